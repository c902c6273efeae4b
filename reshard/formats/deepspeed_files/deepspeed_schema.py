"""DeepSpeed 0.19.8 checkpoint schema in one place: file names, where partitioned tensors sit.

    from reshard.formats.deepspeed_files.deepspeed_schema import optim_file_name, classify
    optim_file_name(dp_rank=3, bf16=True)    # "bf16_zero_pp_rank_3_mp_rank_00_optim_states.pt"
    classify("mp_rank_00_model_states.pt")   # FileRole("model", dp_rank=None, mp_rank=0, bf16=False)

A save directory holds `latest` (the tag, no newline) and one directory per tag. Inside a tag
(runtime/engine.py: `_get_ckpt_name`, `_get_rank_zero_ckpt_name`):

    mp_rank_{mp:02d}_model_states.pt                       ZeRO-1/2, written by dp rank 0
    zero_pp_rank_{dp}_mp_rank_{mp:02d}_model_states.pt     ZeRO-3, one per dp rank
    [bf16_]zero_pp_rank_{dp}_mp_rank_{mp:02d}_optim_states.pt   one per dp rank;
                                                           "bf16_" iff bf16.enabled
    layer_{L}_expert_{G}_mp_rank_00_model_states.pt        native MoE: MoE layer L, GLOBAL expert G
                                                           (`_get_expert_ckpt_name`), keys global too

Model-states file (`_save_checkpoint`, `_common_checkpoint_state`; client_state merged at
the top level):
    module, buffer_names, optimizer (None), param_shapes, frozen_param_shapes,
    shared_params, frozen_param_fragments, lr_scheduler, data_sampler, random_ltd,
    skipped_steps, global_steps, global_samples, dp_world_size, mp_world_size,
    checkpoint_parallel_dimensions, ds_config, ds_version, <client_state keys...>

Optim-states file: {"optimizer_state_dict": OSD, "ds_config", "ds_version"} where OSD is
    ZeRO-1/2 (stage_1_and_2.py `state_dict`): loss_scaler, dynamic_loss_scale, overflow,
        clip_grad, base_optimizer_state {state: {g: {step, <partitioned>...}}, param_groups},
        single_partition_of_fp32_groups [g], zero_stage, group_paddings,
        param_alignment_paddings, partition_count [g], ds_version, param_slice_mappings [g]
    BF16_Optimizer (bf16_optimizer.py `state_dict`): clip_grad, base_optimizer_state,
        single_partition_of_fp32_groups [g] (padded), group_paddings, partition_count,
        ds_version, param_slice_mappings
    ZeRO-3 (stage3.py `_rigid_state_dict`): zero_stage, loss_scaler, dynamic_loss_scale,
        overflow, partition_count (int), optimizer_state_dict {state: {sub-group: {...}},
        param_groups[g].params = sub-group ids}, fp32_flat_groups [sub-group]
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from reshard.errors import CheckpointError
from reshard.formats.deepspeed_files import deepspeed_classes as classes

from reshard.topology import Topology

OPTIM = "optimizer_state_dict"
LATEST = "latest"
RECOVERY_SCRIPTS = ("zero_to_fp32.py", "zero_to_torch.py")  # engine.py: _copy_recovery_script

_OPTIM_RE = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_ZERO3_MODEL_RE = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$")
_MODEL_RE = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")
_EXPERT_RE = re.compile(r"^(expp_rank_\d+_mp_rank_\d+_optim_states|(layer_\d+_)?expert_\d+_mp_rank_\d+_model_states)\.pt$")
_LAYER_EXPERT_RE = re.compile(r"^layer_(\d+)_expert_(\d+)_mp_rank_00_model_states\.pt$")
_LAYER_EXPERT_MP_RE = re.compile(r"^layer_(\d+)_expert_(\d+)_mp_rank_(\d+)_model_states\.pt$")
_PIPELINE_RE = re.compile(r"^layer_\d+-model_\d+-model_states\.pt$|^layer_\d+-model_states\.pt$")


@dataclass(frozen=True)
class FileRole:
    """What a file in a tag directory is, by its name."""

    kind: str
    """"optim", "model" (ZeRO-1/2), "zero3_model", "expert", "pipeline" or "other"."""
    dp_rank: int | None = None
    mp_rank: int | None = None
    bf16: bool = False


def classify(name: str) -> FileRole:
    if m := _OPTIM_RE.match(name):
        return FileRole("optim", int(m[2]), int(m[3]), bool(m[1]))
    if m := _ZERO3_MODEL_RE.match(name):
        return FileRole("zero3_model", int(m[1]), int(m[2]))
    if m := _MODEL_RE.match(name):
        return FileRole("model", None, int(m[1]))
    if _EXPERT_RE.match(name):
        return FileRole("expert")
    if _PIPELINE_RE.match(name):
        return FileRole("pipeline")
    return FileRole("other")


def expert_file_index(name: str) -> tuple[int, int] | None:
    """(MoE layer, global expert) of a native MoE expert file (engine.py `_get_expert_ckpt_name`)."""
    match = _LAYER_EXPERT_RE.match(name)
    return (int(match[1]), int(match[2])) if match else None


def expert_file_mp_rank(name: str) -> int | None:
    """The tensor-parallel rank in a per-layer expert file's name, layer_{L}_expert_{G}_mp_rank_{XX}_...
    (engine.py `_get_expert_ckpt_name`: the saving rank's model-parallel rank), or None."""
    match = _LAYER_EXPERT_MP_RE.match(name)
    return int(match[3]) if match else None


def expert_file_index_any_mp(name: str) -> tuple[int, int] | None:
    """(MoE layer, global expert) of a per-layer expert file of any TP rank (AutoEP folded with
    AutoTP writes them under the writer's TP rank, reshard.formats.deepspeed_files.deepspeed_folding)."""
    match = _LAYER_EXPERT_MP_RE.match(name)
    return (int(match[1]), int(match[2])) if match else None


def expert_file_name(layer: int, expert: int, mp_rank: int = 0) -> str:
    return f"layer_{layer}_expert_{expert}_mp_rank_{mp_rank:02d}_model_states.pt"


def layer_file_name(index: int, model: int | None) -> str:
    """A PipelineModule's layer file (module.py `ckpt_layer_path`): `layer_XX-model_YY-model_states.pt` with a
    model axis, `layer_XX-model_states.pt` without (model None)."""
    return f"layer_{index:02d}" + ("" if model is None else f"-model_{model:02d}") + "-model_states.pt"


def optim_file_name(dp_rank: int, bf16: bool, mp_rank: int = 0) -> str:
    return f"{'bf16_' if bf16 else ''}zero_pp_rank_{dp_rank}_mp_rank_{mp_rank:02d}_optim_states.pt"


def model_file_name(stage: int, dp_rank: int = 0, mp_rank: int = 0) -> str:
    if stage == 3:
        return f"zero_pp_rank_{dp_rank}_mp_rank_{mp_rank:02d}_model_states.pt"
    return f"mp_rank_{mp_rank:02d}_model_states.pt"


def optim_file_name_of(topology: Topology, rank: int, bf16: bool) -> str:
    """The optim-states file of global rank `rank` of `topology` (the mp index is the tp rank, after
    the pipeline stages before it: stage * tp + tp rank, as PipelineModule saves name it)."""
    at = topology.coordinates(rank)
    return optim_file_name(at.dp, bf16, at.pp * topology.tp + at.tp)


def model_file_name_of(topology: Topology, rank: int, stage: int) -> str:
    """The model-states file global rank `rank` of `topology` reads (ZeRO-1/2: its tp rank's file)."""
    at = topology.coordinates(rank)
    return model_file_name(stage, at.dp, at.pp * topology.tp + at.tp)


def safe_globals() -> list:
    """The classes DeepSpeed pickles into its checkpoints, as stand-ins under DeepSpeed's names
    (see deepspeed_classes); nothing else is unpickled by default."""
    return classes.safe_globals()


def fragment_address(numel: int, start: int):
    """DeepSpeed's record type for `param_slice_mappings` values (written under its name)."""
    return classes.fragment_address(numel=numel, start=start)


# -- the partitions of an optimizer file, checked the same way on every road -------------------
# The ZeRO road (deepspeed_inspect.validate_optim_tree, on TensorRefs of the torch-free reader) and
# the pipeline road (deepspeed_pipeline, on memory-mapped torch tensors) both call these, so a
# wrong-sized or non-contiguous partition is refused alike, before anything is allocated from it.

def tensor_layout(value) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(shape, stride) of a tensor as either reader gives it (a TensorRef, or a torch tensor), or
    None for anything else."""
    shape, stride = getattr(value, "shape", None), getattr(value, "stride", None)
    if shape is None or stride is None or isinstance(value, type):
        return None
    stride = stride() if callable(stride) else stride
    return tuple(int(s) for s in shape), tuple(int(s) for s in stride)


def partition_problem(value, numel: int) -> str | None:
    """Why `value` is not a partition of `numel` elements as DeepSpeed saves one (a 1-D tensor
    stored contiguously: stage_1_and_2.py and stage3.py save flat views of a flat buffer), or None."""
    layout = tensor_layout(value)
    if layout is None:
        return f"is {type(value).__name__}, not a tensor"
    shape, stride = layout
    if len(shape) != 1 or shape[0] != numel:
        count = 1
        for size in shape:
            count *= size
        return f"has {count} elements (shape {list(shape)}), but its partition has {numel}"
    if numel > 1 and stride[0] != 1:
        return "is not stored contiguously"
    return None


def partitioned_state_keys(path: str, where: str, state: dict, numel: int, expected=None) -> list[str]:
    """The keys of one flat buffer's optimizer state (`state`: {key: value} of a torch optimizer's
    per-param state, the param being the partition of `numel` elements) that are partitioned like
    it, in order, refusing (CheckpointError naming the file, the key and both sizes) any other
    tensor that is not a scalar: under ZeRO the base optimizer sees one flat partition per group,
    so every per-element state (Adam's moments, Muon's momentum_buffer) has the partition's size,
    whatever its name, and only counters (`step`) are scalars. With `expected` (dp rank 0's keys),
    each of them must be present too."""
    if not isinstance(state, dict):
        raise CheckpointError(path, f"optimizer state of {where} is {type(state).__name__}, not a dict")
    keys = []
    for key, value in state.items():
        layout = tensor_layout(value)
        if layout is None:
            continue
        count = 1
        for size in layout[0]:
            count *= size
        if count == 1 and len(layout[0]) <= 1 and numel != 1:
            continue  # a scalar: step
        problem = partition_problem(value, numel)
        if problem:
            raise CheckpointError(path, f"optimizer state {key!r} of {where} {problem} (from another checkpoint "
                                        "or world size, or edited?)")
        keys.append(key)
    if expected is not None:
        if missing := [key for key in expected if key not in keys]:
            raise CheckpointError(path, f"has no optimizer state {missing[0]!r} of {where} (dp rank 0's file has one)")
        if extra := [key for key in keys if key not in expected]:
            raise CheckpointError(path, f"has optimizer state {extra[0]!r} of {where}, which dp rank 0's file has not")
    return keys
