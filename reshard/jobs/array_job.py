"""SLURM array jobs: K independent tasks, no collectives; each writes a fixed share of the target files.

    python -m reshard SRC DST --target-dp 64 --array-task 3 --array-tasks 8    # task 3 of 8
    sbatch --array=0-7 launch/slurm-array.sbatch SRC DST --target-dp 64
    python -m reshard publish DST                                             # see publish_ready

Every task inspects the source and derives the same assignment (pure, deterministic,
`deal_files`): the target files of every checkpoint, and the other files of each source tag
directory, are dealt out by size, largest first, each to the least-loaded task, so that tasks
get about equal bytes and no two tasks write the same file. A task then runs the reshard plan
for one worker restricted to the segments its own files hold (`restrict_to_files`): it preads
exactly the source byte ranges those need and writes them in place, through the same
exchange code as a collective job but over a LocalTransport, so no other process is involved.
Every save is inspected, targeted and planned as the collective job does it (`preflight.checkpoint_target`:
the stage form plans and names the target files), so native MoE, AutoEP and ZeRO-0 MoE saves (each
EP rank's file and the model-states file's copy of EP rank 0's optimizer dealt as target files) publish
the collective job's bytes, manifest included; AutoTP saves, AutoEP folded with AutoTP layers among them,
are refused by name (`refuse_tensor_parallel`).
A DeepSpeed PipelineModule save goes through the same plan as the collective job
(`_PipelineColumnsUnit`, inspected by the collective job's own `inspect_pipeline_target`), dealt the same way
over every target rank (stage, dp rank, model rank); its layer files are copied with tp kept, and with
tp changed are target files of the plan, re-cut (issue 37).

A task runs the one lifecycle every job runs (reshard.jobs.lifecycle: complete or not, the
destination check, staging, lock, free space, clean-up), resuming per file
(`lifecycle.ResumeByFile`) instead of by rounds. What an array job supplies is its bookkeeping,
beside the staging tag directory in DST/.reshard-staging/TAG.array/: `record.json` (what the set
is: output fingerprint, K, every file and its owner, the manifest fields; written once, by
whichever task comes first, and compared by every later one), `done/NAME.json` (NAME is complete
and fsynced: its size and BLAKE3: the per-file completion marker), and `task-I/` (where the
lifecycle keeps the task's lock: one live run per task). Tasks may run at any time, in any order,
on any hosts that see SRC and DST, one after another or at once, and may be retried: a retried
task redoes the files it had not finished.

After its own files, each task publishes every checkpoint of its destinations whose files are
all done (`publish_ready`: the final assembly, a manifest from the markers, is this module's; the
placing, under the destination lock so that exactly one process moves a tag directory into place
and writes `latest`, last, once every tag of that destination is in place, is
`lifecycle.publish_sets`).
"""
from __future__ import annotations

import functools
import glob
import heapq
import json
import os
import sys
import time
import urllib.parse
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from reshard.jobs import save_dir_files
from reshard.files.byte_io import hash_file
from reshard.jobs.destination import (
    ARRAY_DONE,
    ARRAY_RECORD,
    ARRAY_SUFFIX,
    STAGING,
    Staging,
    check_paths,
    stale_staging_notes,
)
from reshard.errors import OptionError, ReshardError
from reshard.jobs.execute import execute
from reshard.layouts.experts import expert_placement_lines
from reshard.formats.deepspeed_files.deepspeed_inspect import inspect_checkpoint
from reshard.formats.deepspeed_files.deepspeed_pipeline import (
    is_pipeline,
)
from reshard.formats.deepspeed_files.deepspeed_spec import (
    SourceCheckpoint,
    refuse_tensor_parallel,
)
from reshard.formats.deepspeed_files.deepspeed_zero0_moe import inspect_zero0_moe_checkpoint, is_zero0_moe
from reshard.formats.deepspeed_files.stage_change import ZeroStageTarget
from reshard.formats.torch_bytes.torch_archive import NewTensor, TensorRef, dtype_of, refs_in
from reshard.jobs.lifecycle import (
    JobOutput,
    Lifecycle,
    ReadySet,
    ResumeByFile,
    destination_names,
    publish_checkpoint,
    publish_sets,
)
from reshard.jobs.manifest import (
    output_entries,
    source_identity,
    write_json_atomically,
)
from reshard.jobs.options import ReshardOptions
from reshard.planning.plan import ReshardPlan
from reshard.jobs.preflight import (
    ZERO3_RANK_IDENTITY_NOTE,
    CheckpointTarget,
    checkpoint_target,
    outputs_of,
    preflight,
)
from reshard.files.resources import (
    anonymous_rss_bytes,
    ensure_open_files,
    peak_resident_bytes,
)
from reshard.jobs.results import CheckpointResult, ReshardResult, WorkerReport
from reshard.jobs.progress import Progress, progress_enabled
from reshard.jobs.runs import Unit, discover_units
from reshard.formats.deepspeed_files.source_reader import SourceReader
from reshard.formats.deepspeed_files.target_writer import TargetWriter
from reshard.topology import Topology
from reshard.transport.local import LocalTransport

