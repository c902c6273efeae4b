"""A ZeRO stage change (`--target-stage`): the target spec, the plan's spaces, the target files.

    python -m reshard SRC DST --target-dp 3 --target-stage 3       # ZeRO-2 at 2 ranks -> ZeRO-3 at 3

    from reshard.formats.deepspeed_files.stage_change import zero_stage_target
    zero = zero_stage_target(source.spec, 3)           # StageChange(3); SameStage when it stays
    plan = zero.plan(source, Topology(dp=3), workers=2, budget_bytes=1 << 30)
    files = zero.files(source, Topology(dp=3), rank=1)

Whether the stage changes is decided once, by `zero_stage_target`: the job then plans, reads and
writes through the value it returns, and the reader (reshard.formats.deepspeed_files.source_reader) and writer
(reshard.formats.deepspeed_files.target_writer) take its `source_slots` and `files` without knowing of stages.

A stage change is a target layout of another stage over the same logical space: trainable
parameters in optimizer-group order, the same at every stage (`CheckpointSpec.params`). So the
optimizer space (fp32 masters and every per-partition state) is planned like any DP change, from
the piece tables of the two layouts (`reshard.planning.plan.plan_space`; the arithmetic ZeRO-3 planner of
`reshard.planning.chunked_plan` assumes both sides are ZeRO-3). Two more spaces move what the stages keep
in different places:

- "frozen": frozen parameters. ZeRO-1/2 keep them whole in the `module` of the one model-states
  file; ZeRO-3 keeps rank r's ceil(n/W) chunk of each in `frozen_param_fragments` of rank r's
  model-states file (engine.py `_get_zero_frozen_param_attributes` with
  `_get_param_fragment_func`: `ds_tensor` under ZeRO-3, the whole parameter otherwise).
- "module" (ZeRO-3 -> 1/2 only): ZeRO-1/2 save the low-precision module weights in full, a
  ZeRO-3 checkpoint holds none (its `module` has empty tensors). They are the fp32 masters cast
  to the module dtype: both optimizers copy the fp32 partition into the low-precision one after
  every step (stage_1_and_2.py `step`: `bit16_partitions[partition_id].data.copy_(fp32_partition)`;
  stage3.py `_reassign_or_swap_out_partitioned_parameters`), and a ZeRO-3 load rebuilds them the
  same way (stage3.py `_rigid_load_state_dict`, "restore fp16 partitions from fp32"). So this
  space moves the fp32 stream to rank 0's model file and the writer casts it on the way
  (`TargetFile.casts`).

The target files are built from the source's rank-0 trees, restructured into the target stage's
trees; every field is derived from DeepSpeed 0.19.8's rules, cited where it is set. What is
not derivable from the checkpoint is the target engine's own layout config: the ZeRO-1/2 target
of a ZeRO-3 source uses round_robin_gradients and parameter_alignment off (the defaults), the
ZeRO-3 target uses the source ds_config's sub_group_size (default 1e9). The engine loading the
output must be configured the same way (the written ds_config says so).
"""
from __future__ import annotations

import copy
import dataclasses
from collections import OrderedDict
from typing import Any, Union

import numpy as np

from reshard.errors import CheckpointError, UnsupportedCheckpoint
from reshard.formats.deepspeed_files import deepspeed_classes as classes
from reshard.formats.deepspeed_files import deepspeed_schema as schema
from reshard.formats.deepspeed_files.deepspeed_metadata import rank_metadata
from reshard.formats.deepspeed_files.deepspeed_schema import OPTIM as OPT
from reshard.formats.deepspeed_files.deepspeed_spec import CheckpointSpec, SourceCheckpoint, itemsize
from reshard.formats.deepspeed_files.deepspeed_target import TargetFile, own_storage, shape_type, target_files
from reshard.formats.torch_bytes.torch_archive import NewTensor, TensorRef
from reshard.layouts.zero import ParamSpec, PieceTable, Stream, buffer_numels, frozen_pieces, logical_bases, zero3_chunk
from reshard.planning.checkpoint_plan import plan_reshard
from reshard.planning.plan import Ownership, ReshardPlan, plan_space
from reshard.topology import Topology

