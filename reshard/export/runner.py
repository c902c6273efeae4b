"""What every export runs on every worker: the one lifecycle (`reshard.jobs.lifecycle`: lock, staging,
journal, resume, atomic publish) around the one skeleton (`reshard.jobs.execute`).

    from reshard.export.runner import ExportOutput, run_export
    output = ExportOutput(destination, tag, fingerprint, overwrite)
    run_export(transport, source, plan, output, open_writer=lambda files, staged, reuse: MyWriter(...),
               publish=lambda staging: publish_files(staging, last="index.json"), trust_pickle=False)

1. worker 0 refuses an OUT holding anything but reshard's own staging and lock (unless
   --overwrite), takes OUT's lock (`reshard.jobs.lock`) and either finds the staging of an
   interrupted run of this same export (same source, options, workers and budget: its journal,
   `reshard.jobs.manifest`) and resumes it, or creates a fresh OUT/.reshard-staging/TAG
   (`reshard.jobs.destination.Staging`); every worker learns which; the lifecycle does all of
   this (`reshard.jobs.lifecycle.Lifecycle.begin`), the export none of it;
2. each worker opens (and validates) the source rank files it reads and lets `open_writer`
   create (or, resuming, reopen) the output files it owns (`plan.ownership` target ranks) in
   the staging directory; all agree on success; worker 0 journals that the files exist;
3. all workers run the plan's rounds from the first one not yet durable; worker 0 journals
   every durable stretch;
4. `writer.finish()` (its own copies, fsync, close); all agree;
5. worker 0 runs `publish(staging)`: it completes the staged output and places it through the
   lifecycle (`reshard.jobs.lifecycle.publish_tag_dir`: the journal removed, the tag directory by
   one rename, the pointer file last and atomically; or `publish_files`: the journal removed,
   files moved with the completing one last); all agree.
A failure before the rounds removes the staging (and OUT, when this run created it); after,
the staging stays for a resume and the message says so. OUT holds no output that looks
complete until the publish. Returns what every export reports (reshard.jobs.results.ExportResult: where
from and to, workers, rounds, seconds since `started`, each worker's peak RSS, the lifecycle's notes), on
every worker; each format's result adds what it wrote (`ExportResult.of`).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from reshard.jobs.destination import RESHARD_NAMES
from reshard.jobs.execute import execute
from reshard.formats.deepspeed_files.deepspeed_spec import SourceCheckpoint
from reshard.jobs.lifecycle import EXPORT, JobOutput, Lifecycle
from reshard.jobs.manifest import plan_fingerprint
from reshard.jobs.progress import Progress, progress_enabled
from reshard.jobs.results import ExportResult
from reshard.planning.plan import ReshardPlan
from reshard.files.resources import peak_resident_bytes
from reshard.formats.deepspeed_files.source_reader import SourceReader


@dataclass
class ExportOutput:
    """Where an export goes and what identifies it (for resuming an interrupted run)."""

    destination: str
    tag: str
    """The source tag: names the staging directory OUT/.reshard-staging/TAG."""
    fingerprint: str
    """`reshard.jobs.manifest.export_fingerprint` of the source and the export's options."""
    overwrite: bool = False
    durable_every: int = 1 << 30
    """Bytes moved (all workers together) between the journal's resume points."""
    resumed_rounds: int | None = None
    """Set on every worker: the rounds an interrupted run had made durable, or None (a fresh run)."""
    notes: list = field(default_factory=list)


def run_export(transport, source: SourceCheckpoint, plan: ReshardPlan, output: ExportOutput, open_writer, publish, *,
               trust_pickle: bool = False, started: float | None = None) -> ExportResult:
    """`open_writer(target_ranks, staged_dir, reuse_existing)` creates this worker's writer;
    `publish(staging)` (worker 0, after every writer finished) completes the output in staging and
    places it with reshard.jobs.lifecycle.publish_tag_dir or publish_files. `started`: the
    time.perf_counter() at which the export began (before its inspection), else this call."""
    started = time.perf_counter() if started is None else started
    own = plan.ownership
    life = Lifecycle(output.destination, output.tag, leader=transport.rank == 0, overwrite=output.overwrite,
                     words=EXPORT)
    staging = life.staging
    start = life.begin(transport, lambda: JobOutput(  # OUT may hold reshard's staging and lock, nothing else
        output.fingerprint, set(RESHARD_NAMES),
        plan_fingerprint(output.fingerprint, plan.ownership.workers, plan.budget_bytes), plan.rounds))
    output.resumed_rounds = start.rounds_done if start.mode == "resume" else None
    output.notes += start.notes

    life.run(lambda: execute(
        plan, transport,
        open_source=lambda: SourceReader.open(source, own.source_ranks_of(transport.rank), target=None,
                                              trust_pickle=trust_pickle),
        open_sink=lambda: open_writer(own.target_ranks_of(transport.rank), staging.tag_dir, start.skeletons),
        opening="opening source files and creating output files", opened=lambda reader, writer: life.opened(),
        finish=lambda reader, writer: writer.finish(), finishing="writing output files",
        after=lambda reader, writer, finished: life.publish(transport, None, lambda _: publish(staging)),
        start_round=start.rounds_done, durable_every_bytes=output.durable_every, on_durable=life.journal,
        progress=Progress("export", progress_enabled(False, transport.rank == 0))))
    peak_rss = transport.all_gather_object(peak_resident_bytes())
    return ExportResult(source.save_dir, output.destination, output.tag, transport.size, plan.rounds,
                        time.perf_counter() - started, peak_rss, output.notes)
