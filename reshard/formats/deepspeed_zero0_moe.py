"""A native DeepSpeed MoE checkpoint saved without ZeRO (stage 0): read it, write it for another ep.

    from reshard.formats.deepspeed_zero0_moe import inspect_zero0_moe, write_target_files
    source = inspect_zero0_moe("/ckpt/run1/global_step3")     # pickles only
    source.topology, source.orders                            # Topology(dp=2, ep=2), per-group orders
    write_target_files(source, Topology(dp=2, ep=1), staging_dir, ["expp_rank_0_mp_rank_00_optim_states.pt"])

What DeepSpeed 0.19.8 writes at stage 0 (runtime/engine.py `_save_moe_checkpoint`, CPU-checked
with a client torch.optim.AdamW in fp32 and FP16_UnfusedOptimizer in bf16):
    mp_rank_00_model_states.pt   dp rank 0: dense module weights, `optimizer` = dp rank 0's whole
                                 optimizer state_dict (EP rank 0's), `param_shapes` None,
                                 `num_experts`, `dp_world_size`, client_state
    expp_rank_{e}_mp_rank_00_optim_states.pt   {"optimizer": state_dict} of EP rank e (written by
                                 its expert-data-parallel rank 0), dense groups and its LOCAL experts
    layer_{L}_expert_{G}_mp_rank_00_model_states.pt   one per global expert, as at ZeRO-1/2
On load (`_load_checkpoint`) every rank reads the model states, its experts' files and
`expp_rank_{its EP rank}`, and hands that dict to `optimizer.load_state_dict`; the data-parallel
size is never checked. Only an ep change therefore needs new optimizer files; a dp change keeps
them (reshard still writes `dp_world_size` for the target, as DeepSpeed would).

The state_dict is torch's: `state` {param index: {step, exp_avg, ...}} and `param_groups`
whose `params` list the indices group by group; FP16_UnfusedOptimizer wraps it as
`optimizer_state_dict` beside `fp32_groups` (one fp32 master per parameter) and its loss-scale
scalars. Whole tensors per parameter, nothing partitioned: the target's files are the source's
tensors regrouped (reshard.layouts.zero0_expert_groups), saved with torch.save.
"""
from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass

from reshard.errors import CheckpointError, UnsupportedCheckpoint
from reshard.layouts.expert_placement import ExpertPlacement
from reshard.formats import deepspeed_classes as classes
from reshard.formats import deepspeed_schema as schema
from reshard.formats.deepspeed_inspect import _expert_layers, _other_contents  # the same rules as ZeRO-1/2 MoE
from reshard.formats.deepspeed_rank_values import compare, describe, refuse
from reshard.formats.torch_archive import TensorRef, load_checked, load_portable
from reshard.topology import Topology
from reshard.layouts.zero0_expert_groups import GroupOrder, solve_per_expert_counts

