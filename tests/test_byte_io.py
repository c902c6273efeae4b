"""Byte I/O across filesystems and hashing in bounded windows (reshard.files.byte_io).

    PYTHONPATH=$PWD python -m pytest -q tests/test_byte_io.py

/dev/shm is a tmpfs on every machine here and /tmp is not: `copy_file_range` between them
fails with EXDEV, which is what a DST on local NVMe (or tmpfs) and SRC on a shared filesystem
meets. The copy must fall back and give the same bytes.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest
from blake3 import blake3

from reshard.files import byte_io
from reshard.files.byte_io import copy_bytes, hash_file
from reshard.errors import CheckpointError

REPO = Path(__file__).resolve().parents[1]
SHM = Path("/dev/shm")


@pytest.fixture
def shm_dir():
    """A directory on the tmpfs /dev/shm, removed afterwards."""
    path = SHM / f"reshard-test-{uuid.uuid4().hex[:12]}"
    path.mkdir()
    yield path
    for child in path.iterdir():
        child.unlink()
    path.rmdir()


def _other_filesystem(a: Path, b: Path) -> bool:
    return os.stat(a).st_dev != os.stat(b).st_dev


def _copy(src: Path, dst: Path, src_offset: int, dst_offset: int, count: int) -> None:
    src_fd, dst_fd = os.open(src, os.O_RDONLY), os.open(dst, os.O_RDWR | os.O_CREAT)
    try:
        copy_bytes(src_fd, src_offset, dst_fd, dst_offset, count, str(src))
    finally:
        os.close(src_fd)
        os.close(dst_fd)


def test_copy_between_filesystems_gives_the_same_bytes(tmp_path, shm_dir):
    assert _other_filesystem(tmp_path, shm_dir), "this machine's /tmp is on /dev/shm's filesystem"
    data = os.urandom(3 * byte_io.COPY_BUFFER_BYTES + 12345)  # several buffers' worth, and a ragged end
    src = tmp_path / "src.bin"
    src.write_bytes(data)
    for dst in (shm_dir / "out.bin", tmp_path / "back.bin"):  # /tmp -> tmpfs, then tmpfs -> /tmp
        _copy(src, dst, 7, 4096, len(data) - 7)
        assert dst.read_bytes() == b"\0" * 4096 + data[7:]
        src = shm_dir / "out.bin"
        data = src.read_bytes()
    # the refusal is remembered: the pair of filesystems goes straight to the plain copy now
    pair = (os.stat(tmp_path).st_dev, os.stat(shm_dir).st_dev)
    assert pair in byte_io._plain_copy_devices


def test_the_plain_copy_on_one_filesystem_matches_the_kernel_copy(tmp_path, monkeypatch):
    data = os.urandom(byte_io.COPY_BUFFER_BYTES + 999)
    src = tmp_path / "src.bin"
    src.write_bytes(data)
    _copy(src, tmp_path / "kernel.bin", 100, 0, len(data) - 100)
    # the remembered refusal forces the fallback where copy_file_range would work
    monkeypatch.setattr(byte_io, "_plain_copy_devices", {(os.stat(tmp_path).st_dev,) * 2})
    _copy(src, tmp_path / "plain.bin", 100, 0, len(data) - 100)
    assert (tmp_path / "plain.bin").read_bytes() == (tmp_path / "kernel.bin").read_bytes() == data[100:]


def test_a_truncated_source_is_named_on_either_path(tmp_path, shm_dir):
    src = tmp_path / "short.pt"
    src.write_bytes(b"x" * 1000)
    for dst in (tmp_path / "same.bin", shm_dir / "other.bin"):
        with pytest.raises(CheckpointError, match="short.pt.*ends before byte 2000"):
            _copy(src, dst, 0, 0, 2000)


@pytest.mark.parametrize("size", [0, 1, 65536, 3 * 65536 + 17])
def test_hash_in_windows_is_blake3_of_the_whole_file(tmp_path, monkeypatch, size):
    monkeypatch.setattr(byte_io, "HASH_WINDOW_BYTES", 65536)  # several windows without a large file
    data = os.urandom(size)
    (tmp_path / "f").write_bytes(data)
    assert hash_file(str(tmp_path / "f")) == blake3(data).hexdigest()


@pytest.mark.e2e
def test_hashing_a_large_file_keeps_resident_memory_to_a_window(tmp_path):
    """VmHWM of a fresh process hashing a 256 MiB file grows by about a window, not by the file."""
    path = tmp_path / "large.bin"
    with open(path, "wb") as out:
        block = os.urandom(1 << 20)
        for _ in range(256):
            out.write(block)
    script = textwrap.dedent(f"""
        from reshard.files.byte_io import hash_file
        def hwm():
            return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:")) * 1024
        before = hwm()
        hash_file({str(path)!r})
        print(hwm() - before)
    """)
    grown = int(subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                               env=dict(os.environ, PYTHONPATH=str(REPO))).stdout)
    assert grown < 64 << 20, f"VmHWM grew by {grown >> 20} MiB hashing a 256 MiB file"


def _pieces(seed: int, count: int) -> list[bytes]:
    """`count` byte strings of 0-40 bytes (some empty), different each."""
    import random
    rng = random.Random(seed)
    return [bytes(rng.randrange(256) for _ in range(rng.randrange(41))) for _ in range(count)]


def test_a_gathered_write_puts_every_view_back_to_back(tmp_path):
    """More views than one pwritev takes (IOV_MAX): every one lands after the one before, from the offset."""
    pieces = _pieces(1, 3 * byte_io.IOV_MAX + 7)
    path = tmp_path / "gathered"
    path.write_bytes(b"\xee" * 100)
    fd = os.open(path, os.O_RDWR)
    try:
        written = byte_io.pwritev_exact(fd, [memoryview(p) for p in pieces], 100)
    finally:
        os.close(fd)
    assert written == sum(map(len, pieces))
    assert path.read_bytes() == b"\xee" * 100 + b"".join(pieces)


def test_a_short_gathered_write_is_finished(tmp_path, monkeypatch):
    """pwritev may write fewer bytes than asked (POSIX): the rest still lands where it belongs."""
    real = os.pwritev
    calls = []

    def at_most_13_bytes(fd, buffers, offset):
        calls.append(len(buffers))
        cut, left = [], 13
        for b in buffers:
            if left == 0:
                break
            cut.append(memoryview(b)[:left])
            left -= len(cut[-1])
        return real(fd, cut, offset)

    monkeypatch.setattr(os, "pwritev", at_most_13_bytes)
    pieces = _pieces(2, 200)
    path = tmp_path / "short"
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    try:
        byte_io.pwritev_exact(fd, [memoryview(p) for p in pieces], 5)
    finally:
        os.close(fd)
    assert path.read_bytes() == b"\0" * 5 + b"".join(pieces)
    assert max(calls) > 1  # the gathered call was made, and cut short