SAVE_DIR_FILES = save_dir_files.STAGED
"""The item standing for every file of the save directory beside DeepSpeed's (reshard.jobs.save_dir_files)."""
RECORD_NAME = ARRAY_RECORD
DONE_DIR = ARRAY_DONE


@dataclass(frozen=True)
class ArrayFile:
    """One file of the output set: a target file, or a file copied from the source tag directory."""

    unit: int
    """Index of its checkpoint in the job's units (reshard.jobs.runs.discover_units order)."""
    name: str
    nbytes: int
    """Tensor bytes it holds (target file) or its size (copied file): what balancing weighs."""
    rank: int | None
    """Target rank whose file it is; None for a file copied from the source tag directory."""


def deal_files(files: list[ArrayFile], tasks: int) -> list[int]:
    """Owner task of each file: largest first, each to the least-loaded task (ties: the lower task)."""
    order = sorted(range(len(files)), key=lambda i: (-files[i].nbytes, files[i].unit, files[i].name))
    loads = [(0, task) for task in range(tasks)]
    owners = [0] * len(files)
    for i in order:
        load, task = heapq.heappop(loads)
        owners[i] = task
        heapq.heappush(loads, (load + files[i].nbytes, task))
    return owners


def _tensor_bytes(tree) -> int:
    seen, total = set(), 0
    for ref in refs_in(tree):
        if isinstance(ref, NewTensor):
            total += ref.numel * dtype_of(ref.dtype).itemsize
        elif isinstance(ref, TensorRef) and ref.storage_key not in seen:
            seen.add(ref.storage_key)
            total += ref.storage_nbytes
    return total


def files_of(unit_index: int, source: SourceCheckpoint, target: CheckpointTarget, plan: ReshardPlan,
             carried=()) -> list[ArrayFile]:
    """Every file of one checkpoint's output, weighed: each target rank's of `plan` (the one-worker plan),
    named by the stage form (`target.zero.files`, as the collective job names them); `carried`
    (save-directory files) count as one item."""
    files = [ArrayFile(unit_index, file.name, _tensor_bytes(file.tree), rank)
             for rank in range(plan.ownership.target_ranks)
             for file in target.zero.files(source, target.topology, rank)]
    files += [ArrayFile(unit_index, name, os.path.getsize(os.path.join(source.tag_dir, name)), None)
              for name in sorted(source.other_files)]
    if carried:
        files.append(ArrayFile(unit_index, SAVE_DIR_FILES,
                               sum(os.path.getsize(os.path.join(source.save_dir, name)) for name in carried), None))
    return files


