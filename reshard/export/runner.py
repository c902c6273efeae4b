"""What every export runs on every worker: the reshard job's lifecycle (lock, staging, journal,
resume, atomic publish) around the one skeleton (`reshard.execute`).

    from reshard.export.runner import ExportOutput, run_export
    output = ExportOutput(destination, tag, fingerprint, overwrite)
    run_export(transport, source, plan, output, open_writer=lambda files, staged, reuse: MyWriter(...),
               publish=lambda staging: staging.publish_files(last="index.json"), trust_pickle=False)

1. worker 0 takes OUT's lock (`reshard.lock`) and either finds the staging of an interrupted
   run of this same export (same source, options, workers and budget: its journal,
   `reshard.manifest`) and resumes it, or creates a fresh OUT/.reshard-staging/TAG
   (`reshard.destination.Staging`); every worker learns which;
2. each worker opens (and validates) the source rank files it reads and lets `open_writer`
   create (or, resuming, reopen) the output files it owns (`plan.ownership` target ranks) in
   the staging directory; all agree on success; worker 0 journals that the files exist;
3. all workers run the plan's rounds from the first one not yet durable; worker 0 journals
   every durable stretch;
4. `writer.finish()` (its own copies, fsync, close); all agree;
5. worker 0 removes the journal and runs `publish(staging)`: it completes the staged output and
   moves it into OUT (a tag directory by one rename, or files with the completing one last);
   all agree.
A failure before the rounds removes the staging (and OUT, when this run created it); after,
the staging stays for a resume and the message says so. OUT holds no output that looks
complete until the publish. Returns each worker's peak RSS in bytes, gathered on every worker.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from reshard.collective import check_peers, on_rank0
from reshard.destination import (
    Staging,
    check_empty,
    clean_up_after_failure,
    what_was_kept,
)
from reshard.errors import ReshardError
from reshard.execute import execute
from reshard.formats.deepspeed_spec import SourceCheckpoint
from reshard.lock import LOCK_NAME, DestinationLock
from reshard.manifest import JOURNAL_NAME, plan_fingerprint, read_journal, write_journal
from reshard.plan import ReshardPlan
from reshard.resources import peak_resident_bytes
from reshard.source_reader import SourceReader


@dataclass
class ExportOutput:
    """Where an export goes and what identifies it (for resuming an interrupted run)."""

    destination: str
    tag: str
    """The source tag: names the staging directory OUT/.reshard-staging/TAG."""
    fingerprint: str
    """`reshard.manifest.export_fingerprint` of the source and the export's options."""
    overwrite: bool = False
    durable_every: int = 1 << 30
    """Bytes moved (all workers together) between the journal's resume points."""
    resumed_rounds: int | None = None
    """Set on every worker: the rounds an interrupted run had made durable, or None (a fresh run)."""
    notes: list = field(default_factory=list)


@dataclass
class _Start:
    plan_fingerprint: str
    resume: bool = False
    rounds_done: int = 0
    created_destination: bool = False
    notes: list = field(default_factory=list)


def _decide_start(output: ExportOutput, plan: ReshardPlan, staging: Staging, lock: DestinationLock) -> _Start:
    """Worker 0: refuse a non-empty OUT (unless --overwrite), lock it, resume or create the staging."""
    check_empty(output.destination, {os.path.basename(staging.root), LOCK_NAME}, output.overwrite)
    start = _Start(plan_fingerprint(output.fingerprint, plan.ownership.workers, plan.budget_bytes))
    journal = read_journal(staging.tag_dir)
    start.created_destination = not os.path.lexists(output.destination)
    lock.acquire()
    if lock.stale_note:
        start.notes.append(lock.stale_note)
    if journal and journal.get("plan_fingerprint") == start.plan_fingerprint and journal.get("skeletons"):
        start.resume, start.rounds_done = True, int(journal.get("rounds_done", 0))
        start.notes.append(f"resuming an interrupted export: {start.rounds_done} of {plan.rounds} rounds were done")
        return start
    if journal:
        start.notes.append("discarded the staging of an earlier export with a different plan "
                           "(source, options, worker count or budget changed)")
    try:
        staging.create()
        write_journal(staging.tag_dir, start.plan_fingerprint, False, 0)
    except BaseException:
        clean_up_after_failure(staging, lock, keep_staging=False, remove_destination=start.created_destination)
        raise
    return start


def run_export(transport, source: SourceCheckpoint, plan: ReshardPlan, output: ExportOutput, open_writer, publish, *,
               trust_pickle: bool = False) -> list[int]:
    """`open_writer(target_ranks, staged_dir, reuse_existing)` creates this worker's writer;
    `publish(staging)` (worker 0, after every writer finished) completes and places the output."""
    own = plan.ownership
    leader = transport.rank == 0
    staging = Staging(output.destination, output.tag)
    lock = DestinationLock(output.destination)

    def decide():
        try:
            return _decide_start(output, plan, staging, lock)
        except OSError as error:
            detail = f"{error.filename}: {error.strerror}" if error.filename else error.strerror
            raise ReshardError(f"{output.destination}: cannot be created or written ({detail})") from None

    start: _Start = on_rank0(transport, decide)
    output.resumed_rounds = start.rounds_done if start.resume else None
    output.notes += start.notes
    rounds_started = False

    def opened(reader, writer) -> None:
        nonlocal rounds_started
        if leader and not start.resume:
            write_journal(staging.tag_dir, start.plan_fingerprint, True, 0)
        rounds_started = True

    def journal(rounds_done: int) -> None:
        if leader:
            write_journal(staging.tag_dir, start.plan_fingerprint, True, rounds_done)

    def publish_on_worker_0(reader, writer, finished) -> None:
        failure = None
        if leader:
            try:
                os.unlink(os.path.join(staging.tag_dir, JOURNAL_NAME))
                publish(staging)
            except Exception as error:
                failure = error
        check_peers(transport, failure, "publishing the output")

    try:
        execute(plan, transport,
                open_source=lambda: SourceReader.open(source, own.source_ranks_of(transport.rank),
                                                      trust_pickle=trust_pickle),
                open_sink=lambda: open_writer(own.target_ranks_of(transport.rank), staging.tag_dir, start.resume),
                opening="opening source files and creating output files", opened=opened,
                finish=lambda reader, writer: writer.finish(), finishing="writing output files",
                after=publish_on_worker_0, start_round=start.rounds_done,
                durable_every_bytes=output.durable_every, on_durable=journal)
    except BaseException as error:
        removed = False
        if leader:
            removed = clean_up_after_failure(staging, lock, keep_staging=rounds_started,
                                             remove_destination=start.created_destination)
        if isinstance(error, OSError):
            error = ReshardError(f"{error.filename or staging.tag_dir}: writing failed: {error.strerror or error}")
        if isinstance(error, ReshardError):
            error.args = (str(error) + what_was_kept(staging, rounds_started, removed),)
            raise error from None
        raise
    if leader:
        lock.release()
    return transport.all_gather_object(peak_resident_bytes())
