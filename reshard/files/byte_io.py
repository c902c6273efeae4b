"""Byte I/O on open files, the one place reshard reads, writes, copies and hashes bytes.

    from reshard.files.byte_io import pread_exact, pwrite_exact, copy_bytes, hash_file
    pread_exact(fd, memoryview(buffer), offset, path)     # fill buffer from the file at offset
    pwrite_exact(fd, memoryview(data), offset)            # write all of data at offset
    pwritev_exact(fd, [view_a, view_b], offset)           # the views back to back from offset, few syscalls
    copy_bytes(src_fd, 0, dst_fd, 4096, n, path)          # file to file, in the kernel where it can
    hash_file(path)                                       # BLAKE3 hex digest of the whole file

Formats (source reader, target writer, exports) and the manifest (hashes, verify) all go
through these functions: reads use `os.preadv` (nothing stays mapped; a short read is a
truncated file and says so), writes `os.pwritev`, copies `os.copy_file_range` (or, where the
kernel refuses it, such as between two filesystems, pread/pwrite through one bounded buffer),
hashes BLAKE3 over a memory map one window at a time (pages still cached from writing are not
read from disk again, and no more than a window is ever mapped).
"""
from __future__ import annotations

import errno
import mmap
import os
import threading

from reshard.errors import CheckpointError

_CHUNK = 16 << 20
COPY_BUFFER_BYTES = 8 << 20
"""The most a plain copy (the fallback of `copy_bytes`) holds at once, per thread."""
HASH_WINDOW_BYTES = 16 << 20
"""How much of a file `hash_file` maps at once. Measured on a 1 GiB cached file (2 cores): 16 MiB
windows hash as fast as mapping the whole file (0.53 s vs 0.55 s) with VmHWM 30 MiB instead of
1038 MiB; pread into a reused buffer instead took 0.9-1.8 s (a copy the map avoids)."""

# copy_file_range's refusals that mean "not between these two files", not "the copy failed":
# EXDEV across filesystems (Linux >= 5.19 between different filesystem types, and before 5.3
# always), ENOSYS without the syscall, EOPNOTSUPP/ENOTSUP where a filesystem lacks it, EINVAL
# for files it cannot copy (e.g. some special or FUSE files), EBADF where a file was opened
# with O_APPEND.
_NO_KERNEL_COPY = {errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL, errno.EBADF}
_plain_copy_devices: set[tuple[int, int]] = set()
"""(source st_dev, destination st_dev) pairs where copy_file_range was refused: not tried again."""
_copy_buffers = threading.local()


def pread_exact(fd: int, view: memoryview, offset: int, path: str = "") -> None:
    """Fill `view` from `fd` at `offset`; a short read means the file is shorter than its index says."""
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise CheckpointError(path, f"ends at byte {offset + done}, but its index says data continues to "
                                        f"byte {offset + len(view)} (truncated)")
        done += n


