"""Export a DeepSpeed ZeRO checkpoint as Hugging Face safetensors shards, with W workers.

    python -m reshard export /ckpt/run1 /models/run1-hf --format safetensors --dtype bf16 --max-shard-size 5GB
    torchrun --standalone --nproc_per_node=4 -m reshard export /ckpt/run1 /models/run1-hf --format safetensors

    from reshard.export import export_safetensors
    result = export_safetensors("/ckpt/run1", "/models/run1-hf", dtype="bf16")

Steps, and which workers run them (the same skeleton as a reshard job, `reshard.jobs.collective_job`):
1. worker 0 inspects the source (pickles only) and checks OUT; every worker receives it;
2. every worker derives the same layout (`hf_layout`) and plan: the output files are the
   target "ranks", each tensor of a file a target buffer, so `plan_space` and `run_rounds`
   move fp32 master slices (and ZeRO-3 frozen fragments) from the workers that read the
   source rank files to the worker that writes the output file, in rounds under the budget;
3. each worker writes the headers of its files, runs the rounds, then copies the tensors
   stored whole in the model-states file (buffers, ZeRO-1/2 frozen parameters) in chunks;
4. worker 0 writes `model.safetensors.index.json` and publishes: the files are written in
   OUT/.reshard-staging/TAG (the lifecycle through `reshard.export.runner`: OUT checked, lock,
   journal, resume) and moved into OUT with the index last (reshard.jobs.lifecycle.publish_files),
   so a directory with the index is complete.

Output is byte-identical whatever the number of workers and the budget.
"""
from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass, field

from reshard.transport.collective import on_rank0
from reshard.jobs.destination import Staging, check_paths
from reshard.errors import OptionError, UnsupportedCheckpoint
from reshard.export.hf_layout import (INDEX_NAME, SAFETENSORS_DTYPES, ExportLayout, hf_layout, refuse_unnamed_experts,
                                       shard_files, write_index)
from reshard.export.model_files import copy_model_files, missing_notes, model_files_in
from reshard.export.pipeline_layout import inspect_pipeline_export
from reshard.export.runner import ExportOutput, run_export
from reshard.export.safetensors_writer import SafetensorsWriter
from reshard.formats.deepspeed_files.deepspeed_inspect import inspect_checkpoint, pipeline_tag_of
from reshard.formats.deepspeed_files.deepspeed_spec import SourceCheckpoint, refuse_tensor_parallel
from reshard.jobs.lifecycle import publish_files
from reshard.jobs.manifest import export_fingerprint
from reshard.jobs.results import ExportResult, counted
from reshard.planning.checkpoint_plan import source_rank_count, trainable_pieces
from reshard.planning.plan import Ownership, ReshardPlan, plan_space
from reshard.transport import Transport, transport_from_environment

DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
_DECIMAL = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
            "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40}


def parse_shard_size(text: str | int) -> int:
    """'5GB' -> 5 * 10**9, as huggingface_hub reads max_shard_size; '4GiB' -> 4 * 2**30."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*", str(text), re.IGNORECASE)
    unit = match[2].upper() if match else None
    if unit is not None and unit and not unit.endswith("B"):
        unit += "B"
    if not match or unit not in _DECIMAL:
        raise OptionError(f"cannot read shard size {text!r}: use e.g. 5GB, 500MB or 2GiB")
    return int(float(match[1]) * _DECIMAL[unit])


@dataclass(kw_only=True)
class SafetensorsResult(ExportResult):
    """What a safetensors export wrote, besides what every export reports (reshard.jobs.results.ExportResult)."""

    files: list
    total_size: int
    kept_for_tied: dict = field(default_factory=dict)
    tied_files: dict = field(default_factory=dict)
    """A pipeline save: layer file -> the tied module's key it was named by (reshard.export.pipeline_layout)."""
    model_files: list = field(default_factory=list)
    """config, generation config and tokenizer files copied from the save directory (export.model_files)."""

    def written(self) -> str:
        return f"{counted(len(self.files), 'safetensors file')}, {self.total_size:,} bytes of tensors"

    def details(self) -> list[str]:
        tied = ", ".join([*(f"{alias} stored as {owner}" for alias, owner in self.kept_for_tied.items()),
                          *(f"{file} as tied_modules.{key}" for file, key in self.tied_files.items())])
        return ([f"tied: {tied}"] if tied else []) + \
            ([f"copied from the save directory: {', '.join(self.model_files)}"] if self.model_files else [])

    def all_notes(self) -> list[str]:
        return [*self.notes, *missing_notes(self.model_files)]


