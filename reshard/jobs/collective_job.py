"""A reshard job from start to finish, run by every worker.

    from reshard import reshard_checkpoint
    result = reshard_checkpoint("/ckpt/run1", "/ckpt/run1-dp16", target_dp=16)
    print(result.summary())

Under torchrun every worker calls the same function; alone it runs as one worker. Steps,
and which workers run them:

1. worker 0 inspects the source (pickles only) and checks the destination; every worker
   receives the result, or the error;
2. every worker derives the same plan from it (pure);
3. worker 0 creates DST/.reshard-staging/TAG; each worker checks and opens the source files
   it reads and writes the skeletons of the target files it owns;
4. all workers run the rounds together (`reshard.transport.exchange`);
5. each worker fsyncs its files; worker 0 publishes: tag directory into place, `latest` last.

After every step all workers agree on success before the next one; on any failure every
worker raises and the destination holds no new checkpoint. Staging is removed when the
failure came before the rounds, and kept (with its journal) after: re-running the same
command resumes from the last durable round.
"""
from __future__ import annotations

import dataclasses
import os
import sys
import time
from collections.abc import Callable
from typing import Protocol

from reshard.jobs import save_dir_files
from reshard.files.byte_io import hash_file
from reshard.transport.collective import check_peers, on_rank0
from reshard.jobs.destination import Staging, check_paths, stale_staging_notes
from reshard.errors import OptionError, ReshardError
from reshard.jobs.execute import execute
from reshard.jobs.progress import Progress, progress_enabled
from reshard.layouts.experts import expert_placement_lines
from reshard.planning.file_shares import file_shares
from reshard.formats.deepspeed_files.folded_expert_files import (
    rewrites_expert_files,
    target_expert_files,
    write_expert_files,
)
from reshard.formats.deepspeed_files.deepspeed_inspect import inspect_pipeline_columns
from reshard.formats.deepspeed_files.deepspeed_save_kind import inspect_save
from reshard.formats.deepspeed_files.deepspeed_spec import SourceCheckpoint
from reshard.formats.torch_bytes.torch_archive import torch_fallbacks
from reshard.jobs.lifecycle import (
    JobOutput,
    Lifecycle,
    Start,
    destination_names,
    publish_checkpoint,
)
from reshard.jobs.node_local import NodeLocal
from reshard.jobs.node_local_columns import ColumnsOnNodes
from reshard.jobs.manifest import output_entries, plan_fingerprint, source_identity
from reshard.jobs.options import ReshardOptions
from reshard.planning.plan import Ownership, ReshardPlan
from reshard.jobs.preflight import (
    ZERO3_RANK_IDENTITY_NOTE,
    CheckpointTarget,
    checkpoint_target,
    outputs_of,
    preflight,
)
from reshard.files.resources import PeakAnonymousMemory, ensure_open_files, files_per_worker, peak_resident_bytes
from reshard.jobs.preflight import output_bytes
from reshard.jobs.results import CheckpointResult, PhaseClock, ReshardResult, WorkerReport
from reshard.jobs.runs import Unit, discover_units
from reshard.formats.deepspeed_files.source_reader import SourceReader
from reshard.formats.deepspeed_files.stage_change import ZeroStageTarget
from reshard.formats.deepspeed_files.target_writer import TargetWriter
from reshard.topology import LayerFiles, PipelineStages, Topology
from reshard.transport import Transport, transport_from_environment


def reshard_checkpoint(source: str, destination: str, target_dp: int, *, transport: Transport | None = None,
                       target_tp: int | None = None, **options) -> ReshardResult:
    """Reshard the DeepSpeed checkpoint(s) in `source` for `target_dp` ranks into `destination`.

    `source` is a save directory, or a run directory whose sub-directories are save
    directories (see reshard.jobs.runs). Keyword options are the fields of `ReshardOptions` (tag,
    all_tags, memory_budget, overwrite, dry_run, quiet, trust_pickle, backend, timeout). Uses
    the given transport, else the initialised torch.distributed group, else one worker.
    `target_stage=S` also changes the ZeRO stage (1, 2 or 3; see reshard.formats.deepspeed_files.stage_change).
    Raises ReshardError on bad input.
    """
    opts = ReshardOptions(source=str(source), destination=str(destination), target_dp=target_dp, target_tp=target_tp,
                          **options)
    return run_job(opts.validate(), transport)


