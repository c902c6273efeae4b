"""Variants trained one after another in one launch write what a launch of their own writes.

    python -m pytest -q tests/test_trained_together.py       # 3 training launches at 2 ranks

`trained.prepare` (tests/trained.py) trains many variants of one N in one launch
(reshard_proof.train --also), each in a fresh engine. Two things a ZeRO-3 engine leaves in the
process would change a later engine's files, so build_engine undoes them: torch.nn.functional.linear
patched (undo_zero3_linear_patch; a ZeRO-1/2 bf16 engine then trains on other values) and the
process-wide parameter id counter (restart_zero3_param_ids; the optimizer files save the `ds_id`s).
A Ulysses engine leaves its sp mpu in DeepSpeed's groups (forget_sequence_parallel_mpu); an
engine with ZeRO-Offload is in the shared launch too.

The comparison is byte for byte, record by record of every torch archive, with one exception:
the tensor records of ZeRO-3 optimizer files. Their flat fp32 groups end in padding DeepSpeed
allocates with torch.empty, so two separate launches differ there too (2 of 130 elements of rank 1,
values like 1.8e+28 against 0.0). For those files the pickles (every id, shape and offset) must
still match byte for byte, and the truth file (every unpadded value, compared bit for bit by
reshard_proof.bitwise) must be byte-identical.
"""
from __future__ import annotations

import zipfile
from pathlib import Path

import pytest
from trained import tree_files

from reshard_proof.launch import train_checkpoint, train_checkpoints

pytestmark = pytest.mark.e2e


def _padding_records(name: str, record: str) -> bool:
    """Tensor storages of a ZeRO-3 optimizer file: end in uninitialized padding (see the docstring)."""
    return name.endswith("optim_states.pt") and "/data/" in record and not record.endswith("data.pkl")


def _differences(alone: Path, together: Path, zero3: bool) -> list[str]:
    alone_files, together_files = tree_files(alone), tree_files(together)
    if sorted(alone_files) != sorted(together_files):
        return [f"files: {sorted(alone_files)} != {sorted(together_files)}"]
    found = []
    for name, data in alone_files.items():
        if data == together_files[name]:
            continue
        if not name.endswith(".pt"):
            found.append(name)
            continue
        first, second = zipfile.ZipFile(alone / name), zipfile.ZipFile(together / name)
        for record in first.namelist():
            if record.endswith("serialization_id") or (zero3 and _padding_records(name, record)):
                continue  # serialization_id hashes the records, so it differs whenever padding does
            if record not in second.namelist() or first.read(record) != second.read(record):
                found.append(f"{name}: {record}")
    return found


def test_variants_trained_in_one_launch_write_the_files_of_their_own_launch(tmp_path):
    # ZeRO-3 first, so that both ZeRO-1/2 and a second ZeRO-3 engine come after one; then a Ulysses
    # engine, whose sp mpu DeepSpeed keeps in its groups for the rest of the process
    # (engine_setup.forget_sequence_parallel_mpu), and a ZeRO-3 engine with CPU offload
    order = [("z3_fp32", False), ("ulysses_z2", False), ("z3_offload", False), ("z2_bf16", True), ("z3_bf16", True)]
    jobs = [(variant, tmp_path / "together" / variant / "ckpt", tmp_path / "together" / variant / "truth.pt")
            for variant, _ in order]
    train_checkpoints(2, jobs)
    for (variant, compared), (_, save_dir, truth) in zip(order, jobs):
        if not compared:
            continue
        alone = tmp_path / "alone" / variant
        train_checkpoint(variant, 2, alone / "ckpt", alone / "truth.pt")
        assert (alone / "truth.pt").read_bytes() == truth.read_bytes(), variant
        assert _differences(alone / "ckpt", save_dir, variant.startswith("z3")) == [], variant
