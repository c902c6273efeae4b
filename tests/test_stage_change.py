"""`--target-stage`: a ZeRO stage change and a DP change in one pass, proven by loading.

    python -m pytest -q tests/test_stage_change.py

Sources are the session's trained checkpoints (2 ranks). Every output is loaded with plain
`engine.load_checkpoint` in an engine configured at the target stage and target DP size
(`VARIANT@stageS`, everything else unchanged), compared element by element with the truth of the
source run, and trained one more step; all loads at one size share one torchrun launch. Three
outputs are also compared field by field with a checkpoint DeepSpeed itself saved at the target
stage and size (same variant and seed), and every output is read by DeepSpeed's zero_to_fp32.
"""
from __future__ import annotations

import pytest
from native_compare import structural_differences, tied_storage_shared
from trained import reshard_in_process, reshard_in_threads

from reshard.errors import OptionError
from reshard_proof.launch import check_checkpoints
from reshard_proof.zero_to_fp32_check import check_zero_to_fp32

N = 2
# source variant, target stage, target dp, workers: every direction, every precision
MATRIX = [
    ("z1_fp16", 3, 3, 2),
    ("z1_fp16", 2, 1, 1),
    ("z2_bf16", 3, 1, 2),
    ("z2_fp32", 1, 3, 3),
    ("z3_bf16", 1, 3, 2),
    ("z3_fp32", 2, 3, 1),
    ("z3_fp16", 2, 1, 2),
    ("z2_round_robin", 3, 3, 2),  # the flat order depends on W at the source only
    ("z3_exclude_frozen", 2, 3, 2),  # no frozen parameters saved: none to move
]
NATIVE = [("z1_fp16", 3, 3), ("z3_bf16", 1, 3), ("z3_fp32", 2, 3)]
# the checkpoints its tests ask `trained` for, trained with the session's others (conftest.py)
pytestmark = [pytest.mark.e2e, pytest.mark.trains(*[(variant, N) for variant, *_ in MATRIX], ("bf16_optimizer", N),
                                                  ("z3_subgroups", N))]


def _name(variant, stage, m, *_):
    return f"{variant}-to-stage{stage}-dp{m}"


@pytest.fixture(scope="module")
def stage_outputs(trained, tmp_path_factory):
    """{case: (destination, truth, verdict)}: every MATRIX case resharded, then judged, one launch per M."""
    root = tmp_path_factory.mktemp("stage-change")
    outputs, jobs_by_m = {}, {}
    for variant, stage, m, workers in MATRIX:
        source, truth = trained(variant, N)
        destination = root / _name(variant, stage, m)
        result = reshard_in_threads(source, destination, m, workers, target_stage=stage, memory_budget=8 << 10)
        assert result.checkpoints[0].target_dp == m
        verdict = root / f"{_name(variant, stage, m)}.json"
        jobs_by_m.setdefault(m, []).append((f"{variant}@stage{stage}", str(destination), str(truth), str(verdict)))
        outputs[(variant, stage, m)] = destination, truth
    verdicts = {}
    for m, jobs in jobs_by_m.items():
        for job, verdict in zip(jobs, check_checkpoints(m, jobs)):
            verdicts[job[1]] = verdict
    return {key: (destination, truth, verdicts[str(destination)]) for key, (destination, truth) in outputs.items()}


@pytest.mark.parametrize("variant,stage,m,workers", MATRIX, ids=[_name(*case) for case in MATRIX])
def test_loads_at_the_target_stage_equal_to_the_truth(stage_outputs, variant, stage, m, workers):
    destination, truth, verdict = stage_outputs[(variant, stage, m)]
    assert verdict["ok"], (verdict["load_error"], verdict["mismatches"])
    assert verdict["world_size"] == m and verdict["source_world_size"] == N
    assert verdict["checked_elements"] > 1000
    assert len(verdict["extra_step_losses"]) == m  # every rank trained on
    assert check_zero_to_fp32(str(destination), str(truth), stage=stage) == []


@pytest.mark.trains(*[(f"{variant}@stage{stage}", m) for variant, stage, m in NATIVE])
@pytest.mark.parametrize("variant,stage,m", NATIVE, ids=[_name(*case) for case in NATIVE])
def test_files_match_what_deepspeed_saves_at_the_target_stage(trained, stage_outputs, variant, stage, m):
    destination, _, _ = stage_outputs[(variant, stage, m)]
    native, _ = trained(f"{variant}@stage{stage}", m)
    tag = (destination / "latest").read_text()
    assert tag == (native / "latest").read_text()
    assert structural_differences(destination / tag, native / tag) == []
    if stage < 3:  # a tied alias shares its owner's storage in the module, as in DeepSpeed's save
        assert tied_storage_shared(destination / tag / "mp_rank_00_model_states.pt", "head.weight", "embed.weight")


def test_field_comparison_sees_a_stage_difference(trained, stage_outputs):
    """The comparison above can fail: a ZeRO-1 save and its ZeRO-2 output differ where the stages do."""
    z1, _ = trained("z1_fp16", N)
    z2, _, _ = stage_outputs[("z1_fp16", 2, 1)]
    tag = (z1 / "latest").read_text()
    differences = structural_differences(z2 / tag, z1 / tag)
    assert any("['zero_stage']" in d for d in differences)
    assert any("['frozen_param_shapes']" in d for d in differences)


def test_bf16_optimizer_and_bad_stages_are_refused(trained, tmp_path):
    source, _ = trained("bf16_optimizer", N)
    # the messages, not the launcher: reshard.cli.main in this process (test_cli proves a real
    # `python -m reshard` refusal exits 2)
    done = reshard_in_process(source, tmp_path / "dst", "--target-dp", "3", "--target-stage", "3")
    assert done.returncode == 2 and "BF16_Optimizer" in done.stderr and not (tmp_path / "dst").exists()
    assert str(source) in done.stderr  # the message names the checkpoint
    done = reshard_in_process(source, tmp_path / "dst", "--target-dp", "3", "--target-stage", "4")
    assert done.returncode == 2 and "--target-stage" in done.stderr
    with pytest.raises(OptionError, match="--target-stage"):
        reshard_in_threads(source, tmp_path / "dst", 3, 1, target_stage=0)
    with pytest.raises(OptionError, match="--array-task"):
        reshard_in_threads(source, tmp_path / "dst", 3, 1, target_stage=3, array_task=0, array_tasks=2)


def test_zero3_sub_groups_keep_their_own_step_counter(trained, tmp_path):
    """Several sub-groups of one param group each get a step tensor of their own, as DeepSpeed saves
    them: torch's load_state_dict keeps a shared tensor shared, and ZeRO-3 steps each sub-group
    alone, so a shared counter would advance once per sub-group."""
    import torch
    source, _ = trained("z3_subgroups", N)
    destination = tmp_path / "dp3"
    reshard_in_threads(source, destination, 3, 2)
    tag = (destination / "latest").read_text()
    state = torch.load(destination / tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                       weights_only=False)["optimizer_state_dict"]["optimizer_state_dict"]
    assert max(len(g["params"]) for g in state["param_groups"]) > 1  # a group with several sub-groups
    steps = [state["state"][sg]["step"] for sg in sorted(state["state"])]
    assert len({s.untyped_storage().data_ptr() for s in steps}) == len(steps)
    assert all(torch.equal(s, steps[0]) for s in steps)