STAGES = (1, 2, 3)


def is_stage_change(spec: CheckpointSpec, stage: int | None) -> bool:
    return stage is not None and stage != spec.stage


@dataclasses.dataclass(frozen=True)
class SameStage:
    """The target at the source's ZeRO stage: planned by reshard.planning.checkpoint_plan, its files
    those of reshard.formats.deepspeed_files.deepspeed_target.target_files, no source slots besides the partitions."""

    stage: int
    changed_to = None
    """The stage an output fingerprint records: none (fingerprints stay as before stage changes)."""

    def plan(self, source: SourceCheckpoint, target: Topology, workers: int, budget_bytes: int,
             ownership: Ownership | None = None, tabulated: bool = False) -> ReshardPlan:
        """`tabulated`: every space from its piece tables (an array task restricts the plan by them)."""
        return plan_reshard(source.spec, target, workers, budget_bytes, ownership=ownership, tabulated=tabulated)

    def notes(self, spec: CheckpointSpec) -> list[str]:
        return []

    def files(self, source: SourceCheckpoint, target: Topology, rank: int) -> list[TargetFile]:
        return target_files(source, target, rank)

    def source_slots(self, source: SourceCheckpoint, rank: int, found: dict) -> dict:
        return {}


@dataclasses.dataclass(frozen=True)
class StageChange:
    """The target at another ZeRO stage (this module's docstring): its own plan spaces, files and
    source slots."""

    stage: int

    @property
    def changed_to(self) -> int:
        """The stage an output fingerprint records."""
        return self.stage

    def plan(self, source: SourceCheckpoint, target: Topology, workers: int, budget_bytes: int,
             ownership: Ownership | None = None, tabulated: bool = True) -> ReshardPlan:
        """Every space from its piece tables, whatever `tabulated` asks (plan_stage_change)."""
        return plan_stage_change(source, target, self.stage, workers, budget_bytes, ownership)

    def notes(self, spec: CheckpointSpec) -> list[str]:
        return [stage_change_note(spec, self.stage)]

    def files(self, source: SourceCheckpoint, target: Topology, rank: int) -> list[TargetFile]:
        return stage_target_files(source, target, rank, self.stage)

    def source_slots(self, source: SourceCheckpoint, rank: int, found: dict) -> dict:
        return source_slots(source, rank, found, self.stage)


ZeroStageTarget = Union[SameStage, StageChange]


def zero_stage_target(spec: CheckpointSpec, stage: int | None) -> ZeroStageTarget:
    """The target's ZeRO stage as a value the job plans, reads and writes through: `stage`
    (--target-stage) when it differs from the source's, else the source's. Decided once per checkpoint."""
    return StageChange(stage) if is_stage_change(spec, stage) else SameStage(spec.stage)


def check_stage_change(spec: CheckpointSpec, stage: int, path: str) -> None:
    """Refuse what a stage change does not cover, naming the source."""
    if stage not in STAGES:
        raise UnsupportedCheckpoint(path, f"--target-stage must be 1, 2 or 3, got {stage!r}")
    if spec.optimizer != "zero":
        raise UnsupportedCheckpoint(path, "was saved by BF16_Optimizer (bf16 with ZeRO-1 and fp32 gradient "
                                          "accumulation); --target-stage converts DeepSpeedZeroOptimizer "
                                          "(stage 1/2) and ZeRO-3 checkpoints only")
    if spec.topology.tp != 1 or spec.topology.ep != 1 or spec.tensor is not None or spec.experts is not None:
        raise UnsupportedCheckpoint(path, "has tensor parallelism or mixture-of-experts layers; --target-stage "
                                          "covers data parallelism only")


def stage_change_note(spec: CheckpointSpec, stage: int) -> str:
    """What the summary says about a stage change: what the loading engine must be configured with."""
    new = target_spec(spec, stage)
    if stage == 3:
        layout = f"sub_group_size {spec.sub_group_size}"
    else:
        layout = (f"round_robin_gradients {'on' if new.round_robin else 'off'}, parameter_alignment "
                  f"{'on' if new.param_alignment > 1 else 'off'}")
    return (f"ZeRO stage {spec.stage} -> {stage}: load it in an engine configured with zero_optimization.stage "
            f"{stage} and {layout}; the output's ds_config names the stage")


