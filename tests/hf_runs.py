"""Hugging Face Trainer / Accelerate runs for the tests, trained once per session on CPU ranks.

    def test_something(hf_trained):
        output_dir = hf_trained("z2")        # Trainer, ZeRO-2 fp32, 2 ranks: checkpoint-3, checkpoint-6,
                                             # truth-3.pt, truth-6.pt
        report = run_entry("hf_trainer.py", 3, "resume", out, "--stage", "2", "--from", ..., report=path)

The `hf_trained` fixture lives in conftest.py. Entry scripts are in tests/entry/ (hf_trainer.py,
hf_accelerate.py); each writes a JSON report on rank 0, which is what a run is judged by.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from reshard_proof.launch import child_env

REPO = Path(__file__).resolve().parents[1]
ENTRY = Path(__file__).resolve().parent / "entry"
RUNS = {"z2": ("hf_trainer.py", ["--stage", "2"]), "z3_bf16": ("hf_trainer.py", ["--stage", "3", "--bf16"]),
        "accelerate_z3": ("hf_accelerate.py", ["--stage", "3"])}


def run_entry(script: str, nproc: int, *args, expect: Path | None = None, timeout: float = 600) -> None:
    """torchrun --standalone the entry script; retried once when it died at exit after writing `expect`."""
    env = child_env()  # the entry scripts import reshard_proof (tests/)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               str(ENTRY / script), *map(str, args)]
    for attempt in (1, 2):
        if expect is not None:
            expect.unlink(missing_ok=True)
        result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO)
        if result.returncode == 0:
            return
        if attempt == 1 and expect is not None and expect.is_file():
            continue
        raise AssertionError(f"{' '.join(command)} failed:\n{(result.stdout + result.stderr)[-4000:]}")


def read_report(path: Path) -> dict:
    return json.loads(path.read_text())


class HfRuns:
    """run name -> directory of a finished 2-rank run, trained on first use."""

    def __init__(self, root: Path):
        self.root, self.cache = root, {}

    def __call__(self, name: str) -> Path:
        if name not in self.cache:
            script, options = RUNS[name]
            out = self.root / name
            if script == "hf_trainer.py":
                run_entry(script, 2, "train", out, *options, expect=out / "truth-6.pt")
            else:
                out.mkdir(parents=True)
                run_entry(script, 2, "train", out / "state", *options, "--truth", out / "truth.pt",
                          expect=out / "truth.pt")
            self.cache[name] = out
        return self.cache[name]