def plan_export(source: SourceCheckpoint, layout: ExportLayout, workers: int, budget_bytes: int, rules=None
                ) -> ReshardPlan:
    """Move the fp32 masters (and ZeRO-3 frozen fragments) to the writers of the output files (pure); of a
    pipeline save, each trainable parameter once, joined over its model axis by `rules` (`trainable_pieces`)."""
    spec = source.spec
    ownership = Ownership(source_rank_count(spec), len(layout.files), workers)
    numels = layout.buffer_numels()
    fp32 = tuple(s for s in spec.streams if s.name == "fp32")
    params, pieces = trainable_pieces(spec, layout.params or None, None if rules is None else rules.rule)
    spaces = [plan_space("optim", pieces, layout.pieces("optim", [p.numel for p in params]), fp32, numels, ownership,
                         budget_bytes)]
    if spec.frozen:
        old_frozen, _ = spec.frozen_layout(spec.dp_world_size)
        spaces.append(plan_space("frozen", old_frozen, layout.pieces("frozen", [p.numel for p in spec.frozen]),
                                 spec.frozen_streams, numels, ownership, budget_bytes, round_offset=spaces[0].rounds))
    return ReshardPlan(ownership, tuple(spaces), budget_bytes)


def export_safetensors(source: str, destination: str, *, dtype: str = "fp32", max_shard_size: str | int = "5GB",
                       tag: str | None = None, memory_budget: int = 1 << 30, trust_pickle: bool = False,
                       overwrite: bool = False, transport: Transport | None = None, backend: str = "auto",
                       timeout: float = 600.0, durable_every: int = 1 << 30) -> SafetensorsResult:
    if dtype not in DTYPES:
        raise OptionError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    max_shard_bytes = parse_shard_size(max_shard_size)
    if max_shard_bytes < 1:
        raise OptionError("--max-shard-size must be positive")
    own_transport = transport is None
    transport = transport or transport_from_environment(backend, timeout)
    try:
        # absolute once, here: the layers below compare OUT with paths built from it
        return _run(os.path.abspath(source), os.path.abspath(destination), DTYPES[dtype], max_shard_bytes, tag, memory_budget, trust_pickle,
                    overwrite, durable_every, transport)
    finally:
        if own_transport:
            transport.close()


@dataclass(frozen=True)
class SafetensorsExport:
    """What every worker of a collective export, and every SLURM array task (reshard.export.array_export),
    derives the same from the one inspection (`inspect_safetensors`): the shards, the plan for `workers`
    workers (whose ownership names each shard's writer) and the output's fingerprint."""

    source: SourceCheckpoint
    layout: ExportLayout
    tied_files: dict
    rules: object
    plan: ReshardPlan
    stream_dtypes: dict
    fingerprint: str


