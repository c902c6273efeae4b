"""Whole files sent between nodes over the job's transport, in pieces: what a node-local job moves to a
node that lacks a file its output holds unchanged (a pipeline's layer files).

    transfers = fetch_plan({node: {"layer_03-model_states.pt"}}, views, sizes, tag_dir)   # pure
    fetch(transport, transfers, src_tag_dir, into_tag_dir, destination, piece, report)   # collective

`fetch_plan` says who sends which file to which node (a worker that sees it, to a worker of the node
that lacks it); `fetch` runs it: one piece of at most `piece` bytes per sender per round, written at its
offset, never a whole file in memory. Its bytes between nodes are the transfers' sizes where sender
and receiver sit on different nodes (`bytes_between_nodes`), which a job adds to its plan's figure.
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from reshard.errors import CheckpointError
from reshard.files.paths import open_new_file
from reshard.jobs.node_local import WorkerView
from reshard.jobs.results import WorkerReport
from reshard.transport import Transport
from reshard.transport.collective import check_peers

MAX_PIECE = 64 << 20


@dataclass(frozen=True)
class Transfer:
    """One source file sent whole to a node that lacks it."""

    name: str
    size: int
    sender: int
    """A worker that sees the file."""
    receiver: int
    """A worker of the node that lacks it: it writes the file into that node's fetch area."""


def fetch_plan(needed: dict[int, set[str]], views: Sequence[WorkerView], sizes: dict[str, int],
               tag_dir: str) -> list[Transfer]:
    """Who sends which file to which node. Pure. `needed`: node -> the file names its build needs.

    A file a node lacks is sent by a worker that sees it (the one with the fewest bytes to send so
    far, then the lowest) to one of that node's workers (in turn). CheckpointError names a file no
    worker sees."""
    workers_of: dict[int, list[int]] = {}
    for worker, view in enumerate(views):
        workers_of.setdefault(view.node, []).append(worker)
    load, transfers = [0] * len(views), []
    for node in sorted(needed):
        held = set().union(*(views[w].files for w in workers_of.get(node, [])))
        for index, name in enumerate(sorted(needed[node] - held)):
            able = [w for w, view in enumerate(views) if name in view.files]
            if not able:
                raise CheckpointError(os.path.join(tag_dir, name), "is on no node: no worker sees it; start the job "
                                                                   "on every node that saved the checkpoint")
            sender = min(able, key=lambda w: (load[w], w))
            load[sender] += sizes[name]
            receivers = workers_of[node]
            transfers.append(Transfer(name, sizes[name], sender, receivers[index % len(receivers)]))
    return transfers


def fetch_pieces(transfers: Sequence[Transfer], workers: int, piece: int) -> list[list[tuple[int, int, int]]]:
    """Per sender, its pieces in order: (transfer index, offset, length), each at most `piece` bytes;
    round r moves every sender's r-th piece. Pure."""
    pieces: list[list[tuple[int, int, int]]] = [[] for _ in range(workers)]
    for index, transfer in enumerate(transfers):
        for offset in range(0, transfer.size, piece):
            pieces[transfer.sender].append((index, offset, min(piece, transfer.size - offset)))
    return pieces


def fetch(transport: Transport, transfers: Sequence[Transfer], source_tag_dir: str, fetch_tag_dir: str,
          destination: str, piece: int, report: WorkerReport) -> None:
    """Run `transfers` (collective): each sender reads its pieces from SRC, each receiver writes them
    at their offsets into `fetch_tag_dir`. A worker that fails locally keeps taking part in every
    round (sending zeros), then all learn of it (check_peers)."""
    me, failure = transport.rank, None
    pieces = fetch_pieces(transfers, transport.size, piece)
    rounds = max((len(p) for p in pieces), default=0)
    files: dict[int, int] = {}
    reading: dict[int, int] = {}
    try:
        for index, transfer in enumerate(transfers):
            if transfer.receiver == me:
                files[index] = open_new_file(destination, os.path.join(fetch_tag_dir, transfer.name))
            if transfer.sender == me:
                reading[index] = fd = os.open(os.path.join(source_tag_dir, transfer.name), os.O_RDONLY)
                if os.fstat(fd).st_size != transfer.size:
                    raise CheckpointError(os.path.join(source_tag_dir, transfer.name),
                                          f"has {os.fstat(fd).st_size} bytes, {transfer.size} when the job "
                                          "surveyed it: the source changed while the job ran")
    except (OSError, CheckpointError) as error:
        failure = error
    for round_index in range(rounds):
        send_counts, recv_counts = [0] * transport.size, [0] * transport.size
        mine = pieces[me][round_index] if round_index < len(pieces[me]) else None
        data = np.zeros(0, dtype=np.uint8)
        if mine is not None:
            index, offset, length = mine
            send_counts[transfers[index].receiver] = length
            data = np.zeros(length, dtype=np.uint8)
            if failure is None:
                try:
                    data = np.frombuffer(os.pread(reading[index], length, offset), dtype=np.uint8)
                    if len(data) != length:
                        raise CheckpointError(os.path.join(source_tag_dir, transfers[index].name),
                                              "is shorter than when the job surveyed it")
                except (OSError, CheckpointError) as error:
                    failure, data = error, np.zeros(length, dtype=np.uint8)
            report.bytes_read += length
        arriving = []
        for sender in range(transport.size):
            if round_index < len(pieces[sender]):
                index, offset, length = pieces[sender][round_index]
                if transfers[index].receiver == me:
                    recv_counts[sender] = length
                    arriving.append((sender, index, offset, length))
        received = transport.all_to_all(data, send_counts, recv_counts)
        if mine is not None and transfers[mine[0]].receiver != me:
            report.bytes_between_nodes += mine[2]
        start = 0
        for sender, index, offset, length in arriving:
            if failure is None:
                try:
                    os.pwrite(files[index], memoryview(received[start:start + length]), offset)
                except OSError as error:
                    failure = error
            start += length
    for fd in [*files.values(), *reading.values()]:
        os.close(fd)
    check_peers(transport, failure, "fetching the source files a node lacks")


def bytes_between_nodes(transfers: Sequence[Transfer], node_of_worker: Sequence[int]) -> int:
    """The bytes `transfers` move from one node to another. Pure."""
    return sum(t.size for t in transfers if node_of_worker[t.sender] != node_of_worker[t.receiver])