def restrict_to_files(plan: ReshardPlan, locations) -> ReshardPlan:
    """`plan` (for one worker) keeping only the segments whose target buffers `locations` holds.

    `locations` are a TargetWriter's keys, (rank, (space, buffer, stream)); every stream of a
    kept buffer that receives elements must be there (DeepSpeed keeps a buffer's states in one file;
    an empty tensor, such as the fp32 partition of a rank that holds only a group's padding, has no
    location and receives nothing)."""
    streams_of = defaultdict(set)
    for rank, (space, buffer, stream) in locations:
        streams_of[(space, rank, buffer)].add(stream)
    spaces = []
    for space in plan.spaces:
        keys = [(rank, buffer) for (name, rank, buffer), streams in streams_of.items() if name == space.name]
        seg = space.table
        width = int(seg.dst_buffer.max()) + 1 if len(seg) else 1
        wanted = np.asarray([rank * width + buffer for rank, buffer in keys if buffer < width], dtype=np.int64)
        keep = np.isin(seg.dst_rank * width + seg.dst_buffer, wanted)
        receiving = set(np.unique((seg.dst_rank * width + seg.dst_buffer)[keep & (seg.length > 0)]).tolist())
        for rank, buffer in keys:
            missing = {s.name for s in space.streams} - streams_of[(space.name, rank, buffer)]
            if missing and rank * width + buffer in receiving:
                raise ReshardError(f"target rank {rank}: states {sorted(missing)} of {space.name} buffer {buffer} "
                                   "are in another file; array tasks cannot split them")
        spaces.append(space.restricted(keep))
    return ReshardPlan(plan.ownership, tuple(spaces), plan.budget_bytes)


def array_set_dir(destination: str, tag: str) -> str:
    return os.path.join(destination, STAGING, tag + ARRAY_SUFFIX)


def done_path(array_dir: str, name: str) -> str:
    """The marker of file `name` (a relative path for files in sub-directories of the tag directory)."""
    return os.path.join(array_dir, DONE_DIR, urllib.parse.quote(name, safe="") + ".json")


def is_done(array_dir: str, name: str) -> bool:
    """File `name` of the set is complete and fsynced: its marker exists (the per-file resume)."""
    return os.path.isfile(done_path(array_dir, name))


def _read_json(path: str):
    try:
        with open(path) as fd:
            return json.load(fd)
    except FileNotFoundError:
        return None
    except ValueError:
        raise ReshardError(f"{path}: unreadable (not JSON); remove it and re-run") from None


def write_record_once(path: str, record: dict) -> None:
    """Write `record` unless a task got there first; then it must describe the same set."""
    temporary = f"{path}.{os.getpid()}.tmp"
    with open(temporary, "w") as fd:
        json.dump(record, fd, indent=1, sort_keys=True)
        fd.flush()
        os.fsync(fd.fileno())
    try:
        os.link(temporary, path)  # atomic and exclusive: exactly one task's record wins
    except FileExistsError:
        pass
    finally:
        os.unlink(temporary)
    existing = _read_json(path)
    for key in ("fingerprint", "tasks", "owners"):
        if existing.get(key) != record[key]:
            raise OptionError(f"{path}: the staging there belongs to another array job ({key} differs: "
                              f"{existing.get('tasks')} tasks, output {existing.get('fingerprint')}); run the "
                              f"same command as its other tasks, or remove {os.path.dirname(path)} and "
                              f"{os.path.dirname(path)[:-len(ARRAY_SUFFIX)]} once none of them runs")


