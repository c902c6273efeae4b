"""Run the proof entry points under torchrun from Python (tests, loops), judging runs by their files.

    python -c "from reshard.proof.launch import train_checkpoint, check_checkpoint as c; \
        train_checkpoint('z2_fp32', 2, '/tmp/ck', '/tmp/ck.truth.pt'); \
        print(c('z2_fp32', 2, '/tmp/ck', '/tmp/ck.truth.pt', '/tmp/v.json')['ok'])"

About one torchrun launch in seventy aborts (SIGABRT) at process teardown after all its work is
done. A run that failed but left every expected file complete is therefore retried once; a run
that failed without its files, or failed twice, raises with the tail of its output.
"""

import json
import os
import subprocess
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
OUTPUT_TAIL_CHARS = 6000


class TorchrunError(RuntimeError):
    """A torchrun launch failed; the message carries the command and the tail of its output."""


def _looks_complete(path: Path) -> bool:
    """Writers here replace files atomically; this also catches files written by other means."""
    if not path.is_file() or path.stat().st_size == 0:
        return False
    try:
        if path.suffix == ".json":
            json.loads(path.read_text())
        elif path.suffix == ".pt":
            torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:
        return False
    return True


def _child_env(env: dict | None) -> dict:
    child = dict(os.environ)
    child.update({"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"})
    # The package may not be installed; make `-m reshard.proof...` importable from any cwd.
    child["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), child.get("PYTHONPATH")]))
    child.update(env or {})
    return child


def run_torchrun(module: str, nproc: int, args: Sequence[str], *, env: dict | None = None, timeout: float = 600,
                 expect_files: Iterable[str | os.PathLike] = ()) -> subprocess.CompletedProcess:
    """`python -m torch.distributed.run --standalone --nproc_per_node=nproc -m module *args`."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               "-m", module, *map(str, args)]
    expected = [Path(path) for path in expect_files]
    for attempt in (1, 2):
        for path in expected:  # stale files from an earlier run must not pass for this one's
            path.unlink(missing_ok=True)
        try:
            result = subprocess.run(command, env=_child_env(env), cwd=REPO_ROOT, capture_output=True, text=True,
                                    timeout=timeout)
        except subprocess.TimeoutExpired as expired:
            output = (expired.stdout or b"").decode(errors="replace") + (expired.stderr or b"").decode(errors="replace")
            raise TorchrunError(f"timed out after {timeout}s: {' '.join(command)}\n{output[-OUTPUT_TAIL_CHARS:]}")
        if result.returncode == 0:
            return result
        output = result.stdout + result.stderr
        died_at_exit = all(_looks_complete(path) for path in expected) and expected
        if died_at_exit and attempt == 1:
            print(f"[proof.launch] {module} exited {result.returncode} after writing its files; retrying once. "
                  f"Output tail:\n{output[-1500:]}", file=sys.stderr, flush=True)
            continue
        missing = [str(path) for path in expected if not _looks_complete(path)]
        raise TorchrunError(f"exit code {result.returncode} (attempt {attempt}); missing or incomplete: {missing}\n"
                            f"command: {' '.join(command)}\n--- output tail ---\n{output[-OUTPUT_TAIL_CHARS:]}")
    raise AssertionError("unreachable")


def train_checkpoint(variant: str, n: int, save_dir, truth_path, *, steps: int = 3, seed: int = 0,
                     tag: str | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """Train `variant` on n ranks, save to save_dir, write the truth to truth_path."""
    args = ["--variant", variant, "--save-dir", save_dir, "--truth", truth_path, "--steps", steps, "--seed", seed]
    if tag is not None:
        args += ["--tag", tag]
    return run_torchrun("reshard.proof.train", n, args, timeout=timeout, expect_files=[truth_path])


def check_checkpoint(variant: str, m: int, load_dir, truth_path, verdict_path, *, seed: int = 1,
                     tag: str | None = None, extra_steps: int = 1, in_job: bool = False,
                     timeout: float = 600) -> dict:
    """Load load_dir on m ranks, judge it against truth_path; returns the parsed verdict.
    in_job: load with reshard.deepspeed.load_checkpoint rather than engine.load_checkpoint."""
    args = ["--variant", variant, "--load-dir", load_dir, "--truth", truth_path, "--verdict", verdict_path,
            "--seed", seed, "--extra-steps", extra_steps]
    if tag is not None:
        args += ["--tag", tag]
    if in_job:
        args.append("--in-job")
    run_torchrun("reshard.proof.check_load", m, args, timeout=timeout, expect_files=[verdict_path])
    with open(verdict_path) as handle:
        return json.load(handle)


def train_moe_checkpoint(variant: str, ep: int, world: int, save_dir, truth_path, *, steps: int = 3,
                         timeout: float = 600) -> subprocess.CompletedProcess:
    """Train the native MoE `variant` on `world` ranks at expert-parallel size `ep` (reshard.proof.moe_run)."""
    args = ["train", "--variant", variant, "--ep", ep, "--save-dir", save_dir, "--truth", truth_path,
            "--steps", steps]
    return run_torchrun("reshard.proof.moe_run", world, args, timeout=timeout, expect_files=[truth_path])


def check_moe_loads(variant: str, ep: int, world: int, truth_path, loads: Sequence[tuple], *,
                    timeout: float = 600) -> list[dict]:
    """Load each (load_dir, verdict_path[, in_job]) in one job of `world` ranks at `ep`; returns the
    verdicts in that order. in_job: load with reshard.deepspeed.load_checkpoint."""
    args = ["check", "--variant", variant, "--ep", ep, "--truth", truth_path]
    for load_dir, verdict_path, *in_job in loads:
        flag = "--in-job-" if in_job and in_job[0] else "--"
        args += [f"{flag}load-dir", load_dir, f"{flag}verdict", verdict_path]
    run_torchrun("reshard.proof.moe_run", world, args, timeout=timeout, expect_files=[load[1] for load in loads])
    verdicts = []
    for _, verdict_path, *_ in loads:
        with open(verdict_path) as handle:
            verdicts.append(json.load(handle))
    return verdicts
