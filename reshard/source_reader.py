"""Reads partition slices from the source files one worker owns, at offsets, with pread.

    reader = SourceReader.open(source, ranks=[0, 1])
    reader.read_into(rank=1, slot=("optim", 0, "exp_avg"), element=128, itemsize=4, out=view)
    reader.close()

Opening a rank checks its files against the layout (see deepspeed_inspect.source_rank_tensors)
before any byte is moved. Files are opened read-only; nothing here can modify the source.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from reshard.byte_io import pread_exact
from reshard.formats.deepspeed_inspect import source_rank_tensors
from reshard.formats.deepspeed_spec import SourceCheckpoint



@dataclass
class SourceReader:
    locations: dict = field(default_factory=dict)
    """(rank, slot) -> (fd, byte offset of element 0, path)"""
    fds: dict = field(default_factory=dict)
    bytes_read: int = 0

    @classmethod
    def open(cls, source: SourceCheckpoint, ranks, *, trust_pickle: bool = False) -> "SourceReader":
        reader = cls()
        try:
            for rank in ranks:
                for slot, (path, ref) in source_rank_tensors(source, rank, trust_pickle=trust_pickle).items():
                    if path not in reader.fds:
                        reader.fds[path] = os.open(path, os.O_RDONLY)
                    reader.locations[(rank, slot)] = (reader.fds[path], ref.byte_offset, path)
        except BaseException:
            reader.close()
            raise
        return reader

    def read_into(self, rank: int, slot: tuple, element: int, itemsize: int, out: memoryview) -> None:
        fd, base, path = self.locations[(rank, slot)]
        pread_exact(fd, out, base + element * itemsize, path)
        self.bytes_read += len(out)

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()
