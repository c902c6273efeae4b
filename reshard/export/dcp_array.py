"""The DCP export as a SLURM array job: K independent tasks, no collectives, then `reshard publish OUT`.

    python -m reshard export SRC OUT --format dcp --array-task 3 --array-tasks 8   # task 3 of 8
    sbatch --array=0-7 launch/slurm-array.sbatch export SRC OUT --format dcp        # (the same, per task)
    python -m reshard publish OUT                                                   # once every task is done

Every task inspects the source and derives the same export as a collective export of K workers
(`dcp_job.derive_export`: the same row-block chunks dealt to K files, the same names
`__{task}_0.distcp`, the same fingerprint). Task I writes the files worker I would write: the
one-worker plan restricted to those files (`restricted_to_files`), over a LocalTransport, so it preads
only the source bytes its chunks hold (the chunks are dealt in parameter order, so the tasks' reads
are disjoint) and writes them in place in OUT/.reshard-staging/TAG, under `--memory-budget`.

The bookkeeping is the array reshard's (reshard.jobs.array_job, beside the staging in
OUT/.reshard-staging/TAG.array/): `record.json` (kind "dcp-export", the output's fingerprint, K, every
file and its task, the export's options; written by the first task, compared by every later one, so a
task started with another K or other options is refused by name), `done/NAME.json` per finished file
(size and BLAKE3, written after its fsync: a killed task, run again, rewrites only the files not marked
done, `lifecycle.ResumeByFile`) and the task's lock.

Publishing (`place_dcp_set`: by the task that finishes the set, or `reshard publish OUT`, under OUT's
lock, `lifecycle.publish_sets`) inspects the source again, checks it is the one the tasks exported,
and completes the staging as a collective export's worker 0 does (`dcp_job.complete_staging`: worker
0's file of whole tensors, steps and param groups, the run state, `.metadata` made with
torch.distributed.checkpoint's classes), then moves every file into OUT with `.metadata` last
(`lifecycle.publish_files`). So the output is byte for byte the collective export's with K workers.
While a task's files are not all done, publishing names the tasks still to run and places nothing.
"""
from __future__ import annotations

import functools
import os
import time
from dataclasses import dataclass, field

import numpy as np

from reshard.errors import OptionError, ReshardError
from reshard.export.dcp_job import (
    DcpExport,
    DcpWriter,
    complete_staging,
    derive_export,
    file_blobs,
    inspect_dcp,
    plan_dcp,
)
from reshard.export.dcp_layout import DEFAULT_CHUNK_BYTES
from reshard.export.dcp_output_layout import OUTPUT_LAYOUTS
from reshard.export.safetensors_job import DTYPES
from reshard.formats.source_reader import SourceReader
from reshard.jobs.array_job import (
    DONE_DIR,
    RECORD_NAME,
    array_set_dir,
    done_path,
    is_done,
    mark_done,
    publish_ready,
    write_record_once,
)
from reshard.jobs.destination import ARRAY_SUFFIX, RESHARD_NAMES, Staging
from reshard.jobs.execute import execute
from reshard.jobs.lifecycle import EXPORT, JobOutput, Lifecycle, ResumeByFile, publish_files
from reshard.jobs.progress import Progress, progress_enabled
from reshard.jobs.results import ExportResult, counted
from reshard.planning.plan import ReshardPlan
from reshard.transport.local import LocalTransport

KIND = "dcp-export"
"""The record's kind: `reshard publish` hands such a set to `place_dcp_set` (cli passes `PLACERS`)."""


def restricted_to_files(plan: ReshardPlan, files) -> ReshardPlan:
    """`plan` keeping only the segments that write into output files `files` (the plan's target ranks)."""
    wanted = np.asarray(sorted(files), dtype=np.int64)
    return ReshardPlan(plan.ownership, tuple(space.restricted(np.isin(space.table.dst_rank, wanted))
                                             for space in plan.spaces), plan.budget_bytes)


def file_paths(export: DcpExport, f: int) -> dict[str, int]:
    """Output file `f` as it lies in OUT: its path in each directory holding some of its blobs -> its size."""
    return {os.path.join(directory, export.names[f]) if directory else export.names[f]: size
            for directory, (placed, _, size) in file_blobs(export.layout, export.streams, f, export.out).items()
            if placed}


