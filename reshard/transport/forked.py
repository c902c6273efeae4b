"""Workers forked on one host, talking without torch: shared memory for the rounds, socket pairs for the rest.

    links = ForkedLinks.create(workers=2)        # in the parent, before forking
    ... fork W - 1 children; worker k then:
    transport = ForkedTransport(links, rank=k, timeout_seconds=600)
    received = transport.all_to_all(send, send_counts, recv_counts, out=out)   # numpy uint8 buffers

`python -m reshard ... --workers W` (reshard.local_workers) forks its workers from one process,
so they can share what that process made before forking: one memfd per worker (its send
segment, grown with ftruncate, mapped by every worker) and a connected Unix socket pair
between every two workers. The exchange packs its rounds straight into the segment
(`send_buffers`); a round then tells each peer where that peer's block is (offset, bytes,
segment size), copies this worker's blocks out of the peers' segments into `out`, and tells
them it is done, so that the buffer can be refilled. One copy per byte, and no memory beyond
the exchange's own buffers. Measured on the 2-core development machine for a 64 MiB round
between two processes: two memcpy through a warm shared segment took 14 ms; the same bytes
through a socket pair 20-190 ms, through a pipe 170-280 ms (shared machine, noisy).

torchrun workers on one host run this same transport: they make the segments and connections
themselves and exchange them over abstract Unix sockets (reshard.transport.same_host), then
build `ForkedLinks` from what they hold.

Objects (agreement, reports) travel pickled over the socket pairs, sent and received at once
through a selector so that large ones cannot deadlock. A peer that dies closes its sockets:
every worker waiting on it raises WorkerLost at once, naming it; one that hangs makes the
others raise after `timeout_seconds`. Failures the job handles go through reshard.transport.collective
as with every transport.
"""
from __future__ import annotations

import mmap
import os
import pickle
import selectors
import socket
import struct
import time
from dataclasses import dataclass

import numpy as np

HEADER = struct.Struct("<Q")


class WorkerLost(RuntimeError):
    """A peer worker died or stopped answering: the job cannot go on (exit status 1, not a refusal)."""


@dataclass
class ForkedLinks:
    """What the parent makes before forking: a memfd per worker, a socket pair per two workers."""

    segments: list[int]
    """memfd of each worker's send segment (every worker keeps all of them)"""
    sockets: dict[tuple[int, int], socket.socket]
    """(a, b) -> the end worker a holds of the pair it shares with worker b"""

    @classmethod
    def create(cls, workers: int) -> "ForkedLinks":
        import math

        from reshard.files.resources import SPARE_FILE_HANDLES, ensure_open_files, open_file_limit
        # Until the fork, this one process holds every socket pair's two ends and every memfd:
        # W * (W - 1) + W = W * W files, however few each worker keeps afterwards.
        limit = open_file_limit()
        fits = workers if limit is None else max(1, math.isqrt(max(0, limit - SPARE_FILE_HANDLES)))
        ensure_open_files(workers * workers,
                          what=f"--workers {workers} makes this process open {workers * workers} files before it "
                               f"starts the workers ({workers} shared-memory segments and a socket pair between "
                               f"every two workers: workers x workers in all)",
                          advice=f"use at most --workers {fits} here, or start the workers with torchrun (each "
                                 "then opens only its own connections)")
        segments = [os.memfd_create(f"reshard-worker{k}", os.MFD_CLOEXEC) for k in range(workers)]
        sockets = {}
        for a in range(workers):
            for b in range(a + 1, workers):
                sockets[(a, b)], sockets[(b, a)] = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        return cls(segments, sockets)

    def keep(self, rank: int) -> dict[int, socket.socket]:
        """In worker `rank`, after forking: close the other workers' ends (so that a peer's death
        reads as end of file here) and return {peer: socket}."""
        mine = {}
        for (a, b), sock in self.sockets.items():
            if a == rank:
                mine[b] = sock
            else:
                sock.close()
        self.sockets = {}
        return mine


