"""What a job needs from the machine: disk space on DST and open files (checked before it
starts), and the memory it held (measured while it runs).

    from reshard.files.resources import check_free_space, ensure_open_files, PeakAnonymousMemory
    check_free_space(dst, output_bytes(source, target_dp))   # OptionError "no space left on DST ..."
    ensure_open_files(files_needed=1200)                    # raises the soft limit, or explains
    memory = PeakAnonymousMemory(); ...; memory.sample()    # peak anonymous RSS, page cache left out

Both are estimates made from the source's file sizes (pickles only, no tensors): the output of a
reshard holds the same partitioned bytes as its source, plus one pickle structure per target
file. A job that would fail half-way for lack of space or file handles is refused up front with
a message that says what to change; a disk that fills anyway (another writer) is reported by
`disk_full_message` in the same words.
"""
from __future__ import annotations

import errno
import os
import resource

from reshard.errors import OptionError

#: file handles a worker needs besides its source and target files (torch, gloo, logs, ...)
SPARE_FILE_HANDLES = 64


def anonymous_rss_bytes() -> int:
    """Resident anonymous memory of this process (`RssAnon` of /proc/self/status; 0 where there
    is none). Unlike ru_maxrss it leaves out file pages mapped into the process: the page cache
    of a file hashed through a memory map (`byte_io.hash_file`) is not memory the job holds."""
    found = _status_bytes("RssAnon")
    return 0 if found is None else found


def peak_resident_bytes() -> int:
    """This process's peak resident memory since it started its program: VmHWM of
    /proc/self/status (every resident page, file pages mapped for hashing included: what top,
    SLURM's MaxRSS and memory watchdogs read). Not ru_maxrss, which Linux carries over an execve
    from the parent's memory at fork: a torchrun worker would report its agent's ~220 MB (the
    agent imported torch) whatever the worker itself touched. ru_maxrss where there is no /proc."""
    found = _status_bytes("VmHWM")
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 if found is None else found


def _status_bytes(field: str) -> int | None:
    """A kB field of /proc/self/status in bytes; None where it or /proc is missing."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class PeakAnonymousMemory:
    """The largest `anonymous_rss_bytes` seen at the moments `sample` is called (after planning,
    after every round, at the end): Linux keeps a peak of all resident pages (VmHWM) but none of
    anonymous ones alone, so the peak is sampled."""

    def __init__(self) -> None:
        self.peak = anonymous_rss_bytes()

    def sample(self, *_) -> int:
        self.peak = max(self.peak, anonymous_rss_bytes())
        return self.peak


def free_bytes(path: str) -> int:
    """Bytes an unprivileged writer can still put on the file system holding `path` (or its parent)."""
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    stat = os.statvfs(probe)
    return stat.f_bavail * stat.f_frsize


def check_free_space(destination: str, needed: int, already_written: int = 0) -> None:
    free = free_bytes(destination)
    if needed - already_written > free:
        raise OptionError(disk_full_message(destination, needed, free) + "; nothing was written")


def disk_full_message(destination: str, needed: int, free: int | None = None) -> str:
    free = free_bytes(destination) if free is None else free
    return f"no space left on {destination} (needed about {human(needed)}, free {human(free)})"


def is_disk_full(error: BaseException, path: str, slack: int = 1 << 20) -> bool:
    """ENOSPC, or a torch.save failure ("unexpected pos ...") on a file system that is now full."""
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    try:
        return free_bytes(os.path.dirname(path) or ".") < slack
    except OSError:
        return False


def files_per_worker(stage: int, ownership, worker: int) -> int:
    """Source and target files `worker` holds open at once (optim files, and model-states files
    per rank under ZeRO-3 or the one rank-0 model file under ZeRO-1/2)."""
    per_rank = 2 if stage == 3 else 1
    sources, targets = ownership.source_ranks_of(worker), ownership.target_ranks_of(worker)
    return (per_rank * (len(sources) + len(targets)) + (stage < 3) * ((0 in sources) + (0 in targets)))


def ensure_open_files(files_needed: int, what: str | None = None, advice: str | None = None) -> None:
    """Raise this process's soft RLIMIT_NOFILE as far as needed (up to the hard limit), or explain.

    `what` says who opens the files and why (default: a worker's source and target files), `advice`
    what to change besides the limit (default: more workers, each then holds fewer files)."""
    needed = files_needed + SPARE_FILE_HANDLES
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if needed <= soft:
        return
    if hard == resource.RLIM_INFINITY or needed <= hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))
        return
    what = what or f"this job keeps about {needed} files open per worker ({files_needed} source and target files)"
    advice = advice or "run more workers (each writes a share of the target files)"
    raise OptionError(f"{what}, but the open-file limit (RLIMIT_NOFILE) is {soft} (hard limit {hard}): {advice}, "
                      f"or raise the limit (ulimit -n {needed})")


def open_file_limit() -> int | None:
    """The hard RLIMIT_NOFILE (None when unlimited): how many files a process can be allowed to open."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    return None if hard == resource.RLIM_INFINITY else hard


def human(nbytes: int) -> str:
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{nbytes} B"


def size_at_least(nbytes: int) -> str:
    """The shortest size a flag reads (one decimal, the unit `human` picks: "2.7G") that is at least
    `nbytes`: rounded up, never to the nearest, so that a budget given as printed is enough
    (`human(2.64 GiB)` says "2.6 GiB", and 2.6G is less than 2.64 GiB). A number followed by K, M, G or
    T is read as that many binary units, truncated to whole bytes (jobs/options.py `parse_size`)."""
    unit, scale = "", 1
    for unit, scale in (("", 1), ("K", 1 << 10), ("M", 1 << 20), ("G", 1 << 30), ("T", 1 << 40)):
        if nbytes < 1024 * scale or unit == "T":
            break
    if not unit:
        return str(nbytes)
    tenths = -(-nbytes * 10 // scale)  # ceil(nbytes / scale, to one decimal)
    while int(float(f"{tenths // 10}.{tenths % 10}") * scale) < nbytes:  # the float product parse_size forms
        tenths += 1
    return f"{tenths // 10}.{tenths % 10}{unit}"

