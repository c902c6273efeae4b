"""n-D box planner on synthetic layouts: every target element written once, from the same coordinate;
every source element read once.

    python -m pytest -q tests/test_boxes.py

Layouts are random grids of boxes over random shapes (row blocks, column blocks, both), on
both sides, with random holders, buffers and offsets, and replicated boxes (the same box on
several holders) on either side. The simulation fills every source copy with each element's
logical id, executes the moves run by run, counts reads and writes per element, and compares.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reshard.boxes import Box, Placement, flat_placements, lower, plan_boxes
from reshard.layout import ParamSpec, zero3_layout, zero12_layout


@st.composite
def grids(draw, shape, param):
    """A random grid of boxes over `shape`: cut points per dimension (dimension 0 may stay whole)."""
    cuts = []
    for size in shape:
        inner = sorted(draw(st.sets(st.integers(1, size - 1), max_size=3))) if size > 1 else []
        cuts.append([0, *inner, size])
    boxes = []
    for cell in np.ndindex(*[len(c) - 1 for c in cuts]):
        offsets = tuple(cuts[d][i] for d, i in enumerate(cell))
        sizes = tuple(cuts[d][i + 1] - cuts[d][i] for d, i in enumerate(cell))
        boxes.append(Box(param, offsets, sizes))
    return boxes


@st.composite
def placed(draw, boxes, holders):
    """Each box on one or more holders (copies), packed into per-(holder, buffer) flat buffers."""
    cursor: dict = {}
    placements = []
    for box in draw(st.permutations(boxes)):
        copies = draw(st.sets(st.integers(0, holders - 1), min_size=1, max_size=min(3, holders)))
        for holder in sorted(copies):
            buffer = draw(st.integers(0, 1))
            gap = draw(st.integers(0, 2))  # padding between placements
            offset = cursor.get((holder, buffer), 0) + gap
            cursor[(holder, buffer)] = offset + box.numel
            placements.append(Placement(box, holder, buffer, offset))
    return placements, cursor


@st.composite
def layouts(draw):
    count = draw(st.integers(1, 3))
    shapes = {p: tuple(draw(st.lists(st.integers(1, 7), min_size=0, max_size=3))) for p in range(count)}
    src_boxes = [b for p, s in shapes.items() for b in draw(grids(s, p))]
    dst_boxes = [b for p, s in shapes.items() for b in draw(grids(s, p))]
    source, src_sizes = draw(placed(src_boxes, draw(st.integers(1, 4))))
    target, dst_sizes = draw(placed(dst_boxes, draw(st.integers(1, 5))))
    return shapes, source, src_sizes, target, dst_sizes


def logical_ids(shapes, param, box: Box) -> np.ndarray:
    """Row-major ids (param * 10^6 + flat index in the full parameter) of the box's elements."""
    index = np.arange(math.prod(shapes[param])).reshape(shapes[param]) if shapes[param] else np.arange(1)
    block = index[tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes))]
    return (param * 1_000_000 + block).reshape(-1)


def execute(moves, shapes, source, src_sizes, dst_sizes):
    """Run the moves; return target buffers, per-source-buffer read counts."""
    src = {key: np.full(size, -1, np.int64) for key, size in src_sizes.items()}
    for p in source:
        src[(p.holder, p.buffer)][p.offset:p.offset + p.box.numel] = logical_ids(shapes, p.box.param, p.box)
    reads = {key: np.zeros(size, np.int64) for key, size in src_sizes.items()}
    dst = {key: np.full(size, -1, np.int64) for key, size in dst_sizes.items()}
    writes = {key: np.zeros(size, np.int64) for key, size in dst_sizes.items()}
    for move in moves:
        for s_at, d_at in move.runs():
            values = src[(move.src_holder, move.src_buffer)][s_at:s_at + move.run]
            reads[(move.src_holder, move.src_buffer)][s_at:s_at + move.run] += 1
            for holder, buffer, offset in zip(move.dst_holders, move.dst_buffers, move.dst_offsets):
                dst[(holder, buffer)][offset + d_at:offset + d_at + move.run] = values
                writes[(holder, buffer)][offset + d_at:offset + d_at + move.run] += 1
    return src, reads, dst, writes


@given(layouts())
@settings(max_examples=300, deadline=None)
def test_every_target_element_written_once_from_the_same_coordinate(layout):
    shapes, source, src_sizes, target, dst_sizes = layout
    moves = plan_boxes(shapes, source, target)
    src, reads, dst, writes = execute(moves, shapes, source, src_sizes, dst_sizes)
    for p in target:
        at = slice(p.offset, p.offset + p.box.numel)
        assert (writes[(p.holder, p.buffer)][at] == 1).all(), "a target element written other than once"
        np.testing.assert_array_equal(dst[(p.holder, p.buffer)][at], logical_ids(shapes, p.box.param, p.box))
    # Each logical element is read exactly once, from one copy, and no byte outside a box is read.
    read_ids = np.concatenate([src[key][reads[key] > 0] for key in src] + [np.zeros(0, np.int64)])
    assert all((r <= 1).all() for r in reads.values()), "a source element read twice"
    wanted = np.concatenate([logical_ids(shapes, p, Box(p, (0,) * len(s), s)) for p, s in shapes.items()])
    assert sorted(read_ids.tolist()) == sorted(wanted.tolist())