def inspect_unit(opts: ReshardOptions, unit: Unit, inspect_pipeline=None) -> "_ZeroUnit":
    """One checkpoint inspected, its target worked out, and the options checked against it.
    `inspect_pipeline(opts, save_dir, tag)`: (source, target, notes) of a pipeline save
    (reshard.jobs.collective_job.inspect_pipeline_target: the collective job's own inspection, handed
    down from above this module)."""
    check_paths(unit.source, unit.destination)
    if is_pipeline(os.path.join(unit.source, unit.tag)):
        if inspect_pipeline is None:
            raise OptionError(f"{os.path.join(unit.source, unit.tag)}: a pipeline checkpoint in array mode needs "
                              "the collective job's inspection (run it through `python -m reshard` or "
                              "reshard.jobs.collective_job.run_job)")
        source, target, notes = inspect_pipeline(opts, unit.source, unit.tag)  # through the plan, as the collective job
        carried = save_dir_files.list_save_dir_files(source.save_dir)
        return _PipelineColumnsUnit(source, target, _one_worker_plan(opts, source, target), carried,
                                    notes + preflight(opts, source, target.topology, carried))
    # as the collective job inspects it (collective_job.WholeWorld.inspect): a ZeRO-0 MoE save by its own
    # inspector, whose stage form (deepspeed_zero0_moe.Zero0Moe) plans and names its files
    inspect = inspect_zero0_moe_checkpoint if is_zero0_moe(os.path.join(unit.source, unit.tag)) else inspect_checkpoint
    source = inspect(unit.source, unit.tag, trust_pickle=opts.trust_pickle, read_tensors=not opts.dry_run)
    # AutoTP, and AutoEP folded with AutoTP layers, whose expert files the collective job rewrites beside the plan
    refuse_tensor_parallel(source, "SLURM array mode (--array-task)")
    target = checkpoint_target(opts, source)  # refuses --target-ep > 1 for a checkpoint without experts
    carried = save_dir_files.list_save_dir_files(source.save_dir)
    return _ZeroUnit(source, target, _one_worker_plan(opts, source, target), carried,
                     preflight(opts, source, target.topology, carried))


def _one_worker_plan(opts: ReshardOptions, source: SourceCheckpoint, target: CheckpointTarget) -> ReshardPlan:
    """The plan for one worker under the job's budget (its rounds are the result's; its target ranks the
    files dealt out), from the piece tables an array task restricts."""
    return target.zero.plan(source, target.topology, 1, opts.memory_budget, tabulated=True)


def run_array_task(opts: ReshardOptions, inspect_pipeline=None) -> ReshardResult:
    """Run task `opts.array_task` of `opts.array_tasks`, then publish whatever is complete.
    `inspect_pipeline`: as `inspect_unit` takes it."""
    started = time.perf_counter()
    task, tasks = opts.array_task, opts.array_tasks
    check_paths(opts.source, opts.destination)
    units, notes = discover_units(opts.source, opts.destination, opts.tag, opts.all_tags)
    result = ReshardResult(notes=notes)
    inspected = [inspect_unit(opts, unit, inspect_pipeline) for unit in units]
    files = [f for index, job in enumerate(inspected) for f in job.files(index)]
    owners = deal_files(files, tasks)
    shares = []
    for index, job in enumerate(inspected):
        unit_files = [(f, owner) for f, owner in zip(files, owners) if f.unit == index]
        shares.append(({f.name: owner for f, owner in unit_files}, [f for f, owner in unit_files if owner == task]))
        job.check(opts, [f for f, _ in unit_files], shares[-1][0])  # every task refuses what any task could not do
    for unit, job, (unit_owners, mine) in zip(units, inspected, shares):
        same = [u for u in units if u.destination == unit.destination]
        place = {"destination_tags": [u.tag for u in same], "latest": next((u.latest for u in same if u.latest), None)}
        result.checkpoints.append(job.run_share(opts, unit, unit_owners, mine, place))
    if not opts.dry_run:
        for destination in dict.fromkeys(unit.destination for unit in units):
            same = [unit for unit in units if unit.destination == destination]
            latest = next((unit.latest for unit in same if unit.latest), None)
            result.notes += publish_ready(destination, tags=[unit.tag for unit in same], latest=latest)
            result.notes += stale_staging_notes(destination, [unit.tag for unit in same])
    result.seconds = time.perf_counter() - started
    return result


@dataclass(frozen=True)
class ArrayOutput:
    """What one checkpoint's array set is, whatever kind of checkpoint: its record's and manifest's
    entries, and where the files it copies come from."""

    tag: str
    tag_dir: str
    """The source tag directory (its other files are copied as they are)."""
    save_dir: str
    fingerprint: str
    source: dict
    """The manifest's "source" entry, "files" (the source identity) included."""
    target: dict
    """The manifest's "target" entry."""
    outputs: dict
    """Earlier outputs of this source in DST (reshard.jobs.preflight.outputs_of): complete check, names allowed."""
    carried: list = field(default_factory=list)
    """Files of the save directory carried beside the tag directory (reshard.jobs.save_dir_files)."""
    other_dirs: list = field(default_factory=list)
    """Sub-directories of the source tag directory, re-created when the set is published."""


