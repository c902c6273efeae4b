"""The DCP export's pure parts and its torch blobs, with no process started.

    python -m pytest tests/test_dcp_format.py -q

Row-block chunks and how they are dealt (`dcp_layout`), a reserved torch.save blob filled at its
offset equal to torch.save's own (`dcp_format`), and DeepSpeed's optimizer settings mapped to torch
AdamW's or refused by name (`dcp_optimizer`). End to end, with FSDP2 loading the exports, see
tests/test_export_dcp.py.
"""
from __future__ import annotations

import io
import os
import zipfile
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from threaded_transport import run_workers

from reshard.errors import ReshardError, UnsupportedCheckpoint
from reshard.export import export_dcp
from reshard.export.dcp_format import blob_template, fill_crc
from reshard.export.dcp_layout import dcp_layout, row_blocks
from reshard.export.dcp_optimizer import adamw_group, check_adam_states
from reshard.export.hf_layout import ExportTensor
from reshard.layouts.zero import Stream


def test_row_blocks_cut_dim_0_and_keep_at_least_one_row():
    chunks = row_blocks(0, (11, 7), 77, chunk_bytes=64)  # 2 rows of 28 bytes fit in 64
    assert [(c.row, c.rows, c.element, c.numel) for c in chunks] == [
        (0, 2, 0, 14), (2, 2, 14, 14), (4, 2, 28, 14), (6, 2, 42, 14), (8, 2, 56, 14), (10, 1, 70, 7)]
    assert [(c.row, c.rows) for c in row_blocks(0, (3, 100), 300, chunk_bytes=8)] == [(0, 1), (1, 1), (2, 1)]
    scalar = row_blocks(0, (), 1, chunk_bytes=64)
    assert len(scalar) == 1 and scalar[0].offsets(()) == () and scalar[0].sizes(()) == ()


def test_chunks_dealt_in_order_tile_the_optimizer_space():
    tensors = [ExportTensor("a", (10, 3), "float32", "optim", 0), ExportTensor("buf", (4,), "float32", "whole", -1),
               ExportTensor("b", (7,), "float32", "optim", 1), ExportTensor("c", (5, 2), "float32", "optim", 2)]
    layout = dcp_layout(tensors, {}, files=3, chunk_bytes=24)
    assert len(layout.files) == 3
    dealt = [c for chunks in layout.files for c in chunks]
    assert [c.tensor for c in dealt] == sorted(c.tensor for c in dealt)  # in order, runs per file
    assert all(layout.tensors[c.tensor].source == "optim" for c in dealt)  # "whole" tensors are not chunked
    pieces = layout.pieces("optim", [30, 7, 10])
    assert pieces.total == 47 and int(pieces.length.sum()) == 47  # from_unsorted checks the tiling too
    sizes = [sum(c.numel for c in chunks) for chunks in layout.files]
    assert max(sizes) - min(sizes) <= 12, sizes
    assert dcp_layout(tensors[:1], {}, files=8, chunk_bytes=1 << 20).files.__len__() == 1  # never an empty file


@pytest.mark.parametrize("shape,dtype", [((6, 7), "float32"), ((), "float32"), ((5,), "bfloat16"), ((0, 3), "float32")])
def test_a_reserved_blob_filled_at_its_offset_is_torch_save_of_the_chunk(tmp_path, shape, dtype):
    value = torch.randn(shape).to(getattr(torch, dtype))
    template = blob_template(shape, dtype)
    path = tmp_path / "blob"
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    try:
        os.ftruncate(fd, template.size)
        os.pwrite(fd, template.head, 0)
        os.pwrite(fd, template.tail, template.data_offset + template.data_bytes)
        os.pwrite(fd, value.reshape(-1).view(torch.uint8).numpy().tobytes(), template.data_offset)
        blob = SimpleNamespace(template=template, file_offset=0, data_at=template.data_offset)
        fill_crc(fd, blob, lambda f, n, o: os.pread(f, n, o), lambda f, b, o: os.pwrite(f, b, o))
    finally:
        os.close(fd)
    ours = path.read_bytes()
    reference = io.BytesIO()
    torch.save(value.clone(), reference)
    theirs = reference.getvalue()
    assert len(ours) == len(theirs)
    a, b = zipfile.ZipFile(io.BytesIO(ours)), zipfile.ZipFile(io.BytesIO(theirs))
    assert a.testzip() is None  # every CRC-32 right
    assert [i.filename for i in a.infolist()] == [i.filename for i in b.infolist()]
    for info in a.infolist():  # every record the same bytes but the random serialization id
        if not info.filename.endswith("serialization_id"):
            assert a.read(info) == b.read(info), info.filename
            assert info.header_offset == b.getinfo(info.filename).header_offset
    assert torch.equal(torch.load(io.BytesIO(ours), weights_only=True), value)


TORCH_ADAMW = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, "amsgrad": False,
               "maximize": False, "foreach": None, "capturable": False, "differentiable": False, "fused": None,
               "decoupled_weight_decay": True, "initial_lr": 1e-3, "name": "decay", "params": [0]}


def test_a_torch_adamw_group_keeps_its_hyperparameters_and_names_its_params():
    group = adamw_group(TORCH_ADAMW, ["a.weight", "b.weight"], {}, "optim.pt")
    assert group == {**{k: v for k, v in TORCH_ADAMW.items() if k != "params"}, "params": ["a.weight", "b.weight"]}


