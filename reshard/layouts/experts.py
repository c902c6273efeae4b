"""ZeRO-1/2 layout of a native DeepSpeed MoE checkpoint at one (dp, ep) topology. Pure, no torch.

    from reshard.layouts.experts import ExpertParams, expert_zero12_layout
    experts = ExpertParams.of(params, expert_groups=(False, True), num_experts=(4,))
    layout = expert_zero12_layout(params, groups, experts, Topology(dp=4, ep=2))
    layout.pieces                      # every element of every GLOBAL parameter, once
    layout.rank_groups(3)              # [(dense group, 3), (expert group of EP rank 1, 1)]

The logical space is the model's GLOBAL parameters: dense ones and every global expert's
parameters under their global names (`reshard.layouts.expert_placement`), in the spec's order, so the
source and target layouts describe the same space whatever their ep. The rules
(runtime/zero/stage_1_and_2.py `DeepSpeedZeroOptimizer.__init__`, which takes each group's
`real_dp_process_group`; runtime/bf16_optimizer.py the same):
- a dense param group is ZeRO-partitioned over all dp ranks (`zero12_group`);
- an expert param group (`moe: True`) is, on EP rank e, the group of e's LOCAL experts (global
  experts e*n .. e*n+n-1 of each layer, in the model's order), ZeRO-partitioned over e's
  expert-data-parallel group (dp // ep ranks, `Topology.expert_dp_rank_of`);
- names in the rank's metadata (slice mappings, param_shapes) are the LOCAL names.
Every element still has exactly one holder, so the 1-D planner (`reshard.planning.plan`) moves it as is.

AutoEP folded with AutoTP (`Topology.folded`, see `reshard.topology` for DeepSpeed's groups):
the layout of TP rank t holds t's TP-LOCAL dense parameters, ZeRO-partitioned over the dp
ranks of t's lane, and the experts whole, each EP rank's over its S // ep expert-DP ranks,
which are global ranks of any lane (`rank_groups` takes the dp rank, as for every layout, and
finds the global rank from `tp_rank`). The planner moves the two families as two spaces side
by side (`dense_pieces`: lowered to global tensors by `reshard.layouts.tensor_pieces`; `expert_pieces`:
global ranks already), see `reshard.planning.checkpoint_plan.plan_folded_space`.

AutoEP checkpoints (`ExpertParams.autoep`) use the same rules with one more: a rank's experts of
one weight are one fused parameter, `experts.w1 [n_local, ...]` (module_inject/auto_ep_layer.py).
The logical parameters are the per-expert slices `experts.w1.{G}`, listed weight by weight and
expert by expert, so each EP rank's slices of one weight sit next to each other in its flat
group exactly where DeepSpeed puts the fused tensor; the metadata merges them back under the
fused name (slice mappings, param_shapes [n_local, ...]).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from reshard.layouts.expert_placement import (
    ExpertPlacement,
    autoep_fused_name,
    autoep_name_parts,
    expert_name_parts,
    with_expert_index,
)
from reshard.layouts.zero import (
    ParamSpec,
    PieceTable,
    Zero12Group,
    logical_bases,
    table_from_columns,
    zero12_group,
    zero12_group_columns,
)
from reshard.topology import Topology


@dataclass(frozen=True)
class ExpertParams:
    """Which parameters of a spec are experts, and of which MoE layer and global expert."""

    expert_groups: tuple[bool, ...]
    """Per param group: True for an expert group (`moe: True` in the optimizer)."""
    num_experts: tuple[int, ...]
    """Experts of each MoE layer (the model-states file's `num_experts`)."""
    layer_prefixes: tuple[str, ...]
    """Name prefix of each MoE layer's experts, through `deepspeed_experts.`."""
    expert_of: tuple[tuple[int, int] | None, ...]
    """Per parameter: (MoE layer, global expert), or None for a dense parameter."""
    autoep: bool = False
    """AutoEP: parameters are per-expert slices `...experts.w1.{G}` of fused local tensors;
    native MoE (False): `...deepspeed_experts.{j}....` modules."""

    @classmethod
    def of(cls, params: Sequence[ParamSpec], expert_groups: Sequence[bool], num_experts: Sequence[int],
           layer_prefixes: Sequence[str], autoep: bool = False) -> "ExpertParams":
        layer_of = {prefix: layer for layer, prefix in enumerate(layer_prefixes)}
        parse = autoep_name_parts if autoep else expert_name_parts
        expert_of = []
        for param in params:
            parts = parse(param.name)
            expert_of.append(None if parts is None else (layer_of[parts[0]], parts[1]))
        return cls(tuple(expert_groups), tuple(num_experts), tuple(layer_prefixes), tuple(expert_of), autoep)

    def placement(self, layer: int, ep: int) -> ExpertPlacement:
        return ExpertPlacement(self.num_experts[layer], ep)

    def ep_rank_of(self, pid: int, ep: int) -> int:
        layer, expert = self.expert_of[pid]
        return self.placement(layer, ep).ep_rank_of(expert)

    def local_name(self, param: ParamSpec, pid: int, ep: int) -> str:
        """The name DeepSpeed's module gives parameter `pid` on its EP rank at `ep`."""
        if self.expert_of[pid] is None:
            return param.name
        if self.autoep:
            return autoep_fused_name(param.name)
        layer, expert = self.expert_of[pid]
        return with_expert_index(param.name, self.placement(layer, ep).local_of(expert))

    def local_param_shapes(self, params: Sequence[ParamSpec], pids: Sequence[int], ep: int
                           ) -> list[tuple[str, tuple[int, ...]]]:
        """(local name, local shape) of the parameters `pids` as one EP rank's module holds them
        (engine.py `_get_zero_param_shapes`): AutoEP slices of one fused tensor become one entry
        of shape [n_local, ...]."""
        shapes: list[tuple[str, tuple[int, ...]]] = []
        for pid in pids:
            name, shape = self.local_name(params[pid], pid, ep), tuple(params[pid].shape)
            if self.autoep and self.expert_of[pid] is not None:
                if shapes and shapes[-1][0] == name:
                    shapes[-1] = (name, (shapes[-1][1][0] + 1, *shape))
                    continue
                shape = (1, *shape)
            shapes.append((name, shape))
        return shapes

    def ep_problem(self, ep: int) -> str | None:
        """Why DeepSpeed could not build these layers at `ep` (moe/layer.py asserts), or None."""
        bad = sorted({n for n in self.num_experts if n % ep})
        if bad:
            return (f"the MoE layers have {', '.join(map(str, bad))} experts, which ep={ep} does not divide "
                    "(DeepSpeed's MoE needs num_experts % ep_size == 0)")
        return None


@dataclass(frozen=True)
class ExpertZero12Layout:
    """All param groups of a ZeRO-1/2 or BF16_Optimizer MoE checkpoint at one topology."""

    params: tuple[ParamSpec, ...]
    experts: ExpertParams
    topology: Topology
    groups_by_ep_rank: tuple[tuple[Zero12Group, ...], ...]
    """[EP rank][param group]: dense groups span all dp ranks, expert groups that EP rank's experts."""
    tp_rank: int = 0
    """The TP rank whose local parameters `params` are (folded layouts; 0 otherwise)."""

    @property
    def world_size(self) -> int:
        return self.topology.dp

    @property
    def groups(self) -> tuple[Zero12Group, ...]:
        """EP rank 0's groups: buffer sizes (the same on every EP rank) and the local names of
        param_shapes (EP rank 0's global ids are the local ones)."""
        return self.groups_by_ep_rank[0]

    @property
    def numels(self) -> tuple[int, ...]:
        return tuple(p.numel for p in self.params)

    def rank_groups(self, rank: int) -> list[tuple[Zero12Group, int]]:
        """Each param group as dp rank `rank` (of TP rank `tp_rank`) holds it, with its index inside that group."""
        global_rank = self.topology.rank_of(rank, self.tp_rank)
        ep_rank = self.topology.expert_parallel_rank(global_rank)
        expert_dp_rank = self.topology.expert_data_parallel_rank(global_rank)
        return [(group, expert_dp_rank if is_expert else rank)
                for group, is_expert in zip(self.groups_by_ep_rank[ep_rank], self.experts.expert_groups)]

    def name_on_rank(self, pid: int, rank: int) -> str:
        return self.experts.local_name(self.params[pid], pid, self.topology.ep)

    def param_shapes_on_rank(self, pids: Sequence[int], rank: int) -> list[tuple[str, tuple[int, ...]]]:
        return self.experts.local_param_shapes(self.params, pids, self.topology.ep)

    @functools.cached_property
    def pieces(self) -> PieceTable:
        if self.topology.tp > 1:  # dense ranks would be dp ranks, expert ranks global ones
            raise ValueError("a folded layout is planned family by family (dense_pieces, expert_pieces)")
        numels = np.asarray(self.numels, dtype=np.int64)
        bases = logical_bases(self.numels)
        columns = []
        for ep_rank, groups in enumerate(self.groups_by_ep_rank):
            for buffer, (group, is_expert) in enumerate(zip(groups, self.experts.expert_groups)):
                if not is_expert and ep_rank > 0:
                    continue  # a dense group is the same on every EP rank: count it once
                cols = zero12_group_columns(group, buffer, numels, bases)
                if cols is None:
                    continue
                start, rank, buffers, offset = cols
                if is_expert:
                    rank = self.topology.expert_dp_rank_of(ep_rank, rank)
                columns.append((start, rank, buffers, offset))
        return table_from_columns(columns, int(numels.sum()))


    def _family_columns(self, expert: bool):
        """(numels, bases) of the space of one family: the other family's parameters take no room."""
        is_expert = np.asarray([e is not None for e in self.experts.expert_of], dtype=bool)
        numels = np.where(is_expert == expert, np.asarray(self.numels, dtype=np.int64), 0)
        return numels, logical_bases(numels.tolist())

    @functools.cached_property
    def dense_pieces(self) -> PieceTable:
        """Pieces of the dense parameters only (over their local space, end to end in the spec's
        order), rank = dp rank, buffer = param group: what `reshard.layouts.tensor_pieces` lowers per TP rank."""
        numels, bases = self._family_columns(expert=False)
        columns = [cols for buffer, (group, is_expert) in enumerate(zip(self.groups, self.experts.expert_groups))
                   if not is_expert and (cols := zero12_group_columns(group, buffer, numels, bases)) is not None]
        return table_from_columns(columns, int(numels.sum()))

    @functools.cached_property
    def dense_params(self) -> tuple[ParamSpec, ...]:
        return tuple(p for p, e in zip(self.params, self.experts.expert_of) if e is None)

    @functools.cached_property
    def expert_pieces(self) -> PieceTable:
        """Pieces of the expert parameters only (their space end to end), rank = GLOBAL rank."""
        numels, bases = self._family_columns(expert=True)
        columns = []
        for ep_rank, groups in enumerate(self.groups_by_ep_rank):
            for buffer, (group, is_expert) in enumerate(zip(groups, self.experts.expert_groups)):
                cols = zero12_group_columns(group, buffer, numels, bases) if is_expert else None
                if cols is not None:
                    start, rank, buffers, offset = cols
                    columns.append((start, self.topology.expert_dp_rank_of(ep_rank, rank), buffers, offset))
        return table_from_columns(columns, int(numels.sum()))


def expert_zero12_layout(params: Sequence[ParamSpec], groups: Sequence[Sequence[int]], experts: ExpertParams,
                         topology: Topology, *, round_robin: bool = False, param_alignment: int = 1,
                         tp_rank: int = 0) -> ExpertZero12Layout:
    """Lay out every param group of an MoE checkpoint at `topology` (see the module docstring)."""
    problem = experts.ep_problem(topology.ep)
    if problem:
        raise ValueError(problem)
    numels = [p.numel for p in params]
    dense = {g: zero12_group(ids, numels, topology.dp, round_robin=round_robin, param_alignment=param_alignment)
             for g, ids in enumerate(groups) if not experts.expert_groups[g]}
    local = {}  # (group, EP rank) -> its params in the group's order: one pass over each group
    for g, ids in enumerate(groups):
        if experts.expert_groups[g]:
            for ep_rank in range(topology.ep):
                local[(g, ep_rank)] = []
            for pid in ids:
                local[(g, experts.ep_rank_of(pid, topology.ep))].append(pid)
    by_ep_rank = tuple(tuple(dense[g] if not experts.expert_groups[g] else
                             zero12_group(local[(g, ep_rank)], numels, topology.expert_dp, round_robin=round_robin,
                                          param_alignment=param_alignment)
                             for g in range(len(groups)))
                       for ep_rank in range(topology.ep))
    sizes = {tuple(g.partition_numel for g in groups) for groups in by_ep_rank}
    if len(sizes) != 1:
        raise ValueError(f"EP ranks would hold experts of different sizes ({sorted(sizes)}): DeepSpeed's MoE "
                         "deep-copies one expert, so this is not a native MoE layout")
    return ExpertZero12Layout(tuple(params), experts, topology, by_ep_rank, tp_rank)


def expert_placement_lines(experts: ExpertParams, topology: Topology) -> list[str]:
    """What a dry run shows: which global experts each EP rank holds, and the expert-data-parallel
    groups (the ranks that ZeRO-partition one EP rank's experts)."""
    lines = []
    for layer, count in enumerate(experts.num_experts):
        placement = ExpertPlacement(count, topology.ep)
        blocks = ", ".join(f"EP rank {e}: experts {placement.global_expert(e, 0)}-"
                           f"{placement.global_expert(e, placement.local_count - 1)}" for e in range(topology.ep))
        lines.append(f"MoE layer {layer} ({count} experts) at ep={topology.ep}: {blocks}")
    groups = [[topology.expert_dp_rank_of(e, d) for d in range(topology.expert_dp)] for e in range(topology.ep)]
    lines.append(f"expert-data-parallel groups (ranks partitioning one EP rank's experts, {topology.expert_dp} each): "
                 + " ".join("[" + ",".join(map(str, g)) + "]" for g in groups[:8]) + (" ..." if len(groups) > 8 else ""))
    return lines


@dataclass(frozen=True)
class ExpertZero3SubGroup:
    """A ZeRO-3 sub-group of an AutoEP checkpoint: what each rank holds of its partitioned
    parameters (`units`: one logical parameter, or the run of expert slices of a fused tensor)."""

    group: int
    units: tuple[tuple[int, ...], ...]
    chunk_numels: tuple[int, ...]
    """ceil(numel / partition size) per unit: what each rank of the partition group holds of it."""
    is_expert: bool

    @property
    def params(self) -> tuple[int, ...]:
        return tuple(pid for unit in self.units for pid in unit)

    @property
    def partition_numel(self) -> int:
        return sum(self.chunk_numels)

    @property
    def chunk_offsets(self) -> tuple[int, ...]:
        return tuple(np.concatenate(([0], np.cumsum(self.chunk_numels, dtype=np.int64)))[:-1].tolist())


@dataclass(frozen=True)
class ExpertZero3Layout:
    """An AutoEP ZeRO-3 checkpoint at one topology (DeepSpeed's `zero3_partitioned` format).

    runtime/engine.py `_partition_autoep_zero3_experts` partitions each fused expert tensor of EP
    rank e over e's expert-data-parallel group (ceil(n / (dp/ep)) per rank), dense parameters over
    all dp ranks; stage3.py `_create_fp16_sub_groups` then cuts each param group into sub-groups
    by those chunk sizes, so every EP rank has the same sub-groups, over its own experts."""

    params: tuple[ParamSpec, ...]
    experts: ExpertParams
    topology: Topology
    groups: tuple[tuple[int, ...], ...]
    sub_groups_by_ep_rank: tuple[tuple[ExpertZero3SubGroup, ...], ...]
    tp_rank: int = 0
    """The TP rank whose local parameters `params` are (folded layouts; 0 otherwise)."""

    @property
    def world_size(self) -> int:
        return self.topology.dp

    @property
    def sub_groups(self) -> tuple[ExpertZero3SubGroup, ...]:
        """EP rank 0's sub-groups (sizes are the same on every EP rank; names of rank 0's files)."""
        return self.sub_groups_by_ep_rank[0]

    def name_on_rank(self, pid: int, rank: int) -> str:
        return self.experts.local_name(self.params[pid], pid, self.topology.ep)

    def param_shapes_on_rank(self, pids: Sequence[int], rank: int) -> list[tuple[str, tuple[int, ...]]]:
        return self.experts.local_param_shapes(self.params, pids, self.topology.ep)

    def partition_groups(self, rank: int, ep_group_name: str) -> list[dict]:
        """stage3.py `_zero3_partition_group_metadata` of dp rank `rank` of TP rank `tp_rank`
        (`ds_zero_partition_groups`; its ranks are global: a folded dense group is a TP lane)."""
        topology = self.topology
        global_rank = topology.rank_of(rank, self.tp_rank)
        ep_rank = topology.expert_parallel_rank(global_rank)
        expert_dp_rank = topology.expert_data_parallel_rank(global_rank)
        out = []
        for sg_id, sg in enumerate(self.sub_groups_by_ep_rank[ep_rank]):
            if sg.is_expert:
                ranks = [topology.expert_dp_rank_of(ep_rank, d) for d in range(topology.expert_dp)]
                out.append({"sub_group": sg_id, "partition_count": topology.expert_dp, "partition_rank": expert_dp_rank,
                            "partition_ranks": ranks, "families": ["autoep_expert"], "group_names": [ep_group_name]})
            else:
                out.append({"sub_group": sg_id, "partition_count": topology.dp, "partition_rank": rank,
                            "partition_ranks": [topology.rank_of(d, self.tp_rank) for d in range(topology.dp)],
                            "families": ["replicated"],
                            "group_names": ["replicated"]})
        return out

    @functools.cached_property
    def pieces(self) -> PieceTable:
        numels = np.asarray([p.numel for p in self.params], dtype=np.int64)
        bases = logical_bases([p.numel for p in self.params])
        starts, ranks, buffers, offsets = [], [], [], []
        for ep_rank, sub_groups in enumerate(self.sub_groups_by_ep_rank):
            for sg_id, sg in enumerate(sub_groups):
                if not sg.is_expert and ep_rank > 0:
                    continue  # dense sub-groups are the same on every EP rank: count them once
                for unit, chunk, offset in zip(sg.units, sg.chunk_numels, sg.chunk_offsets):
                    numel = int(numels[list(unit)].sum())
                    for r in range(-(-numel // chunk) if chunk else 0):
                        starts.append(int(bases[unit[0]]) + r * chunk)
                        ranks.append(self.topology.expert_dp_rank_of(ep_rank, r) if sg.is_expert else r)
                        buffers.append(sg_id)
                        offsets.append(offset)
        columns = [tuple(np.asarray(c, dtype=np.int64) for c in (starts, ranks, buffers, offsets))] if starts else []
        return table_from_columns(columns, int(numels.sum()))

    def _family_pieces(self, expert: bool) -> PieceTable:
        """Pieces of one family only, over its own space (the other family takes no room): dense
        ranks are dp ranks, expert ranks global ranks (as ExpertZero12Layout's)."""
        is_expert = np.asarray([e is not None for e in self.experts.expert_of], dtype=bool)
        numels = np.where(is_expert == expert, np.asarray([p.numel for p in self.params], dtype=np.int64), 0)
        bases = logical_bases(numels.tolist())
        starts, ranks, buffers, offsets = [], [], [], []
        for ep_rank, sub_groups in enumerate(self.sub_groups_by_ep_rank):
            for sg_id, sg in enumerate(sub_groups):
                if sg.is_expert != expert or (not expert and ep_rank > 0):
                    continue
                for unit, chunk, offset in zip(sg.units, sg.chunk_numels, sg.chunk_offsets):
                    numel = int(numels[list(unit)].sum())
                    for r in range(-(-numel // chunk) if chunk else 0):
                        starts.append(int(bases[unit[0]]) + r * chunk)
                        ranks.append(self.topology.expert_dp_rank_of(ep_rank, r) if expert else r)
                        buffers.append(sg_id)
                        offsets.append(offset)
        columns = [tuple(np.asarray(c, dtype=np.int64) for c in (starts, ranks, buffers, offsets))] if starts else []
        return table_from_columns(columns, int(numels.sum()))

    @functools.cached_property
    def dense_pieces(self) -> PieceTable:
        return self._family_pieces(expert=False)

    @functools.cached_property
    def dense_params(self) -> tuple[ParamSpec, ...]:
        return tuple(p for p, e in zip(self.params, self.experts.expert_of) if e is None)

    @functools.cached_property
    def expert_pieces(self) -> PieceTable:
        return self._family_pieces(expert=True)


def _units(pids: Sequence[int], params: Sequence[ParamSpec], experts: ExpertParams, ep: int) -> list[tuple[int, ...]]:
    """The partitioned parameters of a group: runs of one local name (AutoEP's fused experts)."""
    units: list[list[int]] = []
    last = None
    for pid in pids:
        name = experts.local_name(params[pid], pid, ep)
        if units and name == last and experts.expert_of[pid] is not None:
            units[-1].append(pid)
        else:
            units.append([pid])
        last = name
    return [tuple(u) for u in units]


def _sub_groups(group: int, units: list[tuple[int, ...]], numels: Sequence[int], world: int, sub_group_size: int,
                is_expert: bool) -> list[ExpertZero3SubGroup]:
    """stage3.py `_create_fp16_sub_groups` over the units' chunk sizes (as layout.zero3_sub_groups)."""
    chunks = [-(-sum(numels[p] for p in unit) // world) for unit in units]
    if sub_group_size >= sum(chunks):
        return [ExpertZero3SubGroup(group, tuple(units), tuple(chunks), is_expert)]
    out, members, member_chunks, accumulated = [], [], [], 0
    for index, (unit, chunk) in enumerate(zip(units, chunks)):
        members.append(unit)
        member_chunks.append(chunk)
        accumulated += chunk
        if accumulated >= sub_group_size or index == len(units) - 1:
            out.append(ExpertZero3SubGroup(group, tuple(members), tuple(member_chunks), is_expert))
            members, member_chunks, accumulated = [], [], 0
    return out


def expert_zero3_layout(params: Sequence[ParamSpec], groups: Sequence[Sequence[int]], experts: ExpertParams,
                        topology: Topology, sub_group_size: int, tp_rank: int = 0) -> ExpertZero3Layout:
    """Lay out an AutoEP ZeRO-3 checkpoint at `topology` (see ExpertZero3Layout)."""
    problem = experts.ep_problem(topology.ep)
    if problem:
        raise ValueError(problem)
    if not experts.autoep:
        raise ValueError("native DeepSpeed MoE has no ZeRO-3 layout (DeepSpeed refuses MoE at stage 3)")
    numels = [p.numel for p in params]
    by_ep_rank = []
    for ep_rank in range(topology.ep):
        sub_groups: list[ExpertZero3SubGroup] = []
        for g, ids in enumerate(groups):
            is_expert = experts.expert_groups[g]
            mine = [pid for pid in ids if not is_expert or experts.ep_rank_of(pid, topology.ep) == ep_rank]
            sub_groups += _sub_groups(g, _units(mine, params, experts, topology.ep), numels,
                                      topology.expert_dp if is_expert else topology.dp, sub_group_size, is_expert)
        by_ep_rank.append(tuple(sub_groups))
    return ExpertZero3Layout(tuple(params), experts, topology, tuple(tuple(g) for g in groups), tuple(by_ep_rank),
                             tp_rank)
