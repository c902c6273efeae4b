"""An export as a SLURM array job: K independent tasks, no collectives, then `reshard publish OUT`.

    python -m reshard export SRC OUT --format FORMAT --array-task 3 --array-tasks 8   # task 3 of 8
    sbatch --array=0-7 launch/slurm-array.sbatch export SRC OUT --format FORMAT        # (the same, per task)
    python -m reshard publish OUT                                                      # once every task is done

The road every export format takes in array mode (reshard.export.dcp_array, safetensors_array,
universal_array each give it an `ArrayFormat`). Every task inspects the source and derives the same export
as a collective export of K workers (the format's `derive`: the same output files, the same owners, the same
fingerprint). Task I writes the files worker I would write: the one-worker plan restricted to those files
(`restricted_to_files`), over a LocalTransport, so it preads only the source bytes its files hold, and
writes them in place in OUT/.reshard-staging/TAG, under `--memory-budget`.

The bookkeeping is the array reshard's (reshard.jobs.array_job, beside the staging in
OUT/.reshard-staging/TAG.array/): `record.json` (the format's kind, the output's fingerprint, K, every file
and its task, the export's options; written by the first task, compared by every later one, so a task
started with another K or other options is refused by name), `done/NAME.json` per finished file (size and
BLAKE3, written after its fsync: a killed task, run again, rewrites only the files not marked done,
`lifecycle.ResumeByFile`) and the task's lock.

Publishing (`place_set`: by the task that finishes the set, or `reshard publish OUT`, under OUT's lock,
`lifecycle.publish_sets`) inspects the source again, checks it is the one the tasks exported and that the
record's files and owners are the ones this K-task export writes (a record edited by hand is refused), and
completes the staging as a collective export's worker 0 does (the format's `complete`), which places it.
So the output is byte for byte the collective export's with K workers. While a task's files are not all
done, publishing names the tasks still to run and places nothing.
"""
from __future__ import annotations

import functools
import json
import os
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from reshard.errors import OptionError, ReshardError
from reshard.formats.deepspeed_files.deepspeed_spec import SourceCheckpoint
from reshard.formats.deepspeed_files.source_reader import SourceReader
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
from reshard.jobs.lifecycle import EXPORT, JobOutput, Lifecycle, ResumeByFile
from reshard.jobs.progress import Progress, progress_enabled
from reshard.jobs.results import counted
from reshard.planning.plan import Ownership, ReshardPlan
from reshard.transport.local import LocalTransport


@dataclass(frozen=True)
class ArrayExport:
    """One format's export of one source as K tasks: what every task and the publisher derive the same."""

    source: SourceCheckpoint
    fingerprint: str
    ownership: Ownership
    """The K-worker plan's: output file f is written by task `ownership.writer(f)`."""
    files: dict
    """Output file index -> {its path relative to the staging tag directory: its bytes} (a file of the
    plan may be several paths: a DCP file in two directories, a universal bundle's per-parameter files)."""
    one_worker_plan: Callable[[int], ReshardPlan]
    """budget -> the plan of one worker writing every file (restricted to a task's files by the task)."""
    open_writer: Callable[[list, str], object]
    """(files, staging tag directory) -> the sink writing those files afresh."""
    complete: Callable[[Staging], None]
    """Every file in staging: complete it as the collective export's worker 0 does, and place it."""
    exact_sizes: bool = True
    """`files` gives each path's exact size (else an estimate: the done markers' sizes are checked)."""


@dataclass(frozen=True)
class ArrayFormat:
    """A format's array mode: its record kind, its words, and how it derives its `ArrayExport` from the
    options (the record's "export": "source", "tag", "memory_budget", "trust_pickle" and its own)."""

    kind: str
    name: str
    """As the summary names the output, e.g. "PyTorch DCP"."""
    file_noun: str
    """What the summary counts, e.g. ".distcp file"."""
    derive: Callable[[dict, int], ArrayExport]


@dataclass
class ArrayTaskResult:
    source: str
    destination: str
    tag: str
    task: int
    tasks: int
    files: list
    """The files this task wrote in this run (those an earlier run finished are not written again)."""
    rounds: int = 0
    bytes_read: int = 0
    seconds: float = 0.0
    notes: list = field(default_factory=list)
    format_name: str = ""
    file_noun: str = "file"

    def summary(self) -> str:
        return (f"export task {self.task} of {self.tasks}: {self.source} (tag {self.tag}) -> {self.destination} "
                f"({self.format_name})\n  {counted(len(self.files), self.file_noun)} written, "
                f"{counted(self.rounds, 'round')}, {self.bytes_read} source bytes read, {self.seconds:.1f} s"
                + "".join(f"\n  note: {note}" for note in self.notes))


def restricted_to_files(plan: ReshardPlan, files) -> ReshardPlan:
    """`plan` keeping only the segments that write into output files `files` (the plan's target ranks)."""
    wanted = np.asarray(sorted(files), dtype=np.int64)
    return ReshardPlan(plan.ownership, tuple(space.restricted(np.isin(space.table.dst_rank, wanted))
                                             for space in plan.spaces), plan.budget_bytes)


def owners_of(export: ArrayExport) -> dict[str, int]:
    """Every path of the output -> the task writing it."""
    return {path: export.ownership.writer(f) for f, paths in export.files.items() for path in paths}


