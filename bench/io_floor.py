"""The I/O floor: W processes read every source byte once and write as many bytes as the target.

    python bench/io_floor.py SRC_TAG_DIR --write-bytes 4400000000 --workers 2 --out-dir /tmp/floor

prints JSON (wall seconds, bytes read and written, per-worker split). Source files are dealt to
the workers largest first onto the least-loaded worker (the best balance any reader could
get); each worker reads its files start to end in 16 MiB chunks into one reused buffer (like
`cat FILE > /dev/null`), then writes its equal share of the target bytes in 16 MiB chunks and
fsyncs (like `dd bs=16M conv=fsync`; the chunk is random bytes, not zeros, so storage that
treats zeros specially cannot flatter the floor). The wall time runs from starting the first
worker to the exit of the last one. Drop the page cache before calling (see page_cache.py).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

CHUNK = 16 << 20


def deal_files(files: list[tuple[str, int]], workers: int) -> list[list[str]]:
    """Largest file first onto the worker with the fewest bytes so far."""
    loads, shares = [0] * workers, [[] for _ in range(workers)]
    for path, size in sorted(files, key=lambda item: -item[1]):
        target = loads.index(min(loads))
        loads[target] += size
        shares[target].append(path)
    return shares


def split_bytes(total: int, workers: int) -> list[int]:
    return [total // workers + (1 if w < total % workers else 0) for w in range(workers)]


def read_whole(path: str, buffer: bytearray) -> int:
    view, done = memoryview(buffer), 0
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        while True:
            n = os.readv(fd, [view])
            if n == 0:
                return done
            done += n
    finally:
        os.close(fd)


def write_chunks(path: str, nbytes: int, buffer: bytearray) -> int:
    view, done = memoryview(buffer), 0
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        while done < nbytes:
            done += os.write(fd, view[:min(CHUNK, nbytes - done)])
        os.fsync(fd)
    finally:
        os.close(fd)
    return done


def run_worker(read_paths: list[str], write_bytes: int, out_path: str) -> dict:
    read_buffer, write_buffer = bytearray(CHUNK), bytearray(os.urandom(CHUNK))
    started = time.perf_counter()
    read = sum(read_whole(path, read_buffer) for path in read_paths)
    reading_done = time.perf_counter()
    written = write_chunks(out_path, write_bytes, write_buffer) if write_bytes else 0
    finished = time.perf_counter()
    return {"bytes_read": read, "bytes_written": written, "read_seconds": reading_done - started,
            "write_seconds": finished - reading_done}


def source_files(tag_dir: str) -> list[tuple[str, int]]:
    paths = [os.path.join(tag_dir, name) for name in sorted(os.listdir(tag_dir))]
    return [(p, os.path.getsize(p)) for p in paths if os.path.isfile(p)]


def measure_io_floor(tag_dir: str, write_bytes: int, workers: int, out_dir: str) -> dict:
    """Start the W workers together; wall time until the last one is done (files fsynced)."""
    os.makedirs(out_dir, exist_ok=True)
    shares, writes = deal_files(source_files(tag_dir), workers), split_bytes(write_bytes, workers)
    started = time.perf_counter()
    children = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", "--write-bytes", str(writes[w]),
                                  "--out", os.path.join(out_dir, f"floor_{w}.bin"), "--read", *shares[w]],
                                 stdout=subprocess.PIPE, text=True) for w in range(workers)]
    reports = [json.loads(child.communicate()[0]) for child in children]
    wall = time.perf_counter() - started
    if any(child.returncode for child in children):
        raise RuntimeError("an I/O floor worker failed")
    for w in range(workers):
        os.unlink(os.path.join(out_dir, f"floor_{w}.bin"))
    return {"wall_seconds": wall, "workers": workers, "bytes_read": sum(r["bytes_read"] for r in reports),
            "bytes_written": sum(r["bytes_written"] for r in reports), "per_worker": reports}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tag_dir", nargs="?", help="directory whose files are read")
    parser.add_argument("--write-bytes", type=int, required=True)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out-dir", default="/tmp/io_floor")
    parser.add_argument("--worker", action="store_true", help="(internal) run one worker")
    parser.add_argument("--read", nargs="*", default=[], help="(internal) files this worker reads")
    parser.add_argument("--out", help="(internal) file this worker writes")
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(run_worker(args.read, args.write_bytes, args.out)))
        return
    print(json.dumps(measure_io_floor(args.tag_dir, args.write_bytes, args.workers, args.out_dir), indent=1))


if __name__ == "__main__":
    main()
