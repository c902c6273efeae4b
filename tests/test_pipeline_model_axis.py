"""PipelineModule checkpoints with a model axis (PipeModelDataParallelTopology): another (pp, dp), tp kept.

    python -m pytest -q tests/test_pipeline_model_axis.py -m "not e2e"   # naming and numbering, no DeepSpeed run
    python -m pytest -q tests/test_pipeline_model_axis.py                # trains (pp, tp, dp) = (2, 2, 1) on 4 CPU ranks

The e2e tests train tests/pipeline_run.py's Megatron-style model (`--mp 2`: a column-parallel and a
row-parallel Linear whose slices differ per model rank, seeded by model rank; the tied embedding,
LayerNorm and a Linear replicated) once per session in fp32, bf16 and fp32 with two param groups and
a buffer (`pipeline_runs(VARIANT, 2, 1)`, one launch), reshard each with threads, and judge each
output three ways: file by file, every (stage, model rank)'s fp32 masters and Adam moments joined
from its optimizer files equal the truth of that model rank (and not the other one's, where the
slices differ), and in a real engine at the target (pp, tp, dp) loading with plain `load_checkpoint`
from another seed (tests/pipeline_run.py check: every master and moment by name against its model
rank's truth, eval loss on a fixed micro-batch, counters, LR, client_state, then one more
`train_batch`; every variant at one target in one launch, which at (1, 2, 2) also loads the fp32 and
bf16 sources in-job through reshard.deepspeed.load_checkpoint), and by `verify --against` (which must
also name a swap of two model ranks' files).
"""
from __future__ import annotations

import os

import pytest

from reshard.errors import OptionError, UnsupportedCheckpoint
from reshard.formats.deepspeed_files.deepspeed_pipeline import PipelineSource, PipelineStage, stage_model_name
from reshard.jobs.options import ReshardOptions
from reshard.formats.deepspeed_files.pipeline_target import pipeline_target
from reshard.layouts.pipeline import stage_model_rank

VARIANT, SOURCE = "fp32-mp2", (2, 1)  # (pp, dp) of the session's save; tp 2
LAYERS = {"pipeline_layers": 7, "pipeline_tied": "embed:0,6"}  # tests/pipeline_run.py's layer list


def test_stage_files_are_numbered_stage_times_tp_plus_model_rank():
    # PipelineParallelGrid: the model-parallel rank is the index among a data coordinate's ranks, the
    # axes (pipe, data, model) with model fastest; on the real (2, 2, 1) save mp_rank_01 is stage 0's
    # model rank 1 (the e2e test below checks it against the truth by value)
    assert [stage_model_rank(s, m, 2) for s in range(3) for m in range(2)] == [0, 1, 2, 3, 4, 5]
    assert stage_model_rank(1, 0, 1) == 1  # without a model axis, the stage
    assert stage_model_name(1, 1, 2) == "mp_rank_03_model_states.pt"
    source = PipelineSource("/ckpt", "t", 2, 3, True, False, (), (), (), tp=2)
    assert source.optim_path(1, 2, 1) == "/ckpt/t/bf16_zero_pp_rank_2_mp_rank_03_optim_states.pt"
    with pytest.raises(ValueError):
        stage_model_rank(0, 2, 2)


def test_the_model_axis_is_kept_and_another_tp_needs_the_layer_list():
    stage = PipelineStage(0, (("tied_modules.embed.weight",),), ((888,),))
    source = PipelineSource("/ckpt", "t", 2, 1, False, False, (stage, stage), (), (), tp=2)
    kept = pipeline_target(ReshardOptions(source="a", destination="b", target_dp=2), source)
    assert (kept.topology.pp, kept.topology.tp, kept.topology.dp, kept.stages) == (2, 2, 2, None)
    assert pipeline_target(ReshardOptions(source="a", destination="b", target_dp=2, target_tp=2), source).topology.tp == 2
    # DeepSpeed's `parameters` partition weighs the local (sliced) parameter counts: another tp may
    # give other stages, so the layer list is needed as for another pp
    with pytest.raises(UnsupportedCheckpoint, match=r"/ckpt/t/mp_rank_00_model_states.pt: --target-tp 1 \(the save "
                                                    r"has tp 2\): DeepSpeed's `parameters` partition .* give "
                                                    r"--pipeline-layers N"):
        pipeline_target(ReshardOptions(source="a", destination="b", target_dp=2, target_tp=1), source)
    with pytest.raises(OptionError, match=r"--target-tp must be at least 1"):
        pipeline_target(ReshardOptions(source="a", destination="b", target_dp=2, target_tp=0, **LAYERS), source)


