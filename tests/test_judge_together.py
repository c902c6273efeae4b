"""judge_together's shared launch gives each checkpoint the verdict a process of its own gives it.

    python -m pytest -q tests/test_judge_together.py       # ~3 launches at 2 ranks, ~2-3 min on 2 cores

A ZeRO-3 engine built in a process replaces torch.nn.functional.linear for the rest of it
(DeepSpeed runtime/zero/partition_parameters.py `_enable_mem_efficient_linear`); a bf16 or fp16
ZeRO-1/2 engine loaded after it in the same launch then computed another eval loss than in a fresh
process. reshard_proof.engine_setup.build_engine undoes that, so judge_together puts loads of every
precision in one launch per M. The e2e test below loads a ZeRO-3 checkpoint first, then a bf16 and
an fp16 one, and compares their verdicts with those of one launch each: without the undo, the
eval loss differs and it fails.
"""
from __future__ import annotations

import json

import pytest
from trained import judge, launches_of

from reshard_proof.launch import check_checkpoints

# the checkpoints its tests ask `trained` for, trained with the session's others (conftest.py)
pytestmark = pytest.mark.trains(("z3_fp32", 2), ("z2_bf16", 2), ("z1_fp16", 2))

# Not compared: the load's wall time.
_VARIES_BY_LAUNCH = {"load_seconds"}


def test_every_precision_at_one_m_shares_one_launch():
    jobs = [(2, "z3_fp32", "a", "ta", "va"), (3, "z2_fp32", "b", "tb", "vb"), (2, "z2_bf16", "c", "tc", "vc"),
            (2, "z1_fp16", "d", "td", "vd")]
    assert launches_of(jobs) == {2: [("z3_fp32", "a", "ta", "va"), ("z2_bf16", "c", "tc", "vc"),
                                     ("z1_fp16", "d", "td", "vd")],
                                 3: [("z2_fp32", "b", "tb", "vb")]}


@pytest.mark.e2e
def test_bf16_and_fp16_after_zero3_in_one_launch_match_their_own_launch(trained, tmp_path):
    z3, bf16, fp16 = (("z3_fp32", *trained("z3_fp32", 2)), ("z2_bf16", *trained("z2_bf16", 2)),
                      ("z1_fp16", *trained("z1_fp16", 2)))
    # check_checkpoints: one launch, or it raises (judge_together would fall back to one launch each)
    shared = check_checkpoints(2, [(variant, ckpt, truth, tmp_path / f"shared-{variant}.json")
                                   for variant, ckpt, truth in (z3, bf16, fp16)])
    assert shared[0]["ok"], shared[0]["mismatches"] or shared[0]["load_error"]  # the ZeRO-3 engine came first
    for (variant, ckpt, truth), in_shared in zip((bf16, fp16), shared[1:]):
        alone = judge(variant, 2, ckpt, truth, tmp_path / f"alone-{variant}.json")
        assert alone["ok"], alone["mismatches"] or alone["load_error"]
        assert in_shared["eval_loss"] == alone["eval_loss"] == in_shared["truth_eval_loss"]
        assert ({k: v for k, v in in_shared.items() if k not in _VARIES_BY_LAUNCH}
                == {k: v for k, v in alone.items() if k not in _VARIES_BY_LAUNCH}), json.dumps([in_shared, alone])
