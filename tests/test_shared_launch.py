"""judge_in_shared_launches: many jobs share one torchrun launch, and a launch that fails as a whole
is judged again one job per launch, so every job still meets its own verdict or its own error.

    python -m pytest -q tests/test_shared_launch.py        # 5 launches of a few-line module, seconds

Every harness that judges many loads (check_together, judge_folded_together, check_moe_together,
tests/trained.py judge_together) goes through reshard_proof.launch.judge_in_shared_launches. Its
fallback only runs when a shared launch fails, which no passing suite shows, so it is driven here:
one job's input is corrupt, the process judging it raises, and the launch it shares with two good
jobs ends non-zero. The module is a few lines (starting DeepSpeed engines would only add minutes),
launched as those harnesses' modules are, its ranks started without torchrun's agent
(reshard_proof.launch.RANKS_WITHOUT_AGENT; RESHARD_PROOF_TORCHRUN=1 puts the agent back for all):
it judges its jobs in order, as reshard_proof.check_load does, and dies on the first input it
cannot read, as check_load dies on a truth file it cannot read.
"""
from __future__ import annotations

import os
import textwrap

import pytest

from reshard_proof import launch
from reshard_proof.launch import TorchrunError, judge_in_shared_launches, shared_launches

pytestmark = pytest.mark.e2e

MODULE = "shared_launch_judge"


@pytest.fixture
def judge_module(tmp_path, monkeypatch):
    """A torchrun module, importable by the launches (child_env extends this process's PYTHONPATH):
    `LAUNCH_LOG --job INPUT VERDICT ...` appends its jobs' inputs to LAUNCH_LOG (one line per
    launch), then per job reads INPUT (JSON) and writes VERDICT."""
    (tmp_path / f"{MODULE}.py").write_text(textwrap.dedent("""
        import json, os, sys
        launch_log, rest = sys.argv[1], sys.argv[2:]
        jobs = [rest[i + 1:i + 3] for i in range(0, len(rest), 3)]
        with open(launch_log, "a") as log:
            log.write(" ".join(os.path.basename(source) for source, _ in jobs) + "\\n")
        for source, verdict in jobs:
            with open(source) as handle:
                value = json.load(handle)  # a corrupt input ends the whole launch here
            with open(verdict, "w") as handle:
                json.dump({"ok": value == 1, "source": source}, handle)
    """))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    # started as the judging harnesses' modules are (check_load, moe_run, tensor_parallel, folded_tp_ep)
    monkeypatch.setattr(launch, "RANKS_WITHOUT_AGENT", launch.RANKS_WITHOUT_AGENT | {MODULE})
    return tmp_path


def _judge(root, jobs) -> tuple[dict, list[str]]:
    """(judge_in_shared_launches' answer for `jobs` (input, verdict), every launch's jobs in order)."""
    log = root / "launches.txt"
    found = judge_in_shared_launches(MODULE, jobs, launch=lambda job: (1, [log]),
                                     job_args=lambda job: ["--job", *job], verdict=lambda job: job[1], timeout=120)
    return found, log.read_text().splitlines()


def _inputs(root, **values):
    for name, text in values.items():
        (root / name).write_text(text)
    return {name: (root / name, root / f"{name}.verdict.json") for name in values}


def test_a_corrupt_input_fails_only_its_own_job(judge_module):
    jobs = _inputs(judge_module, good_a="1", corrupt='{"truncated', good_b="2")
    found, launches = _judge(judge_module, list(jobs.values()))
    # one shared launch, which died on the corrupt input; then one launch per job
    assert launches == ["good_a corrupt good_b", "good_a", "corrupt", "good_b"]
    assert found[str(jobs["good_a"][1])] == {"ok": True, "source": str(jobs["good_a"][0])}
    assert found[str(jobs["good_b"][1])] == {"ok": False, "source": str(jobs["good_b"][0])}  # its own verdict
    error = found[str(jobs["corrupt"][1])]
    assert isinstance(error, TorchrunError) and "JSONDecodeError" in str(error), error
    assert len(found) == 3


def test_good_jobs_share_one_launch(judge_module):
    jobs = _inputs(judge_module, first="1", second="1")
    found, launches = _judge(judge_module, list(jobs.values()))
    assert launches == ["first second"]
    assert [found[str(verdict)]["ok"] for _, verdict in jobs.values()] == [True, True]


def test_jobs_group_by_launch_in_the_order_given():
    jobs = [(2, "a"), (3, "b"), (2, "c")]
    assert shared_launches(jobs, lambda job: (job[0], ["--size", job[0]])) == {
        (2, "--size", "2"): [(2, "a"), (2, "c")], (3, "--size", "3"): [(3, "b")]}
