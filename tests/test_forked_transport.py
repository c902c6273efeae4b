"""The forked workers' transport (shared memory + socket pairs): `python -m pytest -q tests/test_forked_transport.py`.

Real processes forked from the test, as `python -m reshard --workers W` forks them: uneven
all-to-all rounds from buffers of their own (which grow the segments) and from the shared
send buffers the exchange packs into, objects larger than a socket buffer, and a worker
that dies (its peers must fail at once, naming it, not hang).
"""
from __future__ import annotations

import os
import pickle
import sys
import tempfile
import time

import numpy as np
import pytest

from reshard.transport.forked import ForkedLinks, ForkedTransport, WorkerLost

pytestmark = pytest.mark.e2e  # every test forks worker processes


def _forked(workers: int, work, timeout: float = 30.0) -> list:
    """Run work(transport) in `workers` forked processes; return each one's (ok, result or error text)."""
    links = ForkedLinks.create(workers)
    outdir = tempfile.mkdtemp(prefix="forked-test-")
    sys.stdout.flush()
    sys.stderr.flush()
    pids = []
    for rank in range(workers):
        pid = os.fork()
        if pid == 0:
            outcome = (False, "did not finish")
            try:
                transport = ForkedTransport(links, rank, timeout)
                try:
                    outcome = (True, work(transport))
                finally:
                    transport.close()
            except BaseException as error:  # noqa: BLE001 - reported to the parent
                outcome = (False, f"{type(error).__name__}: {error}")
            finally:
                with open(os.path.join(outdir, str(rank)), "wb") as fd:
                    pickle.dump(outcome, fd)
                os._exit(0)
        pids.append(pid)
    for sock in links.sockets.values():
        sock.close()
    for fd in links.segments:
        os.close(fd)
    for pid in pids:
        os.waitpid(pid, 0)
    results = []
    for rank in range(workers):
        path = os.path.join(outdir, str(rank))
        results.append(pickle.load(open(path, "rb")) if os.path.exists(path) else (False, "no result"))
    return results


def _block(sender: int, receiver: int, round_: int) -> np.ndarray:
    """The bytes `sender` sends `receiver` in round `round_`: uneven, some empty, some large."""
    size = ((sender * 7 + receiver * 13 + round_ * 5) % 9) * (1 << (round_ % 4 * 5))
    return ((np.arange(size, dtype=np.int64) * (sender + 1) + receiver * 31 + round_) % 251).astype(np.uint8)


def test_all_to_all_rounds_objects_and_barriers_between_three_processes():
    def work(transport):
        me, size = transport.rank, transport.size
        shared = transport.send_buffers(2, 1 << 20)  # as the exchange packs its rounds, in turn
        for round_ in range(12):
            blocks = [_block(me, peer, round_) for peer in range(size)]
            send = np.concatenate(blocks)
            if round_ >= 4:  # the first rounds send buffers of their own (copied into the segment)
                packed = shared[round_ % 2][:len(send)]
                packed[:] = send
                send = packed
            recv_counts = [len(_block(peer, me, round_)) for peer in range(size)]
            out = np.full(sum(recv_counts), 7, dtype=np.uint8) if round_ % 2 else None
            received = transport.all_to_all(send, [len(b) for b in blocks], recv_counts, out=out)
            assert out is None or received is out
            expected = np.concatenate([_block(peer, me, round_) for peer in range(size)])
            assert np.array_equal(received, expected), round_
            send[:] = 0  # the sender may reuse its buffer at once
        big = {"rank": me, "payload": os.urandom(3 << 20)}  # larger than any socket buffer
        gathered = transport.all_gather_object(big)
        assert [g["rank"] for g in gathered] == [0, 1, 2] and gathered[me] == big
        assert transport.broadcast_object(("from", me, big["payload"][:8]), src=1)[1] == 1
        transport.barrier()
        return "ok"

    assert _forked(3, work) == [(True, "ok")] * 3


def test_a_worker_that_dies_fails_its_peers_at_once_naming_it():
    def work(transport):
        transport.barrier()
        if transport.rank == 2:
            os._exit(3)  # no goodbye: as a crash or the OOM killer would end it
        started = time.monotonic()
        try:
            transport.all_gather_object("still here")
        except WorkerLost as error:
            return time.monotonic() - started, str(error)
        return None

    results = _forked(3, work, timeout=60.0)
    for rank in (0, 1):  # the first to notice names worker 2; the other may notice that one leaving first
        ok, (seconds, message) = results[rank]
        assert ok and seconds < 10 and "exited or died during an all-gather" in message, results[rank]
    assert any("worker 2 exited or died" in results[rank][1][1] for rank in (0, 1)), results
    assert results[2] == (False, "no result")


def test_a_hung_worker_times_its_peers_out():
    def work(transport):
        if transport.rank == 1:
            time.sleep(4)
            return "slept"
        with pytest.raises(WorkerLost, match="waited more than 1s for worker"):
            transport.barrier()
        return "timed out"

    assert [r[1] for r in _forked(2, work, timeout=1.0)] == ["timed out", "slept"]
