"""The files DeepSpeed expects at the target world size, as trees to write.

    from reshard.formats.deepspeed_files.deepspeed_target import target_files
    for f in target_files(source, Topology(dp=3), rank=1):
        f.name   # "zero_pp_rank_1_mp_rank_00_optim_states.pt"
        f.tree   # rank 0's file with partitions replaced by NewTensor slots, metadata for 3 ranks

Each target file starts from the source rank-0 file of its kind (same keys, same order, every
unknown key and all client_state carried through). What depends on the world size is
recomputed from the layout rules rather than copied: partitions (new buffers, filled by the
exchange), `partition_count`, `group_paddings`, `param_alignment_paddings`,
`param_slice_mappings`, `param_shapes` (flat order / sub-groups), ZeRO-3 sub-group ids,
`frozen_param_fragments` and `dp_world_size`. Under AutoTP each (dp, tp) rank's files follow
from its TP-local shapes; the model-states file of each TP rank gets its module weights
resliced and its TP metadata recomputed (`_reslice_tensor_parallel_model`); under ZeRO-3 every
(dp, tp) rank's model-states file gets the TP metadata (`_set_tensor_parallel_metadata`).
"""
from __future__ import annotations

import copy
import math
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from reshard.formats.deepspeed_files import deepspeed_schema as schema
from reshard.formats.deepspeed_files.deepspeed_autoep import AUTOEP_LAYERS_KEY, target_autoep_layers
from reshard.formats.deepspeed_files.deepspeed_folding import FOLDING_KEY, model_folding, optim_folding
from reshard.formats.deepspeed_files.deepspeed_metadata import rank_metadata
from reshard.formats.deepspeed_files.deepspeed_schema import OPTIM as OPT
from reshard.formats.deepspeed_files.deepspeed_spec import SourceCheckpoint
from reshard.formats.torch_bytes.torch_archive import NewTensor, TensorRef
from reshard.topology import Topology


@dataclass(frozen=True)
class TargetFile:
    """One file to write: its name in the tag directory and its tree."""

    name: str
    tree: Any
    template: str
    """Source file (name in the tag directory) whose storages the tree's TensorRefs point into."""
    casts: dict = field(default_factory=dict)
    """slot -> dtype the exchange delivers it in, where the file stores another (a ZeRO stage
    change writes module weights cast from fp32 masters; see reshard.formats.deepspeed_files.stage_change)."""

    @property
    def slots(self) -> list[tuple]:
        from reshard.formats.torch_bytes.torch_archive import refs_in
        return [ref.slot for ref in refs_in(self.tree) if isinstance(ref, NewTensor)]


def target_files(source: SourceCheckpoint, target: Topology, rank: int) -> list[TargetFile]:
    """The files rank `rank` of the `target` topology owns as DeepSpeed saves them (dp rank 0 of each
    TP rank also owns the ZeRO-1/2 model-states file), at the source's ZeRO stage (another stage:
    reshard.formats.deepspeed_files.stage_change.StageChange.files)."""
    spec = source.spec
    at = target.coordinates(rank)
    layout = spec.layout(target, target.tp, at.tp, at.pp)
    optim_template, _, optim_name, _ = source.templates(at, target)  # a pipeline column's own
    optim_tree = _optim_tree(source, layout, at.dp, optim_template)
    if spec.experts is not None and spec.tensor is not None:
        _set_optim_folding(optim_tree, spec, layout, target, rank)
    files = [TargetFile(schema.optim_file_name_of(target, rank, spec.bf16_prefix), optim_tree, optim_name)]
    if spec.stage == 3:
        tree = _zero3_model_tree(source, layout, rank)
        if spec.tensor is not None:
            _set_tensor_parallel_metadata(tree, spec, target)
        if spec.tensor is not None and spec.experts is not None:
            _set_model_folding(tree, target, rank)
        files.append(TargetFile(schema.model_file_name_of(target, rank, 3), tree, source.model_name(0)))
    else:
        if at.dp == 0:
            files.append(_zero12_model_file(source, target, rank, layout))
        files += pipeline_layer_files(source, target, rank)  # dp rank 0's, and a node-local job's copies
    for file in files:
        retarget_parallel_sizes(file.tree, spec.topology, target)
    return files


def zero12_model_file(source: SourceCheckpoint, target: Topology, rank: int) -> TargetFile:
    """The ZeRO-1/2 model-states file of rank `rank`'s TP rank, written by `rank` (DeepSpeed's own
    save writes it from dp rank 0 only, `target_files`; a job that places it elsewhere asks here)."""
    spec = source.spec
    at = target.coordinates(rank)
    file = _zero12_model_file(source, target, rank, spec.layout(target, target.tp, at.tp, at.pp))
    retarget_parallel_sizes(file.tree, spec.topology, target)
    return file


