"""Every torch file reshard fills in after its skeleton is a valid zip, byte for byte torch.save's.

    python -m pytest -q tests/test_zip_crc.py          # single process, threads only, ~15 s

A skeleton (reshard's torch-free writer, or torch.save under `skip_data`) records CRC 0 for its
storage records; reshard fills the data in later, so torch_zip.seal_crcs must give each record
its real CRC-32 and `.data/serialization_id` the value torch derives from them. Checked three
ways: crc32_combine and the windowed CRC against zlib.crc32 of the whole (hypothesis); a filled
skeleton sealed against torch.save of the same object; and the files a reshard (ZeRO-2 and
ZeRO-3, workers as threads) and a universal export write, against `zipfile.testzip()` and
against `torch.save(torch.load(file))` written under the same name. `unzip -t` says the same
by hand (`unzip -tq DST/TAG/*.pt`); the suite uses zipfile so that it never skips.
"""
from __future__ import annotations

import os
import sys
import zipfile
import zlib
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from threaded_transport import run_workers
from trained import reshard_in_threads
from zip_records import rewritten_by_torch

from reshard.formats.deepspeed_files import deepspeed_classes as classes
from reshard.formats.torch_bytes import torch_zip
from reshard.formats.torch_bytes.torch_archive import NewTensor, write_tree_skeleton

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from synthetic_checkpoint import MODELS, write_checkpoint  # noqa: E402


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300), st.binary(max_size=300), st.integers(0, 3))
def test_crc32_combine_is_the_crc_of_the_concatenation(a, b, extra_zeros):
    b = b + bytes(extra_zeros * 1000)  # long runs too: every bit of len2 takes part
    assert torch_zip.crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)


@settings(max_examples=60, deadline=None)
@given(data=st.binary(min_size=1, max_size=5000), start=st.integers(0, 4999), window=st.integers(1, 700),
       threads=st.booleans())
def test_crc_of_a_range_in_windows_is_zlibs(tmp_path_factory, data, start, window, threads):
    """Windows of any size, computed in threads or not, combine to zlib.crc32 of the range."""
    from concurrent.futures import ThreadPoolExecutor

    start = start % len(data)
    path = tmp_path_factory.mktemp("crc") / "bytes"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        with ThreadPoolExecutor(2) as pool:
            got = torch_zip.crc32_of_range(fd, start, len(data) - start, pool if threads else None, window)
    finally:
        os.close(fd)
    assert got == zlib.crc32(data[start:])


def _objects():
    base = torch.arange(24, dtype=torch.float32)
    scaler = classes.DynamicLossScaler()
    scaler.__dict__.update(cur_scale=65536.0, dtype=torch.float16, cur_iter=3)
    return {
        "mixed": {"w": torch.randn(5, 7), "slice": base[2:8], "again": [base, base], "empty": torch.empty(0),
                  "bf16": torch.randn(9).to(torch.bfloat16), "n": 3, "scaler": scaler},
        "one": torch.tensor(1.5),
        "none": {"a": [1, "b"]},
    }


@pytest.mark.parametrize("case", list(_objects()))
def test_a_filled_skeleton_sealed_is_what_torch_save_writes(tmp_path, case):
    """torch.save under skip_data, its holes filled with the data, then sealed: torch.save's bytes."""
    obj = _objects()[case]
    for name in ("real", "skeleton"):
        (tmp_path / name).mkdir()
    real, skeleton = tmp_path / "real" / "f.pt", tmp_path / "skeleton" / "f.pt"
    torch.save(obj, real, pickle_module=classes)
    with torch.serialization.skip_data():
        torch.save(obj, skeleton, pickle_module=classes)
    with torch_zip.ArchiveReader(str(real)) as full, torch_zip.ArchiveReader(str(skeleton)) as holes:
        fd = os.open(skeleton, os.O_RDWR)
        try:
            for name in full.infos:
                if name.startswith("data/"):
                    os.pwrite(fd, full.read(name), holes.offset(name))
        finally:
            os.close(fd)
    storages = sum(name.startswith("data/") and size > 0 for name, size in
                   ((n, r.file_size) for n, r in torch_zip.ArchiveReader(str(real)).infos.items()))
    # each storage record, and .data/serialization_id, whose value torch derives from their CRCs
    assert torch_zip.seal_crcs(skeleton) == (storages + 1 if storages else 0)
    assert skeleton.read_bytes() == real.read_bytes()
    assert torch_zip.seal_crcs(skeleton) == 0  # sealing again writes nothing
    assert zipfile.ZipFile(skeleton).testzip() is None


