"""Pure plan tests: every element moves exactly once to the right place, within the budget.

    python -m pytest tests/test_plan.py -q

The exchange is simulated in memory: buffers of each source rank are filled with each
element's logical id, every worker packs its sends exactly as `reshard.transport.exchange` does, the
all-to-all is a dictionary, and the target buffers must then hold the ids the target layout
says they should.
"""
from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from reshard.transport.exchange import _counts, _walk
from table_rounds_reference import assert_lazy_rounds_match
from reshard.layouts.zero import (
    ParamSpec,
    buffer_numels,
    frozen_pieces,
    zero3_chunk,
    zero3_layout,
    zero12_layout,
)
from reshard.planning.plan import (
    Ownership,
    ReshardPlan,
    Stream,
    intersect,
    plan_space,
    round_cap,
)

STREAMS = (Stream("fp32", "float32", 4), Stream("exp_avg", "float32", 4), Stream("frozen_like", "bfloat16", 2))


@st.composite
def cases(draw):
    sizes = draw(st.lists(st.integers(1, 150), min_size=1, max_size=10))
    params = tuple(ParamSpec(f"p{i}", (n,)) for i, n in enumerate(sizes))
    cut = draw(st.integers(0, len(sizes)))
    groups = [g for g in (tuple(range(cut)), tuple(range(cut, len(sizes)))) if g]
    stage = draw(st.sampled_from([2, 3]))
    opts = dict(round_robin=draw(st.booleans()), param_alignment=draw(st.sampled_from([1, 4, 8])))
    sub = draw(st.integers(1, 300))
    n, m, w = draw(st.integers(1, 8)), draw(st.integers(1, 8)), draw(st.integers(1, 5))
    budget = draw(st.sampled_from([64, 200, 1000, 1 << 20]))

    def layout(world):
        return zero3_layout(params, groups, world, sub) if stage == 3 else zero12_layout(params, groups, world, **opts)
    return params, layout(n), layout(m), Ownership(n, m, w), budget


def simulate(plan: ReshardPlan, source_tables, target_tables, source_numels, target_numels, round_limit=None) -> dict:
    """Run every worker's rounds in memory; return {(target rank, space, buffer, stream): array}.

    `round_limit(space)`: bytes a worker may send and receive in one round of the space
    (default: the round cap, or one element when the budget is below one element)."""
    round_limit = round_limit or (lambda space: max(round_cap(plan.budget_bytes), space.bytes_per_element))
    own = plan.ownership
    src_buf, dst_buf = {}, {}
    for s, space in enumerate(plan.spaces):
        for rank in range(own.source_ranks):
            for b, size in enumerate(source_numels[s]):
                for k, stream in enumerate(space.streams):
                    src_buf[(rank, space.name, b, stream.name)] = np.full(size, -1, dtype=np.int64)
        table = source_tables[s]
        for start, rank, b, off, length in zip(table.start, table.rank, table.buffer, table.offset, table.length):
            for k, stream in enumerate(space.streams):
                # Encode stream k into the value so a stream mix-up is caught too.
                src_buf[(rank, space.name, b, stream.name)][off:off + length] = np.arange(start, start + length) * 10 + k
        for rank in range(own.target_ranks):
            for b, size in enumerate(target_numels[s]):
                for stream in space.streams:
                    dst_buf[(rank, space.name, b, stream.name)] = np.full(size, -1, dtype=np.int64)
    views = [plan.worker_view(w) for w in range(own.workers)]
    round_space = [i for i, space in enumerate(plan.spaces) for _ in range(space.rounds)]
    for r, s in enumerate(round_space):
        space = plan.spaces[s]
        mailbox = {}
        rounds = [view.round(r) for view in views]
        assert all(index == s for index, _, _ in rounds)
        for w, view in enumerate(views):
            blocks = rounds[w][1]
            counts = _counts(blocks, own.workers, 1)
            assert sum(counts) * space.bytes_per_element <= round_limit(space)
            # Pack element values (one int per element; positions in elements, not bytes).
            packed = []
            for _, rank, slot, element, count, itemsize in _walk(blocks, space, "src"):
                packed.append(src_buf[(rank,) + slot][element:element + count])
            flat = np.concatenate(packed) if packed else np.zeros(0, np.int64)
            at = 0
            for block in blocks:
                size = block.elements * len(space.streams)
                mailbox[(w, block.peer)] = flat[at:at + size]
                at += size
        for v, view in enumerate(views):
            blocks = rounds[v][2]
            assert sum(_counts(blocks, own.workers, 1)) * space.bytes_per_element <= round_limit(space)
            incoming = np.concatenate([mailbox.pop((b.peer, v)) for b in blocks]) if blocks else np.zeros(0, np.int64)
            at = 0
            for _, rank, slot, element, count, itemsize in _walk(blocks, space, "dst"):
                target = dst_buf[(rank,) + slot][element:element + count]
                assert (target == -1).all(), "element written twice"
                target[:] = incoming[at:at + count]
                at += count
            assert at == len(incoming)
        assert not mailbox, "a block was sent that nobody received"
    return dst_buf


def expected_targets(space_tables, spaces, target_numels, target_ranks) -> dict:
    out = {}
    for s, (table, space) in enumerate(zip(space_tables, spaces)):
        for rank in range(target_ranks):
            for b, size in enumerate(target_numels[s]):
                for stream in space.streams:
                    out[(rank, space.name, b, stream.name)] = np.full(size, -1, dtype=np.int64)
        for start, rank, b, off, length in zip(table.start, table.rank, table.buffer, table.offset, table.length):
            for k, stream in enumerate(space.streams):
                out[(rank, space.name, b, stream.name)][off:off + length] = np.arange(start, start + length) * 10 + k
    return out