def target_spec(spec: CheckpointSpec, stage: int) -> CheckpointSpec:
    """The spec of the target: same parameters, groups and streams, laid out at `stage`.

    ZeRO-1 and 2 share one layout (stage_1_and_2.py serves both); a ZeRO-3 side has no
    round-robin reordering or per-parameter alignment (stage3.py knows neither)."""
    if stage == spec.stage:
        return spec
    plain = stage == 3 or spec.stage == 3
    return dataclasses.replace(spec, stage=stage, round_robin=spec.round_robin and not plain,
                               param_alignment=1 if plain else spec.param_alignment)


def frozen_params(source: SourceCheckpoint) -> tuple[tuple[ParamSpec, ...], str | None]:
    """Frozen parameters in DeepSpeed's order (`module.parameters()`), and their dtype.

    ZeRO-3 lists them in `frozen_param_shapes` (the spec has them). ZeRO-1/2 keep them whole in
    `module`: every state-dict entry that is no trainable parameter, no buffer (`buffer_names`)
    and no tied alias (`shared_params`); a state dict lists parameters in the same pre-order as
    `parameters()`. A checkpoint saved with exclude_frozen_parameters has none."""
    spec = source.spec
    if spec.stage == 3:
        return spec.frozen, spec.frozen_dtype
    model = source.model_template
    module = model.get("module") or {}
    skip = {p.name for p in spec.params} | set(model.get("buffer_names") or ()) | set(model.get("shared_params") or {})
    frozen = [(name, ref) for name, ref in module.items() if name not in skip and isinstance(ref, TensorRef)]
    dtypes = {ref.dtype for _, ref in frozen}
    if len(dtypes) > 1:
        raise UnsupportedCheckpoint(source.model_path(0), f"frozen parameters of mixed dtypes {sorted(dtypes)}")
    return tuple(ParamSpec(name, ref.shape) for name, ref in frozen), (dtypes.pop() if dtypes else None)


def whole_on_rank0(numels) -> PieceTable:
    """Parameters kept whole by rank 0, parameter i as buffer i (ZeRO-1/2 module weights)."""
    numels = np.asarray(numels, dtype=np.int64)
    ids = np.flatnonzero(numels > 0)
    zeros = np.zeros(len(ids), dtype=np.int64)
    return PieceTable.from_unsorted(logical_bases(numels)[ids], zeros, ids, zeros, int(numels.sum()))


def _frozen_side(frozen, stage: int, world_size: int) -> tuple[PieceTable, tuple[int, ...]]:
    if stage == 3:
        return frozen_pieces(frozen, world_size), tuple(zero3_chunk(p.numel, world_size) for p in frozen)
    return whole_on_rank0([p.numel for p in frozen]), tuple(p.numel for p in frozen)


def plan_stage_change(source: SourceCheckpoint, target: Topology, stage: int, workers: int,
                      budget_bytes: int, ownership: Ownership | None = None) -> ReshardPlan:
    """Spaces "optim", then "frozen" (when either side is ZeRO-3), then "module" (3 -> 1/2).
    `ownership`: who reads and writes which ranks, when not the arithmetic blocks."""
    spec, new_spec = source.spec, target_spec(source.spec, stage)
    if ownership is None:
        ownership = Ownership.between(spec.topology, target, workers)
    new = new_spec.layout(target.dp)
    spaces = [plan_space("optim", spec.layout(spec.dp_world_size).pieces, new.pieces, spec.streams,
                         buffer_numels(new), ownership, budget_bytes)]
    frozen, dtype = frozen_params(source)
    if frozen and 3 in (spec.stage, stage):
        old_side, _ = _frozen_side(frozen, spec.stage, spec.dp_world_size)
        new_side, sizes = _frozen_side(frozen, stage, target.dp)
        spaces.append(plan_space("frozen", old_side, new_side, (Stream("frozen", dtype, itemsize(dtype)),), sizes,
                                 ownership, budget_bytes, round_offset=sum(s.rounds for s in spaces)))
    if spec.stage == 3:
        fp32 = next(s for s in spec.streams if s.name == "fp32")
        numels = [p.numel for p in spec.params]
        spaces.append(plan_space("module", spec.layout(spec.dp_world_size).pieces, whole_on_rank0(numels), (fp32,),
                                 numels, ownership, budget_bytes, round_offset=sum(s.rounds for s in spaces)))
    return ReshardPlan(ownership, tuple(spaces), budget_bytes)


