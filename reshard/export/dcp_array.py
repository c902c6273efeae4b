"""The DCP export as a SLURM array job (one format of reshard.export.array_export): K independent tasks,
no collectives, then `reshard publish OUT`.

    python -m reshard export SRC OUT --format dcp --array-task 3 --array-tasks 8   # task 3 of 8
    sbatch --array=0-7 launch/slurm-array.sbatch export SRC OUT --format dcp        # (the same, per task)
    python -m reshard publish OUT                                                   # once every task is done

Every task inspects the source and derives the same export as a collective export of K workers
(`dcp_job.derive_export`: the same row-block chunks dealt to K files, the same names
`__{task}_0.distcp`, the same fingerprint). Task I writes the files worker I would write: the
one-worker plan restricted to those files (`array_export.restricted_to_files`), over a LocalTransport, so it preads
only the source bytes its chunks hold (the chunks are dealt in parameter order, so the tasks' reads
are disjoint) and writes them in place in OUT/.reshard-staging/TAG, under `--memory-budget`.

The bookkeeping is the array reshard's (reshard.jobs.array_job, beside the staging in
OUT/.reshard-staging/TAG.array/): `record.json` (kind "dcp-export", the output's fingerprint, K, every
file and its task, the export's options; written by the first task, compared by every later one, so a
task started with another K or other options is refused by name), `done/NAME.json` per finished file
(size and BLAKE3, written after its fsync: a killed task, run again, rewrites only the files not marked
done, `lifecycle.ResumeByFile`) and the task's lock.

Publishing (`array_export.place_set`: by the task that finishes the set, or `reshard publish OUT`, under OUT's
lock, `lifecycle.publish_sets`) inspects the source again, checks it is the one the tasks exported,
and completes the staging as a collective export's worker 0 does (`dcp_job.complete_staging`: worker
0's file of whole tensors, steps and param groups, the run state, `.metadata` made with
torch.distributed.checkpoint's classes), then moves every file into OUT with `.metadata` last
(`lifecycle.publish_files`). So the output is byte for byte the collective export's with K workers.
While a task's files are not all done, publishing names the tasks still to run and places nothing.
"""
from __future__ import annotations

import os

from reshard.errors import OptionError
from reshard.export.array_export import ArrayExport, ArrayFormat, ArrayTaskResult, placers_of, run_array_task
from reshard.export.dcp_job import (
    DcpExport,
    DcpWriter,
    check_dcp_options,
    complete_staging,
    derive_export,
    file_blobs,
    inspect_dcp,
    plan_dcp,
)
from reshard.export.dcp_layout import DEFAULT_CHUNK_BYTES
from reshard.export.dcp_output_layout import OUTPUT_LAYOUTS
from reshard.export.safetensors_job import DTYPES
from reshard.jobs.lifecycle import publish_files

KIND = "dcp-export"
"""The record's kind: `reshard publish` hands such a set to `place_set` with `DCP` (cli passes `PLACERS`)."""

DcpArrayTaskResult = ArrayTaskResult


def file_paths(export: DcpExport, f: int) -> dict[str, int]:
    """Output file `f` as it lies in OUT: its path in each directory holding some of its blobs -> its size."""
    return {os.path.join(directory, export.names[f]) if directory else export.names[f]: size
            for directory, (placed, _, size) in file_blobs(export.layout, export.streams, f, export.out).items()
            if placed}


def chunk_files(export: DcpExport) -> dict[int, dict[str, int]]:
    """Every output file holding chunks: its index -> `file_paths` (its task is `export.plan.ownership.writer`)."""
    return {f: file_paths(export, f) for f in range(len(export.layout.files)) if export.layout.files[f]}


def derive_array(options: dict, tasks: int) -> ArrayExport:
    """The DCP export `options` describe (the record's "export"), as `tasks` tasks."""
    out = OUTPUT_LAYOUTS[options["layout"]]
    dtype, budget, trust_pickle = DTYPES[options["dtype"]], options["memory_budget"], options["trust_pickle"]
    export = derive_export(inspect_dcp(options["source"], options["destination"], options["tag"], dtype, trust_pickle,
                                       out), tasks, dtype, options["chunk_bytes"], budget, out)

    def complete(staging) -> None:
        complete_staging(export, staging.tag_dir, budget, trust_pickle)
        publish_files(staging, last=out.complete_marker)

    return ArrayExport(
        export.source, export.fingerprint, export.plan.ownership, chunk_files(export),
        one_worker_plan=lambda share_budget: plan_dcp(export.source, export.layout, 1, share_budget, export.pipeline),
        open_writer=lambda files, staged: DcpWriter.create(export.layout, export.streams, export.names, staged, files,
                                                           False, out),
        complete=complete)


DCP = ArrayFormat(KIND, "PyTorch DCP", ".distcp file", derive_array)


def export_dcp_array_task(source: str, destination: str, *, task: int, tasks: int, dtype: str = "fp32",
                          tag: str | None = None, memory_budget: int = 1 << 30,
                          chunk_bytes: int = DEFAULT_CHUNK_BYTES, trust_pickle: bool = False, overwrite: bool = False,
                          layout: str = "torch", quiet: bool = False) -> ArrayTaskResult:
    """Task `task` of `tasks`: its files of the DCP export, then the set published if it is complete."""
    if tasks < 1 or not 0 <= task < tasks:
        raise OptionError(f"--array-task must be in [0, --array-tasks), got {task} of {tasks}")
    check_dcp_options(dtype, layout, chunk_bytes)
    return run_array_task(DCP, {"source": str(source), "destination": str(destination), "tag": tag, "dtype": dtype,
                                "chunk_bytes": chunk_bytes, "layout": layout, "memory_budget": memory_budget,
                                "trust_pickle": trust_pickle}, task=task, tasks=tasks, overwrite=overwrite,
                          quiet=quiet)


PLACERS = placers_of([DCP])
"""What `reshard publish` (reshard.jobs.array_job.publish_ready) is given to place the DCP export's array sets."""
