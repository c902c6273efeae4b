"""The job summary's memory figure counts anonymous memory, not the page cache of mapped files.

    python -m pytest -q tests/test_memory_measure.py
"""
from __future__ import annotations

import mmap

import numpy as np

from reshard.resources import PeakAnonymousMemory, anonymous_rss_bytes


def test_mapped_file_pages_are_not_counted_but_allocations_are(tmp_path):
    path = tmp_path / "hashed.bin"
    path.write_bytes(np.random.default_rng(0).integers(0, 255, 32 << 20, dtype=np.uint8).tobytes())
    memory = PeakAnonymousMemory()
    before = anonymous_rss_bytes()
    with open(path, "rb") as fd, mmap.mmap(fd.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        total = sum(mapped[i] for i in range(0, len(mapped), 4096))   # every page resident, file-backed
        memory.sample()
    assert total > 0
    assert anonymous_rss_bytes() - before < 16 << 20 and memory.peak - before < 16 << 20
    held = np.ones(96 << 20, dtype=np.uint8)                           # 96 MiB, touched: anonymous
    assert memory.sample() - before > 80 << 20
    del held
