"""DeepSpeed PipelineModule checkpoints (ZeRO-1): what a tag holds, and each stage's files rebuilt for a new dp.

    from reshard.formats.deepspeed_pipeline import is_pipeline, inspect_pipeline, write_stage_files
    if is_pipeline(tag_dir):
        source = inspect_pipeline(save_dir, tag)           # PipelineSource: pp, dp, stages, layer files
        write_stage_files(source, stage=1, target_dp=3, tag_dir=out)   # that stage's model + optim files

Files of a pipeline save (DeepSpeed 0.19.8, runtime/pipe/module.py `ckpt_layer_path`,
`save_state_dict`; runtime/engine.py `_get_ckpt_name`, `_save_checkpoint`):

    layer_{idx:02d}-model_states.pt          one per layer object with a state_dict, idx GLOBAL;
                                             a `-model_{tp:02d}` suffix only with a model axis
    mp_rank_{s:02d}_model_states.pt          one per stage s (the grid's model-parallel rank is the
                                             stage when there is no model axis): `module` None,
                                             `param_shapes` of the stage, dp/mp_world_size,
                                             checkpoint_parallel_dimensions {pp_degree, tp_degree}
    [bf16_]zero_pp_rank_{d}_mp_rank_{s:02d}_optim_states.pt
                                             ZeRO-1 partition of dp rank d over stage s's parameters

Each stage is its own data-parallel group: its optimizer files are an ordinary ZeRO-1 save over
the stage's parameters (a tied module's parameters sit in every stage holding it, named
`tied_modules.<key>.<param>`). With the number of stages unchanged, a new dp is therefore a
ZeRO-1 re-cut per stage, with the layer files unchanged; that is what this module writes.

Changing the number of stages is refused: a new layer-to-stage assignment needs the layer count
(trailing layers without a state_dict, and a TiedLayerSpec with a `forward_fn`, leave no file) and
the positions of the tied layers, neither of which the checkpoint records.

This is the whole-tensor path: a stage's optimizer files are loaded whole (memory-mapped), one
stage at a time per worker; it is not the bounded-memory round exchange of reshard.job.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

from reshard.errors import CheckpointError, UnsupportedCheckpoint
from reshard.formats import deepspeed_classes as classes
from reshard.formats import deepspeed_schema as schema
from reshard.layout import Zero12Group, zero12_group

LAYER_RE = re.compile(r"^layer_(\d+)(-model_(\d+))?-model_states\.pt$")
_STAGE_MODEL_RE = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")
OPTIM = schema.OPTIM
BASE = "base_optimizer_state"
FP32 = "single_partition_of_fp32_groups"


def is_pipeline(tag_dir: str) -> bool:
    """Whether the tag directory holds pipeline layer files (`layer_XX-...model_states.pt`)."""
    return os.path.isdir(tag_dir) and any(LAYER_RE.match(name) for name in os.listdir(tag_dir))


@dataclass(frozen=True)
class PipelineStage:
    """One pipeline stage's ZeRO-1 layout, from its model-states file."""

    index: int
    names: tuple[tuple[str, ...], ...]
    """Per optimizer param group, the stage's trainable parameter names in flat order."""
    numels: tuple[tuple[int, ...], ...]
    """Per group, the element count of each named parameter."""


@dataclass(frozen=True)
class PipelineSource:
    """What a pipeline tag directory holds."""

    save_dir: str
    tag: str
    pp: int
    dp: int
    bf16: bool
    bf16_optimizer: bool
    """BF16_Optimizer files (no `zero_stage`; fp32 partitions saved with their padding)."""
    stages: tuple[PipelineStage, ...]
    layer_files: tuple[str, ...]
    other_files: tuple[str, ...]
    """Files copied as they are besides the layer files (none known today; kept for safety)."""

    @property
    def tag_dir(self) -> str:
        return os.path.join(self.save_dir, self.tag)

    def model_path(self, stage: int = 0) -> str:
        return os.path.join(self.tag_dir, stage_model_name(stage))

    def optim_path(self, stage: int, dp_rank: int) -> str:
        return os.path.join(self.tag_dir, schema.optim_file_name(dp_rank, self.bf16, stage))

    def describe(self) -> str:
        optimizer = "BF16_Optimizer" if self.bf16_optimizer else "ZeRO-1"
        params = sum(len(group) for stage in self.stages for group in stage.names)
        return (f"pipeline pp={self.pp} dp={self.dp}, {optimizer}{' bf16' if self.bf16 else ''}, "
                f"{len(self.layer_files)} layer files, {params} stage parameters")