class _Mapping:
    """A worker's view of one segment, mapped again when its owner grew it. An earlier mapping
    stays valid while arrays still view it (it shares the segment's pages) and is unmapped once
    they are gone."""

    def __init__(self, fd: int):
        self.fd, self.size, self.map, self.array = fd, 0, None, np.empty(0, dtype=np.uint8)

    def cover(self, size: int) -> np.ndarray:
        if size > self.size:
            self.map = mmap.mmap(self.fd, size)
            self.array, self.size = np.frombuffer(self.map, dtype=np.uint8), size
        return self.array

    def grow(self, size: int) -> np.ndarray:
        """(The owner) at least `size` bytes, mapped."""
        if size > self.size:
            os.ftruncate(self.fd, size)
        return self.cover(size)

    def close(self) -> None:
        self.array, self.map, self.size = np.empty(0, dtype=np.uint8), None, 0


class ForkedTransport:
    """The Transport of workers forked from one process (reshard.local_workers)."""

    name = "shared memory (forked workers)"

    def __init__(self, links: ForkedLinks, rank: int, timeout_seconds: float = 600):
        self.rank, self.size, self.timeout = rank, len(links.segments), timeout_seconds
        self.peers = links.keep(rank)
        for sock in self.peers.values():
            sock.setblocking(False)
        self.segments = [_Mapping(fd) for fd in links.segments]
        self.reserved = 0
        """Bytes at the start of this worker's segment handed out by `send_buffers`."""
        self.selector = selectors.DefaultSelector()
        self.pending = {peer: bytearray() for peer in self.peers}

    # -- messages ------------------------------------------------------------------------
    def _swap(self, outgoing: dict[int, bytes], expect, what: str) -> dict[int, bytes]:
        """Send each peer its message and receive one message from each peer in `expect`, at once."""
        sending = {peer: memoryview(HEADER.pack(len(data)) + data) for peer, data in outgoing.items()}
        received: dict[int, bytes] = {}
        waiting = set(expect)
        deadline = time.monotonic() + self.timeout
        for peer in waiting:  # whole messages already buffered from an earlier read
            message = self._take(peer)
            if message is not None:
                received[peer] = message
        waiting -= set(received)
        for peer in set(sending) | waiting:
            events = (selectors.EVENT_WRITE if peer in sending else 0) | \
                     (selectors.EVENT_READ if peer in waiting else 0)
            self.selector.register(self.peers[peer], events, peer)
        try:
            while sending or waiting:
                left = deadline - time.monotonic()
                if left <= 0:
                    slow = sorted(waiting | set(sending))
                    raise WorkerLost(f"worker {self.rank}: {what} waited more than {self.timeout:g}s for worker(s) "
                                     f"{', '.join(map(str, slow))} (one died or hangs)")
                for key, events in self.selector.select(timeout=min(left, 5.0)):
                    peer = key.data
                    if events & selectors.EVENT_WRITE and peer in sending:
                        self._send_some(peer, sending, what)
                    if events & selectors.EVENT_READ and peer in waiting:
                        message = self._receive_some(peer, what)
                        if message is not None:
                            received[peer] = message
                            waiting.discard(peer)
                    self._update(peer, sending, waiting)
        finally:
            for key in list(self.selector.get_map().values()):
                self.selector.unregister(key.fileobj)
        return received

    def _update(self, peer: int, sending: dict, waiting: set) -> None:
        events = (selectors.EVENT_WRITE if peer in sending else 0) | (selectors.EVENT_READ if peer in waiting else 0)
        sock = self.peers[peer]
        if events:
            self.selector.modify(sock, events, peer)
        elif sock in self.selector.get_map():
            self.selector.unregister(sock)

    def _send_some(self, peer: int, sending: dict, what: str) -> None:
        data = sending[peer]
        try:
            sent = self.peers[peer].send(data)
        except BlockingIOError:
            return
        except OSError as error:
            raise self._lost(peer, what, error) from None
        if sent == len(data):
            del sending[peer]
        else:
            sending[peer] = data[sent:]

    def _receive_some(self, peer: int, what: str) -> bytes | None:
        try:
            chunk = self.peers[peer].recv(1 << 20)
        except BlockingIOError:
            return None
        except OSError as error:
            raise self._lost(peer, what, error) from None
        if not chunk:
            raise self._lost(peer, what, None)
        self.pending[peer] += chunk
        return self._take(peer)

    def _take(self, peer: int) -> bytes | None:
        buffer = self.pending[peer]
        if len(buffer) < HEADER.size:
            return None
        length = HEADER.unpack_from(buffer)[0]
        if len(buffer) < HEADER.size + length:
            return None
        message = bytes(buffer[HEADER.size:HEADER.size + length])
        del buffer[:HEADER.size + length]
        return message

    def _lost(self, peer: int, what: str, error: OSError | None) -> WorkerLost:
        how = f" ({error.strerror or error})" if error is not None else ""
        return WorkerLost(f"worker {self.rank}: worker {peer} exited or died during {what}: its connection "
                          f"closed{how}; see its own message above")

    def _to_all(self, data: bytes) -> dict[int, bytes]:
        return {peer: data for peer in self.peers}

    # -- the Transport protocol -----------------------------------------------------------
    def send_buffers(self, count: int, size: int) -> list[np.ndarray]:
        """`count` send buffers of `size` bytes in this worker's shared segment (the exchange packs
        its rounds there): an all-to-all of one of them copies nothing before the peers copy their
        blocks out. A buffer may be refilled once `all_to_all` returned (every peer has its copy)."""
        self.reserved = count * size
        segment = self.segments[self.rank].grow(self.reserved)
        return [segment[k * size:(k + 1) * size] for k in range(count)]

    def _in_segment(self, send: np.ndarray) -> int | None:
        """Where `send` starts in this worker's current segment mapping, if it lies within a send buffer."""
        segment = self.segments[self.rank].array
        if not len(segment) or not len(send):
            return None
        at = send.ctypes.data - segment.ctypes.data
        return at if 0 <= at and at + len(send) <= self.reserved else None

    def place(self, send: np.ndarray, total: int) -> int:
        """Where the first `total` bytes of `send` lie in this worker's segment, for peers to read:
        in place when `send` is a send buffer, else copied in after the send buffers."""
        base = self._in_segment(send)
        if base is None:
            base = self.reserved
            self.segments[self.rank].grow(base + total)[base:base + total] = send[:total]
        return base

    def peer_segment(self, peer: int, size: int) -> np.ndarray:
        """Worker `peer`'s segment, mapped to at least `size` bytes (the size it last announced)."""
        return self.segments[peer].cover(size)

    def own_segment(self, size: int) -> np.ndarray:
        """This worker's segment, grown to at least `size` bytes."""
        return self.segments[self.rank].grow(size)

    def messages(self, outgoing: dict[int, bytes], expect, what: str) -> dict[int, bytes]:
        """Send each peer in `outgoing` its message and receive one from each peer in `expect`, at
        once (no deadlock however large); raises WorkerLost naming a peer that died or hangs."""
        return self._swap(outgoing, expect, what)

    def all_to_all(self, send, send_counts, recv_counts, out=None):
        send = np.asarray(send).view(np.uint8)
        result = out if out is not None else np.empty(sum(recv_counts), dtype=np.uint8)
        send_at = np.concatenate(([0], np.cumsum(send_counts, dtype=np.int64)))
        recv_at = np.concatenate(([0], np.cumsum(recv_counts, dtype=np.int64)))
        total = int(send_at[-1])
        mine = self.segments[self.rank]
        base = self.place(send, total)
        notes = {peer: pickle.dumps((base + int(send_at[peer]), int(send_counts[peer]), mine.size))
                 for peer in self.peers}
        me = self.rank
        result[recv_at[me]:recv_at[me + 1]] = send[send_at[me]:send_at[me + 1]]
        for peer, note in self._swap(notes, self.peers, "a round's all-to-all").items():
            offset, count, size = pickle.loads(note)
            if count != recv_counts[peer]:
                raise AssertionError(f"worker {peer} sends {count} bytes to worker {me}, which expects "
                                     f"{recv_counts[peer]}")
            result[recv_at[peer]:recv_at[peer + 1]] = self.segments[peer].cover(size)[offset:offset + count]
        self._swap(self._to_all(b""), self.peers, "the end of a round")  # every segment may be reused now
        return result

    def broadcast_object(self, obj, src=0):
        if self.rank == src:
            self._swap(self._to_all(pickle.dumps(obj)), (), "a broadcast")
            return obj
        return pickle.loads(self._swap({}, (src,), "a broadcast")[src])

    def all_gather_object(self, obj):
        data = pickle.dumps(obj)
        received = self._swap(self._to_all(data), self.peers, "an all-gather")
        received[self.rank] = data
        return [pickle.loads(received[peer]) for peer in range(self.size)]

    def barrier(self):
        self._swap(self._to_all(b""), self.peers, "a barrier")

    def close(self):
        for segment in self.segments:
            segment.close()
        for sock in self.peers.values():
            sock.close()
        self.peers = {}
        self.selector.close()