def run_job(opts: ReshardOptions, transport: Transport | None = None, *, started: float | None = None
            ) -> ReshardResult:
    """Run the job `opts` describes. `started`: the time.perf_counter() at which the start-up
    phase began (the command line passes its process's start), else this call."""
    if opts.array_tasks is not None:  # one SLURM array task: no transport, no peers
        from reshard.jobs.array_job import run_array_task
        return run_array_task(opts, inspect_pipeline_target)
    clock = PhaseClock(started)
    own_transport = transport is None
    transport = transport or transport_from_environment(opts.backend, opts.timeout, opts.transport)
    clock.lap("start-up")
    try:
        started = time.perf_counter()
        placement = (NodeLocal(ColumnsOnNodes(columns_target))
                     if opts.node_local else WholeWorld(leader=transport.rank == 0))
        units, notes = placement.units(opts, transport)
        result = ReshardResult(notes=notes)
        clock.lap("inspect")
        for unit in units:
            result.checkpoints.append(_run_unit(opts, unit, transport, clock, placement))
            clock = PhaseClock()
        if transport.rank == 0:
            for destination in dict.fromkeys(unit.destination for unit in units):
                result.notes += stale_staging_notes(destination, [u.tag for u in units if u.destination == destination])
        result.seconds = time.perf_counter() - started
        return result
    finally:
        if own_transport:
            transport.close()


class Site(Protocol):
    """This worker's place in one checkpoint's output: who leads the destination steps, who writes
    which target file, what the output's identity and fingerprint hold, who copies the files that
    travel whole. What differs between a whole-world job (`WholeWorld`) and a node-local one
    (reshard.jobs.node_local.NodeSite); the job itself never asks which it runs."""

    leader: bool
    """This worker runs the destination steps (lock, staging, journal, manifest, publish)."""
    peers: tuple[int, ...] | None
    """The workers whose files make up the leader's output (None: every worker)."""
    ownership: Ownership | None
    """Who reads each source rank and writes each target rank (None: the planner's own)."""
    placement: dict | None
    """Which part of the target this output is, for its fingerprint and manifest (None: all of it)."""

    def source_identity(self, source: SourceCheckpoint, carried: list[str], target: Topology) -> dict: ...
    def output_bytes(self, source: SourceCheckpoint, target_dp: int, target: Topology) -> int: ...
    def begin(self, life: Lifecycle, transport: Transport, describe: Callable[[], JobOutput]) -> Start: ...
    def files_of(self, zero: ZeroStageTarget) -> Callable[[SourceCheckpoint, Topology, int], list]:
        """What a target rank this worker owns writes (reshard.formats.deepspeed_files.target_writer.TargetWriter's
        `files_of`): the stage form's files, where this output places them."""
    def copy_share(self, source: SourceCheckpoint, start: Start, staging: Staging, transport: Transport) -> dict:
        """This worker's share of the files that travel whole, copied into staging: {name: manifest entry}."""
    def leader_copies(self, source: SourceCheckpoint) -> tuple[str, ...]:
        """The files that travel whole which the leader copies when it publishes."""
    def scripts_from(self, source: SourceCheckpoint) -> str | None:
        """Where the output's recovery scripts come from (None: it has none)."""


class Placement(Protocol):
    """Where a job's target goes: the checkpoints it reshards, and each one's `Site` on this worker.
    Decided once, from the options (`run_job`)."""

    def units(self, opts: ReshardOptions, transport: Transport) -> tuple[list[Unit], list[str]]: ...
    def inspect(self, opts: ReshardOptions, unit: Unit, transport: Transport
                ) -> tuple[SourceCheckpoint, CheckpointTarget, list[str], list[str], Site]:
        """(source, target, carried save-directory files, notes, this worker's Site), on every worker:
        the target worked out once where the source is inspected, received with it. Collective."""


