"""A reshard job for a DeepSpeed PipelineModule checkpoint (ZeRO-1), run by every worker.

    python -m reshard SRC DST --target-dp 3                 # job.py hands pipeline saves here
    python -m reshard SRC DST --target-dp 2 --target-pp 1 --pipeline-layers 7 --pipeline-tied embed:0,6
    python -m reshard SRC DST --target-dp 2 --target-tp 1 --pipeline-layers 7 --pipeline-tied embed:0,6

With another number of stages, the layers are re-assigned as DeepSpeed's PipelineModule assigns
them (reshard.layouts.pipeline: `--pipeline-partition`, the layer count and tied positions the
caller gives, checked against the source's own assignment first), every worker that builds a
stage loads every source stage's states (whole tensors), and builds its target stages.
With the number of stages unchanged, each stage is an ordinary ZeRO-1 save over its own
parameters (reshard.formats.deepspeed_pipeline): worker w rebuilds the stages s with
s % W == w (the stage's model-states file and its target optimizer files, whole tensors, no
rounds), and the layer files are copied unchanged, shared out by size. Having no rounds to cut,
the job checks the budget instead: before anything is written, worker 0 estimates each worker's
peak (`whole_tensor_bytes`) and refuses a --memory-budget that cannot hold it (a dry run prints the
plan with that verdict instead). Worker 0 inspects the source and checks the options here (the
batch config too, as for ZeRO saves); the rest (lock, staging, journal, each worker's stages,
manifest, publish, clean-up on failure) is the lifecycle in reshard.jobs.whole_file_job.

With a model axis (PipeModelDataParallelTopology, tp > 1) every model rank's column of stages is a
pipeline of its own (reshard.formats.deepspeed_pipeline): the work units are the (stage, model rank)
pairs, unit stage * tp + model (its `mp_rank_XX`) built by worker (stage * tp + model) % W, each from its
own column's files when tp is kept. With --target-tp T other than the source's (a save with a model
axis whose client state carries universal_checkpoint_info patterns, reshard.layouts.model_axis),
the layer list is needed as for another pp: DeepSpeed's `parameters` partition weighs the local
(sliced) parameter counts, so the stages are re-assigned with the target's local sizes
(`model_axis_plan`). The units' dp ranks and the layer indices (whose files, no longer copied, are
re-cut per layer) are then dealt to the workers in runs of about equal bytes (`tp_change_shares`), so
that a unit's optimizer files are spread over the workers even when there is one unit ((1, 1, 4));
each worker joins whole over the source's model ranks only the parameters its ranks' partitions hold
(deepspeed_pipeline.repartitioned_share_names, model_axis_states of those names), once per target
stage, and cuts each of its shares from them (`share_tensor_bytes` in the budget check).
"""
from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass

from reshard.errors import OptionError
from reshard.formats.deepspeed_pipeline import (
    PipelineSource,
    cut_model_axis_states,
    inspect_pipeline,
    joined_state_bytes,
    layer_indices,
    model_axis_states,
    named_states,
    repartitioned_share_names,
    repartitioned_stage_bytes,
    source_numels,
    stage_file_names,
    write_model_axis_layer_files,
    write_repartitioned_stage,
    write_stage_files,
)
from reshard.formats.pipeline_target import (  # noqa: F401 (re-exported: array, node-local, in-job, tests)
    PP_CHANGE_MISSING,
    PipelineTarget,
    check_no_empty_group,
    model_axis_plan,
    pipeline_layers,
)
from reshard.formats.pipeline_target import pipeline_target as target_of_layer_list
from reshard.jobs.batch_config import batch_config_problem
from reshard.jobs.manifest import output_fingerprint
from reshard.jobs.options import ReshardOptions
from reshard.files.resources import human, size_at_least
from reshard.jobs.results import CheckpointResult, PhaseClock, WorkerReport
from reshard.jobs.runs import Unit
from reshard.topology import Topology
from reshard.transport import Transport
from reshard.jobs.whole_file_job import (
    WholeFileSource,
    inspect_on_worker0,
    run_whole_file_job,
)

def pipeline_target(opts: ReshardOptions, source: PipelineSource) -> PipelineTarget:
    """reshard.formats.pipeline_target.pipeline_target (the target stages, the options no pipeline reshard
    serves refused by name), then the batch config at the target dp (`check_batch_config`), as the
    whole-tensor job has always checked them."""
    target = target_of_layer_list(opts, source)
    check_batch_config(opts, source)
    return target


