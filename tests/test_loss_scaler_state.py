"""An fp16 run's loss scaler in the DCP export's run state: DeepSpeed's own scaler against torch's GradScaler.

    python -m pytest -q tests/test_loss_scaler_state.py

No process is started. DeepSpeed's `DynamicLossScaler` (the real class) runs some clean updates, with or
without an overflow behind it; `loss_scaler_state` turns it into a `torch.amp.GradScaler` state; then
both go on for more clean steps, DeepSpeed by `update_scale(False)`, a real GradScaler on CPU by
scale -> backward -> step -> update on a one-parameter model. The scales must agree step by step,
except the one documented case: with no clean update since the start or the last overflow,
GradScaler's first growth comes one step earlier.
"""
from __future__ import annotations

import pytest
import torch

from reshard.export.dcp_optimizer import loss_scaler_state

WINDOW = 3


def _deepspeed_scaler(clean_updates: int, overflow_at: int | None):
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler
    scaler = DynamicLossScaler(init_scale=2.0 ** 8, scale_window=WINDOW, min_scale=1, delayed_shift=1,
                               consecutive_hysteresis=False, dtype=torch.half)
    for _ in range(clean_updates):
        scaler.update_scale(False)
    if overflow_at is not None:  # what update_scale(True) records (it calls dist.get_rank() to log)
        scaler.cur_scale /= scaler.scale_factor
        scaler.last_overflow_iter = scaler.cur_iter
        scaler.cur_iter += 1
    return scaler


def _grad_scaler_scales(state: dict, steps: int) -> list[float]:
    param = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([param], lr=0.0)
    scaler = torch.amp.GradScaler("cpu")
    scaler.load_state_dict(state)
    scales = []
    for _ in range(steps):
        optimizer.zero_grad()
        scaler.scale(param.sum()).backward()
        scaler.step(optimizer)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales


@pytest.mark.parametrize("clean", range(1, 8))
def test_grad_scaler_grows_on_the_steps_deepspeed_grows(clean):
    scaler = _deepspeed_scaler(clean, None)
    carried = loss_scaler_state({"loss_scaler": scaler})
    assert carried["deepspeed"]["cur_scale"] == scaler.cur_scale and carried["deepspeed"]["dynamic"] is True
    ours = _grad_scaler_scales(carried["grad_scaler"], 10)
    theirs = []
    for _ in range(10):
        scaler.update_scale(False)
        theirs.append(scaler.cur_scale)
    assert ours == theirs


@pytest.mark.parametrize("overflow", [False, True])
@pytest.mark.parametrize("clean_after", range(0, 5))
def test_with_no_clean_update_yet_the_first_growth_comes_one_step_early(clean_after, overflow):
    """c = 0 (no update yet, or an overflow the update before): the one case that differs."""
    scaler = _deepspeed_scaler(4, overflow_at=4) if overflow else _deepspeed_scaler(0, None)
    for _ in range(clean_after):
        scaler.update_scale(False)
    carried = loss_scaler_state({"loss_scaler": scaler})
    ours = _grad_scaler_scales(carried["grad_scaler"], 10)
    theirs = []
    for _ in range(10):
        scaler.update_scale(False)
        theirs.append(scaler.cur_scale)
    if clean_after == 0:  # c = 0: DeepSpeed waits WINDOW + 1 clean updates, GradScaler WINDOW
        assert ours[WINDOW - 1] == 2 * theirs[WINDOW - 1] and ours[WINDOW:] != theirs[WINDOW:]
    else:
        assert ours == theirs


def test_fp32_and_bf16_runs_carry_no_scaler_and_a_static_scale_is_kept_as_it_is():
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    assert loss_scaler_state({"loss_scaler": LossScaler(scale=1.0)}) is None
    assert loss_scaler_state({}) is None  # BF16_Optimizer keeps none
    static = loss_scaler_state({"loss_scaler": LossScaler(scale=128.0)})
    assert static["deepspeed"]["cur_scale"] == 128.0 and static["grad_scaler"] is None
