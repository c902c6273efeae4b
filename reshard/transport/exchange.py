"""Runs a plan's rounds: read slices, all-to-all them between workers, write them in place.

    from reshard.transport.exchange import run_rounds
    run_rounds(plan, transport, reader, writer, on_round=progress.update)

Every worker calls `run_rounds` with the same plan; each round is one collective, so all
workers step through the rounds together. In a round a worker packs what it sends into one
byte buffer (block per destination worker; per stream; segments in source order), and
unpacks what it receives walking its own blocks the same way: the plan is the protocol.
Runs of segments contiguous in a file become a single pread or pwrite; a strided segment (a
row-parallel shard) is walked row by row on each side. Source bytes packed more than once (a
replicated TP parameter, one copy per target TP rank) are read once and copied from where this
round or the previous one already packed them (`reshard.transport.read_once`).

A reader thread fills the send buffer of the next round while the current round is in
flight and being written, so disk reads overlap the exchange and the writes; it hands the
source the whole round's reads at once (`SliceSource.read_batch`), which keeps several in
flight. Buffers are allocated once: two send buffers and one receive buffer, each at most a
third of the memory budget (`reshard.planning.plan.round_cap`).

A worker that fails mid-round still takes part in that round's collective (sending zeros)
and then reports; every worker sees the failure at the same round boundary and stops, so
nobody hangs and nothing is declared complete.
"""
from __future__ import annotations

import queue
import threading
from typing import Callable

import numpy as np

from reshard.transport.collective import check_peers
from reshard.transport.failpoints import failpoint
from reshard.planning.plan import ReshardPlan, RoundBlock, round_cap
from reshard.transport.read_once import reads_and_copies
from reshard.layouts.strided_runs import row_runs


def _runs(rank: np.ndarray, buffer: np.ndarray, offset: np.ndarray, length: np.ndarray) -> list[tuple[int, int]]:
    """[start, stop) index ranges of consecutive segments that continue each other in one buffer."""
    if len(rank) == 0:
        return []
    breaks = np.ones(len(rank), dtype=bool)
    breaks[1:] = (rank[1:] != rank[:-1]) | (buffer[1:] != buffer[:-1]) | (offset[1:] != offset[:-1] + length[:-1])
    starts = np.flatnonzero(breaks)
    return list(zip(starts.tolist(), np.append(starts[1:], len(rank)).tolist()))


def _side(seg, side: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(rank, buffer, offset, length) of the contiguous pieces of `side` ("src" or "dst") of
    segments, in the segments' element order: a strided segment gives one piece per row it
    touches on that side (`reshard.layouts.strided_runs.row_runs`)."""
    rank, buffer, offset = (seg.src_rank, seg.src_buffer, seg.src_offset) if side == "src" else \
        (seg.dst_rank, seg.dst_buffer, seg.dst_offset)
    if not seg.strided:
        return rank, buffer, offset, seg.length
    stride = seg.src_stride if side == "src" else seg.dst_stride
    item, _, offset, length = row_runs(offset, seg.col, seg.width, stride, seg.length)
    return rank[item], buffer[item], offset, length


def _walk(blocks: list[RoundBlock], space, side: str):
    """Yield (byte position in the packed buffer, rank, slot, first element, elements, itemsize) per run."""
    position = 0
    for block in blocks:
        rank, buffer, offset, length = _side(block.segments, side)
        runs = _runs(rank, buffer, offset, length)
        if not runs:
            continue
        starts = np.array([start for start, _ in runs])
        # one vectorised pass instead of a numpy sum per run (a tp change has tens of thousands)
        counts, firsts = np.add.reduceat(length, starts).tolist(), offset[starts].tolist()
        ranks, buffers = rank[starts].tolist(), buffer[starts].tolist()
        for stream in space.streams:
            for i in range(len(runs)):
                count = counts[i]
                yield position, ranks[i], (space.name, buffers[i], stream.name), firsts[i], count, stream.itemsize
                position += count * stream.itemsize


def _write_received(writer, receives: list[RoundBlock], space, incoming: memoryview) -> None:
    """Write a round's received runs. Where the sink takes gathered writes (`write_gather`), the
    runs are sorted by place and those that continue each other, from any peer, go in one call:
    a tp change cuts a row-parallel weight into one run per row and block, and the rows of the
    blocks interleave in the target. The bytes and where they land are the same either way."""
    runs = _walk(receives, space, "dst")
    gather = getattr(writer, "write_gather", None)
    if gather is None:
        for position, rank, slot, element, count, itemsize in runs:
            writer.write(rank, slot, element, itemsize, incoming[position:position + count * itemsize])
        return
    ordered = sorted(runs, key=lambda run: (run[1], run[2], run[3]))
    i = 0
    while i < len(ordered):
        _, rank, slot, element, _, itemsize = ordered[i]
        end, pieces = element, []
        while i < len(ordered) and ordered[i][1] == rank and ordered[i][2] == slot and ordered[i][3] == end:
            position, count = ordered[i][0], ordered[i][4]
            pieces.append(incoming[position:position + count * itemsize])
            end += count
            i += 1
        gather(rank, slot, element, itemsize, pieces)


def _counts(blocks: list[RoundBlock], workers: int, bytes_per_element: int) -> list[int]:
    counts = [0] * workers
    for block in blocks:
        counts[block.peer] = block.elements * bytes_per_element
    return counts


class _RoundReader:
    """Makes each round's blocks and fills its send buffer ahead of the collective, in a thread."""

    def __init__(self, plan: ReshardPlan, view, rounds: range, reader, size: int, buffers: list | None = None):
        self.plan, self.view, self.rounds, self.reader = plan, view, rounds, reader
        self.free: queue.Queue = queue.Queue()
        for buffer in buffers or [np.empty(size, dtype=np.uint8) for _ in range(2)]:
            self.free.put(buffer)
        self.ready: queue.Queue = queue.Queue()
        self.last: tuple = (None, [])
        """(buffer, runs) of the round filled last: intact while this one fills, as the reader
        takes one buffer at a time and the collective only reads a send buffer"""
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._fill, name="reshard-reader", daemon=True)
        self.thread.start()

    def _fill(self) -> None:
        workers = self.plan.ownership.workers
        for r in self.rounds:
            buffer = None
            while buffer is None:
                if self.stop.is_set():
                    return
                try:
                    buffer = self.free.get(timeout=0.5)
                except queue.Empty:
                    continue
            failure, space, sends, receives = None, None, [], []
            send_counts = recv_counts = [0] * workers
            try:
                index, sends, receives = self.view.round(r)
                space = self.plan.spaces[index]
                send_counts = _counts(sends, workers, space.bytes_per_element)
                recv_counts = _counts(receives, workers, space.bytes_per_element)
                if sum(send_counts) > len(buffer):
                    raise AssertionError(f"round {r} sends {sum(send_counts)} bytes, buffers hold {len(buffer)}")
                runs = list(_walk(sends, space, "src"))
                last_buffer, last_runs = self.last if self.last[0] is not buffer else (None, [])
                reads, copies = reads_and_copies(runs, last_runs)
                memory = memoryview(buffer)
                self.reader.read_batch([(rank, slot, element, itemsize, memory[position:position + count * itemsize])
                                        for position, rank, slot, element, count, itemsize in reads])
                del memory
                for to, start, nbytes, from_last in copies:  # replicated copies: bytes already packed
                    buffer[to:to + nbytes] = (last_buffer if from_last else buffer)[start:start + nbytes]
                self.last = (buffer, runs)
            except Exception as error:  # reported after the collective, so peers do not hang
                failure = error
                self.last = (None, [])
                buffer[:sum(send_counts)] = 0
            self.ready.put((r, buffer, failure, space, receives, send_counts, recv_counts))

    def next(self):
        return self.ready.get()

    def recycle(self, buffer: np.ndarray) -> None:
        self.free.put(buffer)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=30)