@dataclass
class _ZeroUnit:
    """A ZeRO-1/2/3 checkpoint (native MoE and AutoEP included) or a ZeRO-0 MoE one: target files dealt
    one by one, each written through the one-worker plan restricted to it (`restrict_to_files`). Its
    target and files are the collective job's (collective_job.WholeWorld.inspect), its fingerprint and manifest
    entries the one rule every job kind uses (manifest.output_entries), so the set publishes the same bytes."""

    source: SourceCheckpoint
    checkpoint: CheckpointTarget
    """The target, worked out as the collective job works it out (preflight.checkpoint_target)."""
    plan: ReshardPlan
    """The one-worker plan under the job's budget (`_one_worker_plan`)."""
    carried: list
    notes: list

    @property
    def target(self) -> Topology:
        return self.checkpoint.topology

    @property
    def zero(self) -> ZeroStageTarget:
        return self.checkpoint.zero

    def files(self, index: int) -> list[ArrayFile]:
        return files_of(index, self.source, self.checkpoint, self.plan, self.carried)

    def check(self, opts: ReshardOptions, files: list[ArrayFile], owners: dict) -> None:
        pass  # the rounds keep every task within --memory-budget

    def output(self, opts: ReshardOptions, unit: Unit) -> ArrayOutput:
        """What the set is: its fingerprint, manifest entries (manifest.output_entries, as the collective job's)
        and where its copied files come from."""
        zero = self.zero
        target_ep = self.target.ep if self.source.spec.experts is not None else None
        return self._output(opts, outputs_of(unit.destination, self.source.save_dir, self.target.dp, 1, zero.stage,
                                             target_ep))

    def _output(self, opts: ReshardOptions, outputs: dict) -> ArrayOutput:
        source, carried = self.source, self.carried
        names = [n for r in range(source.spec.topology.world_size)
                 for n in map(os.path.basename, source.source_files(r, self.target))]
        identity = source_identity(source.tag_dir, set(names) | set(source.other_files)
                                   | set(save_dir_files.manifest_names(carried)))
        entries = output_entries(opts, source, self.checkpoint, identity)
        return ArrayOutput(source.tag, source.tag_dir, source.save_dir, entries.fingerprint, entries.source,
                           entries.target, outputs, carried, list(source.other_dirs))

    def run_share(self, opts: ReshardOptions, unit: Unit, owners: dict, mine: list, place: dict) -> CheckpointResult:
        source, target, plan = self.source, self.target, self.plan
        started = time.perf_counter()
        spec = source.spec
        ranks = tuple(sorted({f.rank for f in mine if f.rank is not None}))
        result = CheckpointResult(source.save_dir, unit.destination, source.tag, spec.describe(), spec.topology,
                                  target, opts.array_tasks, _no_collectives(opts), plan.rounds, 0.0, opts.dry_run,
                                  plan, notes=list(self.notes))
        report = WorkerReport(opts.array_task, (), ranks)
        result.reports = [report]
        if spec.experts is not None:
            result.notes += expert_placement_lines(spec.experts, target)
        if spec.stage == 3:
            result.notes.append(ZERO3_RANK_IDENTITY_NOTE)
        result.notes += self.zero.notes(spec)
        if opts.dry_run:
            result.notes.append(_dry_run_note(opts, mine, [f.name for f in mine]))
            return result
        output = self.output(opts, unit)

        def write_targets(tag_dir: str, array_dir: str, targets: list) -> int:
            return _write_targets(opts, source, self.checkpoint, plan.ownership.target_ranks, tag_dir, array_dir,
                                  targets, report)
        return _run_share(opts, unit, output, owners, mine, place, result, report, started, write_targets)


