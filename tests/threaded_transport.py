"""W workers as threads of one process, for running whole jobs in a test without torchrun.

    results = run_workers(3, lambda transport: reshard_checkpoint(src, dst, 5, transport=transport))

Implements reshard.transport.Transport with a shared board and a barrier; it moves the same
bytes the torch.distributed transport would. Multi-process gloo runs are covered by the
end-to-end tests; this one makes many worker counts cheap to test.
"""
from __future__ import annotations

import copy
import threading

import numpy as np


class _Board:
    def __init__(self, size: int, timeout: float):
        self.size = size
        self.barrier = threading.Barrier(size, timeout=timeout)
        self.slots: list = [None] * size


class ThreadTransport:
    name = "threads"

    def __init__(self, board: _Board, rank: int):
        self.board, self.rank, self.size = board, rank, board.size

    def _exchange(self, value):
        self.board.slots[self.rank] = value
        self.board.barrier.wait()
        everything = list(self.board.slots)
        self.board.barrier.wait()
        return everything

    def all_to_all(self, send, send_counts, recv_counts, out=None):
        offsets = [sum(send_counts[:p]) for p in range(self.size)]
        posted = self._exchange((send.copy(), offsets, list(send_counts)))
        parts = []
        for peer, (buffer, peer_offsets, peer_counts) in enumerate(posted):
            assert peer_counts[self.rank] == recv_counts[peer], "send and receive counts disagree"
            parts.append(buffer[peer_offsets[self.rank]:peer_offsets[self.rank] + peer_counts[self.rank]])
        result = np.concatenate(parts) if parts else send[:0].copy()
        if out is None:
            return result
        out[...] = result
        return out

    def broadcast_object(self, obj, src=0):
        return copy.deepcopy(self._exchange(obj)[src])

    def all_gather_object(self, obj):
        return copy.deepcopy(self._exchange(obj))

    def barrier(self):
        self._exchange(None)

    def close(self):
        pass


def run_workers(size: int, work, timeout: float = 120.0) -> list:
    """Run work(transport) on `size` threads; return their results or raise the first error."""
    board = _Board(size, timeout)
    results: list = [None] * size
    errors: list = [None] * size

    def target(rank):
        try:
            results[rank] = work(ThreadTransport(board, rank))
        except BaseException as error:  # noqa: BLE001 - reported to the test below
            errors[rank] = error
            board.barrier.abort()

    threads = [threading.Thread(target=target, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    from reshard.errors import PeerFailure
    raised = [e for e in errors if e is not None]
    for kinds in ((threading.BrokenBarrierError, PeerFailure), (threading.BrokenBarrierError,), ()):
        primary = [e for e in raised if not isinstance(e, kinds)]
        if primary:
            raise primary[0]
    return results


def in_threads(transports, work) -> list:
    """`work(transport)` for each of `transports` in a thread of its own (each rank's result, or the
    exception it raised), joined within 60 s: for transports whose ranks must run at once."""
    results: list = [None] * len(transports)

    def run(rank):
        try:
            results[rank] = work(transports[rank])
        except BaseException as error:  # noqa: BLE001 (the test judges each rank's outcome)
            results[rank] = error

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(len(transports))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return results
