"""Paths the user names: `--result-json` never lands in SRC or DST, and relative SRC, DST and OUT work.

    python -m pytest -q tests/test_output_paths.py -m "not e2e"   # in this process, ~20 s
    python -m pytest -q tests/test_output_paths.py                # + --workers, torchrun (~30 s more)

The source is bench/synthetic_checkpoint.py's tiny ZeRO-2 save at 2 ranks (written in-process,
no training; its files are DeepSpeed's, tests/test_synthetic_checkpoint.py). Each command runs
from the directory holding it, with relative paths only, as `cd /ckpt && reshard src dst ...`.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import pytest
from trained import REPO, reshard_in_process

sys.path.insert(0, str(REPO / "bench"))
from synthetic_checkpoint import MODELS, write_checkpoint  # noqa: E402

TAG = "global_step1"


@pytest.fixture(scope="module")
def zero2_source(tmp_path_factory) -> Path:
    source = tmp_path_factory.mktemp("source") / "src"
    write_checkpoint(str(source), MODELS["tiny"], 2, 2)
    return source


@pytest.fixture
def workdir(tmp_path, zero2_source, monkeypatch) -> Path:
    """A working directory holding `src` (a copy of the synthetic save), the command's cwd."""
    import shutil
    shutil.copytree(zero2_source, tmp_path / "src", symlinks=True)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _digests(directory: Path) -> dict:
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(directory.rglob("*"))}


# -- --result-json ----------------------------------------------------------------------------

