"""Workers over MPI (mpi4py): started by mpiexec/mpirun/srun, one MPI process per worker.

    mpiexec -n 16 python -m reshard SRC DST --target-dp 64 --transport mpi
    transport = MPITransport(timeout_seconds=600)     # MPI.COMM_WORLD, or comm=...

The rounds move host buffers with `Alltoallv` through the buffer interface (numpy views of
the exchange's uint8 buffers; no tensor is pickled); only the small agreement objects
(errors, plans' results, reports) travel pickled, with `bcast`/`allgather`.

MPI collectives have no timeout, and a peer that died may leave the others blocked for
ever. A watchdog thread therefore times every collective: when one waits longer than
`timeout_seconds`, it prints why and, two seconds later, calls `MPI.COMM_WORLD.Abort(3)`,
which ends every process of the job; mpiexec exits with status 3. An exception that nothing
handles (a bug on one worker, which its peers cannot know about) aborts the job the same way,
with status 1, rather than leaving them waiting.
Failures the job does handle go through `reshard.transport.collective` as with torch.distributed:
every worker learns of them at the same point and exits with the CLI's status.
"""
from __future__ import annotations

import contextlib
import sys
import threading
import time
import traceback

import numpy as np

from reshard.errors import OptionError

INSTALL_HINT = "pip install 'reshard[mpi]' (mpi4py) and an MPI (e.g. pip install mpich)"


def import_mpi():
    """mpi4py's MPI module (initialising MPI), or an OptionError saying how to install it."""
    try:
        from mpi4py import MPI
    except ImportError as error:
        raise OptionError(f"--transport mpi needs mpi4py, which cannot be imported ({error}); {INSTALL_HINT}") from None
    return MPI


class _Watchdog:
    """Aborts the MPI job when a collective waits longer than the timeout.

    The reason is printed `grace_seconds` before the abort: MPICH's launcher tears the job down on
    MPI_Abort and may exit before it has forwarded what the processes wrote last (a CI run lost the
    whole message that way), so the message is given time to reach the terminal first."""

    def __init__(self, comm, timeout_seconds: float, abort, grace_seconds: float = 2.0):
        self.comm, self.timeout, self.abort, self.grace = comm, timeout_seconds, abort, grace_seconds
        self.waiting: tuple[str, float] | None = None
        self.lock = threading.Condition()
        self.closed = False
        self.thread = threading.Thread(target=self._watch, name="reshard-mpi-watchdog", daemon=True)
        self.thread.start()

    @contextlib.contextmanager
    def guard(self, what: str):
        with self.lock:
            self.waiting = (what, time.monotonic() + self.timeout)
            self.lock.notify()
        try:
            yield
        finally:
            with self.lock:
                self.waiting = None

    def _overdue(self) -> str | None:
        """Blocks until a guarded collective is overdue (its name) or the watchdog is closed (None)."""
        with self.lock:
            while not self.closed:
                if self.waiting is None:
                    self.lock.wait()
                    continue
                what, deadline = self.waiting
                left = deadline - time.monotonic()
                if left <= 0:
                    return what
                self.lock.wait(timeout=min(left, 1.0))
        return None

    def _watch(self) -> None:
        what = self._overdue()
        if what is None:
            return
        print(f"reshard: worker {self.comm.Get_rank()}: {what} waited more than {self.timeout:g}s for its "
              "peers (one died or hangs); aborting the MPI job", file=sys.stderr, flush=True)
        time.sleep(self.grace)
        self.abort(3)

    def close(self) -> None:
        with self.lock:
            self.closed = True
            self.lock.notify()
        self.thread.join(timeout=5)


class MPITransport:
    """MPI over a communicator (COMM_WORLD by default): Alltoallv for the rounds, pickled objects for agreement."""

    def __init__(self, comm=None, timeout_seconds: float = 600, owns_process: bool = False):
        MPI = import_mpi()
        self.MPI = MPI
        self.comm = comm if comm is not None else MPI.COMM_WORLD
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        vendor, version = MPI.get_vendor()
        self.name = f"mpi/{vendor} {'.'.join(map(str, version))}"
        self.watchdog = _Watchdog(self.comm, timeout_seconds, self.abort)
        if owns_process:  # stays installed after close(): the exception reaches the hook after the job's cleanup
            sys.excepthook = self._abort_on_unhandled

    def abort(self, status: int = 1) -> None:
        """End every process of the MPI job now (peers blocked in a collective included)."""
        self.MPI.COMM_WORLD.Abort(status)

    def _abort_on_unhandled(self, kind, value, tb) -> None:
        traceback.print_exception(kind, value, tb)
        print(f"reshard: worker {self.rank} failed; aborting the MPI job so that its peers do not wait",
              file=sys.stderr, flush=True)
        time.sleep(self.watchdog.grace)  # let the launcher forward the traceback before it tears the job down
        self.abort(1)

    def all_to_all(self, send, send_counts, recv_counts, out=None):
        result = out if out is not None else np.empty(sum(recv_counts), dtype=np.uint8)
        send_view, recv_view = send.view(np.uint8), result.view(np.uint8)
        send_displacements = np.concatenate(([0], np.cumsum(send_counts)[:-1])).astype(np.int64)
        recv_displacements = np.concatenate(([0], np.cumsum(recv_counts)[:-1])).astype(np.int64)
        byte = self.MPI.BYTE
        with self.watchdog.guard("the round's Alltoallv"):
            self.comm.Alltoallv([send_view, (list(send_counts), send_displacements.tolist()), byte],
                                [recv_view, (list(recv_counts), recv_displacements.tolist()), byte])
        return result

    def broadcast_object(self, obj, src=0):
        with self.watchdog.guard("a broadcast"):
            return self.comm.bcast(obj, root=src)

    def all_gather_object(self, obj):
        with self.watchdog.guard("an all-gather"):
            return self.comm.allgather(obj)

    def barrier(self):
        with self.watchdog.guard("a barrier"):
            self.comm.Barrier()

    def close(self):
        self.watchdog.close()
