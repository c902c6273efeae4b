"""`python -m reshard --workers W` without torch, and its fallback: `python -m pytest -q tests/test_torch_free.py`.

Fast cases on the bench's synthetic ZeRO-3 checkpoint (bench/synthetic_checkpoint.py,
whose files tests/test_synthetic_checkpoint.py holds to DeepSpeed's): the command's imports pull
no torch; a forked run never imports torch in any process (a `torch` that refuses to import
comes first on the path); a run whose files must be read with torch (`--trust-pickle`: real
classes, as torch.load gives them) falls back to torch and says so; and every way gives the same
bytes as today's gloo workers (`--transport torch`). The pinned real checkpoints run the same
way in tests/test_output_pinned.py.
"""
from __future__ import annotations

import filecmp
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

from synthetic_checkpoint import MODELS, write_checkpoint  # noqa: E402

# every test runs `python -m reshard` (and its forked workers) as a new process
pytestmark = pytest.mark.e2e

TORCH_FREE = "  io     : torch-free (no worker imported torch)"


def _run(*args, blocked: Path | None = None, **environment) -> subprocess.CompletedProcess:
    path = [str(blocked)] if blocked is not None else []
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path + [str(REPO)]), **environment)
    return subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, env=env, cwd=REPO,
                          timeout=300)


@pytest.fixture(scope="module")
def no_torch(tmp_path_factory) -> Path:
    """A directory whose `torch` package refuses to be imported, naming the process and where from."""
    root = tmp_path_factory.mktemp("no-torch")
    (root / "torch").mkdir()
    (root / "torch" / "__init__.py").write_text(textwrap.dedent("""\
        import os, traceback
        traceback.print_stack()
        raise ImportError(f"torch imported by process {os.getpid()} of a torch-free run")
    """))
    return root


def test_the_command_imports_no_torch(no_torch):
    done = _run("-c", "import sys, reshard.cli, reshard.jobs.collective_job, reshard.local_workers, reshard.transport.forked; "
                      "print('torch' in sys.modules)", blocked=no_torch)
    assert done.returncode == 0 and done.stdout.strip() == "False", done.stderr


def _same_files(a: Path, b: Path) -> None:
    tag = (a / "latest").read_text()
    names = sorted(os.listdir(a / tag))
    assert names == sorted(os.listdir(b / tag)) and "reshard_manifest.json" in names
    match, mismatch, errors = filecmp.cmpfiles(a / tag, b / tag, names, shallow=False)
    assert mismatch == [] and errors == [], mismatch


def test_forked_workers_without_torch_with_its_fallback_and_over_gloo_write_the_same_bytes(no_torch, tmp_path):
    source = tmp_path / "src"  # ZeRO-3: optimizer and model-states files per rank, both rebuilt
    write_checkpoint(str(source), MODELS["tiny"], 3, 2)
    job = ["-m", "reshard", source, None, "--target-dp", "3", "--workers", "2", "--memory-budget", "4K", "--quiet"]

    def run(name: str, *extra: str, blocked: Path | None = None) -> subprocess.CompletedProcess:
        args = [tmp_path / name if a is None else a for a in job]
        done = _run(*args, *extra, blocked=blocked)
        assert done.returncode == 0, done.stdout + done.stderr
        return done

    free = run("free", blocked=no_torch)
    assert TORCH_FREE in free.stdout.splitlines() and "torch imported" not in free.stderr
    trusted = run("trusted", "--trust-pickle")  # torch.load reads: the torch path, for both workers
    io = [line for line in trusted.stdout.splitlines() if line.startswith("  io     : ")]
    assert io and io[0].startswith("  io     : torch (imported by worker(s) 0, 1): ") and "--trust-pickle" in io[0], io
    gloo = run("gloo", "--transport", "torch")
    assert "over torch.distributed/gloo" in gloo.stdout
    for other in ("trusted", "gloo"):
        _same_files(tmp_path / "free", tmp_path / other)


@pytest.mark.parametrize("failure", ["kill", "stall"])
def test_a_forked_worker_that_dies_or_hangs_fails_the_command_and_leaves_no_process(tmp_path, failure):
    """Worker 1 killed (SIGKILL) or hanging at round 3: worker 0 names it (at once, or after
    --timeout), the command exits 1, no worker process is left behind, and nothing is published."""
    source = tmp_path / "src"
    write_checkpoint(str(source), MODELS["tiny"], 2, 2)
    done = _run("-m", "reshard", source, tmp_path / "dst", "--target-dp", "3", "--workers", "2", "--memory-budget",
                "4K", "--quiet", "--timeout", "2", RESHARD_FAILPOINTS=f"{failure}@round=3,worker=1")
    assert done.returncode == 1, done.stdout + done.stderr
    expected = "worker 1 exited or died during a round" if failure == "kill" else \
        "waited more than 2s for worker(s) 1"
    assert "reshard: error: worker 0: " in done.stderr and expected in done.stderr, done.stderr
    assert not (tmp_path / "dst" / "latest").exists()
    left = subprocess.run(["pgrep", "-f", str(tmp_path / "dst")], capture_output=True, text=True)
    assert left.stdout == "", left.stdout
