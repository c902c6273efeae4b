"""Issue 37's pipeline tp change on the one road: by rounds within a budget, each source byte read once, resumed.

    python -m pytest -q tests/test_pipeline_tp_change_road.py     # the session's tp saves (conftest `tp_saves`); one torchrun pair

The collective job reshards a PipelineModule save to another tp (its model axis), pp kept or changed,
through the planner and execute() (collective_job.pipeline_stage_change sets the target columns at the
target's local shapes and the model axis: tensor_pieces.pipeline_model_axis_pieces lowers every column
onto the target stages' global parameters; the layer files are module tensors of the same plan, re-cut),
no longer through the whole-tensor pipeline job, which joined every tensor whole over the model ranks,
refused a budget below that and had no resume. The outputs stay byte-identical to the pins of
tests/test_pipeline_pinned.py (which checks every tp-change case; tests/test_pipeline_tp_change.py judges
those outputs by native DeepSpeed loads). Here: (pp, tp, dp) (2, 2, 1) -> (1, 1, 4) under a 4 KiB budget,
far below a stage's optimizer file, in many rounds each within the budget, each source byte read once (a
tied parameter from its first stage only, a replicated one from model rank 0 only; the layer files' tensors
likewise); and `torchrun -m reshard` killed mid-rounds, then run again, resuming to the pinned bytes.
"""
from __future__ import annotations

import re

import pytest
import torch

pytestmark = pytest.mark.e2e

BUDGET = 4096
VARIANT, PINNED_CASE = "fp32-mp2u", "fp32-mp2u-to-pp1-tp1-dp4-w2"  # (2, 2, 1) -> (1, 1, 4)
LAYERS = ("--pipeline-layers", "7", "--pipeline-tied", "embed:0,6", "--ignore-batch-config")  # pipeline_run.py's


def expected_reads(tag_dir) -> int:
    """Bytes a tp change to tp 1, pp 1 reads once each, from the save's own files: every (stage, model rank)'s
    optimizer elements (masters and both moments, fp32) but a tied parameter's on a later stage and a
    replicated one's on model rank 1 (tp_replicated_parameter_patterns, matched here with re.match as
    ds_to_universal does), and every layer file's tensors but model rank 1's replicated ones."""
    first = torch.load(tag_dir / "mp_rank_00_model_states.pt", weights_only=False)
    replicated = first["universal_checkpoint_info"]["tp_replicated_parameter_patterns"]
    is_replicated = lambda name: any(re.match(p, name) for p in replicated)  # noqa: E731
    seen, elements = set(), 0
    for stage in range(2):
        for model in range(2):
            tree = torch.load(tag_dir / f"mp_rank_{stage * 2 + model:02d}_model_states.pt", weights_only=False)
            for group in tree["param_shapes"]:
                for name, shape in group.items():
                    if (stage > 0 and name in seen) or (model == 1 and is_replicated(name)):
                        continue
                    elements += 3 * shape.numel()  # fp32 master, exp_avg, exp_avg_sq
                    seen.add(name) if model == 0 else None
    layer_bytes = 0
    for path in sorted(tag_dir.glob("layer_*-model_*-model_states.pt")):
        index, model = (int(x) for x in re.match(r"layer_(\d+)-model_(\d+)", path.name).groups())
        tied = "tied_modules.embed." if index in (0, 6) else f"{index}."
        for key, tensor in torch.load(path, weights_only=True).items():
            if not (model == 1 and is_replicated(tied + key)):
                layer_bytes += tensor.numel() * tensor.element_size()
    return 4 * elements + layer_bytes


def test_a_tp_change_by_rounds_within_a_budget_reads_each_source_byte_once(tp_saves, tmp_path):
    from test_pipeline_pinned import PINNED, TRUTH_DIGESTS, tree_hashes, truth_dir_digest
    from test_pipeline_tp_change import LAYERS as LAYER_OPTIONS
    from trained import reshard_in_threads

    save, truth = tp_saves[VARIANT]
    assert truth_dir_digest(truth) == TRUTH_DIGESTS[f"tp/{VARIANT}"], "trained to other values than the pins'"
    assert min(p.stat().st_size for p in save.glob("*/*optim_states.pt")) > 4 * BUDGET
    out = tmp_path / "out"
    result = reshard_in_threads(save, out, 4, 2, target_pp=1, target_tp=1, memory_budget=BUDGET, **LAYER_OPTIONS)
    [checkpoint] = result.checkpoints
    plan = checkpoint.plan
    assert plan is not None, "took the whole-tensor pipeline job, not the rounds"
    assert [space.name for space in plan.spaces] == ["optim", "layer_float32"]  # the layer files in the plan
    assert plan.rounds > 4 and max(plan.round_bytes()) <= BUDGET, (plan.rounds, max(plan.round_bytes()))
    [tag] = [p for p in save.iterdir() if p.is_dir()]
    assert sum(r.bytes_read for r in checkpoint.reports) == expected_reads(tag)
    assert tree_hashes(out) == PINNED[PINNED_CASE]