REFUSED = {
    "source-latest": ("src/latest", "lies inside SRC"),
    "source-file": (f"src/{TAG}/mp_rank_00_model_states.pt", "lies inside SRC"),
    "source-through-dots": ("dst/../src/new.json", "lies inside SRC"),
    "destination-latest": ("dst/latest", "lies inside DST"),
    "destination-itself": ("dst", "lies inside DST"),
    "link-into-source": ("link.json", "lies inside SRC"),
    "link-dir-into-source": ("linkdir/x.json", "lies inside SRC"),
    "a-directory": ("elsewhere", "is a directory"),
    "no-parent": ("missing/r.json", "cannot be created"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_result_json_inside_src_or_dst_is_refused_before_anything_is_written(workdir, case):
    """exit 2 naming --result-json, the path and why; SRC byte for byte unchanged, no DST written,
    and no refusal record written there either. On main each of the SRC cases exited 0 with the
    source file replaced by JSON, and dst/latest held JSON."""
    path, why = REFUSED[case]
    os.symlink(f"src/{TAG}/mp_rank_00_model_states.pt", "link.json")
    os.symlink("src", "linkdir")
    os.mkdir("elsewhere")
    before = _digests(workdir / "src")
    done = reshard_in_process("src", "dst", "--target-dp", "3", "--quiet", "--result-json", path)
    assert done.returncode == 2, done.stdout + done.stderr
    message = done.stdout + done.stderr
    assert f"--result-json {path}: {why}" in message, message
    assert _digests(workdir / "src") == before
    assert not (workdir / "dst" / "latest").exists()
    assert not (workdir / "dst").exists() or os.listdir(workdir / "dst") == []


def test_result_json_that_is_the_job_file_is_refused(workdir):
    (workdir / "job.yaml").write_text("source: src\ndestination: dst\ntarget_dp: 3\nresult_json: job.yaml\n")
    before = (workdir / "job.yaml").read_bytes()
    done = reshard_in_process("--config", "job.yaml", "--quiet")
    assert done.returncode == 2, done.stdout + done.stderr
    assert "--result-json job.yaml: is job.yaml, a file reshard reads" in done.stdout + done.stderr
    assert (workdir / "job.yaml").read_bytes() == before and not (workdir / "dst").exists()


def test_result_json_replaces_a_link_outside_without_writing_through_it(workdir):
    """A relative --result-json outside SRC and DST is written whole; a link already at that name
    (pointing outside SRC and DST) is replaced by the record, its target left as it was."""
    (workdir / "victim.txt").write_text("keep me")
    os.symlink("victim.txt", "result.json")
    done = reshard_in_process("src", "dst", "--target-dp", "3", "--quiet", "--result-json", "result.json")
    assert done.returncode == 0, done.stdout + done.stderr
    assert not os.path.islink("result.json") and json.loads(Path("result.json").read_text())["checkpoints"]
    assert (workdir / "victim.txt").read_text() == "keep me"
    assert [n for n in os.listdir(workdir) if n.startswith(".result.json.")] == []  # no temporary left


# -- relative SRC, DST and OUT ----------------------------------------------------------------

def test_every_subcommand_takes_relative_paths(workdir):
    """reshard, export (safetensors, universal), verify (by hashes, --against), inspect and the
    SLURM array mode (both tasks, then publish), all from the save's parent with relative paths.
    On main, `export src out --format safetensors` failed publishing ("refusing to write outside
    the destination out"), and its re-run failed on the staging it left."""
    def ok(*args):
        done = reshard_in_process(*args)
        assert done.returncode == 0, (args, done.stdout + done.stderr)
        return done

    ok("src", "dst", "--target-dp", "3", "--quiet")
    assert (workdir / "dst" / "latest").read_text() == TAG
    ok("verify", "dst")
    ok("verify", "dst", "--against", "src")
    assert "ZeRO" in ok("inspect", "src").stdout
    ok("export", "src", "out", "--format", "safetensors")
    assert sorted(os.listdir("out")) == ["model-00001-of-00001.safetensors", "model.safetensors.index.json"]
    ok("export", "src", "universal", "--format", "universal")
    assert (workdir / "universal" / "latest_universal").read_text() == TAG
    for task in (0, 1):
        ok("src", "array", "--target-dp", "3", "--array-task", str(task), "--array-tasks", "2", "--quiet")
    assert (workdir / "array" / "latest").read_text() == TAG
    ok("publish", "array")  # nothing left to publish: says so, exit 0
    assert _digests(workdir / "array" / TAG) == _digests(workdir / "dst" / TAG)


def test_a_refused_relative_export_is_resumed_by_the_same_command(workdir, monkeypatch):
    """A publish refused before any file moved (here: its first check raises, as the relative OUT
    once did) keeps the journal, so the same command resumes and publishes."""
    from reshard.errors import OptionError
    from reshard.jobs import destination

    real, refused = destination.confined, []

    def refuse_once(root, path):  # the first check of the index's place in OUT: publishing's first
        if os.path.basename(path) == "model.safetensors.index.json" and os.path.dirname(path) == root and not refused:
            refused.append(path)
            raise OptionError(f"{path}: refused for the test")
        return real(root, path)

    monkeypatch.setattr(destination, "confined", refuse_once)
    first = reshard_in_process("export", "src", "out", "--format", "safetensors")
    assert first.returncode == 2 and "refused for the test" in first.stdout + first.stderr, first
    monkeypatch.setattr(destination, "confined", real)
    again = reshard_in_process("export", "src", "out", "--format", "safetensors")
    assert again.returncode == 0, again.stdout + again.stderr
    assert sorted(os.listdir("out")) == ["model-00001-of-00001.safetensors", "model.safetensors.index.json"]


def test_a_publish_that_failed_moving_files_says_how_to_recover(workdir, monkeypatch):
    """A rename failing once publishing moves files (the journal is gone by then): the message
    says files may be in OUT and how to recover, not "re-run to resume"; doing what it says works."""
    import shutil

    real, failed = os.replace, []

    def fail_first_move(src, dst, *args, **kwargs):
        if str(dst).endswith(".safetensors") and not failed:
            failed.append(dst)
            raise OSError(5, "Input/output error", str(dst))
        return real(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", fail_first_move)
    first = reshard_in_process("export", "src", "out", "--format", "safetensors")
    monkeypatch.setattr(os, "replace", real)
    message = first.stdout + first.stderr
    assert first.returncode == 2 and "Publishing had begun" in message and "to resume" not in message, message
    staging = workdir / "out" / ".reshard-staging" / TAG
    assert f"rm -rf {staging}" in message
    shutil.rmtree(staging)
    again = reshard_in_process("export", "src", "out", "--format", "safetensors", "--overwrite")
    assert again.returncode == 0, again.stdout + again.stderr
    assert sorted(os.listdir("out")) == ["model-00001-of-00001.safetensors", "model.safetensors.index.json"]


@pytest.mark.e2e
def test_launchers_take_relative_paths(workdir):
    """`--workers 2` and `torchrun --nproc_per_node=2`, relative SRC and DST, from SRC's parent:
    the same bytes as one worker."""
    import shutil
    import subprocess

    from reshard_proof.launch import child_env

    def run(*command: str) -> None:
        for attempt in (1, 2):  # DESIGN 4: about one launch in seventy aborts at teardown; retried once
            done = subprocess.run([sys.executable, *command], capture_output=True, text=True, env=child_env(),
                                  cwd=workdir, timeout=300)
            if done.returncode == 0:
                return
            shutil.rmtree(workdir / command[-4], ignore_errors=True)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    run("-m", "reshard", "--workers", "2", "src", "forked", "--target-dp", "3", "--quiet")
    run("-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "reshard",
        "src", "torchrun", "--target-dp", "3", "--quiet")
    assert reshard_in_process("src", "one", "--target-dp", "3", "--quiet").returncode == 0
    for name in ("forked", "torchrun"):
        assert _digests(workdir / name / TAG) == _digests(workdir / "one" / TAG), name
