"""n-D pieces: boxes of a parameter placed in flat buffers, intersected and lowered to strided runs. Pure.

    from reshard.boxes import Box, Placement, plan_boxes
    shapes = {0: (4, 6)}
    source = [Placement(Box(0, (0, 0), (4, 3)), holder=0, buffer=0, offset=0),     # column blocks
              Placement(Box(0, (0, 3), (4, 3)), holder=1, buffer=0, offset=0)]
    target = [Placement(Box(0, (0, 0), (2, 6)), holder=h, buffer=0, offset=0) for h in (0, 1)] + \
             [Placement(Box(0, (2, 0), (2, 6)), holder=h, buffer=0, offset=0) for h in (2, 3)]
    for move in plan_boxes(shapes, source, target):
        move.run, move.counts, move.src_strides, move.dst_strides, move.dst_holders

A *box* is a block of one parameter, per-dimension offsets and sizes (as PyTorch DCP's
`ChunkStorageMetadata`); a *placement* puts a box, row-major, at an element offset of one
holder's flat buffer (a rank's ZeRO partition, or a tensor in a file). ZeRO's 1-D layout is
the case of boxes of flattened parameters; a tensor-parallel shard is a box of the full
shape (a row-parallel shard is a column block); a replicated parameter is the same box
placed on several holders.

Rules the planner relies on, checked: the distinct source boxes of a parameter tile it
exactly (disjoint, covering); the distinct target boxes are disjoint (a target need not hold
every element). Identical boxes on several holders are copies: on the source side one copy
is read (chosen by a rule every worker computes alike, spread over the copies); on the target
side every copy is served from that one read.

The overlap of a source box and a target box is a box; lowered to memory it is `run`
contiguous elements in both buffers, repeated over the outer dimensions with `counts` and
per-dimension strides on each side (`src_strides`, `dst_strides`): a column block of a
row-major matrix is one `Move` of rows x width, not one piece per row.
"""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Iterator, Mapping, Sequence

import numpy as np


@dataclass(frozen=True)
class Box:
    """Elements [offsets[d], offsets[d] + sizes[d]) in every dimension d of parameter `param`."""

    param: int
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    def intersect(self, other: "Box") -> "Box | None":
        lo = tuple(max(a, b) for a, b in zip(self.offsets, other.offsets))
        hi = tuple(min(a + s, b + t) for a, s, b, t in zip(self.offsets, self.sizes, other.offsets, other.sizes))
        if any(h <= low for low, h in zip(lo, hi)):
            return None
        return Box(self.param, lo, tuple(h - low for low, h in zip(lo, hi)))


@dataclass(frozen=True)
class Placement:
    """A box laid out row-major at element `offset` of flat buffer `buffer` of holder `holder`."""

    box: Box
    holder: int
    buffer: int
    offset: int


@dataclass(frozen=True)
class Move:
    """One overlap, read once from a source holder and written to every target copy.

    Element (i_0, ..., i_{k-1}, j) with i_d < counts[d], j < run sits at
    src_offset + sum(i_d * src_strides[d]) + j in the source buffer and at
    dst_offsets[c] + sum(i_d * dst_strides[d]) + j in the buffer of target copy c.
    """

    param: int
    coords: Box
    """The overlap in the parameter's coordinates."""
    src_holder: int
    src_buffer: int
    src_offset: int
    dst_holders: tuple[int, ...]
    dst_buffers: tuple[int, ...]
    dst_offsets: tuple[int, ...]
    run: int
    counts: tuple[int, ...]
    src_strides: tuple[int, ...]
    dst_strides: tuple[int, ...]

    @property
    def elements(self) -> int:
        return self.run * math.prod(self.counts)

    def runs(self) -> Iterator[tuple[int, int]]:
        """(source element, target element offset from dst_offsets[c]) of every contiguous run."""
        for index in np.ndindex(*self.counts):
            yield (self.src_offset + sum(i * s for i, s in zip(index, self.src_strides)),
                   sum(i * s for i, s in zip(index, self.dst_strides)))


