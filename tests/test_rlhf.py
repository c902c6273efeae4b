"""RLHF: an actor (ZeRO-3, bf16) and a critic (ZeRO-2, fp32) saved at 2 ranks, resumed at 3 and 1.

    python -m pytest tests/test_rlhf.py -q -s        # -s prints the timing of both paths

Uses launch/examples/ppo_actor_critic.py: it trains with real DeepSpeed, saves OpenRLHF-style
(CKPT/_actor, CKPT/_critic, two global_step tags, a best_ tag, metric.json), records the truth of
both engines and their client_state, and on resume compares everything bit for bit, then runs
more PPO iterations. The offline and the in-job resume at 3 ranks share one launch
(tests/entry/ppo_resumes.py runs the example's own resume for each).
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from reshard_proof.launch import TorchrunError, run_torchrun
from trained import REPO, reshard_in_threads, reshard_with_torchrun, tree_files

pytestmark = pytest.mark.e2e
EXAMPLE = REPO / "launch" / "examples" / "ppo_actor_critic.py"
RESUMES = REPO / "tests" / "entry" / "ppo_resumes.py"  # several of its resumes in one launch
KL_INIT = 0.2


def _launch(nproc: int, script: Path, *args, expected: Path | None = None, timeout: float = 600) -> None:
    """`script` as an nproc-rank job (reshard_proof.launch.run_torchrun: ranks started without torchrun's
    agent, RANKS_WITHOUT_AGENT; the example judges itself with reshard_proof, which child_env puts on
    PYTHONPATH); one retry for the rare abort at process exit, judged by `expected`. A failure raises
    AssertionError with the tail of the output."""
    try:
        run_torchrun(script, nproc, args, timeout=timeout, expect_files=[expected] if expected is not None else [])
    except TorchrunError as error:
        raise AssertionError(str(error)) from None


def _example(nproc: int, *args, timeout: float = 600) -> None:
    expected = Path(args[args.index("--report") + 1]) if "--report" in args else None
    _launch(nproc, EXAMPLE, *args, expected=expected, timeout=timeout)


@pytest.fixture(scope="module")
def ppo_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("ppo")
    ckpt, truth = root / "ckpt", root / "truth.pt"
    _example(2, "train", "--ckpt", ckpt, "--iterations", 3, "--truth", truth)
    return ckpt, truth


def _resumed(report: Path) -> dict:
    data = json.loads(report.read_text())
    assert data["mismatches"] == [], data["mismatches"]
    assert data["checked_tensors"] > 40  # both engines: masters, optimizer states, module values, ...
    assert data["kl_coef_restored"] == data["kl_coef_saved"] != KL_INIT
    assert data["finite"] and len(data["continued"]) == 2
    assert data["continued"][0]["iteration"] == 4  # the PPO iteration counter continues
    return data


@pytest.fixture(scope="module")
def resumed_at_3(ppo_run, tmp_path_factory):
    """The whole run resharded offline to 3 (torchrun -m reshard, 2 workers, --all-tags), then resumed at 3
    ranks from that output and, in-job, from the run as saved: both resumes in one launch
    (tests/entry/ppo_resumes.py); should it fail, each in a launch of its own (a missing report then
    fails its own test). {"destination", "reshard_seconds", "offline": report path, "in_job": report path}"""
    ckpt, truth = ppo_run
    root = tmp_path_factory.mktemp("ppo-at-3")
    destination = root / "ckpt-dp3"
    started = time.perf_counter()
    reshard_with_torchrun(ckpt, destination, 3, 2, "--all-tags")
    found = {"destination": destination, "reshard_seconds": time.perf_counter() - started,
             "offline": root / "offline.json", "in_job": root / "in-job.json"}
    jobs = [{"ckpt": str(destination), "in_job": False, "iterations": 2, "truth": str(truth),
             "report": str(found["offline"])},
            {"ckpt": str(ckpt), "in_job": True, "iterations": 2, "truth": str(truth), "report": str(found["in_job"])}]
    jobs_file = root / "jobs.json"
    jobs_file.write_text(json.dumps(jobs))
    try:
        _launch(3, RESUMES, jobs_file, expected=found["in_job"])
    except AssertionError as error:
        print(f"[rlhf] the shared resume launch at 3 ranks failed, one launch each: {error}", flush=True)
        for job in jobs:
            try:
                _example(3, "resume", "--ckpt", job["ckpt"], *(["--in-job"] if job["in_job"] else []),
                         "--iterations", 2, "--truth", truth, "--report", job["report"])
            except AssertionError as alone:
                print(f"[rlhf] {job['report']}: {alone}", flush=True)
    return found


def test_offline_reshard_of_the_whole_run(ppo_run, resumed_at_3):
    ckpt, _ = ppo_run
    destination = resumed_at_3["destination"]
    for engine in ("_actor", "_critic"):
        source_tags = sorted(p.name for p in (ckpt / engine).iterdir() if p.is_dir())
        assert sorted(p.name for p in (destination / engine).iterdir() if p.is_dir()) == source_tags
        assert (destination / engine / "latest").read_text() == (ckpt / engine / "latest").read_text()
        for tag in source_tags:
            if (ckpt / engine / tag / "metric.json").exists():
                assert (destination / engine / tag / "metric.json").read_bytes() == \
                       (ckpt / engine / tag / "metric.json").read_bytes()
    data = _resumed(resumed_at_3["offline"])
    assert not data["in_job"] and data["world_size"] == 3
    print(f"\noffline: reshard (torchrun, 2 workers, 6 checkpoints) {resumed_at_3['reshard_seconds']:.2f} s wall "
          f"incl. start-up, then native load of both engines at 3 ranks {data['load_seconds']:.3f} s")


@pytest.mark.parametrize("m", [3, 1])
def test_in_job_resume(request, ppo_run, tmp_path, m):
    ckpt, truth = ppo_run
    if m == 3:  # in the launch it shares with the offline resume at 3
        report = request.getfixturevalue("resumed_at_3")["in_job"]
    else:
        report = tmp_path / "report.json"
        _example(m, "resume", "--ckpt", ckpt, "--in-job", "--iterations", 2, "--truth", truth, "--report", report)
    data = _resumed(report)
    assert data["in_job"] and data["world_size"] == m
    assert not list(ckpt.rglob("*reshard*")), "in-job resharding must not write into the source"
    print(f"\nin-job at {m} ranks: both engines resharded and loaded in {data['load_seconds']:.3f} s")


def test_array_tasks_convert_the_whole_run(ppo_run, tmp_path):
    """SLURM array mode over the run directory: 2 tasks share 6 checkpoints' files (actor and critic,
    every tag), run out of order; the result equals the collective job's byte for byte."""
    from reshard.jobs.collective_job import run_job
    from reshard.jobs.options import ReshardOptions
    ckpt, _ = ppo_run
    expected = tmp_path / "collective"
    reshard_in_threads(ckpt, expected, 3, 2, all_tags=True)
    destination = tmp_path / "array"
    written = []
    for task in (1, 0):
        result = run_job(ReshardOptions(source=str(ckpt), destination=str(destination), target_dp=3, all_tags=True,
                                        array_task=task, array_tasks=2, quiet=True).validate())
        assert len(result.checkpoints) == 6
        written.append(sum(c.bytes_written for c in result.checkpoints))
        if task == 1:
            assert not (destination / "_actor" / "latest").exists() and not (destination / "_critic" / "latest").exists()
    assert all(written), written
    assert tree_files(destination) == tree_files(expected)