def _zero12_model_file(source: SourceCheckpoint, target: Topology, rank: int, layout) -> TargetFile:
    spec = source.spec
    at = target.coordinates(rank)
    _, model_template, _, model_name = source.templates(at, target)  # a pipeline column's own
    tree = zero12_model_tree(source, layout, model_template)
    if target.stages is not None and (target.pp, target.tp) != (spec.topology.pp, spec.topology.tp):
        _retarget_pipeline_stages(tree, target, at.pp)
    if spec.tensor is not None:
        _reslice_tensor_parallel_model(tree, spec, target, at.tp)
    if spec.tensor is not None and spec.experts is not None:
        _set_model_folding(tree, target, target.rank_of(0, at.tp))
    return TargetFile(schema.model_file_name_of(target, rank, spec.stage), tree, model_name)


def _retarget_pipeline_stages(tree: dict, target: Topology, stage: int) -> None:
    """A stage file at another number of stages: its buffers (the target's, `Topology.stages`), and the
    model-parallel size (pp * tp) and pp degree as engine.py saves them, set as the deleted pipeline job set
    them (the pinned bytes of tests/test_pipeline_pinned.py), key order kept."""
    if target.stages.buffer_names:
        tree["buffer_names"] = list(target.stages.buffer_names[stage])
    tree["mp_world_size"] = target.pp * target.tp
    tree["checkpoint_parallel_dimensions"] = {**(tree.get("checkpoint_parallel_dimensions") or {}),
                                              "pp_degree": target.pp,
                                              **({"tp_degree": target.tp} if _recut(target) else {})}


def _recut(target: Topology) -> bool:
    """Whether `target` re-cuts a pipeline save's layer files for another tp (`Topology.layer_files`)."""
    return target.layer_files is not None and target.layer_files.recut


def pipeline_layer_files(source: SourceCheckpoint, target: Topology, rank: int) -> list[TargetFile]:
    """Under a pipeline tp change (`Topology.layer_files`, re-cut), the layer files target rank `rank` writes (dp rank 0 of
    each (stage, model rank), module.py `save_state_dict` without checkpoint_parallel_write_pipeline): each
    layer of its stage as model rank 0's source file holds it (key order, non-tensor entries), every tensor a
    new one of its model rank's slice, filled from its layer space (reshard.layouts.model_axis.LayerFileSpace)
    in the layer file's dtype, its own storage, as torch.save of the cut clones the pipeline job saved
    (deepspeed_pipeline.model_axis_layer_states). With tp kept, the same from the kept layer files (a node-local
    job: each model rank's tensors whole), else none (the layer files are carried whole). A node-local job
    names more writers (`LayerFiles.copies`: a column's first rank on each node)."""
    layer_files, at = target.layer_files, target.coordinates(rank)
    if layer_files is None or (at.dp != 0 and not any(rank in copy for copy in layer_files.copies)):
        return []
    axis, files = layer_files.axis, []
    for index, _, stage, template in layer_files.templates:
        if stage != at.pp:
            continue
        tree = copy.deepcopy(template)
        for key, value in tree.items():
            found = axis.tensor(index, key)
            if found is not None:
                space, j = found
                shape = space.tensors.local_shape(j, target.tp, at.tp)
                tree[key] = NewTensor((space.name, j, space.stream.name), math.prod(shape), space.stream.dtype,
                                      value.requires_grad, tuple(shape))
        files.append(TargetFile(schema.layer_file_name(index, axis.layer_file_model(at.tp)), tree,
                                schema.layer_file_name(index, axis.layer_file_model(0))))
    return files


def retarget_parallel_sizes(tree: Any, source: Topology, target: Topology) -> None:
    """The saved ds_config (engine.py `_save_checkpoint` and `_save_zero_checkpoint` store the
    engine's config dict as given) with the TP and AutoEP sizes it names set to the target's:
    `tensor_parallel.autotp_size` (runtime/tensor_parallel/config.py `TPTrainingConfig`) and
    `expert_parallel.autoep_size` (module_inject/auto_ep_config.py `parse_autoep_config`). DeepSpeed's
    load does not read them; a script that builds its engine from the checkpoint's config does, and
    would otherwise start at the source's sizes. A size the config does not name stays unnamed."""
    config = tree.get("ds_config") if isinstance(tree, dict) else None
    if not isinstance(config, dict):
        return
    for section, key, old, new in (("tensor_parallel", "autotp_size", source.tp, target.tp),
                                   ("expert_parallel", "autoep_size", source.ep, target.ep)):
        part = config.get(section)
        if old != new and isinstance(part, dict) and key in part:
            part[key] = new


