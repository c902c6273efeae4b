"""Lower ranges of a rank's local tensors (TP shards of global parameters) to pieces of the global space. Pure.

    from reshard.layouts.local_to_global import ShardGrid, globalize
    grid = ShardGrid.of(shapes=[(8, 9)], dims=[1], source_tp=2, target_tp=3)   # a row-parallel weight
    grid.strips(0)                    # [(0, 3), (3, 5), (5, 6), (6, 9)]: columns between both sides' cuts
    columns = globalize(start=[0], rank=[0], buffer=[0], offset=[0], length=[40], local_bases=np.array([0]),
                        grid=grid, side="source", tp_rank=0, copy_base=np.array([0]), copy_count=np.array([1]))
    # 2 strided pieces (strips (0, 3) and (3, 5)), not 8 rows: (start, rank, buffer, offset, col, width, stride)

A parallel layout gives each rank local tensors that are blocks of global parameters; ZeRO
then cuts each rank's local tensors into 1-D ranges of its flat buffers. To plan with the 1-D
core (`reshard.layouts.zero.PieceTable`, `reshard.planning.plan`), every local range becomes pieces of ONE
logical space shared by source and target:

- a parameter that no TP rank cuts inside a row (replicated, split on its first dimension,
  or whole on both sides) keeps its row-major order; a local range is one contiguous piece;
- a parameter split on dimension k >= 1 is seen as a matrix [outer, row] (outer: the product
  of the dimensions before k), in which every TP shard is a column block. The columns are cut
  into *strips* at the shard boundaries of BOTH sides, and the logical order of the parameter
  is strip by strip, each strip row-major. A local range (a partial row, whole rows, a partial
  row of its block) is then one contiguous piece of each strip of its block it touches,
  strided in the buffer (`reshard.layouts.strided_runs`): O(ranges x strips per block), not O(rows).

A fused sub-parameter split (a local tensor made of one block of each fused sub-parameter) is
lowered box by box instead (`globalize_boxes`, row-major, one run per row of a box).

Both sides must be lowered with the same grid (it holds both sides' cuts); the order never
leaves the planner (sources and sinks see buffer offsets only). Vectorised over every
parameter and range at once.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from reshard.layouts.boxes import Box, row_major_strides
from reshard.layouts.tensor_parallel import shard_bounds
from reshard.layouts.strided_runs import CONTIGUOUS

SIDES = ("source", "target")


@dataclass(frozen=True, eq=False)
class ShardGrid:
    """Every parameter's TP blocks on both sides, as columns of its matrix view, and its strips."""

    numels: np.ndarray
    outer: np.ndarray
    """Product of the dimensions before the split one (1 when not split): rows of the matrix view."""
    blocks: dict
    """side -> (first column [P, tp], end column [P, tp]) of each TP rank's block."""
    strided: np.ndarray
    """[P] the logical order is strip by strip (split inside rows, with more than one strip)."""
    cuts: np.ndarray
    """[P, K] both sides' block boundaries, sorted (rows of strided parameters only are used)."""

    @classmethod
    def of(cls, shapes: Sequence[Sequence[int]], dims: Sequence[int | None], source_tp: int, target_tp: int,
           grain: int = 1) -> "ShardGrid":
        """The grid of AutoTP shards (`reshard.layouts.tensor_parallel.shard_sizes`) at both TP sizes."""
        extent = np.asarray([int(shape[dim]) if dim is not None else 1 for shape, dim in zip(shapes, dims)],
                            dtype=np.int64)
        return cls.from_bounds(shapes, dims, shard_bounds(extent, source_tp, grain),
                               shard_bounds(extent, target_tp, grain))

    @classmethod
    def from_bounds(cls, shapes: Sequence[Sequence[int]], dims: Sequence[int | None], source_bounds: np.ndarray,
                    target_bounds: np.ndarray) -> "ShardGrid":
        """The grid of any shards: `*_bounds[p]` are 0, then the end of each TP rank's shard along
        dimension dims[p] ([P, tp + 1] per side; ignored where dims[p] is None: replicated)."""
        count = len(shapes)
        numels, outer, inner = (np.ones(count, np.int64) for _ in range(3))
        dim_of = np.asarray([-1 if d is None else d for d in dims], dtype=np.int64)
        ndims = np.fromiter((len(shape) for shape in shapes), dtype=np.int64, count=count)
        for ndim in np.unique(ndims).tolist():  # vectorised per number of dimensions
            members = np.flatnonzero(ndims == ndim)
            if ndim == 0:
                continue
            sizes = np.asarray([shapes[i] for i in members.tolist()], dtype=np.int64).reshape(len(members), ndim)
            running = np.cumprod(sizes, axis=1)
            numels[members] = running[:, -1]
            dim = dim_of[members]
            cut = dim >= 0
            at = np.where(cut, dim, 0)
            before = np.where(at > 0, running[np.arange(len(members)), np.maximum(at - 1, 0)], 1)
            extent = sizes[np.arange(len(members)), at]
            outer[members] = np.where(cut, before, 1)
            inner[members] = np.where(cut & (extent > 0), numels[members] // np.maximum(before * extent, 1), 1)
        split = (dim_of >= 0) & (numels > 0)
        outer = np.where(split, outer, 1)
        inner = np.where(split, inner, 1)
        row = numels // np.maximum(outer, 1)
        blocks = {}
        for side, bounds in zip(SIDES, (source_bounds, target_bounds)):
            bounds = np.asarray(bounds, dtype=np.int64).reshape(count, -1) * inner[:, None]
            lo = np.where(split[:, None], bounds[:, :-1], 0)
            hi = np.where(split[:, None], bounds[:, 1:], row[:, None])
            blocks[side] = (lo, hi)
        cuts = np.sort(np.concatenate((blocks["source"][0], blocks["target"][0], row[:, None]), axis=1), axis=1)
        distinct = (np.diff(cuts, axis=1) > 0).sum(axis=1)
        strided = split & (outer > 1) & (distinct > 1)
        return cls(numels, outer, blocks, strided, cuts)

    def local_numels(self, side: str, tp_rank: int) -> np.ndarray:
        """[P] elements of each parameter's block on `side`'s TP rank `tp_rank`."""
        lo, hi = self.blocks[side]
        return (hi[:, tp_rank] - lo[:, tp_rank]) * self.outer

    def strips(self, param: int) -> list[tuple[int, int]]:
        """(first column, end column) of each strip of a parameter (one for a row-major one)."""
        if not self.strided[param]:
            return [(0, int(self.numels[param] // self.outer[param]))]
        cuts = self.cuts[param].tolist()
        return [(a, b) for a, b in zip(cuts, cuts[1:]) if b > a]


def globalize(start, rank, buffer, offset, length, local_bases: np.ndarray, grid: ShardGrid, side: str,
              tp_rank: int, copy_base: np.ndarray, copy_count: np.ndarray, param: np.ndarray | None = None
              ) -> tuple[np.ndarray, ...]:
    """Pieces of TP rank `tp_rank`'s local space (its local parameters end to end, at
    `local_bases`), each inside one local parameter, as pieces of the global space.

    Local parameter p is the block of global parameter p that `grid` gives `side` at
    `tp_rank`; it fills `copy_count[p]` copies in the global space, the first at
    `copy_base[p]`, the next ones `grid.numels[p]` further each (0: not taken from this side;
    several: a replicated parameter read once for several target copies). Returns columns
    (start, rank, buffer, offset, col, width, stride) for `reshard.layouts.zero.PieceTable.from_unsorted`.
    `param`: each piece's local parameter, when the caller already has it (TP ranks that share
    one layout share it); found in `local_bases` otherwise.
    """
    start, rank, buffer, offset, length = (np.asarray(c, dtype=np.int64) for c in (start, rank, buffer, offset, length))
    if param is None:
        param = np.searchsorted(local_bases, start, side="right") - 1
    copies = copy_count[param]
    if len(copies) and copies.max() > 1:
        item = np.repeat(np.arange(len(start)), copies)
        copy = np.arange(len(item)) - np.repeat(np.cumsum(copies) - copies, copies)
        param = param[item]
        base = copy_base[param] + copy * grid.numels[param]
    else:  # at most one copy each (every TP rank but the one read for replicated tensors): no expansion
        item = np.flatnonzero(copies)
        if len(item) == len(start):
            item = slice(None)  # every piece, once: views, not gathers
        param = param[item]
        base = copy_base[param]
    s = start[item] - local_bases[param]
    e = s + length[item]
    rank, buffer, offset = rank[item], buffer[item], offset[item]
    lo, hi = (edge[:, tp_rank] for edge in grid.blocks[side])
    c0, width = lo[param], hi[param] - lo[param]
    out = []
    plain = ~grid.strided[param]
    if plain.any():
        n = int(plain.sum())
        out.append((base[plain] + grid.outer[param[plain]] * c0[plain] + s[plain], rank[plain], buffer[plain],
                    offset[plain], np.zeros(n, np.int64), np.full(n, CONTIGUOUS, np.int64),
                    np.full(n, CONTIGUOUS, np.int64)))
    strided = np.flatnonzero(~plain)
    if len(strided):
        p = param[strided]
        cuts = grid.cuts[p]
        a = cuts[:, :-1] - c0[strided, None]          # strip columns relative to the block
        b = cuts[:, 1:] - c0[strided, None]
        bw = width[strided, None]
        i, j = np.nonzero((a >= 0) & (b <= bw) & (b > a))
        a, w, bw = a[i, j], (b - a)[i, j], width[strided][i]
        k = strided[i]
        rs, cs = np.divmod(s[k], bw)
        re, ce = np.divmod(e[k], bw)
        i0 = rs * w + np.clip(cs - a, 0, w)            # the range's part of the strip, in strip order
        i1 = re * w + np.clip(ce - a, 0, w)
        keep = i1 > i0
        k, a, w, bw, i0, i1, j = k[keep], a[keep], w[keep], bw[keep], i0[keep], i1[keep], j[keep]
        row, col = np.divmod(i0, w)
        first = row * bw + a + col                     # its first element in the local tensor
        out.append((base[k] + grid.outer[param[k]] * grid.cuts[param[k], j] + i0, rank[k], buffer[k],
                    offset[k] + first - s[k], col, w, bw))
    if not out:
        empty = np.zeros(0, np.int64)
        return (empty,) * 7
    if len(out) == 1:
        return out[0]
    return tuple(np.concatenate(c) for c in zip(*out))


def _run_dimension(box: Box, shape: Sequence[int]) -> int:
    """The outermost dimension of a contiguous run: every dimension after it the box spans whole."""
    inner = len(shape) - 1
    while inner > 0 and box.sizes[inner] == shape[inner]:
        inner -= 1
    return inner


def contiguous_run(box: Box, shape: Sequence[int]) -> int:
    """Elements of the box that are contiguous in the global parameter, row-major: the product
    of the box's sizes from the outermost dimension after which the box spans every dimension whole."""
    return math.prod(box.sizes[_run_dimension(box, shape):]) if shape else 1


def box_runs(box: Box, shape: Sequence[int], starts, lengths) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Lower local ranges [starts[i], starts[i] + lengths[i]) of `box` (element offsets in the
    box's row-major order) to global runs. Returns (item, local start, global start, length)
    per run, `item` the index of the range it came from; runs of one range are in order."""
    starts = np.asarray(starts, dtype=np.int64)
    lengths = np.asarray(lengths, dtype=np.int64)
    shape = tuple(int(d) for d in shape)
    run = contiguous_run(box, shape)
    first = starts // run
    counts = (starts + lengths - 1) // run - first + 1
    item = np.repeat(np.arange(len(starts)), counts)
    within = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    q = first[item] + within                      # which run of the box
    lo = np.maximum(starts[item], q * run)
    hi = np.minimum(starts[item] + lengths[item], (q + 1) * run)
    # global start of run q: unravel q over the box's outer dimensions, offset, ravel globally
    global_strides = row_major_strides(shape)
    inner = _run_dimension(box, shape)
    run_start = np.full(len(q), sum(o * s for o, s in zip(box.offsets[inner:], global_strides[inner:])), np.int64)
    rest = q.copy()
    for d in range(inner - 1, -1, -1):
        index = rest % box.sizes[d]
        rest //= box.sizes[d]
        run_start += (box.offsets[d] + index) * global_strides[d]
    return item, lo, run_start + (lo - q * run), hi - lo


def globalize_boxes(start, rank, buffer, offset, length, local_bases: np.ndarray,
                    placements: Sequence[tuple[Box, Sequence[int], Sequence[int]]]) -> tuple[np.ndarray, ...]:
    """Pieces of a rank-local space cut into boxes (at `local_bases`), each inside one box, as
    contiguous pieces of a global space in row-major order: one run per row of a box that cuts
    an inner dimension. For fused sub-parameter splits (several boxes per local tensor), which
    the strip grid of `globalize` does not describe.

    `placements[p]`: (box of local parameter p in its global parameter, global shape, global
    bases) where `global bases` are the starts in the global space of every copy this local
    parameter fills (empty: the parameter is not taken from this side; several: a replicated
    parameter read once and written to several copies). Returns columns (start, rank, buffer,
    offset) for `reshard.layouts.zero.PieceTable.from_unsorted`.
    """
    start, rank, buffer, offset, length = (np.asarray(c, dtype=np.int64) for c in (start, rank, buffer, offset, length))
    param = np.searchsorted(local_bases, start, side="right") - 1
    out = [[], [], [], []]
    order = np.argsort(param, kind="stable")
    bounds = np.flatnonzero(np.diff(param[order])) + 1
    for members in np.split(order, bounds) if len(order) else []:
        p = int(param[members[0]])
        box, shape, copies = placements[p]
        if not len(copies):
            continue
        item, local, glob, run_length = box_runs(box, shape, start[members] - local_bases[p], length[members])
        moved = local - (start[members] - local_bases[p])[item]
        for base in copies:
            out[0].append(base + glob)
            out[1].append(rank[members][item])
            out[2].append(buffer[members][item])
            out[3].append(offset[members][item] + moved)
    if not out[0]:
        empty = np.zeros(0, np.int64)
        return empty, empty, empty, empty
    return tuple(np.concatenate(c) for c in out)