def stage_model_name(stage: int) -> str:
    return f"mp_rank_{stage:02d}_model_states.pt"


def load_whole(path: str, trust_pickle: bool = False):
    """A DeepSpeed file as torch loads it, with reshard's stand-ins for DeepSpeed's classes."""
    import torch
    torch.serialization.add_safe_globals(schema.safe_globals())
    try:
        return torch.load(path, map_location="cpu", mmap=True, weights_only=not trust_pickle)
    except Exception as error:
        raise CheckpointError(path, f"cannot be read: {error}") from error


def inspect_pipeline(save_dir: str, tag: str, trust_pickle: bool = False) -> PipelineSource:
    """Read the model-states file of every stage and the first optimizer file of each; refuse by
    name what the per-stage ZeRO-1 re-cut does not handle."""
    tag_dir = os.path.join(save_dir, tag)
    names = sorted(os.listdir(tag_dir))
    layer_files, stage_models, optims, others = [], {}, {}, []
    for name in names:
        path = os.path.join(tag_dir, name)
        if match := LAYER_RE.match(name):
            if match[2]:
                raise UnsupportedCheckpoint(path, "is a layer file of a pipeline with a model (tensor-parallel) axis; "
                                                  "only pipelines without one are supported")
            layer_files.append(name)
        elif match := _STAGE_MODEL_RE.match(name):
            stage_models[int(match[1])] = name
        elif (role := schema.classify(name)).kind == "optim":
            optims[(role.mp_rank, role.dp_rank)] = role
        elif os.path.isdir(path) or name.startswith("."):
            continue
        else:
            others.append(name)
    if not stage_models:
        raise CheckpointError(tag_dir, "has pipeline layer files but no mp_rank_XX_model_states.pt")
    pp = len(stage_models)
    if sorted(stage_models) != list(range(pp)):
        raise CheckpointError(tag_dir, f"has stage model files {sorted(stage_models)}; expected 0..{pp - 1}")
    stages, dp, bf16_flags, bf16_optimizer = [], None, {role.bf16 for role in optims.values()}, None
    if len(bf16_flags) > 1:
        raise CheckpointError(tag_dir, "holds optimizer files with and without the bf16_ prefix")
    bf16 = bf16_flags.pop() if bf16_flags else False
    for stage in range(pp):
        model_path = os.path.join(tag_dir, stage_model_name(stage))
        model = load_whole(model_path, trust_pickle)
        dims = model.get("checkpoint_parallel_dimensions") or {}
        if dims.get("tp_degree", 1) != 1:
            raise UnsupportedCheckpoint(model_path, f"has tp_degree {dims['tp_degree']}: pipelines with a model "
                                                    "axis are not supported")
        if dims.get("pp_degree", pp) != pp or model.get("mp_world_size") != pp:
            raise CheckpointError(model_path, f"says pp_degree {dims.get('pp_degree')} and mp_world_size "
                                              f"{model.get('mp_world_size')}, but {pp} stage files are present")
        if model.get("module") is not None:
            raise UnsupportedCheckpoint(model_path, "holds module weights; a pipeline stage file holds none")
        if model.get("frozen_param_fragments") or model.get("frozen_param_shapes"):
            raise UnsupportedCheckpoint(model_path, "records frozen parameters; not supported for pipelines yet")
        stage_dp = model.get("dp_world_size")
        dp = stage_dp if dp is None else dp
        if stage_dp != dp:
            raise CheckpointError(model_path, f"has dp_world_size {stage_dp}, stage 0 has {dp}")
        missing = [d for d in range(dp) if (stage, d) not in optims]
        if missing:
            raise CheckpointError(os.path.join(tag_dir, schema.optim_file_name(missing[0], bf16, stage)),
                                  f"is missing: dp_world_size is {dp}, so stage {stage} has {dp} optimizer files")
        first = load_whole(os.path.join(tag_dir, schema.optim_file_name(0, bf16, stage)), trust_pickle)[OPTIM]
        stage_bf16_optimizer = _check_optimizer(first, os.path.join(tag_dir, schema.optim_file_name(0, bf16, stage)),
                                                model, dp)
        if bf16_optimizer is not None and stage_bf16_optimizer != bf16_optimizer:
            raise CheckpointError(model_path, "stages were saved by different optimizer wrappers")
        bf16_optimizer = stage_bf16_optimizer
        groups = [list(shapes.items()) for shapes in model["param_shapes"]]
        stages.append(PipelineStage(stage, tuple(tuple(n for n, _ in g) for g in groups),
                                    tuple(tuple(_numel(s) for _, s in g) for g in groups)))
    extra = sorted(key for key in optims if key[0] >= pp or key[1] >= dp)
    if extra:
        raise CheckpointError(os.path.join(tag_dir, schema.optim_file_name(extra[0][1], bf16, extra[0][0])),
                              f"should not exist: the save has {pp} stages of {dp} dp ranks")
    return PipelineSource(save_dir, tag, pp, dp, bf16, bool(bf16_optimizer), tuple(stages), tuple(layer_files),
                          tuple(others))


