"""The safetensors and universal exports as SLURM array jobs (formats of reshard.export.array_export), and
every export's placer for `reshard publish`.

    python -m reshard export SRC OUT --format safetensors --array-task 1 --array-tasks 4   # task 1 of 4
    python -m reshard export SRC OUT --format universal --array-task 1 --array-tasks 4
    python -m reshard publish OUT                                                          # once every task is done

Task I writes what worker I of a `--workers K` export writes, derived the same (`safetensors_job.derive_export`:
the shards dealt to K workers; `universal.derive_export`: the parameters cut into bundles for K workers, each
bundle's per-parameter files); publishing completes the staging as that export's worker 0 does
(`safetensors_job.complete_staging`: the model's files and the index, moved into OUT with the index last;
`universal.complete_staging`: optimizer_state.pt, step.pt, the model-states files, then the tag directory by
one rename and `latest_universal` last). So each output is byte for byte the collective export's with K workers.
"""
from __future__ import annotations

from reshard.errors import OptionError
from reshard.export import dcp_array
from reshard.export.array_export import ArrayExport, ArrayFormat, ArrayTaskResult, placers_of, run_array_task
from reshard.export.model_files import model_files_in
from reshard.export.safetensors_job import (
    DTYPES,
    complete_staging as complete_safetensors,
    derive_export as derive_safetensors,
    inspect_safetensors,
    open_safetensors_writer,
    parse_shard_size,
    plan_export,
)
from reshard.export.hf_layout import safetensors_header
from reshard.export.universal import (
    complete_staging as complete_universal,
    derive_export as derive_universal,
    inspect_universal,
    open_universal_writer,
    plan_universal,
)


def safetensors_array(options: dict, tasks: int) -> ArrayExport:
    """The safetensors export `options` describe (the record's "export"), as `tasks` tasks."""
    dtype, shard, budget = DTYPES[options["dtype"]], options["max_shard_bytes"], options["memory_budget"]
    export = derive_safetensors(inspect_safetensors(options["source"], options["destination"], options["tag"], dtype,
                                                    shard, options["trust_pickle"]), tasks, dtype, shard, budget)
    layout = export.layout
    return ArrayExport(
        export.source, export.fingerprint, export.plan.ownership,
        {f: {file.name: len(safetensors_header(file)) + file.data_bytes} for f, file in enumerate(layout.files)},
        one_worker_plan=lambda share_budget: plan_export(export.source, layout, 1, share_budget, export.rules),
        open_writer=lambda files, staged: open_safetensors_writer(export, files, staged, budget, False),
        complete=lambda staging: complete_safetensors(export, staging, model_files_in(export.source.save_dir)))


def universal_array(options: dict, tasks: int) -> ArrayExport:
    """The universal export `options` describe (the record's "export"), as `tasks` tasks."""
    trust_pickle = options["trust_pickle"]
    export = derive_universal(inspect_universal(options["source"], options["destination"], options["tag"],
                                                trust_pickle), tasks, options["memory_budget"])
    rules = export.found.model.rules if export.found else None
    return ArrayExport(
        export.source, export.fingerprint, export.plan.ownership,
        {b: export.bundle_files(b) for b in range(len(export.bundles.files))},
        one_worker_plan=lambda share_budget: plan_universal(export.source, export.bundles, 1, share_budget, rules),
        open_writer=lambda files, staged: open_universal_writer(export, files, staged, False),
        complete=lambda staging: complete_universal(export, staging, trust_pickle),
        exact_sizes=False)  # a per-parameter archive's size is known once written: the done markers hold it


SAFETENSORS = ArrayFormat("safetensors-export", "safetensors", "safetensors file", safetensors_array)
UNIVERSAL = ArrayFormat("universal-export", "DeepSpeed universal", "per-parameter file", universal_array)


def _check_task(task: int, tasks: int) -> None:
    if tasks < 1 or not 0 <= task < tasks:
        raise OptionError(f"--array-task must be in [0, --array-tasks), got {task} of {tasks}")


def export_safetensors_array_task(source: str, destination: str, *, task: int, tasks: int, dtype: str = "fp32",
                                  max_shard_size: str | int = "5GB", tag: str | None = None,
                                  memory_budget: int = 1 << 30, trust_pickle: bool = False, overwrite: bool = False,
                                  quiet: bool = False) -> ArrayTaskResult:
    """Task `task` of `tasks`: its shards of the safetensors export, then the set published if it is complete."""
    _check_task(task, tasks)
    if dtype not in DTYPES:
        raise OptionError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    max_shard_bytes = parse_shard_size(max_shard_size)
    if max_shard_bytes < 1:
        raise OptionError("--max-shard-size must be positive")
    return run_array_task(SAFETENSORS, {"source": str(source), "destination": str(destination), "tag": tag,
                                        "dtype": dtype, "max_shard_bytes": max_shard_bytes,
                                        "memory_budget": memory_budget, "trust_pickle": trust_pickle},
                          task=task, tasks=tasks, overwrite=overwrite, quiet=quiet)


def export_universal_array_task(source: str, destination: str, *, task: int, tasks: int, tag: str | None = None,
                                memory_budget: int = 1 << 30, trust_pickle: bool = False, overwrite: bool = False,
                                quiet: bool = False) -> ArrayTaskResult:
    """Task `task` of `tasks`: its bundles' files of the universal export, then the set published if complete."""
    _check_task(task, tasks)
    return run_array_task(UNIVERSAL, {"source": str(source), "destination": str(destination), "tag": tag,
                                      "memory_budget": memory_budget, "trust_pickle": trust_pickle},
                          task=task, tasks=tasks, overwrite=overwrite, quiet=quiet)


PLACERS = {**dcp_array.PLACERS, **placers_of([SAFETENSORS, UNIVERSAL])}
"""Every export kind `reshard publish` (reshard.jobs.array_job.publish_ready) places."""
