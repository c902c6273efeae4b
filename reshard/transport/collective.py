"""How workers agree: one worker decides and all learn it; all report and all learn any failure.

    source = on_rank0(transport, lambda: inspect_checkpoint(src))   # every worker gets it, or the error
    check_peers(transport, failure, "opening files")                 # every worker raises if any failed

These are the only points where a job's workers wait for each other besides the rounds'
all-to-all; calling them at the same places on every worker is what keeps a failing worker
from leaving the others hanging.
"""
from __future__ import annotations

from reshard.errors import PeerFailure, ReshardError


def on_rank0(transport, work):
    """Run `work()` on worker 0; every worker gets its result or raises its ReshardError."""
    return on_worker(transport, 0, work)


def on_worker(transport, worker: int, work):
    """Run `work()` on `worker`; every worker gets its result or raises its ReshardError."""
    outcome, crash = None, None
    if transport.rank == worker:
        try:
            outcome = ("ok", work())
        except ReshardError as error:
            outcome = ("error", error)
        except Exception as error:  # a bug: worker 0 keeps its traceback, the others stop too
            outcome, crash = ("error", PeerFailure(f"worker {worker} failed: {type(error).__name__}: {error}")), error
    outcome = transport.broadcast_object(outcome, src=worker)
    if crash is not None:
        raise crash
    if outcome[0] == "error":
        raise outcome[1]
    return outcome[1]


def check_peers(transport, failure: BaseException | None, stage: str) -> None:
    """Every worker learns whether any worker failed at `stage`; the failing one re-raises its own error."""
    reports = transport.all_gather_object(None if failure is None else f"{type(failure).__name__}: {failure}")
    if failure is not None:
        raise failure
    failed = [(worker, report) for worker, report in enumerate(reports) if report is not None]
    if failed:
        worker, report = failed[0]
        raise PeerFailure(f"worker {worker} failed during {stage}: {report}")