def run_array_task(fmt: ArrayFormat, options: dict, *, task: int, tasks: int, overwrite: bool = False,
                   quiet: bool = False) -> ArrayTaskResult:
    """Task `task` of `tasks`: its files of the export `options` describe (with "destination"), then the set
    published if it is complete."""
    if tasks < 1 or not 0 <= task < tasks:
        raise OptionError(f"--array-task must be in [0, --array-tasks), got {task} of {tasks}")
    started = time.perf_counter()
    options = {**options, "source": os.path.abspath(options["source"])}
    destination, budget, trust_pickle = str(options.pop("destination")), options["memory_budget"], \
        options["trust_pickle"]
    export = fmt.derive({**options, "destination": destination}, tasks)
    checkpoint = export.source
    options["tag"] = checkpoint.tag
    mine = [f for f in export.files if export.ownership.writer(f) == task]
    array_dir = array_set_dir(destination, checkpoint.tag)
    record = {"kind": fmt.kind, "fingerprint": export.fingerprint, "tasks": tasks, "tag": checkpoint.tag,
              "owners": owners_of(export), "export": options}
    resume = ResumeByFile(
        {path: size for f in mine for path, size in export.files[f].items()}, functools.partial(is_done, array_dir),
        (array_dir, os.path.join(array_dir, DONE_DIR)),
        lambda staging: write_record_once(os.path.join(array_dir, RECORD_NAME), record),
        os.path.join(array_dir, f"task-{task}"),
        f"The files this task finished stay marked done in {array_dir}; fix the cause and re-run export task "
        f"{task} to write the rest")
    result = ArrayTaskResult(checkpoint.save_dir, destination, checkpoint.tag, task, tasks, [],
                             format_name=fmt.name, file_noun=fmt.file_noun)
    life = Lifecycle(destination, checkpoint.tag, leader=True, overwrite=overwrite, words=EXPORT, resume=resume)
    start = life.begin(LocalTransport(), lambda: JobOutput(export.fingerprint, set(RESHARD_NAMES)))
    result.notes += start.notes
    # a file of the plan is rewritten whole unless every one of its paths is done
    todo = [f for f in mine if any(path in start.remaining for path in export.files[f])]

    def work() -> None:
        if not todo:
            return
        staged = life.staging.tag_dir
        # rounds of the one-worker plan take an equal window of every file; scaled so that, restricted to
        # this task's files, a round holds about the budget
        share = restricted_to_files(export.one_worker_plan(int(budget * len(export.files) / len(todo))), todo)
        ranks = sorted({int(r) for space in share.spaces for r in np.unique(space.table.src_rank)})
        result.rounds = sum(int(np.count_nonzero(space.windows.round_elements(space.table))) for space in share.spaces)
        result.bytes_read = execute(
            share, LocalTransport(),
            open_source=lambda: SourceReader.open(checkpoint, ranks, target=None, trust_pickle=trust_pickle),
            open_sink=lambda: export.open_writer(todo, staged), opening="opening source files and creating output files",
            finish=lambda reader, sink: sink.finish(),  # the format's own copies, fsync, close
            after=lambda reader, sink, finished: reader.bytes_read,
            progress=Progress(f"export task {task}", progress_enabled(quiet, first_worker=True)))
        for f in todo:
            for path in export.files[f]:
                mark_done(array_dir, path, os.path.join(staged, path))
                result.files.append(path)

    life.run(work)
    result.notes += publish_ready(destination, placers=placers_of([fmt]))
    result.seconds = time.perf_counter() - started
    return result


def place_set(fmt: ArrayFormat, destination: str, record: dict, array_dir: str) -> None:
    """Every file of the set done: check the source and the record, then complete the staging as a collective
    export's worker 0 does and place it (`publish_ready` calls this under OUT's lock)."""
    export = fmt.derive({**record["export"], "destination": destination}, record["tasks"])
    if export.fingerprint != record["fingerprint"]:
        raise ReshardError(f"{export.source.tag_dir}: changed since the array tasks exported it (its files' sizes or "
                           f"times differ); remove {array_dir} and {staging_of(array_dir)} and run every task again")
    owners = owners_of(export)
    if owners != record["owners"]:  # a record edited by hand: publishing it would describe other files
        raise ReshardError(f"{os.path.join(array_dir, RECORD_NAME)}: its files and their tasks are not those a "
                           f"{record['tasks']}-task export of this source writes; remove {array_dir} and "
                           f"{staging_of(array_dir)} and run every task again")
    expected = {path: size for paths in export.files.values() for path, size in paths.items()}
    staging = Staging(destination, record["tag"])
    for path, owner in owners.items():
        staged = os.path.join(staging.tag_dir, path)
        size = expected[path] if export.exact_sizes else _marked_bytes(array_dir, path)
        if not os.path.isfile(staged) or os.path.getsize(staged) != size:
            problem = "missing" if not os.path.isfile(staged) else f"not the {size} bytes it must hold"
            raise ReshardError(f"{staged}: marked done but {problem}; remove {done_path(array_dir, path)} and "
                               f"re-run export task {owner}")
    export.complete(staging)


def placers_of(formats) -> dict:
    """Record kind -> how `reshard publish` (reshard.jobs.array_job.publish_ready) places such a set."""
    return {fmt.kind: functools.partial(place_set, fmt) for fmt in formats}


def _marked_bytes(array_dir: str, path: str) -> int | None:
    with open(done_path(array_dir, path)) as fd:
        return json.load(fd).get("bytes")


def staging_of(array_dir: str) -> str:
    """OUT/.reshard-staging/TAG of the set whose bookkeeping is OUT/.reshard-staging/TAG.array."""
    return array_dir[:-len(ARRAY_SUFFIX)]
