"""DeepSpeed's pickled classes without DeepSpeed: same bytes out, DeepSpeed's classes on load.

    python -m pytest -q tests/test_deepspeed_classes.py
"""
from __future__ import annotations

import io
import subprocess
import sys
from collections import OrderedDict

import pytest
import torch

from reshard.formats.deepspeed_files import deepspeed_classes as classes

# the checkpoints its tests ask `trained` for, trained with the session's others (conftest.py)
pytestmark = pytest.mark.trains(("z1_fp16", 2))


def _deepspeed_object():
    """An optimizer-states-like object built from DeepSpeed's own classes."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address
    return {"optimizer_state_dict": {
        "loss_scaler": DynamicLossScaler(init_scale=2.0 ** 16, scale_window=7, min_scale=1,
                                         delayed_shift=2, consecutive_hysteresis=False, raise_error_at_min_scale=True,
                                         dtype=torch.float16),
        "static": LossScaler(scale=128.0),
        "zero_stage": ZeroStageEnum.gradients,
        "again": ZeroStageEnum.gradients,
        "param_slice_mappings": [OrderedDict((f"layer.{i}.weight", fragment_address(numel=7 * i + 1, start=3 * i))
                                             for i in range(5))],
        "partition": torch.arange(10, dtype=torch.float32),
        "clip_grad": 1.0, "ds_version": "0.19.8", "blob": b"\x00\x01"}}


def _saved(obj, **kwargs) -> bytes:
    out = io.BytesIO()
    torch.save(obj, out, **kwargs)
    return out.getvalue()


def test_stand_ins_repickle_byte_for_byte_and_load_as_deepspeed_classes():
    original = _saved(_deepspeed_object())
    torch.serialization.add_safe_globals(classes.safe_globals())
    stand_in = torch.load(io.BytesIO(original), weights_only=True)
    osd = stand_in["optimizer_state_dict"]
    assert type(osd["loss_scaler"]) is classes.DynamicLossScaler and osd["loss_scaler"].cur_scale == 2.0 ** 16
    assert osd["zero_stage"] is classes.ZeroStageEnum.gradients
    assert osd["param_slice_mappings"][0]["layer.2.weight"] == classes.fragment_address(numel=15, start=6)
    assert _saved(stand_in, pickle_module=classes) == original

    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    reloaded = torch.load(io.BytesIO(_saved(stand_in, pickle_module=classes)), weights_only=False)
    scaler = reloaded["optimizer_state_dict"]["loss_scaler"]
    assert type(scaler) is DynamicLossScaler and scaler.cur_scale == 2.0 ** 16 and scaler.scale_window == 7
    assert reloaded["optimizer_state_dict"]["zero_stage"] is ZeroStageEnum.gradients

    real = classes.to_deepspeed(stand_in)
    assert type(real["optimizer_state_dict"]["loss_scaler"]) is DynamicLossScaler
    assert real["optimizer_state_dict"]["partition"] is osd["partition"]  # tensors are not copied
    assert _saved(real) == original


@pytest.mark.e2e
def test_inspecting_and_writing_a_checkpoint_does_not_import_deepspeed(trained, tmp_path):
    source, _ = trained("z1_fp16", 2)
    code = ("import sys; from reshard.jobs.collective_job import reshard_checkpoint; "
            f"reshard_checkpoint({str(source)!r}, {str(tmp_path / 'dst')!r}, 3, quiet=True); "
            "assert 'deepspeed' not in sys.modules, sorted(m for m in sys.modules if m.startswith('deepspeed'))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "dst" / "latest").is_file()


def test_objects_for_a_live_engine_get_torchs_own_dtype_and_size():
    """Read without torch, a loss scaler's dtype is a stand-in; DeepSpeed must get torch.float16."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    from reshard.formats.torch_bytes.torch_classes import TorchSize, torch_global
    scaler = classes.DynamicLossScaler()
    scaler.__dict__.update(cur_scale=65536.0, dtype=torch_global("torch.float16"))
    real = classes.to_deepspeed({"loss_scaler": scaler, "shapes": [TorchSize((2, 3))], "dtype": torch_global("torch.bfloat16")})
    assert type(real["loss_scaler"]) is DynamicLossScaler
    assert real["loss_scaler"].dtype is torch.float16 and real["loss_scaler"].cur_scale == 65536.0
    assert type(real["shapes"][0]) is torch.Size and real["shapes"][0] == torch.Size([2, 3])
    assert real["dtype"] is torch.bfloat16
