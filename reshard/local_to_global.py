"""Map ranges of a rank's local tensor (a box of a global parameter) to runs of the global one. Pure.

    from reshard.boxes import Box
    from reshard.local_to_global import box_runs
    box = Box(0, offsets=(0, 5), sizes=(8, 4))           # a row-parallel shard of an (8, 9) weight
    item, local, glob, length = box_runs(box, (8, 9), starts=[0], lengths=[32])
    # 8 runs of 4: local 0, 4, 8...; global 5, 14, 23...

A parallel layout (tensor parallelism, later expert parallelism) gives each rank local
tensors that are boxes of global parameters; ZeRO then cuts each rank's local tensors into
1-D ranges of its flat buffers. To plan with the 1-D core (`reshard.layout.PieceTable`,
`reshard.plan`), every local range is lowered here to runs of the global parameter in
row-major order: a box that spans whole inner dimensions (column-parallel, replicated, an
expert's slab) gives one run per range; a box that cuts an inner dimension (row-parallel)
gives one run per row it touches. Vectorised per parameter with numpy.

Scale follow-up (issue 8): a row-parallel shard becomes one piece per row and ZeRO range,
O(rows); a compact strided form (run length, count, stride, as `reshard.boxes.Move`) would
keep the table at O(ranges).
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from reshard.boxes import Box, row_major_strides


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


def globalize(start, rank, buffer, offset, length, local_bases: np.ndarray,
              placements: Sequence[tuple[Box, Sequence[int], Sequence[int]]]) -> tuple[np.ndarray, ...]:
    """Pieces of a rank-local space (local parameters end to end, at `local_bases`), each inside
    one local parameter, as pieces of a global space.

    `placements[p]`: (box of local parameter p in its global parameter, global shape, global
    bases) where `global bases` are the starts in the global space of every copy this local
    parameter fills (empty: the parameter is not taken from this side; several: a replicated
    parameter read once and written to several copies). Returns columns (start, rank, buffer,
    offset) for `reshard.layout.PieceTable.from_unsorted`.
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