class WholeWorld:
    """The target of a job whose workers all see SRC and DST: one output that worker 0 leads, made of
    every worker's files; the files that travel whole are shared out among all workers by bytes.
    Both a `Placement` and, for each checkpoint, its `Site`."""

    peers = None
    ownership = None
    placement = None  # fingerprints and manifests as before node-local outputs existed

    def __init__(self, leader: bool):
        self.leader = leader

    def units(self, opts: ReshardOptions, transport: Transport) -> tuple[list[Unit], list[str]]:
        def discover():
            check_paths(opts.source, opts.destination)
            return discover_units(opts.source, opts.destination, opts.tag, opts.all_tags)
        return on_rank0(transport, discover)

    def inspect(self, opts: ReshardOptions, unit: Unit, transport: Transport
                ) -> tuple[SourceCheckpoint, CheckpointTarget, list[str], list[str], Site]:
        def inspect():  # on worker 0
            check_paths(unit.source, unit.destination)
            source, target, notes = inspect_target(opts, unit.source, unit.tag)
            carried = save_dir_files.list_save_dir_files(source.save_dir)
            return source, target, carried, notes + preflight(opts, source, target.topology, carried)

        source, target, carried, notes = on_rank0(transport, inspect)
        return source, target, carried, notes, self

    def source_identity(self, source: SourceCheckpoint, carried: list[str], target: Topology) -> dict:
        names = [n for r in range(source.spec.topology.world_size)
                 for n in map(os.path.basename, source.source_files(r, target))]
        return source_identity(source.tag_dir, set(names) | set(source.other_files)
                               | set(save_dir_files.manifest_names(carried)))

    def output_bytes(self, source: SourceCheckpoint, target_dp: int, target: Topology) -> int:
        return output_bytes(source, target_dp, target_tp=target.tp, target_ep=target.ep, target=target)

    def begin(self, life: Lifecycle, transport: Transport, describe: Callable[[], JobOutput]) -> Start:
        return life.begin(transport, describe)

    def files_of(self, zero: ZeroStageTarget) -> Callable[[SourceCheckpoint, Topology, int], list]:
        return zero.files  # as DeepSpeed saves them

    def copy_share(self, source: SourceCheckpoint, start: Start, staging: Staging, transport: Transport) -> dict:
        sizes = {name: start.identity[name]["bytes"] for name in source.other_files}  # worker 0's survey
        return staging.copy_in_hashed(source.tag_dir, file_shares(sizes, transport.size)[transport.rank])

    def leader_copies(self, source: SourceCheckpoint) -> tuple[str, ...]:
        return ()

    def scripts_from(self, source: SourceCheckpoint) -> str | None:
        return source.save_dir


def refuse_pipeline_options(opts: ReshardOptions, source: SourceCheckpoint) -> None:
    """What no pipeline reshard serves, refused by name whatever else changes: another ZeRO stage
    (DeepSpeed's PipelineEngine asserts ZeRO stage < 2, runtime/pipe/engine.py `PipelineEngine.__init__`,
    and a pipeline save is a ZeRO-1 save per column) and an expert-parallel size (no experts)."""
    for applies, option in ((opts.target_stage not in (None, 1), f"--target-stage {opts.target_stage}"),
                            (opts.target_ep not in (None, 1), f"--target-ep {opts.target_ep}")):
        if applies:
            raise OptionError(f"{source.model_path(0)}: {option} is not supported for pipeline checkpoints: "
                              "DeepSpeed's PipelineEngine runs ZeRO-0 and ZeRO-1 only (runtime/pipe/engine.py), and "
                              "a pipeline has no experts; reshard changes its dp, pp and a model axis's tp")


