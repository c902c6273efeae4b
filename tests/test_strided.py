"""Strided pieces (row-parallel shards as O(ZeRO ranges) pieces): arithmetic, planner and exchange.

    python -m pytest -q tests/test_strided.py          # seconds

`reshard.layouts.strided_runs` is checked element by element against its definition. Then synthetic
tensor-parallel ZeRO-1/2 layouts: random shapes (2-D and 3-D), each parameter split on a
random dimension (an inner one: strided) or replicated, random column-block grids on both
sides (uneven, any block widths), random dp, W and budget. Each (source rank, buffer) is
filled with the logical identity (parameter, global row-major index) of every element; the
plan's rounds are run through the real exchange (`reshard.transport.exchange.run_rounds`, W worker
threads) into target buffers, and every target element must be written exactly once, from
the element with the same identity; each source element is read once per round that packs
it and not the round before (a replicated one: once in all when its target TP copies are in
one round or consecutive rounds, and only from source TP rank 0); padding is never touched;
no worker sends or receives more than a round's cap.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np
from hypothesis import event, given, settings
from hypothesis import strategies as st

from reshard.transport.exchange import run_rounds
from reshard.layouts.zero import ParamSpec, buffer_numels, zero12_layout
from reshard.layouts.tensor_parallel import TensorParallelParams, TensorSplit, REPLICATED
from reshard.layouts.local_to_global import ShardGrid
from reshard.planning.plan import Ownership, ReshardPlan, Stream, plan_space, round_cap
from reshard.layouts.strided_runs import CONTIGUOUS, advance, first_at_or_after, row_runs, split_at_windows
from reshard.layouts.tensor_pieces import GlobalSpace, zero12_pieces
from reshard.topology import Topology
from strided_check import segment_elements
from table_rounds_reference import assert_lazy_rounds_match
from threaded_transport import run_workers

# --- the arithmetic, against its definition ------------------------------------------------------


def _positions(offset, col, width, stride, length):
    e = np.arange(length) + col
    return offset - col + (e // width) * stride + e % width


@st.composite
def ranges(draw):
    width = draw(st.integers(1, 6))
    stride = draw(st.one_of(st.integers(width, 12), st.just(CONTIGUOUS)))
    if stride == CONTIGUOUS:
        width = CONTIGUOUS
    col = draw(st.integers(0, min(width, 8) - 1))
    return draw(st.integers(0, 30)), col, width, stride, draw(st.integers(1, 25))


@given(ranges(), st.data())
@settings(max_examples=200, deadline=None)
def test_strided_arithmetic_matches_its_definition(run, data):
    offset, col, width, stride, length = run
    a = lambda x: np.asarray([x])  # noqa: E731
    where = _positions(offset, col, width, stride, length)
    delta = data.draw(st.integers(0, length - 1))
    moved, moved_col = advance(a(offset), a(col), a(width), a(stride), a(delta))
    assert moved[0] == where[delta] and np.array_equal(_positions(moved[0], moved_col[0], width, stride,
                                                                   length - delta), where[delta:])
    position = data.draw(st.integers(0, int(where[-1]) + 3))
    assert min(first_at_or_after(a(offset), a(col), a(width), a(stride), a(position))[0], length) == \
        int(np.searchsorted(where, position))
    item, first, at, count = row_runs(a(offset), a(col), a(width), a(stride), a(length))
    assert np.array_equal(np.concatenate([np.arange(o, o + n) for o, n in zip(at, count)]), where)
    assert np.array_equal(first, np.concatenate(([0], np.cumsum(count)[:-1]))) and np.all(item == 0)
    window = data.draw(st.integers(1, 20))
    item, first, count, k = split_at_windows(a(offset), a(col), a(width), a(stride), a(length), window)
    assert np.array_equal(np.concatenate([where[f:f + n] // window for f, n in zip(first, count)]), where // window)
    assert np.array_equal(np.concatenate([np.full(n, w) for n, w in zip(count, k)]), where // window)
    assert np.all(count > 0) and np.all(np.diff(first) > 0)


# --- synthetic tensor-parallel layouts, planned and exchanged ------------------------------------


def _cuts(draw, extent: int, tp: int) -> list[int]:
    """Random shard boundaries: tp blocks of at least one index each (uneven, any widths)."""
    inner = sorted(draw(st.sets(st.integers(1, extent - 1), min_size=tp - 1, max_size=tp - 1))) if tp > 1 else []
    return [0, *inner, extent]


@st.composite
def tp_layouts(draw):
    tp_src, tp_dst = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    count = draw(st.integers(1, 4))
    names, shapes, splits, bounds = [], [], [], {"source": [], "target": []}
    for i in range(count):
        ndim = draw(st.integers(1, 3))
        shape = tuple(draw(st.integers(1, 6)) for _ in range(ndim))
        fits = [d for d in range(ndim) if shape[d] >= max(tp_src, tp_dst)]
        dim = draw(st.sampled_from([None] + fits + [d for d in fits if d > 0] * 2))   # inner splits more often
        names.append(f"p{i}")
        shapes.append(shape)
        splits.append(REPLICATED if dim is None else TensorSplit("row" if dim else "column", dim))
        for side, tp in (("source", tp_src), ("target", tp_dst)):
            bounds[side].append(_cuts(draw, shape[dim], tp) if dim is not None else [0] * (tp + 1))
    cut = draw(st.integers(0, count))
    groups = tuple(g for g in (tuple(range(cut)), tuple(range(cut, count))) if g)
    params = TensorParallelParams(tuple(names), tuple(shapes), tuple(splits))
    source = Topology(dp=draw(st.integers(1, 3)), tp=tp_src)
    target = Topology(dp=draw(st.integers(1, 3)), tp=tp_dst)
    workers = draw(st.integers(1, 3))
    budget = draw(st.sampled_from([3 * 12, 3 * 12 * 5, 3 * 12 * 40, 1 << 20]))
    return params, groups, source, target, bounds, workers, budget


def _local_box(params, bounds, p, t):
    """(offsets, sizes) of TP rank t's block of parameter p."""
    shape, dim = params.shapes[p], params.splits[p].dim
    if dim is None:
        return (0,) * len(shape), shape
    offsets, sizes = [0] * len(shape), list(shape)
    offsets[dim], sizes[dim] = bounds[p][t], bounds[p][t + 1] - bounds[p][t]
    return tuple(offsets), tuple(sizes)