def test_a_tp_change_killed_mid_rounds_under_torchrun_resumes_to_the_pinned_bytes(tp_saves, tmp_path):
    """(2, 2, 1) -> (1, 1, 4) by `torchrun -m reshard` (2 workers) under a 4 KiB budget, killed in round 3
    (SIGKILL, the journal durable every 1 KiB), run again: it resumes and publishes the pinned bytes. The
    pipeline job it replaces refused such a budget and had no resume."""
    from reshard_proof.launch import TorchrunError
    from test_pipeline_pinned import PINNED, tree_hashes
    from trained import reshard_with_torchrun

    from reshard.jobs.destination import STAGING
    from reshard.jobs.manifest import JOURNAL_NAME
    save, _ = tp_saves[VARIANT]
    out = tmp_path / "out"
    args = ("--target-pp", "1", "--target-tp", "1", *LAYERS, "--memory-budget", "4K", "--durable-every", "1K")
    with pytest.raises(TorchrunError):
        reshard_with_torchrun(save, out, 4, 2, *args, env={"RESHARD_FAILPOINTS": "kill@round=3"})
    journals = list((out / STAGING).glob(f"*/{JOURNAL_NAME}"))
    assert len(journals) == 1 and not (out / "latest").exists()
    done = reshard_with_torchrun(save, out, 4, 2, *args)
    assert "resuming an interrupted" in done.stdout + done.stderr, done.stdout
    assert tree_hashes(out) == PINNED[PINNED_CASE]
    assert not (out / STAGING).exists()


def test_a_zero_stage_or_expert_size_is_refused_by_name_on_the_road(tp_saves, tmp_path):
    """With every pipeline reshard on the main road, what none serves is still refused by name, exit 2, nothing
    written, whatever else changes: another ZeRO stage (PipelineEngine runs ZeRO-0 and 1 only) and an ep."""
    from trained import reshard_in_process
    save, _ = tp_saves[VARIANT]
    for extra in (("--target-stage", "2"), ("--target-stage", "3", "--target-pp", "1", *LAYERS[:4]),
                  ("--target-ep", "2")):
        run = reshard_in_process(save, tmp_path / "out", "--target-dp", "2", "--ignore-batch-config", *extra)
        assert run.returncode == 2, run.stderr
        assert f"mp_rank_00_model_states.pt: {extra[0]} {extra[1]} is not supported for pipeline checkpoints" \
            in run.stderr, run.stderr
        assert not (tmp_path / "out").exists()


def test_a_layer_file_slice_of_another_dtype_is_refused_naming_the_file(tp_saves, tmp_path):
    """The road reads each layer file's tensors at their offsets, so each is checked first to be its model
    rank's slice in model rank 0's dtype: one saved as float64 is refused naming its file, exit 2, nothing
    written, the source untouched (the whole-tensor job cast it into float32 and exited 0)."""
    import hashlib
    import shutil

    from trained import reshard_in_process
    save, _ = tp_saves[VARIANT]
    copy = tmp_path / "save"
    shutil.copytree(save, copy)
    odd = next(copy.glob("*/layer_01-model_01-model_states.pt"))
    state = torch.load(odd, weights_only=True)
    state["weight"] = state["weight"].double()
    torch.save(state, odd)
    before = hashlib.sha256(odd.read_bytes()).hexdigest()
    run = reshard_in_process(copy, tmp_path / "out", "--target-dp", "2", "--target-tp", "1", *LAYERS)
    assert run.returncode == 2, run.stdout + run.stderr
    assert f"{odd}: weight is a float64 tensor of shape [22, 24]; model rank 1's slice is a contiguous float32 " \
           "tensor of shape [22, 24]" in run.stderr, run.stderr
    assert not (tmp_path / "out").exists()
    assert hashlib.sha256(odd.read_bytes()).hexdigest() == before
