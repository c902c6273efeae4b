"""Piece tables of tensor-parallel ZeRO checkpoints over one global space. Pure, no torch.

    from reshard.tensor_pieces import GlobalSpace, zero12_pieces
    space = GlobalSpace.of(spec.tensor.params, target_tp=1)
    source = zero12_pieces(spec.tensor.params, space, spec.topology, lambda t: spec.layout(2, 2, t), "source")
    frozen = zero3_frozen_pieces(spec.frozen, GlobalSpace.of(replicated(spec.frozen), 1), spec.topology, "source")

The logical space is the GLOBAL (unsharded) parameters laid end to end, each row-major, so
it does not depend on either TP size and the 1-D core (`reshard.plan`) intersects a source
and a target of any (tp, dp). A replicated parameter is held by every TP rank: the space
gives it one copy per TARGET TP rank (copy t is what target TP rank t writes); on the
source side every copy is mapped to the bytes of source TP rank 0, which are read for each
copy (the other source TP ranks' copies are not read).

Each (dp, tp) rank's pieces come from the ZeRO rules over its TP-local shapes and the dp
size (`reshard.layout`), are cut where a local tensor of a fused sub-parameter split passes
from one sub-parameter's piece to the next, then are lowered from the rank's local space to
the global one (`reshard.local_to_global`); a piece's rank is the global rank, tp fastest
(`reshard.topology`). The same holds under ZeRO-3 (`reshard.layout.Zero3Layout`: each TP rank's
local parameters chunked over its dp group, engine.py `_get_zero_ckpt_name` names the file by
(dp, tp)), and for its partitioned frozen parameters (`frozen_param_fragments`), which AutoTP
leaves whole: each TP rank holds the same chunks, read from source TP rank 0. Module tensors (the split lp weights of the ZeRO-1/2 model-states
files, one file per TP rank, written by its dp rank 0) form a second space the same way:
buffer j of a rank is its local tensor j. DeepSpeed saves them as views of each param group's
flat lp buffer, whose order and padding depend on the TP-local shapes, so every trainable
module tensor (replicated ones too) gets its own storage in the target files.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from reshard.layout import ParamSpec, PieceTable, Zero3Layout, Zero12Layout, frozen_pieces, logical_bases, \
    table_from_columns
from reshard.layout_tensor import REPLICATED, TensorParallelParams, numel
from reshard.local_to_global import globalize
from reshard.topology import Topology


@dataclass(frozen=True, eq=False)
class GlobalSpace:
    """Global parameters end to end; a replicated parameter once per target TP rank."""

    numels: np.ndarray
    copies: np.ndarray
    bases: np.ndarray
    """Start of copy 0 of each parameter; copy c starts at bases + c * numels."""
    total: int

    @classmethod
    def of(cls, params: TensorParallelParams, target_tp: int) -> "GlobalSpace":
        numels = np.asarray([numel(s) for s in params.shapes], dtype=np.int64)
        copies = np.asarray([target_tp if split.dim is None else 1 for split in params.splits], dtype=np.int64)
        sizes = numels * copies
        return cls(numels, copies, logical_bases(sizes), int(sizes.sum()))


def _bases_for(params: TensorParallelParams, space: GlobalSpace, side: str, tp_rank: int) -> list[list[int]]:
    result = []
    for p, split in enumerate(params.splits):
        base, size = int(space.bases[p]), int(space.numels[p])
        if split.dim is not None:
            result.append([base])
        elif side == "target":
            result.append([base + tp_rank * size])
        else:  # replicated: source TP rank 0 serves every target copy
            result.append([base + c * size for c in range(int(space.copies[p]))] if tp_rank == 0 else [])
    return result


def _placements(params: TensorParallelParams, space: GlobalSpace, side: str, tp: int, tp_rank: int,
                local_bases: np.ndarray) -> tuple[np.ndarray, list]:
    """The rank's local space cut into pieces each one box of a global parameter (a parameter
    of a plain split is one; a sub-parameter split several): their local starts and their
    `globalize` placements."""
    starts, placements = [], []
    for p, copies in enumerate(_bases_for(params, space, side, tp_rank)):
        for offset, box, shape in params.local_pieces(p, tp, tp_rank):
            starts.append(int(local_bases[p]) + offset)
            placements.append((box, shape, copies))
    return np.asarray(starts, dtype=np.int64), placements


def _cut_at(cuts: np.ndarray, start, rank, buffer, offset, length) -> tuple[np.ndarray, ...]:
    """ZeRO pieces (start, rank, buffer, offset, length) of a local space, cut wherever one of
    the sorted local positions `cuts` falls strictly inside one, so each lies in one box."""
    start, rank, buffer, offset, length = (np.asarray(c, dtype=np.int64) for c in (start, rank, buffer, offset, length))
    end = start + length
    first = np.searchsorted(cuts, start, side="right")       # the first cut after each start
    inner = np.searchsorted(cuts, end, side="left") - first  # cuts strictly inside each piece
    if not inner.any():
        return start, rank, buffer, offset, length
    counts = inner + 1
    item = np.repeat(np.arange(len(start)), counts)
    k = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    top = max(len(cuts) - 1, 0)
    left = np.where(k == 0, start[item], cuts[np.minimum(first[item] + k - 1, top)])
    right = np.where(k == counts[item] - 1, end[item], cuts[np.minimum(first[item] + k, top)])
    return left, rank[item], buffer[item], offset[item] + left - start[item], right - left


def zero12_pieces(params: TensorParallelParams, space: GlobalSpace, topology: Topology,
                  layout_of: Callable[[int], Zero12Layout | Zero3Layout], side: str) -> PieceTable:
    """Pieces of every (dp, tp) rank of `topology` over `space`; `layout_of(t)` is TP rank t's
    ZeRO layout (stage 1/2, or 3) over its local shapes at `topology.dp` ranks."""
    columns = []
    for t in range(topology.tp):
        layout = layout_of(t)
        pieces = layout.pieces
        local_bases, placements = _placements(params, space, side, topology.tp, t,
                                              logical_bases([p.numel for p in layout.params]))
        start, dp_rank, buffer, offset = globalize(*_cut_at(local_bases, pieces.start, pieces.rank, pieces.buffer,
                                                            pieces.offset, pieces.length), local_bases, placements)
        columns.append((start, dp_rank * topology.tp + t, buffer, offset))
    return table_from_columns(columns, space.total)


@dataclass(frozen=True)
class _FrozenChunks:
    """ZeRO-3 frozen parameters at one dp size, shaped as `zero12_pieces` reads a layout."""

    params: tuple[ParamSpec, ...]
    pieces: PieceTable


def replicated(frozen: tuple[ParamSpec, ...]) -> TensorParallelParams:
    """Frozen parameters as AutoTP leaves them (whole on every TP rank; split ones are refused
    at inspect, `deepspeed_tensor.tensor_parallel_spec`)."""
    return TensorParallelParams(tuple(p.name for p in frozen), tuple(tuple(p.shape) for p in frozen),
                                (REPLICATED,) * len(frozen))


def zero3_frozen_pieces(frozen: tuple[ParamSpec, ...], space: GlobalSpace, topology: Topology,
                        side: str) -> PieceTable:
    """Pieces of the ZeRO-3 `frozen_param_fragments` of every (dp, tp) rank over `space`
    (`GlobalSpace.of(replicated(frozen), target_tp)`): frozen parameter j alone in buffer j,
    chunked over dp (layout.py `frozen_pieces`), the same chunks on every TP rank."""
    chunks = _FrozenChunks(tuple(frozen), frozen_pieces(frozen, topology.dp))
    return zero12_pieces(replicated(frozen), space, topology, lambda t: chunks, side)


def module_pieces(module: TensorParallelParams, space: GlobalSpace, topology: Topology, side: str) -> PieceTable:
    """Pieces of the module tensors of the model-states files: TP rank t's local tensor j is
    buffer j of global rank (dp 0, tp t), from element 0; replicated ones as in `zero12_pieces`."""
    columns = []
    for t in range(topology.tp):
        numels = np.asarray([numel(module.local_shape(j, topology.tp, t)) for j in range(len(module.names))],
                            dtype=np.int64)
        tensor_bases = logical_bases(numels)
        keep = numels > 0
        local_bases, placements = _placements(module, space, side, topology.tp, t, tensor_bases)
        count = int(keep.sum())
        start, _, buffer, offset = globalize(*_cut_at(local_bases, tensor_bases[keep], np.zeros(count, np.int64),
                                                      np.flatnonzero(keep), np.zeros(count, np.int64), numels[keep]),
                                             local_bases, placements)
        columns.append((start, np.full(len(start), topology.rank_of(0, t), np.int64), buffer, offset))
    return table_from_columns(columns, space.total)


def module_buffer_numels(module: TensorParallelParams, tp: int) -> tuple[int, ...]:
    """Largest shard of each split module tensor over the TP ranks (round windows need a bound)."""
    return tuple(max(numel(module.local_shape(j, tp, t)) for t in range(tp)) for j in range(len(module.names)))