def _numel(shape) -> int:
    count = 1
    for size in shape:
        count *= int(size)
    return count


def _check_optimizer(osd: dict, path: str, model: dict, dp: int) -> bool:
    """Whether the stage was saved by BF16_Optimizer; refuse what a plain re-cut would get wrong."""
    if FP32 not in osd or "partition_count" not in osd:
        raise UnsupportedCheckpoint(path, "is not a ZeRO-1 optimizer file (no single_partition_of_fp32_groups); "
                                          "pipeline checkpoints are supported under ZeRO stage 1 only")
    bf16_optimizer = "zero_stage" not in osd
    if bf16_optimizer:  # bf16 under ZeRO stage 0; with a tied layer DeepSpeed cannot load its own save
        raise UnsupportedCheckpoint(path, "was saved by BF16_Optimizer (bf16 with ZeRO stage 0); pipeline "
                                          "checkpoints are supported under ZeRO stage 1 only (DeepSpeed 0.19.8 "
                                          "itself fails to load such a save with a tied layer, "
                                          "bf16_optimizer.py _load_legacy_checkpoint)")
    if int(osd["zero_stage"]) != 1:
        raise UnsupportedCheckpoint(path, f"has ZeRO stage {int(osd['zero_stage'])}; the pipeline engine allows 0 or 1 "
                                          "and reshard supports 1")
    if any(any(group) for group in osd.get("param_alignment_paddings") or []):
        raise UnsupportedCheckpoint(path, "uses parameter_alignment paddings; not supported for pipelines yet")
    zero_config = (model.get("ds_config") or {}).get("zero_optimization") or {}
    if zero_config.get("round_robin_gradients"):
        raise UnsupportedCheckpoint(path, "uses round_robin_gradients; not supported for pipelines yet")
    if list(osd["partition_count"]) != [dp] * len(osd[FP32]):
        raise CheckpointError(path, f"has partition_count {list(osd['partition_count'])}, dp_world_size is {dp}")
    if len(model["param_shapes"]) != len(osd[FP32]):
        raise CheckpointError(path, f"has {len(osd[FP32])} param groups, the stage's param_shapes {len(model['param_shapes'])}")
    return bf16_optimizer


def _group_layout(stage: PipelineStage, group: int, dp: int) -> Zero12Group:
    numels = stage.numels[group]
    return zero12_group(range(len(numels)), numels, dp)


def _joined(parts: list, layouts: list[Zero12Group], group: int, path_of) -> "torch.Tensor":
    """The stage group's flat tensor without its tail padding, from every source rank's partition."""
    import torch
    layout = layouts[group]
    pieces = []
    for rank, part in enumerate(parts):
        lean = layout.lean_numel(rank)
        if part.numel() < lean:
            raise CheckpointError(path_of(rank), f"group {group} holds {part.numel()} elements, {lean} expected")
        pieces.append(part.reshape(-1)[:lean])
    return torch.cat(pieces)[:layout.padded_numel]