def inspect_safetensors(source_dir: str, destination: str, tag: str | None, out_dtype: str, max_shard_bytes: int,
                        trust_pickle: bool) -> tuple:
    """Worker 0: (source, layout, tied layer files, model-axis rules, identity) of any save reshard exports to
    safetensors, or a refusal by name."""
    pipeline_tag = pipeline_tag_of(source_dir, tag)
    check_paths(source_dir, destination)  # OUT's contents: the lifecycle checks them (reshard.export.runner)
    if pipeline_tag is not None:  # a PipelineModule save: the module's own names, each parameter once
        found = inspect_pipeline_export(source_dir, pipeline_tag, out_dtype, trust_pickle)
        for tensor in found.tensors:
            if tensor.dtype not in SAFETENSORS_DTYPES:
                raise UnsupportedCheckpoint(tensor.path, f"{tensor.name} is {tensor.dtype}, which safetensors "
                                                         "cannot store")
        layout = ExportLayout(shard_files(list(found.tensors), max_shard_bytes), {},
                              sum(p.numel for p in found.params), 0, found.params)
        return found.source, layout, found.tied_files, found.model.rules, found.identity()
    source = inspect_checkpoint(source_dir, tag, trust_pickle=trust_pickle, carry_model_bytes=False)
    refuse_tensor_parallel(source, "the safetensors export")
    refuse_unnamed_experts(source, "safetensors")
    return source, hf_layout(source, out_dtype, max_shard_bytes), {}, None, {}


def derive_export(inspected: tuple, workers: int, out_dtype: str, max_shard_bytes: int, budget: int
                  ) -> SafetensorsExport:
    """`inspected` (`inspect_safetensors`'s result) planned for `workers` workers (pure)."""
    source, layout, tied_files, rules, identity = inspected
    stream_dtypes = {"optim": next(s.dtype for s in source.spec.streams if s.name == "fp32"),
                     "frozen": source.spec.frozen_dtype}
    fingerprint = export_fingerprint(source, {"format": "safetensors", "dtype": out_dtype,
                                              "max_shard_bytes": max_shard_bytes, **identity})
    return SafetensorsExport(source, layout, tied_files, rules, plan_export(source, layout, workers, budget, rules),
                             stream_dtypes, fingerprint)


def open_safetensors_writer(export: SafetensorsExport, files, staged: str, budget: int, reuse_existing: bool
                            ) -> SafetensorsWriter:
    """The writer of shards `files` in `staged` (the whole tensors of the model-states file copied at its finish)."""
    return SafetensorsWriter.create(export.layout, staged, files, export.stream_dtypes, export.source.model_path(0),
                                    budget, reuse_existing)


def complete_staging(export: SafetensorsExport, staging: Staging, model_files: list) -> None:
    """Once every shard is in staging: the model's other files (config, tokenizer) and the index (which makes
    the directory a model) written there too, then every file moved into OUT, the index last (an earlier
    export's model files and index in OUT removed first)."""
    source = export.source
    copy_model_files(source.save_dir, staging.tag_dir, model_files)
    copy_model_files(source.save_dir, staging.destination, ())  # removes an earlier export's model files from OUT
    write_index(staging.tag_dir, export.layout.total_size, export.layout.weight_map())
    publish_files(staging, last=INDEX_NAME)


def _run(source_dir, destination, out_dtype, max_shard_bytes, tag, budget, trust_pickle, overwrite, durable_every,
         transport):
    started = time.perf_counter()
    inspected = on_rank0(transport, lambda: inspect_safetensors(source_dir, destination, tag, out_dtype,
                                                                max_shard_bytes, trust_pickle))
    export = derive_export(inspected, transport.size, out_dtype, max_shard_bytes, budget)
    source, layout = export.source, export.layout
    output = ExportOutput(destination, source.tag, export.fingerprint, overwrite, durable_every)

    def open_writer(files, staged, reuse_existing):
        return open_safetensors_writer(export, files, staged, budget, reuse_existing)

    model_files = model_files_in(source.save_dir)
    done = run_export(transport, source, export.plan, output, open_writer,
                      lambda staging: complete_staging(export, staging, model_files), trust_pickle=trust_pickle,
                      started=started)
    return SafetensorsResult.of(done, files=[f.name for f in layout.files], total_size=layout.total_size,
                                kept_for_tied=layout.kept_for_tied, tied_files=export.tied_files,
                                model_files=model_files)