def test_deepspeed_fused_adam_groups_map_by_the_configs_mode():
    fused = {"lr": 1e-3, "bias_correction": True, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01,
             "params": [0]}
    group = adamw_group(fused, ["w"], {"optimizer": {"type": "AdamW"}}, "optim.pt")
    assert "bias_correction" not in group and group["decoupled_weight_decay"] is True
    assert group["betas"] == (0.9, 0.999) and group["weight_decay"] == 0.01
    assert adamw_group(fused, ["w"], {"optimizer": {"type": "Adam"}}, "optim.pt")["lr"] == 1e-3  # adam_w_mode default
    with pytest.raises(UnsupportedCheckpoint, match="L2, adam_w_mode false"):
        adamw_group(fused, ["w"], {"optimizer": {"type": "Adam", "params": {"adam_w_mode": False}}}, "optim.pt")
    with pytest.raises(UnsupportedCheckpoint, match="bias_correction false"):
        adamw_group({**fused, "bias_correction": False}, ["w"], {"optimizer": {"type": "AdamW"}}, "optim.pt")


def test_what_torch_adamw_cannot_continue_is_refused_by_name():
    with pytest.raises(UnsupportedCheckpoint, match="L2"):
        adamw_group({**TORCH_ADAMW, "decoupled_weight_decay": False}, ["w"], {}, "optim.pt")
    assert adamw_group({**TORCH_ADAMW, "decoupled_weight_decay": False, "weight_decay": 0.0}, ["w"], {}, "x")
    with pytest.raises(UnsupportedCheckpoint, match="amsgrad"):
        adamw_group({**TORCH_ADAMW, "amsgrad": True}, ["w"], {}, "optim.pt")
    with pytest.raises(UnsupportedCheckpoint, match="no betas/eps"):
        adamw_group({"lr": 0.1, "momentum": 0.9, "params": [0]}, ["w"], {}, "optim.pt")
    sgd = SimpleNamespace(spec=SimpleNamespace(streams=(Stream("fp32", "float32", 4),
                                                        Stream("momentum_buffer", "float32", 4))),
                          optim_path=lambda rank: f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
    with pytest.raises(UnsupportedCheckpoint, match="momentum_buffer.*AdamW"):
        check_adam_states(sgd)


def test_a_broken_pipeline_save_is_refused_naming_a_file_and_nothing_is_written(tmp_path):
    """A hand-made directory with a pipeline layer file's name and nothing else: pipeline saves are served
    (tests/test_export_dcp.py), this one is refused by the pipeline inspection, naming what is missing."""
    save = tmp_path / "save"
    (save / "global_step1").mkdir(parents=True)
    (save / "latest").write_text("global_step1")
    (save / "global_step1" / "layer_00-model_states.pt").write_bytes(b"")
    out = tmp_path / "out"
    with pytest.raises(ReshardError, match=str(save / "global_step1")):
        run_workers(1, lambda t: export_dcp(str(save), str(out), transport=t))
    assert not out.exists()
    assert np.array_equal(sorted(os.listdir(save / "global_step1")), ["layer_00-model_states.pt"])


def test_moe_exports_name_autoep_slices_by_their_fused_tensor_and_refuse_what_no_test_covers():
    # the model at ep 1: a native expert keeps its (global) name, an AutoEP expert slice is its fused tensor's
    from reshard.export.hf_layout import export_names, refuse_unnamed_experts
    from reshard.layouts.experts import ExpertParams
    from reshard.layouts.zero import ParamSpec
    params = [ParamSpec("dense.weight", (3, 2))] + [ParamSpec(f"l.0.mlp.experts.w1.{g}", (4, 2)) for g in range(2)]
    autoep = ExpertParams.of(params, (False, True), (2,), ("l.0.mlp.experts.",), autoep=True)
    assert export_names(SimpleNamespace(params=params, experts=autoep)) == ["dense.weight"] + ["l.0.mlp.experts.w1"] * 2
    native = [ParamSpec("moe.0.deepspeed_moe.experts.deepspeed_experts.1.fc1.weight", (4, 2))]
    assert export_names(SimpleNamespace(params=native, experts=None)) == [native[0].name]

    def source(stage, tensor=None):
        return SimpleNamespace(spec=SimpleNamespace(experts=autoep, tensor=tensor, stage=stage),
                               model_path=lambda rank=0: "/ckpt/global_step3/mp_rank_00_model_states.pt")
    refuse_unnamed_experts(source(2), "DCP")  # ZeRO-1/2 and BF16_Optimizer: served
    refuse_unnamed_experts(source(3), "DCP")  # AutoEP at ZeRO-3: served (tests/test_export_dcp.py autoep_z3_fp32)
    refuse_unnamed_experts(source(2, tensor=object()), "DCP")  # folded TP+EP at ZeRO-1/2: served (DCP)
    with pytest.raises(UnsupportedCheckpoint, match="mp_rank_00_model_states.pt: is a ZeRO-3 AutoEP mixture-of-experts "
                                                    "checkpoint folded with AutoTP; exporting it to DCP"):
        refuse_unnamed_experts(source(3, tensor=object()), "DCP")
