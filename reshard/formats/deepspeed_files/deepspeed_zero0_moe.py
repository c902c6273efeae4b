"""A native DeepSpeed MoE checkpoint saved without ZeRO (stage 0): read it, lower it for another ep.

    python -m reshard SRC DST --target-dp 4 --target-ep 1      # the collective job, through the planner

    from reshard.formats.deepspeed_files.deepspeed_zero0_moe import inspect_zero0_moe, inspect_zero0_moe_checkpoint
    facts = inspect_zero0_moe("/ckpt/run1", "global_step3")   # pickles only: Topology(dp=2, ep=2), orders
    source = inspect_zero0_moe_checkpoint("/ckpt/run1", "global_step3")   # what the collective job plans
    Zero0Moe().files(source, Topology(dp=2, ep=1), rank=0)    # expp_rank_0's tree, NewTensor slots

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
tensors regrouped (reshard.layouts.zero0_expert_groups). The collective job moves them through the
planner and execute() like every other layout ("on the main road" below), and so does the in-job
load (reshard.deepspeed), into in-memory files.
"""
from __future__ import annotations

import copy
import functools
import os
import re
from dataclasses import dataclass

from reshard.errors import CheckpointError, UnsupportedCheckpoint
from reshard.layouts.expert_placement import ExpertPlacement
from reshard.formats.deepspeed_files import deepspeed_schema as schema
from reshard.formats.deepspeed_files.deepspeed_inspect import _expert_layers, _other_contents  # the same rules as ZeRO-1/2 MoE
from reshard.formats.deepspeed_files.deepspeed_rank_values import compare, describe, refuse
from reshard.formats.deepspeed_files.deepspeed_spec import CheckpointSpec, SourceCheckpoint
from reshard.formats.deepspeed_files.deepspeed_target import TargetFile
from reshard.formats.torch_bytes.torch_archive import NewTensor, TensorRef, load_portable, refs_in
from reshard.layouts.experts import ExpertParams
from reshard.layouts.zero import Stream
from reshard.topology import Topology
from reshard.layouts.zero0_expert_groups import (
    GroupOrder,
    Zero0Space,
    solve_per_expert_counts,
    target_places,
)