def chunk_files(export: DcpExport) -> dict[int, dict[str, int]]:
    """Every output file holding chunks: its index -> `file_paths` (its task is `export.plan.ownership.writer`)."""
    return {f: file_paths(export, f) for f in range(len(export.layout.files)) if export.layout.files[f]}


@dataclass
class DcpArrayTaskResult(ExportResult):
    """What one DCP export array task did: the figures every export has (reshard.jobs.results.ExportResult; a
    task is one worker) and its own; `summary()` names the task."""

    task: int = 0
    tasks: int = 1
    files: list = field(default_factory=list)
    """The files this task wrote in this run (those an earlier run finished are not written again)."""
    bytes_read: int = 0

    format_name = " (PyTorch DCP)"

    def summary(self) -> str:
        return (f"export task {self.task} of {self.tasks}: {self.source} (tag {self.tag}) -> {self.destination}"
                f"{self.format_name}\n  {counted(len(self.files), '.distcp file')} written, "
                f"{counted(self.rounds, 'round')}, {self.bytes_read} source bytes read, {self.seconds:.1f} s"
                + "".join(f"\n  note: {note}" for note in self.notes))


def export_dcp_array_task(source: str, destination: str, *, task: int, tasks: int, dtype: str = "fp32",
                          tag: str | None = None, memory_budget: int = 1 << 30,
                          chunk_bytes: int = DEFAULT_CHUNK_BYTES, trust_pickle: bool = False, overwrite: bool = False,
                          layout: str = "torch", quiet: bool = False) -> DcpArrayTaskResult:
    """Task `task` of `tasks`: its files of the DCP export, then the set published if it is complete."""
    if tasks < 1 or not 0 <= task < tasks:
        raise OptionError(f"--array-task must be in [0, --array-tasks), got {task} of {tasks}")
    if dtype not in DTYPES:
        raise OptionError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if layout not in OUTPUT_LAYOUTS:
        raise OptionError(f"--layout must be one of {', '.join(OUTPUT_LAYOUTS)}, got {layout!r}")
    if chunk_bytes < 1:
        raise OptionError("--chunk-size must be positive")
    started = time.perf_counter()
    out = OUTPUT_LAYOUTS[layout]
    source, destination = str(source), str(destination)
    export = derive_export(inspect_dcp(source, destination, tag, DTYPES[dtype], trust_pickle, out), tasks,
                           DTYPES[dtype], chunk_bytes, memory_budget, out)
    checkpoint = export.source
    ownership = export.plan.ownership
    paths = chunk_files(export)
    owned = list(paths)
    mine = [f for f in owned if ownership.writer(f) == task]
    array_dir = array_set_dir(destination, checkpoint.tag)
    record = {"kind": KIND, "fingerprint": export.fingerprint, "tasks": tasks, "tag": checkpoint.tag,
              "owners": {path: ownership.writer(f) for f in owned for path in paths[f]},
              "export": {"source": os.path.abspath(source), "tag": checkpoint.tag, "dtype": dtype,
                         "chunk_bytes": chunk_bytes, "layout": layout, "memory_budget": memory_budget,
                         "trust_pickle": trust_pickle}}
    resume = ResumeByFile(
        {path: size for f in mine for path, size in paths[f].items()}, functools.partial(is_done, array_dir),
        (array_dir, os.path.join(array_dir, DONE_DIR)),
        lambda staging: write_record_once(os.path.join(array_dir, RECORD_NAME), record),
        os.path.join(array_dir, f"task-{task}"),
        f"The files this task finished stay marked done in {array_dir}; fix the cause and re-run export task "
        f"{task} to write the rest")
    result = DcpArrayTaskResult(checkpoint.save_dir, destination, checkpoint.tag, workers=1, rounds=0, task=task,
                                tasks=tasks)
    life = Lifecycle(destination, checkpoint.tag, leader=True, overwrite=overwrite, words=EXPORT, resume=resume)
    start = life.begin(LocalTransport(), lambda: JobOutput(export.fingerprint, set(RESHARD_NAMES)))
    result.notes += start.notes
    todo = [f for f in mine if any(path in start.remaining for path in paths[f])]

    def work() -> None:
        if not todo:
            return
        staged = life.staging.tag_dir
        writer = DcpWriter.create(export.layout, export.streams, export.names, staged, todo, False, out)
        try:
            # rounds of the one-worker plan take an equal window of every file; scaled so that, restricted
            # to this task's files, a round holds about the budget
            scale = len(owned) / len(todo)
            share = restricted_to_files(plan_dcp(checkpoint, export.layout, 1, int(memory_budget * scale),
                                                 export.pipeline), todo)
        except BaseException:
            writer.close()
            raise
        ranks = sorted({int(r) for space in share.spaces for r in np.unique(space.table.src_rank)})
        result.rounds = sum(int(np.count_nonzero(space.windows.round_elements(space.table))) for space in share.spaces)
        result.bytes_read = execute(
            share, LocalTransport(),
            open_source=lambda: SourceReader.open(checkpoint, ranks, trust_pickle=trust_pickle),
            open_sink=lambda: writer, opening="opening source files and creating output files",
            finish=lambda reader, sink: sink.finish(),  # CRCs filled, fsync, close
            after=lambda reader, sink, finished: reader.bytes_read,
            progress=Progress(f"export task {task}", progress_enabled(quiet, first_worker=True)))
        for f in todo:
            for path in paths[f]:
                mark_done(array_dir, path, os.path.join(staged, path))
                result.files.append(path)

    life.run(work)
    result.notes += publish_ready(destination, placers=PLACERS)
    result.seconds = time.perf_counter() - started
    return result