@dataclass
class _PipelineColumnsUnit(_ZeroUnit):
    """A PipelineModule save (dp, pp or tp changed), inspected as the collective job inspects it
    (collective_job.inspect_pipeline_target): its target files dealt one by one over every target rank
    (stage, dp rank, model rank) and each written through the one-worker plan restricted to it, as a ZeRO
    save's; the layer files copied with tp kept, re-cut target files with tp changed.
    Fingerprint and manifest entries are every job kind's (manifest.output_entries), so the set publishes
    the same bytes."""

    def output(self, opts: ReshardOptions, unit: Unit) -> ArrayOutput:
        return self._output(opts, outputs_of(unit.destination, self.source.save_dir, self.target.dp, 1, 1))


def _no_collectives(opts: ReshardOptions) -> str:
    return f"no collectives (array task {opts.array_task} of {opts.array_tasks})"


def _dry_run_note(opts: ReshardOptions, mine: list, names: list[str]) -> str:
    return (f"task {opts.array_task} writes {len(names)} file(s), {sum(f.nbytes for f in mine)} bytes: "
            f"{', '.join(names) or '-'}")


def _run_share(opts: ReshardOptions, unit: Unit, output: ArrayOutput, owners: dict, mine: list, place: dict,
               result: CheckpointResult, report: WorkerReport, started: float, write_targets) -> CheckpointResult:
    """This task's items of one checkpoint, on the one lifecycle (reshard.jobs.lifecycle) resuming per
    item. `place`: every tag going to the unit's destination, and `latest`. `write_targets(staging
    tag directory, array_dir, items)` writes the items that are target files, marks each done once
    it is durable, and returns the number of rounds that moved data."""
    array_dir = array_set_dir(unit.destination, output.tag)
    record = {
        "fingerprint": output.fingerprint, "tasks": opts.array_tasks, "tag": output.tag, "owners": owners,
        "source": output.source, "target": output.target, "other_dirs": list(output.other_dirs),
        "save_dir_files": output.carried,
        **place}
    resume = ResumeByFile(
        {f.name: f.nbytes for f in mine}, functools.partial(is_done, array_dir),
        (array_dir, os.path.join(array_dir, DONE_DIR)),
        lambda staging: write_record_once(os.path.join(array_dir, RECORD_NAME), record),
        os.path.join(array_dir, f"task-{opts.array_task}"),
        f"The files this task finished stay marked done in {array_dir}; fix the cause and re-run array task "
        f"{opts.array_task} to write the rest")
    life = Lifecycle(unit.destination, output.tag, leader=True, overwrite=opts.overwrite, resume=resume)
    start = life.begin(LocalTransport(), lambda: JobOutput(output.fingerprint,
                                                           destination_names(output.outputs, output.carried),
                                                           earlier=output.outputs.get(output.tag)))
    result.notes += start.notes
    if start.mode == "complete":
        return result
    staging = life.staging
    todo = [f for f in mine if f.name in start.remaining]

    def work() -> None:  # an OSError becomes the lifecycle's WriteFailed, ending with `resume.rerun`
        for f in todo:
            if f.name == SAVE_DIR_FILES:
                entries = save_dir_files.stage(output.save_dir, output.carried,
                                               save_dir_files.staging_dir(staging.tag_dir), unit.destination)
                report.bytes_carried += sum(entry["bytes"] for entry in entries.values())
                write_json_atomically(done_path(array_dir, f.name), {"save_dir_files": entries})
            elif f.rank is None:
                staging.copy_in(output.tag_dir, [f.name])
                path = os.path.join(staging.tag_dir, f.name)
                report.bytes_carried += os.path.getsize(path)
                mark_done(array_dir, f.name, path)
        targets = [f for f in todo if f.rank is not None]
        result.rounds = write_targets(staging.tag_dir, array_dir, targets) if targets else 0

    life.run(work)
    report.peak_rss_bytes = peak_resident_bytes()
    report.peak_anonymous_bytes = anonymous_rss_bytes()
    result.seconds = time.perf_counter() - started
    return result