@given(cases())
@settings(max_examples=150, deadline=None)
def test_every_element_lands_once_in_its_target_place(case):
    params, src, dst, own, budget = case
    streams = STREAMS[:2]
    space = plan_space("optim", src.pieces, dst.pieces, streams, buffer_numels(dst), own, budget)
    plan = ReshardPlan(own, (space,), budget)
    assert space.segments.length.sum() == sum(p.numel for p in params)
    got = simulate(plan, [src.pieces], [dst.pieces], [buffer_numels(src)], [buffer_numels(dst)])
    want = expected_targets([dst.pieces], plan.spaces, [buffer_numels(dst)], own.target_ranks)
    assert got.keys() == want.keys()
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=str(key))


@given(st.lists(st.integers(0, 40), min_size=1, max_size=6), st.integers(1, 6), st.integers(1, 6),
       st.integers(1, 4), st.sampled_from([16, 100, 1 << 20]))
@settings(max_examples=100, deadline=None)
def test_two_spaces_run_one_after_another(frozen_sizes, n, m, w, budget):
    """The ZeRO-3 frozen space follows the optimizer space, with its own dtype and rounds."""
    params = (ParamSpec("a", (37,)), ParamSpec("b", (5,)))
    frozen = tuple(ParamSpec(f"f{i}", (k,)) for i, k in enumerate(frozen_sizes))
    src, dst = zero3_layout(params, [(0, 1)], n), zero3_layout(params, [(0, 1)], m)
    own = Ownership(n, m, w)
    optim = plan_space("optim", src.pieces, dst.pieces, STREAMS[:1], buffer_numels(dst), own, budget)
    chunks = lambda world: [zero3_chunk(p.numel, world) for p in frozen]
    frozen_space = plan_space("frozen", frozen_pieces(frozen, n), frozen_pieces(frozen, m), STREAMS[2:],
                              chunks(m), own, budget, round_offset=optim.rounds)
    plan = ReshardPlan(own, (optim, frozen_space), budget)
    tables = [dst.pieces, frozen_pieces(frozen, m)]
    got = simulate(plan, [src.pieces, frozen_pieces(frozen, n)], tables,
                   [buffer_numels(src), chunks(n)], [buffer_numels(dst), chunks(m)])
    want = expected_targets(tables, plan.spaces, [buffer_numels(dst), chunks(m)], m)
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=str(key))


@given(cases())
@settings(max_examples=50, deadline=None)
def test_plan_is_deterministic_and_traffic_adds_up(case):
    params, src, dst, own, budget = case
    one = plan_space("optim", src.pieces, dst.pieces, STREAMS[:2], buffer_numels(dst), own, budget)
    two = plan_space("optim", src.pieces, dst.pieces, STREAMS[:2], buffer_numels(dst), own, budget)
    for column in ("logical", "src_rank", "src_offset", "dst_rank", "dst_offset", "length", "round"):
        assert np.array_equal(getattr(one.segments, column), getattr(two.segments, column))
    traffic = ReshardPlan(own, (one,), budget).traffic()
    total = sum(p.numel for p in params) * 8
    assert sum(t.bytes_read for t in traffic) == total == sum(t.bytes_written for t in traffic)
    assert sum(t.bytes_sent for t in traffic) == sum(t.bytes_received for t in traffic)


@given(cases())
@settings(max_examples=80, deadline=None)
def test_rounds_cut_per_worker_match_the_whole_cut_table(case):
    """Workers cut their rounds lazily from the uncut table (`TableWorkerRounds`): the same blocks,
    buffer sizes and round bytes as the whole table cut at once, packed (overfull) windows too."""
    params, src, dst, own, budget = case
    space = plan_space("optim", src.pieces, dst.pieces, STREAMS[:2], buffer_numels(dst), own, budget)
    assert_lazy_rounds_match(space, own)


def test_contiguous_neighbours_merge_into_one_segment():
    """N = M: each rank keeps its partition, so each (rank, group) moves as one segment."""
    params = tuple(ParamSpec(f"p{i}", (n,)) for i, n in enumerate([7, 9, 11, 13]))
    layout = zero12_layout(params, [(0, 1, 2, 3)], 3)
    segments = intersect(layout.pieces, layout.pieces)
    assert len(segments) == 3
    assert (segments.src_rank == segments.dst_rank).all() and (segments.src_offset == segments.dst_offset).all()


def test_a_tensor_larger_than_the_budget_is_split_across_rounds():
    params = (ParamSpec("big", (10_000,)),)
    src, dst = zero12_layout(params, [(0,)], 2), zero12_layout(params, [(0,)], 3)
    own = Ownership(2, 3, 2)
    space = plan_space("optim", src.pieces, dst.pieces, STREAMS[:2], buffer_numels(dst), own, budget_bytes=4096)
    assert space.rounds >= 10_000 * 8 // (own.workers * round_cap(4096))  # nobody moves more than a third of the budget a round
    plan = ReshardPlan(own, (space,), 4096)
    got = simulate(plan, [src.pieces], [dst.pieces], [buffer_numels(src)], [buffer_numels(dst)])
    want = expected_targets([dst.pieces], plan.spaces, [buffer_numels(dst)], 3)
    for key in want:
        np.testing.assert_array_equal(got[key], want[key])


@given(st.lists(st.integers(-5, 40), max_size=60))
@settings(max_examples=60, deadline=None)
def test_sorted_distinct_is_numpy_unique(values):
    from reshard.planning.plan import sorted_distinct
    array = np.array(values, dtype=np.int64)
    assert np.array_equal(sorted_distinct(array), np.unique(array))
    assert sorted_distinct(array).dtype == array.dtype