def check_batch_config(opts: ReshardOptions, source: PipelineSource) -> None:
    """The ZeRO jobs' batch-config refusal (reshard.jobs.batch_config), for the pipeline's data-parallel
    size: DeepSpeed's pipeline engine asserts train_batch_size = micro batch x accumulation steps x the
    grid's data-parallel size (runtime/config.py `_batch_assertion`, with the pipe grid's dp world), so
    a save whose ds_config fixes train_batch_size stops the resumed job at deepspeed.initialize at
    another dp; --ignore-batch-config when the target job brings new batch settings."""
    problem = batch_config_problem(source.ds_config, opts.target_dp)
    if problem and not opts.ignore_batch_config:
        raise OptionError(f"{source.model_path(0)}: {problem}")


def whole_tensor_bytes(source: PipelineSource, target: PipelineTarget, workers: int) -> list[int]:
    """Per worker, about the most bytes of tensors it holds at once: the largest `joined_state_bytes`
    (stages kept) or `repartitioned_stage_bytes` (stages changed) over the (stage, model rank) units it
    builds (0 for a worker building none); with tp changed, the largest `share_tensor_bytes` over the
    stages its shares (tp_change_shares) are of."""
    if target.tp_changed:
        per_element = optimizer_bytes_per_element(source)
        return [max((share_tensor_bytes(source, target, stage, [s for s in shares if s[0] == stage], per_element)
                     for stage in {s[0] for s in shares}), default=0)
                for shares, _ in tp_change_shares(source, target, workers)]
    writes = stage_files_written_by(target.topology.pp, target.topology.tp, workers)
    dp = target.topology.dp
    if target.stages is None:
        return [max((joined_state_bytes(source, dp, kept_stage=s, model=m) for s, m in units), default=0)
                for units in writes]
    numels = source_numels(source)
    elements = [sum(numels[n] for n in names) for names in target.stages.names]
    return [max((repartitioned_stage_bytes(source, dp, elements[t], m) for t, m in units), default=0)
            for units in writes]


