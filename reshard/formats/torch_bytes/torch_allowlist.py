"""torch's weights_only allowlist, extended only while reshard loads, and left as it was found.

    from reshard.formats.torch_bytes.torch_allowlist import allowed_globals
    with allowed_globals(schema.safe_globals()):      # DeepSpeed's names -> reshard's stand-ins
        tree = torch.load(path, weights_only=True)
    # afterwards torch.serialization.get_safe_globals() is what it was before

torch 2.13 keeps the allowlist in one process-wide set (torch/_weights_only_unpickler.py
`_marked_safe_globals_set`; `add_safe_globals` unions into it and never takes anything out).
Its scoped form, `torch.serialization.safe_globals` (`_safe_globals.__enter__`/`__exit__`), adds
on entry and removes on exit with no count: when two threads load at once, the first to leave
removes the entries the other is still loading with, and an entry the process had allowed
before is removed too. So reshard does not register its stand-ins for good (an in-job load would
leave the training process mapping DeepSpeed's class names to reshard's stand-ins in every later
`torch.load(weights_only=True)`), and does not use the context manager bare either: it counts
holders under a lock, enters torch's context manager for what the process did not already allow
when the first holder arrives, and leaves it when the last holder goes. Any other thread of the
process that calls `torch.load(weights_only=True)` while a reshard load is under way sees the
stand-ins for that moment: torch has no per-call allowlist to pass them through instead
(`torch.load` refuses a custom `pickle_module` under weights_only).
"""
from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from reshard.formats.torch_bytes.torch_release import require

_lock = threading.Lock()
_holders: Counter = Counter()
"""entry -> how many reshard scopes hold it (only entries reshard itself added)."""
_scopes: dict = {}
"""entry -> the torch.serialization.safe_globals context that added it (exited by the last holder)."""


@contextmanager
def allowed_globals(entries: Iterable) -> Iterator[None]:
    """`entries` (classes, or (class, "module.Name") pairs) allowed for weights_only loads inside
    the block; on leaving, torch's allowlist holds what it held before the first scope began."""
    import torch

    wanted = list(dict.fromkeys(entries))
    if any(isinstance(entry, tuple) for entry in wanted):
        require("named_allowlist")  # torch 2.5 would fail inside torch.load on the pair's __module__
    held = []
    with _lock:
        before = set(torch.serialization.get_safe_globals())
        added = [entry for entry in wanted if not _holders[entry] and entry not in before]
        for entry in added:
            scope = torch.serialization.safe_globals([entry])
            scope.__enter__()
            _scopes[entry] = scope
        held = [entry for entry in wanted if _holders[entry] or entry in added]
        for entry in held:
            _holders[entry] += 1
    try:
        yield
    finally:
        with _lock:
            for entry in held:
                _holders[entry] -= 1
                if not _holders[entry]:
                    del _holders[entry]
                    _scopes.pop(entry).__exit__(None, None, None)