def place_dcp_set(destination: str, record: dict, array_dir: str) -> None:
    """Every file of the set done: complete the staging as a collective export's worker 0 does and move it
    into OUT, `.metadata` last (`publish_ready` calls this under OUT's lock)."""
    options = record["export"]
    out = OUTPUT_LAYOUTS[options["layout"]]
    dtype = DTYPES[options["dtype"]]
    export = derive_export(inspect_dcp(options["source"], destination, options["tag"], dtype, options["trust_pickle"],
                                       out), record["tasks"], dtype, options["chunk_bytes"], options["memory_budget"],
                           out)
    if export.fingerprint != record["fingerprint"]:
        raise ReshardError(f"{export.source.tag_dir}: changed since the array tasks exported it (its files' sizes or "
                           f"times differ); remove {array_dir} and {staging_of(array_dir)} and run every task again")
    paths = chunk_files(export)
    expected = {path: size for f in paths for path, size in paths[f].items()}
    owners = {path: export.plan.ownership.writer(f) for f in paths for path in paths[f]}
    if owners != record["owners"]:  # a record edited by hand: publishing it would describe other files
        raise ReshardError(f"{os.path.join(array_dir, RECORD_NAME)}: its files and their tasks are not those a "
                           f"{record['tasks']}-task export of this source writes; remove {array_dir} and "
                           f"{staging_of(array_dir)} and run every task again")
    staging = Staging(destination, record["tag"])
    for path, owner in owners.items():
        staged = os.path.join(staging.tag_dir, path)
        if not os.path.isfile(staged) or os.path.getsize(staged) != expected[path]:
            problem = "missing" if not os.path.isfile(staged) else f"not the {expected[path]} bytes it must hold"
            raise ReshardError(f"{staged}: marked done but {problem}; remove {done_path(array_dir, path)} and "
                               f"re-run export task {owner}")
    complete_staging(export, staging.tag_dir, options["memory_budget"], options["trust_pickle"])
    publish_files(staging, last=out.complete_marker)


def staging_of(array_dir: str) -> str:
    """OUT/.reshard-staging/TAG of the set whose bookkeeping is OUT/.reshard-staging/TAG.array."""
    return array_dir[:-len(ARRAY_SUFFIX)]


PLACERS = {KIND: place_dcp_set}
"""What `reshard publish` (reshard.jobs.array_job.publish_ready) is given to place the exports' array sets."""