def test_the_torch_free_writer_sealed_is_what_torch_save_writes(tmp_path):
    """reshard's own skeleton writer (no torch), filled at its offsets and sealed, against torch.save."""
    values = {("m", 1): torch.randn(11), ("m", 2): torch.arange(6, dtype=torch.int64)}
    tree = {"a": NewTensor(("m", 1), 11, "float32"), "b": [NewTensor(("m", 2), 6, "int64"), "x"],
            "tied": NewTensor(("m", 1), 11, "float32")}
    for name in ("real", "pure"):
        (tmp_path / name).mkdir()
    real, pure = tmp_path / "real" / "t.pt", tmp_path / "pure" / "t.pt"
    offsets = write_tree_skeleton(str(pure), tree, classes.safe_globals())
    fd = os.open(pure, os.O_RDWR)
    try:
        for slot, at in offsets.items():
            os.pwrite(fd, values[slot].numpy().tobytes(), at)
    finally:
        os.close(fd)
    torch_zip.seal_crcs(pure)
    torch.save({"a": values[("m", 1)], "b": [values[("m", 2)], "x"], "tied": values[("m", 1)]}, real)
    assert pure.read_bytes() == real.read_bytes()


def assert_torch_save_bytes(directory: Path) -> int:
    """Every .pt file under `directory` passes zipfile's CRC check, and is byte for byte what
    torch's own zip writer writes for its records (zip_records.rewritten_by_torch, under the same
    name) and what torch.save writes for its content (saved again from torch.load); returns how many."""
    files = sorted(directory.rglob("*.pt"))
    for path in files:
        assert zipfile.ZipFile(path).testzip() is None, f"{path}: bad CRC-32"
        again = directory.parent / "by_torch" / path.relative_to(directory)
        again.parent.mkdir(parents=True, exist_ok=True)
        assert rewritten_by_torch(path, again) == path.read_bytes(), f"{path}: not what torch's zip writer writes"
        torch.save(torch.load(path, weights_only=False), again)
        assert again.read_bytes() == path.read_bytes(), f"{path}: not what torch.save writes for its content"
    return len(files)


@pytest.mark.parametrize("stage", [2, 3])
def test_every_file_a_reshard_writes_is_a_valid_zip(tmp_path, stage):
    """A synthetic ZeRO-2 / ZeRO-3 save at 2 ranks resharded to 3 by two workers (threads):
    every target file, model and optimizer states, is a valid zip and torch.save's bytes.
    Fails before torch_zip.seal_crcs: the storage records carried CRC 0."""
    write_checkpoint(str(tmp_path / "src"), MODELS["tiny"], stage, 2)
    reshard_in_threads(tmp_path / "src", tmp_path / "dst", 3, 2, memory_budget=4 << 10)
    tag = (tmp_path / "dst" / "latest").read_text()
    assert assert_torch_save_bytes(tmp_path / "dst" / tag) == (4 if stage == 2 else 6)


def test_every_file_a_universal_export_writes_is_a_valid_zip(tmp_path):
    """The per-parameter state files a universal export reserves and fills (and the files it
    torch.saves or copies beside them), by two workers (threads)."""
    from reshard.export import export_universal

    write_checkpoint(str(tmp_path / "src"), MODELS["tiny"], 2, 2)
    run_workers(2, lambda t: export_universal(str(tmp_path / "src"), str(tmp_path / "out"), memory_budget=4 << 10,
                                              transport=t))
    tag = (tmp_path / "out" / "latest_universal").read_text()
    assert assert_torch_save_bytes(tmp_path / "out" / tag) > 10
