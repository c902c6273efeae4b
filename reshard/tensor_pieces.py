"""Piece tables of tensor-parallel ZeRO checkpoints over one global space. Pure, no torch.

    from reshard.tensor_pieces import GlobalSpace, zero12_pieces
    space = GlobalSpace.of(spec.tensor.params, source_tp=spec.topology.tp, target_tp=1)
    source = zero12_pieces(spec.tensor.params, space, spec.topology, lambda t: spec.layout(2, 2, t), "source")

The logical space is the GLOBAL (unsharded) parameters laid end to end, so the 1-D core
(`reshard.plan`) intersects a source and a target of any (tp, dp). Each parameter is
row-major, except one split inside its rows (row-parallel): that one is taken strip by strip
between both sides' shard boundaries, so a ZeRO range of a shard is one strided piece per
strip, not one piece per row (`reshard.local_to_global`); the space is built for one pair of
TP sizes. A replicated parameter is held by every TP rank: the space
gives it one copy per TARGET TP rank (copy t is what target TP rank t writes); on the
source side every copy is mapped to the bytes of source TP rank 0, which are read for each
copy (the other source TP ranks' copies are not read).

Each (dp, tp) rank's pieces come from the ZeRO rules over its TP-local shapes and the dp
size (`reshard.layout`), then are lowered from the rank's local space to the global one
(`reshard.local_to_global`); a piece's rank is the global rank, tp fastest
(`reshard.topology`). Module tensors (the split lp weights of the ZeRO-1/2 model-states
files, one file per TP rank, written by its dp rank 0) form a second space the same way:
buffer j of a rank is its local tensor j. DeepSpeed saves them as views of each param group's
flat lp buffer, whose order and padding depend on the TP-local shapes, so every trainable
module tensor (replicated ones too) gets its own storage in the target files.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from reshard.layout import PieceTable, Zero12Layout, table_from_columns, logical_bases
from reshard.layout_tensor import TensorParallelParams
from reshard.local_to_global import ShardGrid, globalize
from reshard.topology import Topology


@dataclass(frozen=True, eq=False)
class GlobalSpace:
    """Global parameters end to end; a replicated parameter once per target TP rank; each
    parameter in the order `reshard.local_to_global` gives it for these two TP sizes."""

    numels: np.ndarray
    copies: np.ndarray
    bases: np.ndarray
    """Start of copy 0 of each parameter; copy c starts at bases + c * numels."""
    total: int
    grid: ShardGrid
    replicated: np.ndarray
    """[P] held whole by every TP rank."""

    @classmethod
    def of(cls, params: TensorParallelParams, *, source_tp: int, target_tp: int) -> "GlobalSpace":
        grid = ShardGrid.of(params.shapes, [split.dim for split in params.splits], source_tp, target_tp, params.grain)
        numels = grid.numels
        replicated = np.asarray([split.dim is None for split in params.splits], dtype=bool)
        copies = np.where(replicated, target_tp, 1).astype(np.int64)
        sizes = numels * copies
        return cls(numels, copies, logical_bases(sizes), int(sizes.sum()), grid, replicated)

    def copies_from(self, side: str, tp_rank: int) -> tuple[np.ndarray, np.ndarray]:
        """(first copy's start, number of copies) each parameter of `side`'s TP rank `tp_rank` fills.

        Split parameters fill their one copy; a replicated parameter fills copy t on target TP rank
        t, and every copy from source TP rank 0 (the other source TP ranks' copies are not read)."""
        replicated = self.replicated
        base, count = self.bases, np.ones(len(self.bases), np.int64)
        if side == "target":
            base = np.where(replicated, self.bases + tp_rank * self.numels, self.bases)
        else:
            count = np.where(replicated, self.copies if tp_rank == 0 else 0, 1)
        return base, count

    def table(self, columns) -> PieceTable:
        """A piece table of `globalize` columns; the stride columns are kept only when some
        parameter is strided (otherwise every piece is contiguous, the plain 1-D case)."""
        if not self.grid.strided.any():
            columns = [c[:4] for c in columns]
        return table_from_columns(columns, self.total)


def shared_layouts(space: GlobalSpace, side: str, tp: int, layout_of: Callable[[int], Zero12Layout]) -> list:
    """`layout_of(t)` for every TP rank t of `side`, built once per distinct set of local shapes
    (TP ranks of even shards share one layout: it depends on the local shapes only)."""
    built: dict[bytes, Zero12Layout] = {}
    layouts = []
    for t in range(tp):
        key = space.grid.local_numels(side, t).tobytes()
        if key not in built:
            built[key] = layout_of(t)
        layouts.append(built[key])
    return layouts


def zero12_pieces(params: TensorParallelParams, space: GlobalSpace, topology: Topology,
                  layout_of: Callable[[int], Zero12Layout], side: str) -> PieceTable:
    """Pieces of every (dp, tp) rank of `topology` over `space`; `layout_of(t)` is TP rank t's
    ZeRO layout over its local shapes at `topology.dp` ranks (asked once per distinct layout)."""
    columns, local = [], {}
    for t, layout in enumerate(shared_layouts(space, side, topology.tp, layout_of)):
        if id(layout) not in local:
            local[id(layout)] = (layout.pieces, logical_bases(layout.numels))
        pieces, local_bases = local[id(layout)]
        start, dp_rank, buffer, offset, *strides = globalize(
            pieces.start, pieces.rank, pieces.buffer, pieces.offset, pieces.length, local_bases, space.grid, side, t,
            *space.copies_from(side, t))
        columns.append((start, dp_rank * topology.tp + t, buffer, offset, *strides))
    return space.table(columns)


def module_pieces(module: TensorParallelParams, space: GlobalSpace, topology: Topology, side: str) -> PieceTable:
    """Pieces of the module tensors of the model-states files: TP rank t's local tensor j is
    buffer j of global rank (dp 0, tp t), from element 0; replicated ones as in `zero12_pieces`."""
    columns = []
    for t in range(topology.tp):
        numels = space.grid.local_numels(side, t)
        local_bases = logical_bases(numels)
        keep = numels > 0
        count = int(keep.sum())
        start, _, buffer, offset, *strides = globalize(
            local_bases[keep], np.zeros(count), np.flatnonzero(keep), np.zeros(count), numels[keep], local_bases,
            space.grid, side, t, *space.copies_from(side, t))
        columns.append((start, np.full(len(start), topology.rank_of(0, t), np.int64), buffer, offset, *strides))
    return space.table(columns)


def module_buffer_numels(space: GlobalSpace, tp: int) -> tuple[int, ...]:
    """Largest shard of each split module tensor over the target's TP ranks (round windows need a bound)."""
    if not tp or not len(space.numels):
        return tuple(int(n) for n in space.numels)
    return tuple(np.max([space.grid.local_numels("target", t) for t in range(tp)], axis=0).tolist())
