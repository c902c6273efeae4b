"""The writer's torch-free casts give torch's bytes: `python -m pytest -q tests/test_float_casts.py`.

Every 16-bit pattern (all float16 and bfloat16 values, NaNs and denormals included), and float32
values chosen where rounding is decided (ties, the largest finite values, denormals, infinities,
NaNs of every sign and payload kind) plus random bit patterns, cast by reshard.formats.torch_bytes.float_casts and by
torch's `Tensor.to` on this CPU, compared bit for bit.
"""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from reshard.formats.torch_bytes.float_casts import ITEMSIZE, cast_bytes

TORCH = {"float64": torch.float64, "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
UNSIGNED = {8: np.uint64, 4: np.uint32, 2: np.uint16}


def _float32_cases() -> np.ndarray:
    rng = np.random.default_rng(0)
    special = [0x00000000, 0x80000000, 0x00000001, 0x80000001, 0x007FFFFF, 0x00800000, 0x7F7FFFFF, 0xFF7FFFFF,
               0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FA00000, 0x7FFFFFFF,
               0xFFFFFFFF, 0x7F8FFFFF, 0x3F800000, 0x477FE000, 0x477FF000, 0x477FEFFF, 0x47800000, 0x33800000,
               0x33000000, 0x33000001, 0x387FC000, 0x38800000]
    # bfloat16 and float16 ties and their neighbours, at even and odd kept bits
    ties = [(hi << 16) | lo for hi in (0x3F80, 0x3F81, 0x7F7F, 0x0001, 0x8000, 0xC2A5)
            for lo in (0x7FFF, 0x8000, 0x8001, 0xFFFF, 0x0000)]
    half_ties = [0x3F800000 | m for m in (0x1000, 0x3000, 0x0FFF, 0x1001, 0x2000, 0x6000)]
    randoms = rng.integers(0, 1 << 32, size=200_000, dtype=np.uint64).astype(np.uint32)
    return np.concatenate([np.array(special + ties + half_ties, dtype=np.uint32), randoms])


def _cases(dtype: str) -> np.ndarray:
    if ITEMSIZE[dtype] == 2:
        return np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    if dtype == "float32":
        return _float32_cases()
    rng = np.random.default_rng(1)
    wide = rng.integers(0, 1 << 63, size=50_000, dtype=np.uint64) | (rng.integers(0, 2, 50_000, dtype=np.uint64) << 63)
    with np.errstate(invalid="ignore"):
        widened = _float32_cases().view(np.float32).astype(np.float64)[:50_000]
    values = np.concatenate([wide.view(np.float64), widened,
                             np.array([np.inf, -np.inf, np.nan, -np.nan, 3.4028235677973366e38, 1e-46, 5e-324])])
    return values.view(np.uint64)


@pytest.mark.parametrize("source,target", [p for p in itertools.permutations(ITEMSIZE, 2)]
                         + [(d, d) for d in ITEMSIZE])
def test_cast_matches_torch_bit_for_bit(source, target):
    bits = _cases(source)
    ours = cast_bytes(memoryview(bits.tobytes()), source, target).view(UNSIGNED[ITEMSIZE[target]])
    theirs = torch.from_numpy(bits.view(np.uint8).copy()).view(TORCH[source]).to(TORCH[target])
    theirs = theirs.view(torch.uint8).numpy().view(UNSIGNED[ITEMSIZE[target]])
    differ = np.flatnonzero(ours != theirs)
    assert len(ours) == len(bits) and differ.size == 0, \
        [(hex(int(bits[i])), hex(int(ours[i])), hex(int(theirs[i]))) for i in differ[:8]]


def test_a_slice_cast_alone_is_the_same_as_cast_whole():
    """The writer casts each arriving slice on its own: no dependence on length or alignment."""
    values = _float32_cases()[:1001].tobytes()
    whole = cast_bytes(values, "float32", "bfloat16")
    parts = [cast_bytes(memoryview(values)[a:b], "float32", "bfloat16") for a, b in ((0, 4), (4, 1000), (1000, 4004))]
    assert np.array_equal(np.concatenate(parts), whole)
