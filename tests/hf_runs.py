"""Hugging Face Trainer / Accelerate runs for the tests, trained once per session on CPU ranks.

    def test_something(hf_trained):
        output_dir = hf_trained("z2")        # Trainer, ZeRO-2 fp32, 2 ranks: checkpoint-3, checkpoint-6,
                                             # truth-3.pt, truth-6.pt ("z2_fp16": the same in
                                             # fp16; "z1_tp2": ZeRO-1 with AutoTP at tp 2, dp 1)
        report = run_entry("hf_trainer.py", 3, "resume", out, "--stage", "2", "--from", ..., report=path)

The `hf_trained` fixture lives in conftest.py. Entry scripts are in tests/entry/ (hf_trainer.py,
hf_accelerate.py); each writes a JSON report on rank 0, which is what a run is judged by.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from reshard_proof.launch import TorchrunError, run_torchrun

ENTRY = Path(__file__).resolve().parent / "entry"
RUNS = {"z2": ("hf_trainer.py", ["--stage", "2"]), "z3_bf16": ("hf_trainer.py", ["--stage", "3", "--bf16"]),
        "z2_fp16": ("hf_trainer.py", ["--stage", "2", "--fp16"]),
        "z1_tp2": ("hf_trainer.py", ["--stage", "1", "--autotp", "2"]),
        "accelerate_z3": ("hf_accelerate.py", ["--stage", "3"])}
ALONE = {"z1_tp2"}
"""Runs trained in a launch of their own, on first use. DeepSpeed AutoTP in the Trainer: as a job of the
shared launch, after three Trainer runs (Accelerate's state reset between them), its two TP ranks were
given different rows ("Data inconsistency within the TP group", deepspeed engine.py
`check_dataloader_inputs_same_across_ranks`; the cause is not pinned down); alone it trains."""


def run_entry(script: str, nproc: int, *args, expect: Path | None = None, timeout: float = 600) -> None:
    """The entry script as an nproc-rank job (reshard_proof.launch.run_torchrun: its ranks started
    without torchrun's agent, RANKS_WITHOUT_AGENT); retried once when it died at exit after writing
    `expect`. A failure raises AssertionError with the tail of the output."""
    try:
        run_torchrun(ENTRY / script, nproc, args, timeout=timeout, expect_files=[expect] if expect is not None else [])
    except TorchrunError as error:
        raise AssertionError(str(error)) from None


def read_report(path: Path) -> dict:
    return json.loads(path.read_text())


class HfRuns:
    """run name -> directory of a finished 2-rank run. The first use trains every run of RUNS in one
    launch (tests/entry/hf_trainer.py jobs: the Trainer runs, then the Accelerate loop), since starting
    torch, DeepSpeed and transformers on each rank costs more than a run's 6 steps; each run's truth is
    recorded in that same process, from its own engine. Should that launch fail, each run is trained in a
    launch of its own. A run of ALONE is trained alone when first asked for."""

    def __init__(self, root: Path):
        self.root, self.cache = root, {}

    def _paths(self, name: str) -> tuple[Path, Path]:
        """(directory returned, file that shows the run finished)."""
        out = self.root / name
        return out, (out / "truth-6.pt" if RUNS[name][0] == "hf_trainer.py" else out / "truth.pt")

    def _train_alone(self, name: str) -> None:
        script, options = RUNS[name]
        out, done = self._paths(name)
        if script == "hf_trainer.py":
            run_entry(script, 2, "train", out, *options, expect=done)
        else:
            out.mkdir(parents=True, exist_ok=True)
            run_entry(script, 2, "train", out / "state", *options, "--truth", done, expect=done)

    def _train_all(self) -> None:
        jobs = []
        shared = {name: run for name, run in RUNS.items() if name not in ALONE}
        for name, (script, options) in shared.items():  # Trainer runs first: Accelerate's switch is an env variable
            out, done = self._paths(name)
            stage = int(options[options.index("--stage") + 1])
            if script == "hf_trainer.py":
                jobs.append({"mode": "train", "out": str(out), "stage": stage, "bf16": "--bf16" in options,
                             "fp16": "--fp16" in options,
                             "autotp": int(options[options.index("--autotp") + 1]) if "--autotp" in options else 1})
            else:
                out.mkdir(parents=True, exist_ok=True)
                jobs.append({"mode": "train", "kind": "accelerate", "state_dir": str(out / "state"), "stage": stage,
                             "truth": str(done)})
        self.root.mkdir(parents=True, exist_ok=True)
        jobs_file = self.root / "train-jobs.json"
        jobs_file.write_text(json.dumps(jobs))
        try:
            run_entry("hf_trainer.py", 2, "jobs", jobs_file, expect=self._paths(list(shared)[-1])[1])
        except AssertionError as error:
            print(f"[hf_runs] training every run in one launch failed, one launch each: {error}", flush=True)
            for name in shared:
                if not self._paths(name)[1].is_file():
                    shutil.rmtree(self._paths(name)[0], ignore_errors=True)
                    self._train_alone(name)
        for name in shared:
            self.cache[name] = self._paths(name)[0]

    def __call__(self, name: str) -> Path:
        if name in ALONE and name not in self.cache:
            self._train_alone(name)
            self.cache[name] = self._paths(name)[0]
        elif name not in self.cache:
            self._train_all()
        return self.cache[name]
