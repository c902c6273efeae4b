"""Hugging Face Trainer and Accelerate runs resumed at a new size, offline and in-job, on CPU ranks.

    python -m pytest -q tests/test_huggingface.py -s      # -s prints wall times

A tiny Llama trained by the Trainer with DeepSpeed (ZeRO-2 fp32, ZeRO-3 bf16) at 2 ranks, saved at
steps 3 and 6 (tests/entry/hf_trainer.py); resumed with `trainer.train(resume_from_checkpoint=...)`
and nothing else, at 3 and at 1 rank: at the first on_step_begin every full fp32 master and Adam
moment equals the 2-rank original's, the step counter and learning rate continue, and training
reaches the next save. The same for an Accelerate save_state / load_state loop (ZeRO-3).
The six resumes (Trainer and Accelerate) run three to a launch, one launch per world size, in a
module fixture (tests/entry/hf_trainer.py jobs).
"""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
from hf_runs import read_report, run_entry
from trained import reshard_in_process, reshard_in_threads, reshard_with_torchrun

from reshard.jobs.save_dir_files import list_save_dir_files

pytestmark = pytest.mark.e2e
STAGE = {"z2": ["--stage", "2"], "z3_bf16": ["--stage", "3", "--bf16"]}


# The six resumes, three per world size, each three in one launch (hf_trainer.py jobs): a Trainer's
# offline resume first, then an in-job one (whose replacement of the Trainer's load is undone after
# it), then the Accelerate loop's load_state.
RESUMES_AT = {3: (("offline", "z2"), ("in_job", "z3_bf16"), ("in_job", "accelerate_z3")),
              1: (("offline", "z3_bf16"), ("in_job", "z2"), ("offline", "accelerate_z3"))}


def _resume_together(nproc: int, jobs: list[dict]) -> None:
    """Every job resumed at nproc ranks in one torchrun launch; should it fail, each in a launch of its own
    (a job whose report is missing then fails its own test through read_report)."""
    jobs_file = Path(jobs[0]["report"]).with_name(f"jobs-{nproc}.json")
    jobs_file.write_text(json.dumps(jobs))
    started = time.perf_counter()
    try:
        run_entry("hf_trainer.py", nproc, "jobs", jobs_file, expect=Path(jobs[-1]["report"]))
    except AssertionError as error:
        print(f"[hf] the shared resume launch at {nproc} ranks failed, one launch each: {error}", flush=True)
        for job in jobs:
            in_job = ["--in-job"] if job["in_job"] else []
            try:
                if job.get("kind") == "accelerate":
                    run_entry("hf_accelerate.py", nproc, "resume", job["state_dir"], "--stage", job["stage"],
                              "--truth", job["truth"], "--report", job["report"], *in_job, expect=Path(job["report"]))
                    continue
                run_entry("hf_trainer.py", nproc, "resume", job["out"], *STAGE["z3_bf16" if job["bf16"] else "z2"],
                          *in_job, "--from", job["source"], "--truth", job["truth"], "--report", job["report"],
                          expect=Path(job["report"]))
            except AssertionError as alone:
                print(f"[hf] {job['report']}: {alone}", flush=True)
    print(f"\n{len(jobs)} resumes at {nproc} rank(s): {time.perf_counter() - started:.1f} s wall "
          f"(one start-up; per resume: load, 3 steps, save)")


@pytest.fixture(scope="module")
def hf_resumes(hf_trained, tmp_path_factory):
    """The offline reshards the resumes read, and the six resumes' reports: {"output_dir", "destination",
    "reshard" (the torchrun result), "z3_dp1", "accelerate_dp1", "reports": {(mode, run, nproc): path}}.
    z2: the whole output_dir (with a user's sub-directory) by torchrun -m reshard to 3; z3_bf16: one
    checkpoint-N directory by two worker threads to 1; Accelerate's state directory by one worker to 1.
    In-job resumes read the 2-rank save as it is."""
    root = tmp_path_factory.mktemp("hf-resumes")
    output_dir = root / "output_dir"
    shutil.copytree(hf_trained("z2"), output_dir)
    (output_dir / "checkpoint-3" / "tokenizer").mkdir()
    (output_dir / "checkpoint-3" / "tokenizer" / "vocab.json").write_text('{"<s>": 0}')
    destination = root / "dp3"
    started = time.perf_counter()
    reshard = reshard_with_torchrun(output_dir, destination, 3, 2)
    print(f"\nreshard of output_dir (2 checkpoints, 2 workers): {time.perf_counter() - started:.1f} s wall")
    z3 = hf_trained("z3_bf16")
    z3_dp1 = root / "z3-checkpoint-3-dp1"
    reshard_in_threads(z3 / "checkpoint-3", z3_dp1, 1, 2)
    sources = {("offline", "z2"): (destination / "checkpoint-3", output_dir / "truth-3.pt"),
               ("offline", "z3_bf16"): (z3_dp1, z3 / "truth-3.pt")}
    for run in ("z2", "z3_bf16"):
        sources[("in_job", run)] = (hf_trained(run) / "checkpoint-3", hf_trained(run) / "truth-3.pt")
    accelerate = hf_trained("accelerate_z3")
    accelerate_dp1 = root / "accelerate-state-dp1"
    reshard_in_threads(accelerate / "state", accelerate_dp1, 1, 1)
    sources[("in_job", "accelerate_z3")] = (accelerate / "state", accelerate / "truth.pt")
    sources[("offline", "accelerate_z3")] = (accelerate_dp1, accelerate / "truth.pt")
    reports = {}
    for nproc, pairs in RESUMES_AT.items():
        jobs = []
        for mode, run in pairs:
            source, truth = sources[(mode, run)]
            report = root / f"report-{mode}-{run}-{nproc}.json"
            reports[(mode, run, nproc)] = report
            if run == "accelerate_z3":
                jobs.append({"mode": "resume", "kind": "accelerate", "state_dir": str(source), "stage": 3, "truth": str(truth),
                             "report": str(report), "in_job": mode == "in_job"})
                continue
            jobs.append({"mode": "resume", "out": str(root / f"resumed-{mode}-{run}-{nproc}"), "stage": 3 if run == "z3_bf16" else 2,
                         "bf16": run == "z3_bf16", "source": str(source), "truth": str(truth), "report": str(report),
                         "in_job": mode == "in_job"})
        _resume_together(nproc, jobs)
    return {"output_dir": output_dir, "destination": destination, "reshard": reshard, "z3_dp1": z3_dp1,
            "accelerate_dp1": accelerate_dp1, "reports": reports}