def _plan_for_share(source: SourceCheckpoint, target: CheckpointTarget, opts: ReshardOptions, locations,
                    target_ranks: int) -> ReshardPlan:
    """The one-worker plan, its rounds sized for the target ranks this share writes.

    A round of the one-worker plan takes an equal window of every target rank's buffers; a
    share keeps only its own ranks' parts, so the plan is made with the budget scaled by
    M / (ranks in the share): once restricted, a round holds at most a third of the real budget."""
    ranks = {rank for rank, _ in locations}
    scale = target_ranks / max(1, len(ranks))
    return target.zero.plan(source, target.topology, 1, int(opts.memory_budget * scale), tabulated=True)


def _write_targets(opts, source: SourceCheckpoint, target: CheckpointTarget, target_ranks: int, tag_dir: str,
                   array_dir: str, targets: list, report: WorkerReport) -> int:
    """Write `targets` complete: skeletons, carried storages, then every slice read straight from the source.
    Returns the number of rounds that moved data."""
    ranks = sorted({f.rank for f in targets})
    per_rank = 2 if source.spec.stage == 3 else 1
    ensure_open_files(per_rank * source.spec.topology.world_size + len(targets) + 1)
    writer = TargetWriter.create(source, tag_dir, target.topology, ranks, only={f.name for f in targets},
                                 files_of=target.zero.files)
    try:
        share = restrict_to_files(_plan_for_share(source, target, opts, writer.locations, target_ranks),
                                  writer.locations)
    except BaseException:
        writer.close()
        raise
    source_ranks = sorted({int(r) for space in share.spaces for r in np.unique(space.table.src_rank)})
    report.source_ranks = tuple(source_ranks)
    # rounds with data
    rounds = sum(int(np.count_nonzero(space.windows.round_elements(space.table))) for space in share.spaces)
    hashes, report_read = execute(
        share, LocalTransport(),
        open_source=lambda: SourceReader.open(source, source_ranks, target=target.topology,
                                              trust_pickle=opts.trust_pickle, extra_slots=target.zero.source_slots),
        open_sink=lambda: writer, opening="opening source files",
        opened=lambda reader, sink: sink.copy_in_background(),
        finish=lambda reader, sink: sink.finish(),  # fsync, hash and close
        after=lambda reader, sink, hashes: (hashes, reader.bytes_read),
        # each task runs alone: it draws its own bar (rounds of its share), whatever its launcher's rank
        progress=Progress(f"reshard task {opts.array_task}", progress_enabled(opts.quiet, first_worker=True)))
    report.bytes_read += report_read
    report.bytes_written += writer.bytes_written
    report.bytes_carried += writer.bytes_carried
    for name, entry in hashes.items():
        write_json_atomically(done_path(array_dir, name), entry)
    return rounds


def _durable_entry(path: str) -> dict:
    """fsync the file at `path`, then its manifest entry."""
    with open(path, "rb+") as fd:
        os.fsync(fd.fileno())
    return {"bytes": os.path.getsize(path), "blake3": hash_file(path)}


def mark_done(array_dir: str, name: str, path: str) -> None:
    write_json_atomically(done_path(array_dir, name), _durable_entry(path))


def _missing(record: dict, array_dir: str) -> list[str]:
    return [name for name in sorted(record["owners"]) if not is_done(array_dir, name)]


