"""Floating-point casts of raw little-endian bytes, bit-identical to torch's CPU `Tensor.to`, without torch.

    from reshard.formats.torch_bytes.float_casts import cast_bytes
    out = cast_bytes(memoryview(fp32_bytes), "float32", "bfloat16")   # a uint8 numpy array, 2 bytes per element

The writer casts where a file stores another dtype than the exchange delivers (a ZeRO stage
change writes module weights from the fp32 masters; see reshard.formats.deepspeed_files.stage_change), as DeepSpeed
does with `copy_` into its low-precision parameters: round to nearest, ties to even. numpy has
no bfloat16, so bfloat16 is handled on its bit patterns; float16 goes through numpy's own
conversion (IEEE round to nearest even, denormals included) with NaNs fixed up as torch makes
them. What torch 2.13 gives on x86 CPUs (checked element by element, every 16-bit pattern and
the float32 ties, infinities, denormals and NaNs, in tests/test_float_casts.py):

- float32 -> bfloat16: `c10::round_to_nearest_even` (c10/util/BFloat16.h): add 0x7FFF plus the
  lowest kept bit, keep the high half. A NaN becomes 0xFFFF: ATen's vectorised `cvtfp32_bf16`
  (aten/src/ATen/cpu/vec/vec512/vec512_bfloat16.h) blends in that constant, whatever the sign
  or payload, and torch takes that path for tensors of any length.
- float32 -> float16: IEEE round to nearest even (F16C `vcvtps2ph`); a NaN keeps its sign and
  the top 10 payload bits and is made quiet (0x7E00 set).
- bfloat16 -> float32: exact, the bits shifted (a NaN keeps its bits, signalling or not).
- float16 -> float32: exact; a NaN is made quiet (0x7FC00000 set), sign and payload kept.
- float64 <-> float32: numpy's conversion, which is the C cast torch also uses.
- bfloat16 <-> float16: through float32, as torch converts them (c10 `static_cast<float>`);
  float16 -> bfloat16 then rounds with c10's scalar `round_to_nearest_even`, whose NaN is 0x7FC0.
"""
from __future__ import annotations

import numpy as np

ITEMSIZE = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2}
"""The dtypes cast here, by their torch names (those the torch archive records)."""


def can_cast(source: str, target: str) -> bool:
    return source in ITEMSIZE and target in ITEMSIZE


def _bfloat16_to_float32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _float32_to_bfloat16(values: np.ndarray, nan: int = 0xFFFF) -> np.ndarray:
    bits = values.view(np.uint32)
    rounded = ((bits + (((bits >> 16) & 1) + 0x7FFF)) >> 16).astype(np.uint16)
    rounded[np.isnan(values)] = nan
    return rounded


def _float16_to_float32(bits: np.ndarray) -> np.ndarray:
    wide = bits.view(np.float16).astype(np.float32).view(np.uint32)
    nan = np.isnan(bits.view(np.float16))
    if nan.any():
        half = bits[nan].astype(np.uint32)
        wide[nan] = ((half & 0x8000) << 16) | 0x7FC00000 | ((half & 0x03FF) << 13)
    return wide.view(np.float32)


def _float32_to_float16(values: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        half = values.astype(np.float16).view(np.uint16)
    nan = np.isnan(values)
    if nan.any():
        bits = values.view(np.uint32)[nan]
        half[nan] = (((bits >> 16) & 0x8000) | 0x7E00 | ((bits & 0x007FFFFF) >> 13)).astype(np.uint16)
    return half


def _to_float32(raw: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "float32":
        return raw.view(np.float32)
    if dtype == "float64":
        with np.errstate(over="ignore", invalid="ignore"):
            return raw.view(np.float64).astype(np.float32)
    if dtype == "bfloat16":
        return _bfloat16_to_float32(raw.view(np.uint16))
    return _float16_to_float32(raw.view(np.uint16))


def cast_bytes(data, source: str, target: str) -> np.ndarray:
    """`data` (the bytes of `source` elements) as `target` elements: a new uint8 array."""
    if not can_cast(source, target):
        raise ValueError(f"no cast from {source} to {target}")
    raw = np.frombuffer(data, dtype=np.uint8)
    if source == target:
        return raw.copy()
    values = _to_float32(raw, source)
    if target == "float64":
        with np.errstate(invalid="ignore"):
            return values.astype(np.float64).view(np.uint8)
    if target == "bfloat16":  # float16 -> bfloat16 goes through c10's scalar rounding: NaN is 0x7FC0
        return _float32_to_bfloat16(values, 0x7FC0 if source == "float16" else 0xFFFF).view(np.uint8)
    if target == "float16":
        return _float32_to_float16(values).view(np.uint8)
    return values.view(np.uint8)
