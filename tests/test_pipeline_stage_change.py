"""Issue 37's pp change on the one road: a pipeline save at another number of stages (tp kept), by rounds, resumed.

    python -m pytest -q tests/test_pipeline_stage_change.py     # the session's fp32 (pp 2, dp 1) save; one torchrun pair

The collective job reshards a PipelineModule save to another pp through the planner and execute()
(collective_job.pipeline_stage_change: the target stages from the layer list as the pipeline job works
them out; checkpoint_plan.plan_pipeline_stage_change: pieces of global parameters, tied ones replicated),
no longer through the whole-tensor pipeline job, which held a stage's tensors whole, refused a budget
below them and had no resume. The outputs stay byte-identical to the pins of tests/test_pipeline_pinned.py
(which that file checks for every pp-change case; the pinned outputs are those tests/test_pipeline.py
judges by a native DeepSpeed load). Here: pp 2 -> 1 under a 4 KiB budget, far below a stage's optimizer
file, in many rounds each within the budget, each source byte read once (a tied parameter from its first
stage only); and `torchrun -m reshard` killed mid-rounds, then run again, resuming to the pinned bytes.
"""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.e2e

BUDGET = 4096
LAYERS = ("--pipeline-layers", "7", "--pipeline-tied", "embed:0,6", "--ignore-batch-config")  # pipeline_run.py's


def test_a_pp_change_by_rounds_within_a_budget_reads_each_source_byte_once(pipeline_runs, tmp_path):
    from test_pipeline_pinned import PINNED, TRUTH_DIGESTS, tree_hashes, truth_dir_digest
    from test_pipeline_tp_change import LAYERS as LAYER_OPTIONS
    from trained import reshard_in_threads

    from reshard.formats.deepspeed_files.deepspeed_inspect import inspect_pipeline_columns
    save, truth = pipeline_runs("fp32", 2, 1)
    assert truth_dir_digest(truth) == TRUTH_DIGESTS["runs/fp32/2/1"], "trained to other values than the pins'"
    assert min(p.stat().st_size for p in save.glob("*/*optim_states.pt")) > 4 * BUDGET
    out = tmp_path / "out"
    result = reshard_in_threads(save, out, 2, 1, target_pp=1, memory_budget=BUDGET, **LAYER_OPTIONS)
    [checkpoint] = result.checkpoints
    plan = checkpoint.plan
    assert plan is not None, "took the whole-tensor pipeline job, not the rounds"
    assert plan.rounds > 4 and max(plan.round_bytes()) <= BUDGET, (plan.rounds, max(plan.round_bytes()))
    spec = inspect_pipeline_columns(save).spec
    tied_again = sum(p.numel for p in spec.columns[1][0] if p.name.startswith("tied_modules."))  # stage 1's copy
    assert tied_again > 0
    carried = sum(p.stat().st_size for p in save.glob("*/layer_*-model_states.pt"))  # copied whole, read once
    assert checkpoint.bytes_read - carried == (sum(p.numel for p in spec.params) - tied_again) * sum(
        s.itemsize for s in spec.streams)
    assert tree_hashes(out) == PINNED["fp32-pp2-dp1-to-pp1-dp2-w1"]


def test_a_pp_change_reads_the_stage_pickles_once(pipeline_runs, tmp_path, monkeypatch):
    """Worker 0 inspects a pp change's source once (deepspeed_pipeline.inspect_pipeline: every stage's model-
    states and optimizer pickles, every layer file's header), for the columns and the target's stages alike
    (collective_job.inspect_pipeline_target hands it down); it read them twice before. The dry run of the
    same job: the target really is pp 1, and every source rank is planned."""
    from test_pipeline_tp_change import LAYERS as LAYER_OPTIONS

    from reshard.formats.deepspeed_files import deepspeed_pipeline
    from reshard.jobs.collective_job import reshard_checkpoint
    save, _ = pipeline_runs("fp32", 2, 1)
    inspected = []
    inspect = deepspeed_pipeline.inspect_pipeline
    monkeypatch.setattr(deepspeed_pipeline, "inspect_pipeline",
                        lambda *args, **kwargs: inspected.append(args[:2]) or inspect(*args, **kwargs))
    result = reshard_checkpoint(str(save), str(tmp_path / "out"), 2, target_pp=1, dry_run=True, quiet=True,
                                **LAYER_OPTIONS)
    [checkpoint] = result.checkpoints
    assert (checkpoint.source_topology.pp, checkpoint.target_topology.pp) == (2, 1)
    assert len(inspected) == 1, inspected
    assert not (tmp_path / "out").exists()


def test_a_pp_change_killed_mid_rounds_under_torchrun_resumes_to_the_pinned_bytes(pipeline_runs, tmp_path):
    """Issue 37's held-out check at this scale: pp 2 -> 1 by `torchrun -m reshard` (2 workers) under a
    4 KiB budget, killed in round 3 (SIGKILL, the journal durable every 1 KiB), run again: it resumes and
    publishes the pinned bytes. The pipeline job it replaces refused such a budget and had no resume."""
    from reshard_proof.launch import TorchrunError
    from test_pipeline_pinned import PINNED, tree_hashes
    from trained import reshard_with_torchrun

    from reshard.jobs.destination import STAGING
    from reshard.jobs.manifest import JOURNAL_NAME
    save, _ = pipeline_runs("fp32", 2, 1)
    out = tmp_path / "out"
    args = ("--target-pp", "1", *LAYERS, "--memory-budget", "4K", "--durable-every", "1K")
    with pytest.raises(TorchrunError):
        reshard_with_torchrun(save, out, 2, 2, *args, env={"RESHARD_FAILPOINTS": "kill@round=3"})
    journals = list((out / STAGING).glob(f"*/{JOURNAL_NAME}"))
    assert len(journals) == 1 and not (out / "latest").exists()
    done = reshard_with_torchrun(save, out, 2, 2, *args)
    assert "resuming an interrupted" in done.stdout + done.stderr, done.stdout
    assert tree_hashes(out) == PINNED["fp32-pp2-dp1-to-pp1-dp2-w1"]
    assert not (out / STAGING).exists()
