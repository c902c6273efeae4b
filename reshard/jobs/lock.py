"""One job per destination: an exclusive lock file naming its holder.

    with DestinationLock("/ckpt/run1-dp16"):
        ...                       # a second job on the same DST is refused meanwhile

The lock is DST/.reshard.lock, created with O_EXCL and holding {"host", "pid", "started"}.
A lock left by a process that no longer runs on this host (killed, OOM) is reported and
taken over; a live holder, or one on another host (whose liveness cannot be checked from
here), makes the new job fail with a message naming it.
"""
from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass

from reshard.errors import OptionError

LOCK_NAME = ".reshard.lock"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass
class DestinationLock:
    destination: str
    stale_note: str | None = None
    """Set when a stale lock was found and taken over (for the job summary)."""

    @property
    def path(self) -> str:
        return os.path.join(self.destination, LOCK_NAME)

    def acquire(self) -> "DestinationLock":
        os.makedirs(self.destination, exist_ok=True)
        record = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.strftime("%Y-%m-%dT%H:%M:%S")}
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                self._handle_existing(record)
                continue
            with os.fdopen(fd, "w") as out:
                json.dump(record, out)
            return self
        raise OptionError(f"{self.path}: could not take the lock")

    def _handle_existing(self, me: dict) -> None:
        try:
            with open(self.path) as fd:
                holder = json.load(fd)
            host, pid = holder["host"], int(holder["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            raise OptionError(f"{self.path}: another reshard job holds this destination (unreadable lock file); "
                              "if no job is running, remove the file") from None
        if host == me["host"] and not _alive(pid):
            self.stale_note = (f"took over a stale lock from pid {pid} on {host} (started {holder.get('started')}), "
                               "which is no longer running")
            os.unlink(self.path)
            return
        where = "on this host" if host == me["host"] else f"on host {host}"
        raise OptionError(f"{self.destination}: another reshard job is writing here (pid {pid} {where}, started "
                          f"{holder.get('started')}, lock {self.path}); wait for it, or remove the lock if that job is gone")

    def release(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()
