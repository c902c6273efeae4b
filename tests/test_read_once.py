"""Each source byte of a replicated tensor-parallel parameter is read once (issues 8 and 9).

    python -m pytest -q tests/test_read_once.py          # seconds

`reshard.transport.read_once` is checked against its definition on random runs (overlapping, nested,
repeated, several slots) after a random previous round: the send buffer it fills equals one
pread per run, and an element is read once, and not at all when the previous round packed
it. Then a synthetic TP 2 -> 3 ZeRO-2 layout with replicated parameters (a row-parallel
weight's bias, a norm) is planned and run through the real exchange
(`reshard.transport.exchange.run_rounds`) on worker threads, in one round and in many: the plan keeps
one copy per target TP rank, yet every source element (replicated ones included) is read
exactly once, only from source TP rank 0 for replicated ones, the reader's byte count is
exactly the distinct bytes, and every target element is written once, from the element with
the same identity.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reshard.transport.exchange import run_rounds
from reshard.layouts.zero import buffer_numels
from reshard.layouts.tensor_parallel import REPLICATED, TensorParallelParams, TensorSplit
from reshard.planning.plan import Ownership, ReshardPlan, plan_space
from reshard.transport.read_once import reads_and_copies
from reshard.topology import Topology
from test_strided import STREAMS, _Arrays, _buffers, _layout, _space
from threaded_transport import run_workers

FILE = np.arange(1000, dtype=np.int64) * 7 + 3


@st.composite
def walks(draw):
    """Runs (position, rank, slot, element, count, itemsize) laid end to end in a send buffer."""
    keys = draw(st.lists(st.tuples(st.integers(0, 2), st.sampled_from(["a", "b"])), min_size=1, max_size=4,
                         unique=True))
    runs, position = [], 0
    for _ in range(draw(st.integers(0, 25))):
        rank, slot = draw(st.sampled_from(keys))
        itemsize = (2, 4, 8)[(rank + (slot == "b")) % 3]  # a slot's element size is fixed
        element, count = draw(st.integers(0, 60)), draw(st.integers(1, 30))
        runs.append((position, rank, (slot,), element, count, itemsize))
        position += count * itemsize
    return runs, position


def _file(rank, slot, itemsize):
    return (FILE + rank * 100_000 + (slot == ("b",)) * 50_000).astype(f"<i{itemsize}").view(np.uint8)


def _packed(runs, size):
    """The send buffer one pread per run fills."""
    want = np.zeros(size, np.uint8)
    for position, rank, slot, element, count, itemsize in runs:
        want[position:position + count * itemsize] = _file(rank, slot, itemsize)[element * itemsize:
                                                                                 (element + count) * itemsize]
    return want


@given(walks(), walks())
@settings(max_examples=300, deadline=None)
def test_reads_and_copies_fill_the_buffer_as_one_read_per_run_would(walk, last):
    """`last`: the previous round's runs and its buffer (all packed), which copies may also use."""
    runs, size = walk
    last_runs, last_size = last
    last_buffer = _packed(last_runs, last_size)
    want = _packed(runs, size)
    reads, copies = reads_and_copies(runs, last_runs)
    got = np.zeros(size, np.uint8)
    read_count = {}
    for position, rank, slot, element, count, itemsize in reads:
        got[position:position + count * itemsize] = _file(rank, slot, itemsize)[element * itemsize:
                                                                                (element + count) * itemsize]
        seen = read_count.setdefault((rank, slot), np.zeros(100, np.int64))
        seen[element:element + count] += 1
    for to, start, nbytes, from_last in copies:
        assert from_last or start + nbytes <= to or to + nbytes <= start  # never overlapping
        got[to:to + nbytes] = (last_buffer if from_last else got)[start:start + nbytes]
    assert np.array_equal(got, want)
    for (rank, slot) in {(r[1], r[2]) for r in runs}:
        wanted = np.zeros(100, np.int64)
        for _, r, s, element, count, _ in runs:
            if (r, s) == (rank, slot):
                wanted[element:element + count] = 1
        for _, r, s, element, count, _ in last_runs:
            if (r, s) == (rank, slot):
                wanted[element:element + count] = 0
        seen = read_count.get((rank, slot), np.zeros(100, np.int64))
        assert np.array_equal(seen, wanted), (rank, slot)  # read once, unless the last round packed it


@pytest.mark.parametrize("budget", [1 << 20, 3 * 12 * 8])
def test_replicated_parameters_are_read_once_and_written_to_every_target_tp_rank(budget):
    """One round (the copies share it), and many small rounds (a sender's copies overflow a
    round: consecutive sub-rounds, served from the previous round's buffer)."""
    params = TensorParallelParams(
        ("qkv", "qkv_bias", "proj", "proj_bias", "norm"),
        ((12, 10), (12,), (10, 12), (10,), (10,)),
        (TensorSplit("column", 0), TensorSplit("column", 0), TensorSplit("row", 1), REPLICATED, REPLICATED))
    groups = ((0, 1, 2), (3, 4))
    source, target = Topology(dp=2, tp=2), Topology(dp=2, tp=3)
    bounds = {"source": [[0, 6, 12], [0, 6, 12], [0, 6, 12], [0, 0, 0], [0, 0, 0]],
              "target": [[0, 4, 8, 12], [0, 4, 8, 12], [0, 4, 8, 12], [0, 0, 0, 0], [0, 0, 0, 0]]}
    _, old, new = _space(params, groups, source, target, bounds)
    sizes = np.max([buffer_numels(_layout(params, groups, bounds["target"], target, t)) for t in range(target.tp)],
                   axis=0)
    ownership = Ownership.between(source, target, 2)
    space = plan_space("optim", old, new, STREAMS, tuple(int(n) for n in sizes), ownership, budget)
    plan = ReshardPlan(ownership, (space,), budget)
    assert (plan.rounds == 1) == (budget == 1 << 20)
    replicated = [3, 4]
    copies_planned = int(space.segments.length.sum()) - sum(int(np.prod(s)) for s in params.shapes)
    assert copies_planned == (target.tp - 1) * (10 + 10)  # the plan still moves one copy per target TP rank

    src_ids = _buffers(params, groups, bounds["source"], source)
    want = _buffers(params, groups, bounds["target"], target)
    reader = _Arrays(src_ids, STREAMS)
    writer = _Arrays({key: np.full(len(v), -1, np.int64) for key, v in want.items()}, STREAMS)
    run_workers(2, lambda transport: run_rounds(plan, transport, reader, writer))

    for (rank, stream, buffer), written in writer.buffers.items():
        expected = want[(rank, buffer)]
        assert np.array_equal(written, expected if stream == "ids" else expected.astype(np.int32)), (rank, buffer)
        assert np.array_equal(writer.count[(rank, stream, buffer)], (expected >= 0).astype(np.int64))
    distinct = 0
    for (rank, stream, buffer), reads in reader.count.items():
        ids = src_ids[(rank, buffer)]
        is_replicated = np.isin(ids // 10_000, replicated) & (ids >= 0)
        from_tp0 = source.coordinates(rank).tp == 0
        assert np.all(reads[is_replicated] == (1 if from_tp0 else 0)), (rank, stream, buffer)
        assert np.all(reads[(ids >= 0) & ~is_replicated] == 1) and np.all(reads[ids < 0] == 0)
        distinct += int((reads > 0).sum()) * (8 if stream == "ids" else 4)
        assert is_replicated.any() == (buffer == 1)  # the replicated group is there to be read
    assert reader.bytes_read == distinct