def publish_ready(destination: str, *, tags: list[str] | None = None, latest: str | None = None,
                  lock_wait: float = 60.0, placers: dict | None = None) -> list[str]:
    """Publish every array set under `destination` whose files are all done; write `latest` last
    (reshard.jobs.lifecycle.publish_sets: under DST's lock, exactly once).

    `tags`/`latest`: every tag this destination receives and the one `latest` names (a task
    knows them from the source; `reshard publish DST` takes them from the records). `latest`
    is written once all those tags are in place. `placers`: record kind -> `place(destination, record,
    array_dir)` for the sets other jobs write (an export's array tasks, reshard.export.dcp_array, whose
    record names its "kind"); a set of a kind not given is left alone. Returns notes for the summary.
    """
    notes, ready = [], []
    placers = {None: _publish_record, **(placers or {})}
    for path in sorted(glob.glob(os.path.join(glob.escape(destination), STAGING, "*" + ARRAY_SUFFIX, RECORD_NAME))):
        record = _read_json(path)
        if record is None:
            continue
        array_dir = os.path.dirname(path)
        if record.get("kind") not in placers:
            continue
        missing = _missing(record, array_dir)
        output = destination if record.get("kind") else None  # an export's set is DST's files, not DST/TAG
        if missing:
            waiting = sorted({record["owners"][name] for name in missing})
            notes.append(f"{output or os.path.join(destination, record['tag'])}: {len(missing)} of "
                         f"{len(record['owners'])} file(s) still to write, by array task(s) "
                         f"{', '.join(map(str, waiting))}; not published yet")
        else:
            place = functools.partial(placers[record.get("kind")], destination, record, array_dir)
            ready.append(ReadySet(record["tag"], record["fingerprint"], array_dir, place, output))
        if tags is None:
            tags, latest = record.get("destination_tags"), record.get("latest")
    return notes + publish_sets(destination, ready, tags=tags or [], latest=latest, lock_wait=lock_wait)


def _publish_record(destination: str, record: dict, array_dir: str) -> None:
    """Manifest from the done markers, then the tag directory into place (reshard.jobs.lifecycle.publish_checkpoint)."""
    staging = Staging(destination, record["tag"])
    files = {}
    for item in record["owners"]:
        marker = _read_json(done_path(array_dir, item))
        if item == SAVE_DIR_FILES:
            files.update(marker["save_dir_files"])
            continue
        # a file, or several built together (a pipeline stage: {"files": {name: entry}})
        for name, entry in (marker["files"].items() if "files" in marker else [(item, marker)]):
            path = os.path.join(staging.tag_dir, name)
            if not os.path.isfile(path) or os.path.getsize(path) != entry["bytes"]:
                raise ReshardError(f"{path}: marked done with {entry['bytes']} bytes but "
                                   f"{'missing' if not os.path.isfile(path) else f'{os.path.getsize(path)} bytes'}; "
                                   f"remove {done_path(array_dir, item)} and re-run array task "
                                   f"{record['owners'][item]}")
            files[name] = entry
    staging.copy_in("", [], record.get("other_dirs", ()))  # empty sub-directories of the source tag directory
    publish_checkpoint(staging, record["fingerprint"], record["source"], record["target"], files, None,
                       record["source"]["save_dir"], record.get("save_dir_files") or [])


def build_publish_parser():
    """The parser of `reshard publish` (argparse.ArgumentParser)."""
    import argparse
    parser = argparse.ArgumentParser(prog="reshard publish",
                                     description="Publish the output of a finished SLURM array reshard: move each "
                                                 "complete tag into place and write `latest` last.")
    parser.add_argument("destination", help="DST given to the array tasks")
    return parser


def publish_main(argv: list[str], placers: dict | None = None) -> int:
    """`python -m reshard publish DST`: publish DST (and its run sub-directories) where every task is done.
    `placers`: as `publish_ready` takes them (the exports' array sets)."""
    args = build_publish_parser().parse_args(argv)
    if not os.path.isdir(args.destination):
        print(f"reshard publish: error: {args.destination}: no such directory", file=sys.stderr)
        return 2
    args.destination = os.path.abspath(args.destination)  # once, here: publishing compares absolute paths
    places = [args.destination] + sorted(os.path.join(args.destination, name) for name in os.listdir(args.destination)
                                         if os.path.isdir(os.path.join(args.destination, name, STAGING)))
    pending = False
    try:
        for place in places:
            for note in publish_ready(place, placers=placers):
                pending |= "not published" in note
                print(note)
    except ReshardError as error:
        print(f"reshard publish: error: {error}", file=sys.stderr)
        return 2
    return 1 if pending else 0
