"""Runs a plan's rounds: read slices, all-to-all them between workers, write them in place.

    from reshard.exchange import run_rounds
    run_rounds(plan, transport, reader, writer, on_round=progress.update)

Every worker calls `run_rounds` with the same plan; each round is one collective, so all
workers step through the rounds together. In a round a worker packs what it sends into one
byte buffer (block per destination worker; per stream; segments in logical order), and
unpacks what it receives walking its own blocks the same way: the plan is the protocol.
Runs of segments contiguous in a file become a single pread or pwrite.

A worker that fails mid-round still takes part in that round's collective (sending zeros)
and then reports; every worker sees the failure at the same round boundary and stops, so
nobody hangs and nothing is declared complete.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from reshard.errors import PeerFailure
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


def run_rounds(plan: ReshardPlan, transport, reader, writer, *, start_round: int = 0, durable_every: int = 0,
               on_durable: Callable[[int], None] | None = None,
               on_round: Callable[[int, int], None] | None = None) -> None:
    """Move every segment of `plan` from round `start_round` on.

    Every `durable_every` rounds (and after the last) each worker fsyncs what it wrote
    before the round's agreement, then `on_durable(rounds done)` runs: a resume can start
    there. `on_round(round, bytes moved by all workers)` runs after every round.
    """
    view = plan.worker_view(transport.rank)
    round_space = [i for i, space in enumerate(plan.spaces) for _ in range(space.rounds)]
    moved_per_round = round_bytes(plan)
    for r in range(start_round, len(round_space)):
        space_index = round_space[r]
        space = plan.spaces[space_index]
        bpe = space.bytes_per_element
        sends = view.sends.get(r, (space_index, []))[1]
        receives = view.receives.get(r, (space_index, []))[1]
        send_counts = _counts(sends, transport.size, bpe)
        recv_counts = _counts(receives, transport.size, bpe)
        packed = np.empty(sum(send_counts), dtype=np.uint8)
        failure = None
        try:
            memory = memoryview(packed)
            for position, rank, slot, element, count, itemsize in _walk(sends, space, "src"):
                reader.read_into(rank, slot, element, itemsize, memory[position:position + count * itemsize])
        except Exception as error:  # reported after the collective, so peers do not hang
            failure, packed[:] = error, 0
        failpoint("kill", round=r, worker=transport.rank)
        received = transport.all_to_all(torch.from_numpy(packed), send_counts, recv_counts)
        durable = durable_every > 0 and ((r + 1) % durable_every == 0 or r == len(round_space) - 1)
        if failure is None:
            try:
                incoming = memoryview(received.numpy())
                for position, rank, slot, element, count, itemsize in _walk(receives, space, "dst"):
                    writer.write(rank, slot, element, itemsize, incoming[position:position + count * itemsize])
                if durable:
                    writer.sync()
            except Exception as error:
                failure = error
        del packed, received
        check_peers(transport, failure, f"round {r + 1} of {plan.rounds}")
        if durable and on_durable is not None:
            on_durable(r + 1)
        if on_round is not None:
            on_round(r, moved_per_round[r])


def check_peers(transport, failure: BaseException | None, stage: str) -> None:
    """Every worker learns whether any worker failed at `stage`; the failing one re-raises its own error."""
    reports = transport.all_gather_object(None if failure is None else f"{type(failure).__name__}: {failure}")
    if failure is not None:
        raise failure
    failed = [(worker, report) for worker, report in enumerate(reports) if report is not None]
    if failed:
        worker, report = failed[0]
        raise PeerFailure(f"worker {worker} failed during {stage}: {report}")


def round_bytes(plan: ReshardPlan) -> list[int]:
    totals = []
    for space in plan.spaces:
        seg = space.segments
        per_round = np.bincount(seg.round, weights=seg.length, minlength=space.rounds) if len(seg) else []
        totals.extend(int(x) * space.bytes_per_element for x in per_round)
    return totals
