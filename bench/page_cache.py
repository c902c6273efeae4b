"""Drop the page cache before a measurement, the same way for every contender.

    python bench/page_cache.py /path/to/checkpoint [/more/paths ...]     # prints the method used

Method "proc": `sync; echo 3 > /proc/sys/vm/drop_caches` (needs root and a writable /proc/sys).
Method "fadvise": for machines where that is refused, fsync and POSIX_FADV_DONTNEED every file
under the given paths (clean pages of those files leave the cache; other files stay cached).
`drop_page_cache(paths, method="auto")` tries "proc" and falls back to "fadvise".
"""
from __future__ import annotations

import os
import sys


def drop_with_proc() -> bool:
    """Drop every clean page system-wide; False when the kernel interface is not writable."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as fd:
            fd.write("3\n")
        return True
    except OSError:
        return False


def files_under(paths) -> list[str]:
    found = []
    for path in paths:
        if os.path.isfile(path):
            found.append(path)
        elif os.path.isdir(path):
            for root, _, names in os.walk(path):
                found.extend(os.path.join(root, name) for name in names)
    return found


def drop_with_fadvise(paths) -> int:
    """fsync, then evict, every file under `paths`; returns how many files were evicted."""
    count = 0
    for path in files_under(paths):
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            count += 1
        finally:
            os.close(fd)
    return count


def drop_page_cache(paths, method: str = "auto") -> str:
    """Drop cached pages of `paths` (or everything); returns the method that was used."""
    if method in ("auto", "proc") and drop_with_proc():
        return "proc"
    if method == "proc":
        raise RuntimeError("cannot write /proc/sys/vm/drop_caches (not root?): use --cache-drop fadvise")
    drop_with_fadvise(paths)
    return "fadvise"


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    print(drop_page_cache(sys.argv[1:]))


if __name__ == "__main__":
    main()