def row_major_strides(sizes: Sequence[int]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(sizes):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def lower(overlap: Box, source: Box, target: Box) -> tuple[int, tuple[int, ...], tuple[int, ...], tuple[int, ...],
                                                           int, int]:
    """The overlap as (run, counts, source strides, target strides, first source element, first
    target element), both relative to the boxes' own placements. The run takes in every inner
    dimension the overlap spans whole in both boxes, plus the next one out; outer dimensions of
    count 1 are dropped."""
    src_strides, dst_strides = row_major_strides(source.sizes), row_major_strides(target.sizes)
    ndim = len(overlap.sizes)
    inner = ndim - 1
    while inner > 0 and overlap.sizes[inner] == source.sizes[inner] == target.sizes[inner]:
        inner -= 1
    run = math.prod(overlap.sizes[inner:]) if ndim else 1
    keep = [d for d in range(inner) if overlap.sizes[d] > 1]
    first_src = sum((o - s) * st for o, s, st in zip(overlap.offsets, source.offsets, src_strides))
    first_dst = sum((o - t) * st for o, t, st in zip(overlap.offsets, target.offsets, dst_strides))
    return (run, tuple(overlap.sizes[d] for d in keep), tuple(src_strides[d] for d in keep),
            tuple(dst_strides[d] for d in keep), first_src, first_dst)


def _copies(placements: Sequence[Placement]) -> dict[int, list[tuple[Box, list[Placement]]]]:
    """Per parameter, its distinct boxes (sorted by offsets) and the placements holding each."""
    by_box: dict[Box, list[Placement]] = defaultdict(list)
    for placement in placements:
        by_box[placement.box].append(placement)
    per_param: dict[int, list] = defaultdict(list)
    for box in sorted(by_box, key=lambda b: (b.param, b.offsets, b.sizes)):
        holders = sorted(by_box[box], key=lambda p: (p.holder, p.buffer, p.offset))
        per_param[box.param].append((box, holders))
    return per_param


def _check_disjoint(param: int, boxes: list[Box], side: str) -> None:
    for i, a in enumerate(boxes):
        for b in boxes[i + 1:]:
            if a.intersect(b) is not None:
                raise ValueError(f"{side} boxes of parameter {param} overlap without being copies: {a} and {b}")


def _check_in_shape(param: int, box: Box, shape: Sequence[int], side: str) -> None:
    if len(box.offsets) != len(shape) or len(box.sizes) != len(shape) or any(
            o < 0 or s < 1 or o + s > n for o, s, n in zip(box.offsets, box.sizes, shape)):
        raise ValueError(f"{side} box {box} does not fit parameter {param} of shape {tuple(shape)}")


def plan_boxes(shapes: Mapping[int, Sequence[int]], source: Sequence[Placement],
               target: Sequence[Placement]) -> list[Move]:
    """Every overlap of the source and target boxes, as moves; deterministic (sorted) output.

    Cost: per parameter, pairs of distinct source and target boxes that overlap, found by
    sweeping dimension 0 (boxes sorted by their first offset).
    """
    sources, targets = _copies(source), _copies(target)
    moves = []
    for param in sorted(shapes):
        shape = tuple(shapes[param])
        src_boxes = sources.get(param, [])
        for box, _ in src_boxes:
            _check_in_shape(param, box, shape, "source")
        _check_disjoint(param, [b for b, _ in src_boxes], "source")
        covered = sum(b.numel for b, _ in src_boxes)
        if covered != math.prod(shape):
            raise ValueError(f"source boxes of parameter {param} cover {covered} of {math.prod(shape)} elements")
        dst_boxes = targets.get(param, [])
        for box, _ in dst_boxes:
            _check_in_shape(param, box, shape, "target")
        _check_disjoint(param, [b for b, _ in dst_boxes], "target")
        starts = [b.offsets[0] if b.offsets else 0 for b, _ in src_boxes]
        ends = np.maximum.accumulate([(b.offsets[0] + b.sizes[0]) if b.offsets else 1 for b, _ in src_boxes]) \
            if src_boxes else np.zeros(0, np.int64)
        for dst_box, dst_copies in dst_boxes:
            d_lo = dst_box.offsets[0] if dst_box.offsets else 0
            d_hi = d_lo + (dst_box.sizes[0] if dst_box.sizes else 1)
            first = int(np.searchsorted(ends, d_lo, side="right"))
            for index in range(first, len(src_boxes)):
                if starts[index] >= d_hi:
                    break
                src_box, src_copies = src_boxes[index]
                overlap = src_box.intersect(dst_box)
                if overlap is None:
                    continue
                # One copy reads; which one turns with the overlap so copies share the reading.
                reader = src_copies[(sum(overlap.offsets) + param) % len(src_copies)]
                run, counts, s_strides, d_strides, first_src, first_dst = lower(overlap, src_box, dst_box)
                moves.append(Move(param, overlap, reader.holder, reader.buffer, reader.offset + first_src,
                                  tuple(c.holder for c in dst_copies), tuple(c.buffer for c in dst_copies),
                                  tuple(c.offset + first_dst for c in dst_copies), run, counts, s_strides, d_strides))
    return moves


def flat_placements(numels: Sequence[int], pieces) -> list[Placement]:
    """ZeRO's 1-D layout as boxes: a `reshard.layout.PieceTable` over parameters laid end to end
    becomes one box of a flattened parameter per piece part (a piece may span parameters)."""
    bases = np.concatenate(([0], np.cumsum(np.asarray(numels, dtype=np.int64))))
    placements = []
    for start, rank, buffer, offset, length in zip(pieces.start.tolist(), pieces.rank.tolist(),
                                                   pieces.buffer.tolist(), pieces.offset.tolist(),
                                                   pieces.length.tolist()):
        end = start + length
        param = int(np.searchsorted(bases, start, side="right")) - 1
        while start < end:
            while bases[param + 1] <= start:
                param += 1
            stop = min(end, int(bases[param + 1]))
            placements.append(Placement(Box(param, (start - int(bases[param]),), (stop - start,)), rank, buffer, offset))
            offset += stop - start
            start = stop
    return placements
