"""SourceReader.read_batch: a round's reads split into pieces over threads land where asked.

    python -m pytest -q tests/test_source_reader.py
"""
from __future__ import annotations

import os

import numpy as np
import pytest

from reshard.formats.deepspeed_files import source_reader
from reshard.errors import CheckpointError
from reshard.formats.deepspeed_files.source_reader import SourceReader


def _reader(path, slots: dict) -> SourceReader:
    """A reader over one file: slot -> byte offset of its element 0 (what `open` finds in a real file)."""
    reader = SourceReader()
    fd = os.open(path, os.O_RDONLY)
    reader.fds[str(path)] = fd
    for slot, base in slots.items():
        reader.locations[(0, slot)] = (fd, base, str(path))
    return reader


def test_batch_in_pieces_over_threads_fills_every_view_exactly(tmp_path, monkeypatch):
    monkeypatch.setattr(source_reader, "READ_PIECE", 4096 + 8)  # many pieces, not page aligned
    data = np.random.default_rng(0).integers(0, 256, size=1 << 20, dtype=np.uint8)
    path = tmp_path / "optim_states.pt"
    path.write_bytes(data.tobytes())
    slots = {("optim", 0, "fp32"): 64, ("optim", 0, "exp_avg"): 300_000, ("optim", 0, "exp_avg_sq"): 700_000}
    reader = _reader(path, slots)
    out = np.zeros(200_000, dtype=np.uint8)
    view = memoryview(out)
    # (slot, first element, itemsize, bytes, position in `out`): reads of many pieces, of one piece, of one byte
    asks = [(("optim", 0, "exp_avg"), 1000, 4, 90_000, 0), (("optim", 0, "fp32"), 3, 4, 8_000, 90_000),
            (("optim", 0, "exp_avg_sq"), 7, 2, 101_999, 98_000), (("optim", 0, "fp32"), 0, 1, 1, 199_999)]
    try:
        reader.read_batch([(0, slot, element, itemsize, view[at:at + nbytes])
                           for slot, element, itemsize, nbytes, at in asks])
        for slot, element, itemsize, nbytes, at in asks:
            start = slots[slot] + element * itemsize
            assert np.array_equal(out[at:at + nbytes], data[start:start + nbytes]), slot
        assert reader.bytes_read == sum(ask[3] for ask in asks)
        assert reader._pool is not None  # the batch went through the threads
    finally:
        reader.close()
    assert reader._pool is None and not reader.fds


def test_a_short_file_fails_the_batch_naming_the_file(tmp_path, monkeypatch):
    monkeypatch.setattr(source_reader, "READ_PIECE", 1024)
    path = tmp_path / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    path.write_bytes(bytes(10_000))
    reader = _reader(path, {("optim", 0, "fp32"): 0})
    out = memoryview(bytearray(20_000))
    try:
        with pytest.raises(CheckpointError, match=r"zero_pp_rank_1_mp_rank_00_optim_states\.pt.*truncated"):
            reader.read_batch([(0, ("optim", 0, "fp32"), 0, 4, out)])
    finally:
        reader.close()
