"""Which bytes of a round's send buffer are read from the source, and which are copied from
bytes already packed (this round's buffer, or the previous round's). Pure, no I/O.

    from reshard.transport.read_once import reads_and_copies
    reads, copies = reads_and_copies(runs, previous=last_rounds_runs)
    reader.read_batch([(rank, slot, element, itemsize, view of buffer[position:...])
                       for position, rank, slot, element, count, itemsize in reads])
    for to, start, nbytes, from_previous in copies:
        buffer[to:to + nbytes] = (last_buffer if from_previous else buffer)[start:start + nbytes]

A replicated tensor-parallel parameter (and a ZeRO-3 frozen fragment under TP) has one copy
per target TP rank in the logical space, and every copy maps to the same source elements
(`reshard.layouts.tensor_pieces`): the worker that reads that source rank packs the same source
range once per target copy, in one round, or in consecutive rounds when one sender's copies
exceed a round (`reshard.planning.plan._pack_overfull_windows` puts them in consecutive sub-rounds).
Each run of the packing walk is cut into the parts the previous round packed (copied from its
buffer, which stays intact while this one fills), the parts an earlier run of this round covers
(copied inside the buffer) and the rest (read with one pread). This round's runs are swept per
(source rank, slot, itemsize) in order of first element: of the runs before, the one reaching
furthest starts at or before the current run, so it alone covers the whole overlap. Copies are
done in sweep order after all reads, so their sources are always filled; reads keep the
walk's order (sequential in each file). So each source byte is read once, unless its copies
are more than a round apart.
"""
from __future__ import annotations

import numpy as np

from reshard.planning.plan import sorted_distinct

Run = tuple[int, int, tuple, int, int, int]
"""(byte position in the send buffer, source rank, slot, first element, elements, itemsize)"""


def _sweep(key: np.ndarray, start: np.ndarray, end: np.ndarray):
    """Per key by first element (the longest first): (order, covered_to, owner) where run
    order[i] has [start, covered_to) already in the earlier run order[owner[i]] (none where
    covered_to <= start), and reads [max(start, covered_to), end)."""
    order = np.lexsort((-end, start, key))
    k, e = key[order], end[order]
    span = int(e.max()) + 1
    shifted = e + k * span  # one running maximum over all keys: an earlier key's ends stay below this key's
    reach = np.maximum.accumulate(shifted)
    before = np.concatenate(([-1], reach[:-1]))
    covered_to = np.minimum(e, before - k * span)  # negative where no earlier run of the key exists
    furthest = np.maximum.accumulate(np.where(shifted >= before, np.arange(len(order)), 0))
    owner = np.concatenate(([0], furthest[:-1]))  # the earlier run reaching furthest: it covers [s, reach)
    return order, covered_to, owner


def _columns(runs, keys: dict):
    key = np.fromiter((keys.setdefault((r[1], r[2], r[5]), len(keys)) for r in runs), dtype=np.int64, count=len(runs))
    start = np.fromiter((r[3] for r in runs), dtype=np.int64, count=len(runs))
    return key, start, start + np.fromiter((r[4] for r in runs), dtype=np.int64, count=len(runs))


def _outside(runs: list[Run], previous: list[Run], keys: dict, copies: list) -> list[Run]:
    """The parts of `runs` the previous round did not pack (its copies appended to `copies`)."""
    key, start, end = _columns(previous, keys)
    order, covered_to, _ = _sweep(key, start, end)
    first = np.maximum(start[order], covered_to)
    new = first < end[order]  # the previous round's packed elements, as disjoint pieces
    piece = order[new]
    span = int(max(end.max(), max(r[3] + r[4] for r in runs))) + 1
    lo, hi = key[piece] * span + first[new], key[piece] * span + end[piece]
    at = np.fromiter((p[0] + (f - p[3]) * p[5] for p, f in zip((previous[j] for j in piece.tolist()),
                                                                 first[new].tolist())), dtype=np.int64, count=len(piece))
    r_key, r_start, r_end = _columns(runs, keys)
    g_start, g_end = r_key * span + r_start, r_key * span + r_end
    index = np.searchsorted(hi, g_start, side="right")  # first piece ending after the run starts
    touched = index < len(lo)
    touched[touched] = lo[index[touched]] < g_end[touched]
    if not touched.any():
        return runs
    kept: list[Run] = []
    for n, run in enumerate(runs):
        if not touched[n]:
            kept.append(run)
            continue
        position, rank, slot, element, count, itemsize = run
        base, cursor, stop, j = int(r_key[n]) * span, element, element + count, int(index[n])
        while j < len(lo) and lo[j] < base + stop:
            a, b = max(int(lo[j]) - base, cursor), min(int(hi[j]) - base, stop)
            if a > cursor:
                kept.append((position + (cursor - element) * itemsize, rank, slot, cursor, a - cursor, itemsize))
            copies.append((position + (a - element) * itemsize, int(at[j]) + (a - int(lo[j]) + base) * itemsize,
                           (b - a) * itemsize, True))
            cursor, j = b, j + 1
        if cursor < stop:
            kept.append((position + (cursor - element) * itemsize, rank, slot, cursor, stop - cursor, itemsize))
    return kept


def reads_and_copies(runs: list[Run], previous: list[Run] = ()
                     ) -> tuple[list[Run], list[tuple[int, int, int, bool]]]:
    """(runs to read, in walk order; copies (to position, from position, bytes, from the previous
    round's buffer), in the order to do them). `previous`: the runs the previous round's
    buffer holds (all of them, read or copied)."""
    keys: dict = {}
    copies: list = []
    if len(runs) and len(previous):
        runs = _outside(list(runs), list(previous), keys, copies)
    if len(runs) < 2:
        return list(runs), copies
    key, start, end = _columns(runs, keys)
    if len(sorted_distinct(key)) == len(runs):
        return list(runs), copies
    order, covered_to, owner = _sweep(key, start, end)
    s = start[order]
    copied = covered_to > s
    for i in np.flatnonzero(copied).tolist():
        run, source = runs[order[i]], runs[order[owner[i]]]
        itemsize = run[5]
        copies.append((run[0], source[0] + (int(s[i]) - source[3]) * itemsize,
                       (int(covered_to[i]) - int(s[i])) * itemsize, False))
    if not copied.any():
        return list(runs), copies
    read_from = np.empty(len(runs), dtype=np.int64)
    read_from[order] = np.maximum(s, covered_to)
    reads = []
    for index, run in enumerate(runs):
        first, stop = int(read_from[index]), run[3] + run[4]
        if first < stop:
            reads.append((run[0] + (first - run[3]) * run[5], run[1], run[2], first, stop - first, run[5]))
    return reads, copies
