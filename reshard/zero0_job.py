"""A reshard job for a native MoE checkpoint saved without ZeRO (stage 0), run by every worker.

    python -m reshard SRC DST --target-dp 4 --target-ep 1      # job.py hands ZeRO-0 MoE saves here

DeepSpeed's ZeRO-0 MoE files hold whole tensors (reshard.formats.deepspeed_zero0_moe): there is
nothing to cut and exchange, so no rounds: the target's `expp_rank_{e}` optimizer files (one per
target EP rank) and the model-states file are each built by one worker from the source files
they draw on, memory-mapped, and every worker copies its share of the expert files
(reshard.file_shares). Steps (as in reshard.job, which this mirrors):

1. worker 0 inspects the source and checks the destination; every worker receives the result;
2. worker 0 takes the destination lock and creates DST/.reshard-staging/TAG;
3. each worker writes its target files and copies its share of the files that travel whole;
4. worker 0 writes the manifest and publishes: tag directory into place, `latest` last.
After every step all workers agree on success; on failure the staging is removed and DST
holds no new checkpoint (no resume: there are no rounds to resume).
"""
from __future__ import annotations

import os
import time

from reshard import __version__
from reshard.byte_io import hash_file
from reshard.collective import check_peers, on_rank0
from reshard.destination import STAGING, Staging, check_empty, check_paths
from reshard.errors import OptionError
from reshard.expert_layout import ExpertParams, expert_placement_lines
from reshard.file_shares import file_shares
from reshard.formats.deepspeed_schema import LATEST, RECOVERY_SCRIPTS
from reshard.formats.deepspeed_zero0_moe import (
    MODEL,
    Zero0MoeSource,
    inspect_zero0_moe,
    target_file_names,
    write_target_files,
)
from reshard.lock import LOCK_NAME, DestinationLock
from reshard.manifest import JOURNAL_NAME, Manifest, output_fingerprint, source_identity, write_journal
from reshard.options import ReshardOptions
from reshard.resources import anonymous_rss_bytes, peak_resident_bytes
from reshard.results import CheckpointResult, PhaseClock, WorkerReport
from reshard.runs import Unit
from reshard.topology import Topology
from reshard.transport import Transport


def written_by(target: Topology, workers: int) -> tuple[tuple[str, ...], ...]:
    """Per worker, the target files it builds: expp_rank_{e} by worker e % W, and the model-states
    file (which holds EP rank 0's optimizer dict again) by the builder of expp_rank_0."""
    names = target_file_names(target)
    shares: list[list[str]] = [[] for _ in range(workers)]
    shares[0].append(MODEL)
    for ep_rank, name in enumerate(names[1:]):
        shares[ep_rank % workers].append(name)
    return tuple(tuple(share) for share in shares)


def _target(opts: ReshardOptions, source: Zero0MoeSource) -> Topology:
    model = source.model_path()
    if opts.target_stage not in (None, 0):
        raise OptionError(f"{model}: --target-stage {opts.target_stage}: changing the ZeRO stage of a ZeRO-0 MoE "
                          "checkpoint is not supported")
    if opts.target_tp not in (None, 1):
        raise OptionError(f"{model}: --target-tp {opts.target_tp}: a ZeRO-0 MoE checkpoint has no tensor-parallel "
                          "metadata; only its dp and ep change")
    if opts.node_local:
        raise OptionError(f"{model}: --node-local is not supported for ZeRO-0 MoE checkpoints")
    return opts.checked_target(source.topology, source.expert_problem, model)


