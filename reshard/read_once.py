"""Which bytes of a round's send buffer are read from the source, and which are copied from
bytes the same round already read. Pure, no I/O.

    from reshard.read_once import reads_and_copies
    reads, copies = reads_and_copies(list(_walk(sends, space, "src")))
    for position, rank, slot, element, count, itemsize in reads: reader.read_into(...)
    for to, start, nbytes in copies: buffer[to:to + nbytes] = buffer[start:start + nbytes]

A replicated tensor-parallel parameter (and a ZeRO-3 frozen fragment under TP) has one copy
per target TP rank in the logical space, and every copy maps to the same source elements
(`reshard.tensor_pieces`): the worker that reads that source rank packs the same source
range once per target copy. Here each run of the packing walk is cut into the part some
earlier run of the round already covers (copied inside the send buffer) and the rest (read
with one pread), so each source byte is read once per round. Runs are swept per (source
rank, slot) in order of first element: everything before the run that reaches furthest
starts at or before the current run, so that one run covers the whole overlap; copies are
done in sweep order, after all reads, so their sources are always filled. Reads keep the
walk's order (sequential in each file).
"""
from __future__ import annotations

import numpy as np

Run = tuple[int, int, tuple, int, int, int]
"""(byte position in the send buffer, source rank, slot, first element, elements, itemsize)"""


def reads_and_copies(runs: list[Run]) -> tuple[list[Run], list[tuple[int, int, int]]]:
    """(runs to read, in walk order; (to position, from position, bytes) copies, in the order to do them)."""
    if len(runs) < 2:
        return list(runs), []
    keys: dict = {}
    key = np.fromiter((keys.setdefault((r[1], r[2]), len(keys)) for r in runs), dtype=np.int64, count=len(runs))
    if len(keys) == len(runs):
        return list(runs), []
    start = np.fromiter((r[3] for r in runs), dtype=np.int64, count=len(runs))
    end = start + np.fromiter((r[4] for r in runs), dtype=np.int64, count=len(runs))
    order = np.lexsort((-end, start, key))  # per key by first element, the longest first
    k, s, e = key[order], start[order], end[order]
    span = int(e.max()) + 1
    shifted = e + k * span  # one running maximum over all keys: an earlier key's ends stay below this key's
    reach = np.maximum.accumulate(shifted)
    before = np.concatenate(([-1], reach[:-1]))
    covered_to = np.minimum(e, before - k * span)  # negative where no earlier run of the key exists
    if not np.any(covered_to > s):
        return list(runs), []
    furthest = np.maximum.accumulate(np.where(shifted >= before, np.arange(len(order)), 0))
    owner = np.concatenate(([0], furthest[:-1]))  # the earlier run reaching furthest: it covers [s, reach)
    reads, copies = [], []
    read_from = np.maximum(s, covered_to)
    for i in np.flatnonzero(covered_to > s).tolist():
        run, source = runs[order[i]], runs[order[owner[i]]]
        itemsize = run[5]
        copies.append((run[0], source[0] + (int(s[i]) - source[3]) * itemsize,
                       (int(covered_to[i]) - int(s[i])) * itemsize))
    read_from_by_run = np.empty(len(runs), dtype=np.int64)
    read_from_by_run[order] = read_from
    for index, run in enumerate(runs):
        first, stop = int(read_from_by_run[index]), run[3] + run[4]
        if first < stop:
            reads.append((run[0] + (first - run[3]) * run[5], run[1], run[2], first, stop - first, run[5]))
    return reads, copies
