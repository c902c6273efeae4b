"""The param groups of a ZeRO-0 native MoE optimizer at one expert-parallel size. Pure, no torch.

    from reshard.layouts.zero0_expert_groups import GroupOrder, solve_per_expert_counts
    counts = solve_per_expert_counts(shapes, layer_shapes=[[(9, 7), (9,), (7, 9), (7,)]] * 2,
                                     local_counts=[2, 2])          # (2, 2): fc1.weight, fc2.weight
    order = GroupOrder(per_expert=counts, num_experts=(4, 4))
    order.sources(source_ep=2, target_ep=1, target_rank=0)       # [(EP rank, position), ...]

Without ZeRO (stage 0) DeepSpeed saves each EP rank's whole torch optimizer state_dict
(runtime/engine.py `_save_moe_checkpoint`: `expp_rank_{e}_mp_rank_00_optim_states.pt` holds
`{"optimizer": self.optimizer.state_dict()}`), with no `param_shapes` to name its parameters.
What places a parameter is its position in its param group:
- a dense group is the same list on every EP rank;
- an expert group (moe/utils.py `split_params_into_different_moe_groups_for_optimizer`, which
  keeps `model.parameters()` order) lists, MoE layer by MoE layer, the LOCAL experts of that
  EP rank one after the other (moe/experts.py `Experts` deep-copies one expert, so each holds
  the same parameters), each expert contributing the same `per_expert[layer]` parameters;
- local expert j on EP rank e is global expert e * (num_experts // ep) + j (reshard.layouts.expert_placement).
So the target's position p of an expert group is (layer, global expert, k-th parameter of that
expert in the group), found at the same (layer, expert, k) in the source EP rank holding that
expert. `per_expert` is not written anywhere: `solve_per_expert_counts` recovers it from the
shapes of the group's tensors and of one expert's parameters, and refuses what it cannot tell.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from reshard.layouts.expert_placement import ExpertPlacement
from reshard.layouts.zero import PieceTable, Stream, table_from_columns

Shape = tuple[int, ...]


@dataclass(frozen=True)
class GroupOrder:
    """Where each parameter of one expert param group sits, at any expert-parallel size."""

    per_expert: tuple[int, ...]
    """Per MoE layer: how many parameters each expert puts into this group (0: none)."""
    num_experts: tuple[int, ...]
    """Per MoE layer: its global experts."""

    def length(self, ep: int) -> int:
        """Parameters in this group on each EP rank at `ep`."""
        return sum(ExpertPlacement(n, ep).local_count * c for n, c in zip(self.num_experts, self.per_expert))

    def entries(self, ep: int, ep_rank: int) -> list[tuple[int, int, int]]:
        """(layer, global expert, k) at each position of the group on `ep_rank`."""
        rows = []
        for layer, (n, count) in enumerate(zip(self.num_experts, self.per_expert)):
            placement = ExpertPlacement(n, ep)
            for local in range(placement.local_count):
                expert = placement.global_expert(ep_rank, local)
                rows += [(layer, expert, k) for k in range(count)]
        return rows

    def position(self, ep: int, layer: int, expert: int, k: int) -> tuple[int, int]:
        """(EP rank, position in its group) of parameter k of global `expert` of `layer` at `ep`."""
        before = 0
        for n, count in zip(self.num_experts[:layer], self.per_expert[:layer]):
            before += ExpertPlacement(n, ep).local_count * count
        placement = ExpertPlacement(self.num_experts[layer], ep)
        return placement.ep_rank_of(expert), before + placement.local_of(expert) * self.per_expert[layer] + k

    def sources(self, source_ep: int, target_ep: int, target_rank: int) -> list[tuple[int, int]]:
        """Per position of the group on target EP rank `target_rank`: (source EP rank, position)."""
        return [self.position(source_ep, *entry) for entry in self.entries(target_ep, target_rank)]


def _embeds(pattern: Sequence[Shape | None], shapes: Sequence[Shape]) -> bool:
    """Whether `pattern` (None: any shape) is an ordered subsequence of `shapes` (greedy is exact)."""
    i = 0
    for wanted in pattern:
        while i < len(shapes) and wanted is not None and shapes[i] != wanted:
            i += 1
        if i == len(shapes):
            return False
        i += 1
    return True


def _chunk_pattern(shapes: Sequence[Shape | None], start: int, chunks: int, count: int) -> list | None:
    """The common shape pattern of `chunks` consecutive runs of `count` (None where unknown), or
    None when two runs disagree."""
    pattern: list[Shape | None] = [None] * count
    for chunk in range(chunks):
        for k in range(count):
            shape = shapes[start + chunk * count + k]
            if shape is None:
                continue
            if pattern[k] is None:
                pattern[k] = shape
            elif pattern[k] != shape:
                return None
    return pattern


def solve_per_expert_counts(shapes: Sequence[Shape | None], layer_shapes: Sequence[Sequence[Shape]],
                            local_counts: Sequence[int]) -> tuple[int, ...]:
    """`per_expert` of an expert group from its tensors' shapes (None where unknown: a parameter
    that never received a gradient has no optimizer state), the shapes of one expert's
    parameters per MoE layer (its expert file, in module order) and the local experts per layer.

    Raises ValueError when no split fits, or when several do."""
    total, layers = len(shapes), len(layer_shapes)
    memo: dict[tuple[int, int], list[tuple[int, ...]]] = {}

    def solve(layer: int, position: int) -> list[tuple[int, ...]]:
        if layer == layers:
            return [()] if position == total else []
        key = (layer, position)
        if key not in memo:
            found: list[tuple[int, ...]] = []
            for count in range(len(layer_shapes[layer]) + 1):
                end = position + local_counts[layer] * count
                if end > total:
                    break
                pattern = _chunk_pattern(shapes, position, local_counts[layer], count)
                if pattern is None or not _embeds(pattern, layer_shapes[layer]):
                    continue
                found += [(count, *rest) for rest in solve(layer + 1, end)]
                if len(found) > 1:
                    break
            memo[key] = found[:2]
        return memo[key]

    solutions = solve(0, 0)
    if not solutions:
        raise ValueError(f"its {total} parameters do not split into MoE layers of {list(local_counts)} local "
                         "experts with the expert files' parameter shapes")
    if len(solutions) > 1:
        raise ValueError(f"its {total} parameters split into MoE layers in more than one way "
                         f"({list(solutions[0])} or {list(solutions[1])} per expert per layer)")
    return solutions[0]


@dataclass(frozen=True)
class Zero0Space:
    """One space of a ZeRO-0 MoE save: the tensors kept per parameter that move together."""

    name: str
    """"optim" (per-element optimizer states), "scalar" (0-d states: torch's `step`) or "master"
    (FP16_UnfusedOptimizer's fp32 copy of every parameter, `fp32_groups`)."""
    streams: tuple[Stream, ...]
    """One per tensor kept per parameter in this space, by its state key ("fp32" for masters)."""
    numels: tuple[tuple[tuple[int, ...], ...], ...]
    """[source EP rank][param group][position]: elements of that parameter here (0: it has none)."""


def target_places(orders: Sequence[GroupOrder | None], group_lengths: Sequence[int], source_ep: int, target_ep: int,
                  target_rank: int) -> list[tuple[int, int, int]]:
    """Every parameter of target EP rank `target_rank`'s optimizer, in its order (param group by
    param group): (group, source EP rank, position in that group on the source rank). A dense group
    is EP rank 0's list (every EP rank holds the same dense parameters, each with the state of the
    same data-parallel step: engine.py `_save_moe_checkpoint` keeps EP rank 0's in the model file)."""
    places = []
    for g, (order, length) in enumerate(zip(orders, group_lengths)):
        if order is None:
            places += [(g, 0, p) for p in range(length)]
        else:
            places += [(g, rank, p) for rank, p in order.sources(source_ep, target_ep, target_rank)]
    return places


def zero0_pieces(numels: Sequence[Sequence[Sequence[int]]], orders: Sequence[GroupOrder | None],
                 group_lengths: Sequence[int], source_ep: int, target_ep: int,
                 copies: Sequence[int] | None = None) -> tuple[PieceTable, PieceTable, tuple[int, ...]]:
    """(source pieces, target pieces, per target buffer its most elements) of one space of a ZeRO-0
    MoE save resharded from `source_ep` to `target_ep` EP ranks (docs/architecture.md, "One road").

        old, new, sizes = zero0_pieces(numels, orders, lengths, source_ep=2, target_ep=1)
        plan_space("optim", old, new, streams, sizes, Ownership(2, 2, workers), budget)

    `numels[e][g][p]`: the elements parameter p of param group g on source EP rank e has in this space
    (0: none, a parameter with no optimizer state yet). Each parameter of a rank's optimizer is one
    buffer of its own, numbered in the optimizer's order over every group (its index in the torch
    state_dict), whole at offset 0: nothing is partitioned at stage 0. Target ranks 0 .. target_ep - 1
    are the `expp_rank_{e}` files; rank `target_ep` is the model-states file's copy of EP rank 0's
    optimizer (engine.py `_common_checkpoint_state`), so each of its pieces is a replicated piece of
    rank 0's. The space is every target buffer in order, each followed by its copies on the other
    target ranks, so that a dense parameter's copies (one per target rank, all read from source EP
    rank 0) fall at one buffer position and are read once per round (transport/read_once.py).

    `copies`: which of those target files each target rank writes (default: rank t file t), for a job
    that writes a file more than once, as a node-local job writes the files of every node that loads
    them (reshard.jobs.node_local): a copy is one more replicated piece at the same buffer position."""
    group_base = [0]
    for length in group_lengths:
        group_base.append(group_base[-1] + length)
    files = list(range(target_ep + 1)) if copies is None else list(copies)
    ranks = len(files)
    places = [target_places(orders, group_lengths, source_ep, target_ep, f if f < target_ep else 0)
              for f in files]
    count = len(places[0])
    sizes = [0] * count
    start, src_rank, src_buffer, dst_rank, dst_buffer = [], [], [], [], []
    total = 0
    for buffer in range(count):
        for t in range(ranks):
            g, rank, position = places[t][buffer]
            n = int(numels[rank][g][position])
            if n == 0:
                continue
            start.append(total)
            src_rank.append(rank)
            src_buffer.append(group_base[g] + position)
            dst_rank.append(t)
            dst_buffer.append(buffer)
            sizes[buffer] = max(sizes[buffer], n)
            total += n
    start, zeros = np.asarray(start, np.int64), np.zeros(len(start), np.int64)
    old = table_from_columns([(start, np.asarray(src_rank, np.int64), np.asarray(src_buffer, np.int64), zeros)], total)
    new = table_from_columns([(start, np.asarray(dst_rank, np.int64), np.asarray(dst_buffer, np.int64), zeros)], total)
    return old, new, tuple(sizes)
