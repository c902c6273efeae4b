"""Bad input and failures: a clear message naming the file, a non-zero exit, the source untouched,
and no output that looks complete. Then: resume after a crash, verify, locking.

    python -m pytest tests/test_bad_input.py -q

Every case starts from a real DeepSpeed checkpoint (trained once per session) copied to a
temporary directory; the copy is damaged the way the case needs, hashed before and after. The
damaged-file and bad-option refusals run reshard.cli.main in this process (the message and the
files are the point); the other cases run `python -m reshard` or torchrun.
"""
from __future__ import annotations

import argparse
import errno
import filecmp
import json
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest
import torch
from trained import reshard_cli, reshard_in_process, reshard_in_threads, reshard_with_torchrun, tree_state

from reshard.files.byte_io import hash_file

pytestmark = [pytest.mark.e2e, pytest.mark.trains(("z2_fp32", 2), ("z2_fp32", 3), ("z2_fp32", 2, 2))]

VARIANT, N = "z2_fp32", 2


def _hashes(root: Path) -> dict:
    return {p.relative_to(root): hash_file(str(p)) for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def source(trained, tmp_path):
    """A private copy of a real 2-rank ZeRO-2 checkpoint: (save_dir, tag_dir)."""
    original, _ = trained(VARIANT, N)
    copy = tmp_path / "src"
    shutil.copytree(original, copy)
    tag = (copy / "latest").read_text().strip()
    shutil.copytree(copy / tag, tmp_path / "sibling" / tag)  # what a stray path would hit first
    return copy, copy / tag


def _refused(result: subprocess.CompletedProcess, *fragments: str) -> str:
    assert result.returncode == 2, result.stdout + result.stderr
    message = result.stderr
    assert message.startswith("reshard: error: "), message
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    assert "Traceback" not in message
    return message


def _no_output(dst: Path) -> None:
    assert not (dst / "latest").exists()
    if dst.exists():
        assert not [p for p in dst.rglob("*.pt") if ".reshard-staging" not in str(p)]


def _edit(path: Path, change) -> None:
    state = torch.load(path, map_location="cpu", weights_only=False)
    change(state)
    torch.save(state, path)


@pytest.mark.parametrize("case", ["no-latest", "missing-tag", "latest-names-missing-tag", "missing-rank",
                                  "extra-rank", "truncated", "empty", "not-torch", "state-size",
                                  "other-world-size", "other-save", "unsafe-class", "model-missing"])
def test_bad_source_is_refused_clearly(source, trained, tmp_path, case):
    save_dir, tag_dir = source
    optim1 = tag_dir / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    args = [save_dir, tmp_path / "dst", "--target-dp", "3"]
    if case == "no-latest":
        (save_dir / "latest").unlink()
        expected = [str(save_dir / "latest"), "--tag", tag_dir.name]
    elif case == "missing-tag":
        args += ["--tag", "global_step999"]
        expected = [str(save_dir / "global_step999"), "does not exist"]
    elif case == "latest-names-missing-tag":
        (save_dir / "latest").write_text("global_step42")
        expected = [str(save_dir / "global_step42"), "latest"]
    elif case == "missing-rank":
        optim1.unlink()
        expected = [str(optim1), "missing", "dp_world_size is 2"]
    elif case == "extra-rank":
        shutil.copy(optim1, tag_dir / "zero_pp_rank_2_mp_rank_00_optim_states.pt")
        expected = ["zero_pp_rank_2_mp_rank_00_optim_states.pt", "should not exist"]
    elif case == "truncated":
        data = optim1.read_bytes()
        optim1.write_bytes(data[: len(data) * 2 // 3])
        expected = [str(optim1), "truncated"]
    elif case == "empty":
        optim1.write_bytes(b"")
        expected = [str(optim1), "empty"]
    elif case == "not-torch":
        optim1.write_text("this is not a checkpoint\n")
        expected = [str(optim1), "not"]
    elif case == "state-size":
        def shorten(state):
            group = state["optimizer_state_dict"]["base_optimizer_state"]["state"][0]
            group["exp_avg"] = group["exp_avg"][:-1].clone()
        _edit(optim1, shorten)
        expected = [str(optim1), "exp_avg", "shape"]
    elif case == "other-world-size":
        other, _ = trained(VARIANT, 3)
        other_tag = other / (other / "latest").read_text().strip()
        shutil.copy(other_tag / optim1.name, optim1)
        expected = [str(optim1), "partition_count"]
    elif case == "other-save":  # same shapes, another save of the same run (2 steps instead of 3)
        other, _ = trained(VARIANT, N, steps=2)
        shutil.copy(other / (other / "latest").read_text().strip() / optim1.name, optim1)
        expected = [str(optim1), "step", "different checkpoints"]
    elif case == "unsafe-class":
        model = tag_dir / "mp_rank_00_model_states.pt"
        _edit(model, lambda state: state.update(extra=argparse.Namespace(note="runs code on load")))
        expected = [str(model), "argparse.Namespace", "--trust-pickle"]
    elif case == "model-missing":
        (tag_dir / "mp_rank_00_model_states.pt").unlink()
        expected = ["mp_rank_00_model_states.pt", "missing"]
    before, outside = _hashes(save_dir), tree_state(tmp_path, skip=tmp_path / "dst")
    _refused(reshard_in_process(*args), *expected)
    assert _hashes(save_dir) == before
    assert tree_state(tmp_path, skip=tmp_path / "dst") == outside, "something outside DST changed or appeared"
    _no_output(tmp_path / "dst")


def test_trust_pickle_accepts_and_carries_a_foreign_class(source, tmp_path):
    save_dir, tag_dir = source
    model = tag_dir / "mp_rank_00_model_states.pt"
    _edit(model, lambda state: state.update(extra=argparse.Namespace(note="kept")))
    result = reshard_cli(save_dir, tmp_path / "dst", "--target-dp", "3", "--trust-pickle", "--quiet")
    assert result.returncode == 0, result.stderr
    out = torch.load(tmp_path / "dst" / tag_dir.name / model.name, weights_only=False)
    assert out["extra"] == argparse.Namespace(note="kept")


@pytest.mark.parametrize("case", ["zero", "negative", "dst-is-src", "dst-inside-src", "src-inside-dst",
                                  "dst-not-empty", "dst-is-file", "dst-unwritable"])
def test_bad_options_are_refused_clearly(source, tmp_path, case):
    save_dir, _ = source
    dst, target = tmp_path / "dst", "3"
    if case == "zero":
        target, expected = "0", ["--target-dp", ">= 1"]
    elif case == "negative":
        target, expected = "-2", ["--target-dp"]
    elif case == "dst-is-src":
        dst, expected = save_dir, ["is the source"]
    elif case == "dst-inside-src":
        dst, expected = save_dir / "resharded", ["inside the source"]
    elif case == "src-inside-dst":
        dst, expected = tmp_path, ["contains the source"]
    elif case == "dst-not-empty":
        dst.mkdir()
        (dst / "notes.txt").write_text("keep me")
        expected = [str(dst), "not empty", "--overwrite"]
    elif case == "dst-is-file":
        dst.write_text("a file")
        expected = [str(dst), "not a directory"]
    elif case == "dst-unwritable":
        dst, expected = Path("/proc/reshard-test/dst"), ["/proc/reshard-test/dst"]
    before, outside = _hashes(save_dir), tree_state(tmp_path, skip=dst)
    _refused(reshard_in_process(save_dir, dst, "--target-dp", target), *expected)
    assert _hashes(save_dir) == before
    assert tree_state(tmp_path, skip=dst) == outside, "something outside DST changed or appeared"
    if case == "dst-not-empty":
        assert (dst / "notes.txt").read_text() == "keep me" and not (dst / "latest").exists()
        ok = reshard_cli(save_dir, dst, "--target-dp", target, "--overwrite", "--quiet")
        assert ok.returncode == 0, ok.stderr
        assert (dst / "notes.txt").read_text() == "keep me" and (dst / "latest").exists()


def test_batch_config_that_cannot_run_at_the_target_size_is_explained(source, tmp_path):
    save_dir, tag_dir = source

    def fixed_batch(state):
        state["ds_config"]["train_batch_size"] = 8
        state["ds_config"]["gradient_accumulation_steps"] = 2
    _edit(tag_dir / "mp_rank_00_model_states.pt", fixed_batch)
    message = _refused(reshard_cli(save_dir, tmp_path / "dst", "--target-dp", "3"),
                       "train_batch_size 8", "3", "--ignore-batch-config")
    assert "Traceback" not in message
    ok = reshard_cli(save_dir, tmp_path / "dst", "--target-dp", "3", "--ignore-batch-config", "--quiet")
    assert ok.returncode == 0, ok.stderr
    ok2 = reshard_cli(save_dir, tmp_path / "dst2", "--target-dp", "2", "--quiet")  # 8 = micro x 2 x 2: fine
    assert ok2.returncode == 0, ok2.stderr


def test_disk_full_mid_write_then_resume_is_byte_identical(source, tmp_path, monkeypatch):
    """ENOSPC injected into the writes of the exchange; freeing space and re-running resumes."""
    save_dir, tag_dir = source
    reference = tmp_path / "reference"
    reshard_in_threads(save_dir, reference, 3, 2, memory_budget=2048)
    before = _hashes(save_dir)

    import reshard.formats.torch_bytes.torch_archive as archive
    real_pwritev, written = os.pwritev, {"bytes": 0}

    def filling_disk(fd, buffers, offset):
        written["bytes"] += sum(len(b) for b in buffers)
        if written["bytes"] > 1500:  # about half of what this reshard writes through pwrite
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_pwritev(fd, buffers, offset)

    monkeypatch.setattr(archive.os, "pwritev", filling_disk)
    dst = tmp_path / "dst"
    from reshard.errors import ReshardError
    with pytest.raises(ReshardError) as failure:
        reshard_in_threads(save_dir, dst, 3, 2, memory_budget=2048, durable_every=1024)
    message = str(failure.value)
    assert os.strerror(errno.ENOSPC) in message and str(dst / ".reshard-staging" / tag_dir.name) in message
    assert "re-run" in message
    monkeypatch.setattr(archive.os, "pwritev", real_pwritev)
    _no_output(dst)
    assert _hashes(save_dir) == before
    assert not (dst / ".reshard.lock").exists()

    result = reshard_in_threads(save_dir, dst, 3, 2, memory_budget=2048, durable_every=1024)
    assert any("resuming" in note for note in result.checkpoints[0].notes), result.checkpoints[0].notes
    names = sorted(p.name for p in (reference / tag_dir.name).iterdir())
    match, mismatch, errors = filecmp.cmpfiles(reference / tag_dir.name, dst / tag_dir.name, names, shallow=False)
    assert mismatch == [] and errors == [] and match == names


def test_worker_killed_mid_exchange_then_resume(source, tmp_path):
    """SIGKILL one of two torchrun workers in round 3: the job fails fast, DST has no checkpoint,
    and the same command then finishes with output identical to an uninterrupted run."""
    save_dir, tag_dir = source
    reference, dst = tmp_path / "reference", tmp_path / "dst"
    reshard_with_torchrun(save_dir, reference, 3, 2, "--memory-budget", "2K")
    started = time.monotonic()
    from reshard_proof.launch import TorchrunError
    durable = ("--memory-budget", "2K", "--durable-every", "1K")  # a resume point every round or two
    with pytest.raises(TorchrunError):
        reshard_with_torchrun(save_dir, dst, 3, 2, *durable, "--timeout", "60",
                              env={"RESHARD_FAILPOINTS": "kill@round=3,worker=1"})
    assert time.monotonic() - started < 120, "the surviving worker must not hang"
    _no_output(dst)
    journal = json.loads((dst / ".reshard-staging" / tag_dir.name / ".reshard-journal.json").read_text())
    assert journal["skeletons"] is True and 1 <= journal["rounds_done"] <= 3  # killed during round 4
    resumed = reshard_with_torchrun(save_dir, dst, 3, 2, *durable)
    assert f"resuming an interrupted run: {journal['rounds_done']} of" in resumed.stdout, resumed.stdout
    names = sorted(p.name for p in (reference / tag_dir.name).iterdir())
    match, mismatch, errors = filecmp.cmpfiles(reference / tag_dir.name, dst / tag_dir.name, names, shallow=False)
    assert mismatch == [] and errors == [] and match == names
    assert not (dst / ".reshard-staging").exists()


def test_second_job_on_the_same_destination_is_refused(source, tmp_path):
    save_dir, _ = source
    dst = tmp_path / "dst"
    dst.mkdir()
    holder = subprocess.Popen(["sleep", "60"])
    try:
        (dst / ".reshard.lock").write_text(json.dumps({"host": socket.gethostname(), "pid": holder.pid,
                                                       "started": "2026-01-01T00:00:00"}))
        _refused(reshard_cli(save_dir, dst, "--target-dp", "3"), "another reshard job", str(holder.pid))
    finally:
        holder.kill()
        holder.wait()
    result = reshard_cli(save_dir, dst, "--target-dp", "3", "--quiet")  # holder is gone: stale lock
    assert result.returncode == 0, result.stderr
    assert "stale lock" in result.stdout and str(holder.pid) in result.stdout
    assert not (dst / ".reshard.lock").exists()


def test_verify_finds_a_changed_element(source, tmp_path):
    save_dir, tag_dir = source
    dst = tmp_path / "dst"
    reshard_in_threads(save_dir, dst, 3, 2)
    assert reshard_cli("verify", dst).returncode == 0
    assert reshard_cli("verify", dst, "--against", save_dir).returncode == 0
    from reshard.formats.torch_bytes.torch_archive import load_structure, portable
    target = dst / tag_dir.name / "zero_pp_rank_2_mp_rank_00_optim_states.pt"
    exp_avg = portable(load_structure(target, trust_pickle=True))["optimizer_state_dict"][
        "base_optimizer_state"]["state"][0]["exp_avg"]
    where = exp_avg.byte_offset + 3 * exp_avg.itemsize
    with open(target, "r+b") as fd:  # flip one bit of exp_avg element 3, in place
        fd.seek(where)
        byte = fd.read(1)
        fd.seek(where)
        fd.write(bytes([byte[0] ^ 0x40]))
    by_hash = reshard_cli("verify", dst)
    assert by_hash.returncode == 1 and target.name in by_hash.stdout
    logical = reshard_cli("verify", dst, "--against", save_dir)
    assert logical.returncode == 1, logical.stdout + logical.stderr
    assert "exp_avg of flat buffer 0: 1 of" in logical.stdout and target.name in logical.stdout


def test_rerunning_a_finished_job_changes_nothing(source, tmp_path):
    save_dir, tag_dir = source
    dst = tmp_path / "dst"
    first = reshard_cli(save_dir, dst, "--target-dp", "3", "--quiet")
    assert first.returncode == 0, first.stderr
    before = {p: p.stat().st_mtime_ns for p in dst.rglob("*") if p.is_file()}
    again = reshard_cli(save_dir, dst, "--target-dp", "3", "--quiet")
    assert again.returncode == 0 and "already holds this output" in again.stdout, again.stdout + again.stderr
    assert {p: p.stat().st_mtime_ns for p in dst.rglob("*") if p.is_file()} == before
    other = reshard_cli(save_dir, dst, "--target-dp", "2")  # another output into the same place: refused
    _refused(other, str(dst), "not empty")
