"""n-D pieces: a box is a block of one parameter, per-dimension offsets and sizes. Pure.

    from reshard.layouts.boxes import Box, row_major_strides
    box = Box(0, offsets=(0, 3), sizes=(4, 3))   # columns 3..5 of a 4 x 6 parameter
    box.numel, row_major_strides((4, 6))         # 12, (6, 1)

As PyTorch DCP's `ChunkStorageMetadata`: a tensor-parallel shard is a box of the full shape (a
row-parallel shard is a column block), a replicated parameter the same box on several ranks.
`reshard.layouts.tensor_parallel` says which box each TP rank holds; `reshard.layouts.local_to_global` lowers
boxes to the 1-D pieces the planner intersects.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class Box:
    """Elements [offsets[d], offsets[d] + sizes[d]) in every dimension d of parameter `param`."""

    param: int
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


def row_major_strides(sizes: Sequence[int]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(sizes):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))
