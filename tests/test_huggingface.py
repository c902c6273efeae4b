"""Hugging Face Trainer and Accelerate runs resumed at a new size, offline and in-job, on CPU ranks.

    python -m pytest -q tests/test_huggingface.py -s      # -s prints wall times

A tiny Llama trained by the Trainer with DeepSpeed (ZeRO-2 fp32, ZeRO-3 bf16) at 2 ranks, saved at
steps 3 and 6 (tests/entry/hf_trainer.py); resumed with `trainer.train(resume_from_checkpoint=...)`
and nothing else, at 3 and at 1 rank: at the first on_step_begin every full fp32 master and Adam
moment equals the 2-rank original's, the step counter and learning rate continue, and training
reaches the next save. The same for an Accelerate save_state / load_state loop (ZeRO-3).
"""
from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hf_runs import read_report, run_entry
from trained import REPO, reshard_in_threads, reshard_with_torchrun

from reshard.jobs.save_dir_files import list_save_dir_files

pytestmark = pytest.mark.e2e
STAGE = {"z2": ["--stage", "2"], "z3_bf16": ["--stage", "3", "--bf16"]}


def _resume_trainer(run: str, nproc: int, source: Path, truth: Path, tmp_path: Path, *extra: str) -> dict:
    report = tmp_path / f"report-{run}-{nproc}.json"
    started = time.perf_counter()
    run_entry("hf_trainer.py", nproc, "resume", tmp_path / "resumed", *STAGE[run], "--from", source,
              "--truth", truth, "--report", report, *extra, expect=report)
    data = read_report(report)
    assert data["mismatches"] == [], data["mismatches"]
    assert data["checked_tensors"] == 63  # 21 parameters x (fp32 master, exp_avg, exp_avg_sq)
    assert data["world_size"] == nproc
    assert data["global_step_at_resume"] == data["truth_global_step"] == 3
    assert data["lr_at_resume"] == data["truth_lr"]
    assert data["final_global_step"] == 6 and data["final_save"] and data["final_loss_finite"]
    print(f"\n{run} resumed at {nproc} rank(s) {' '.join(extra) or 'offline'}: "
          f"{time.perf_counter() - started:.1f} s wall (start-up, load, 3 steps, save)")
    return data


def _same_bytes(source_save_dir: Path, destination_save_dir: Path) -> list[str]:
    names = list_save_dir_files(str(source_save_dir))
    assert names, source_save_dir
    for name in names:
        assert (destination_save_dir / name).read_bytes() == (source_save_dir / name).read_bytes(), name
    return names