def pwrite_exact(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        done += os.pwritev(fd, [view[done:]], offset + done)


IOV_MAX = os.sysconf("SC_IOV_MAX") if "SC_IOV_MAX" in os.sysconf_names else 16
"""The most buffers one pwritev takes (1024 on Linux; POSIX guarantees 16)."""


def pwritev_exact(fd: int, views: list[memoryview], offset: int) -> int:
    """Write `views` (of bytes: format "B") back to back from `offset`, up to IOV_MAX of them per pwritev; return the bytes.

    Why: a tp change puts each row of a row-parallel piece in its own place in the target file,
    tens of thousands of small pieces per job; one syscall per piece cost more than the bytes
    (docs/benchmarks.md, "pipeline pp and tp change: where the time went")."""
    total = 0
    start = 0
    while start < len(views):
        batch = views[start:start + IOV_MAX]
        want = sum(map(len, batch))
        done = os.pwritev(fd, batch, offset + total)
        if done < want:  # a short write: finish the rest of this batch piece by piece
            skipped = 0
            for v in batch:
                if skipped + len(v) > done:
                    pwrite_exact(fd, v[max(done - skipped, 0):], offset + total + max(done, skipped))
                skipped += len(v)
        total += want
        start += IOV_MAX
    return total


def copy_bytes(src_fd: int, src_offset: int, dst_fd: int, dst_offset: int, count: int, path: str = "") -> None:
    """Copy `count` bytes between files: in the kernel (`copy_file_range`, no user-space buffer)
    where it can, else through one reused buffer of at most COPY_BUFFER_BYTES.

    A pair of filesystems that refused the kernel copy once is remembered, so later calls go
    straight to the plain copy. `path` (the source) is named when the source is truncated."""
    if count <= 0:
        return
    devices = (os.fstat(src_fd).st_dev, os.fstat(dst_fd).st_dev)
    done = 0
    if devices not in _plain_copy_devices:
        while done < count:
            try:
                n = os.copy_file_range(src_fd, dst_fd, count - done, src_offset + done, dst_offset + done)
            except OSError as error:
                if error.errno not in _NO_KERNEL_COPY or done:
                    raise
                _plain_copy_devices.add(devices)
                break
            if n == 0:
                # End of the source (the plain copy below says "truncated"), or a filesystem that
                # copies nothing although there is more (some return 0 early): not tried again.
                if os.fstat(src_fd).st_size > src_offset + done:
                    _plain_copy_devices.add(devices)
                break
            done += n
    if done < count:
        plain_copy(src_fd, src_offset + done, dst_fd, dst_offset + done, count - done, path)


def plain_copy(src_fd: int, src_offset: int, dst_fd: int, dst_offset: int, count: int, path: str = "") -> None:
    """pread/pwrite `count` bytes through this thread's buffer (at most COPY_BUFFER_BYTES)."""
    buffer = getattr(_copy_buffers, "buffer", None)
    if buffer is None or len(buffer) < min(count, COPY_BUFFER_BYTES):
        buffer = _copy_buffers.buffer = bytearray(min(count, COPY_BUFFER_BYTES))
    view = memoryview(buffer)
    done = 0
    while done < count:
        chunk = view[:min(len(view), count - done)]
        n = os.preadv(src_fd, [chunk], src_offset + done)
        if n == 0:
            raise CheckpointError(path, f"ends before byte {src_offset + count} (truncated)")
        pwrite_exact(dst_fd, chunk[:n], dst_offset + done)
        done += n


def hash_file(path: str) -> str:
    """BLAKE3 of a file's bytes (about 4x faster than hashlib's blake2b on one core here), read
    through a memory map of one window (HASH_WINDOW_BYTES) at a time: no copy, pages still cached
    from writing are not read again, and the process's VmRSS grows by a window, not by the file
    (`blake3.update_mmap` maps the whole file: a 30 GB target file read as 30 GB of VmRSS)."""
    from blake3 import blake3
    digest = blake3(max_threads=blake3.AUTO)
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        for offset in range(0, size, HASH_WINDOW_BYTES):
            window = mmap.mmap(fd, min(HASH_WINDOW_BYTES, size - offset), prot=mmap.PROT_READ, offset=offset)
            try:
                with memoryview(window) as view:
                    digest.update(view)
            finally:
                window.close()
    finally:
        os.close(fd)
    return digest.hexdigest()


def hash_range(path: str, offset: int, nbytes: int) -> str:
    """BLAKE3 of `nbytes` of a file from `offset`, read in chunks (module weights can be large)."""
    from blake3 import blake3
    digest = blake3(max_threads=blake3.AUTO)
    buffer = bytearray(min(_CHUNK, nbytes))
    fd = os.open(path, os.O_RDONLY)
    try:
        for start in range(0, nbytes, _CHUNK):
            view = memoryview(buffer)[:min(_CHUNK, nbytes - start)]
            pread_exact(fd, view, offset + start, path)
            digest.update(view)
    finally:
        os.close(fd)
    return digest.hexdigest()