def _new(slot: tuple, numel: int, like: Any, dtype: str) -> NewTensor:
    requires_grad = like.requires_grad if isinstance(like, TensorRef) else False
    return NewTensor(slot, numel, dtype, requires_grad)


def _optim_tree(source: SourceCheckpoint, layout, rank: int, template: Any = None) -> Any:
    spec = source.spec
    tree = copy.deepcopy(source.optim_template if template is None else template)
    osd = tree[OPT]
    if spec.stage == 3:
        _fill_zero3_optim(osd, source, layout, rank)
        return tree
    states = osd["base_optimizer_state"]["state"]
    fp32 = osd["single_partition_of_fp32_groups"]
    meta = rank_metadata(spec, layout, rank)
    for g in range(len(layout.groups)):
        for stream in spec.streams:
            slot = ("optim", g, stream.name)
            if stream.name == "fp32":
                fp32[g] = _new(slot, meta.fp32_numels[g], fp32[g], stream.dtype)
            else:
                states[g][stream.name] = _new(slot, meta.buffer_numels[g], states[g][stream.name], stream.dtype)
    _rename_expert_groups(osd, spec, layout)
    osd["partition_count"] = meta.partition_count
    osd["group_paddings"] = meta.group_paddings
    if "param_alignment_paddings" in osd and meta.param_alignment_paddings is not None:
        osd["param_alignment_paddings"] = meta.param_alignment_paddings
    if "param_slice_mappings" in osd:
        # DeepSpeed's type (stage_1_and_2.py `_create_param_mapping`); a pipeline column keeps the plain
        # dicts the pipeline job has always written (deepspeed_pipeline.build_optimizers), which its
        # outputs' pinned bytes hold (tests/test_pipeline_pinned.py); both load alike
        # (tests/test_pipeline_columns.py judges the OrderedDicts by a native load)
        mapping = OrderedDict if spec.columns is None else dict
        osd["param_slice_mappings"] = [mapping((name, schema.fragment_address(numel, start))
                                               for name, numel, start in group)
                                       for group in meta.slice_mappings]
    return tree


def own_storage(value: Any, used: set, slot: tuple) -> Any:
    """`value` (copied), or, for a tensor whose source storage another sub-group already took, a
    copy of its bytes in a storage of its own (slot ("copy", storage key, byte offset, bytes, *slot)).

    Every ZeRO-3 sub-group steps alone (stage3.py `_optimizer_step` runs the torch optimizer once
    per sub-group) and torch's `Optimizer.load_state_dict` keeps a shared `step` tensor shared, so
    sub-groups sharing one would advance it once per sub-group: each needs its own, as DeepSpeed
    saves them."""
    if not isinstance(value, TensorRef):
        return copy.deepcopy(value)
    if value.storage_key not in used:
        used.add(value.storage_key)
        return copy.deepcopy(value)
    start = value.storage_offset * value.itemsize
    return NewTensor(("copy", value.storage_key, start, value.numel * value.itemsize, *slot), value.numel,
                     value.dtype, value.requires_grad, value.shape)


def is_copy_role(role: Any) -> bool:
    """A storage `own_storage` made: filled from part of a source storage, not by the exchange."""
    return isinstance(role, tuple) and role[0] == "copy"


def carried_bytes(carried: dict, role: Any) -> memoryview:
    """The bytes of an unpartitioned storage: a carried source storage by key, or the part of one
    an `own_storage` copy role names."""
    if is_copy_role(role):
        _, key, start, nbytes = role[:4]
        return memoryview(carried[key])[start:start + nbytes]
    return memoryview(carried[role])


def _rename_expert_groups(osd: dict, spec, layout) -> None:
    """moe/utils.py `split_params_into_different_moe_groups_for_optimizer` names an expert group
    after its process group, `ep_size_{ep}`; torch's load_state_dict restores the saved name, so
    it is rewritten for the target's ep (a name the user chose is left alone)."""
    if spec.experts is None or layout.topology.ep == spec.topology.ep:
        return
    old_name, new_name = f"ep_size_{spec.topology.ep}", f"ep_size_{layout.topology.ep}"
    torch_state = osd[OPT] if spec.stage == 3 else osd["base_optimizer_state"]
    for group, is_expert in zip(torch_state["param_groups"], spec.experts.expert_groups):
        if is_expert and group.get("name") == old_name:
            group["name"] = new_name  # one object for every group, as DeepSpeed's (pickled once)


