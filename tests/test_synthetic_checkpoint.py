"""The bench's synthetic checkpoint writer against checkpoints DeepSpeed really trains.

    PYTHONPATH=$PWD python -m pytest -q tests/test_synthetic_checkpoint.py      # about a minute

bench/synthetic_checkpoint.py writes the checkpoints DeepSpeed cannot train here (N = 256
ranks, 10 GB). It is only worth its figures if its files are DeepSpeed's: for the same bench
model at the same N, a one-step checkpoint trained with real DeepSpeed (bench/make_checkpoint.py)
and the synthetic one must have the same file names and modes and the same unpickled trees
(keys, types, every metadata value, tensor shapes, dtypes, strides, storage sizes and which
tensors share a storage), and DeepSpeed's plain load_checkpoint at N ranks and its own
zero_to_fp32 must read back exactly the known state. Cases: ZeRO-2 and ZeRO-3 at N = 2
(SYNTHETIC_ALSO_N4=1 adds N = 4); the model has odd sizes so that both padding rules show.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench"
sys.path.insert(0, str(BENCH))

from make_checkpoint import ensure_checkpoint  # noqa: E402
from synthetic_checkpoint import MODELS, check_with_zero_to_fp32, write_checkpoint  # noqa: E402

pytestmark = pytest.mark.e2e
CASES = [(2, 2), (3, 2)] + [(stage, 4) for stage in (2, 3) if os.environ.get("SYNTHETIC_ALSO_N4")]
"""(stage, N); SYNTHETIC_ALSO_N4=1 adds N = 4 (two 4-rank trainings: about two minutes more)."""
CLIENT_LOSS = "/'loss'"
"""The only value allowed to differ: make_checkpoint saves the step's real loss as client state."""


def flatten(obj, path: str = "", out: dict | None = None, storages: dict | None = None) -> dict:
    """path -> what a loader sees there: container type and keys, value, or tensor geometry and storage."""
    if out is None:
        out, storages = {}, {}
    if isinstance(obj, dict):
        out[path] = (type(obj).__name__, [repr(k) for k in obj], repr(getattr(obj, "_metadata", None)))
        for key, value in obj.items():
            flatten(value, f"{path}/{key!r}", out, storages)
    elif isinstance(obj, (list, tuple)) and not isinstance(obj, torch.Size):
        out[path] = (type(obj).__name__, len(obj))
        for i, value in enumerate(obj):
            flatten(value, f"{path}[{i}]", out, storages)
    elif isinstance(obj, torch.Tensor):
        storage = obj.untyped_storage()
        shared = storages.setdefault(storage._cdata if storage.nbytes() else path, len(storages))
        out[path] = ("tensor", tuple(obj.shape), str(obj.dtype), obj.requires_grad, obj.stride(),
                     obj.storage_offset(), storage.nbytes(), shared)
    elif hasattr(obj, "__dict__") and not isinstance(obj, type):
        out[path] = (f"{type(obj).__module__}.{type(obj).__qualname__}", repr(vars(obj)))
    else:
        out[path] = (type(obj).__name__, repr(obj))
    return out


def file_listing(save_dir: Path) -> dict:
    return {str(p.relative_to(save_dir)): (p.is_dir(), p.stat().st_mode & 0o777)
            for p in sorted(save_dir.rglob("*"))}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(stage, n) -> (trained save dir, synthetic save dir), made once."""
    root = tmp_path_factory.mktemp("synthetic")
    made = {}

    def get(stage: int, n: int) -> tuple[Path, Path]:
        if (stage, n) not in made:
            meta = ensure_checkpoint(MODELS["tiny"], stage, n, str(root / "trained"), log=lambda *_: None)
            synthetic = root / f"synthetic-z{stage}-n{n}"
            write_checkpoint(str(synthetic), MODELS["tiny"], stage, n, seed=3)
            made[stage, n] = Path(meta["save_dir"]), synthetic
        return made[stage, n]
    return get


@pytest.mark.parametrize("stage,n", CASES)
def test_files_and_trees_are_deepspeeds(checkpoints, stage, n):
    trained, synthetic = checkpoints(stage, n)
    assert file_listing(synthetic) == file_listing(trained)
    assert (synthetic / "latest").read_bytes() == (trained / "latest").read_bytes()
    for script in ("zero_to_fp32.py", "zero_to_torch.py"):
        assert (synthetic / script).read_bytes() == (trained / script).read_bytes()
    tag = (trained / "latest").read_text()
    names = sorted(p.name for p in (trained / tag).iterdir())
    assert len(names) == n + (n if stage == 3 else 1)
    for name in names:
        ours, theirs = synthetic / tag / name, trained / tag / name
        assert torch.serialization.get_unsafe_globals_in_checkpoint(ours) == \
            torch.serialization.get_unsafe_globals_in_checkpoint(theirs), name
        mine = flatten(torch.load(ours, map_location="meta", weights_only=False))
        real = flatten(torch.load(theirs, map_location="meta", weights_only=False))
        differ = {path for path in mine.keys() | real.keys() if mine.get(path) != real.get(path)}
        expected = {CLIENT_LOSS} if "model_states" in name else set()
        assert differ == expected, f"{name}: " + "; ".join(f"{p}: ours {mine.get(p)} vs DeepSpeed's {real.get(p)}"
                                                            for p in sorted(differ - expected)[:5])


@pytest.mark.parametrize("stage,n", CASES)
def test_deepspeed_loads_the_known_state(checkpoints, stage, n, tmp_path):
    _, synthetic = checkpoints(stage, n)
    from reshard_proof.launch import run_torchrun
    verdict = tmp_path / "verdict.json"
    # n ranks without torchrun's agent (reshard_proof.launch.RANKS_WITHOUT_AGENT); raises with the
    # output's tail should the job fail
    run_torchrun(BENCH / "synthetic_load_check.py", n, [synthetic, "--model", "tiny", "--stage", stage, "--seed", 3,
                                                        "--verdict", verdict], timeout=300, expect_files=[verdict])
    result = json.loads(verdict.read_text())
    assert result["mismatches"] == [] and result["ranks"] == n
    # 27 trainable params x (fp32, exp_avg, exp_avg_sq [, ZeRO-2 module weight]) + the frozen one
    assert result["checked"] == 27 * (4 if stage == 2 else 3) + 1


@pytest.mark.parametrize("stage,n", CASES)
def test_zero_to_fp32_reads_the_known_state(checkpoints, stage, n):
    _, synthetic = checkpoints(stage, n)
    assert check_with_zero_to_fp32(str(synthetic), MODELS["tiny"], 3, stage) == []
    wrong = check_with_zero_to_fp32(str(synthetic), MODELS["tiny"], 4, stage)  # another seed: the check can fail
    assert len(wrong) == 28, wrong  # 27 trainable parameters and the frozen position embedding