def test_a_column_block_is_one_strided_move():
    """Row-parallel style: the source holds column blocks of a 6 x 8 matrix, the target row blocks."""
    shapes = {0: (6, 8)}
    source = [Placement(Box(0, (0, 0), (6, 4)), 0, 0, 0), Placement(Box(0, (0, 4), (6, 4)), 1, 0, 0)]
    target = [Placement(Box(0, (0, 0), (6, 8)), 2, 0, 0)]
    moves = plan_boxes(shapes, source, target)
    assert len(moves) == 2
    left = moves[0]
    assert (left.run, left.counts, left.src_strides, left.dst_strides) == (4, (6,), (4,), (8,))
    assert left.dst_offsets == (0,) and moves[1].dst_offsets == (4,)


def test_replicated_source_is_read_once_and_replicated_target_served_from_one_read():
    shapes = {0: (5,)}
    source = [Placement(Box(0, (0,), (5,)), h, 0, 0) for h in range(3)]   # a norm on three tp ranks
    target = [Placement(Box(0, (0,), (5,)), h, 0, 0) for h in range(2)]
    (move,) = plan_boxes(shapes, source, target)
    assert move.dst_holders == (0, 1) and move.run == 5 and move.counts == ()


def test_lowering_joins_whole_inner_dimensions_into_the_run():
    box = Box(0, (0, 0, 0), (4, 3, 5))
    overlap = Box(0, (1, 0, 0), (2, 3, 5))
    assert lower(overlap, box, box)[:2] == (30, ())


@pytest.mark.parametrize("bad,message", [
    ([Placement(Box(0, (0,), (3,)), 0, 0, 0), Placement(Box(0, (2,), (3,)), 1, 0, 0)], "overlap without being copies"),
    ([Placement(Box(0, (0,), (3,)), 0, 0, 0)], "cover 3 of 5 elements"),
    ([Placement(Box(0, (0,), (6,)), 0, 0, 0)], "does not fit parameter 0"),
])
def test_inconsistent_layouts_are_refused(bad, message):
    with pytest.raises(ValueError, match=message):
        plan_boxes({0: (5,)}, bad, [Placement(Box(0, (0,), (5,)), 0, 0, 0)])


@given(st.lists(st.integers(1, 60), min_size=1, max_size=6), st.integers(1, 6), st.integers(1, 6),
       st.sampled_from([2, 3]), st.booleans())
@settings(max_examples=100, deadline=None)
def test_zero_layouts_as_flat_boxes_move_what_the_piece_plan_moves(sizes, n, m, stage, round_robin):
    """ZeRO's 1-D layout is the case of boxes of flattened parameters."""
    params = tuple(ParamSpec(f"p{i}", (k,)) for i, k in enumerate(sizes))
    groups = [tuple(range(len(sizes)))]

    def layout(world):
        return zero3_layout(params, groups, world) if stage == 3 else \
            zero12_layout(params, groups, world, round_robin=round_robin)
    src, dst = layout(n), layout(m)
    shapes = {i: (k,) for i, k in enumerate(sizes)}
    source, target = flat_placements(sizes, src.pieces), flat_placements(sizes, dst.pieces)
    moves = plan_boxes(shapes, source, target)
    src_sizes = {(p.holder, p.buffer): 0 for p in source}
    for p in source:
        src_sizes[(p.holder, p.buffer)] = max(src_sizes[(p.holder, p.buffer)], p.offset + p.box.numel)
    dst_sizes = {(p.holder, p.buffer): 0 for p in target}
    for p in target:
        dst_sizes[(p.holder, p.buffer)] = max(dst_sizes[(p.holder, p.buffer)], p.offset + p.box.numel)
    _, _, got, writes = execute(moves, shapes, source, src_sizes, dst_sizes)
    bases = np.concatenate(([0], np.cumsum(sizes)))
    table = dst.pieces
    for start, rank, buffer, offset, length in zip(table.start, table.rank, table.buffer, table.offset, table.length):
        logical = np.arange(start, start + length)
        param = np.searchsorted(bases, logical, side="right") - 1
        np.testing.assert_array_equal(got[(rank, buffer)][offset:offset + length],
                                      param * 1_000_000 + logical - bases[param])
