"""Whole-file reshard jobs on the one lifecycle (reshard.jobs.lifecycle), used by pipeline_job.

    python -m reshard SRC DST --target-dp 3 --target-tp 1   # a PipelineModule save changing tp: pipeline_job runs this

Jobs whose target files are each built whole by one worker (no rounds, no exchange) run the
lifecycle every job runs; only which files a worker builds and how, and what the manifest says
about source and target, differ, and those come in as values and a callable:

1. `inspect_on_worker0`: worker 0 checks the paths, inspects the source and derives the target
   (the job's callables, which check its options); every worker receives both;
2. `run_whole_file_job`: the lifecycle begins (worker 0 checks the destination, takes its lock,
   creates DST/.reshard-staging/TAG and writes the journal); the `JobOutput` it is given has no
   plan fingerprint, so there is never a resume: there are no rounds to resume;
3. each worker builds its own files (the job's `build`) and copies its share of the files that
   travel whole (reshard.planning.file_shares, by size);
4. the lifecycle publishes: worker 0 writes the manifest, the tag directory goes into place,
   `latest` last (reshard.jobs.lifecycle.publish_tag_dir).
After every step all workers agree on success (reshard.transport.collective.check_peers); on failure
`Lifecycle.run` removes the staging, releases the lock and removes a DST this run created.
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from reshard.files.byte_io import hash_file
from reshard.transport.collective import check_peers, on_rank0
from reshard.jobs.destination import SAVE_DIR_NAMES, check_paths
from reshard.planning.file_shares import file_shares
from reshard.jobs.lifecycle import JobOutput, Lifecycle, publish_tag_dir
from reshard.jobs.manifest import Manifest, source_identity
from reshard.jobs.options import ReshardOptions
from reshard.jobs.progress import Progress, progress_enabled
from reshard.files.resources import anonymous_rss_bytes, peak_resident_bytes
from reshard.jobs.results import CheckpointResult, PhaseClock, WorkerReport
from reshard.jobs.runs import Unit
from reshard.transport import Transport
from reshard.version import __version__


@dataclass
class WholeFileSource:
    """What the lifecycle needs of an inspected source, whatever its format."""
    tag: str
    tag_dir: str
    identified: tuple[str, ...]      # the files the output's fingerprint and manifest name (source_identity)
    carried: tuple[str, ...]         # files copied unchanged, shared out between workers by size
    directories: tuple[str, ...] = ()  # sub-directories of the tag directory, re-created by worker 0
    manifest_source: dict | None = None  # the manifest's "source" entry, less "files" (added last)
    save_dir: str | None = None      # the source save directory: its recovery scripts are carried, no others


def inspect_on_worker0(unit: Unit, transport: Transport, clock: PhaseClock, inspect: Callable[[str, str], object],
                       target_of: Callable[[object], object]) -> tuple:
    """Step 1 above: (source, target), computed by worker 0 and received by every worker.
    `inspect(src, tag)` reads the source; `target_of(source)` checks the options against it."""
    def source_and_target():
        check_paths(unit.source, unit.destination)
        source = inspect(unit.source, unit.tag)
        return source, target_of(source)

    source, target = on_rank0(transport, source_and_target)
    clock.lap("inspect")
    return source, target


def run_whole_file_job(opts: ReshardOptions, unit: Unit, transport: Transport, clock: PhaseClock,
                       result: CheckpointResult, started: float, source: WholeFileSource,
                       fingerprint_of: Callable[[dict], dict], manifest_target: dict, report: WorkerReport,
                       build: Callable[[str, dict, WorkerReport], list[str]]) -> CheckpointResult:
    """Steps 2-4 above, on every worker; fills `result.reports` and `result.seconds`.

    `fingerprint_of(identity)`: the output's fingerprint (reshard.jobs.manifest.output_fingerprint).
    `build(staging_tag_dir, identity, report)`: writes this worker's target files into staging,
    adds what it read to `report.bytes_read`, and returns the paths it wrote, in manifest order."""
    life = Lifecycle(unit.destination, source.tag, leader=transport.rank == 0, overwrite=opts.overwrite)

    def describe() -> JobOutput:  # whole files: nothing to resume, no earlier output compared
        identity = source_identity(source.tag_dir, set(source.identified))
        # DST may hold reshard's staging and lock, `latest` and the recovery scripts, as a save directory does
        return JobOutput(fingerprint_of(identity), set(SAVE_DIR_NAMES), identity=identity)

    start = life.begin(transport, describe)
    identity = start.identity
    clock.lap("plan")
    staging = life.staging

    def work() -> None:
        hashes, failure = {}, None
        # whole files, no rounds to count: worker 0's own files as they are done, and the seconds
        progress = Progress(f"reshard {source.tag}, files written by worker 0",
                            progress_enabled(opts.quiet, transport.rank == 0), unit="file")
        try:
            progress.start(None)
            for path in build(staging.tag_dir, identity, report):
                hashes[os.path.basename(path)] = {"bytes": os.path.getsize(path), "blake3": hash_file(path)}
                progress.update(1)
            report.bytes_written = sum(h["bytes"] for h in hashes.values())
            sizes = {name: identity[name]["bytes"] for name in source.carried}
            copied = staging.copy_in_hashed(source.tag_dir, file_shares(sizes, transport.size)[transport.rank])
            report.bytes_carried = sum(h["bytes"] for h in copied.values())
            report.bytes_read += report.bytes_carried
            hashes.update(copied)
        except Exception as error:
            failure = error
        finally:
            progress.close()
        clock.lap("exchange+write")
        check_peers(transport, failure, "writing the target files")

        def place(all_hashes: list) -> None:
            staging.copy_in(source.tag_dir, (), source.directories)
            files = {}
            for worker_hashes in all_hashes:
                files.update(worker_hashes)
            publish_tag_dir(staging, Manifest(start.output_fingerprint,
                                              source={**(source.manifest_source or {}), "files": identity},
                                              target=manifest_target, files=files, reshard_version=__version__),
                            unit.latest, scripts_from=source.save_dir)

        life.publish(transport, hashes, place)

    life.run(work)
    report.peak_rss_bytes = peak_resident_bytes()
    report.peak_anonymous_bytes = anonymous_rss_bytes()  # whole-file copies: no rounds to sample between
    clock.lap("publish")
    report.phases = clock.seconds
    result.reports = transport.all_gather_object(report)
    result.seconds = time.perf_counter() - started
    return result