def run_zero0_unit(opts: ReshardOptions, unit: Unit, transport: Transport, clock: PhaseClock) -> CheckpointResult:
    started = time.perf_counter()

    def inspect():
        check_paths(unit.source, unit.destination)
        source = inspect_zero0_moe(unit.source, unit.tag, trust_pickle=opts.trust_pickle)
        return source, _target(opts, source)

    source, target = on_rank0(transport, inspect)
    clock.lap("inspect")
    experts = ExpertParams((), source.num_experts, (), ())
    result = CheckpointResult(source.save_dir, unit.destination, source.tag, source.describe(), source.topology,
                              target, transport.size, transport.name, 0, 0.0, opts.dry_run,
                              notes=expert_placement_lines(experts, target))
    writes = written_by(target, transport.size)
    result.notes.append("whole tensors per parameter (no ZeRO partitions): target files built by workers "
                        + ", ".join(f"{w}: {len(names)}" for w, names in enumerate(writes) if names))
    if opts.dry_run:
        result.seconds = time.perf_counter() - started
        return result

    staging = Staging(unit.destination, source.tag)
    lock = DestinationLock(unit.destination)

    def decide():
        names = [MODEL, *source.expert_files, *source.other_files] + [
            f"expp_rank_{e}_mp_rank_00_optim_states.pt" for e in range(source.topology.ep)]
        identity = source_identity(source.tag_dir, set(names))
        fingerprint = output_fingerprint(source.save_dir, source.tag, identity, target.dp, target_ep=target.ep)
        ours = {STAGING, LOCK_NAME, LATEST, *RECOVERY_SCRIPTS}
        check_empty(unit.destination, ours, opts.overwrite)
        created = not os.path.lexists(unit.destination)
        lock.acquire()
        try:
            staging.create()
            write_journal(staging.tag_dir, fingerprint, False, 0)
        except BaseException:
            lock.release()
            raise
        return identity, fingerprint, created

    identity, fingerprint, created = on_rank0(transport, decide)
    clock.lap("plan")
    report = WorkerReport(transport.rank, (), tuple(e for e in range(target.ep)
                                                    if f"expp_rank_{e}_mp_rank_00_optim_states.pt" in writes[transport.rank]))
    hashes, failure = {}, None
    try:
        paths, read = write_target_files(source, target, staging.tag_dir, list(writes[transport.rank]),
                                         trust_pickle=opts.trust_pickle)
        report.bytes_read = sum(os.path.getsize(path) for path in read)
        for path in paths:
            hashes[os.path.basename(path)] = {"bytes": os.path.getsize(path), "blake3": hash_file(path)}
        report.bytes_written = sum(h["bytes"] for h in hashes.values())
        sizes = {name: identity[name]["bytes"] for name in (*source.expert_files, *source.other_files)}
        copied = staging.copy_in_hashed(source.tag_dir, file_shares(sizes, transport.size)[transport.rank])
        report.bytes_carried = sum(h["bytes"] for h in copied.values())
        report.bytes_read += report.bytes_carried
        hashes.update(copied)
    except Exception as error:
        failure = error
    clock.lap("exchange+write")
    try:
        check_peers(transport, failure, "writing the target files")
        all_hashes = transport.all_gather_object(hashes)
        failure = None
        if transport.rank == 0:
            try:
                staging.copy_in(source.tag_dir, (), source.other_dirs)
                files = {}
                for worker_hashes in all_hashes:
                    files.update(worker_hashes)
                source_entry = {"save_dir": source.save_dir, "tag": source.tag, "dp_world_size": source.topology.dp,
                                "stage": 0, "optimizer": "wrapped" if source.wrapped else "torch",
                                "description": source.describe(), "files": identity}
                Manifest(fingerprint, source=source_entry, target={"dp_world_size": target.dp, "stage": 0,
                                                                   "ep": target.ep},
                         files=files, reshard_version=__version__).write(staging.tag_dir)
                os.unlink(os.path.join(staging.tag_dir, JOURNAL_NAME))
                staging.publish(unit.latest)
            except Exception as error:
                failure = error
        check_peers(transport, failure, "publishing the result")
    except BaseException:
        if transport.rank == 0:
            staging.discard()
            lock.release()
            if created and os.path.isdir(unit.destination) and not os.listdir(unit.destination):
                os.rmdir(unit.destination)
        raise
    if transport.rank == 0:
        lock.release()
    report.peak_rss_bytes = peak_resident_bytes()
    report.peak_anonymous_bytes = anonymous_rss_bytes()  # whole-file copies: no rounds to sample between
    clock.lap("publish")
    report.phases = clock.seconds
    result.reports = transport.all_gather_object(report)
    result.seconds = time.perf_counter() - started
    return result
