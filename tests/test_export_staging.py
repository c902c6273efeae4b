"""Exports go through the reshard job's lifecycle: staged, published atomically, resumed after a failure.

    PYTHONPATH=$PWD python -m pytest -q tests/test_export_staging.py     # ~1 min (trains once)

A failed export leaves no output that looks real in OUT (no `latest_universal`, no tag
directory, no safetensors index or shards, no DCP `.metadata` or `.distcp` files), only OUT/.reshard-staging/TAG with its journal; the
same command then resumes from the last durable round and writes the same bytes as an
uninterrupted export. A parameter name that would collide with a file the universal format
writes (`zero/optimizer_state.pt`), or that is no plain directory name, is refused before
anything is written.
"""
from __future__ import annotations

import errno
import shutil
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from threaded_transport import run_workers
from trained import tree_files

from reshard.errors import ReshardError, UnsupportedCheckpoint
from reshard.export import export_dcp, export_safetensors, export_universal
from reshard.export.dcp_job import DcpWriter
from reshard.export.safetensors_writer import SafetensorsWriter
from reshard.export.universal import UniversalWriter

VARIANT, N = "z2_fp32", 2
# the checkpoints its tests ask `trained` for, trained with the session's others (conftest.py)
pytestmark = [pytest.mark.e2e, pytest.mark.trains((VARIANT, N))]
BUDGET = 1 << 10  # many rounds on the tiny checkpoint
EXPORTS = {
    "universal": (export_universal, UniversalWriter, {}),
    "safetensors": (export_safetensors, SafetensorsWriter, {"max_shard_size": "1KB"}),
    "dcp": (export_dcp, DcpWriter, {"chunk_bytes": 64}),
    "dcp_accelerate": (export_dcp, DcpWriter, {"chunk_bytes": 64, "layout": "accelerate"}),  # files in sub-directories
}


def _export(kind: str, source, out, workers: int = 2, **options):
    export, _, extra = EXPORTS[kind]
    return run_workers(workers, lambda t: export(str(source), str(out), memory_budget=BUDGET, transport=t,
                                                 **extra, **options))[0]


def _looks_published(out: Path) -> list[str]:
    """What in OUT (outside the staging) a user or a loader could take for an export."""
    return sorted(str(p.relative_to(out)) for p in out.rglob("*")
                  if ".reshard-staging" not in p.parts and p.name != ".reshard.lock")


@pytest.mark.parametrize("kind", sorted(EXPORTS))
def test_a_failed_export_publishes_nothing_and_resumes_byte_identically(trained, tmp_path, monkeypatch, kind):
    source, _ = trained(VARIANT, N)
    tag = (source / "latest").read_text()
    writer = EXPORTS[kind][1]
    real_write, calls = writer.write, {"n": 0, "fail_after": None}

    def disk_fills_up(self, *args):
        calls["n"] += 1
        if calls["fail_after"] is not None and calls["n"] > calls["fail_after"]:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(self, *args)

    monkeypatch.setattr(writer, "write", disk_fills_up)
    reference = tmp_path / "reference"
    _export(kind, source, reference)
    calls["n"], calls["fail_after"] = 0, calls["n"] // 2  # half way through the rounds
    out = tmp_path / "out"
    with pytest.raises(ReshardError) as failure:
        _export(kind, source, out, durable_every=1)
    monkeypatch.setattr(writer, "write", real_write)
    staging = out / ".reshard-staging" / tag
    assert "No space left on device" in str(failure.value) and str(staging) in str(failure.value), failure.value
    assert "re-run the same command to resume" in str(failure.value)
    assert _looks_published(out) == []
    assert (staging / ".reshard-journal.json").is_file() and not (out / ".reshard.lock").exists()

    result = _export(kind, source, out, durable_every=1)
    resumed = [note for note in result.notes if note.startswith("resuming an interrupted export")]
    assert resumed and not resumed[0].startswith("resuming an interrupted export: 0 of"), result.notes
    assert tree_files(out) == tree_files(reference)
    assert not (out / ".reshard-staging").exists() and not (out / ".reshard.lock").exists()
    if kind == "universal":
        assert (out / "latest_universal").read_text() == tag


def _rename_parameter(save_dir: Path, old: str, new: str) -> None:
    """Rename trainable parameter `old` everywhere DeepSpeed names it (module, param_shapes, slice mappings)."""
    tag_dir = save_dir / (save_dir / "latest").read_text()

    def renamed(mapping):
        return OrderedDict((new if key == old else key, value) for key, value in mapping.items())

    for path in sorted(tag_dir.glob("*.pt")):
        state = torch.load(path, map_location="cpu", weights_only=False)
        if "module" in state:
            state["module"] = renamed(state["module"])
            state["param_shapes"] = [renamed(group) for group in state["param_shapes"]]
        else:
            osd = state["optimizer_state_dict"]
            osd["param_slice_mappings"] = [renamed(group) for group in osd["param_slice_mappings"]]
        torch.save(state, path)


@pytest.mark.parametrize("name,reason", [("optimizer_state.pt", "is the name of the file zero/optimizer_state.pt"),
                                         ("..", "is a relative path component")])
def test_a_parameter_name_the_universal_format_cannot_hold_is_refused_before_writing(trained, tmp_path, name,
                                                                                       reason):
    original, _ = trained(VARIANT, N)
    source = tmp_path / "src"
    shutil.copytree(original, source)
    _rename_parameter(source, "gain", name)
    out = tmp_path / "out"
    with pytest.raises(UnsupportedCheckpoint) as refused:
        _export("universal", source, out)
    message = str(refused.value)
    assert f"parameter name {name!r} {reason}" in message and "mp_rank_00_model_states.pt" in message, message
    assert not out.exists() or list(out.rglob("*")) == [], sorted(out.rglob("*"))