def _layout(params, groups, bounds, topology, t):
    local = [ParamSpec(n, _local_box(params, bounds, i, t)[1]) for i, n in enumerate(params.names)]
    return zero12_layout(local, groups, topology.dp)


def _identities(params, bounds, p, t):
    offsets, sizes = _local_box(params, bounds, p, t)
    index = np.indices(sizes).reshape(len(sizes), -1) + np.asarray(offsets).reshape(-1, 1)
    return p * 10_000 + np.ravel_multi_index(tuple(index), params.shapes[p])


def _buffers(params, groups, bounds, topology):
    """(global rank, buffer) -> element identities; -1 where ZeRO pads."""
    out = {}
    for t in range(topology.tp):
        layout = _layout(params, groups, bounds, topology, t)
        for g, group in enumerate(layout.groups):
            flat = np.full(group.flat_numel, -1, dtype=np.int64)
            for p, offset in zip(group.flat_order, group.flat_offsets):
                ids = _identities(params, bounds, p, t)
                flat[offset:offset + len(ids)] = ids
            for d in range(topology.dp):
                out[(topology.rank_of(d, t), g)] = flat[d * group.partition_numel:(d + 1) * group.partition_numel]
    return out


def _space(params, groups, source, target, bounds):
    dims = [s.dim for s in params.splits]
    grid = ShardGrid.from_bounds(params.shapes, dims, bounds["source"], bounds["target"])
    space = GlobalSpace.of(params, source_tp=source.tp, target_tp=target.tp)
    space = dataclasses.replace(space, grid=grid)
    old = zero12_pieces(params, space, source, lambda t: _layout(params, groups, bounds["source"], source, t),
                        "source")
    new = zero12_pieces(params, space, target, lambda t: _layout(params, groups, bounds["target"], target, t),
                        "target")
    return grid, old, new