def _fill_zero3_optim(osd: dict, source: SourceCheckpoint, layout, rank: int) -> None:
    spec = source.spec
    stream_names = {s.name for s in spec.streams}
    source_layout = spec.layout(spec.topology)
    first_source_sub_group = {}
    for sg_id, sg in enumerate(source_layout.sub_groups):
        first_source_sub_group.setdefault(sg.group, sg_id)
    inner = osd[OPT]
    old_states, old_fp32 = inner["state"], osd["fp32_flat_groups"]
    like_fp32 = old_fp32[0] if old_fp32 else None
    states, used = {}, set()
    for sg_id, sg in enumerate(layout.sub_groups):
        template = old_states.get(first_source_sub_group[sg.group])
        if template is None:
            continue
        states[sg_id] = {key: (_new(("optim", sg_id, key), sg.partition_numel, value, value.dtype)
                               if key in stream_names and isinstance(value, TensorRef)
                               else own_storage(value, used, ("optim", sg_id, key)))
                         for key, value in template.items()}
    inner["state"] = states
    meta = rank_metadata(spec, layout, rank)  # the same on every rank, but AutoEP's partition groups
    for param_group, ids in zip(inner["param_groups"], meta.sub_group_ids):
        param_group["params"] = ids
    if meta.partition_groups is not None:
        osd["ds_zero_partition_groups"] = meta.partition_groups
    _rename_expert_groups(osd, spec, layout)
    fp32 = next(s for s in spec.streams if s.name == "fp32")
    osd["fp32_flat_groups"] = [_new(("optim", i, "fp32"), size, like_fp32, fp32.dtype)
                               for i, size in enumerate(meta.fp32_numels)]
    osd["partition_count"] = meta.partition_count


def shape_type(tree: dict) -> type:
    """The type of the shapes in a source model-states tree's `param_shapes`: torch.Size (as torch.load
    gives it, or the stand-in the torch-free reader gives for it, which saves as torch.Size), or
    plain tuples where DeepSpeed's MoE save ran the state through checkpoint/utils.py
    `clone_tensors_for_torch_save` (which rebuilds tuples). Targets keep the source's type."""
    for table in [*(tree.get("param_shapes") or []), tree.get("frozen_param_shapes") or {}]:
        if isinstance(table, dict):
            for value in table.values():
                return type(value)
    import torch  # a source without a single shape: DeepSpeed's own type
    return torch.Size


def _shapes(layout, param_ids, shape_type: type) -> OrderedDict:
    if hasattr(layout, "param_shapes_on_rank"):  # MoE: local names, AutoEP's fused expert tensors
        return OrderedDict((name, shape_type(shape)) for name, shape in layout.param_shapes_on_rank(param_ids, 0))
    return OrderedDict((layout.name_on_rank(p, 0), shape_type(layout.params[p].shape)) for p in param_ids)


def zero12_model_tree(source: SourceCheckpoint, layout, template: Any = None) -> Any:
    """The ZeRO-1/2 model-states tree at `layout`'s world size: the source rank-0 tree (or `template`, a
    pipeline column's), metadata recomputed."""
    tree = copy.deepcopy(source.model_template if template is None else template)
    # Rank 0's names: LOCAL names of EP rank 0 in an MoE checkpoint (engine.py `_get_zero_param_shapes`).
    tree["param_shapes"] = [_shapes(layout, g.flat_order, shape_type(tree)) for g in layout.groups]
    tree["dp_world_size"] = layout.world_size
    if source.spec.experts is not None and source.spec.experts.autoep:
        _retarget_autoep_layers(tree, layout.topology)
    return tree


def _retarget_autoep_layers(tree: dict, target: Topology, rank: int = 0) -> None:
    """engine.py `_save_moe_checkpoint` stores one list under both keys."""
    layers = target_autoep_layers(tree[AUTOEP_LAYERS_KEY], target, rank)
    tree[AUTOEP_LAYERS_KEY] = layers
    info = tree.get("universal_checkpoint_info")
    if isinstance(info, dict) and AUTOEP_LAYERS_KEY in info:
        info[AUTOEP_LAYERS_KEY] = layers


def _set_optim_folding(tree: dict, spec, layout, target: Topology, rank: int) -> None:
    """AutoEP with AutoTP layers: the optim file's `folding` for global rank `rank`, or none
    unfolded (reshard.formats.deepspeed_files.deepspeed_folding; engine.py `_save_zero_checkpoint`)."""
    tree.pop(FOLDING_KEY, None)
    if target.folded:
        names = None if spec.stage == 3 else \
            [[name for name, _ in layout.param_shapes_on_rank(g.flat_order, 0)] for g in layout.groups]
        tree[FOLDING_KEY] = optim_folding(target, rank, names, spec.experts.expert_groups)


