"""The reshard plan, pure and deterministic: who reads, who writes, what moves, in which round.

    from reshard.planning.plan import Stream, plan_space, Ownership
    own = Ownership.between(Topology(dp=2), Topology(dp=3), workers=2)
    space = plan_space("optimizer", src_layout.pieces, dst_layout.pieces,
                       streams=(Stream("fp32", "float32", 4),), target_buffer_numels=(80,),
                       ownership=own, budget_bytes=1 << 20)
    space.table.length.sum()      # every element of the space, exactly once (uncut segments)

Every worker computes the same plan from the same inputs (no I/O, no randomness), so
workers agree on every transfer without exchanging the plan. A *segment* is a run of
elements that is contiguous in one source buffer and in one target buffer; every stream of
the space (fp32 weights, exp_avg, ...) moves along the same segments. Segments come from
intersecting the two layouts' sorted piece tables: O(pieces), vectorised.

Rounds bound memory: in one round a worker sends at most a third of the budget and receives
at most a third. The exchange reads the next round while the current one is in flight, so a
worker holds two send buffers and one receive buffer: never more than the budget. Rounds cut
the target ranks' buffers (laid end to end per rank) into equal windows, so every worker
receives an equal share in every round; a window whose senders turn out unbalanced is split
further for those senders (packed in logical order into sub-rounds).

Nobody cuts the whole plan (at 10^12 elements over 8192 ranks that would be ~10^8 window
segments). `plan_space` keeps the uncut segment table and decides the rounds from per-window
totals (`round_windows`: a difference array per worker, O(segments + windows x workers)); only
windows found overfull are cut, to pack them. Round r is then the r-th (window, sub-round)
that holds elements, the same on every worker. Each worker keeps the uncut segments it sends
or receives, sorted by (target rank, position) (`_WindowIndex`), and cuts a round's segments
when the exchange asks for it (`TableWorkerRounds.blocks`): O(target ranks + segments of the
round). `SpacePlan.segments` still gives the whole cut table, for tests and small plans.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from reshard.layouts.zero import PieceTable, Stream
from reshard.layouts.strided_runs import advance, first_at_or_after, split_at_windows
from reshard.topology import Topology

SEGMENT_COLUMNS = ("logical", "src_rank", "src_buffer", "src_offset", "dst_rank", "dst_buffer",
                   "dst_offset", "length", "round")
STRIDE_COLUMNS = ("col", "width", "src_stride", "dst_stride")
"""Extra columns of strided segments (tensor-parallel shards cut inside rows): element e of a
segment sits at `strided_runs.advance(src_offset, col, width, src_stride, e)` in the source
buffer and likewise in the target one. Segments of contiguous spaces have none of them."""


@dataclass(frozen=True)
class Ownership:
    """Which worker reads each source rank's files and writes each target rank's files.

    By default contiguous blocks: ranks are spread as evenly as possible, and worker 0 always
    owns source rank 0 and target rank 0 (it also reads the metadata and writes the shared
    model-states file). With explicit tables (`from_tables`: node-local checkpoints, where
    readers follow which files a worker sees and writers follow the node of the target rank,
    see `reshard.jobs.node_local`) any worker may own any ranks.
    """

    source_ranks: int
    target_ranks: int
    """Target ranks, or whatever the writers own (output files of an export)."""
    workers: int
    reader_table: tuple[int, ...] | None = None
    """Worker reading each source rank, when not the arithmetic blocks."""
    writer_table: tuple[int, ...] | None = None
    """Worker writing each target rank, when not the arithmetic blocks."""

    @classmethod
    def between(cls, source: Topology, target: Topology, workers: int) -> "Ownership":
        """Ownership of every rank of the `source` topology and of the `target` topology."""
        return cls(source.world_size, target.world_size, workers)

    @classmethod
    def from_tables(cls, readers: Sequence[int], writers: Sequence[int], workers: int) -> "Ownership":
        """Readers and writers given rank by rank (each a worker in 0..workers-1)."""
        readers, writers = tuple(int(w) for w in readers), tuple(int(w) for w in writers)
        if any(not 0 <= w < workers for w in readers + writers):
            raise ValueError(f"ownership tables name workers outside 0..{workers - 1}")
        return cls(len(readers), len(writers), workers, readers, writers)

    @property
    def ascending(self) -> bool:
        """Readers grow with the source rank (true of the arithmetic blocks): sorting segments by
        source position then sorts them by reader too."""
        table = self.reader_table
        return table is None or all(a <= b for a, b in zip(table, table[1:]))

    def reader(self, source_rank):
        if self.reader_table is not None:
            return self.reader_table[source_rank]
        return source_rank * self.workers // self.source_ranks

    def writer(self, target_rank):
        if self.writer_table is not None:
            return self.writer_table[target_rank]
        return target_rank * self.workers // self.target_ranks

    def readers(self, source_ranks: np.ndarray) -> np.ndarray:
        if self.reader_table is not None:
            return np.asarray(self.reader_table, dtype=np.int64)[np.asarray(source_ranks, dtype=np.int64)]
        return np.asarray(source_ranks, dtype=np.int64) * self.workers // self.source_ranks

    def writers(self, target_ranks: np.ndarray) -> np.ndarray:
        if self.writer_table is not None:
            return np.asarray(self.writer_table, dtype=np.int64)[np.asarray(target_ranks, dtype=np.int64)]
        return np.asarray(target_ranks, dtype=np.int64) * self.workers // self.target_ranks

    def source_ranks_of(self, worker: int) -> list[int]:
        """Source ranks `worker` reads, ascending: a contiguous range without tables (the first
        rank r with r*W//N == worker on)."""
        if self.reader_table is not None:
            return [r for r, w in enumerate(self.reader_table) if w == worker]
        return list(range(-(-worker * self.source_ranks // self.workers),
                          -(-(worker + 1) * self.source_ranks // self.workers)))

    def target_ranks_of(self, worker: int) -> list[int]:
        if self.writer_table is not None:
            return [r for r, w in enumerate(self.writer_table) if w == worker]
        return list(range(-(-worker * self.target_ranks // self.workers),
                          -(-(worker + 1) * self.target_ranks // self.workers)))

    @property
    def max_source_ranks_per_worker(self) -> int:
        if self.reader_table is not None:
            return _most_per_worker(self.reader_table, self.workers)
        return -(-self.source_ranks // self.workers)

    @property
    def max_target_ranks_per_worker(self) -> int:
        if self.writer_table is not None:
            return _most_per_worker(self.writer_table, self.workers)
        return -(-self.target_ranks // self.workers)


def _most_per_worker(table: tuple[int, ...], workers: int) -> int:
    return int(np.bincount(np.asarray(table, dtype=np.int64), minlength=workers).max(initial=0))


@dataclass(frozen=True, eq=False)
class Segments:
    """Columns of equal length, one row per segment, sorted by `logical`."""

    logical: np.ndarray
    src_rank: np.ndarray
    src_buffer: np.ndarray
    src_offset: np.ndarray
    dst_rank: np.ndarray
    dst_buffer: np.ndarray
    dst_offset: np.ndarray
    length: np.ndarray
    round: np.ndarray
    col: np.ndarray | None = None
    width: np.ndarray | None = None
    src_stride: np.ndarray | None = None
    dst_stride: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.logical)

    @property
    def strided(self) -> bool:
        return self.width is not None

    def strides(self) -> tuple:
        """The stride columns, or () for contiguous segments."""
        return tuple(getattr(self, c) for c in STRIDE_COLUMNS) if self.width is not None else ()

    def select(self, index) -> "Segments":
        return Segments(*(getattr(self, c)[index] for c in SEGMENT_COLUMNS), *(c[index] for c in self.strides()))

    def end_offsets(self) -> tuple[np.ndarray, np.ndarray]:
        """(source, target) buffer offset where each segment's next element would be."""
        if self.width is None:
            return self.src_offset + self.length, self.dst_offset + self.length
        return (advance(self.src_offset, self.col, self.width, self.src_stride, self.length)[0],
                advance(self.dst_offset, self.col, self.width, self.dst_stride, self.length)[0])


def intersect(source: PieceTable, target: PieceTable) -> Segments:
    """Segments moving every element of the space from its source place to its target place."""
    if source.total != target.total:
        raise ValueError(f"layouts describe different spaces: {source.total} vs {target.total} elements")
    if source.total == 0:
        empty = np.zeros(0, dtype=np.int64)
        return Segments(*(empty for _ in SEGMENT_COLUMNS))
    bounds = _sorted_union(source.start, target.start)
    i = np.searchsorted(source.start, bounds, side="right") - 1
    j = np.searchsorted(target.start, bounds, side="right") - 1
    length = np.diff(np.append(bounds, source.total))
    into_source, into_target = bounds - source.start[i], bounds - target.start[j]
    cols = dict(logical=bounds, src_rank=source.rank[i], src_buffer=source.buffer[i], src_offset=None,
                dst_rank=target.rank[j], dst_buffer=target.buffer[j], dst_offset=None, length=length)
    if source.strided or target.strided:
        (s_col, s_width, s_stride), (t_col, t_width, t_stride) = source.stride_columns(), target.stride_columns()
        width = s_width[i]
        if np.any(width != t_width[j]):
            raise ValueError("source and target pieces of one strip disagree on its width (built from different grids)")
        cols["src_offset"], col = advance(source.offset[i], s_col[i], width, s_stride[i], into_source)
        cols["dst_offset"], _ = advance(target.offset[j], t_col[j], width, t_stride[j], into_target)
        cols.update(col=col, width=width, src_stride=s_stride[i], dst_stride=t_stride[j])
    else:
        cols["src_offset"], cols["dst_offset"] = source.offset[i] + into_source, target.offset[j] + into_target
    del i, j, into_source, into_target
    return _merge_contiguous(cols)


def _sorted_union(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Sorted distinct values of a and b (np.union1d hashes on numpy 2; sorting is ~10x faster here)."""
    merged = np.concatenate((a, b))
    merged.sort(kind="stable")
    keep = np.ones(len(merged), dtype=bool)
    keep[1:] = merged[1:] != merged[:-1]
    return merged[keep]


def _merge_contiguous(cols: dict) -> Segments:
    """Join neighbours that continue each other in both buffers (e.g. adjacent parameters)."""
    n = len(cols["logical"])
    new_run = np.ones(n, dtype=bool)
    if n > 1:
        if "width" in cols:
            ends = Segments(*(cols[c] if c != "round" else None for c in SEGMENT_COLUMNS),
                            *(cols[c] for c in STRIDE_COLUMNS)).end_offsets()
            end_src, end_dst = ends[0][:-1], ends[1][:-1]
        else:
            end_src = cols["src_offset"][:-1] + cols["length"][:-1]
            end_dst = cols["dst_offset"][:-1] + cols["length"][:-1]
        continues = ((cols["src_rank"][1:] == cols["src_rank"][:-1])
                     & (cols["src_buffer"][1:] == cols["src_buffer"][:-1])
                     & (cols["src_offset"][1:] == end_src)
                     & (cols["dst_rank"][1:] == cols["dst_rank"][:-1])
                     & (cols["dst_buffer"][1:] == cols["dst_buffer"][:-1])
                     & (cols["dst_offset"][1:] == end_dst))
        if "width" in cols:  # the same strip geometry, the next element's column too
            continues &= ((cols["width"][1:] == cols["width"][:-1])
                          & (cols["src_stride"][1:] == cols["src_stride"][:-1])
                          & (cols["dst_stride"][1:] == cols["dst_stride"][:-1])
                          & (cols["col"][1:] == (cols["col"][:-1] + cols["length"][:-1]) % cols["width"][:-1]))
        new_run[1:] = ~continues
    starts = np.flatnonzero(new_run)
    if len(starts) == n:  # nothing joins (the columns are the caller's own): no copies
        return Segments(**cols, round=np.zeros(n, dtype=np.int64))
    merged = {k: v[starts] for k, v in cols.items() if k != "length"}
    merged["length"] = np.add.reduceat(cols["length"], starts) if n else cols["length"]
    return Segments(**merged, round=np.zeros(len(starts), dtype=np.int64))


ROUND_BYTES_MAX = 64 << 20
"""Bytes a worker sends (or receives) in one round at most, whatever the budget: smaller rounds
start the read-ahead pipeline sooner and touch fewer fresh buffer pages (bench/ladder.py, 1 GB
ZeRO-2 on 2 shared cores: exchange+write 6-11 s with 64-192 MiB budgets, 13-18 s with 1 GiB)."""


def sorted_distinct(values: np.ndarray) -> np.ndarray:
    """np.unique(values) for a 1-d integer array, without np.unique: its first call imports numpy.ma
    (about 12 ms of CPU in every worker process, for masked arrays reshard never has)."""
    ordered = np.sort(values)
    if len(ordered) < 2:
        return ordered
    return ordered[np.concatenate(([True], ordered[1:] != ordered[:-1]))]


def round_cap(budget_bytes: int) -> int:
    """Bytes a worker may send, and may receive, in one round: a third of the budget (two send
    buffers, one being filled while the other is in flight, and one receive buffer), at most
    ROUND_BYTES_MAX."""
    return min(budget_bytes // 3, ROUND_BYTES_MAX)


def _split_strided_at_windows(seg: Segments, dst_base: np.ndarray, window: int) -> tuple[Segments, np.ndarray]:
    """`_split_at_windows` for strided segments: cut where an element's target position (its
    buffer's base plus its offset) crosses a multiple of `window`."""
    item, first, length, k = split_at_windows(dst_base + seg.dst_offset, seg.col, seg.width, seg.dst_stride,
                                              seg.length, window)
    if len(item) == len(seg):  # no range cut (each has one non-empty part): views, not gathers
        item = slice(None)
    col, width, s_stride, d_stride = (c[item] for c in seg.strides())
    src_offset, new_col = advance(seg.src_offset[item], col, width, s_stride, first)
    dst_offset, _ = advance(seg.dst_offset[item], col, width, d_stride, first)
    cut = Segments(seg.logical[item] + first, seg.src_rank[item], seg.src_buffer[item], src_offset,
                   seg.dst_rank[item], seg.dst_buffer[item], dst_offset, length, k, new_col, width, s_stride, d_stride)
    return cut, k


def _split_at_windows(seg: Segments, position: np.ndarray, window: int) -> tuple[Segments, np.ndarray]:
    """Cut segments where `position` (a per-segment start coordinate) crosses a multiple of `window`."""
    first = position // window
    counts = (position + seg.length - 1) // window - first + 1
    item = np.repeat(np.arange(len(seg)), counts)
    k = first[item] + (np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts))
    piece_start = np.maximum(position[item], k * window)
    piece_end = np.minimum(position[item] + seg.length[item], (k + 1) * window)
    shift = piece_start - position[item]
    cut = Segments(seg.logical[item] + shift, seg.src_rank[item], seg.src_buffer[item],
                   seg.src_offset[item] + shift, seg.dst_rank[item], seg.dst_buffer[item],
                   seg.dst_offset[item] + shift, piece_end - piece_start, k)
    return cut, k


def _with_rounds(seg: Segments, rounds) -> Segments:
    return Segments(*(getattr(seg, c) for c in SEGMENT_COLUMNS[:-1]),
                    np.broadcast_to(np.asarray(rounds, dtype=np.int64), (len(seg),)).copy(), *seg.strides())


NO_WINDOW = 1 << 60
"""Window of a space that moves no bytes (no streams): one round holds everything, uncut."""


def _target_span(seg: Segments, bases: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(first, last + 1) target position of each segment (its buffer's base plus its offset), and
    which segments have gaps between their target rows (None when none can): only those may
    skip positions between the two."""
    start = bases[seg.dst_buffer] + seg.dst_offset
    if not seg.strided:
        return start, start + seg.length, None
    last = advance(start, seg.col, seg.width, seg.dst_stride, seg.length - 1)[0]
    return start, last + 1, (seg.dst_stride != seg.width) & (seg.col + seg.length > seg.width)


def _clip_to_window(seg: Segments, bases: np.ndarray, window: int, k: int) -> Segments:
    """Each segment's part in target positions [k*window, (k+1)*window), the empty ones dropped:
    the same parts `_split_at_windows` / `_split_strided_at_windows` cut (rounds left 0)."""
    if window >= NO_WINDOW:
        return seg
    start = bases[seg.dst_buffer] + seg.dst_offset
    lo_pos, hi_pos = k * window, (k + 1) * window
    if not seg.strided:
        first = np.maximum(start, lo_pos)
        length = np.minimum(start + seg.length, hi_pos) - first
        keep = np.flatnonzero(length > 0)
        shift = (first - start)[keep]
        return Segments(seg.logical[keep] + shift, seg.src_rank[keep], seg.src_buffer[keep],
                        seg.src_offset[keep] + shift, seg.dst_rank[keep], seg.dst_buffer[keep],
                        seg.dst_offset[keep] + shift, length[keep], np.zeros(len(keep), dtype=np.int64))
    col, width, s_stride, d_stride = seg.strides()
    lo = np.minimum(first_at_or_after(start, col, width, d_stride, lo_pos), seg.length)
    hi = np.minimum(first_at_or_after(start, col, width, d_stride, hi_pos), seg.length)
    keep = np.flatnonzero(hi > lo)
    first = lo[keep]
    col, width, s_stride, d_stride = col[keep], width[keep], s_stride[keep], d_stride[keep]
    src_offset, new_col = advance(seg.src_offset[keep], col, width, s_stride, first)
    dst_offset, _ = advance(seg.dst_offset[keep], col, width, d_stride, first)
    return Segments(seg.logical[keep] + first, seg.src_rank[keep], seg.src_buffer[keep], src_offset,
                    seg.dst_rank[keep], seg.dst_buffer[keep], dst_offset, (hi - lo)[keep],
                    np.zeros(len(keep), dtype=np.int64), new_col, width, s_stride, d_stride)


_PARTS_PER_PASS = 1 << 22
"""Window parts of gapped (target-strided) segments counted in one pass of `_window_elements`."""


def _window_elements(seg: Segments, bases: np.ndarray, window: int, windows: int, groupings=((None, 1),),
                     span: tuple | None = None) -> tuple[list[np.ndarray], np.ndarray]:
    """([elements per grouping], present): for each (group, groups) of `groupings`, elements[k, g]
    of the segments of group g (a worker; `None`: one group) that fall in window k; and whether
    window k holds any element at all; without cutting the segments. `span`: `_target_span`'s
    result, when the caller has it.

    A segment without gaps in its target positions gives its first and last window their
    partial counts and every window between the full `window` (a difference array); a gapped
    one is cut, a bounded number of parts per pass."""
    start, end, gapped = span if span is not None else _target_span(seg, bases)
    present = np.zeros(windows, dtype=bool)
    groups_of = [(np.zeros(len(seg), dtype=np.int64) if g is None else np.asarray(g, dtype=np.int64), n)
                 for g, n in groupings]
    counts = [np.zeros((windows + 1) * n, dtype=np.float64) for _, n in groups_of]  # a spare row for steps
    if len(seg) == 0:
        return [c[:windows * n].astype(np.int64).reshape(windows, n) for c, (_, n) in zip(counts, groups_of)], present
    plain = slice(None) if gapped is None else np.flatnonzero(~gapped)
    p, e = start[plain], end[plain]
    k0, k1 = p // window, (e - 1) // window
    first = np.where(k0 == k1, e - p, (k0 + 1) * window - p)
    many = np.flatnonzero(k0 != k1)
    last = e[many] - k1[many] * window
    k0_many, k1_many = k0[many], k1[many]
    for c, (g, n) in zip(counts, groups_of):
        gp = g[plain]
        size = len(c)
        c += np.bincount(k0 * n + gp, weights=first, minlength=size)
        gm = gp[many]
        c += np.bincount(k1_many * n + gm, weights=last, minlength=size)
        steps = (np.bincount((k0_many + 1) * n + gm, minlength=size)
                 - np.bincount(k1_many * n + gm, minlength=size)).astype(np.float64) * float(window)
        c += np.cumsum(steps.reshape(-1, n), axis=0).ravel()
    cover = np.bincount(k0, minlength=windows + 1) - np.bincount(k1 + 1, minlength=windows + 1)
    present |= np.cumsum(cover)[:windows] > 0
    del p, e, k0, k1, first, many, last, k0_many, k1_many, cover
    if gapped is not None and gapped.any():
        ids = np.flatnonzero(gapped)
        parts = (end[ids] - 1) // window - start[ids] // window + 1
        stops = np.searchsorted(np.cumsum(parts), np.arange(_PARTS_PER_PASS, int(parts.sum()), _PARTS_PER_PASS))
        for chunk in np.split(ids, stops):
            if len(chunk) == 0:
                continue
            item, _, length, k = split_at_windows(start[chunk], seg.col[chunk], seg.width[chunk],
                                                  seg.dst_stride[chunk], seg.length[chunk], window)
            for c, (g, n) in zip(counts, groups_of):
                c += np.bincount(k * n + g[chunk][item], weights=length, minlength=len(c))
            present[k] = True
    totals = [np.rint(c[:windows * n]).astype(np.int64).reshape(windows, n) for c, (_, n) in zip(counts, groups_of)]
    return totals, present


@dataclass(frozen=True, eq=False)
class RoundWindows:
    """How a table space is cut into rounds, decided from global sizes and the uncut table alone,
    so that every worker numbers the rounds alike and can cut any one round by itself.

    Round numbers go through the windows that hold elements in ascending order; a window is
    one round, or several where it was packed per sender (`packed`)."""

    window: int
    """Target-buffer elements per rank in one window (`NO_WINDOW`: one round, uncut)."""
    bases: np.ndarray
    """Position of each target buffer when a rank's buffers are laid end to end."""
    span: int
    """More than any target position: ranks' positions kept apart in one sort key."""
    present: np.ndarray
    """Windows holding elements, ascending."""
    first_round: np.ndarray
    """Local round of each present window's first sub-round, and the round count at the end."""
    packed: dict = field(default_factory=dict)
    """Window -> (logical starts of its parts, ascending; their sub-rounds) for windows split per
    sender."""

    @property
    def rounds(self) -> int:
        return int(self.first_round[-1])

    def locate(self, local_round: int) -> tuple[int, int]:
        """(window, sub-round in it) of `local_round`."""
        i = int(np.searchsorted(self.first_round, local_round, side="right")) - 1
        return int(self.present[i]), local_round - int(self.first_round[i])

    def sub_rounds(self, window: int, logical: np.ndarray) -> np.ndarray:
        """Sub-round of window parts starting at `logical` (0 outside packed windows)."""
        if window not in self.packed:
            return np.zeros(len(logical), dtype=np.int64)
        starts, subs = self.packed[window]
        return subs[np.searchsorted(starts, logical)]

    def rounds_of(self, k: np.ndarray, logical: np.ndarray) -> np.ndarray:
        """Local round of window parts in windows `k` starting at `logical`."""
        rounds = self.first_round[np.searchsorted(self.present, k)]
        for w in self.packed:
            at = np.flatnonzero(k == w)
            rounds[at] += self.sub_rounds(w, logical[at])
        return rounds

    def round_elements(self, table: Segments) -> np.ndarray:
        """Elements of `table` (all or a part of the space's uncut table) moved in each round."""
        totals = np.zeros(self.rounds, dtype=np.int64)
        if len(table) == 0 or self.rounds == 0:
            return totals
        per_window = _window_elements(table, self.bases, self.window, int(self.present[-1]) + 1)[0][0][:, 0]
        totals[self.first_round[:-1]] = per_window[self.present]
        finder = _WindowIndex(table, self) if len(self.packed) > 2 else None
        for w, (starts, subs) in self.packed.items():
            part = _clip_to_window(table, self.bases, self.window, w) if finder is None else finder.window(w)
            index = np.searchsorted(self.present, w)
            totals[self.first_round[index]:self.first_round[index + 1]] = np.bincount(
                subs[np.searchsorted(starts, part.logical)], weights=part.length,
                minlength=self.first_round[index + 1] - self.first_round[index])
        return totals


def round_windows(seg: Segments, target_buffer_numels: Sequence[int], ownership: Ownership,
                  bytes_per_element: int, budget_bytes: int, receiving_ranks: int | None = None) -> RoundWindows:
    """The rounds of a table space, in which no worker sends or receives more than `round_cap(budget)` bytes.

    `receiving_ranks`: the most target ranks of one worker that receive anything in this space,
    when fewer than it owns (a space only some ranks hold, as the TP module tensors on dp rank
    0): windows are then as wide as the budget allows for those. O(segments + windows x workers);
    only a window that turns out overfull is cut (and packed, `_pack_overfull_windows`)."""
    bases = np.concatenate(([0], np.cumsum(np.asarray(target_buffer_numels, dtype=np.int64))))[:-1]
    none = np.zeros(0, dtype=np.int64)
    if len(seg) == 0:
        return RoundWindows(NO_WINDOW, bases, 1, none, np.zeros(1, dtype=np.int64))
    spans = _target_span(seg, bases)
    span = int(spans[1].max()) + 1
    if not bytes_per_element:
        return RoundWindows(NO_WINDOW, bases, span, np.zeros(1, dtype=np.int64), np.arange(2, dtype=np.int64))
    cap = max(round_cap(budget_bytes), bytes_per_element)
    receivers = ownership.max_target_ranks_per_worker if receiving_ranks is None else max(1, receiving_ranks)
    window = max(1, cap // (bytes_per_element * receivers))
    windows = (span - 1) // window + 1
    workers = ownership.workers
    sender, receiver = ownership.readers(seg.src_rank), ownership.writers(seg.dst_rank)
    (sent, got), present = _window_elements(seg, bases, window, windows, ((sender, workers), (receiver, workers)),
                                            spans)
    del spans, sender, receiver
    overfull = np.flatnonzero((sent.max(axis=1) * bytes_per_element > cap)
                              | (got.max(axis=1) * bytes_per_element > cap))
    del sent, got
    present = np.flatnonzero(present)
    subs = np.ones(len(present), dtype=np.int64)
    packed = {}
    # an overfull window's parts: by a scan of the table, or by an index when there are several
    index = _WindowIndex(seg, RoundWindows(window, bases, span, present, np.zeros(1, np.int64))) \
        if len(overfull) > 2 else None
    for w in overfull.tolist():
        part = _clip_to_window(seg, bases, window, w) if index is None else index.window(w)
        order = np.argsort(part.logical, kind="stable")
        part = part.select(order)
        sub = _pack_overfull_windows(np.zeros(len(part), dtype=np.int64), ownership.readers(part.src_rank),
                                     ownership.writers(part.dst_rank), part.length * bytes_per_element,
                                     part.logical, workers, cap)
        packed[w] = (part.logical, sub)
        subs[np.searchsorted(present, w)] = int(sub.max()) + 1
    first_round = np.concatenate(([0], np.cumsum(subs))).astype(np.int64)
    return RoundWindows(window, bases, span, present, first_round, packed)


def cut_at_windows(seg: Segments, windows: RoundWindows) -> Segments:
    """Every segment of an uncut table cut into its window parts, each with its round, sorted by
    `logical`: the whole plan at once, O(all window parts). Workers never build it (they cut
    round by round, `TableWorkerRounds`); tests and array tasks' counts read it."""
    if len(seg) == 0 or windows.window >= NO_WINDOW:
        return seg
    if seg.strided:
        cut, window_index = _split_strided_at_windows(seg, windows.bases[seg.dst_buffer], windows.window)
    else:
        cut, window_index = _split_at_windows(seg, windows.bases[seg.dst_buffer] + seg.dst_offset, windows.window)
    rounds = windows.rounds_of(window_index, cut.logical)
    if len(cut) < 2 or bool((cut.logical[1:] >= cut.logical[:-1]).all()):
        # cutting keeps the logical order (a segment's parts in order, segments sorted)
        return _with_rounds(cut, rounds)
    order = np.argsort(cut.logical, kind="stable")
    return _with_rounds(cut.select(order), rounds[order])


def _pack_overfull_windows(window, sender, receiver, nbytes, logical, workers: int, cap: int) -> np.ndarray:
    """Sub-round of each segment, so that in every (window, sub-round) no worker sends or
    receives more than `cap` bytes.

    Equal windows already bound what each worker receives, unless a worker owns so many
    target ranks that one element each exceeds the budget; a sender may be over budget when
    the windows of many targets come from its ranks. Only windows where either happens are
    packed, segment by segment in logical order, into the first sub-round with room.
    """
    sub = np.zeros(len(window), dtype=np.int64)
    if len(window) == 0:
        return sub
    size = int(window.max()) + 1
    sent = np.bincount(window * workers + sender, weights=nbytes, minlength=size * workers)
    got = np.bincount(window * workers + receiver, weights=nbytes, minlength=size * workers)
    overfull = np.flatnonzero((sent.reshape(size, workers).max(axis=1) > cap)
                              | (got.reshape(size, workers).max(axis=1) > cap))
    for w in overfull:
        members = np.flatnonzero(window == w)
        members = members[np.argsort(logical[members], kind="stable")]
        bins: list[tuple[np.ndarray, np.ndarray]] = []
        for idx in members:
            s, r, n = sender[idx], receiver[idx], nbytes[idx]
            for b, (out, inn) in enumerate(bins):
                if out[s] + n <= cap and inn[r] + n <= cap:
                    break
            else:
                bins.append((np.zeros(workers, np.int64), np.zeros(workers, np.int64)))
                b = len(bins) - 1
            bins[b][0][s] += n
            bins[b][1][r] += n
            sub[idx] = b
    return sub


def blocks_by_peer(seg: Segments, peer: np.ndarray, order: np.ndarray | None = None) -> list["RoundBlock"]:
    """One round's segments of one worker as blocks per peer worker, in the order both ends walk:
    peer, then source rank, buffer and offset (reads sequential in each file); neighbours that
    continue each other in both buffers are joined. Sender and receiver hold the same segments
    of a (sender, receiver) pair, so both arrive at the same blocks. `order`: that sort, when
    the caller has a cheaper way to it."""
    if len(seg) == 0:
        return []
    if order is None:
        order = np.lexsort((seg.src_offset, seg.src_buffer, seg.src_rank, peer))
    if len(order) != len(seg) or not bool((order[1:] > order[:-1]).all()):  # else the identity: no copy
        seg, peer = seg.select(order), peer[order]
    joins = np.zeros(len(seg), dtype=bool)
    end_src, end_dst = seg.end_offsets()
    joins[1:] = ((peer[1:] == peer[:-1]) & (seg.src_rank[1:] == seg.src_rank[:-1])
                 & (seg.src_buffer[1:] == seg.src_buffer[:-1])
                 & (seg.src_offset[1:] == end_src[:-1])
                 & (seg.dst_rank[1:] == seg.dst_rank[:-1]) & (seg.dst_buffer[1:] == seg.dst_buffer[:-1])
                 & (seg.dst_offset[1:] == end_dst[:-1]))
    if seg.strided:  # the same strip geometry, the next element's column too
        joins[1:] &= ((seg.width[1:] == seg.width[:-1]) & (seg.src_stride[1:] == seg.src_stride[:-1])
                      & (seg.dst_stride[1:] == seg.dst_stride[:-1])
                      & (seg.col[1:] == (seg.col[:-1] + seg.length[:-1]) % seg.width[:-1]))
    if joins.any():
        starts = np.flatnonzero(~joins)
        length = np.add.reduceat(seg.length, starts)
        seg = seg.select(starts)
        seg = Segments(*(getattr(seg, c) for c in SEGMENT_COLUMNS[:-2]), length, seg.round, *seg.strides())
        peer = peer[starts]
    bounds = [0, *(np.flatnonzero(np.diff(peer)) + 1).tolist(), len(seg)]
    return [RoundBlock(int(peer[a]), seg.select(slice(a, b))) for a, b in zip(bounds, bounds[1:])]


@dataclass(frozen=True, eq=False)
class SpacePlan:
    """The transfers of one logical space (optimizer state, TP module tensors, ZeRO-3 frozen
    parameters) from its table of uncut segments: O(params + ranks) rows for ZeRO-1/2 (times
    the TP degree for TP layouts). Rounds are windows of that table (`RoundWindows`), cut by
    each worker for itself when the exchange asks for a round. Evenly chunked layouts (ZeRO-3)
    use `reshard.planning.chunked_plan.ChunkedSpacePlan`, which needs no table at all.

    Both kinds answer: `rounds`, `worker_rounds(ownership, worker)` (that worker's blocks per
    round), `round_bytes()` (bytes all workers move per round, for progress and durable
    points), `traffic(ownership)` and `round_buffer_bytes(ownership, worker)`.
    """

    name: str
    streams: tuple[Stream, ...]
    table: Segments
    """Every uncut segment, sorted by `logical` (round column 0)."""
    windows: RoundWindows
    round_offset: int = 0
    """Global number of this space's round 0 (spaces run one after another)."""

    @property
    def rounds(self) -> int:
        return self.windows.rounds

    @property
    def segments(self) -> Segments:
        """Every segment cut at the round windows, with its round: O(all rounds), made on each
        call (`cut_at_windows`); workers use `worker_rounds` instead."""
        return cut_at_windows(self.table, self.windows)

    @property
    def bytes_per_element(self) -> int:
        return sum(s.itemsize for s in self.streams)

    def restricted(self, keep) -> "SpacePlan":
        """The space keeping only the table rows `keep` (an array task's target files), same rounds."""
        return SpacePlan(self.name, self.streams, self.table.select(keep), self.windows, self.round_offset)

    def worker_rounds(self, ownership: Ownership, worker: int) -> "TableWorkerRounds":
        return TableWorkerRounds(self, ownership, worker)

    def round_bytes(self) -> list[int]:
        return [int(x) * self.bytes_per_element for x in self.windows.round_elements(self.table)]

    def traffic(self, ownership: Ownership) -> np.ndarray:
        """(workers, 4) bytes: read, sent to other workers, received from them, written."""
        totals = np.zeros((ownership.workers, 4), dtype=np.int64)
        seg = self.table
        nbytes = seg.length * self.bytes_per_element
        src, dst = ownership.readers(seg.src_rank), ownership.writers(seg.dst_rank)
        remote = src != dst
        totals[:, 0] = np.bincount(src, weights=nbytes, minlength=ownership.workers)
        totals[:, 1] = np.bincount(src[remote], weights=nbytes[remote], minlength=ownership.workers)
        totals[:, 2] = np.bincount(dst[remote], weights=nbytes[remote], minlength=ownership.workers)
        totals[:, 3] = np.bincount(dst, weights=nbytes, minlength=ownership.workers)
        return totals


    def bytes_between_nodes(self, ownership: Ownership, node_of_worker: Sequence[int]) -> int:
        """Bytes of the segments whose reading worker and writing worker sit on different nodes."""
        seg, node = self.table, np.asarray(node_of_worker, dtype=np.int64)
        crossing = node[ownership.readers(seg.src_rank)] != node[ownership.writers(seg.dst_rank)]
        return int(seg.length[crossing].sum()) * self.bytes_per_element


class _WindowIndex:
    """Uncut segments in (target rank, first target position) order, so that the segments with
    elements in one window are found by two binary searches per target rank. Holds the
    segments (not copied) and three integers per segment."""

    def __init__(self, seg: Segments, windows: RoundWindows):
        self.seg, self.windows = seg, windows
        start, end, _ = _target_span(seg, windows.bases)
        key = seg.dst_rank * windows.span
        start += key
        end += key
        del key
        order = np.argsort(start, kind="stable")
        self.order = None if len(order) < 2 or bool((order[1:] > order[:-1]).all()) else order
        if self.order is not None:
            start, end = start[order], end[order]
        del order
        self.key_start = start
        # strided segments of one rank may interleave: the running maximum of ends keeps a
        # sorted key, and a window's candidates start where it first passes the window
        self.key_end = np.maximum.accumulate(end) if len(end) else end
        del end
        self.rank_keys = sorted_distinct(seg.dst_rank) * windows.span

    def window(self, k: int) -> Segments:
        """Every segment's part in window k (`_clip_to_window`), in this index's order."""
        w, span = self.windows.window, self.windows.span
        lo = np.searchsorted(self.key_end, self.rank_keys + min(k * w, span), side="right")
        hi = np.searchsorted(self.key_start, self.rank_keys + min((k + 1) * w, span), side="left")
        counts = np.maximum(hi - lo, 0)
        index = np.repeat(lo - np.cumsum(counts) + counts, counts) + np.arange(int(counts.sum()))
        if self.order is not None:
            index = self.order[index]
        return _clip_to_window(self.seg.select(index), self.windows.bases, w, k)


class TableWorkerRounds:
    """One worker's blocks of a table space, cut round by round on request: the worker keeps
    only the uncut segments it sends or receives (two `_WindowIndex`es), never the whole plan."""

    def __init__(self, space: SpacePlan, ownership: Ownership, worker: int):
        self.space, self.ownership = space, ownership
        seg = space.table
        indexes = []
        for owner in (ownership.readers(seg.src_rank), ownership.writers(seg.dst_rank)):
            mine = owner == worker
            del owner
            if mine.all() and indexes and indexes[0].seg is seg:  # one worker holds the space: one index
                indexes.append(indexes[0])
                continue
            indexes.append(_WindowIndex(seg if mine.all() else seg.select(np.flatnonzero(mine)), space.windows))
        self._indexes = tuple(indexes)

    def blocks(self, local_round: int) -> tuple[list, list]:
        windows, own = self.space.windows, self.ownership
        k, sub = windows.locate(local_round)
        found = []
        for index, sending in zip(self._indexes, (True, False)):
            seg = index.window(k)
            if k in windows.packed:
                seg = seg.select(np.flatnonzero(windows.sub_rounds(k, seg.logical) == sub))
            seg = _with_rounds(seg, local_round)
            peer = own.writers(seg.dst_rank) if sending else own.readers(seg.src_rank)
            # blocks_by_peer's order; ties (one source place sent to several targets) in logical order
            order = np.lexsort((seg.logical, seg.src_offset, seg.src_buffer, seg.src_rank, peer))
            found.append(blocks_by_peer(seg, peer, order))
        return found[0], found[1]

    def largest_round_bytes(self, bytes_per_element: int) -> tuple[int, int]:
        windows = self.space.windows
        send, receive = (int(windows.round_elements(index.seg).max(initial=0)) * bytes_per_element
                         for index in self._indexes)
        return send, receive


def plan_space(name: str, source: PieceTable, target: PieceTable, streams: Sequence[Stream],
               target_buffer_numels: Sequence[int], ownership: Ownership, budget_bytes: int,
               round_offset: int = 0, receiving_ranks: int | None = None) -> SpacePlan:
    """The table space moving `source`'s pieces to `target`'s: its uncut segments and its round
    windows; nobody cuts the rounds here."""
    segments = intersect(source, target)
    del source, target  # freed here when the caller passed them without keeping them
    bpe = sum(s.itemsize for s in streams)
    windows = round_windows(segments, target_buffer_numels, ownership, bpe, budget_bytes, receiving_ranks)
    return SpacePlan(name, tuple(streams), segments, windows, round_offset)


@dataclass(frozen=True)
class WorkerTraffic:
    """What one worker does, in bytes of partitioned state (the dry-run summary)."""

    worker: int
    source_ranks: tuple[int, ...]
    target_ranks: tuple[int, ...]
    bytes_read: int
    bytes_sent: int
    """To other workers (what it reads for itself is not sent over the network)."""
    bytes_received: int
    bytes_written: int


@dataclass(frozen=True, eq=False)
class ReshardPlan:
    """All spaces of a job, run one after another, over one set of workers."""

    ownership: Ownership
    spaces: tuple
    """SpacePlan or ChunkedSpacePlan, in the order they run."""
    budget_bytes: int
    _worker_cache: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def rounds(self) -> int:
        return sum(s.rounds for s in self.spaces)

    def round_bytes(self) -> list[int]:
        """Bytes moved in each global round, by all workers together (the same on every worker)."""
        return [n for space in self.spaces for n in space.round_bytes()]

    def traffic(self) -> list[WorkerTraffic]:
        own = self.ownership
        totals = sum((space.traffic(own) for space in self.spaces), np.zeros((own.workers, 4), dtype=np.int64))
        return [WorkerTraffic(w, tuple(own.source_ranks_of(w)), tuple(own.target_ranks_of(w)), *map(int, totals[w]))
                for w in range(own.workers)]

    def bytes_between_nodes(self, node_of_worker: Sequence[int]) -> int:
        """Bytes that must cross between nodes when worker w runs on node `node_of_worker[w]`: every
        segment read on one node and written on another, once (what reshard.transport.nodes sends)."""
        if len(node_of_worker) != self.ownership.workers:
            raise ValueError(f"{len(node_of_worker)} nodes given for {self.ownership.workers} workers")
        return sum(space.bytes_between_nodes(self.ownership, node_of_worker) for space in self.spaces)

    def worker_view(self, worker: int) -> "WorkerPlan":
        if worker not in self._worker_cache:
            self._worker_cache[worker] = WorkerPlan(self, worker)
        return self._worker_cache[worker]


@dataclass(frozen=True, eq=False)
class RoundBlock:
    """The segments one worker exchanges with one peer in one round, in pack order."""

    peer: int
    segments: Segments

    @property
    def elements(self) -> int:
        return int(self.segments.length.sum())


class WorkerPlan:
    """One worker's sends and receives, per global round, in the order both ends agree on.

    Within a round, a worker's send buffer holds one block per destination worker in worker
    order; within a block, each stream in order; within a stream, segments in source order
    (rank, buffer, offset), so reads are sequential in each file. The receiver walks its
    blocks the same way, so no offsets are exchanged. Blocks are made when a round is asked
    for (`round(r)`), so a worker never holds more than a round or two of them.
    """

    def __init__(self, plan: ReshardPlan, worker: int):
        self.plan, self.worker = plan, worker
        self._spaces = []
        for index, space in enumerate(plan.spaces):
            self._spaces += [(index, space, local) for local in range(space.rounds)]
        self._rounds: dict = {}

    def _space_rounds(self, index: int):
        if index not in self._rounds:
            self._rounds[index] = self.plan.spaces[index].worker_rounds(self.plan.ownership, self.worker)
        return self._rounds[index]

    def round(self, global_round: int) -> tuple[int, list[RoundBlock], list[RoundBlock]]:
        """(space index, blocks sent, blocks received) in `global_round`."""
        index, _, local = self._spaces[global_round]
        sends, receives = self._space_rounds(index).blocks(local)
        return index, sends, receives

    def buffer_bytes(self) -> tuple[int, int]:
        """Bytes of the largest round this worker sends and receives (what its buffers must hold)."""
        send = receive = 0
        for index, space in enumerate(self.plan.spaces):
            if space.rounds:
                s, r = self._space_rounds(index).largest_round_bytes(space.bytes_per_element)
                send, receive = max(send, s), max(receive, r)
        return send, receive