def inspect_target(opts: ReshardOptions, save_dir: str, tag: str
                   ) -> tuple[SourceCheckpoint, CheckpointTarget, list[str]]:
    """(source, target, notes) of any save: inspected as the kind of save its files say it is
    (formats/deepspeed_files/deepspeed_save_kind.inspect_save) and its target worked out once (`source_target`). What every
    job kind calls for one (WholeWorld.inspect; array tasks, reshard.jobs.array_job, which sits below this
    module and is handed `inspect_pipeline_target` by `run_job`)."""
    source = inspect_save(save_dir, tag, trust_pickle=opts.trust_pickle, read_tensors=not opts.dry_run)
    return source_target(opts, source)


def source_target(opts: ReshardOptions, source: SourceCheckpoint
                  ) -> tuple[SourceCheckpoint, CheckpointTarget, list[str]]:
    """(source, target, notes) of an inspected save: a pipeline save's (its columns, `CheckpointSpec.columns`)
    with its target stages (`columns_target`), every other save's from the options (preflight.checkpoint_target,
    which gives a ZeRO-0 MoE save its own stage form)."""
    if source.spec.columns is not None:
        return columns_target(opts, source)
    return source, checkpoint_target(opts, source), []


def inspect_pipeline_target(opts: ReshardOptions, save_dir: str, tag: str
                            ) -> tuple[SourceCheckpoint, CheckpointTarget, list[str]]:
    """(source, target, notes) of a pipeline save, every one of which takes the plan: inspected as columns
    (inspect_pipeline_columns) and its target worked out once, the target stages with another pp or tp
    (`columns_target`). What array tasks (reshard.jobs.array_job, which sits below this module) are handed
    by `run_job`; `inspect_target` reaches the same for a pipeline save. The stage pickles are read once
    (deepspeed_pipeline.inspect_pipeline, kept on the source as `pipeline` until the target is worked out)."""
    source = inspect_pipeline_columns(save_dir, tag, trust_pickle=opts.trust_pickle, read_tensors=not opts.dry_run)
    return source_target(opts, source)


def columns_target(opts: ReshardOptions, source: SourceCheckpoint, pipe=None
                   ) -> tuple[SourceCheckpoint, CheckpointTarget, list[str]]:
    """(source, target, notes) of inspected columns: with another pp or tp, `pipeline_stage_change`. `pipe`: the
    save's PipelineSource where it was read already or gathered from the nodes (None: the one the columns were
    inspected from, `SourceCheckpoint.pipeline`, or read here). The source returned no longer holds it, so
    it is never shipped to the workers."""
    pipe, source = pipe or source.pipeline, dataclasses.replace(source, pipeline=None)
    refuse_pipeline_options(opts, source)
    if opts.target_pp not in (None, source.spec.topology.pp) or opts.target_tp not in (None, source.spec.topology.tp):
        return pipeline_stage_change(opts, source, pipe)
    return source, checkpoint_target(opts, source), []