def source_slots(source: SourceCheckpoint, rank: int, found: dict, stage: int) -> dict:
    """Slots the stage-change spaces read, besides the checked partitions `found` of `rank`
    ({slot: (path, TensorRef)}): the fp32 partitions again as the "module" space's source, and,
    from a ZeRO-1/2 source, the whole frozen parameters in rank 0's module."""
    extra = {}
    if source.spec.stage == 3:
        extra.update({("module",) + slot[1:]: where for slot, where in found.items()
                      if slot[0] == "optim" and slot[2] == "fp32"})
    elif stage == 3 and rank == 0:
        module = source.model_template.get("module") or {}
        for j, param in enumerate(frozen_params(source)[0]):
            ref = module[param.name]
            if not ref.is_contiguous:
                raise UnsupportedCheckpoint(source.model_path(0), f"frozen parameter {param.name} is not stored "
                                                                  "contiguously")
            extra[("frozen", j, "frozen")] = (source.model_path(0), ref)
    return extra


# --- target files ---------------------------------------------------------------------------

def stage_target_files(source: SourceCheckpoint, target: Topology, rank: int, stage: int) -> list[TargetFile]:
    """The files rank `rank` of `target` owns at ZeRO `stage` (engine.py `_get_ckpt_name`,
    `_get_zero_ckpt_name`: ZeRO-3 model states per rank, ZeRO-1/2 one file from dp rank 0)."""
    spec = source.spec
    new_spec = target_spec(spec, stage)
    at = target.coordinates(rank)
    layout = new_spec.layout(target.dp)
    files = [TargetFile(schema.optim_file_name_of(target, rank, spec.bf16_prefix),
                        _optim_tree(source, new_spec, layout, at.dp), source.optim_name(0))]
    if stage == 3:
        files.append(TargetFile(schema.model_file_name_of(target, rank, 3),
                                _zero3_model_tree(source, new_spec, layout, at.dp), source.model_name(0)))
    elif at.dp == 0:
        tree, casts = _zero12_model_tree(source, new_spec, layout)
        files.append(TargetFile(schema.model_file_name_of(target, rank, stage), tree, source.model_name(0), casts))
    return files


def _with_stage(config: Any, stage: int) -> Any:
    """ds_config as saved (engine.py `_save_zero_checkpoint` / `_common_checkpoint_state`: the
    engine's config dict), with zero_optimization.stage set to the target's."""
    config = copy.deepcopy(config)
    if isinstance(config, dict):
        zero = config.get("zero_optimization")
        config["zero_optimization"] = {**(zero if isinstance(zero, dict) else {}), "stage": stage}
    return config


def _source_group_states(source: SourceCheckpoint) -> tuple[list, list]:
    """(torch state entry, param_group) of each param group in the source optim tree: ZeRO-1/2
    index the torch state by group, ZeRO-3 by sub-group (the group's first one stands for it:
    every sub-group steps together)."""
    spec, osd = source.spec, source.optim_template[OPT]
    if spec.stage != 3:
        base = osd["base_optimizer_state"]
        return [base["state"].get(g) for g in range(len(spec.groups))], base["param_groups"]
    inner = osd[OPT]
    first = {}
    for sg_id, sg in enumerate(spec.layout(spec.dp_world_size).sub_groups):
        first.setdefault(sg.group, sg_id)
    return [inner["state"].get(first[g]) for g in range(len(spec.groups))], inner["param_groups"]


def _state_entry(template: dict | None, buffer: int, numel: int, streams, used: set) -> dict | None:
    if template is None:
        return None
    names = {s.name for s in streams}
    return {key: (NewTensor(("optim", buffer, key), numel, value.dtype, value.requires_grad)
                  if key in names and isinstance(value, TensorRef) else own_storage(value, used, ("optim", buffer, key)))
            for key, value in template.items()}