def test_whole_output_dir_offline_then_trainer_resumes_at_3(hf_trained, tmp_path):
    """torchrun -m reshard OUTPUT_DIR DST: both checkpoints, every HF file (and a user's sub-directory)
    byte-identical and in the manifest, verify passes; the Trainer resumes from DST/checkpoint-3."""
    output_dir = tmp_path / "output_dir"
    shutil.copytree(hf_trained("z2"), output_dir)
    (output_dir / "checkpoint-3" / "tokenizer").mkdir()
    (output_dir / "checkpoint-3" / "tokenizer" / "vocab.json").write_text('{"<s>": 0}')
    destination = tmp_path / "dp3"
    started = time.perf_counter()
    result = reshard_with_torchrun(output_dir, destination, 3, 2)
    print(f"\nreshard of output_dir (2 checkpoints, 2 workers): {time.perf_counter() - started:.1f} s wall")
    assert "the global batch size is 4 at 2 ranks and becomes 6 at 3 ranks" in result.stdout
    assert "rank(s) 2 of 3 have no rng_state_{rank}.pth" in result.stdout
    assert "truth-3.pt" in result.stdout  # named as lying outside every save directory
    for checkpoint in ("checkpoint-3", "checkpoint-6"):
        names = _same_bytes(output_dir / checkpoint, destination / checkpoint)
        assert {"trainer_state.json", "rng_state_0.pth", "rng_state_1.pth", "training_args.bin", "config.json",
                "model.safetensors"} <= set(names)
        tag = f"global_step{checkpoint.split('-')[1]}"
        manifest = (destination / checkpoint / tag / "reshard_manifest.json").read_text()
        assert all(f'"../{name}"' in manifest for name in names)
        assert not (destination / checkpoint / "rng_state_2.pth").exists()  # no RNG stream is invented
    assert "tokenizer/vocab.json" in list_save_dir_files(str(output_dir / "checkpoint-3"))

    verify = [sys.executable, "-m", "reshard", "verify", str(destination / "checkpoint-3")]
    assert subprocess.run(verify, cwd=REPO, capture_output=True, text=True).returncode == 0
    (destination / "checkpoint-3" / "tokenizer" / "vocab.json").write_text('{"<s>": 1}')
    failed = subprocess.run(verify, cwd=REPO, capture_output=True, text=True)
    assert failed.returncode == 1 and "tokenizer/vocab.json" in failed.stdout
    against = subprocess.run(verify + ["--against", str(output_dir / "checkpoint-3")], cwd=REPO, capture_output=True,
                             text=True)
    assert against.returncode == 1 and "vocab.json: content differs" in against.stdout, against.stdout + against.stderr
    shutil.copy2(output_dir / "checkpoint-3" / "tokenizer" / "vocab.json",
                 destination / "checkpoint-3" / "tokenizer" / "vocab.json")

    _resume_trainer("z2", 3, destination / "checkpoint-3", output_dir / "truth-3.pt", tmp_path)


def test_checkpoint_dir_offline_then_trainer_resumes_at_1(hf_trained, tmp_path):
    """SRC is one checkpoint-N directory (ZeRO-3, bf16); two workers as threads; resume at 1 rank."""
    run = hf_trained("z3_bf16")
    destination = tmp_path / "checkpoint-3"
    reshard_in_threads(run / "checkpoint-3", destination, 1, 2)
    _same_bytes(run / "checkpoint-3", destination)
    _resume_trainer("z3_bf16", 1, destination, run / "truth-3.pt", tmp_path)


@pytest.mark.parametrize("run,nproc", [("z2", 1), ("z3_bf16", 3)])
def test_trainer_resumes_in_job(hf_trained, tmp_path, run, nproc):
    """enable_resharding(trainer), then train(resume_from_checkpoint=the 2-rank checkpoint as saved)."""
    source = hf_trained(run)
    _resume_trainer(run, nproc, source / "checkpoint-3", source / "truth-3.pt", tmp_path, "--in-job")
    assert not list(source.rglob("*reshard*")), "in-job resharding must not write into the source"


def _resume_accelerate(state: Path, truth: Path, nproc: int, tmp_path: Path, *extra: str) -> dict:
    report = tmp_path / f"accelerate-{nproc}.json"
    started = time.perf_counter()
    run_entry("hf_accelerate.py", nproc, "resume", state, "--stage", "3", "--truth", truth, "--report", report,
              *extra, expect=report)
    data = read_report(report)
    assert data["mismatches"] == [] and data["checked_tensors"] == 63, data
    assert data["world_size"] == nproc and data["lr_at_resume"] == data["truth_lr"]
    assert data["loss_after_resume"] == data["loss_after_resume"]  # finite: NaN != NaN
    print(f"\naccelerate load_state at {nproc} rank(s) {' '.join(extra) or 'offline'}: "
          f"{time.perf_counter() - started:.1f} s wall")
    return data


def test_accelerate_load_state_in_job_at_3_and_offline_at_1(hf_trained, tmp_path):
    run = hf_trained("accelerate_z3")
    _resume_accelerate(run / "state", run / "truth.pt", 3, tmp_path, "--in-job")
    destination = tmp_path / "state-dp1"
    reshard_in_threads(run / "state", destination, 1, 1)
    names = _same_bytes(run / "state", destination)
    assert {"random_states_0.pkl", "random_states_1.pkl", "scheduler.bin"} <= set(names)
    _resume_accelerate(destination, run / "truth.pt", 1, tmp_path)