class _Arrays:
    """A SliceSource and SliceSink over numpy buffers, counting every element read and written."""

    def __init__(self, buffers: dict, streams):
        self.buffers = {(rank, stream.name, buffer): (data if stream.itemsize == 8 else data.astype(np.int32))
                        for (rank, buffer), data in buffers.items() for stream in streams}
        self.count = {key: np.zeros(len(v), np.int64) for key, v in self.buffers.items()}
        self.bytes_read = 0

    def read_batch(self, reads):
        for rank, slot, element, itemsize, out in reads:
            self.read_into(rank, slot, element, itemsize, out)

    def read_into(self, rank, slot, element, itemsize, out):
        data = self.buffers[(rank, slot[2], slot[1])]
        n = len(out) // itemsize
        np.frombuffer(out, dtype=data.dtype)[:] = data[element:element + n]
        self.count[(rank, slot[2], slot[1])][element:element + n] += 1
        self.bytes_read += len(out)

    def write(self, rank, slot, element, itemsize, data):
        target = self.buffers[(rank, slot[2], slot[1])]
        n = len(data) // itemsize
        target[element:element + n] = np.frombuffer(data, dtype=target.dtype)
        self.count[(rank, slot[2], slot[1])][element:element + n] += 1

    def sync(self):
        pass

    def close(self):
        pass


STREAMS = (Stream("ids", "int64", 8), Stream("low", "int32", 4))


