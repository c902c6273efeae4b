"""Run a command and watch its whole process tree: wall time, peak memory, peak extra disk use.

    python bench/process_tree.py -- python -c "x = bytearray(500_000_000)"

`run_watched` polls every `poll_seconds`: the sum of RSS over the command and all its
descendants (what the machine must hold at once), the largest single process, the lowest
MemAvailable of the machine, how much the free space of a file system dropped below where it
started (temporary files included, even ones deleted before the end), and the I/O counters of
every process seen (last value per process, summed: a lower bound, as a process's last
0.2 s before exit can be missed). Output goes to a log file, so a chatty command never blocks on a
full pipe.
"""
from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

import psutil


@dataclass
class WatchedRun:
    """What one watched command did."""

    command: list
    returncode: int
    wall_seconds: float
    peak_tree_rss_bytes: int
    """Largest sum of RSS over the process tree seen at one poll (shared pages counted per process)."""
    peak_process_rss_bytes: int
    """Largest RSS of a single process of the tree seen at a poll."""
    peak_disk_bytes: int
    """Largest drop of free space on the watched file system below its value at the start."""
    min_available_bytes: int
    """Lowest MemAvailable of the machine seen at a poll."""
    read_chars: int
    """Bytes passed to read-type system calls by the tree's processes (/proc/PID/io rchar)."""
    write_chars: int
    """Bytes passed to write-type system calls by the tree's processes (/proc/PID/io wchar;
    sockets included, so gloo traffic counts here)."""
    read_bytes: int
    """Bytes the tree's processes caused to be fetched from storage (/proc/PID/io read_bytes)."""
    write_bytes: int
    """Bytes the tree's processes dirtied for storage (/proc/PID/io write_bytes; temporary files
    included, even when deleted before writeback)."""
    log_path: str
    output_tail: str = ""
    peak_process_fds: int = 0
    """Most file descriptors one process of the tree held open at a poll (/proc/PID/fd)."""
    peak_tree_fds: int = 0
    """Most file descriptors the whole tree held open at a poll."""
    peak_process_anon_rss_bytes: int = 0
    """Largest anonymous RSS (/proc/PID/status RssAnon) of one process at a poll: RSS without
    file pages mapped for reading (reshard hashes its outputs through a memory map, and those
    clean, reclaimable pages count in RSS and ru_maxrss)."""
    peak_tree_anon_rss_bytes: int = 0
    cpu_user_seconds: float = 0.0
    """User CPU seconds of the command and every descendant it waited for (RUSAGE_CHILDREN, before
    and after): on a shared machine the figure that load does not inflate, unlike wall time."""
    cpu_system_seconds: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


def tree_rss(root: psutil.Process, io_seen: dict, fds: list | None = None) -> tuple[int, int]:
    """(sum, max) of RSS over `root` and its descendants; records each one's I/O counters in
    `io_seen` (pid -> (rchar, wchar, read_bytes, write_bytes)) and, given `fds`, appends
    (largest, summed) open file descriptors. Processes that vanish meanwhile are skipped."""
    total = largest = most_fds = all_fds = most_anon = all_anon = 0
    try:
        members = [root] + root.children(recursive=True)
    except psutil.Error:
        return 0, 0
    for process in members:
        try:
            rss = process.memory_info().rss
            io = process.io_counters()
            io_seen[process.pid] = (io.read_chars, io.write_chars, io.read_bytes, io.write_bytes)
        except psutil.Error:
            continue
        total += rss
        largest = max(largest, rss)
        if fds is not None:
            try:
                count = process.num_fds()
            except psutil.Error:
                continue
            most_fds, all_fds = max(most_fds, count), all_fds + count
            anon = anon_rss(process.pid)
            most_anon, all_anon = max(most_anon, anon), all_anon + anon
    if fds is not None:
        fds.append((most_fds, all_fds, most_anon, all_anon))
    return total, largest


def anon_rss(pid: int) -> int:
    """RssAnon of a process in bytes (0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as fd:
            for line in fd:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def free_bytes(path: str) -> int:
    stat = os.statvfs(path)
    return stat.f_bavail * stat.f_frsize


def read_tail(path: str, limit: int = 6000) -> str:
    with open(path, "rb") as fd:
        fd.seek(0, os.SEEK_END)
        size = fd.tell()
        fd.seek(max(0, size - limit))
        return fd.read().decode(errors="replace")


def run_watched(command: list, *, env: dict | None = None, cwd: str | None = None, log_path: str,
                disk_path: str | None = None, poll_seconds: float = 0.2, timeout: float | None = None) -> WatchedRun:
    """Run `command` to completion while sampling its process tree and the disk under `disk_path`."""
    disk_path = disk_path or (cwd or os.getcwd())
    free_at_start = free_bytes(disk_path)
    peak_tree = peak_one = peak_disk = 0
    min_available = psutil.virtual_memory().available
    io_seen: dict = {}
    fds: list = []
    cpu_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    with open(log_path, "wb") as log:
        started = time.perf_counter()
        child = subprocess.Popen(command, env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT)
        root = psutil.Process(child.pid)
        while True:
            total, largest = tree_rss(root, io_seen, fds)
            peak_tree, peak_one = max(peak_tree, total), max(peak_one, largest)
            min_available = min(min_available, psutil.virtual_memory().available)
            peak_disk = max(peak_disk, free_at_start - free_bytes(disk_path))
            try:
                child.wait(timeout=poll_seconds)
                break
            except subprocess.TimeoutExpired:
                if timeout is not None and time.perf_counter() - started > timeout:
                    child.kill()
                    child.wait()
                    break
        wall = time.perf_counter() - started
    cpu_after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return WatchedRun([str(c) for c in command], child.returncode, wall, peak_tree, peak_one, max(peak_disk, 0),
                      min_available, *(sum(v[i] for v in io_seen.values()) for i in range(4)),
                      log_path, read_tail(log_path), peak_process_fds=max((f[0] for f in fds), default=0),
                      peak_tree_fds=max((f[1] for f in fds), default=0),
                      peak_process_anon_rss_bytes=max((f[2] for f in fds), default=0),
                      peak_tree_anon_rss_bytes=max((f[3] for f in fds), default=0),
                      cpu_user_seconds=cpu_after.ru_utime - cpu_before.ru_utime,
                      cpu_system_seconds=cpu_after.ru_stime - cpu_before.ru_stime)


def main() -> None:
    if "--" not in sys.argv:
        sys.exit(__doc__)
    command = sys.argv[sys.argv.index("--") + 1:]
    run = run_watched(command, log_path="/tmp/process_tree.log")
    print(json.dumps({k: v for k, v in run.to_dict().items() if k != "output_tail"}, indent=1))


if __name__ == "__main__":
    main()