def pipeline_stage_change(opts: ReshardOptions, source: SourceCheckpoint, pipe=None
                          ) -> tuple[SourceCheckpoint, CheckpointTarget, list[str]]:
    """A pipeline save at another number of stages or model ranks: the target stages worked out (and the
    options checked) from the layer list (reshard.formats.deepspeed_files.pipeline_target.pipeline_target, which every job
    kind shares; with tp changed, weighed at the target's local shapes; the batch config is preflight's),
    the target topology at the new pp and tp with each target column's (params at its local shapes, groups)
    and each stage's buffers as its stages (`target_stages`, `Topology.stages`), with tp changed each
    parameter's split and the layer files' tensors as its layer files (`Topology.layer_files`, re-cut,
    deepspeed_pipeline.pipeline_model_axis: the layer files are then re-cut in the plan, no longer carried
    by the source), and a note saying how the layers were re-assigned."""
    from reshard.formats.deepspeed_files.deepspeed_pipeline import inspect_pipeline
    from reshard.formats.deepspeed_files.pipeline_target import pipeline_target
    pipe = pipe or inspect_pipeline(source.save_dir, source.tag, opts.trust_pickle)
    planned = pipeline_target(opts, pipe)
    stages, tp, layer_files = planned.stages, planned.topology.tp, None
    if planned.tp_changed:  # the layer files move through the plan, re-cut; no longer carried whole
        source, layer_files = with_model_axis(source, pipe, planned.model_axis, planned.layers, stages.bounds, tp,
                                              opts.trust_pickle)
    kept = checkpoint_target(dataclasses.replace(opts, target_pp=None, target_tp=None), source)  # the stage form
    # pipeline_target's topology, worked out there once, with its stages (and re-cut layer files)
    target = dataclasses.replace(kept, topology=dataclasses.replace(planned.topology, stages=target_stages(
        pipe, stages.names, stages.buffer_names, shapes=planned.shapes, tp=tp), layer_files=layer_files))
    note = (f"layers re-assigned to {len(stages.names)} stages by {opts.pipeline_partition!r} (bounds "
            f"{list(stages.bounds)}), each stage's parameters a ZeRO-1 partition over dp {opts.target_dp}")
    if planned.tp_changed:
        note += (f", every parameter and layer-file tensor re-cut from {pipe.tp} to {tp} model ranks by the save's "
                 "universal_checkpoint_info patterns")
    return source, target, [note]


def with_model_axis(source: SourceCheckpoint, pipe, rules, layers, bounds, tp: int, trust_pickle: bool = False
                    ) -> tuple[SourceCheckpoint, LayerFiles]:
    """A tp change's model axis, for a target whose stages (`target_stages`) are at `tp`: (`source` no longer
    carrying its layer files, the target's `Topology.layer_files`, re-cut: each parameter's split by `rules`,
    the save's patterns, and the layer files' tensors, the target stages holding layers
    `bounds[s]..bounds[s + 1] - 1`, deepspeed_pipeline.pipeline_model_axis). The layer files then move through
    the plan, re-cut. The offline job takes `layers` and `bounds` from the layer list (pipeline_stage_change),
    the in-job load from the engine (reshard.deepspeed)."""
    from reshard.formats.deepspeed_files.deepspeed_pipeline import pipeline_model_axis
    axis, layer_templates = pipeline_model_axis(pipe, rules, layers, bounds, tp, trust_pickle)
    return (dataclasses.replace(source, other_files=tuple(n for n in source.other_files if n not in pipe.layer_files)),
            LayerFiles(axis, recut=True, templates=layer_templates))


def target_stages(pipe, names, buffer_names, *, shapes: dict | None = None, tp: int | None = None
                  ) -> PipelineStages:
    """The stages of a pipeline target at another pp or tp (`Topology.stages`, which the planner and the writers
    lay out): per target stage its parameter `names` and persistent `buffer_names`, each stage's column repeated
    for the target's `tp` model ranks (default the save's), the `shapes` (default the save's: local shapes
    at the target tp when it changes) and param groups the save's (`pipe`: inspect_pipeline). The
    offline job takes the stages from the layer list (pipeline_stage_change), the in-job load from the
    engine's own stages (reshard.deepspeed), verify --against from the output's (reshard.verify)."""
    from reshard.formats.deepspeed_files.deepspeed_pipeline import source_groups, source_shapes
    from reshard.layouts.pipeline import split_by_group
    from reshard.layouts.zero import ParamSpec
    shapes, (count, group_of) = shapes or source_shapes(pipe), source_groups(pipe)
    columns = []
    for stage_names in names:
        index = {name: i for i, name in enumerate(stage_names)}
        column = (tuple(ParamSpec(name, tuple(int(d) for d in shapes[name])) for name in stage_names),
                  tuple(tuple(index[name] for name in group)
                        for group in split_by_group(stage_names, group_of, count)))
        columns += [column] * (tp or pipe.tp)
    return PipelineStages(tuple(columns), tuple(buffer_names))