def run_rounds(plan: ReshardPlan, transport, reader, writer, *, start_round: int = 0,
               durable_every_bytes: int = 0, on_durable: Callable[[int], None] | None = None,
               on_round: Callable[[int, int], None] | None = None) -> None:
    """Move every segment of `plan` from round `start_round` on.

    Each time `durable_every_bytes` have moved (all workers together), and after the last
    round, each worker fsyncs what it wrote before the round's agreement, then
    `on_durable(rounds done)` runs: a resume can start there. `on_round(round, bytes moved by
    all workers)` runs after every round.
    """
    view = plan.worker_view(transport.rank)
    moved_per_round = plan.round_bytes()
    if start_round >= plan.rounds:
        return
    largest_send, largest_receive = view.buffer_bytes()
    incoming_buffer = np.empty(largest_receive, dtype=np.uint8)
    shared = getattr(transport, "send_buffers", None)  # the forked transport's: packed where peers read
    bound_staging = getattr(transport, "bound_staging", None)  # node leaders (reshard.transport.nodes)
    if bound_staging is not None:  # hold a round's cross-node bytes in pieces, under the budget
        bound_staging(round_cap(plan.budget_bytes))
    ahead = _RoundReader(plan, view, range(start_round, plan.rounds), reader, largest_send,
                         shared(2, largest_send) if shared is not None else None)
    since_durable = 0
    try:
        for r in range(start_round, plan.rounds):
            ready_round, packed, failure, space, receives, send_counts, recv_counts = ahead.next()
            assert ready_round == r
            failpoint("kill", round=r, worker=transport.rank)
            failpoint("stall", round=r, worker=transport.rank)
            out = incoming_buffer[:sum(recv_counts)]
            received = transport.all_to_all(packed[:sum(send_counts)], send_counts, recv_counts, out=out)
            ahead.recycle(packed)
            since_durable += moved_per_round[r]
            durable = durable_every_bytes > 0 and (since_durable >= durable_every_bytes or r == plan.rounds - 1)
            if failure is None:
                try:
                    incoming = memoryview(received)
                    _write_received(writer, receives, space, incoming)
                    del incoming
                    if durable:
                        writer.sync()
                except Exception as error:
                    failure = error
            del received, out
            check_peers(transport, failure, f"round {r + 1} of {plan.rounds}")
            if durable:
                since_durable = 0
                if on_durable is not None:
                    on_durable(r + 1)
            if on_round is not None:
                on_round(r, moved_per_round[r])
    finally:
        ahead.close()


def round_bytes(plan: ReshardPlan) -> list[int]:
    """Bytes moved in each global round, by all workers together."""
    return plan.round_bytes()
