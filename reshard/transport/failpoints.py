"""Fault injection for tests: make a chosen worker die or a write fail at a chosen moment.

    RESHARD_FAILPOINTS="kill@round=3,worker=1"  torchrun ... -m reshard SRC DST --target-dp 3

Off unless the environment variable is set; each name is checked where it is declared
(`failpoint("kill", round=r, worker=w)`): it fires when every key=value given in the
variable matches. Names in use, both in the exchange loop: "kill" (SIGKILL this process) and
"stall" (sleep for an hour: a worker that hangs without dying).
Tests that run workers in-process inject I/O errors by patching os functions instead.
"""
from __future__ import annotations

import os
import signal
import time


def _parse(text: str) -> list[tuple[str, dict]]:
    points = []
    for item in filter(None, (part.strip() for part in text.split(";"))):
        name, _, condition = item.partition("@")
        pairs = dict(kv.split("=", 1) for kv in condition.split(",") if "=" in kv)
        points.append((name.strip(), {k.strip(): v.strip() for k, v in pairs.items()}))
    return points


def failpoint(name: str, **context) -> None:
    text = os.environ.get("RESHARD_FAILPOINTS")
    if not text:
        return
    for point, condition in _parse(text):
        if point == name and all(str(context.get(k)) == v for k, v in condition.items()):
            if name == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif name == "stall":
                time.sleep(3600)
