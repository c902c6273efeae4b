"""The progress bar every job draws on stderr (tqdm), on worker 0 only.

    from reshard.jobs.progress import Progress, progress_enabled
    with Progress("reshard", progress_enabled(opts.quiet)) as bar:
        bar.start(total_bytes)            # or bar.start(None): elapsed time only, while work has no count
        bar.update(nbytes)

When it is drawn (`progress_enabled`): never with --quiet, never on a worker other than worker 0
(torchrun's, SLURM's or an MPI launcher's rank 0; the one process of `--workers` that reports),
and otherwise when stderr is a terminal. RESHARD_PROGRESS=1 draws it also when stderr is not a
terminal (a log file: tqdm then writes a line per refresh), RESHARD_PROGRESS=0 never. The
summary on stdout is the same either way.

A job's rounds (`reshard.jobs.execute`, with `start_rounds`) count the bytes all workers move;
a step with no rounds to count (verify without --against) counts what worker 0 has
done of its own share, or, while a step has no count, shows the seconds it has taken.
"""
from __future__ import annotations

import os
import sys
import threading

from reshard.planning.plan import ReshardPlan
from reshard.transport import is_first_worker

PROGRESS_VARIABLE = "RESHARD_PROGRESS"
"""1: draw the bar although stderr is not a terminal; 0: never draw it."""

TICK_SECONDS = 1.0
"""How often a bar with no count redraws its elapsed time."""


def progress_enabled(quiet: bool, first_worker: bool | None = None) -> bool:
    """Whether this process draws the bar: not quiet, worker 0 (`first_worker`, else the launcher's
    rank), and stderr a terminal unless RESHARD_PROGRESS says otherwise."""
    if quiet or not (is_first_worker() if first_worker is None else first_worker):
        return False
    forced = os.environ.get(PROGRESS_VARIABLE, "").strip()
    if forced in ("0", "1"):
        return forced == "1"
    return sys.stderr.isatty()


class Progress:
    """One tqdm bar on stderr, or nothing when not `enabled`. The bar appears at `start` (a job
    starts it once every worker has opened its files, so that a refusal is not preceded by an
    empty bar) and is closed by `close` or on leaving the `with` block."""

    def __init__(self, description: str, enabled: bool, unit: str = "B"):
        self.description, self.enabled, self.unit = description, enabled, unit
        self.bar = None
        self._ticker: threading.Event | None = None

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self, total: int | None, initial: int = 0, description: str | None = None) -> None:
        """Draw the bar: `total` units, `initial` of them done; None: no total, the count so far and
        the elapsed time, redrawn every TICK_SECONDS."""
        if not self.enabled:
            return
        self.close()
        from tqdm import tqdm
        scaled = self.unit == "B"
        self.bar = tqdm(total=total, initial=initial, unit=self.unit, unit_scale=scaled, unit_divisor=1024,
                        desc=description or self.description, file=sys.stderr, dynamic_ncols=True,
                        bar_format=None if total is not None else "{desc}: {n_fmt} [{elapsed}]")
        if total is None:  # a long step may advance nothing: redraw the seconds from a thread until closed
            stop = self._ticker = threading.Event()
            bar = self.bar

            def tick() -> None:
                while not stop.wait(TICK_SECONDS):
                    bar.refresh()
            threading.Thread(target=tick, name="reshard-progress", daemon=True).start()

    def start_rounds(self, plan: ReshardPlan, rounds_done: int = 0) -> None:
        """Draw the bar over the bytes all workers move in `plan`'s rounds, the first `rounds_done` done."""
        if self.enabled and plan.rounds > 0:
            per_round = plan.round_bytes()
            self.start(sum(per_round), sum(per_round[:rounds_done]))

    def update(self, amount: int) -> None:
        if self.bar is not None:
            self.bar.update(amount)
            if self.bar.total is not None and self.bar.n >= self.bar.total:
                self.close()  # done: the rate shown is the work's, not that of what follows

    def close(self) -> None:
        if self._ticker is not None:
            self._ticker.set()
            self._ticker = None
        if self.bar is not None:
            self.bar.close()
            self.bar = None