def _optim_tree(source: SourceCheckpoint, new_spec: CheckpointSpec, layout, rank: int) -> dict:
    spec = source.spec
    old_tree, old = source.optim_template, source.optim_template[OPT]
    group_states, param_groups = _source_group_states(source)
    meta = rank_metadata(new_spec, layout, rank)
    fp32 = next(s for s in spec.streams if s.name == "fp32")
    requires_grad = _fp32_requires_grad(source)
    if new_spec.stage == 3:
        states, used = {}, set()
        for sg_id, sg in enumerate(layout.sub_groups):
            entry = _state_entry(group_states[sg.group], sg_id, sg.partition_numel, spec.streams, used)
            if entry is not None:
                states[sg_id] = entry
        groups = [{**copy.deepcopy(g), "params": ids} for g, ids in zip(param_groups, meta.sub_group_ids)]
        # stage3.py `_rigid_state_dict`, in its order.
        osd = {"zero_stage": classes.ZeroStageEnum(3), "loss_scaler": copy.deepcopy(old["loss_scaler"]),
               "dynamic_loss_scale": old["dynamic_loss_scale"], "overflow": old["overflow"],
               "partition_count": meta.partition_count,
               OPT: {"state": states, "param_groups": groups},
               "fp32_flat_groups": [NewTensor(("optim", i, "fp32"), n, fp32.dtype, requires_grad)
                                    for i, n in enumerate(meta.fp32_numels)]}
    else:
        states, used = {}, set()
        for g in range(len(layout.groups)):
            entry = _state_entry(group_states[g], g, meta.buffer_numels[g], spec.streams, used)
            if entry is not None:
                states[g] = entry
        # torch Optimizer.state_dict numbers the one flat parameter of group g as g.
        groups = [{**copy.deepcopy(g), "params": [i]} for i, g in enumerate(param_groups)]
        if spec.stage == 3:
            config = old_tree.get("ds_config") or {}
            clip_grad = float(config.get("gradient_clipping", 0.0)) if isinstance(config, dict) else 0.0
            ds_version = old_tree.get("ds_version")
        else:
            clip_grad, ds_version = old["clip_grad"], old["ds_version"]
        # stage_1_and_2.py `state_dict`, in its order; clip_grad is the engine's
        # gradient_clipping (engine.py `_configure_zero_optimizer`), ds_version the saving version.
        osd = {"loss_scaler": copy.deepcopy(old["loss_scaler"]), "dynamic_loss_scale": old["dynamic_loss_scale"],
               "overflow": old["overflow"], "clip_grad": clip_grad,
               "base_optimizer_state": {"state": states, "param_groups": groups},
               "single_partition_of_fp32_groups": [NewTensor(("optim", g, "fp32"), n, fp32.dtype, requires_grad)
                                                   for g, n in enumerate(meta.fp32_numels)],
               "zero_stage": classes.ZeroStageEnum(new_spec.stage),
               "group_paddings": meta.group_paddings,
               "param_alignment_paddings": meta.param_alignment_paddings,
               "partition_count": meta.partition_count,
               "ds_version": ds_version,
               "param_slice_mappings": [OrderedDict((name, schema.fragment_address(numel, start))
                                                    for name, numel, start in group)
                                        for group in meta.slice_mappings]}
    tree = {key: copy.deepcopy(value) for key, value in old_tree.items() if key != OPT}
    tree = {OPT: osd, **tree}
    tree["ds_config"] = _with_stage(old_tree.get("ds_config"), new_spec.stage)
    return tree


def _fp32_requires_grad(source: SourceCheckpoint) -> bool:
    osd = source.optim_template[OPT]
    flats = osd["fp32_flat_groups"] if source.spec.stage == 3 else osd["single_partition_of_fp32_groups"]
    return bool(flats and isinstance(flats[0], TensorRef) and flats[0].requires_grad)


def _shapes(spec: CheckpointSpec, param_ids, size: type) -> OrderedDict:
    """`size`: the source's shape type (torch.Size or its torch-free stand-in; deepspeed_target.shape_type)."""
    return OrderedDict((spec.params[p].name, size(spec.params[p].shape)) for p in param_ids)