_EXPP_RE = re.compile(r"^expp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
INNER = "optimizer_state_dict"  # fp16/unfused_optimizer.py `state_dict`
MODEL = schema.model_file_name(0)


def expp_file_name(ep_rank: int) -> str:
    """engine.py `_get_optimizer_ckpt_name`."""
    return f"expp_rank_{ep_rank}_mp_rank_00_optim_states.pt"


def is_zero0_moe(tag_dir: str) -> bool:
    """Whether the tag directory holds the per-EP-rank optimizer files of a ZeRO-0 MoE save."""
    return os.path.isdir(tag_dir) and any(_EXPP_RE.match(name) for name in os.listdir(tag_dir))


@dataclass(frozen=True)
class Zero0MoeSource:
    """What a ZeRO-0 MoE tag directory holds, from its pickles."""

    save_dir: str
    tag: str
    topology: Topology
    num_experts: tuple[int, ...]
    orders: tuple[GroupOrder | None, ...]
    """Per optimizer param group: its expert order, or None for a dense group."""
    group_lengths: tuple[int, ...]
    """Parameters per optimizer param group on each source EP rank."""
    wrapped: bool
    """FP16_UnfusedOptimizer's dict (`optimizer_state_dict` + `fp32_groups`), else torch's own."""
    precision: str
    expert_files: tuple[str, ...]
    other_files: tuple[str, ...]
    other_dirs: tuple[str, ...]

    @property
    def tag_dir(self) -> str:
        return os.path.join(self.save_dir, self.tag)

    def model_path(self, rank: int = 0) -> str:
        return os.path.join(self.tag_dir, MODEL)

    def expp_path(self, ep_rank: int) -> str:
        return os.path.join(self.tag_dir, expp_file_name(ep_rank))

    def describe(self) -> str:
        optimizer = "FP16_UnfusedOptimizer" if self.wrapped else "torch optimizer"
        return (f"ZeRO-0 native MoE, {self.precision} ({optimizer}), {self.topology.dp} dp ranks, ep={self.topology.ep}, "
                f"{len(self.num_experts)} MoE layers of {'/'.join(map(str, self.num_experts))} experts")

    def expert_problem(self, target: Topology) -> str | None:
        bad = sorted({n for n in self.num_experts if n % target.ep})
        if bad:
            return (f"the MoE layers have {', '.join(map(str, bad))} experts, which ep={target.ep} does not divide "
                    "(DeepSpeed's MoE needs num_experts % ep_size == 0)")
        return None


def _inner(optimizer: dict, path: str) -> dict:
    inner = optimizer.get(INNER, optimizer) if isinstance(optimizer, dict) else None
    if not isinstance(inner, dict) or not isinstance(inner.get("state"), dict) \
            or not isinstance(inner.get("param_groups"), list):
        raise CheckpointError(path, "does not hold a torch optimizer state_dict (state, param_groups) under "
                                    "\"optimizer\": not a ZeRO-0 MoE optimizer file")
    return inner


def _position_shapes(optimizer: dict, inner: dict, group: int) -> list[tuple[int, ...] | None]:
    """The shape of each parameter of a group where the file tells it: its fp32 master
    (FP16_UnfusedOptimizer), else its first non-scalar optimizer state, else None (no state yet)."""
    shapes = []
    masters = optimizer.get("fp32_groups")
    for position, index in enumerate(inner["param_groups"][group]["params"]):
        if masters is not None:
            shapes.append(tuple(masters[group][position].shape))
            continue
        tensors = [v for v in inner["state"].get(index, {}).values() if isinstance(v, TensorRef) and v.shape]
        shapes.append(tuple(tensors[0].shape) if tensors else None)
    return shapes


def inspect_zero0_moe(save_dir: str, tag: str, *, trust_pickle: bool = False) -> Zero0MoeSource:
    """Read the pickles of a ZeRO-0 MoE tag directory (no tensor bytes) and check them."""
    save_dir = os.path.abspath(save_dir)
    tag_dir = os.path.join(save_dir, tag)
    roles = {name: schema.classify(name) for name in sorted(os.listdir(tag_dir))
             if os.path.isfile(os.path.join(tag_dir, name))}
    expp = {}
    for name in roles:
        if m := _EXPP_RE.match(name):
            if int(m[2]) != 0:
                raise UnsupportedCheckpoint(os.path.join(tag_dir, name), "is a ZeRO-0 MoE optimizer file of tensor-"
                                                                         "parallel rank > 0; TP with ZeRO-0 MoE is not supported")
            expp[int(m[1])] = name
    mixed = next((name for name, role in roles.items() if role.kind in ("optim", "zero3_model", "pipeline")), None)
    if mixed:
        raise UnsupportedCheckpoint(os.path.join(tag_dir, min(expp.values())),
                                    f"is the optimizer file of a ZeRO-0 MoE save, but {mixed} (a ZeRO-1/2/3 or "
                                    "pipeline file) lies beside it: files of two kinds of save mixed in one tag")
    ep = len(expp)
    if sorted(expp) != list(range(ep)):
        missing = min(set(range(max(expp) + 1)) - set(expp))
        raise CheckpointError(os.path.join(tag_dir, expp_file_name(missing)),
                              f"is missing: expp_rank files {sorted(expp)} are present, one per EP rank is expected")
    model_path = os.path.join(tag_dir, MODEL)
    if not os.path.isfile(model_path):
        raise CheckpointError(model_path, "is missing: every ZeRO-0 MoE checkpoint has this model-states file")
    model = load_portable(model_path, schema.safe_globals(), trust_pickle)
    if not isinstance(model, dict) or not isinstance(model.get("dp_world_size"), int):
        raise CheckpointError(model_path, "is not a DeepSpeed model-states file (no dp_world_size)")
    if model.get("mp_world_size", 1) != 1:
        raise UnsupportedCheckpoint(model_path, f"has mp_world_size {model.get('mp_world_size')}; TP with ZeRO-0 "
                                                "MoE is not supported")
    if model.get("optimizer") is None:
        raise CheckpointError(model_path, "holds no optimizer state (optimizer is None): not a ZeRO-0 save "
                                          "beside its expp_rank_* files")
    n = model["dp_world_size"]
    expert_files = {name: schema.expert_file_index(name) for name, role in roles.items()
                    if role.kind == "expert" and not _EXPP_RE.match(name)}
    bad = next((name for name, index in expert_files.items() if index is None), None)
    if bad:
        raise UnsupportedCheckpoint(os.path.join(tag_dir, bad), "is a mixture-of-experts file of DeepSpeed's old "
                                                                "layout (no layer index); not supported")
    layers = _expert_layers(tag_dir, expert_files, model, model_path, trust_pickle)
    if layers is None:
        raise CheckpointError(model_path, "has expp_rank_* optimizer files but no layer_*_expert_* files")
    num_experts = layers[0]
    if n % ep or any(count % ep for count in num_experts):
        raise CheckpointError(model_path, f"{ep} expp_rank files (ep={ep}) do not divide dp_world_size {n} "
                                          f"and num_experts {list(num_experts)}")
    layer_shapes = []
    for layer in range(len(num_experts)):
        path = os.path.join(tag_dir, schema.expert_file_name(layer, 0))
        tree = load_portable(path, schema.safe_globals(), trust_pickle)
        layer_shapes.append([tuple(ref.shape) for ref in tree.values() if isinstance(ref, TensorRef)])

    path0 = os.path.join(tag_dir, expp[0])
    optimizer = _optimizer_of(load_portable(path0, schema.safe_globals(), trust_pickle), path0)
    wrapped = INNER in optimizer
    if wrapped and "fp32_groups" not in optimizer:
        raise UnsupportedCheckpoint(path0, "holds FP16_Optimizer's flat fp32 groups (fp32_groups_flat, fused Adam); "
                                           "only the unfused optimizer's per-parameter masters are supported")
    inner = _inner(optimizer, path0)
    named = {int(m[1]) for g in inner["param_groups"] if g.get("moe")
             for m in [re.fullmatch(r"ep_size_(\d+)", str(g.get("name")))] if m}
    if named and named != {ep}:  # moe/utils.py names expert groups after their process group, ep_size_{ep}
        wanted = max(named)
        missing = os.path.join(tag_dir, expp_file_name(ep)) if wanted > ep else path0
        raise CheckpointError(missing, f"is missing: the expert param groups are named ep_size_{wanted}, so "
                                       f"{wanted} expp_rank files are expected, {ep} are present"
                              if wanted > ep else
                              f"names its expert param groups {sorted(named)}, but {ep} expp_rank files are present")
    local_counts = [ExpertPlacement(count, ep).local_count for count in num_experts]
    orders = []
    for g, group in enumerate(inner["param_groups"]):
        if not group.get("moe"):
            orders.append(None)
            continue
        try:
            counts = solve_per_expert_counts(_position_shapes(optimizer, inner, g), layer_shapes, local_counts)
        except ValueError as error:
            raise UnsupportedCheckpoint(path0, f"expert param group {g} ({group.get('name')}): {error}; cannot tell "
                                               "which expert each of its parameters belongs to") from None
        orders.append(GroupOrder(counts, tuple(num_experts)))
    if not any(orders):
        raise CheckpointError(path0, "has no expert param group (moe=True): not a native MoE optimizer state")
    dtypes = [ref.dtype for ref in (model.get("module") or {}).values() if isinstance(ref, TensorRef)]
    precision = next((_PRECISION[d] for d in dtypes if d in _PRECISION), "fp32")
    others, other_dirs = _other_contents(tag_dir, roles)
    lengths = tuple(len(group["params"]) for group in inner["param_groups"])
    return Zero0MoeSource(save_dir, tag, Topology(dp=n, ep=ep), tuple(num_experts), tuple(orders), lengths, wrapped,
                          precision, tuple(sorted(expert_files)), others, other_dirs)


_PRECISION = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def _optimizer_of(tree, path: str) -> dict:
    if not isinstance(tree, dict) or not isinstance(tree.get("optimizer"), dict):
        raise CheckpointError(path, "holds no \"optimizer\" dict: not a ZeRO-0 MoE optimizer file")
    return tree["optimizer"]


def _load(path: str, trust_pickle: bool):
    # a ZeRO-0 MoE job loads whole files: the torch path; an in-job load leaves the allowlist as it was
    return load_checked(path, schema.safe_globals(), trust_pickle)


def target_optimizer(source: Zero0MoeSource, loaded: dict[int, dict], target: Topology, ep_rank: int) -> dict:
    """EP rank `ep_rank`'s optimizer dict at `target`, from the source EP ranks' loaded dicts
    (`loaded` maps source EP rank -> its file's "optimizer"; the ones `source_ranks_for` names).
    Hyperparameters, scalars and dense groups come from source EP rank 0."""
    first = loaded[0]
    inner0 = first.get(INNER, first)
    groups, state, masters = [], {}, [] if source.wrapped else None
    index = 0
    for g, (group, order) in enumerate(zip(inner0["param_groups"], source.orders)):
        if order is None:
            places = [(0, p) for p in range(len(group["params"]))]
        else:
            places = order.sources(source.topology.ep, target.ep, ep_rank)
        new_group = dict(group)
        if order is not None and group.get("name") == f"ep_size_{source.topology.ep}":
            new_group["name"] = f"ep_size_{target.ep}"  # moe/utils.py names it after its process group
        new_group["params"] = list(range(index, index + len(places)))
        groups.append(new_group)
        if masters is not None:
            masters.append([])
        for src_rank, position in places:
            optimizer = loaded[src_rank]
            inner = optimizer.get(INNER, optimizer)
            old = inner["param_groups"][g]["params"][position]
            if old in inner["state"]:
                state[index] = inner["state"][old]
            if masters is not None:
                masters[g].append(optimizer["fp32_groups"][g][position])
            index += 1
    new_inner = dict(inner0, state=state, param_groups=groups)
    if not source.wrapped:
        return new_inner
    return dict(first, **{INNER: new_inner, "fp32_groups": masters})


def source_ranks_for(source: Zero0MoeSource, target: Topology, ep_rank: int) -> list[int]:
    """The source EP ranks whose optimizer files target EP rank `ep_rank` draws on (0 always: dense state)."""
    ranks = {0}
    for order in source.orders:
        if order is not None:
            ranks |= {rank for rank, _ in order.sources(source.topology.ep, target.ep, ep_rank)}
    return sorted(ranks)


def _check_same_groups(source: Zero0MoeSource, optimizer: dict, path: str) -> None:
    """Every EP rank's file has EP rank 0's groups, of the same lengths (DeepSpeed's MoE
    deep-copies one expert), and the same wrapper."""
    inner = _inner(optimizer, path)
    lengths = tuple(len(g["params"]) for g in inner["param_groups"])
    if lengths != source.group_lengths or (INNER in optimizer) != source.wrapped:
        raise CheckpointError(path, f"has param groups of {list(lengths)} parameters, EP rank 0's file has "
                                    f"{list(source.group_lengths)} (file of another checkpoint?)")
    _check_state_sizes(optimizer, inner, path)


def _check_state_sizes(optimizer: dict, inner: dict, path: str) -> None:
    """Every per-element optimizer state of a parameter has its shape (at ZeRO stage 0 the
    "partition" is the whole parameter: its fp32 master under FP16_UnfusedOptimizer, else the
    shape its states agree on), stored contiguously; scalars (`step`) aside. The size check every
    road makes (deepspeed_schema.partition_problem on the ZeRO and pipeline roads)."""
    masters = optimizer.get("fp32_groups")
    for g, group in enumerate(inner["param_groups"]):
        for position, index in enumerate(group["params"]):
            shapes = {key: schema.tensor_layout(value) for key, value in inner["state"].get(index, {}).items()}
            shapes = {key: layout for key, layout in shapes.items()
                      if layout is not None and functools.reduce(lambda a, b: a * b, layout[0], 1) != 1}
            want = schema.tensor_layout(masters[g][position]) if masters is not None else None
            want = want[0] if want is not None else next((layout[0] for layout in shapes.values()), None)
            for key, (shape, stride) in shapes.items():
                numel = functools.reduce(lambda a, b: a * b, shape, 1)
                if shape != want or (numel > 1 and not _dense(shape, stride)):
                    raise CheckpointError(path, f"optimizer state {key!r} of parameter {position} of param group {g} "
                                                f"has shape {list(shape)}" + (" and is not stored contiguously"
                                                                              if shape == want else
                                                                              f", but the parameter's is {list(want)}"))


def _dense(shape, stride) -> bool:
    expected = 1
    for size, step in reversed(list(zip(shape, stride))):
        if size > 1 and step != expected:
            return False
        expected *= size
    return True


def _rank_values(optimizer: dict) -> dict:
    """What every EP rank's optimizer file holds alike, and the targets take from EP rank 0's
    (`target_optimizer`): the fp16 wrapper's loss-scale values (fp16/unfused_optimizer.py
    `state_dict`: cur_scale, cur_iter, ...; every rank steps the scaler from the same overflow, which
    runtime/utils.py `CheckOverflow.has_overflow` all-reduces over every rank for MoE) and
    each param group's hyperparameters (lr, betas, ...: one scheduler on every rank)."""
    values = {key: value for key, value in optimizer.items() if key not in (INNER, "fp32_groups", "state",
                                                                            "param_groups")}
    inner = optimizer.get(INNER, optimizer)
    values["param_groups"] = [{k: v for k, v in group.items() if k != "params"} for group in inner["param_groups"]]
    return values


def _check_same_as_ep_rank0(optimizer: dict, path: str, optimizer0: dict, path0: str) -> None:
    """Refuse an EP rank's file whose values every rank saves alike differ from EP rank 0's
    (reshard.formats.deepspeed_rank_values). Only the files a target draws on are read, so only
    those are compared: the ones this job would otherwise silently override with EP rank 0's."""
    difference, _ = compare(_rank_values(optimizer), _rank_values(optimizer0))
    if difference is not None:
        where, here, there = difference
        refuse(path, f"optimizer.{where}", describe(here), path0, describe(there))


class _SourceOptimizers:
    """The source EP ranks' optimizer dicts, each loaded (memory-mapped) and checked once."""

    def __init__(self, source: Zero0MoeSource, trust_pickle: bool):
        self.source, self.trust_pickle = source, trust_pickle
        self.loaded: dict[int, dict] = {}
        self.read: list[str] = []

    def __getitem__(self, rank: int) -> dict:
        if rank not in self.loaded:
            path = self.source.expp_path(rank)
            optimizer = _optimizer_of(_load(path, self.trust_pickle), path)
            _check_same_groups(self.source, optimizer, path)
            if rank != 0:
                _check_same_as_ep_rank0(optimizer, path, self[0], self.source.expp_path(0))
            self.read.append(path)
            self.loaded[rank] = optimizer
        return self.loaded[rank]

    def target(self, target: Topology, ep_rank: int) -> dict:
        ranks = source_ranks_for(self.source, target, ep_rank)
        return target_optimizer(self.source, {r: self[r] for r in ranks}, target, ep_rank)


def target_optimizers(source: Zero0MoeSource, target: Topology, ep_ranks, *, trust_pickle: bool = False) -> dict:
    """{EP rank: its optimizer dict at `target`} for the given target EP ranks (in-job loads)."""
    sources = _SourceOptimizers(source, trust_pickle)
    return {e: sources.target(target, e) for e in ep_ranks}


def write_target_files(source: Zero0MoeSource, target: Topology, tag_dir: str, names: list[str], *,
                       trust_pickle: bool = False) -> tuple[list[str], list[str]]:
    """Write the named target files (expp_rank_* of `target`, and the model-states file) into
    `tag_dir`. Reads only the source files they draw on, memory-mapped. Returns the paths
    written and the source paths read."""
    sources = _SourceOptimizers(source, trust_pickle)
    read = sources.read
    optimizer_of = functools.partial(sources.target, target)
    paths = []
    for name in names:
        path = os.path.join(tag_dir, name)
        if name == MODEL:
            tree = _load(source.model_path(), trust_pickle)
            read.append(source.model_path())
            tree["optimizer"] = optimizer_of(0)  # engine.py `_common_checkpoint_state`: dp rank 0's, EP rank 0's
            tree["dp_world_size"] = target.dp
        else:
            match = _EXPP_RE.match(name)
            if not match:
                raise ValueError(f"{name} is not a ZeRO-0 MoE target file")
            tree = {"optimizer": optimizer_of(int(match[1]))}
        import torch
        torch.save(tree, path, pickle_module=classes)
        paths.append(path)
    return paths, read


def target_file_names(target: Topology) -> list[str]:
    """Every file reshard writes for `target` (the expert files are copied as they are)."""
    return [MODEL] + [expp_file_name(e) for e in range(target.ep)]