def _resumed_trainer(hf_resumes, mode: str, run: str, nproc: int) -> dict:
    data = read_report(hf_resumes["reports"][(mode, run, nproc)])
    assert data["mismatches"] == [], data["mismatches"]
    assert data["checked_tensors"] == 63  # 21 parameters x (fp32 master, exp_avg, exp_avg_sq)
    assert data["world_size"] == nproc
    assert data["global_step_at_resume"] == data["truth_global_step"] == 3
    assert data["lr_at_resume"] == data["truth_lr"]
    assert data["final_global_step"] == 6 and data["final_save"] and data["final_loss_finite"]
    return data


def _same_bytes(source_save_dir: Path, destination_save_dir: Path) -> list[str]:
    names = list_save_dir_files(str(source_save_dir))
    assert names, source_save_dir
    for name in names:
        assert (destination_save_dir / name).read_bytes() == (source_save_dir / name).read_bytes(), name
    return names


def test_whole_output_dir_offline_then_trainer_resumes_at_3(hf_resumes):
    """torchrun -m reshard OUTPUT_DIR DST: both checkpoints, every HF file (and a user's sub-directory)
    byte-identical and in the manifest, verify passes; the Trainer resumes from DST/checkpoint-3."""
    output_dir, destination, result = (hf_resumes[k] for k in ("output_dir", "destination", "reshard"))
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

    # the resume (in the fixture) read DST/checkpoint-3 as the reshard wrote it; verify it, then tamper.
    # `reshard verify` through reshard.cli.main in this process (test_bad_input runs it as a process)
    verify = ["verify", destination / "checkpoint-3"]
    assert reshard_in_process(*verify).returncode == 0
    vocab = destination / "checkpoint-3" / "tokenizer" / "vocab.json"
    original_vocab = vocab.read_text()
    vocab.write_text('{"<s>": 1}')
    try:
        failed = reshard_in_process(*verify)
        assert failed.returncode == 1 and "tokenizer/vocab.json" in failed.stdout
        against = reshard_in_process(*verify, "--against", output_dir / "checkpoint-3")
        assert against.returncode == 1 and "vocab.json: content differs" in against.stdout, \
            against.stdout + against.stderr
    finally:
        vocab.write_text(original_vocab)

    _resumed_trainer(hf_resumes, "offline", "z2", 3)


def test_checkpoint_dir_offline_then_trainer_resumes_at_1(hf_trained, hf_resumes):
    """SRC is one checkpoint-N directory (ZeRO-3, bf16); two workers as threads; resume at 1 rank."""
    _same_bytes(hf_trained("z3_bf16") / "checkpoint-3", hf_resumes["z3_dp1"])
    _resumed_trainer(hf_resumes, "offline", "z3_bf16", 1)


@pytest.mark.parametrize("run,nproc", [("z2", 1), ("z3_bf16", 3)])
def test_trainer_resumes_in_job(hf_trained, hf_resumes, run, nproc):
    """enable_resharding(trainer), then train(resume_from_checkpoint=the 2-rank checkpoint as saved)."""
    _resumed_trainer(hf_resumes, "in_job", run, nproc)
    assert not list(hf_trained(run).rglob("*reshard*")), "in-job resharding must not write into the source"


def _resumed_accelerate(hf_resumes, mode: str, nproc: int) -> dict:
    data = read_report(hf_resumes["reports"][(mode, "accelerate_z3", nproc)])
    assert data["mismatches"] == [] and data["checked_tensors"] == 63, data
    assert data["world_size"] == nproc and data["lr_at_resume"] == data["truth_lr"]
    assert data["loss_after_resume"] == data["loss_after_resume"]  # finite: NaN != NaN
    return data


def test_accelerate_load_state_in_job_at_3_and_offline_at_1(hf_trained, hf_resumes):
    run = hf_trained("accelerate_z3")
    _resumed_accelerate(hf_resumes, "in_job", 3)
    names = _same_bytes(run / "state", hf_resumes["accelerate_dp1"])
    assert {"random_states_0.pkl", "random_states_1.pkl", "scheduler.bin"} <= set(names)
    _resumed_accelerate(hf_resumes, "offline", 1)