_EXPP_RE = re.compile(r"^expp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
INNER = "optimizer_state_dict"  # fp16/unfused_optimizer.py `state_dict`
MODEL = schema.model_file_name(0)


def expp_file_name(ep_rank: int) -> str:
    """engine.py `_get_optimizer_ckpt_name`."""
    return f"expp_rank_{ep_rank}_mp_rank_00_optim_states.pt"


def is_expp_file(name: str) -> bool:
    """Whether `name` is a ZeRO-0 MoE save's per-EP-rank optimizer file (engine.py `_get_optimizer_ckpt_name`)."""
    return _EXPP_RE.match(name) is not None


def is_zero0_moe(tag_dir: str) -> bool:
    """Whether the tag directory holds the per-EP-rank optimizer files of a ZeRO-0 MoE save."""
    return os.path.isdir(tag_dir) and any(is_expp_file(name) for name in os.listdir(tag_dir))


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
    (`_optimizer_tree`): the fp16 wrapper's loss-scale values (fp16/unfused_optimizer.py
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
    (reshard.formats.deepspeed_files.deepspeed_rank_values). Only the files a target draws on are read, so only
    those are compared: the ones this job would otherwise silently override with EP rank 0's."""
    difference, _ = compare(_rank_values(optimizer), _rank_values(optimizer0))
    if difference is not None:
        where, here, there = difference
        refuse(path, f"optimizer.{where}", describe(here), path0, describe(there))


# --- on the main road: the planner and execute() (docs/architecture.md, "One road") -------------------
# A ZeRO-0 MoE save lowers to pieces of whole parameters: each parameter of an EP rank's optimizer is
# one buffer of its own (its index in the torch state_dict), in three spaces (per-element states, 0-d
# states, fp32 masters: layouts/zero0_expert_groups.Zero0Space). Source ranks are the source's EP
# ranks (their expp_rank_{e} files); target ranks the target's EP ranks and one more, the model-states
# file's copy of EP rank 0's optimizer (planning/checkpoint_plan.plan_zero0_moe). Each target file's
# tree is EP rank 0's dict regrouped (`_optimizer_tree`), with NewTensor slots for the source's tensors.

TensorMeta = tuple  # ("tensor", dtype, shape, requires_grad): a tensor the exchange fills, by its source's


@dataclass(frozen=True)
class Zero0MoeSpec(CheckpointSpec):
    """A ZeRO-0 MoE save as the planner and the writers take it (stage 0; `topology` the source's dp and
    ep). Its parameters have no names (no `param_shapes` at stage 0): each is placed by its position in
    its param group (layouts/zero0_expert_groups.GroupOrder)."""

    orders: tuple = ()
    """Per param group: its GroupOrder, or None for a dense group."""
    group_lengths: tuple[int, ...] = ()
    """Parameters per param group on each source EP rank."""
    spaces: tuple[Zero0Space, ...] = ()
    entries: tuple = ()
    """[source EP rank][group][position]: (its state as ((key, TensorMeta or ("value", v)), ...) or None
    when it has none yet, its fp32 master's TensorMeta or None)."""
    wrapped: bool = False
    """FP16_UnfusedOptimizer's dict (`optimizer_state_dict` + `fp32_groups`), else torch's own."""
    description: str = ""

    def describe(self) -> str:
        return self.description


@dataclass(frozen=True)
class Zero0MoeCheckpoint(SourceCheckpoint):
    """A ZeRO-0 MoE source: `optim_template` is EP rank 0's "optimizer" dict, `model_template` the
    model-states file's tree; source rank e is EP rank e, whose one file is `expp_rank_{e}`."""

    num_experts: tuple[int, ...] = ()

    def optim_name(self, rank: int) -> str:
        return expp_file_name(rank)

    def model_name(self, rank: int = 0) -> str:
        return MODEL

    def source_files(self, rank: int, target: Topology | None = None) -> list[str]:
        """Source rank `rank`'s files; `target` is SourceCheckpoint.source_files' (a pipeline's layer files
        ride on it) and names nothing here."""
        if rank >= self.spec.topology.ep:  # dp ranks beyond the EP ranks save no file at stage 0
            return []
        return [self.optim_path(rank)] + ([self.model_path()] if rank == 0 else [])

    def expert_problem(self, target: Topology) -> str | None:
        bad = sorted({n for n in self.num_experts if n % target.ep})
        if bad:
            return (f"the MoE layers have {', '.join(map(str, bad))} experts, which ep={target.ep} does not divide "
                    "(DeepSpeed's MoE needs num_experts % ep_size == 0)")
        return None


def _meta(value) -> TensorMeta:
    return ("tensor", value.dtype, tuple(value.shape), bool(value.requires_grad)) if isinstance(value, TensorRef) \
        else ("value", value)


def _entries(optimizer: dict, wrapped: bool) -> tuple:
    inner = optimizer.get(INNER, optimizer)
    masters = optimizer.get("fp32_groups") if wrapped else None
    rows = []
    for g, group in enumerate(inner["param_groups"]):
        row = []
        for position, index in enumerate(group["params"]):
            state = inner["state"].get(index)
            # the keys as unpickled, not interned: torch.save pickles a string once per object, and each
            # source file's keys are one object per file, as a load of that file gives them
            state = None if state is None else tuple((key, _meta(value)) for key, value in state.items())
            row.append((state, _meta(masters[g][position]) if masters is not None else None))
        rows.append(tuple(row))
    return tuple(rows)


def _numel(shape) -> int:
    return functools.reduce(lambda a, b: a * b, shape, 1)


def _spaces(entries: tuple, wrapped: bool, paths: list[str]) -> tuple[Zero0Space, ...]:
    """The spaces of a save from its entries (`paths`: each EP rank's file); refused, naming the file,
    where the parameters' states differ in their keys or dtypes, which one stream per key cannot carry."""
    from reshard.formats.deepspeed_files.deepspeed_spec import itemsize
    kinds: dict[str, dict[str, str]] = {"optim": {}, "scalar": {}}
    for rank, path in zip(entries, paths):
        for row in rank:
            for state, _ in row:
                for key, meta in state or ():
                    if meta[0] != "tensor":
                        continue
                    space = kinds["scalar" if meta[2] == () else "optim"]
                    if space.setdefault(key, meta[1]) != meta[1]:
                        raise UnsupportedCheckpoint(path, f"optimizer state {key!r} is {meta[1]} for one parameter and "
                                                          f"{space[key]} for another; reshard needs one dtype per state")
    spaces = []
    for name, keys in kinds.items():
        if not keys:
            continue
        numels = []
        for rank, path in zip(entries, paths):
            numels.append(tuple(tuple(_state_numel(state, keys, name == "scalar", path) for state, _ in row)
                                for row in rank))
        streams = tuple(Stream(key, dtype, itemsize(dtype)) for key, dtype in keys.items())
        spaces.append(Zero0Space(name, streams, tuple(numels)))
    if wrapped:
        dtype = None
        for rank, path in zip(entries, paths):
            dtypes = {meta[1] for row in rank for _, meta in row} | ({dtype} if dtype else set())
            if len(dtypes) > 1:
                raise UnsupportedCheckpoint(path, f"holds fp32 masters of dtypes {sorted(dtypes)} (with EP rank "
                                                  "0's); one is expected")
            dtype = next(iter(dtypes), dtype)
        spaces.append(Zero0Space("master", (Stream("fp32", dtype, itemsize(dtype)),),
                                 tuple(tuple(tuple(_numel(meta[2]) for _, meta in row) for row in rank)
                                       for rank in entries)))
    return tuple(spaces)


def _state_numel(state, keys: dict, scalar: bool, path: str) -> int:
    if state is None:
        return 0
    tensors = {key: meta for key, meta in state if meta[0] == "tensor" and (meta[2] == ()) == scalar}
    if set(tensors) != set(keys):
        raise UnsupportedCheckpoint(path, f"a parameter's optimizer state holds tensors {sorted(tensors)}, another's "
                                          f"{sorted(keys)}; reshard needs the same states for every parameter "
                                          "(or none, before its first step)")
    return 1 if scalar else _numel(next(iter(tensors.values()))[2])


def inspect_zero0_moe_checkpoint(save_dir: str, tag: str, *, trust_pickle: bool = False,
                                 read_tensors: bool = True) -> Zero0MoeCheckpoint:
    """A ZeRO-0 MoE tag directory as the collective job takes it: `inspect_zero0_moe`'s facts, every EP
    rank's optimizer file's pickle read and checked against EP rank 0's (no tensor bytes), and the spec
    the planner lowers. `read_tensors` is accepted for the inspectors' common signature: nothing is read."""
    facts = inspect_zero0_moe(save_dir, tag, trust_pickle=trust_pickle)
    optimizers = []
    for rank in range(facts.topology.ep):
        path = facts.expp_path(rank)
        optimizer = _optimizer_of(load_portable(path, schema.safe_globals(), trust_pickle), path)
        _check_same_groups(facts, optimizer, path)
        if rank:
            _check_same_as_ep_rank0(optimizer, path, optimizers[0], facts.expp_path(0))
        optimizers.append(optimizer)
    first = optimizers[0]
    rest = {key: value for key, value in first.items() if key not in (INNER, "fp32_groups", "state")}
    inner0 = first.get(INNER, first)
    rest.update({key: value for key, value in inner0.items() if key != "state"})
    if any(isinstance(value, TensorRef) for value in refs_in(rest)):
        raise UnsupportedCheckpoint(facts.expp_path(0), "holds tensors in its optimizer dict beside the parameters' "
                                                        "states and masters; reshard does not know where they go")
    entries = tuple(_entries(optimizer, facts.wrapped) for optimizer in optimizers)
    model = load_portable(facts.model_path(), schema.safe_globals(), trust_pickle)
    lp_dtype = {"bf16": "bfloat16", "fp16": "float16"}.get(facts.precision, "float32")
    spec = Zero0MoeSpec(
        stage=0, optimizer="wrapped" if facts.wrapped else "torch", bf16_prefix=False, topology=facts.topology,
        params=(), groups=(), round_robin=False, param_alignment=1, sub_group_size=0, lp_dtype=lp_dtype, streams=(),
        experts=ExpertParams(tuple(order is not None for order in facts.orders), facts.num_experts, (), ()),
        orders=facts.orders, group_lengths=facts.group_lengths,
        spaces=_spaces(entries, facts.wrapped, [facts.expp_path(rank) for rank in range(facts.topology.ep)]),
        entries=entries, wrapped=facts.wrapped, description=facts.describe())
    return Zero0MoeCheckpoint(facts.save_dir, tag, spec, first, model, other_files=facts.expert_files + facts.other_files,
                              other_dirs=facts.other_dirs, num_experts=facts.num_experts)


def _new_tensor(meta: TensorMeta, slot: tuple) -> NewTensor:
    _, dtype, shape, requires_grad = meta
    return NewTensor(slot, _numel(shape), dtype, requires_grad, tuple(shape))


def _optimizer_tree(source: Zero0MoeCheckpoint, target: Topology, ep_rank: int) -> dict:
    """EP rank `ep_rank`'s optimizer dict at `target` (hyperparameters, scalars and dense groups from
    source EP rank 0; each parameter's states and master where `target_places` puts them), its tensors
    NewTensor slots: ("optim" | "scalar", buffer, state key), ("master", buffer, "fp32"),
    buffer the parameter's index in this optimizer."""
    spec = source.spec
    first = copy.deepcopy(source.optim_template)
    inner0 = first.get(INNER, first)
    places = target_places(spec.orders, spec.group_lengths, spec.topology.ep, target.ep, ep_rank)
    groups, state, masters = [], {}, [] if spec.wrapped else None
    index = 0
    for g, (group, order) in enumerate(zip(inner0["param_groups"], spec.orders)):
        mine = [(rank, position) for group_of, rank, position in places if group_of == g]
        new_group = dict(group)
        if order is not None and group.get("name") == f"ep_size_{spec.topology.ep}":
            new_group["name"] = f"ep_size_{target.ep}"  # moe/utils.py names it after its process group
        new_group["params"] = list(range(index, index + len(mine)))
        groups.append(new_group)
        if masters is not None:
            masters.append([])
        for rank, position in mine:
            entry, master = spec.entries[rank][g][position]
            if entry is not None:
                state[index] = {key: (_new_tensor(meta, ("scalar" if meta[2] == () else "optim", index, key))
                                      if meta[0] == "tensor" else copy.deepcopy(meta[1])) for key, meta in entry}
            if masters is not None:
                masters[g].append(_new_tensor(master, ("master", index, "fp32")))
            index += 1
    new_inner = dict(inner0, state=state, param_groups=groups)
    if not spec.wrapped:
        return new_inner
    return dict(first, **{INNER: new_inner, "fp32_groups": masters})


def zero0_target_files(source: Zero0MoeCheckpoint, target: Topology, rank: int) -> list[TargetFile]:
    """What target rank `rank` of `plan_zero0_moe` writes: `expp_rank_{rank}` for an EP rank, the
    model-states file for rank target.ep (the source's tree, its module weights copied from the source
    file, with EP rank 0's optimizer and the target's dp_world_size, engine.py `_save_moe_checkpoint`)."""
    if rank < target.ep:
        return [TargetFile(expp_file_name(rank), {"optimizer": _optimizer_tree(source, target, rank)},
                           expp_file_name(0))]
    tree = copy.deepcopy(source.model_template)
    tree["optimizer"] = _optimizer_tree(source, target, 0)  # engine.py `_common_checkpoint_state`: EP rank 0's
    tree["dp_world_size"] = target.dp
    return [TargetFile(MODEL, tree, MODEL)]


def zero0_source_slots(source: Zero0MoeCheckpoint, rank: int, trust_pickle: bool = False) -> dict:
    """{slot: (path, TensorRef)} of source EP rank `rank`'s file, checked to hold what the plan was made
    from (the pickle worker 0 inspected): the slots `_optimizer_tree` names, by source buffer."""
    spec = source.spec
    path = source.optim_path(rank)
    optimizer = _optimizer_of(load_portable(path, schema.safe_globals(), trust_pickle), path)
    _check_state_sizes(optimizer, _inner(optimizer, path), path)
    if (INNER in optimizer) != spec.wrapped or _entries(optimizer, spec.wrapped) != spec.entries[rank]:
        raise CheckpointError(path, "changed since it was inspected (its optimizer states differ from what the plan "
                                    "was made from)")
    return _slots_of(optimizer, spec.wrapped, path)


def _slots_of(optimizer: dict, wrapped: bool, path: str) -> dict:
    """{slot: (path, TensorRef)} of one optimizer dict, buffer b its b-th parameter over the groups."""
    inner = optimizer.get(INNER, optimizer)
    slots, buffer = {}, 0
    for g, group in enumerate(inner["param_groups"]):
        for position, index in enumerate(group["params"]):
            for key, value in (inner["state"].get(index) or {}).items():
                if isinstance(value, TensorRef):
                    slots[("scalar" if tuple(value.shape) == () else "optim", buffer, key)] = (path, value)
            if wrapped:
                slots[("master", buffer, "fp32")] = (path, optimizer["fp32_groups"][g][position])
            buffer += 1
    return slots


def zero0_output_slots(output: Zero0MoeCheckpoint, rank: int, trust_pickle: bool = False) -> dict:
    """{slot: (path, TensorRef)} where target rank `rank` of `plan_zero0_moe` put each tensor in `output`
    (a ZeRO-0 MoE output, inspected as a source): its `expp_rank_{rank}` file, or for rank ep the
    model-states file's copy of EP rank 0's optimizer. What `verify --against` reads back (reshard.verify)."""
    if rank < output.spec.topology.ep:
        return zero0_source_slots(output, rank, trust_pickle)
    path = output.model_path()
    optimizer = _optimizer_of(load_portable(path, schema.safe_globals(), trust_pickle), path)
    _check_state_sizes(optimizer, _inner(optimizer, path), path)
    if (INNER in optimizer) != output.spec.wrapped:
        raise CheckpointError(path, "holds another optimizer kind than its expp_rank files")
    return _slots_of(optimizer, output.spec.wrapped, path)


@dataclass(frozen=True)
class Zero0Moe:
    """The target form of a ZeRO-0 MoE save (a reshard.formats.deepspeed_files.stage_change.ZeroStageTarget): stage 0
    kept, planned by planning/checkpoint_plan.plan_zero0_moe, its files `zero0_target_files`, its source
    slots `zero0_source_slots` (the ZeRO partition checks find none at stage 0).

    `copies`: which target file each target rank writes (rank t: file `copies[t]`, t < ep an `expp_rank_{t}`,
    t == ep the model-states file), where a job writes a file more than once (a node-local job: once per
    node that loads it, reshard.jobs.node_local); None: rank t writes file t, each once."""

    trust_pickle: bool = False
    copies: tuple[int, ...] | None = None
    stage = 0
    changed_to = None

    def plan(self, source: Zero0MoeCheckpoint, target: Topology, workers: int, budget_bytes: int,
             ownership=None, tabulated: bool = True):
        """Every space from its piece tables (plan_zero0_moe), whatever `tabulated` asks: an array task
        restricts it to its files by them."""
        from reshard.planning.checkpoint_plan import plan_zero0_moe
        return plan_zero0_moe(source.spec, target, workers, budget_bytes, ownership, self.copies)

    def notes(self, spec) -> list[str]:
        return ["whole tensors per parameter (no ZeRO partitions), each parameter's states a buffer of their own; "
                "the model-states file holds EP rank 0's optimizer again"]

    def files(self, source: Zero0MoeCheckpoint, target: Topology, rank: int) -> list[TargetFile]:
        return zero0_target_files(source, target, rank if self.copies is None else self.copies[rank])

    def source_slots(self, source: Zero0MoeCheckpoint, rank: int, found: dict) -> dict:
        return zero0_source_slots(source, rank, self.trust_pickle)