def unit_tensor_bytes(source: PipelineSource, target: PipelineTarget) -> list[int]:
    """Per target (stage, model rank) unit (index stage * tp + model), about the most bytes of
    tensors building it whole takes (what an array task holds building its neediest unit)."""
    topology = target.topology
    if target.tp_changed:
        every_rank, per_element = tuple(range(topology.dp)), optimizer_bytes_per_element(source)
        return [share_tensor_bytes(source, target, unit // topology.tp,
                                   [(unit // topology.tp, unit % topology.tp, every_rank)], per_element)
                for unit in range(topology.pp * topology.tp)]
    return whole_tensor_bytes(source, target, topology.pp * topology.tp)  # worker u builds unit u alone


def check_budget(opts: ReshardOptions, source: PipelineSource, target: PipelineTarget, workers: int) -> list[int]:
    """The whole-tensor estimate per worker; refused when a worker's exceeds --memory-budget (this
    path has no rounds to cut, so the budget can only be checked, never kept by slicing)."""
    needed = whole_tensor_bytes(source, target, workers)
    more = (" or more workers (each joins, over every model rank, only the parameters of its share of the "
            "target's optimizer files)" if target.tp_changed else
            " (more workers do not help: every worker building a stage joins every source stage)") \
        if target.stages is not None else " or more workers, up to one per stage"
    refuse_over_budget(source, needed, opts.memory_budget, WHOLE_TENSORS, more)
    return needed


WHOLE_TENSORS = "pipeline checkpoints are resharded with whole tensors (not the bounded rounds of ZeRO checkpoints)"


def refuse_over_budget(source: PipelineSource, needed: list[int], budget: int, why: str, more: str = "",
                       who: str = "worker") -> None:
    """OptionError naming the source's first optimizer file, `why` whole tensors are held, and the
    budget to give, when the neediest worker's `needed` bytes exceed --memory-budget `budget`
    (`who`: what an index of `needed` is, "worker" or "array task")."""
    worst = max(range(len(needed)), key=needed.__getitem__)
    if needed[worst] > budget:
        raise OptionError(f"{source.optim_path(0, 0)}: {why}; {who} {worst} would hold about {human(needed[worst])}, "
                          f"over --memory-budget {human(budget)}: give --memory-budget {size_at_least(needed[worst])} "
                          f"or more{more}")


def stages_written_by(pp: int, workers: int) -> tuple[tuple[int, ...], ...]:
    """Per worker, the stages whose files it builds: stage s by worker s % W."""
    return tuple(tuple(range(w, pp, workers)) for w in range(workers))


def stage_files_written_by(pp: int, tp: int, workers: int) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Per worker, the (stage, model rank) units whose files it builds: unit stage * tp + model (its
    `mp_rank_XX`, reshard.layouts.pipeline.stage_model_rank) by worker unit % W, as stages_written_by
    over pp * tp units; ordered by model rank, then stage, so that a worker re-assigning stages joins
    one model rank's column at a time."""
    return tuple(tuple(sorted(((unit // tp, unit % tp) for unit in units), key=lambda unit: (unit[1], unit[0])))
                 for units in stages_written_by(pp * tp, workers))


UnitShare = tuple[int, int, tuple[int, ...]]
"""(target stage, target model rank, target dp ranks): the optimizer files of those ranks of the
(stage, model rank) unit, and its model-states file when rank 0 is among them."""


def tp_change_shares(source: PipelineSource, target: PipelineTarget,
                     workers: int) -> tuple[tuple[tuple[UnitShare, ...], tuple[int, ...]], ...]:
    """With tp changed, per worker (its unit shares, the layer indices whose files it re-cuts).

    Every unit's dp ranks (units in index order stage * tp + model, each rank weighing the unit's
    bytes / dp, `stage_output_bytes`), then every layer index (weighing its source files), laid end
    to end and cut into `workers` runs of about equal weight: a unit's files are spread over workers
    when there are fewer units than workers (the usual case of a tp decrease: (1, 1, 4) has one), and
    each worker joins only the parameters its ranks hold (deepspeed_pipeline.repartitioned_share_names),
    not every source tensor. The same on every worker (pure)."""
    topology = target.topology
    unit_bytes = stage_output_bytes(source, target)
    items = [((unit // topology.tp, unit % topology.tp, rank), nbytes / topology.dp)
             for unit, nbytes in enumerate(unit_bytes) for rank in range(topology.dp)]
    items += [(index, sum(os.path.getsize(os.path.join(source.tag_dir, name)) for name in source.layer_files
                          if name.startswith(f"layer_{index:02d}-")))
              for index in layer_indices(source)]
    total = sum(weight for _, weight in items) or 1
    ranks: list[dict] = [{} for _ in range(workers)]
    layers: list[list[int]] = [[] for _ in range(workers)]
    done = 0.0
    for item, weight in items:  # an item goes to the worker whose run holds its middle
        worker = min(workers - 1, int((done + weight / 2) * workers / total))
        done += weight
        if isinstance(item, tuple):
            ranks[worker].setdefault(item[:2], []).append(item[2])
        else:
            layers[worker].append(item)
    return tuple((tuple((stage, model, tuple(held)) for (stage, model), held in ranks[w].items()), tuple(layers[w]))
                 for w in range(workers))


def optimizer_bytes_per_element(source: PipelineSource) -> float:
    """The source's optimizer files' bytes per element of one model rank's parameters (all states)."""
    optimizer_bytes = sum(os.path.getsize(source.optim_path(s, d, m)) for s in range(source.pp)
                          for d in range(source.dp) for m in range(source.tp))
    return optimizer_bytes / max(1, source.tp * sum(source_numels(source).values()))


def share_tensor_bytes(source: PipelineSource, target: PipelineTarget, stage: int,
                       shares: Sequence[UnitShare], per_element: float) -> int:
    """With tp changed, about the most bytes of tensors building `shares` (all of target stage
    `stage`) holds: the parameters they need (repartitioned_share_names), mapped from every source
    model rank's files, joined whole and cut (at most 3 x their source bytes; a cut on dim 0 or to
    tp 1 is a view), plus one target rank's optimizer file being built. By the bytes per element of
    the source's optimizer files (`per_element`, optimizer_bytes_per_element). Measured on bench/pipeline_bench.py's (2, 2, 1) save (194 MB,
    142 MiB of optimizer files) -> (1, 1, 4): one worker peaked at 543 MiB RSS, about 310 MiB above
    the interpreter's own with torch loaded (about 230 MiB), where this says 460 MiB (joining every
    tensor on every worker, as before these shares, peaked at 847 MiB); two workers (ranks 0-2; rank
    3 and the layer files) at 487 and 336 MiB RSS (about 257 and 106 above), where this says 365 and 159."""
    topology, names = target.topology, target.stages.names[stage]
    needed = frozenset().union(*(repartitioned_share_names(source, names, target.shapes, topology.dp, ranks)
                                 for _, _, ranks in shares))
    local = source_numels(source)
    needed_source = per_element * source.tp * sum(local[name] for name in needed)
    stage_elements = sum(math.prod(target.shapes[name]) for name in names)
    return int(3 * needed_source + per_element * stage_elements / topology.dp)


def column_files(source: PipelineSource, stage: int, model: int) -> tuple[str, ...]:
    """The names of (stage, model rank)'s model-states file and optimizer files in the source."""
    return tuple(stage_file_names(stage, source.dp, source.bf16, model, source.tp))


def checked_target(opts: ReshardOptions, source: PipelineSource, workers: int) -> tuple[PipelineTarget, list[int]]:
    """pipeline_target, then the memory check (each worker's estimate), on worker 0 before anything is
    written. A dry run is not refused over the budget: it prints the plan with the verdict in it
    (`budget_verdict`), which is what a dry run is for."""
    target = pipeline_target(opts, source)
    if opts.dry_run:
        return target, whole_tensor_bytes(source, target, workers)
    return target, check_budget(opts, source, target, workers)


def budget_verdict(needed: list[int], budget: int) -> str:
    """The summary's words on a whole-tensor estimate against --memory-budget: "largest worker about X of
    --memory-budget Y", and where it is over, that a run is refused and the figure that works
    (size_at_least: rounded up, as refuse_over_budget gives it)."""
    largest = max(needed, default=0)
    verdict = f"largest worker about {human(largest)} of --memory-budget {human(budget)}"
    if largest > budget:
        verdict += f": OVER BUDGET, a run is refused; give --memory-budget {size_at_least(largest)} or more"
    return verdict


def stage_output_bytes(source: PipelineSource, target: PipelineTarget) -> list[int]:
    """About the bytes of each target (stage, model rank) unit's files (its model-states file and its
    optimizer files), indexed stage * tp + model (its `mp_rank_XX`), from the source files' sizes: what
    SLURM array tasks are dealt by (reshard.jobs.array_job). A kept unit weighs its source files."""
    tp = target.topology.tp
    if target.stages is None:  # stages and model axis kept
        return [stage_source_bytes(source, s, m) for s in range(source.pp) for m in range(tp)]
    # elements on one target model rank: the target's local shapes with tp changed, else the source's
    numels = {n: math.prod(shape) for n, shape in target.shapes.items()} if target.tp_changed else source_numels(source)
    per_column = sum(sum(sum(g) for g in spec.numels) for spec in source.stages)
    per_element = sum(stage_source_bytes(source, s, m) for s in range(source.pp)
                      for m in range(source.tp)) / max(1, per_column * source.tp)
    return [int(per_element * sum(numels[n] for n in stage)) for stage in target.stages.names for _ in range(tp)]


def describe_target(opts: ReshardOptions, source: PipelineSource, target: PipelineTarget) -> str:
    """How the target's stages are made (the summary's note)."""
    topology = target.topology
    if target.stages is not None:
        how = (f"layers re-assigned to {topology.pp} stages by {opts.pipeline_partition!r} (bounds "
               f"{list(target.stages.bounds)}), each stage's ZeRO-1 partitions rebuilt for dp {topology.dp}")
    else:
        how = f"{source.pp} stages kept, each stage's ZeRO-1 partitions re-cut from dp {source.dp} to {topology.dp}"
    if target.tp_changed:
        return how + (f", every tensor joined over the source's {source.tp} model ranks and re-cut for "
                      f"{topology.tp} by the save's universal_checkpoint_info patterns, layer files too")
    return how + (f", per model rank (tp {source.tp} kept)" if source.tp > 1 else "")


@dataclass(frozen=True)
class PipelineOutput:
    """What a pipeline job's output is, whoever writes it (this job's workers, or SLURM array tasks,
    reshard.jobs.array_job): the same fingerprint and manifest either way."""

    carried: tuple[str, ...]
    """Files copied unchanged: the layer files, and any other file of the tag directory."""
    identified: tuple[str, ...]
    """The source files the fingerprint and the manifest name (reshard.jobs.manifest.source_identity)."""
    placement: dict | None
    """With another pp, what decides the new stages (in the fingerprint); None when the stages are kept."""
    manifest_source: dict
    """The manifest's "source" entry, less "files"."""
    manifest_target: dict

    def fingerprint(self, source: PipelineSource, identity: dict, target: PipelineTarget) -> str:
        return output_fingerprint(source.save_dir, source.tag, identity, target.topology.dp, placement=self.placement)


def pipeline_output(opts: ReshardOptions, source: PipelineSource, target: PipelineTarget) -> PipelineOutput:
    carried = (*(() if target.tp_changed else source.layer_files), *source.other_files)
    identified = (*source.layer_files, *source.other_files, *(name for s in range(source.pp) for m in range(source.tp)
                                                              for name in column_files(source, s, m)))
    topology = target.topology
    placement = ({"pp": topology.pp, "layers": opts.pipeline_layers, "tied": opts.pipeline_tied,
                  "partition": opts.pipeline_partition} if target.stages is not None else None)
    if target.tp_changed:
        placement["tp"] = topology.tp
    return PipelineOutput(
        carried, identified, placement,
        {"save_dir": source.save_dir, "tag": source.tag, "dp_world_size": source.dp, "pp": source.pp, "tp": source.tp,
         "stage": 1, "description": source.describe()},
        {"dp_world_size": topology.dp, "pp": topology.pp, "tp": topology.tp, "stage": 1})


def build_stages(source: PipelineSource, target: PipelineTarget, units: Sequence[tuple[int, int]], tag_dir: str,
                 trust_pickle: bool, report: WorkerReport,
                 dp_ranks_of: Callable[[int, int], Collection[int]] | None = None
                 ) -> Iterator[tuple[tuple[int, int], list[str]]]:
    """Write the target's (stage, model rank) `units` (each its model-states file and its optimizer
    files) into `tag_dir`, one after another, yielding (unit, paths written) as each is complete;
    adds the source bytes read to `report.bytes_read`. With another pp, every source stage of a
    model rank's column is joined once, before that column's first unit
    (reshard.formats.deepspeed_pipeline.named_states; stage_files_written_by orders units by model rank).
    `dp_ranks_of(stage, model)`: the dp ranks whose optimizer files a unit writes (a node-local
    output's own); None: all of them."""
    assignment, topology = target.stages, target.topology
    if target.tp_changed:
        if dp_ranks_of is not None:  # the node-local job refuses a tp change before it gets here
            raise OptionError("a tp change writes every dp rank's files: dp_ranks_of is not served with it")
        yield from _build_tp_changed(source, target, units, tag_dir, trust_pickle, report)
        return
    column = None
    for stage, model in units:
        dp_ranks = None if dp_ranks_of is None else sorted(dp_ranks_of(stage, model))
        if assignment is not None:
            if column != model:  # every source stage of this model rank's column feeds its new stages
                column, (template, states) = model, named_states(source, trust_pickle, model)
                report.bytes_read += sum(stage_source_bytes(source, s, model) for s in range(source.pp))
            yield (stage, model), write_repartitioned_stage(
                source, states, template, assignment.names[stage], topology.pp, stage, topology.dp, tag_dir,
                trust_pickle, assignment.buffer_names[stage] if assignment.buffer_names else None, model_rank=model,
                ranks=dp_ranks, model_file=True)
        else:
            paths = write_stage_files(source, stage, topology.dp, tag_dir, trust_pickle, model_rank=model,
                                      dp_ranks=dp_ranks)
            report.bytes_read += (stage_source_bytes(source, stage, model) if dp_ranks is None or dp_ranks else
                                  os.path.getsize(source.model_path(stage, model)))
            yield (stage, model), paths


def _build_tp_changed(source: PipelineSource, target: PipelineTarget, units: Sequence, tag_dir: str,
                      trust_pickle: bool, report: WorkerReport) -> Iterator[tuple[tuple[int, int], list[str]]]:
    """build_stages with tp changed: `units` are (stage, model rank) pairs (every dp rank) or
    UnitShares. Per target stage, the parameters its shares need, joined whole over the source's model
    ranks once (model_axis_states of those names alone), then each share cut from them and written."""
    assignment, topology = target.stages, target.topology
    shares = [(unit[0], unit[1], tuple(range(topology.dp)) if len(unit) == 2 else tuple(unit[2])) for unit in units]
    local = source_numels(source)
    column_bytes = sum(stage_source_bytes(source, s, m) for s in range(source.pp) for m in range(source.tp))
    for stage in dict.fromkeys(share[0] for share in shares):
        names = assignment.names[stage]
        mine = [share for share in shares if share[0] == stage]
        needed = {share: repartitioned_share_names(source, names, target.shapes, topology.dp, share[2])
                  for share in mine}
        wanted = frozenset().union(*needed.values())
        template, joined = model_axis_states(source, target.model_axis, trust_pickle, wanted)
        report.bytes_read += int(column_bytes * sum(local[n] for n in wanted) / max(1, sum(local.values())))
        for share in mine:
            _, model, ranks = share
            states = cut_model_axis_states(joined, target.model_axis, [n for n in names if n in needed[share]],
                                           topology.tp, model)
            yield (stage, model), write_repartitioned_stage(
                source, states, template, names, topology.pp, stage, topology.dp, tag_dir, trust_pickle,
                assignment.buffer_names[stage] if assignment.buffer_names else None, model_rank=model,
                target_tp=topology.tp, shapes=target.shapes, ranks=ranks)
        del joined


def build_layer_files(source: PipelineSource, target: PipelineTarget, indices: Sequence[int], tag_dir: str,
                      trust_pickle: bool, report: WorkerReport) -> list[str]:
    """With tp changed, the target's layer files of `indices` (write_model_axis_layer_files)."""
    paths = []
    for index in indices:
        report.bytes_read += sum(os.path.getsize(os.path.join(source.tag_dir, name)) for name in source.layer_files
                                 if name.startswith(f"layer_{index:02d}-"))
        paths += write_model_axis_layer_files(source, target.layers, target.model_axis, index, target.topology.tp,
                                              tag_dir, trust_pickle)
    return paths


def stage_source_bytes(source: PipelineSource, stage: int, model: int = 0) -> int:
    """Bytes of source (stage, model rank)'s model-states file and optimizer files."""
    return sum(os.path.getsize(os.path.join(source.tag_dir, name)) for name in column_files(source, stage, model))


def run_pipeline_unit(opts: ReshardOptions, unit: Unit, transport: Transport, clock: PhaseClock) -> CheckpointResult:
    started = time.perf_counter()
    if transport.rank != 0 and opts.target_tp is not None and not opts.dry_run:
        # A tp change re-cuts the layer files and spreads each unit's optimizer files over the workers,
        # so every worker torch.saves; importing torch (about 2 CPU seconds) while worker 0 inspects,
        # rather than after, takes it off the critical path.
        import torch  # noqa: F401

    source, (planned, needed) = inspect_on_worker0(
        unit, transport, clock, lambda src, tag: inspect_pipeline(src, tag, trust_pickle=opts.trust_pickle),
        lambda source: checked_target(opts, source, transport.size))
    target = planned.topology
    result = CheckpointResult(source.save_dir, unit.destination, source.tag, source.describe(),
                              Topology(dp=source.dp, tp=source.tp, pp=source.pp), target, transport.size,
                              transport.name, 0, 0.0, opts.dry_run)
    if planned.tp_changed:  # a unit's dp ranks spread over the workers, with the layer files
        writes, layer_writes = zip(*tp_change_shares(source, planned, transport.size))
    else:
        writes = stage_files_written_by(target.pp, target.tp, transport.size)
        layer_writes = ((),) * transport.size  # the layer files are copied as they are
    units_named = target.tp > 1 or source.tp > 1
    layers_how = (f"the layer files of {len(layer_indices(source))} layers re-cut for tp {target.tp}" if planned.tp_changed
                  else f"{len(source.layer_files)} layer files copied unchanged")
    result.notes.append(f"pipeline: {describe_target(opts, source, planned)}; {layers_how}; whole tensors "
                        f"({budget_verdict(needed, opts.memory_budget)}); "
                        + ("(stage, model rank, dp ranks) shares" if planned.tp_changed else
                           "(stage, model rank) units" if units_named else "stages") + " built by workers " +
                        ", ".join(f"{w}: {[u if units_named else u[0] for u in units]}"
                                  for w, units in enumerate(writes) if units))
    if opts.dry_run:
        result.seconds = time.perf_counter() - started
        return result

    output = pipeline_output(opts, source, planned)
    whole_files = WholeFileSource(source.tag, source.tag_dir, output.identified, output.carried, (),
                                  output.manifest_source, save_dir=source.save_dir)

    def build(tag_dir: str, identity: dict, report: WorkerReport) -> list[str]:
        return [*(path for _, paths in build_stages(source, planned, writes[transport.rank], tag_dir,
                                                    opts.trust_pickle, report) for path in paths),
                *build_layer_files(source, planned, layer_writes[transport.rank], tag_dir, opts.trust_pickle, report)]

    return run_whole_file_job(
        opts, unit, transport, clock, result, started, whole_files,
        lambda identity: output.fingerprint(source, identity, planned),
        output.manifest_target, WorkerReport(transport.rank, (), ()), build)
