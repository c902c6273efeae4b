"""The job summary's memory figure counts anonymous memory, not the page cache of mapped files.

    python -m pytest -q tests/test_memory_measure.py
"""
from __future__ import annotations

import mmap
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from reshard.files.resources import PeakAnonymousMemory, anonymous_rss_bytes

REPO = Path(__file__).resolve().parents[1]


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


@pytest.mark.e2e  # starts a 256 MiB launcher process
def test_peak_resident_memory_is_the_workers_own_not_its_launchers():
    """A launcher that holds 256 MiB starts a worker (fork + exec, as torchrun's agent does): the
    worker's peak RSS is its own VmHWM; ru_maxrss carries the launcher's pages over the exec."""
    held = np.ones(256 << 20, dtype=np.uint8)  # noqa: F841  (resident in this launcher at the fork)
    code = ("import resource; from reshard.files.resources import peak_resident_bytes; "
            "print(peak_resident_bytes(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          env=dict(os.environ, PYTHONPATH=str(REPO)))
    own, carried = map(int, done.stdout.split())
    assert own < 128 << 20, own
    assert carried > 256 << 20, carried  # the reason not to use it (if Linux stops carrying it, this says so)
