"""Test helper: the buffer offsets of every element of planned segments, strided or not.

    for index, src_elements, dst_elements in segment_elements(space.segments):
        target[dst_elements] = source[src_elements]

Written from the definition in `reshard.layouts.strided_runs` (element e of a strided segment sits at
offset - col + ((col + e) // width) * stride + (col + e) % width), element by element, so it
checks the planner's vectorised arithmetic rather than reusing it.
"""
from __future__ import annotations

import numpy as np


def _elements(offset: int, col: int, width: int, stride: int, length: int) -> np.ndarray:
    e = np.arange(length, dtype=np.int64) + col
    return offset - col + (e // width) * stride + e % width


def segment_elements(segments):
    """Yield (segment index, source element offsets, target element offsets) of every segment."""
    for s in range(len(segments)):
        n = int(segments.length[s])
        src, dst = int(segments.src_offset[s]), int(segments.dst_offset[s])
        if segments.width is None:
            yield s, np.arange(src, src + n), np.arange(dst, dst + n)
            continue
        col, width = int(segments.col[s]), int(segments.width[s])
        yield (s, _elements(src, col, width, int(segments.src_stride[s]), n),
               _elements(dst, col, width, int(segments.dst_stride[s]), n))