def _truth_by_model_rank(truth_dir) -> dict[int, dict[str, dict]]:
    import torch
    found: dict[int, dict[str, dict]] = {}
    for name in sorted(os.listdir(truth_dir)):
        truth = torch.load(os.path.join(truth_dir, name), weights_only=True)
        found.setdefault(truth["model_rank"], {}).update(truth["tensors"])
    return found


def _check_files_against_truth(out, truth_dir) -> int:
    """Every (stage, model rank)'s masters and moments, joined from the output's optimizer files, equal
    that model rank's truth and, for a sliced parameter, differ from the other model rank's. Returns
    how many tensors were compared."""
    import torch

    from reshard.formats.deepspeed_files.deepspeed_pipeline import inspect_pipeline, read_stage, states_by_name
    truth = _truth_by_model_rank(truth_dir)
    target = inspect_pipeline(str(out), "step3")
    compared = 0
    for stage, spec in enumerate(target.stages):
        for model in range(target.tp):
            _, masters, moments = read_stage(target, stage, model=model)
            for name, states in states_by_name(spec, masters, moments).items():
                for key, flat in states.items():
                    want = truth[model][name][key].reshape(-1)
                    assert torch.equal(flat, want), f"{target.optim_path(stage, 0, model)}: {name} {key}"
                    other = truth[1 - model][name][key].reshape(-1)
                    if name.startswith(("1.", "3.weight")):  # the sliced parameters: a mix-up would show
                        assert not torch.equal(flat, other), f"{name} {key} is the same on both model ranks"
                    compared += 1
    return compared


def _verify_against_catches_a_model_rank_mix_up(out, save_dir, workers: int, dp: int, prefix: str = "") -> None:
    """verify --against (threads) passes the output, and names the file when stage 0's two model ranks'
    optimizer files of its last dp rank are swapped in a copy (the first dp rank's can hold nothing but
    the replicated embedding, equal on both model ranks: with the column-parallel weight frozen, dp rank 0
    of stage 0 at dp 2 holds 720 of its 888 elements, and such a swap changes nothing)."""
    import shutil

    from threaded_transport import run_workers

    from reshard.verify import verify_against

    def verify(destination):
        return run_workers(workers, lambda t: verify_against(str(destination), str(save_dir), transport=t))[0]
    clean = verify(out)
    assert clean.ok, clean.summary()
    swapped = out.parent / "swapped"
    shutil.copytree(out, swapped)
    first, second = (swapped / "step3" / f"{prefix}zero_pp_rank_{dp - 1}_mp_rank_{i:02d}_optim_states.pt"
                     for i in (0, 1))
    first.rename(swapped / "step3" / "held")
    second.rename(first)
    (swapped / "step3" / "held").rename(second)
    found = verify(swapped)
    assert not found.ok
    sliced = ("1.weight", "1.bias", "3.weight")  # the parameters whose values differ per model rank
    # the main road's words (state, flat buffer) and the parameter the first differing element belongs to
    assert any(p.startswith(f"{first}: fp32 of flat buffer ") and p.endswith(tuple(f", in {name})" for name in sliced))
               for p in found.problems), found.summary()


# (target (pp, dp), workers): pp down with dp up, W=3 differing from both worlds (4 and 4); and the
# stages kept with dp up (the per-stage re-cut, 8 ranks at the target)
TARGETS = [((1, 2), 3), ((2, 2), 2)]
# The model-axis variants (tests/pipeline_run.py variant_settings), trained in one launch
# (test_pipeline.TRAINED_TOGETHER) and judged at each target in one launch (test_pipeline.judge_at): fp32;
# bf16 (ZeRO-1 with bf16 weights, fp32 masters in the optimizer files, `bf16_` file names); fp32 with two
# param groups and a buffer in the LayerNorm layer (each model rank's layer file holding its own copy); and
# fp32 with the column-parallel weight frozen after the build (each model rank's slice only in its layer
# file, compared by value in the verdict; the pp change reads the frozen numels from -model_XX layer files).
VARIANTS = ("fp32-mp2", "bf16-mp2", "fp32-groups-mp2", "fp32-frozen-mp2")
CASES = [(variant, SOURCE, target, workers) for target, workers in TARGETS for variant in VARIANTS]
# also loaded in-job from the source (reshard.deepspeed.load_checkpoint), in the same launch
IN_JOB_CASES = [(variant, SOURCE, (1, 2), 3) for variant in ("fp32-mp2", "bf16-mp2")]