def tensor_parallel_notes(spec) -> list[str]:
    """Which parameters are column-, row-parallel or replicated (the dry run shows them)."""
    if spec.tensor is None:
        return []
    from reshard.layouts.tensor_parallel import describe_splits
    kinds = describe_splits(spec.tensor.params.names, spec.tensor.params.splits)
    return [f"tensor parallel: {kind} ({len(names)}): {', '.join(names[:12])}{' ...' if len(names) > 12 else ''}"
            for kind, names in kinds.items()]


def _describe_output(opts: ReshardOptions, unit: Unit, source: SourceCheckpoint, target: CheckpointTarget,
                     plan: ReshardPlan, carried: list[str], site: Site) -> JobOutput:
    """What the lifecycle needs of this checkpoint's output (reshard.jobs.lifecycle), on its leader."""
    topology, zero = target.topology, target.zero
    identity = site.source_identity(source, carried, topology)
    out_fp = output_entries(opts, source, target, identity, site.placement).fingerprint
    target_ep = topology.ep if source.spec.experts is not None else None
    outputs = outputs_of(unit.destination, source.save_dir, topology.dp, 1 if source.spec.tensor is None else
                         topology.tp, zero.stage, target_ep)  # a pipeline's manifest names no tp_world_size
    return JobOutput(out_fp, destination_names(outputs, carried),
                     plan_fingerprint(out_fp, plan.ownership.workers, plan.budget_bytes), plan.rounds, identity,
                     needed_bytes=site.output_bytes(source, topology.dp, topology),
                     earlier=outputs.get(source.tag), latest=unit.latest)