@given(tp_layouts())
@settings(max_examples=100, deadline=None)
def test_strided_plan_moves_every_element_once_through_the_exchange(model):
    params, groups, source, target, bounds, workers, budget = model
    grid, old, new = _space(params, groups, source, target, bounds)
    assert old.strided == new.strided == bool(grid.strided.any())
    event(f"strided pieces: {old.strided}")
    sizes = np.max([buffer_numels(_layout(params, groups, bounds["target"], target, t)) for t in range(target.tp)],
                   axis=0)
    ownership = Ownership.between(source, target, workers)
    space = plan_space("optim", old, new, STREAMS, tuple(int(n) for n in sizes), ownership, budget)
    plan = ReshardPlan(ownership, (space,), budget)

    src_ids = _buffers(params, groups, bounds["source"], source)
    want = _buffers(params, groups, bounds["target"], target)
    # the plan itself, element by element (independent of the exchange's walk)
    rounds_reading = {key: [set() for _ in ids] for key, ids in src_ids.items()}
    for s, src_index, dst_index in segment_elements(space.segments):
        got = src_ids[(int(space.segments.src_rank[s]), int(space.segments.src_buffer[s]))][src_index]
        assert np.array_equal(got, want[(int(space.segments.dst_rank[s]), int(space.segments.dst_buffer[s]))][dst_index])
        for i in src_index.tolist():
            rounds_reading[(int(space.segments.src_rank[s]), int(space.segments.src_buffer[s]))][i].add(
                int(space.segments.round[s]))
    # no worker sends or receives more than a round's cap
    cap = max(round_cap(budget), space.bytes_per_element)
    for w in range(workers):
        view = plan.worker_view(w)
        for r in range(plan.rounds):
            _, sends, receives = view.round(r)
            assert sum(b.elements for b in sends) * space.bytes_per_element <= cap
            assert sum(b.elements for b in receives) * space.bytes_per_element <= cap

    reader = _Arrays(src_ids, STREAMS)
    writer = _Arrays({key: np.full(len(v), -1, np.int64) for key, v in want.items()}, STREAMS)
    run_workers(workers, lambda transport: run_rounds(plan, transport, reader, writer))
    replicated = {p for p, split in enumerate(params.splits) if split.dim is None}
    for (rank, stream, buffer), written in writer.buffers.items():
        expected = want[(rank, buffer)]
        assert np.array_equal(written, expected if stream == "ids" else expected.astype(np.int32)), (rank, buffer)
        assert np.array_equal(writer.count[(rank, stream, buffer)], (expected >= 0).astype(np.int64))
    for (rank, stream, buffer), reads in reader.count.items():
        ids = src_ids[(rank, buffer)]
        is_replicated = np.isin(ids // 10_000, list(replicated)) & (ids >= 0)
        once = (ids >= 0) & ~is_replicated
        assert np.all(reads[once] == 1) and np.all(reads[ids < 0] == 0), (rank, buffer)
        copies = target.tp if source.coordinates(rank).tp == 0 else 0
        assert np.all(reads[is_replicated] <= copies), (rank, buffer)
        # a replicated element is read once per stretch of consecutive rounds packing its copies
        # (reshard.transport.read_once: from the source, then from this round's or the previous round's buffer)
        assert np.array_equal(reads, [sum(r - 1 not in rounds for r in rounds)
                                      for rounds in rounds_reading[(rank, buffer)]]), (rank, buffer)


@given(tp_layouts())
@settings(max_examples=80, deadline=None)
def test_strided_rounds_cut_per_worker_match_the_whole_cut_table(model):
    """Lazily cut rounds of strided spaces (strips with gaps between target rows, replicated
    copies) equal the whole table cut at once."""
    params, groups, source, target, bounds, workers, budget = model
    grid, old, new = _space(params, groups, source, target, bounds)
    sizes = np.max([buffer_numels(_layout(params, groups, bounds["target"], target, t)) for t in range(target.tp)],
                   axis=0)
    ownership = Ownership.between(source, target, workers)
    space = plan_space("optim", old, new, STREAMS, tuple(int(n) for n in sizes), ownership, budget)
    event(f"packed windows: {bool(space.windows.packed)}")
    gapped = new.strided and bool(((space.table.dst_stride != space.table.width)
                                   & (space.table.col + space.table.length > space.table.width)).any())
    event(f"segments with gaps between target rows: {gapped}")
    assert_lazy_rounds_match(space, ownership)


@given(tp_layouts())
@settings(max_examples=60, deadline=None)
def test_a_row_parallel_shard_is_o_ranges_pieces(model):
    """Pieces per side are bounded by (ZeRO ranges) x (strips of a block), never by rows."""
    params, groups, source, target, bounds, _, _ = model
    grid, old, new = _space(params, groups, source, target, bounds)
    for side, topology, table in (("source", source, old), ("target", target, new)):
        ranges = sum(len(_layout(params, groups, bounds[side], topology, t).pieces) for t in range(topology.tp))
        strips = max(len(grid.strips(p)) for p in range(len(params.names)))
        copies = max(1, target.tp)
        assert len(table) <= ranges * strips * copies


def test_a_tall_row_parallel_weight_plans_in_a_handful_of_segments():
    """A 4096 x 1024 row-parallel weight, TP 4 -> 2, dp 3 -> 5: O(ranges) segments, not 4096 x ..."""
    params = TensorParallelParams(("w", "b"), ((4096, 1024), (4096,)), (TensorSplit("row", 1), REPLICATED))
    source, target = Topology(dp=3, tp=4), Topology(dp=5, tp=2)
    space = GlobalSpace.of(params, source_tp=4, target_tp=2)

    def layout(topology):
        return lambda t: zero12_layout([ParamSpec(n, params.local_shape(i, topology.tp, t))
                                        for i, n in enumerate(params.names)], [(0, 1)], topology.dp)
    old = zero12_pieces(params, space, source, layout(source), "source")
    new = zero12_pieces(params, space, target, layout(target), "target")
    plan = plan_space("optim", old, new, STREAMS, (4096 * 1024,), Ownership.between(source, target, 2), 1 << 30)
    assert len(old) <= 3 * 4 * 2 + 4 and len(new) <= 5 * 2 * 2 + 4
    assert len(plan.segments) < 100 and int(plan.segments.length.sum()) == 4096 * 1024 + 2 * 4096
    assert math.prod((4096, 1024)) == int(plan.segments.length[plan.segments.width < CONTIGUOUS].sum())