def _cut(flat, layout: Zero12Group, rank: int, lean: bool):
    """Rank `rank`'s partition of `flat` at `layout`: zero-padded to the partition size, or without
    its tail padding when `lean` (DeepSpeedZeroOptimizer's saved fp32 partition)."""
    import torch
    start = rank * layout.partition_numel
    size = layout.lean_numel(rank) if lean else layout.partition_numel
    out = torch.zeros(size, dtype=flat.dtype)
    piece = flat[start:start + size]
    out[:piece.numel()] = piece
    return out


def target_optimizers(source: PipelineSource, stage: int, target_dp: int, trust_pickle: bool = False) -> list[dict]:
    """Every target dp rank's optimizer file content for `stage`, from the stage's source files.

    Mirrors runtime/zero/stage_1_and_2.py (`__init__`: flat group padded to a multiple of
    2 * dp, `partition_size`, `groups_padding`; `_create_param_mapping`) and
    runtime/bf16_optimizer.py (`_setup_for_real_optimizer`, `state_dict`), through
    reshard.layout's Zero12Group. Tensors of the base optimizer's state whose size equals the
    partition (Adam's moments, any other per-element state) are re-cut; scalars are copied."""
    spec = source.stages[stage]
    paths = [source.optim_path(stage, rank) for rank in range(source.dp)]
    files = [load_whole(path, trust_pickle) for path in paths]
    osds = [f[OPTIM] for f in files]
    groups = len(spec.names)
    old = [_group_layout(spec, g, source.dp) for g in range(groups)]
    new = [_group_layout(spec, g, target_dp) for g in range(groups)]
    lean_masters = not source.bf16_optimizer
    masters = [_joined([osd[FP32][g] for osd in osds], old, g, paths.__getitem__) for g in range(groups)]
    moments = []
    for g in range(groups):
        states = [osd[BASE]["state"].get(g, {}) for osd in osds]
        keys = [key for key, value in states[0].items()
                if hasattr(value, "numel") and value.dim() == 1 and value.numel() == old[g].partition_numel]
        moments.append({key: _joined([state[key] for state in states], old, g, paths.__getitem__) for key in keys})
    outputs = []
    for rank in range(target_dp):
        osd = dict(osds[0])
        osd[FP32] = [_cut(masters[g], new[g], rank, lean_masters) for g in range(groups)]
        base = dict(osds[0][BASE])
        base["state"] = {}
        for g in range(groups):
            state = dict(osds[0][BASE]["state"].get(g, {}))
            state.update({key: _cut(flat, new[g], rank, lean=False) for key, flat in moments[g].items()})
            base["state"][g] = state
        osd[BASE] = base
        osd["partition_count"] = [target_dp] * groups
        osd["group_paddings"] = [new[g].bf16_optimizer_padding(rank) if source.bf16_optimizer
                                 else new[g].tail_padding(rank) for g in range(groups)]
        osd["param_slice_mappings"] = [
            {spec.names[g][pid]: classes.fragment_address(numel, start)
             for pid, numel, start in new[g].slice_mappings(rank, spec.numels[g])} for g in range(groups)]
        outputs.append({**files[0], OPTIM: osd})
    return outputs


def write_stage_files(source: PipelineSource, stage: int, target_dp: int, tag_dir: str,
                      trust_pickle: bool = False) -> list[str]:
    """Write stage `stage`'s model-states file (dp_world_size updated) and its `target_dp` optimizer
    files into `tag_dir`; return the paths written."""
    import torch
    model = load_whole(source.model_path(stage), trust_pickle)
    model["dp_world_size"] = target_dp
    paths = [os.path.join(tag_dir, stage_model_name(stage))]
    torch.save(model, paths[0], pickle_module=classes)
    for rank, tree in enumerate(target_optimizers(source, stage, target_dp, trust_pickle)):
        path = os.path.join(tag_dir, schema.optim_file_name(rank, source.bf16, stage))
        torch.save(tree, path, pickle_module=classes)
        paths.append(path)
    return paths
