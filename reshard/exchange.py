"""Runs a plan's rounds: read slices, all-to-all them between workers, write them in place.

    from reshard.exchange import run_rounds
    run_rounds(plan, transport, reader, writer, on_round=progress.update)

Every worker calls `run_rounds` with the same plan; each round is one collective, so all
workers step through the rounds together. In a round a worker packs what it sends into one
byte buffer (block per destination worker; per stream; segments in source order), and
unpacks what it receives walking its own blocks the same way: the plan is the protocol.
Runs of segments contiguous in a file become a single pread or pwrite.

A reader thread fills the send buffer of the next round while the current round is in
flight and being written, so disk reads overlap the exchange and the writes. Buffers are
allocated once: two send buffers and one receive buffer, each at most a third of the memory
budget (`reshard.plan.round_cap`).

A worker that fails mid-round still takes part in that round's collective (sending zeros)
and then reports; every worker sees the failure at the same round boundary and stops, so
nobody hangs and nothing is declared complete.
"""
from __future__ import annotations

import queue
import threading
from typing import Callable

import numpy as np
import torch

from reshard.collective import check_peers
from reshard.failpoints import failpoint
from reshard.plan import ReshardPlan, RoundBlock, SpacePlan


def _runs(rank: np.ndarray, buffer: np.ndarray, offset: np.ndarray, length: np.ndarray) -> list[tuple[int, int]]:
    """[start, stop) index ranges of consecutive segments that continue each other in one buffer."""
    if len(rank) == 0:
        return []
    breaks = np.ones(len(rank), dtype=bool)
    breaks[1:] = (rank[1:] != rank[:-1]) | (buffer[1:] != buffer[:-1]) | (offset[1:] != offset[:-1] + length[:-1])
    starts = np.flatnonzero(breaks)
    return list(zip(starts.tolist(), np.append(starts[1:], len(rank)).tolist()))


def _walk(blocks: list[RoundBlock], space: SpacePlan, side: str):
    """Yield (byte position in the packed buffer, rank, slot, first element, elements, itemsize) per run."""
    position = 0
    for block in blocks:
        seg = block.segments
        rank, buffer, offset = (seg.src_rank, seg.src_buffer, seg.src_offset) if side == "src" else \
            (seg.dst_rank, seg.dst_buffer, seg.dst_offset)
        runs = _runs(rank, buffer, offset, seg.length)
        for stream in space.streams:
            for start, stop in runs:
                count = int(seg.length[start:stop].sum())
                slot = (space.name, int(buffer[start]), stream.name)
                yield position, int(rank[start]), slot, int(offset[start]), count, stream.itemsize
                position += count * stream.itemsize


def _counts(blocks: list[RoundBlock], workers: int, bytes_per_element: int) -> list[int]:
    counts = [0] * workers
    for block in blocks:
        counts[block.peer] = block.elements * bytes_per_element
    return counts


class _RoundReader:
    """Fills send buffers ahead of the collective, one round ahead, in a thread."""

    def __init__(self, rounds: list, reader, size: int):
        self.rounds, self.reader = rounds, reader
        self.free: queue.Queue = queue.Queue()
        for _ in range(2):
            self.free.put(np.empty(size, dtype=np.uint8))
        self.ready: queue.Queue = queue.Queue()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._fill, name="reshard-reader", daemon=True)
        self.thread.start()

    def _fill(self) -> None:
        for r, space, sends, nbytes in self.rounds:
            buffer = None
            while buffer is None:
                if self.stop.is_set():
                    return
                try:
                    buffer = self.free.get(timeout=0.5)
                except queue.Empty:
                    continue
            failure = None
            try:
                memory = memoryview(buffer)
                for position, rank, slot, element, count, itemsize in _walk(sends, space, "src"):
                    self.reader.read_into(rank, slot, element, itemsize, memory[position:position + count * itemsize])
                del memory
            except Exception as error:  # reported after the collective, so peers do not hang
                failure = error
                buffer[:nbytes] = 0
            self.ready.put((r, buffer, failure))

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
    round_space = [i for i, space in enumerate(plan.spaces) for _ in range(space.rounds)]
    moved_per_round = round_bytes(plan)
    todo = []
    for r in range(start_round, len(round_space)):
        space = plan.spaces[round_space[r]]
        sends = view.sends.get(r, (None, []))[1]
        receives = view.receives.get(r, (None, []))[1]
        send_counts = _counts(sends, transport.size, space.bytes_per_element)
        recv_counts = _counts(receives, transport.size, space.bytes_per_element)
        todo.append((r, space, sends, receives, send_counts, recv_counts))
    if not todo:
        return
    largest_send = max(sum(t[4]) for t in todo)
    incoming_buffer = np.empty(max(sum(t[5]) for t in todo), dtype=np.uint8)
    ahead = _RoundReader([(r, space, sends, sum(sc)) for r, space, sends, _, sc, _ in todo], reader, largest_send)
    since_durable = 0
    try:
        for r, space, sends, receives, send_counts, recv_counts in todo:
            ready_round, packed, failure = ahead.next()
            assert ready_round == r
            failpoint("kill", round=r, worker=transport.rank)
            failpoint("stall", round=r, worker=transport.rank)
            out = torch.from_numpy(incoming_buffer[:sum(recv_counts)])
            received = transport.all_to_all(torch.from_numpy(packed[:sum(send_counts)]), send_counts, recv_counts,
                                            out=out)
            ahead.recycle(packed)
            since_durable += moved_per_round[r]
            durable = durable_every_bytes > 0 and (since_durable >= durable_every_bytes or r == len(round_space) - 1)
            if failure is None:
                try:
                    incoming = memoryview(received.numpy())
                    for position, rank, slot, element, count, itemsize in _walk(receives, space, "dst"):
                        writer.write(rank, slot, element, itemsize, incoming[position:position + count * itemsize])
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
    totals = []
    for space in plan.spaces:
        seg = space.segments
        per_round = np.bincount(seg.round, weights=seg.length, minlength=space.rounds) if len(seg) else \
            np.zeros(space.rounds)  # a space restricted to some files (array task) may keep its rounds, empty
        totals.extend(int(x) * space.bytes_per_element for x in per_round)
    return totals
