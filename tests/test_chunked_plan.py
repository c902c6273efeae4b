"""The per-worker arithmetic plan of chunked (ZeRO-3) spaces against the table plan and a simulated exchange.

    python -m pytest -q tests/test_chunked_plan.py

The table plan (`reshard.planning.plan.plan_space` over full piece tables) is the reference: the
chunked plan must move the same elements to the same places (simulated exchange), report the
same per-worker traffic, stay within its round bound, and do it at thousands of ranks in
seconds (metadata only).
"""
from __future__ import annotations

import time

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from test_plan import STREAMS, expected_targets, simulate

from reshard.planning.checkpoint_plan import plan_reshard
from reshard.planning.chunked_plan import ChunkedSide, plan_chunked_space
from reshard.layouts.zero import ParamSpec, buffer_numels, frozen_pieces, logical_bases, zero3_chunk, zero3_layout
from reshard.planning.plan import Ownership, ReshardPlan, Stream, plan_space, round_cap
from reshard.topology import Topology


def chunked_limit(plan: ReshardPlan, space) -> int:
    """What the window rule promises a worker sends or receives in a round of `space`."""
    own = plan.ownership
    per_worker = max(-(-own.target_ranks // own.workers),
                     min(-(-own.source_ranks // own.workers) * space.sender_fanout, own.target_ranks))
    return max(round_cap(plan.budget_bytes), space.bytes_per_element * per_worker)


@st.composite
def zero3_cases(draw):
    sizes = draw(st.lists(st.integers(0, 120), min_size=1, max_size=10))
    params = tuple(ParamSpec(f"p{i}", (n,)) for i, n in enumerate(sizes))
    cut = draw(st.integers(0, len(sizes)))
    groups = [g for g in (tuple(range(cut)), tuple(range(cut, len(sizes)))) if g]
    sub = draw(st.integers(1, 300))
    n, m, w = draw(st.integers(1, 9)), draw(st.integers(1, 9)), draw(st.integers(1, 6))
    budget = draw(st.sampled_from([24, 200, 1000, 1 << 20]))
    segments = draw(st.sampled_from([1, 7, 40, 1 << 20]))
    return params, zero3_layout(params, groups, n, sub), zero3_layout(params, groups, m, sub), \
        Ownership(n, m, w), (budget, segments)


def chunked_optim(src, dst, own, budget, streams):
    budget, segments = budget if isinstance(budget, tuple) else (budget, 1 << 20)
    bases = logical_bases([p.numel for p in src.params])
    return plan_chunked_space("optim", ChunkedSide.of_zero3(src), ChunkedSide.of_zero3(dst), streams, bases, own,
                              budget, round_segments=segments)


@given(zero3_cases())
@settings(max_examples=120, deadline=None)
def test_every_element_lands_once_in_its_target_place(case):
    params, src, dst, own, (budget, segments) = case
    space = chunked_optim(src, dst, own, (budget, segments), STREAMS[:2])
    plan = ReshardPlan(own, (space,), budget)
    got = simulate(plan, [src.pieces], [dst.pieces], [buffer_numels(src)], [buffer_numels(dst)],
                   round_limit=lambda s: chunked_limit(plan, s))
    want = expected_targets([dst.pieces], plan.spaces, [buffer_numels(dst)], own.target_ranks)
    assert got.keys() == want.keys()
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=str(key))


@given(zero3_cases())
@settings(max_examples=100, deadline=None)
def test_traffic_and_round_bytes_match_the_table_plan(case):
    params, src, dst, own, (budget, segments) = case
    chunked = chunked_optim(src, dst, own, (budget, segments), STREAMS[:2])
    table = plan_space("optim", src.pieces, dst.pieces, STREAMS[:2], buffer_numels(dst), own, budget)
    assert np.array_equal(chunked.traffic(own), table.traffic(own))
    assert sum(chunked.round_bytes()) == sum(p.numel for p in params) * 8 == sum(table.round_bytes())
    plan = ReshardPlan(own, (chunked,), budget)
    if segments > 1:  # a round touches at most k + 1 parameters, k from the segment cap
        for r in range(chunked.rounds):
            assert len(chunked._window_params(r)[0]) <= max(1, segments // 2) + 1
    for worker in range(own.workers):  # buffers sized by the bound hold every round
        view = plan.worker_view(worker)
        send, receive = view.buffer_bytes()
        for r in range(plan.rounds):
            _, sends, receives = view.round(r)
            assert sum(b.elements for b in sends) * 8 <= send and sum(b.elements for b in receives) * 8 <= receive


@given(st.lists(st.integers(0, 40), min_size=1, max_size=6), st.integers(1, 6), st.integers(1, 6),
       st.integers(1, 4), st.sampled_from([16, 100, 1 << 20]))
@settings(max_examples=100, deadline=None)
def test_frozen_space_follows_the_optimizer_space(frozen_sizes, n, m, w, budget):
    params = (ParamSpec("a", (37,)), ParamSpec("b", (5,)))
    frozen = tuple(ParamSpec(f"f{i}", (k,)) for i, k in enumerate(frozen_sizes))
    src, dst = zero3_layout(params, [(0, 1)], n), zero3_layout(params, [(0, 1)], m)
    own = Ownership(n, m, w)
    optim = chunked_optim(src, dst, own, budget, STREAMS[:1])
    numels = [p.numel for p in frozen]
    frozen_space = plan_chunked_space("frozen", ChunkedSide.of_frozen(numels, n), ChunkedSide.of_frozen(numels, m),
                                      STREAMS[2:], logical_bases(numels), own, budget, round_offset=optim.rounds)
    plan = ReshardPlan(own, (optim, frozen_space), budget)
    chunks = lambda world: [zero3_chunk(k, world) for k in numels]
    tables = [dst.pieces, frozen_pieces(frozen, m)]
    got = simulate(plan, [src.pieces, frozen_pieces(frozen, n)], tables, [buffer_numels(src), chunks(n)],
                   [buffer_numels(dst), chunks(m)], round_limit=lambda s: chunked_limit(plan, s))
    want = expected_targets(tables, plan.spaces, [buffer_numels(dst), chunks(m)], m)
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=str(key))


class _Spec:
    """The parts of a CheckpointSpec the planner reads, for a synthetic model."""

    def __init__(self, params, groups, dp, stage):
        self.params, self.groups, self.stage = params, groups, stage
        self.topology = Topology(dp)
        self.streams = (Stream("fp32", "float32", 4), Stream("exp_avg", "float32", 4),
                        Stream("exp_avg_sq", "float32", 4))
        self.frozen, self.tensor, self.experts = (), None, None

    def layout(self, topology):
        return zero3_layout(self.params, self.groups, topology.dp)


def test_planning_at_thousands_of_ranks_takes_seconds():
    """Metadata only: 5,000 parameters from 2,048 to 4,096 ranks with 512 workers; one worker's plan."""
    rng = np.random.default_rng(0)
    params = tuple(ParamSpec(f"p{i}", (int(rng.integers(1, 64)) * 128, int(rng.integers(1, 8)) * 64))
                   for i in range(5000))
    spec = _Spec(params, [tuple(range(0, 5000, 2)), tuple(range(1, 5000, 2))], 2048, 3)
    started = time.perf_counter()
    plan = plan_reshard(spec, Topology(4096), workers=512, budget_bytes=256 << 20)
    view = plan.worker_view(511)
    sent = received = 0
    for r in range(plan.rounds):
        _, sends, receives = view.round(r)
        sent += sum(b.elements for b in sends)
        received += sum(b.elements for b in receives)
    seconds = time.perf_counter() - started
    traffic = plan.spaces[0].traffic(plan.ownership)[511]
    assert sent * 12 == traffic[0] and received * 12 == traffic[3] and received > 0
    assert seconds < 60, f"planning one worker's share took {seconds:.1f} s"
