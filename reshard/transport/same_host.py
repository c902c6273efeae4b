"""torchrun workers that share one host find each other without torch and talk through shared memory.

    torchrun --nproc_per_node=2 -m reshard SRC DST --target-dp 3     # chosen by transport_from_environment
    from reshard.transport.same_host import join_workers_on_this_host
    transport = join_workers_on_this_host(rank=0, size=2, job="...", timeout_seconds=600)  # a ForkedTransport

`python -m reshard --workers W` forks its workers from one process, which makes their shared
segments and socket pairs before forking (reshard.transport.forked). torchrun starts its workers
as separate programs, so here each worker makes its own memfd segment and the workers meet
through Linux abstract Unix sockets (no file to create or clean up: a name lives exactly as long
as the socket bound to it). Worker r listens on a name derived from the job's identity and r;
it connects to every lower-ranked worker and accepts every higher-ranked one, so every two
workers share one connected stream socket, the same shape as `ForkedLinks`' socket pairs. On
each connection both sides send their memfd with SCM_RIGHTS (`socket.send_fds`), so every
worker ends with every segment, and `ForkedTransport` then runs unchanged: the rounds go
through shared memory and nothing imports torch or starts gloo.

The job's identity is what torchrun gives all its workers and no other job at the same time:
its run id (TORCHELASTIC_RUN_ID), the address and port of its store (MASTER_ADDR, MASTER_PORT:
two jobs on a host cannot both bind the same port) and the restart count
(TORCHELASTIC_RESTART_COUNT: a restarted group never meets a dying one). A connection is checked
before it is used: the peer runs as the same user (SO_PEERCRED), belongs to the same job and
world size, and has the rank its socket name promised. A peer that never appears makes the
others fail after `timeout_seconds`, naming it, as a peer that stops answering does later.
"""
from __future__ import annotations

import hashlib
import os
import socket
import struct
import sys
import time

from reshard.transport.forked import ForkedLinks, ForkedTransport, WorkerLost

JOB_VARIABLES = ("TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT")
"""torchrun's environment that names one attempt of one job (see the module docstring)."""

GREETING = struct.Struct("<8s32sII")
"""magic, job digest, sender's rank, world size: what each side sends with its memfd."""
MAGIC = b"reshard1"
PEER_CREDENTIALS = struct.Struct("3i")
"""struct ucred (pid, uid, gid), as getsockopt(SO_PEERCRED) returns it."""
RETRY_SECONDS = 0.01


def available() -> bool:
    """Abstract Unix socket names, memfd_create and SCM_RIGHTS from Python: Linux only."""
    return sys.platform.startswith("linux") and hasattr(os, "memfd_create") and hasattr(socket, "send_fds")


def all_workers_on_this_host() -> bool:
    """Whether torchrun started every worker of the job on this host: its world is its node's
    (WORLD_SIZE == LOCAL_WORLD_SIZE, both set by torch.distributed.elastic's agent)."""
    world, local = os.environ.get("WORLD_SIZE"), os.environ.get("LOCAL_WORLD_SIZE")
    return world is not None and world == local and int(world) > 1


def job_identity() -> str:
    """The identity torchrun gives this attempt of this job (JOB_VARIABLES; missing ones read as "")."""
    return "\n".join(f"{name}={os.environ.get(name, '')}" for name in JOB_VARIABLES)


def _address(digest: bytes, rank: int) -> bytes:
    """The abstract socket name worker `rank` listens on (a leading NUL: not a file)."""
    return b"\0reshard-" + digest.hex()[:40].encode() + b"-" + str(rank).encode()


def join_workers_on_this_host(rank: int, size: int, job: str, timeout_seconds: float = 600) -> ForkedTransport:
    """Meet the job's other `size` - 1 workers on this host (module docstring); return this worker's
    ForkedTransport. Raises WorkerLost when a peer does not appear within `timeout_seconds`."""
    digest = hashlib.sha256(job.encode()).digest()
    deadline = time.monotonic() + timeout_seconds
    segment = os.memfd_create(f"reshard-worker{rank}", os.MFD_CLOEXEC)
    segments: list[int | None] = [None] * size
    segments[rank] = segment
    peers: dict[int, socket.socket] = {}
    listener = None
    try:
        if rank < size - 1:  # higher-ranked workers connect here
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
            try:
                listener.bind(_address(digest, rank))
            except OSError as error:
                raise WorkerLost(f"worker {rank}: another process on this host already uses this job's socket name "
                                 f"({error.strerror}); is the same torchrun job running twice?") from None
            listener.listen(size)
        for peer in range(rank):
            sock = _connect(digest, rank, peer, deadline, timeout_seconds)
            peers[peer] = sock
            _send_greeting(sock, digest, rank, size, segment)
            segments[peer] = _receive_greeting(sock, digest, size, peer, rank, deadline, timeout_seconds)
        for _ in range(rank + 1, size):
            sock, peer, fd = _accept(listener, digest, rank, size, deadline, timeout_seconds, set(peers))
            peers[peer] = sock
            segments[peer] = fd
            _send_greeting(sock, digest, rank, size, segment)
    except BaseException:
        for sock in peers.values():
            sock.close()
        for fd in segments:
            if fd is not None:
                os.close(fd)
        raise
    finally:
        if listener is not None:
            listener.close()
    links = ForkedLinks(segments, {(rank, peer): sock for peer, sock in peers.items()})
    transport = ForkedTransport(links, rank, timeout_seconds)
    transport.name = "shared memory (torchrun workers on one host)"
    return transport


