"""Plans for evenly chunked layouts (ZeRO-3), per worker and by arithmetic: no table of params x ranks.

    from reshard.planning.chunked_plan import ChunkedSide, plan_chunked_space
    space = plan_chunked_space("optim", ChunkedSide.of_zero3(old), ChunkedSide.of_zero3(new), streams,
                               bases, ownership, budget_bytes=1 << 30)
    index, sends, receives = ReshardPlan(ownership, (space,), 1 << 30).worker_view(3).round(0)

Under ZeRO-3 (runtime/zero/partition_parameters.py `_partition_param`) every parameter of n
elements is cut into chunks of c = ceil(n / W) elements and chunk r lives on rank r, at the
same offset of the same flat buffer on every rank. So the owner of any element, on either
side, is one division away, and a worker can enumerate exactly the segments it sends or
receives without anyone building the whole table (params x ranks pieces: 10^5 x 8192 would
be 8 * 10^8 rows).

Rounds are windows of the target ranks' buffers: round k moves, on every target rank, the
elements at buffer positions [k*w, (k+1)*w) (buffers laid end to end). Every worker derives
the same w from global sizes alone, chosen so that no worker sends or receives more than
the round cap (a third of the budget):
- a receiver owns at most ceil(M/W) target ranks, each taking at most w elements a round;
- a sender owns at most ceil(N/W) source ranks; a source chunk of a parameter overlaps at most
  ceil(c_src / c_dst) + 1 target chunks, each of which gives at most its window part.
- and a sender never sends more than the whole round, M windows.
So w = cap / (bytes per element * max(ceil(M/W), min(ceil(N/W) * (max ratio + 1), M))), at
least 1 element: a budget below one element per rank and peer makes rounds larger than the cap.
Rounds are also cut so that none touches more than a bounded number of parameters, which
bounds the segments a worker makes per round (`ROUND_SEGMENTS`).

A round's segments are computed when the exchange asks for that round (in its read-ahead
thread), so a worker holds the segments of about two rounds, never the whole plan.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from reshard.planning.plan import Ownership, Segments, Stream, blocks_by_peer, round_cap


@dataclass(frozen=True, eq=False)
class ChunkedSide:
    """One side (source or target) of a chunked space: per parameter, in logical order."""

    numel: np.ndarray
    buffer: np.ndarray
    """Flat buffer (ZeRO-3 sub-group, or frozen parameter) holding the parameter's chunk on every rank."""
    offset: np.ndarray
    """Element offset of the chunk in that buffer (the same on every rank)."""
    buffer_numels: tuple[int, ...]
    world_size: int

    @property
    def chunk(self) -> np.ndarray:
        return -(-self.numel // self.world_size)

    @classmethod
    def of_zero3(cls, layout) -> "ChunkedSide":
        """The optimizer space of a `reshard.layouts.zero.Zero3Layout` (flat sub-groups)."""
        count = len(layout.params)
        numel = np.asarray([p.numel for p in layout.params], dtype=np.int64)
        buffer, offset = np.zeros(count, np.int64), np.zeros(count, np.int64)
        for sg_id, sg in enumerate(layout.sub_groups):
            ids = np.asarray(sg.params, dtype=np.int64)
            buffer[ids] = sg_id
            offset[ids] = np.concatenate(([0], np.cumsum(sg.chunk_numels)))[:-1]
        numels = tuple(sg.partition_numel for sg in layout.sub_groups)
        return cls(numel, buffer, offset, numels, layout.world_size)

    @classmethod
    def of_frozen(cls, frozen_numels: Sequence[int], world_size: int) -> "ChunkedSide":
        """ZeRO-3 `frozen_param_fragments`: frozen parameter j alone in buffer j."""
        numel = np.asarray(frozen_numels, dtype=np.int64)
        ids = np.arange(len(numel), dtype=np.int64)
        return cls(numel, ids, np.zeros(len(numel), np.int64), tuple((-(-numel // world_size)).tolist()), world_size)


def _held(numel: np.ndarray, chunk: np.ndarray, first: int, stop: int) -> np.ndarray:
    """Real (unpadded) elements of each parameter held by ranks [first, stop)."""
    safe = np.maximum(chunk, 1)
    full, rest = numel // safe, numel % safe
    whole = np.clip(np.minimum(full, stop) - first, 0, None) * chunk
    return whole + np.where((full >= first) & (full < stop), rest, 0)


def _runs(ranks: Sequence[int]) -> list[tuple[int, int]]:
    """Ascending ranks as [first, stop) runs of consecutive ranks."""
    runs: list[list[int]] = []
    for rank in ranks:
        if runs and runs[-1][1] == rank:
            runs[-1][1] = rank + 1
        else:
            runs.append([rank, rank + 1])
    return [(first, stop) for first, stop in runs]


def _held_by(numel: np.ndarray, chunk: np.ndarray, ranks: Sequence[int]) -> int:
    """Real elements of all parameters held by `ranks` (ascending)."""
    return sum(int(_held(numel, chunk, first, stop).sum()) for first, stop in _runs(ranks))


def _expand(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    item = np.repeat(np.arange(len(counts)), counts)
    within = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    return item, within


@dataclass(frozen=True, eq=False)
class ChunkedSpacePlan:
    """The transfers of one chunked space, answered per worker (see the module docstring)."""

    name: str
    streams: tuple[Stream, ...]
    source: ChunkedSide
    target: ChunkedSide
    bases: np.ndarray
    """Logical offset of each parameter (for the segments' `logical` column)."""
    window: int
    """Most target-buffer elements per rank moved in one round (the byte bound)."""
    bounds: np.ndarray
    """Round r moves target-buffer positions [bounds[r], bounds[r + 1]) on every target rank."""
    sender_fanout: int
    """At most this many target chunks overlap one source chunk (max ceil(c_src / c_dst) + 1)."""
    rounds: int
    round_offset: int = 0
    _position: np.ndarray = field(default=None, repr=False)
    """Start of each parameter's chunk in the target buffers laid end to end, ascending."""
    _order: np.ndarray = field(default=None, repr=False)

    @property
    def bytes_per_element(self) -> int:
        return sum(s.itemsize for s in self.streams)

    def _window_params(self, local_round: int):
        """Parameters with target elements in round `local_round`, and the [a, e) part of their chunk."""
        lo, hi = int(self.bounds[local_round]), int(self.bounds[local_round + 1])
        pos, order = self._position, self._order
        chunk = self.target.chunk[order]
        first = np.searchsorted(pos + chunk, lo, side="right")
        last = np.searchsorted(pos, hi, side="left")
        ids = order[first:last]
        start = pos[first:last]
        a = np.maximum(lo - start, 0)
        e = np.minimum(chunk[first:last], hi - start)
        keep = e > a
        return ids[keep], a[keep], e[keep]

    def round_bytes(self) -> list[int]:
        """Exact bytes all workers move per round: at within-chunk offset x, ceil((n - x) / c) ranks
        hold a real element of a parameter, so a window part [a, e) holds q*(e-a) + overlap with
        [0, n mod c) elements, q = n // c."""
        totals = []
        numel, chunk = self.target.numel, self.target.chunk
        for r in range(self.rounds):
            ids, a, e = self._window_params(r)
            q, rem = numel[ids] // np.maximum(chunk[ids], 1), numel[ids] % np.maximum(chunk[ids], 1)
            count = q * (e - a) + np.clip(np.minimum(e, rem) - a, 0, None)
            totals.append(int(count.sum()) * self.bytes_per_element)
        return totals

    def traffic(self, ownership: Ownership) -> np.ndarray:
        """(workers, 4) bytes: read, sent to other workers, received from them, written; O(workers x params)."""
        totals = np.zeros((ownership.workers, 4), dtype=np.int64)
        n = self.source.numel
        cs, cd = self.source.chunk, self.target.chunk
        bpe = self.bytes_per_element
        for worker in range(ownership.workers):
            sources, targets = ownership.source_ranks_of(worker), ownership.target_ranks_of(worker)
            read = _held_by(n, cs, sources)
            written = _held_by(n, cd, targets)
            local = 0
            for s_first, s_stop in _runs(sources):
                for t_first, t_stop in _runs(targets):
                    lo = np.maximum(s_first * cs, t_first * cd)
                    hi = np.minimum(np.minimum(s_stop * cs, t_stop * cd), n)
                    local += int(np.clip(hi - lo, 0, None).sum())
            totals[worker] = (read * bpe, (read - local) * bpe, (written - local) * bpe, written * bpe)
        return totals

    def bytes_between_nodes(self, ownership: Ownership, node_of_worker: Sequence[int]) -> int:
        """Bytes whose reading worker and writing worker sit on different nodes: every real target
        element crosses unless its source chunk is read on the node that writes it."""
        node_of_worker = np.asarray(node_of_worker, dtype=np.int64)
        n, cs, cd = self.source.numel, self.source.chunk, self.target.chunk
        crossing = 0
        for node in np.unique(node_of_worker).tolist():
            workers = np.flatnonzero(node_of_worker == node).tolist()
            sources = sorted(r for w in workers for r in ownership.source_ranks_of(w))
            targets = sorted(r for w in workers for r in ownership.target_ranks_of(w))
            within = 0
            for s_first, s_stop in _runs(sources):
                for t_first, t_stop in _runs(targets):
                    lo = np.maximum(s_first * cs, t_first * cd)
                    hi = np.minimum(np.minimum(s_stop * cs, t_stop * cd), n)
                    within += int(np.clip(hi - lo, 0, None).sum())
            crossing += _held_by(n, cd, targets) - within
        return crossing * self.bytes_per_element

    def worker_rounds(self, ownership: Ownership, worker: int) -> "ChunkedWorkerRounds":
        return ChunkedWorkerRounds(self, ownership, worker)

    def segments_received(self, target_ranks: Sequence[int], local_round: int) -> Segments:
        """Every segment landing on `target_ranks` in the round, cut at source chunk boundaries."""
        ids, a, e = self._window_params(local_round)
        count = len(target_ranks)
        n, cs, cd = self.source.numel[ids], self.source.chunk[ids], self.target.chunk[ids]
        t = np.repeat(np.asarray(target_ranks, dtype=np.int64), len(ids))
        q = np.tile(np.arange(len(ids)), count)  # index into the window's parameters
        base = t * cd[q]
        lo, hi = base + a[q], np.minimum(base + e[q], n[q])
        keep = np.flatnonzero(lo < hi)
        t, q, lo, hi = t[keep], q[keep], lo[keep], hi[keep]
        c = cs[q]
        first = lo // c
        item, within = _expand((hi - 1) // c - first + 1)
        s = first[item] + within
        q, c = q[item], c[item]
        return self._segments(ids, q, s, t[item], np.maximum(lo[item], s * c), np.minimum(hi[item], (s + 1) * c))

    def segments_sent(self, source_ranks: Sequence[int], local_round: int) -> Segments:
        """Every segment read from `source_ranks` in the round, cut at target chunk boundaries."""
        ids, a, e = self._window_params(local_round)
        count = len(source_ranks)
        n, cs, cd = self.source.numel[ids], self.source.chunk[ids], self.target.chunk[ids]
        s = np.repeat(np.asarray(source_ranks, dtype=np.int64), len(ids))
        q = np.tile(np.arange(len(ids)), count)
        slo = s * cs[q]
        shi = np.minimum(slo + cs[q], n[q])
        keep = np.flatnonzero(slo < shi)
        s, q, slo, shi = s[keep], q[keep], slo[keep], shi[keep]
        c = cd[q]
        first = slo // c
        item, within = _expand((shi - 1) // c - first + 1)
        t = first[item] + within
        q, c = q[item], c[item]
        base = t * c
        lo = np.maximum(slo[item], base + a[q])
        hi = np.minimum(shi[item], base + e[q])
        keep = np.flatnonzero(lo < hi)
        return self._segments(ids, q[keep], s[item][keep], t[keep], lo[keep], hi[keep])

    def _segments(self, ids, q, s, t, lo, hi) -> Segments:
        """Segments of elements [lo, hi) of parameter ids[q] (parameter-local), from rank s to rank t."""
        src, dst = self.source, self.target
        p = ids[q]
        return Segments(self.bases[p] + lo, s, src.buffer[p], src.offset[p] + lo - s * src.chunk[p], t,
                        dst.buffer[p], dst.offset[p] + lo - t * dst.chunk[p], hi - lo,
                        np.zeros(len(p), dtype=np.int64))

    def source_key(self, seg: Segments) -> np.ndarray:
        """(source rank, buffer, offset) as one sortable number: the rank's buffers laid end to end."""
        starts = np.concatenate(([0], np.cumsum(np.asarray(self.source.buffer_numels, dtype=np.int64))))
        return seg.src_rank * int(starts[-1]) + starts[seg.src_buffer] + seg.src_offset


@dataclass(eq=False)
class ChunkedWorkerRounds:
    """One worker's blocks of a chunked space, made round by round on request."""

    space: ChunkedSpacePlan
    ownership: Ownership
    worker: int

    def blocks(self, local_round: int) -> tuple[list, list]:
        own, space = self.ownership, self.space
        sources, targets = own.source_ranks_of(self.worker), own.target_ranks_of(self.worker)
        sends = receives = []
        if sources:
            seg = space.segments_sent(sources, local_round)
            peer = own.writers(seg.dst_rank)
            sends = blocks_by_peer(seg, peer, np.lexsort((space.source_key(seg), peer)))
        if targets:
            seg = space.segments_received(targets, local_round)
            peer = own.readers(seg.src_rank)
            # When the reader grows with the source rank, sorting by source position sorts by peer too.
            order = np.argsort(space.source_key(seg)) if own.ascending else np.lexsort((space.source_key(seg), peer))
            receives = blocks_by_peer(seg, peer, order)
        return sends, receives

    def largest_round_bytes(self, bytes_per_element: int) -> tuple[int, int]:
        """Bounds from the window rule (see the module docstring), no larger than all this worker moves."""
        own, space = self.ownership, self.space
        sources, targets = own.source_ranks_of(self.worker), own.target_ranks_of(self.worker)
        n = space.source.numel
        read = _held_by(n, space.source.chunk, sources)
        written = _held_by(n, space.target.chunk, targets)
        send = min(read, min(len(sources) * space.sender_fanout, own.target_ranks) * space.window)
        receive = min(written, len(targets) * space.window)
        return send * bytes_per_element, receive * bytes_per_element


ROUND_SEGMENTS = 1 << 20
"""Most segments a worker sends, and receives, in one round (~72 bytes each while the round is
made): what bounds plan memory when chunks are tiny (10^5 parameters over 8192 ranks)."""


def plan_chunked_space(name: str, source: ChunkedSide, target: ChunkedSide, streams: Sequence[Stream],
                       bases: np.ndarray, ownership: Ownership, budget_bytes: int, round_offset: int = 0,
                       round_segments: int = ROUND_SEGMENTS) -> ChunkedSpacePlan:
    """The chunked space's rounds, from global sizes only (O(params)).

    Rounds cut the target positions at every multiple of the window (bytes) and at the start
    of every k-th parameter chunk (segments): a round then touches at most k + 1 parameters,
    and each parameter gives a worker at most (its ranks) x (chunks one chunk overlaps) segments.
    """
    if not np.array_equal(source.numel, target.numel):
        raise ValueError("source and target describe different parameters")
    bpe = sum(s.itemsize for s in streams)
    real = source.numel > 0
    ratio = -(-source.chunk[real] // np.maximum(target.chunk[real], 1))
    fanout = int(ratio.max()) + 1 if real.any() else 1
    fan_in = int((-(-target.chunk[real] // np.maximum(source.chunk[real], 1))).max()) + 1 if real.any() else 1
    sources_per_worker = ownership.max_source_ranks_per_worker
    targets_per_worker = ownership.max_target_ranks_per_worker
    # A sender never sends more than the whole round: one window on each of the M target ranks.
    per_worker = max(targets_per_worker, min(sources_per_worker * fanout, ownership.target_ranks))
    cap = max(round_cap(budget_bytes), bpe, 1)
    window = max(1, cap // (max(bpe, 1) * per_worker))
    starts = np.concatenate(([0], np.cumsum(np.asarray(target.buffer_numels, dtype=np.int64))))
    position = starts[target.buffer] + target.offset if len(target.numel) else np.zeros(0, np.int64)
    position = np.where(real, position, np.iinfo(np.int64).max // 4)  # empty parameters take part in no round
    order = np.argsort(position, kind="stable")
    order = order[real[order]]
    total = int(starts[-1])
    if not (bpe and total and real.any()):
        bounds = np.zeros(1, dtype=np.int64)
    else:
        segments_per_param = max(targets_per_worker * fan_in,
                                 min(sources_per_worker * fanout, ownership.target_ranks * fan_in))
        params_per_round = max(1, round_segments // segments_per_param - 1)
        cuts = np.concatenate((np.arange(0, total, window, dtype=np.int64), position[order][::params_per_round],
                               [total]))
        bounds = np.unique(cuts)
    return ChunkedSpacePlan(name, tuple(streams), source, target, np.asarray(bases, dtype=np.int64), window=window,
                            bounds=bounds, sender_fanout=fanout, rounds=len(bounds) - 1, round_offset=round_offset,
                            _position=position[order], _order=order)

