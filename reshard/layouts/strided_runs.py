"""Strided runs: a 1-D range of a column strip of a row-major matrix, as it lies in a buffer. Pure.

    import numpy as np
    from reshard.layouts.strided_runs import advance, row_runs
    # elements 3.. of a strip 4 wide, held in a buffer whose rows are 10 apart, first at offset 0
    advance(np.array([0]), np.array([0]), np.array([4]), np.array([10]), np.array([3]))   # (3, 3)
    advance(np.array([0]), np.array([0]), np.array([4]), np.array([10]), np.array([5]))   # (11, 1)
    row_runs(np.array([0]), np.array([1]), np.array([4]), np.array([10]), np.array([9]))
    # item [0 0 0], element [0 3 7], buffer offset [0 9 19], length [3 4 2]

A tensor-parallel shard that cuts an inner dimension (a row-parallel weight) is a column block
of its parameter seen as a matrix. Cut into *strips* (columns between consecutive shard
boundaries of the source and the target), each strip taken in its own row-major order, a ZeRO
range of a shard is ONE contiguous range of every strip it touches (a partial first row, whole
rows, a partial last row), however many rows it spans. Such a range is described by four
numbers per side: the buffer offset of its first element, the column of that element inside
the strip (`col`), the strip width (`width`) and the buffer distance between rows (`stride`,
the shard's row length). Element e of the range sits at

    offset - col + ((col + e) // width) * stride + (col + e) % width

Ranges that never wrap (every data-parallel piece, column-parallel shards, replicated
tensors) use `width = stride = CONTIGUOUS` and `col = 0`: the formula is then offset + e.
Every function here takes numpy arrays, one entry per range, and is vectorised.
"""
from __future__ import annotations

import numpy as np

CONTIGUOUS = 1 << 62
"""Width and stride of a range that never wraps to another row."""


def advance(offset, col, width, stride, delta):
    """(buffer offset, column) of element `delta` of ranges starting at `offset`, column `col`."""
    row, c = divmod(col + delta, width)       # one division pass for both
    return offset + row * stride + c - col, c


def first_at_or_after(offset, col, width, stride, position) -> np.ndarray:
    """Index of the first element whose buffer offset is >= `position` (0 when the first already is;
    may exceed a range's length when none is)."""
    rel = position - (offset - col)           # from the start of the first element's row
    row, c = divmod(rel, stride)
    return np.maximum(np.where(c >= width, (row + 1) * width, row * width + c) - col, 0)


def _expand(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    item = np.repeat(np.arange(len(counts)), counts)
    within = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    return item, within


def row_runs(offset, col, width, stride, length) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Every contiguous row piece of ranges of `length` >= 1 elements, in order: (range index,
    first element within the range, buffer offset, elements)."""
    rows = (col + length - 1) // width + 1
    item, row = _expand(rows)
    col, width, stride, length = col[item], width[item], stride[item], length[item]
    lo = np.maximum(row * width - col, 0)
    hi = np.minimum((row + 1) * width - col, length)
    return item, lo, offset[item] - col + row * stride + (lo + col - row * width), hi - lo


def split_at_windows(offset, col, width, stride, length, window: int
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Cut ranges where their buffer offset crosses a multiple of `window` (offsets here are
    positions in a space of windows). Returns (range index, first element, elements, window
    index) of every non-empty part, in order."""
    last = advance(offset, col, width, stride, length - 1)[0]
    first_window, last_window = offset // window, last // window
    item, within = _expand(last_window - first_window + 1)
    k = first_window[item] + within
    # the first part of a range starts at its element 0 and its last part ends at its length;
    # only the parts between look their bounds up (most ranges lie in one window)
    lo = np.zeros(len(item), np.int64)
    hi = length[item]
    inner = np.flatnonzero(within)
    if len(inner):
        at = item[inner]
        lo[inner] = first_at_or_after(offset[at], col[at], width[at], stride[at], k[inner] * window)
    inner = np.flatnonzero(k != last_window[item])
    if len(inner):
        at = item[inner]
        hi[inner] = first_at_or_after(offset[at], col[at], width[at], stride[at], (k[inner] + 1) * window)
    hi = np.minimum(hi, length[item])
    keep = hi > lo
    return item[keep], lo[keep], (hi - lo)[keep], k[keep]