def _left(deadline: float, rank: int, timeout_seconds: float, waiting_for: str) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise WorkerLost(f"worker {rank}: waited more than {timeout_seconds:g}s for {waiting_for} to join this "
                         "job's workers on this host (one died before it started, or hangs)")
    return left


def _connect(digest: bytes, rank: int, peer: int, deadline: float, timeout_seconds: float) -> socket.socket:
    """A connection to worker `peer`'s listener, retried until it listens (it may start later)."""
    while True:
        _left(deadline, rank, timeout_seconds, f"worker {peer}")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            sock.connect(_address(digest, peer))
            _check_same_user(sock, rank, peer)
            return sock
        except (ConnectionRefusedError, FileNotFoundError):
            sock.close()
            time.sleep(RETRY_SECONDS)
        except BaseException:
            sock.close()
            raise


def _accept(listener: socket.socket, digest: bytes, rank: int, size: int, deadline: float, timeout_seconds: float,
            known: set[int]) -> tuple[socket.socket, int, int]:
    """The next higher-ranked worker's connection: (socket, its rank, its memfd)."""
    while True:
        listener.settimeout(_left(deadline, rank, timeout_seconds,
                                  f"worker(s) above {rank} (have {', '.join(map(str, sorted(known))) or 'none'})"))
        try:
            sock, _ = listener.accept()
        except TimeoutError:
            continue
        try:
            _check_same_user(sock, rank, None)
            peer, fd = _receive_greeting(sock, digest, size, None, rank, deadline, timeout_seconds, with_rank=True)
        except BaseException:
            sock.close()
            raise
        if peer <= rank or peer in known:
            sock.close()
            os.close(fd)
            raise WorkerLost(f"worker {rank}: a second worker says it is worker {peer} of this job")
        return sock, peer, fd


def _credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end, as the kernel saw it connect."""
    return PEER_CREDENTIALS.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, PEER_CREDENTIALS.size))


def _foreign(sock: socket.socket, rank: int, peer: int | None, what: str) -> WorkerLost:
    """The error for a process at this job's socket that does not speak reshard's greeting."""
    pid = _credentials(sock)[0]
    where = "connected to this job's socket" if peer is None else f"listens under worker {peer}'s socket name"
    return WorkerLost(f"worker {rank}: an unexpected process (pid {pid}), not a reshard worker of this job, {where} "
                      f"and {what}; another program uses this job's socket name (stop it, or re-run the job)")


def _check_same_user(sock: socket.socket, rank: int, peer: int | None) -> None:
    """Abstract socket names carry no file permissions: only a process of this user may join."""
    _, uid, _ = _credentials(sock)
    if uid != os.getuid():
        who = "a process" if peer is None else f"the process listening as worker {peer}"
        raise WorkerLost(f"worker {rank}: {who} runs as user {uid}, not {os.getuid()}; refusing to share memory with it")


def _send_greeting(sock: socket.socket, digest: bytes, rank: int, size: int, segment: int) -> None:
    sock.settimeout(None)
    socket.send_fds(sock, [GREETING.pack(MAGIC, digest, rank, size)], [segment])


def _receive_greeting(sock: socket.socket, digest: bytes, size: int, peer: int | None, rank: int, deadline: float,
                      timeout_seconds: float, with_rank: bool = False):
    """Read a peer's greeting and memfd; check they belong to this job. Returns the memfd (and the
    peer's rank with `with_rank`)."""
    data, fds = b"", []
    while len(data) < GREETING.size:
        sock.settimeout(_left(deadline, rank, timeout_seconds, "a worker's greeting" if peer is None else f"worker {peer}"))
        try:
            chunk, more_fds, _, _ = socket.recv_fds(sock, GREETING.size - len(data), 1)
        except TimeoutError:
            continue
        if not chunk:
            break
        for fd in more_fds:  # SCM_RIGHTS hands fds over inheritable; keep them out of any child process (PEP 446)
            os.set_inheritable(fd, False)
        data, fds = data + chunk, fds + list(more_fds)
        if data[:len(MAGIC)] != MAGIC[:len(data)]:  # not a reshard worker: say so now, not at a timeout
            for fd in fds:
                os.close(fd)
            raise _foreign(sock, rank, peer, f"sent {len(data)} bytes that are not a reshard greeting "
                                             f"({data[:16]!r}...)")
    if len(data) == GREETING.size and len(fds) != 1:
        for fd in fds:
            os.close(fd)
        raise _foreign(sock, rank, peer, f"sent a greeting with {len(fds)} file descriptors instead of one shared "
                                         "memory segment")
    if len(data) < GREETING.size or len(fds) != 1:
        for fd in fds:
            os.close(fd)
        who = "a worker" if peer is None else f"worker {peer}"
        raise WorkerLost(f"worker {rank}: {who} closed its connection while the job's workers met on this host; "
                         "see its own message above")
    magic, their_digest, their_rank, their_size = GREETING.unpack(data)
    if magic != MAGIC or their_digest != digest or their_size != size or (peer is not None and their_rank != peer):
        os.close(fds[0])
        raise WorkerLost(f"worker {rank}: the process that answered as worker {their_rank} of {their_size} belongs "
                         f"to another job or another world size (this one: {size} workers)")
    return (their_rank, fds[0]) if with_rank else fds[0]
