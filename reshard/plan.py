"""The reshard plan, pure and deterministic: who reads, who writes, what moves, in which round.

    from reshard.plan import Stream, plan_space, Ownership
    own = Ownership(source_ranks=2, target_ranks=3, workers=2)
    space = plan_space("optimizer", src_layout.pieces, dst_layout.pieces,
                       streams=(Stream("fp32", "float32", 4),), target_buffer_numels=(80,),
                       ownership=own, budget_bytes=1 << 20)
    space.segments.length.sum()   # every element of the space, exactly once

Every worker computes the same plan from the same inputs (no I/O, no randomness), so
workers agree on every transfer without exchanging the plan. A *segment* is a run of
elements that is contiguous in one source buffer and in one target buffer; every stream of
the space (fp32 weights, exp_avg, ...) moves along the same segments. Segments come from
intersecting the two layouts' sorted piece tables: O(pieces), vectorised.

Rounds bound memory: in one round a worker sends at most a third of the budget and receives
at most a third. The exchange reads the next round while the current one is in flight, so a
worker holds two send buffers and one receive buffer: never more than the budget. Rounds cut
the target ranks' buffers into equal windows, so every worker receives an equal share in
every round; a round whose senders turn out unbalanced is split further for those senders.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from reshard.layout import PieceTable

SEGMENT_COLUMNS = ("logical", "src_rank", "src_buffer", "src_offset", "dst_rank", "dst_buffer",
                   "dst_offset", "length", "round")


@dataclass(frozen=True)
class Stream:
    """A tensor kept per flat buffer that moves with the buffer's coordinates."""

    name: str
    """Key of the tensor: "fp32" for master weights, else the optimizer state key."""
    dtype: str
    """torch dtype name without the "torch." prefix, the same in source and target."""
    itemsize: int


