"""DeepSpeed's ZeRO partition arithmetic, pure: which element of which parameter sits where.

    from reshard.layouts.zero import ParamSpec, zero12_layout
    params = (ParamSpec("w", (11, 7)), ParamSpec("b", (7,)))
    layout = zero12_layout(params, groups=[(0,), (1,)], world_size=4)
    layout.groups[0].partition_numel        # 20: 77 elements padded to 80 over 4 ranks
    layout.pieces.rank                      # the rank that holds each piece

A *logical space* is every element of a list of parameters laid end to end in a fixed order
(optimizer groups in order, parameters in the order the model gave them). That order does
not depend on the world size, so a source and a target layout of the same model describe
the same space and can be intersected (see `reshard.planning.plan`). A layout says, for one world
size, which rank holds each element of the space, in which of its flat buffers, at which
offset: a `PieceTable`. It also carries the per-rank metadata DeepSpeed writes beside the
buffers (paddings, slice mappings, sub-groups), recomputed from the same rules.

Pieces here are 1-D ranges of a flattened parameter, which is all data parallelism needs.
Tensor- and expert-parallel layouts cut a parameter into n-D blocks first; they will become
a block coordinate on top of this space, not a different planner.

Rules mirrored, by DeepSpeed 0.19.8 file and function:
- ZeRO-1/2: runtime/zero/stage_1_and_2.py, DeepSpeedZeroOptimizer.__init__ (round-robin
  reorder `_round_robin_reorder`, per-parameter alignment padding, tail padding to a multiple
  of 2 * world size via runtime/utils.py `align_dense_tensors`, equal partitions), the
  `groups_padding` rule, and `_create_param_mapping` through
  utils/mixed_precision_linkage.py `_init_lp_to_hp_mapping`.
- BF16_Optimizer: runtime/bf16_optimizer.py, `_setup_for_real_optimizer` (no reorder, no
  per-parameter padding, the whole tail padding recorded on the last rank only).
- ZeRO-3: runtime/zero/partition_parameters.py `_partition_param` (each parameter alone,
  ceil(n / W) elements per rank) and runtime/zero/stage3.py `_create_fp16_sub_groups`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

NCCL_START_ALIGNMENT_FACTOR = 2  # stage_1_and_2.py: nccl_start_alignment_factor
DEFAULT_SUB_GROUP_SIZE = 1_000_000_000  # runtime/zero/config.py: sub_group_size default


@dataclass(frozen=True)
class ParamSpec:
    """A parameter by name and full (unpartitioned) shape."""

    name: str
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        # set once, not a functools.cached_property: that one takes a lock on every first read
        # (Python 3.11), which dominated laying out 10^5 parameters
        object.__setattr__(self, "numel", math.prod(self.shape))

    numel: int = field(init=False, repr=False, compare=False, default=0)


@dataclass(frozen=True)
class Stream:
    """A tensor kept per flat buffer that moves with the buffer's coordinates."""

    name: str
    """Key of the tensor: "fp32" for master weights, else the optimizer state key."""
    dtype: str
    """torch dtype name without the "torch." prefix, the same in source and target."""
    itemsize: int