def _model_common(source: SourceCheckpoint, new_spec: CheckpointSpec, layout) -> dict:
    tree = copy.deepcopy(source.model_template)
    tree["dp_world_size"] = layout.world_size
    tree["ds_config"] = _with_stage(tree.get("ds_config"), new_spec.stage)
    return tree


def _zero3_model_tree(source: SourceCheckpoint, new_spec: CheckpointSpec, layout, rank: int) -> dict:
    """engine.py `_save_checkpoint` under ZeRO-3: `module` holds empty tensors for every parameter
    (partitioned: `param.data` is empty) and the buffers in full; `param_shapes` per sub-group
    (`_get_zero_param_shapes`); frozen shapes and this rank's chunk of each frozen parameter;
    `shared_params` filled on global rank 0 only (`_get_shared_params`)."""
    spec = source.spec
    tree = _model_common(source, new_spec, layout)
    buffers = set(tree.get("buffer_names") or ())
    module = tree.get("module")
    if isinstance(module, dict):
        for name, value in module.items():
            if name not in buffers and isinstance(value, (TensorRef, NewTensor)):
                module[name] = NewTensor(("empty", name), 0, value.dtype, False)
    size = shape_type(source.model_template)
    tree["param_shapes"] = [_shapes(new_spec, sg.params, size) for sg in layout.sub_groups]
    frozen, dtype = frozen_params(source)
    # A ZeRO-2 save with exclude_frozen_parameters has None here, and so has a ZeRO-3 one. A
    # ZeRO-1 save never has them (stage 1 does not save them), so its module tells.
    if spec.stage == 1 or tree.get("frozen_param_shapes") is not None:
        tree["frozen_param_shapes"] = OrderedDict((p.name, size(p.shape)) for p in frozen)
        tree["frozen_param_fragments"] = OrderedDict(
            (p.name, NewTensor(("frozen", j, "frozen"), zero3_chunk(p.numel, layout.world_size), dtype))
            for j, p in enumerate(frozen))
    if rank != 0 and isinstance(tree.get("shared_params"), dict):
        tree["shared_params"] = {}
    return tree


def _zero12_model_tree(source: SourceCheckpoint, new_spec: CheckpointSpec, layout) -> tuple[dict, dict]:
    """engine.py `_save_checkpoint` under ZeRO-1/2: `module` holds every parameter whole in the
    module dtype (a tied alias shares its owner's tensor), `param_shapes` per group in flat order,
    and, from stage 2 on (`zero_optimization_partition_gradients`), `frozen_param_shapes` and
    `frozen_param_fragments` (the whole frozen parameters, the module's own tensors)."""
    spec = source.spec
    tree = _model_common(source, new_spec, layout)
    size = shape_type(source.model_template)
    tree["param_shapes"] = [_shapes(new_spec, g.flat_order, size) for g in layout.groups]
    module = tree.get("module")
    frozen, dtype = frozen_params(source)
    casts = {}
    if spec.stage == 3:
        if not isinstance(module, dict):
            raise CheckpointError(source.model_path(0), "has no module state dict to rebuild")
        whole = {}
        fp32 = next(s for s in spec.streams if s.name == "fp32")
        for pid, param in enumerate(spec.params):
            whole[param.name] = NewTensor(("module", pid, "fp32"), param.numel, spec.lp_dtype, False, param.shape)
            casts[("module", pid, "fp32")] = fp32.dtype
        for j, param in enumerate(frozen):
            whole[param.name] = NewTensor(("frozen", j, "frozen"), param.numel, dtype, False, param.shape)
        for alias, owner in (tree.get("shared_params") or {}).items():
            if owner in whole:
                whole[alias] = whole[owner]
        for name in module:
            if name in whole:
                module[name] = whole[name]
    if new_spec.stage == 1:
        tree["frozen_param_shapes"] = tree["frozen_param_fragments"] = None
    elif spec.stage == 1 or tree.get("frozen_param_shapes") is not None:
        tree["frozen_param_shapes"] = OrderedDict((p.name, size(p.shape)) for p in frozen)
        tree["frozen_param_fragments"] = OrderedDict((p.name, module[p.name]) for p in frozen)
    return tree, casts