def _run_unit(opts: ReshardOptions, unit: Unit, transport: Transport, clock: PhaseClock,
              placement: Placement) -> CheckpointResult:
    started = time.perf_counter()
    fallbacks_before = len(torch_fallbacks)  # what this job read or wrote with torch, and why
    source, checkpoint, carried, source_notes, site = placement.inspect(opts, unit, transport)
    clock.lap("inspect")
    target, zero = checkpoint.topology, checkpoint.zero  # decided once, where the source was inspected
    plan = zero.plan(source, target, transport.size, opts.memory_budget, ownership=site.ownership)
    memory = PeakAnonymousMemory()  # after planning: the plan's tables are at their largest
    result = CheckpointResult(source.save_dir, unit.destination, source.tag, source.spec.describe(),
                              source.spec.topology, target, transport.size, transport.name,
                              plan.rounds, 0.0, opts.dry_run, plan, notes=list(source_notes))
    if source.spec.experts is not None:
        result.notes += expert_placement_lines(source.spec.experts, target)
    if source.spec.stage == 3:
        result.notes.append(ZERO3_RANK_IDENTITY_NOTE)
    result.notes += tensor_parallel_notes(source.spec)
    result.notes += zero.notes(source.spec)
    node_of_worker = getattr(transport, "node_of_worker", None)  # reshard.transport.nodes: workers on several nodes
    if node_of_worker is not None:
        result.nodes = len(set(node_of_worker))
        result.plan_bytes_between_nodes = plan.bytes_between_nodes(node_of_worker)
    crossed_before = getattr(transport, "bytes_between_nodes", 0)
    if opts.dry_run:
        result.planner_imported_torch = "torch" in sys.modules
        result.planner_torch_files = list(torch_fallbacks[fallbacks_before:])
        result.seconds = time.perf_counter() - started
        return result

    failure = None
    try:
        ensure_open_files(files_per_worker(source.spec.stage, plan.ownership, transport.rank))
    except ReshardError as error:
        failure = error
    check_peers(transport, failure, "checking the open-file limit")

    life = Lifecycle(unit.destination, source.tag, leader=site.leader, overwrite=opts.overwrite, peers=site.peers)
    start = site.begin(life, transport, lambda: _describe_output(opts, unit, source, checkpoint, plan, carried, site))
    clock.lap("plan")
    result.notes += start.notes
    if start.mode == "complete":
        result.seconds = time.perf_counter() - started
        return result
    own = plan.ownership
    report = WorkerReport(transport.rank, tuple(own.source_ranks_of(transport.rank)),
                          tuple(own.target_ranks_of(transport.rank)))
    staging = life.staging

    def opened(reader, writer) -> None:
        writer.copy_in_background()
        life.opened()

    def flush(reader, writer) -> dict:
        writer.wait_for_copies()
        copied = site.copy_share(source, start, staging, transport)  # of the files that travel whole
        if rewrites_expert_files(source):  # AutoEP with AutoTP layers: TP rank and folding per file
            copied.update(write_expert_files(source, target, staging.tag_dir,
                                             sorted(target_expert_files(source, target))[transport.rank::transport.size],
                                             trust_pickle=opts.trust_pickle))
        copied_bytes = sum(entry["bytes"] for entry in copied.values())
        reader.bytes_read += copied_bytes
        writer.bytes_carried += copied_bytes
        clock.lap("exchange+write")
        clock.move(writer.sync_seconds, "exchange+write", "fsync")
        hashes = writer.finish()  # hashes while a thread fsyncs: "fsync" is what remains of it
        clock.lap("fsync")
        clock.move(writer.hash_seconds, "fsync", "hash")
        return {**hashes, **copied}

    def publish(reader, writer, hashes: dict) -> tuple[int, int, int]:
        clock.lap("hash")  # waiting here for a slower peer's fsync or hash: still that phase, not publishing
        life.publish(transport, hashes,
                     lambda all_hashes: _publish(opts, unit, source, checkpoint, start, staging, all_hashes, carried,
                                                 site))
        return reader.bytes_read, writer.bytes_written, writer.bytes_carried

    def work():
        return execute(plan, transport,
                       open_source=lambda: SourceReader.open(source, report.source_ranks, target=target,
                                                             trust_pickle=opts.trust_pickle,
                                                             extra_slots=zero.source_slots),
                       open_sink=lambda: TargetWriter.create(
                           source, staging.tag_dir, target, report.target_ranks, reuse_existing=start.skeletons,
                           files_of=site.files_of(zero)),
                       opening="opening source files and creating target files", opened=opened,
                       finish=flush, finishing="flushing target files", after=publish,
                       start_round=start.rounds_done, durable_every_bytes=opts.durable_every,
                       on_durable=life.journal, on_round=lambda *done: memory.sample(),
                       progress=Progress(f"reshard {source.tag}", progress_enabled(opts.quiet, transport.rank == 0)))

    moved = life.run(work)
    report.bytes_read, report.bytes_written, report.bytes_carried = moved
    report.bytes_between_nodes = getattr(transport, "bytes_between_nodes", 0) - crossed_before
    report.staging_peak_bytes = getattr(transport, "staging_peak_bytes", 0)
    report.peak_rss_bytes = peak_resident_bytes()
    report.peak_anonymous_bytes = memory.sample()
    report.torch_imported = "torch" in sys.modules
    report.torch_files = list(torch_fallbacks[fallbacks_before:])
    clock.lap("publish")
    report.phases = clock.seconds
    result.reports = transport.all_gather_object(report)
    result.seconds = time.perf_counter() - started
    return result


def _publish(opts, unit: Unit, source: SourceCheckpoint, target: CheckpointTarget, start: Start,
             staging: Staging, worker_hashes: list, carried: list[str], site: Site) -> None:
    here = site.leader_copies(source)  # the whole files no worker copied in `flush`
    staging.copy_in(source.tag_dir, here, source.other_dirs)
    staged = save_dir_files.staging_dir(staging.tag_dir)
    files = {name: {"bytes": os.path.getsize(os.path.join(staging.tag_dir, name)),
                    "blake3": hash_file(os.path.join(staging.tag_dir, name))} for name in here}
    for hashes in worker_hashes:
        files.update(hashes)
    files.update(save_dir_files.stage(source.save_dir, carried, staged, unit.destination) if carried else {})
    entries = output_entries(opts, source, target, start.identity, site.placement)
    publish_checkpoint(staging, start.output_fingerprint, entries.source, entries.target, files, unit.latest,
                       site.scripts_from(source), carried)