def _set_model_folding(tree: dict, target: Topology, rank: int) -> None:
    """AutoEP with AutoTP layers: the model file written by global rank `rank` says that writer's
    EP placement, and its `folding` (engine.py `_save_moe_checkpoint`); an unfolded target keeps
    AutoEP's own `universal_checkpoint_info` keys only."""
    _retarget_autoep_layers(tree, target, rank)
    info = tree.get("universal_checkpoint_info")
    if info is None:  # tp 1: what engine.py `_save_moe_checkpoint` writes for AutoEP alone
        info = tree["universal_checkpoint_info"] = {"universal_checkpoint_version": 0.4}
    # engine.py `_save_moe_checkpoint` adds these to AutoTP's info (absent when it came from layer specs)
    info.setdefault("expert_parameter_patterns", [r".*\.experts\.w[123]$"])
    info[AUTOEP_LAYERS_KEY] = tree[AUTOEP_LAYERS_KEY]
    tree.pop(FOLDING_KEY, None)
    if target.folded:
        tree[FOLDING_KEY] = model_folding(target, rank, list(tree["module"]))


def _reslice_tensor_parallel_model(tree: dict, spec, target: Topology, tp_rank: int) -> None:
    """A ZeRO-1/2 model-states file of TP rank `tp_rank` under AutoTP: every trainable module
    weight a new tensor of its local shape (filled from the "module" space), and what depends
    on the TP size recomputed (engine.py `_save_checkpoint`: `mp_world_size`,
    `checkpoint_parallel_dimensions`; `universal_checkpoint_info`)."""
    module = spec.tensor.module
    tensors = tree["module"]
    for j, name in enumerate(module.names):
        shape = module.local_shape(j, target.tp, tp_rank)
        tensors[name] = NewTensor(("module", j, "module"), math.prod(shape), spec.lp_dtype,
                                  tensors[name].requires_grad, tuple(shape))
    for alias, owner in spec.tensor.aliases:  # a tied alias is its owner's tensor (one storage)
        tensors[alias] = tensors[owner]
    # engine.py `_get_shared_params` fills the alias table on global rank 0 only: (dp 0, tp 0)
    if tp_rank != 0 and isinstance(tree.get("shared_params"), dict):
        tree["shared_params"] = {}
    _set_tensor_parallel_metadata(tree, spec, target)


def _set_tensor_parallel_metadata(tree: dict, spec, target: Topology) -> None:
    """What a model-states file of an AutoTP engine says about the TP size (engine.py
    `_save_checkpoint`, ZeRO-1/2 and ZeRO-3 alike): `mp_world_size`, `checkpoint_parallel_dimensions`,
    `universal_checkpoint_info` (affine maps recomputed for the target TP size)."""
    tree["mp_world_size"] = target.tp
    if isinstance(tree.get("checkpoint_parallel_dimensions"), dict):
        tree["checkpoint_parallel_dimensions"]["tp_degree"] = target.tp
    # engine.py `_save_checkpoint` writes it only when AutoTP partitioned the model (TP > 1)
    if target.tp > 1:
        tree["universal_checkpoint_info"] = spec.tensor.universal_info(target.tp)
    else:
        tree.pop("universal_checkpoint_info", None)


def _zero3_model_tree(source: SourceCheckpoint, layout, rank: int) -> Any:
    """The ZeRO-3 model-states file of global target rank `rank` (param_shapes of its TP-local
    shapes per sub-group, frozen fragments of its dp chunk)."""
    spec = source.spec
    tree = copy.deepcopy(source.model_template)
    tree["param_shapes"] = [_shapes(layout, sg.params, shape_type(tree)) for sg in layout.sub_groups]
    tree["dp_world_size"] = layout.world_size
    if spec.frozen:
        old = tree["frozen_param_fragments"]
        tree["frozen_param_fragments"] = OrderedDict(
            (p.name, _new(("frozen", j, "frozen"), -(-p.numel // layout.world_size), old[p.name], spec.frozen_dtype))
            for j, p in enumerate(spec.frozen))
    # engine.py `_get_shared_params` fills the alias table on global rank 0 only (dp 0 and tp 0).
    if rank != 0 and isinstance(tree.get("shared_params"), dict):
        tree["shared_params"] = {}
    if spec.experts is not None and spec.experts.autoep:
        _retarget_autoep_layers(tree, layout.topology, rank)  # every rank writes its own (engine.py)
    return tree
