"""A reshard job for a native MoE checkpoint saved without ZeRO (stage 0), run by every worker.

    python -m reshard SRC DST --target-dp 4 --target-ep 1      # job.py hands ZeRO-0 MoE saves here

DeepSpeed's ZeRO-0 MoE files hold whole tensors (reshard.formats.deepspeed_zero0_moe): there is
nothing to cut and exchange, so no rounds: the target's `expp_rank_{e}` optimizer files (one per
target EP rank) and the model-states file are each built by one worker from the source files
they draw on, memory-mapped, and every worker copies its share of the expert files
(reshard.planning.file_shares). Worker 0 inspects the source and checks the options here; the rest
(lock, staging, journal, each worker's files, manifest, publish, clean-up on failure) is the
lifecycle in reshard.jobs.whole_file_job, given which files each worker builds (`written_by`) and how
(reshard.formats.deepspeed_zero0_moe.write_target_files).
"""
from __future__ import annotations

import os
import time

from reshard.errors import OptionError
from reshard.layouts.experts import ExpertParams, expert_placement_lines
from reshard.formats.deepspeed_zero0_moe import (
    MODEL,
    Zero0MoeSource,
    inspect_zero0_moe,
    target_file_names,
    write_target_files,
)
from reshard.jobs.manifest import output_fingerprint
from reshard.jobs.options import ReshardOptions
from reshard.jobs.results import CheckpointResult, PhaseClock, WorkerReport
from reshard.jobs.runs import Unit
from reshard.topology import Topology
from reshard.transport import Transport
from reshard.jobs.whole_file_job import (
    WholeFileSource,
    inspect_on_worker0,
    run_whole_file_job,
)


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

    source, target = inspect_on_worker0(unit, transport, clock,
                                        lambda src, tag: inspect_zero0_moe(src, tag, trust_pickle=opts.trust_pickle),
                                        lambda source: _target(opts, source))
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

    def optim_name(ep_rank: int) -> str:
        return f"expp_rank_{ep_rank}_mp_rank_00_optim_states.pt"

    carried = (*source.expert_files, *source.other_files)
    whole_files = WholeFileSource(
        source.tag, source.tag_dir, (MODEL, *carried, *map(optim_name, range(source.topology.ep))), carried, tuple(source.other_dirs),
        {"save_dir": source.save_dir, "tag": source.tag, "dp_world_size": source.topology.dp, "stage": 0,
         "optimizer": "wrapped" if source.wrapped else "torch", "description": source.describe()},
        save_dir=source.save_dir)

    def build(tag_dir: str, identity: dict, report: WorkerReport) -> list[str]:
        paths, read = write_target_files(source, target, tag_dir, list(writes[transport.rank]),
                                         trust_pickle=opts.trust_pickle)
        report.bytes_read += sum(os.path.getsize(path) for path in read)
        return paths

    report = WorkerReport(transport.rank, (), tuple(e for e in range(target.ep)
                                                    if optim_name(e) in writes[transport.rank]))
    return run_whole_file_job(
        opts, unit, transport, clock, result, started, whole_files,
        lambda identity: output_fingerprint(source.save_dir, source.tag, identity, target.dp, target_ep=target.ep),
        {"dp_world_size": target.dp, "stage": 0, "ep": target.ep}, report, build)