@pytest.fixture(scope="module")
def judged(request, pipeline_runs, tmp_path_factory):
    """case -> {"result", "out", "plain": verdict, "in_job": verdict (IN_JOB_CASES)}: the first case asked at
    a target reshards every selected case there, and one launch judges them all (test_pipeline.judge_at)."""
    from test_pipeline import cases_selected, judge_at
    cache, selected = {}, cases_selected(request.session.items, CASES, __name__)

    def judged(case):
        if case not in cache:
            group = [other for other in selected if other[2] == case[2] and other not in cache]
            cache.update(judge_at(pipeline_runs, tmp_path_factory, group if case in group else [case], IN_JOB_CASES))
        return cache[case]
    return judged


@pytest.mark.e2e
@pytest.mark.parametrize("case", CASES, ids=lambda case: f"{case[0]}-to-pp{case[2][0]}-dp{case[2][1]}")
def test_model_axis_reshard_loads_natively_equal_to_each_model_ranks_truth(pipeline_runs, judged, case):
    from test_pipeline import _verdict

    from reshard.formats.deepspeed_files.deepspeed_pipeline import LAYER_RE
    variant, source, target, workers = case
    save_dir, truth = pipeline_runs(variant, *source)
    shared = judged(case)
    result, out = _verdict(shared["result"]), shared["out"]
    [checkpoint] = result.checkpoints
    topology = checkpoint.target_topology
    assert (topology.pp, topology.tp, topology.dp) == (target[0], 2, target[1])
    names = sorted(os.listdir(out / "step3"))
    prefix = "bf16_" if variant.startswith("bf16") else ""
    assert [n for n in names if n.endswith("optim_states.pt")] == sorted(
        f"{prefix}zero_pp_rank_{d}_mp_rank_{s * 2 + m:02d}_optim_states.pt"
        for s in range(target[0]) for m in range(2) for d in range(target[1]))
    assert [n for n in names if n.startswith("mp_rank_")] == [f"mp_rank_{i:02d}_model_states.pt"
                                                               for i in range(target[0] * 2)]
    layers = [n for n in names if LAYER_RE.match(n)]
    assert layers == sorted(n for n in os.listdir(save_dir / "step3") if LAYER_RE.match(n)) and len(layers) == 12
    for name in layers:  # layer files travel unchanged, each model rank's under its own -model_XX name
        assert (out / "step3" / name).read_bytes() == (save_dir / "step3" / name).read_bytes()
    frozen = 1 if "-frozen" in variant else 0  # the column-parallel weight: in no optimizer file, only its layer files
    assert _check_files_against_truth(out, truth) == 3 * ({1: 9, 2: 10}[target[0]] - frozen) * 2
    _verify_against_catches_a_model_rank_mix_up(out, save_dir, workers, target[1], prefix)
    # every rank checks its stage's parameters (the tied embedding on both stages) and buffers (--groups:
    # the LayerNorm's, on the one stage holding it), each model rank's against its own truth
    buffers = 1 if "-groups" in variant else 0
    for key in ("plain", "in_job") if case in IN_JOB_CASES else ("plain",):
        verdict = _verdict(shared[key])
        assert verdict["ok"], (key, verdict)
        assert len(verdict["ranks"]) == target[0] * 2 * target[1]
        assert sum(rank["checked"] for rank in verdict["ranks"]) == 2 * target[1] * (9 + target[0] - 1 + buffers)