@dataclass(frozen=True, eq=False)
class PieceTable:
    """Where every element of a logical space of `total` elements lives at one world size.

    Piece i covers logical elements [start[i], start[i+1]) (the last one ends at `total`);
    pieces are sorted and tile the space exactly, because a ZeRO data-parallel group keeps
    each element on exactly one rank. The piece sits in flat buffer `buffer[i]` of rank
    `rank[i]`, beginning at element `offset[i]` of that buffer.

    Strided pieces (tensor-parallel shards that cut an inner dimension, see
    `reshard.layouts.strided_runs`) carry three more columns: `col`, `width` and `stride`; element e
    of piece i is then at `strided_runs.advance(offset, col, width, stride, e)`. Tables
    without them (every data-parallel layout) are contiguous: element e is at offset + e.
    """

    start: np.ndarray
    rank: np.ndarray
    buffer: np.ndarray
    offset: np.ndarray
    total: int
    col: np.ndarray | None = None
    width: np.ndarray | None = None
    stride: np.ndarray | None = None

    @property
    def length(self) -> np.ndarray:
        return np.diff(np.append(self.start, self.total))

    @property
    def strided(self) -> bool:
        return self.width is not None

    def stride_columns(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(col, width, stride), contiguous ones for a table without them."""
        if self.width is not None:
            return self.col, self.width, self.stride
        from reshard.layouts.strided_runs import CONTIGUOUS
        return (np.zeros(len(self.start), np.int64), np.full(len(self.start), CONTIGUOUS, np.int64),
                np.full(len(self.start), CONTIGUOUS, np.int64))

    def __len__(self) -> int:
        return len(self.start)

    @classmethod
    def from_unsorted(cls, start, rank, buffer, offset, total: int, col=None, width=None, stride=None
                      ) -> "PieceTable":
        order = np.argsort(start, kind="stable")
        extra = () if width is None else tuple(np.asarray(c, np.int64)[order] for c in (col, width, stride))
        table = cls(np.asarray(start, np.int64)[order], np.asarray(rank, np.int64)[order],
                    np.asarray(buffer, np.int64)[order], np.asarray(offset, np.int64)[order], int(total), *extra)
        table.check_tiling()
        return table

    def check_tiling(self) -> None:
        """Raise if the pieces do not tile [0, total) (a layout bug, never bad input)."""
        if self.total == 0:
            assert len(self.start) == 0, "pieces in an empty space"
            return
        assert len(self.start) and self.start[0] == 0, "space does not start at 0"
        assert np.all(np.diff(self.start) > 0), "overlapping or empty pieces"

    def select(self, mask) -> "PieceTable":
        """Some pieces only (they no longer tile the space)."""
        extra = () if self.width is None else (self.col[mask], self.width[mask], self.stride[mask])
        return PieceTable(self.start[mask], self.rank[mask], self.buffer[mask], self.offset[mask], self.total, *extra)


def logical_bases(numels: Sequence[int]) -> np.ndarray:
    """Offset of each parameter in the logical space (parameters laid end to end)."""
    return np.concatenate(([0], np.cumsum(np.asarray(numels, dtype=np.int64))))[:-1].astype(np.int64)


def round_robin_order(count: int, world_size: int) -> list[int]:
    """Positions in the original list, in the order `_round_robin_reorder` flattens them."""
    return [i for j in range(world_size) for i in range(j, count, world_size)]


def undo_round_robin(flat_order: Sequence, world_size: int) -> list:
    """Original order of a list that `_round_robin_reorder` put in `flat_order` for `world_size`."""
    original = [None] * len(flat_order)
    for position, index in enumerate(round_robin_order(len(flat_order), world_size)):
        original[index] = flat_order[position]
    return original


def param_alignment_elements(element_size: int, enabled: bool) -> int:
    """Per-parameter alignment in elements (stage_1_and_2.py: 16 // gcd(16, element_size))."""
    return 16 // math.gcd(16, element_size) if enabled else 1


@dataclass(frozen=True)
class Zero12Group:
    """One optimizer param group as ZeRO-1/2 (or BF16_Optimizer) flattens and splits it."""

    params: tuple[int, ...]
    """Global parameter ids in the model's order (the optimizer group's order)."""
    flat_order: tuple[int, ...]
    """The same ids in the order they are flattened (round-robin reordered if enabled)."""
    flat_offsets: tuple[int, ...]
    """Offset of each `flat_order` parameter in the flat group."""
    alignment_paddings: tuple[int, ...]
    """Zeros after each `flat_order` parameter (`param_alignment_paddings` in the file)."""
    padded_numel: int
    """Parameters plus alignment paddings: where the tail padding starts."""
    world_size: int
    partition_numel: int
    """Elements per rank, `ps`; the flat group is `world_size * ps` long."""

    @property
    def flat_numel(self) -> int:
        return self.partition_numel * self.world_size

    def tail_padding(self, rank: int) -> int:
        """`groups_padding[g]` of DeepSpeedZeroOptimizer on `rank`: tail padding inside its partition."""
        left, size = rank * self.partition_numel, self.partition_numel
        if self.padded_numel <= left:
            return size
        if self.padded_numel < left + size:
            return left + size - self.padded_numel
        return 0

    def bf16_optimizer_padding(self, rank: int) -> int:
        """`group_paddings[g]` of BF16_Optimizer: the whole tail padding, on the last rank only."""
        return self.flat_numel - self.padded_numel if rank == self.world_size - 1 else 0

    def lean_numel(self, rank: int) -> int:
        """Elements of the saved fp32 partition of DeepSpeedZeroOptimizer (tail padding cut off)."""
        return self.partition_numel - self.tail_padding(rank)

    def slice_mappings(self, rank: int, numels: Sequence[int]) -> list[tuple[int, int, int]]:
        """`param_slice_mappings[g]` for `rank`: (param id, numel, start) in DeepSpeed's order.

        Mirrors `_create_param_mapping` -> `_init_lp_to_hp_mapping`: parameters are visited in
        the model's order; offsets are the true flat offsets only when some alignment padding
        is present, otherwise running sums in the model's order. Under round_robin_gradients
        without padding that makes DeepSpeed's own mapping disagree with its flat layout; we
        write what DeepSpeed writes, so the output matches a native save at this world size.
        """
        start_of_partition = rank * self.partition_numel
        end_of_partition = start_of_partition + self.partition_numel
        true_offset = dict(zip(self.flat_order, self.flat_offsets))
        use_true_offsets = any(self.alignment_paddings)
        mappings, running = [], 0
        for pid in self.params:
            offset = true_offset[pid] if use_true_offsets else running
            numel = numels[pid]
            end = offset + numel
            if start_of_partition <= offset < end_of_partition or offset < start_of_partition < end:
                lo, hi = max(offset, start_of_partition), min(end, end_of_partition)
                mappings.append((pid, hi - lo, lo - start_of_partition))
            running += numel
        return mappings


def zero12_group(params: Sequence[int], numels: Sequence[int], world_size: int, *,
                 round_robin: bool = False, param_alignment: int = 1) -> Zero12Group:
    """Lay out one param group of global ids `params` (model order) over `world_size` ranks."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    params = tuple(params)
    flat_order = tuple(params[i] for i in round_robin_order(len(params), world_size)) if round_robin else params
    if param_alignment == 1 and flat_order:  # no padding: offsets are a prefix sum (10^5 params, no loop)
        ends = np.cumsum(np.asarray(numels, dtype=np.int64)[np.asarray(flat_order)]).tolist()
        offsets, paddings, cursor = [0, *ends[:-1]], [0] * len(flat_order), ends[-1]
    else:
        offsets, paddings, cursor = [], [], 0
        for position, pid in enumerate(flat_order):
            offsets.append(cursor)
            cursor += numels[pid]
            padding = 0 if position == len(flat_order) - 1 else (-cursor) % param_alignment
            paddings.append(padding)
            cursor += padding
    alignment = NCCL_START_ALIGNMENT_FACTOR * world_size
    flat_numel = -(-cursor // alignment) * alignment
    return Zero12Group(params, flat_order, tuple(offsets), tuple(paddings), cursor, world_size,
                       flat_numel // world_size)


@dataclass(frozen=True)
class Zero3SubGroup:
    """A ZeRO-3 optimizer sub-group: consecutive parameters of one param group."""

    group: int
    params: tuple[int, ...]
    chunk_numels: tuple[int, ...]
    """ceil(numel / world_size) per parameter: what each rank holds of it, padding included."""

    @property
    def partition_numel(self) -> int:
        return sum(self.chunk_numels)

    @property
    def chunk_offsets(self) -> tuple[int, ...]:
        return tuple(np.concatenate(([0], np.cumsum(self.chunk_numels)))[:-1].tolist())


def zero3_chunk(numel: int, world_size: int) -> int:
    """Elements of one parameter on each rank under ZeRO-3 (`_partition_param`)."""
    return -(-numel // world_size)


def zero3_sub_groups(groups: Sequence[Sequence[int]], numels: Sequence[int], world_size: int,
                     sub_group_size: int = DEFAULT_SUB_GROUP_SIZE) -> tuple[Zero3SubGroup, ...]:
    """Split each param group into sub-groups as `_create_fp16_sub_groups` does at `world_size`."""
    result = []
    for group_id, params in enumerate(groups):
        sizes = np.asarray([numels[p] for p in params], dtype=np.int64)
        chunks = (-(-sizes // world_size)).tolist()
        if sub_group_size >= sum(chunks):
            result.append(Zero3SubGroup(group_id, tuple(params), tuple(chunks)))
            continue
        members, member_chunks, accumulated = [], [], 0
        for index, (pid, chunk) in enumerate(zip(params, chunks)):
            members.append(pid)
            member_chunks.append(chunk)
            accumulated += chunk
            if accumulated >= sub_group_size or index == len(params) - 1:
                result.append(Zero3SubGroup(group_id, tuple(members), tuple(member_chunks)))
                members, member_chunks, accumulated = [], [], 0
    return tuple(result)


def _expand(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For items with `counts`, the item index and the index within the item of every piece."""
    item = np.repeat(np.arange(len(counts)), counts)
    within = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    return item, within


@dataclass(frozen=True)
class Zero12Layout:
    """All param groups of a ZeRO-1/2 or BF16_Optimizer checkpoint at one world size."""

    params: tuple[ParamSpec, ...]
    groups: tuple[Zero12Group, ...]
    world_size: int

    @property
    def numels(self) -> tuple[int, ...]:
        # kept after the first read (planning asks several times of 10^5 parameters); a plain
        # dict entry, as ParamSpec.numel, not a functools.cached_property
        if "_numels" not in self.__dict__:
            self.__dict__["_numels"] = tuple(p.numel for p in self.params)
        return self.__dict__["_numels"]

    @property
    def pieces(self) -> PieceTable:
        return _zero12_pieces(self)

    def rank_groups(self, rank: int) -> list[tuple[Zero12Group, int]]:
        """Each param group as `rank` holds it, with `rank`'s index inside that group (all
        groups span every rank here; see reshard.layouts.experts for groups that do not)."""
        return [(group, rank) for group in self.groups]

    def name_on_rank(self, pid: int, rank: int) -> str:
        """The name `rank`'s module gives parameter `pid` (the same everywhere without experts)."""
        return self.params[pid].name


def zero12_layout(params: Sequence[ParamSpec], groups: Sequence[Sequence[int]], world_size: int, *,
                  round_robin: bool = False, param_alignment: int = 1) -> Zero12Layout:
    numels = [p.numel for p in params]
    laid = tuple(zero12_group(g, numels, world_size, round_robin=round_robin, param_alignment=param_alignment)
                 for g in groups)
    return Zero12Layout(tuple(params), laid, world_size)


def _zero12_pieces(layout: Zero12Layout) -> PieceTable:
    bases = logical_bases(layout.numels)
    numels = np.asarray(layout.numels, dtype=np.int64)
    columns = [zero12_group_columns(group, group_id, numels, bases) for group_id, group in enumerate(layout.groups)]
    return table_from_columns([c for c in columns if c is not None], int(numels.sum()))


def zero12_group_columns(group: Zero12Group, buffer: int, numels: np.ndarray, bases: np.ndarray):
    """(logical start, rank in the group, buffer, offset) of every piece of one flat group, or None
    when it is empty. Ranks are the group's own (0..world_size-1); a caller whose group spans
    other global ranks (expert-data-parallel groups) maps them."""
    if not group.flat_order:
        return None
    ids = np.asarray(group.flat_order, dtype=np.int64)
    offsets = np.asarray(group.flat_offsets, dtype=np.int64)
    sizes = numels[ids]
    keep = sizes > 0
    ids, offsets, sizes = ids[keep], offsets[keep], sizes[keep]
    ps = group.partition_numel
    first = offsets // ps
    counts = (offsets + sizes - 1) // ps - first + 1
    item, within = _expand(counts)
    rank = first[item] + within
    flat_start = np.maximum(offsets[item], rank * ps)
    return (bases[ids[item]] + flat_start - offsets[item], rank, np.full(len(item), buffer), flat_start - rank * ps)


def table_from_columns(columns, total: int) -> PieceTable:
    if not columns:
        empty = np.zeros(0, dtype=np.int64)
        return PieceTable(empty, empty, empty, empty, total)
    joined = [np.concatenate(c) for c in zip(*columns)]  # 4 columns, or 7 with strides
    return PieceTable.from_unsorted(*joined[:4], total, *joined[4:])


@dataclass(frozen=True)
class Zero3Layout:
    """A ZeRO-3 checkpoint at one world size: sub-groups of trainable parameters."""

    params: tuple[ParamSpec, ...]
    groups: tuple[tuple[int, ...], ...]
    sub_groups: tuple[Zero3SubGroup, ...]
    world_size: int

    @property
    def pieces(self) -> PieceTable:
        numels = [p.numel for p in self.params]
        bases = logical_bases(numels)
        buffer_of, offset_of = {}, {}
        for sg_id, sg in enumerate(self.sub_groups):
            for pid, offset in zip(sg.params, sg.chunk_offsets):
                buffer_of[pid], offset_of[pid] = sg_id, offset
        ids = [pid for g in self.groups for pid in g]
        return chunked_pieces(ids, numels, bases, self.world_size,
                              [buffer_of[p] for p in ids], [offset_of[p] for p in ids])

    def name_on_rank(self, pid: int, rank: int) -> str:
        return self.params[pid].name


def zero3_layout(params: Sequence[ParamSpec], groups: Sequence[Sequence[int]], world_size: int,
                 sub_group_size: int = DEFAULT_SUB_GROUP_SIZE) -> Zero3Layout:
    numels = [p.numel for p in params]
    return Zero3Layout(tuple(params), tuple(tuple(g) for g in groups),
                       zero3_sub_groups(groups, numels, world_size, sub_group_size), world_size)


def chunked_pieces(ids: Sequence[int], numels: Sequence[int], bases: np.ndarray, world_size: int,
                   buffers: Sequence[int], offsets: Sequence[int]) -> PieceTable:
    """Pieces of parameters each cut into ceil(n / W) chunks, chunk r on rank r.

    Parameter `ids[i]` sits in buffer `buffers[i]` at `offsets[i]` on every rank, the layout
    of ZeRO-3 flat sub-groups and of its partitioned frozen parameters alike.
    """
    ids = np.asarray(ids, dtype=np.int64)
    sizes = np.asarray(numels, dtype=np.int64)[ids] if len(ids) else np.zeros(0, np.int64)
    keep = sizes > 0
    ids, sizes = ids[keep], sizes[keep]
    buffers = np.asarray(buffers, dtype=np.int64)[keep]
    offsets = np.asarray(offsets, dtype=np.int64)[keep]
    chunks = -(-sizes // world_size)
    counts = -(-sizes // np.maximum(chunks, 1))
    item, rank = _expand(counts)
    start = bases[ids[item]] + rank * chunks[item]
    return PieceTable.from_unsorted(start, rank, buffers[item], offsets[item], int(np.sum(numels)))


def frozen_pieces(frozen: Sequence[ParamSpec], world_size: int) -> PieceTable:
    """ZeRO-3 `frozen_param_fragments`: frozen parameter j is buffer j, chunk r on rank r."""
    numels = [p.numel for p in frozen]
    ids = list(range(len(frozen)))
    return chunked_pieces(ids, numels, logical_bases(numels), world_size, ids, [0] * len(ids))


def buffer_numels(layout: Zero12Layout | Zero3Layout) -> tuple[int, ...]:
    """Padded size of each flat buffer (param group or sub-group); the same on every rank."""
    if hasattr(layout, "sub_groups"):  # Zero3Layout, reshard.layouts.experts.ExpertZero3Layout
        return tuple(sg.partition_numel for sg in layout.sub_groups)
    return tuple(g.partition_numel for g in layout.groups)
