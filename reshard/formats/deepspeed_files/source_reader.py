"""Reads partition slices from the source files one worker owns, at offsets, with pread.

    reader = SourceReader.open(source, ranks=[0, 1], target=target)
    reader.read_batch([(1, ("optim", 0, "exp_avg"), 128, 4, view), ...])  # one round's reads
    reader.close()

Opening a rank checks its files against the layout (see deepspeed_inspect.source_rank_tensors)
before any byte is moved. Files are opened read-only; nothing here can modify the source.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from reshard.files.byte_io import pread_exact
from reshard.formats.deepspeed_files.deepspeed_inspect import source_rank_tensors
from reshard.formats.deepspeed_files.deepspeed_spec import SourceCheckpoint
from reshard.topology import Topology

READ_THREADS = 4
READ_PIECE = 8 << 20


@dataclass
class SourceReader:
    locations: dict = field(default_factory=dict)
    """(rank, slot) -> (fd, byte offset of element 0, path)"""
    fds: dict = field(default_factory=dict)
    bytes_read: int = 0
    _pool: ThreadPoolExecutor | None = None

    @classmethod
    def open(cls, source: SourceCheckpoint, ranks, *, target: Topology | None, trust_pickle: bool = False,
             extra_slots: Callable[[SourceCheckpoint, int, dict], dict] | None = None) -> "SourceReader":
        """Readers of source `ranks` for `target` (whose layer files may move through the plan,
        `Topology.layer_files`; None: an export, which has none). `extra_slots(source, rank, found)`: the
        slots the target reads besides the checked partitions `found` ({slot: (path, TensorRef)}), such as
        a ZeRO stage change's (reshard.formats.deepspeed_files.stage_change.StageChange.source_slots)."""
        reader = cls()
        try:
            for rank in ranks:
                found = source_rank_tensors(source, rank, target=target, trust_pickle=trust_pickle)
                if extra_slots is not None:
                    found.update(extra_slots(source, rank, found))
                for slot, (path, ref) in found.items():
                    if path not in reader.fds:
                        reader.fds[path] = os.open(path, os.O_RDONLY)
                    reader.locations[(rank, slot)] = (reader.fds[path], ref.byte_offset, path)
        except BaseException:
            reader.close()
            raise
        return reader

    def read_batch(self, reads) -> None:
        """Fill the `out` of every (rank, slot, element, itemsize, out) of `reads` (a round's).

        Reads go out in pieces of at most READ_PIECE bytes over READ_THREADS threads (pread
        releases the GIL): a cold disk answers several reads in flight faster than one at a
        time (the 2.5 GB ladder checkpoint's in-job load at 1 rank, page cache dropped, five
        back-to-back pairs: 3.0-4.0 s against 3.9-5.2 s one read at a time).
        """
        pieces = []
        for rank, slot, element, itemsize, out in reads:
            fd, base, path = self.locations[(rank, slot)]
            start = base + element * itemsize
            pieces += [(fd, out[done:done + READ_PIECE], start + done, path) for done in range(0, len(out), READ_PIECE)]
            self.bytes_read += len(out)
        if len(pieces) < 2:
            for piece in pieces:
                pread_exact(*piece)
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="reshard-pread")
        for _ in self._pool.map(lambda piece: pread_exact(*piece), pieces):
            pass

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()