@pytest.mark.e2e
def test_model_axis_save_is_described_and_what_does_not_serve_it_refuses_by_name(pipeline_runs, tmp_path):
    import shutil

    from trained import reshard_in_process

    from reshard.deepspeed import pipeline_to_load
    from reshard.formats.deepspeed_files.deepspeed_pipeline import pipeline_summary, pipeline_summary_text, saved_pipeline_topology
    save_dir, _ = pipeline_runs(VARIANT, *SOURCE)
    tag_dir = save_dir / "step3"
    assert saved_pipeline_topology(str(tag_dir)) == (2, 1, 2)
    summary = pipeline_summary(str(save_dir), None)
    assert (summary["pp"], summary["dp"], summary["tp"]) == (2, 1, 2)
    # per model rank: the tied embedding (37 x 24), column-parallel 21 x 24 + 21, row-parallel 24 x 21 + 24 | the
    # tied embedding, LayerNorm 24 + 24, Linear 24 x 24 + 24
    assert [(s["params"], s["elements"]) for s in summary["stages"]] == [(5, 888 + 525 + 528), (5, 888 + 48 + 600)]
    text = pipeline_summary_text(summary)
    assert "pp=2 dp=1 tp=2 (model axis)" in text and "mp_rank_02_model_states.pt / mp_rank_03_model_states.pt" in text
    out = tmp_path / "out"
    # this save's client state has an empty universal_checkpoint_info: which dim each parameter is
    # sliced on is not recorded (tests/test_pipeline_tp_change.py changes tp of a save that has it)
    run = reshard_in_process(save_dir, out, "--target-dp", "2", "--target-tp", "1", "--pipeline-layers", "7",
                             "--pipeline-tied", "embed:0,6")
    assert run.returncode == 2, run.stderr
    assert (f"{tag_dir}/mp_rank_00_model_states.pt: --target-tp 1 (the save has tp 2): has a universal_checkpoint_info "
            "with none of tp_replicated_parameter_patterns, parameter_to_average_patterns, ") in run.stderr
    assert "so which dim each parameter is sliced on over the model axis is not recorded" in run.stderr
    assert not out.exists()
    run = reshard_in_process("export", save_dir, tmp_path / "export", "--format", "safetensors")
    assert run.returncode == 2, run.stderr
    # the export joins each tensor whole over the model ranks, by the same patterns
    assert ("mp_rank_00_model_states.pt: is a pipeline save with a model axis (tp 2); the export joins each tensor "
            "over the model ranks by the universal_checkpoint_info patterns of its client state") in run.stderr
    assert not (tmp_path / "export").exists()
    # a dp change with the model ranks kept: an array task's items are target files, on the plan
    # (tests/test_pipeline_array.py proves the output): its dry run names each file of each (stage, model
    # rank) by its mp_rank_XX, every file dealt to exactly one of the two tasks
    planned = [reshard_in_process(save_dir, tmp_path / "array", "--target-dp", "2", "--ignore-batch-config",
                                  "--array-task", task,
                                  "--array-tasks", "2", "--dry-run") for task in (0, 1)]
    assert [run.returncode for run in planned] == [0, 0], [run.stderr for run in planned]
    for unit in range(4):
        for name in (f"mp_rank_{unit:02d}_model_states.pt", f"zero_pp_rank_0_mp_rank_{unit:02d}_optim_states.pt",
                     f"zero_pp_rank_1_mp_rank_{unit:02d}_optim_states.pt"):
            assert sum(name in run.stdout for run in planned) == 1, name
    assert not (tmp_path / "array").exists()
    assert pipeline_to_load(str(save_dir), None, (2, 1, 2)) == "step3"  # DeepSpeed's own load at the save's (pp, dp, tp)
    in_job = pipeline_to_load(str(save_dir), None, (1, 2, 2))  # rebuilt per model rank (judged in the test above)
    assert (in_job.pp, in_job.dp, in_job.tp) == (2, 1, 2)
    # a model rank's layer file missing: refused naming it
    broken = tmp_path / "broken"
    shutil.copytree(save_dir, broken)
    (broken / "step3" / "layer_03-model_01-model_states.pt").unlink()
    run = reshard_in_process(broken, tmp_path / "out2", "--target-dp", "2")
    assert run.returncode == 2, run.stderr
    assert "layer_03-model_01-model_states.pt: is missing: the save's tp_degree is 2" in run.stderr


