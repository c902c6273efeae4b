"""Test helper: a worker's blocks of a table space taken from the whole cut table, the way the
planner made them before it cut rounds lazily (every segment cut, then selected per worker).

    sends, receives = reference_blocks(space, ownership, worker)   # {local round: [RoundBlock]}
"""
from __future__ import annotations

import numpy as np

from reshard.planning.plan import blocks_by_peer


def reference_blocks(space, ownership, worker: int) -> tuple[dict, dict]:
    seg = space.segments
    src, dst = ownership.readers(seg.src_rank), ownership.writers(seg.dst_rank)
    tables = []
    for mine, peer_of in ((src == worker, dst), (dst == worker, src)):
        chosen = np.flatnonzero(mine)
        chosen = chosen[np.argsort(seg.round[chosen], kind="stable")]
        table = {}
        for part in np.split(chosen, np.flatnonzero(np.diff(seg.round[chosen])) + 1) if len(chosen) else []:
            part = part[np.lexsort((seg.src_offset[part], seg.src_buffer[part], seg.src_rank[part], peer_of[part]))]
            table[int(seg.round[part[0]])] = blocks_by_peer(seg.select(part), peer_of[part], order=np.arange(len(part)))
        tables.append(table)
    return tables[0], tables[1]


def same_blocks(a: list, b: list) -> bool:
    """Blocks equal peer by peer and column by column."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if x.peer != y.peer or x.segments.strided != y.segments.strided:
            return False
        cols = [c for c in ("logical", "src_rank", "src_buffer", "src_offset", "dst_rank", "dst_buffer",
                            "dst_offset", "length", "round", "col", "width", "src_stride", "dst_stride")
                if getattr(x.segments, c) is not None]
        if not all(np.array_equal(getattr(x.segments, c), getattr(y.segments, c)) for c in cols):
            return False
    return True


def assert_lazy_rounds_match(space, ownership) -> None:
    """Every worker's lazily cut rounds, buffer sizes and the space's round bytes equal what the
    whole cut table (`space.segments`) gives."""
    seg = space.segments
    per_round = np.bincount(seg.round, weights=seg.length, minlength=space.rounds) if len(seg) else np.zeros(0)
    assert space.round_bytes() == [int(x) * space.bytes_per_element for x in per_round]
    for worker in range(ownership.workers):
        sends, receives = reference_blocks(space, ownership, worker)
        lazy = space.worker_rounds(ownership, worker)
        for r in range(space.rounds):
            got_sends, got_receives = lazy.blocks(r)
            assert same_blocks(got_sends, sends.get(r, [])), (worker, r, "sends")
            assert same_blocks(got_receives, receives.get(r, [])), (worker, r, "receives")
        largest = [max((sum(b.elements for b in blocks) for blocks in table.values()), default=0)
                   * space.bytes_per_element for table in (sends, receives)]
        assert list(lazy.largest_round_bytes(space.bytes_per_element)) == largest