@dataclass(frozen=True)
class Ownership:
    """Which worker reads each source rank's files and writes each target rank's files.

    Contiguous blocks: ranks are spread as evenly as possible, and worker 0 always owns
    source rank 0 and target rank 0 (it also reads the metadata and writes the shared
    model-states file).
    """

    source_ranks: int
    target_ranks: int
    workers: int

    def reader(self, source_rank):
        return source_rank * self.workers // self.source_ranks

    def writer(self, target_rank):
        return target_rank * self.workers // self.target_ranks

    def source_ranks_of(self, worker: int) -> list[int]:
        return [r for r in range(self.source_ranks) if self.reader(r) == worker]

    def target_ranks_of(self, worker: int) -> list[int]:
        return [r for r in range(self.target_ranks) if self.writer(r) == worker]

    @property
    def max_target_ranks_per_worker(self) -> int:
        return -(-self.target_ranks // self.workers)


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

    def __len__(self) -> int:
        return len(self.logical)

    def select(self, index) -> "Segments":
        return Segments(*(getattr(self, c)[index] for c in SEGMENT_COLUMNS))


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
    cols = dict(logical=bounds, src_rank=source.rank[i], src_buffer=source.buffer[i],
                src_offset=source.offset[i] + bounds - source.start[i], dst_rank=target.rank[j],
                dst_buffer=target.buffer[j], dst_offset=target.offset[j] + bounds - target.start[j],
                length=length)
    return _merge_contiguous(cols)


def _sorted_union(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Sorted distinct values of a and b (np.union1d hashes on numpy 2; sorting is ~10x faster here)."""
    merged = np.concatenate((a, b))
    merged.sort(kind="stable")
    keep = np.ones(len(merged), dtype=bool)
    keep[1:] = merged[1:] != merged[:-1]
    return merged[keep]


def _dense_ranks(values: np.ndarray) -> np.ndarray:
    """0, 1, 2... in the sorted order of the distinct values (np.unique's inverse, by sorting)."""
    order = np.argsort(values, kind="stable")
    ranks = np.empty(len(values), dtype=np.int64)
    ranks[order] = np.concatenate(([0], np.cumsum(np.diff(values[order]) != 0)))
    return ranks


def _merge_contiguous(cols: dict) -> Segments:
    """Join neighbours that continue each other in both buffers (e.g. adjacent parameters)."""
    n = len(cols["logical"])
    new_run = np.ones(n, dtype=bool)
    if n > 1:
        end_src = cols["src_offset"][:-1] + cols["length"][:-1]
        end_dst = cols["dst_offset"][:-1] + cols["length"][:-1]
        continues = ((cols["src_rank"][1:] == cols["src_rank"][:-1])
                     & (cols["src_buffer"][1:] == cols["src_buffer"][:-1])
                     & (cols["src_offset"][1:] == end_src)
                     & (cols["dst_rank"][1:] == cols["dst_rank"][:-1])
                     & (cols["dst_buffer"][1:] == cols["dst_buffer"][:-1])
                     & (cols["dst_offset"][1:] == end_dst))
        new_run[1:] = ~continues
    starts = np.flatnonzero(new_run)
    merged = {k: v[starts] for k, v in cols.items() if k != "length"}
    merged["length"] = np.add.reduceat(cols["length"], starts) if n else cols["length"]
    return Segments(**merged, round=np.zeros(len(starts), dtype=np.int64))


ROUND_BYTES_MAX = 64 << 20
"""Bytes a worker sends (or receives) in one round at most, whatever the budget: smaller rounds
start the read-ahead pipeline sooner and touch fewer fresh buffer pages (bench/ladder.py, 1 GB
ZeRO-2 on 2 shared cores: exchange+write 6-11 s with 64-192 MiB budgets, 13-18 s with 1 GiB)."""


def round_cap(budget_bytes: int) -> int:
    """Bytes a worker may send, and may receive, in one round: a third of the budget (two send
    buffers, one being filled while the other is in flight, and one receive buffer), at most
    ROUND_BYTES_MAX."""
    return min(budget_bytes // 3, ROUND_BYTES_MAX)


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


def assign_rounds(seg: Segments, target_buffer_numels: Sequence[int], ownership: Ownership,
                  bytes_per_element: int, budget_bytes: int) -> Segments:
    """Cut segments into rounds in which no worker sends or receives more than `round_cap(budget)` bytes."""
    if len(seg) == 0:
        return seg
    cap = max(round_cap(budget_bytes), bytes_per_element)
    window = max(1, cap // (bytes_per_element * ownership.max_target_ranks_per_worker))
    bases = np.concatenate(([0], np.cumsum(np.asarray(target_buffer_numels, dtype=np.int64))))[:-1]
    position = bases[seg.dst_buffer] + seg.dst_offset
    cut, window_index = _split_at_windows(seg, position, window)
    readers = np.asarray([ownership.reader(r) for r in range(ownership.source_ranks)])
    writers = np.asarray([ownership.writer(r) for r in range(ownership.target_ranks)])
    sender, receiver = readers[cut.src_rank], writers[cut.dst_rank]
    nbytes = cut.length * bytes_per_element
    sub = _pack_overfull_windows(window_index, sender, receiver, nbytes, cut.logical, ownership.workers, cap)
    rounds = _dense_ranks(window_index * (int(sub.max()) + 1) + sub)
    order = np.argsort(cut.logical, kind="stable")
    result = cut.select(order)
    return Segments(*(getattr(result, c) for c in SEGMENT_COLUMNS[:-1]), rounds[order].astype(np.int64))


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


@dataclass(frozen=True, eq=False)
class SpacePlan:
    """The transfers of one logical space (optimizer state, or ZeRO-3 frozen parameters)."""

    name: str
    streams: tuple[Stream, ...]
    segments: Segments
    rounds: int
    round_offset: int = 0
    """Global number of this space's round 0 (spaces run one after another)."""

    @property
    def bytes_per_element(self) -> int:
        return sum(s.itemsize for s in self.streams)


def plan_space(name: str, source: PieceTable, target: PieceTable, streams: Sequence[Stream],
               target_buffer_numels: Sequence[int], ownership: Ownership, budget_bytes: int,
               round_offset: int = 0) -> SpacePlan:
    segments = intersect(source, target)
    bpe = sum(s.itemsize for s in streams)
    segments = assign_rounds(segments, target_buffer_numels, ownership, bpe, budget_bytes) if bpe else segments
    rounds = int(segments.round.max()) + 1 if len(segments) else 0
    return SpacePlan(name, tuple(streams), segments, rounds, round_offset)


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
    spaces: tuple[SpacePlan, ...]
    budget_bytes: int
    _worker_cache: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def rounds(self) -> int:
        return sum(s.rounds for s in self.spaces)

    def traffic(self) -> list[WorkerTraffic]:
        own = self.ownership
        totals = np.zeros((own.workers, 4), dtype=np.int64)
        readers = np.asarray([own.reader(r) for r in range(own.source_ranks)])
        writers = np.asarray([own.writer(r) for r in range(own.target_ranks)])
        for space in self.spaces:
            seg = space.segments
            nbytes = seg.length * space.bytes_per_element
            src, dst = readers[seg.src_rank], writers[seg.dst_rank]
            remote = src != dst
            totals[:, 0] += np.bincount(src, weights=nbytes, minlength=own.workers).astype(np.int64)
            totals[:, 1] += np.bincount(src[remote], weights=nbytes[remote], minlength=own.workers).astype(np.int64)
            totals[:, 2] += np.bincount(dst[remote], weights=nbytes[remote], minlength=own.workers).astype(np.int64)
            totals[:, 3] += np.bincount(dst, weights=nbytes, minlength=own.workers).astype(np.int64)
        return [WorkerTraffic(w, tuple(own.source_ranks_of(w)), tuple(own.target_ranks_of(w)), *map(int, totals[w]))
                for w in range(own.workers)]

    def worker_view(self, worker: int) -> "WorkerPlan":
        if worker not in self._worker_cache:
            self._worker_cache[worker] = WorkerPlan.build(self, worker)
        return self._worker_cache[worker]


@dataclass(frozen=True, eq=False)
class RoundBlock:
    """The segments one worker exchanges with one peer in one round, in pack order."""

    peer: int
    segments: Segments

    @property
    def elements(self) -> int:
        return int(self.segments.length.sum())


@dataclass(frozen=True, eq=False)
class WorkerPlan:
    """One worker's sends and receives, per global round, in the order both ends agree on.

    Within a round, a worker's send buffer holds one block per destination worker in worker
    order; within a block, each stream in order; within a stream, segments in source order
    (rank, buffer, offset), so reads are sequential in each file. The receiver walks its
    blocks the same way, so no offsets are exchanged.
    """

    worker: int
    sends: dict
    """global round -> (space index, [RoundBlock per destination worker with data])"""
    receives: dict

    @classmethod
    def build(cls, plan: ReshardPlan, worker: int) -> "WorkerPlan":
        own = plan.ownership
        readers = np.asarray([own.reader(r) for r in range(own.source_ranks)])
        writers = np.asarray([own.writer(r) for r in range(own.target_ranks)])
        sends, receives = {}, {}
        for space_index, space in enumerate(plan.spaces):
            seg = space.segments
            src, dst = readers[seg.src_rank], writers[seg.dst_rank]
            for mine, peer_of, table in ((src == worker, dst, sends), (dst == worker, src, receives)):
                chosen = np.flatnonzero(mine)
                order = chosen[np.lexsort((seg.src_offset[chosen], seg.src_buffer[chosen], seg.src_rank[chosen],
                                           peer_of[chosen], seg.round[chosen]))]
                rounds, peers = seg.round[order], peer_of[order]
                boundaries = np.flatnonzero(np.diff(rounds * own.workers + peers)) + 1
                for block in np.split(order, boundaries) if len(order) else []:
                    r = int(seg.round[block[0]]) + space.round_offset
                    table.setdefault(r, (space_index, []))[1].append(
                        RoundBlock(int(peer_of[block[0]]), seg.select(block)))
        return cls(worker, sends, receives)
