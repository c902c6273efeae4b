"""Export a DeepSpeed ZeRO checkpoint as a PyTorch Distributed Checkpoint (DCP) that FSDP2 loads at any world size.

    python -m reshard export /ckpt/run1 /ckpt/run1-dcp --format dcp
    torchrun --standalone --nproc_per_node=4 -m reshard export /ckpt/run1 /ckpt/run1-dcp --format dcp

    from reshard.export import export_dcp
    result = export_dcp("/ckpt/run1", "/ckpt/run1-dcp")
    # then, in an FSDP2 job at any world size (docs/moving-to-fsdp2.md):
    model_sd, optim_sd = get_state_dict(model, optimizer)      # fully_shard(model), torch.optim.AdamW
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id="/ckpt/run1-dcp")
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])

Steps, and which workers run them (the skeleton of every export, `reshard.export.runner`):
1. worker 0 inspects the source, refuses what does not map to torch AdamW (`dcp_optimizer`) or is not
   served yet (folded TP+EP at ZeRO-3, ZeRO-0 MoE), and works out the param groups and steps; every
   worker receives them (a PipelineModule save and an AutoTP save export each parameter once and whole,
   joined over its model axis or TP ranks by the plan; an MoE save, as the model at ep 1:
   `hf_layout.export_names`);
2. every worker derives the same layout (`dcp_layout`: row-block chunks dealt to one file per
   worker) and plan: each file is a target "rank", each chunk in it a target buffer, so the
   exchange moves fp32 masters, exp_avg and exp_avg_sq (and ZeRO-3 frozen fragments) from the
   workers reading the source rank files to the worker writing the chunk, in rounds under
   `--memory-budget`;
3. each worker reserves its `__{worker}_{i}.distcp` file (every chunk's `torch.save` blob, its data
   still to come, `dcp_format`), writes the values into it as the rounds deliver them (cast to
   `--dtype` for the model's tensors), then fills every blob's CRC-32;
4. worker 0 writes what the exchange does not carry into `__0_{n}.distcp`: the tensors stored whole
   in the model-states file (buffers, ZeRO-1/2 frozen parameters), every parameter's Adam step and
   the param groups; the run's other state into `reshard_run_state.pt`; `.metadata` last. The files
   are written in OUT/.reshard-staging/TAG and moved into OUT with `.metadata` last
   (reshard.jobs.lifecycle.publish_files), so a directory with `.metadata` is complete.

With `layout="accelerate"` (`--layout accelerate`, reshard.export.dcp_output_layout) the same blobs go
into two checkpoints, OUT/pytorch_model_fsdp_0/ (the model's streams) and OUT/optimizer_0/ (the
optimizer's, keyed `optimizer.` as Accelerate saves them), each file `__{worker}_{i}.distcp` in both and
each directory with its own `.metadata`; worker 0 carries the save directory's other files (the HF
Trainer's) into staging, and `pytorch_model_fsdp_0/.metadata` is moved into OUT last.

Keys are those `get_state_dict` gives for an FSDP2 model with torch.optim.AdamW: `model.<fqn>`
(every tensor of the model's state_dict(), a tied alias under its own name, sharing the owner's
chunks), `optim.state.<fqn>.{step, exp_avg, exp_avg_sq}`, `optim.param_groups.<i>.<hyperparameter>`.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from reshard.errors import OptionError, UnsupportedCheckpoint
from reshard.export.dcp_format import (
    DISTCP_SUFFIX,
    METADATA_NAME,
    MetadataBuilder,
    PlacedBlob,
    blob_template,
    bytes_blob,
    fill_crc,
    place_blobs,
    tensor_blob,
    write_metadata,
)
from reshard.export.dcp_layout import DEFAULT_CHUNK_BYTES, DcpLayout, dcp_layout
from reshard.export.dcp_optimizer import (
    RUN_STATE_NAME,
    adamw_groups,
    check_adam_states,
    pipeline_adamw_groups,
    run_state,
)
from reshard.export.dcp_output_layout import OUTPUT_LAYOUTS, DcpOutputLayout, check_carried_files
from reshard.export.pipeline_layout import PipelineExport, inspect_pipeline_export
from reshard.export.hf_layout import hf_layout, refuse_unnamed_experts

from reshard.export.runner import ExportOutput, run_export
from reshard.export.safetensors_job import DTYPES
from reshard.files.byte_io import pread_exact, pwrite_exact
from reshard.files.paths import confined, open_new_file
from reshard.formats.deepspeed_files import deepspeed_classes as classes
from reshard.formats.deepspeed_files import deepspeed_schema as schema
from reshard.formats.deepspeed_files.deepspeed_inspect import inspect_checkpoint, pipeline_tag_of
from reshard.formats.deepspeed_files.deepspeed_spec import SourceCheckpoint
from reshard.formats.torch_bytes.torch_archive import dtype_of, load_checked
from reshard.jobs import save_dir_files
from reshard.jobs.destination import Staging, check_paths
from reshard.jobs.lifecycle import publish_files
from reshard.jobs.manifest import export_fingerprint
from reshard.jobs.results import ExportResult, counted
from reshard.planning.checkpoint_plan import (folded_export_pieces, source_rank_count, tensor_parallel_export_pieces,
                                              trainable_pieces)
from reshard.planning.plan import Ownership, ReshardPlan, plan_space
from reshard.transport import Transport, transport_from_environment
from reshard.transport.collective import on_rank0

MODEL_STREAMS = ("fp32", "frozen")
"""Streams that are the model's own values (`model.<fqn>`); the others are optimizer state."""


def blob_key(name: str, stream: str, out: DcpOutputLayout = OUTPUT_LAYOUTS["torch"]) -> tuple[str, tuple, str]:
    """The flat DCP key of a stream of tensor `name`, its path in the nested state dict, and the
    directory (relative to OUT) whose checkpoint holds it."""
    if stream in MODEL_STREAMS:
        return f"model.{name}", ("model", name), out.model_dir
    prefix = out.optimizer_key
    return f"{prefix}.state.{name}.{stream}", (prefix, "state", name, stream), out.optimizer_dir


def file_names(ownership: Ownership, files: int) -> list[str]:
    """`__{worker}_{i}.distcp`, i counting the files a worker writes, as FileSystemWriter names them."""
    names, count = [], {}
    for f in range(files):
        worker = ownership.writer(f)
        names.append(f"__{worker}_{count.get(worker, 0)}{DISTCP_SUFFIX}")
        count[worker] = count.get(worker, 0) + 1
    return names


def streams_of(source: SourceCheckpoint) -> dict:
    """Space -> its streams ("optim": fp32 masters and Adam's moments; "frozen": ZeRO-3 frozen values)."""
    return {"optim": source.spec.streams, "frozen": source.spec.frozen_streams}


def file_blobs(layout: DcpLayout, streams: dict, f: int, out: DcpOutputLayout = OUTPUT_LAYOUTS["torch"]
               ) -> dict[str, tuple[list[PlacedBlob], list[tuple[int, str]], int]]:
    """Output file `f` in each directory of `out` that has blobs in it: directory -> (the blobs, chunk by
    chunk, each chunk's streams in the source's order; for each blob its (chunk index in the file,
    stream name); the file's size)."""
    entries, owners = {}, {}
    for k, chunk in enumerate(layout.files[f]):
        tensor = layout.tensors[chunk.tensor]
        for stream in streams[tensor.source]:
            key, _, directory = blob_key(tensor.name, stream.name, out)
            dtype = tensor.dtype if stream.name in MODEL_STREAMS else stream.dtype
            entries.setdefault(directory, []).append((key, k, chunk.offsets(tensor.shape), chunk.sizes(tensor.shape),
                                                       dtype))
            owners.setdefault(directory, []).append((k, stream.name))
    files = {}
    for directory, placing in entries.items():
        placed, size = place_blobs(placing)
        files[directory] = (placed, owners[directory], size)
    return files


def plan_dcp(source: SourceCheckpoint, layout: DcpLayout, workers: int, budget_bytes: int,
             pipeline: PipelineExport | None = None) -> ReshardPlan:
    """Move every stream of every parameter (and ZeRO-3 frozen fragments) to the writer of its chunk (pure);
    of a pipeline save, each parameter once and whole (`trainable_pieces`, joined over a model axis); of an
    AutoTP save, likewise over its global parameters (`tensor_parallel_export_pieces`; AutoEP folded with AutoTP:
    `folded_export_pieces`, its expert slices after the joined dense parameters)."""
    spec = source.spec
    ownership = Ownership(source_rank_count(spec), len(layout.files), workers)
    numels = layout.buffer_numels()
    if spec.tensor is not None:  # AutoTP: every TP slice joined whole, a replicated parameter read once
        pieces_of = folded_export_pieces if spec.experts is not None else tensor_parallel_export_pieces
        old, new = pieces_of(spec, layout.pieces("optim", [p.numel for p in spec.params]), len(layout.files))
        spaces = [plan_space("optim", old, new, spec.streams, numels, ownership, budget_bytes)]
        if spec.frozen:  # ZeRO-3's partitioned frozen parameters
            old, new = tensor_parallel_export_pieces(spec, layout.pieces("frozen", [p.numel for p in spec.frozen]),
                                                     len(layout.files), "frozen")
            spaces.append(plan_space("frozen", old, new, spec.frozen_streams, numels, ownership, budget_bytes,
                                     round_offset=spaces[0].rounds))
        return ReshardPlan(ownership, tuple(spaces), budget_bytes)
    rules = pipeline.model.rules if pipeline is not None else None
    params, pieces = trainable_pieces(spec, pipeline.params if pipeline is not None else None,
                                      None if rules is None else rules.rule)
    spaces = [plan_space("optim", pieces, layout.pieces("optim", [p.numel for p in params]), spec.streams, numels,
                         ownership, budget_bytes)]
    if spec.frozen:
        old_frozen, _ = spec.frozen_layout(spec.dp_world_size)
        spaces.append(plan_space("frozen", old_frozen, layout.pieces("frozen", [p.numel for p in spec.frozen]),
                                 spec.frozen_streams, numels, ownership, budget_bytes, round_offset=spaces[0].rounds))
    return ReshardPlan(ownership, tuple(spaces), budget_bytes)


def _cast(data: memoryview, source_dtype: str, target_dtype: str) -> memoryview:
    if source_dtype == target_dtype or not len(data):
        return data
    values = torch.frombuffer(data, dtype=dtype_of(source_dtype))
    return memoryview(values.to(dtype_of(target_dtype)).view(torch.uint8).numpy())


def _read(fd: int, count: int, offset: int) -> bytes:
    buffer = np.empty(count, dtype=np.uint8)
    pread_exact(fd, memoryview(buffer), offset)
    return buffer.tobytes()


def _write(fd: int, data: bytes, offset: int) -> None:
    pwrite_exact(fd, memoryview(data), offset)


@dataclass
class DcpWriter:
    """The .distcp files one worker owns: every blob reserved first, values written at offsets, CRCs last."""

    blobs: dict = field(default_factory=dict)
    """(file, directory) -> its PlacedBlobs"""
    located: dict = field(default_factory=dict)
    """(file, chunk index, stream) -> (directory, PlacedBlob)"""
    stream_dtypes: dict = field(default_factory=dict)
    """stream name -> dtype the exchange delivers"""
    fds: dict = field(default_factory=dict)
    """(file, directory) -> open descriptor"""
    bytes_written: int = 0

    @classmethod
    def create(cls, layout: DcpLayout, streams: dict, names: list[str], out_dir: str, owned,
               reuse_existing: bool = False, out: DcpOutputLayout = OUTPUT_LAYOUTS["torch"]) -> "DcpWriter":
        """`reuse_existing`: resuming, keep the values the files hold (the structure, the same bytes, is
        written again; the CRC fields are filled at the end either way). File `f` of `layout` is written
        as `names[f]` in each directory of `out` that holds some of its blobs."""
        writer = cls(stream_dtypes={s.name: s.dtype for group in streams.values() for s in group})
        try:
            for f in owned:
                for directory, (placed, owners, size) in file_blobs(layout, streams, f, out).items():
                    if not placed:
                        continue
                    folder = confined(out_dir, os.path.join(out_dir, directory)) if directory else out_dir
                    os.makedirs(folder, exist_ok=True)
                    path = confined(out_dir, os.path.join(folder, names[f]))
                    fd = (os.open(path, os.O_RDWR | os.O_NOFOLLOW) if reuse_existing
                          else open_new_file(out_dir, path, os.O_RDWR))
                    writer.fds[(f, directory)] = fd
                    if not reuse_existing:
                        os.ftruncate(fd, size)  # the data regions read as zeros until written
                    for blob in placed:
                        _write(fd, blob.template.head, blob.file_offset)
                        _write(fd, blob.template.tail, blob.data_at + blob.template.data_bytes)
                    writer.blobs[(f, directory)] = placed
                    for (k, stream), blob in zip(owners, placed):
                        writer.located[(f, k, stream)] = (directory, blob)
        except BaseException:
            writer.close()
            raise
        return writer

    def write(self, rank: int, slot: tuple, element: int, itemsize: int, data: memoryview) -> None:
        _space, k, stream = slot
        directory, blob = self.located[(rank, k, stream)]
        out = _cast(data, self.stream_dtypes[stream], blob.dtype)
        pwrite_exact(self.fds[(rank, directory)], out, blob.data_at + element * dtype_of(blob.dtype).itemsize)
        self.bytes_written += len(out)

    def sync(self) -> None:
        """The values written so far made durable (the journal then records their rounds)."""
        for fd in self.fds.values():
            os.fsync(fd)

    def finish(self) -> None:
        for key, placed in self.blobs.items():
            for blob in placed:
                fill_crc(self.fds[key], blob, _read, _write)
            os.fsync(self.fds[key])
        self.close()

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()


def _load_mapped(path: str, trust_pickle: bool):
    """A DeepSpeed file mapped, not read: only the values touched (counters, groups, buffers) are paged
    in, after every check of the checked reader (torch_archive.load_checked)."""
    return load_checked(path, schema.safe_globals(), trust_pickle)


@dataclass(frozen=True)
class OptimizerMapping:
    """What worker 0 worked out from the source's optimizer, for every worker."""

    param_groups: list
    """torch AdamW param groups, `params` as FQN lists."""
    steps: dict
    """FQN -> Adam step (float)."""


def inspect_pipeline_for_dcp(source_dir: str, destination: str, tag: str, out_dtype: str, trust_pickle: bool):
    """Worker 0: a PipelineModule save (its tensors named as PipelineModule.state_dict() names them,
    reshard.export.pipeline_layout), refused unless its optimizer maps to torch AdamW, and the mapping."""
    check_paths(source_dir, destination)
    found = inspect_pipeline_export(source_dir, tag, out_dtype, trust_pickle)
    source = found.source
    check_adam_states(source)
    ds_config = _load_mapped(source.model_path(0), trust_pickle).get("ds_config") or {}
    states = [_load_mapped(source.optim_path(source.spec.topology.rank_of(0, 0, stage)), trust_pickle)[schema.OPTIM]
              for stage in range(source.spec.topology.pp)]
    groups, steps = pipeline_adamw_groups(found, states, ds_config)
    return source, OptimizerMapping(groups, steps), found


def inspect_for_dcp(source_dir: str, destination: str, tag: str | None, trust_pickle: bool,
                    out: DcpOutputLayout = OUTPUT_LAYOUTS["torch"]):
    """Worker 0: the source, refused unless its optimizer maps to torch AdamW (and, in the accelerate
    layout, unless its save directory's files can be carried), the mapping, and the files to carry."""
    check_paths(source_dir, destination)
    source = inspect_checkpoint(source_dir, tag, trust_pickle=trust_pickle, carry_model_bytes=False)
    refuse_unnamed_experts(source, "DCP")
    check_adam_states(source)
    ds_config = _load_mapped(source.model_path(0), trust_pickle).get("ds_config") or {}
    optimizer_state = _load_mapped(source.optim_path(0), trust_pickle)[schema.OPTIM]
    groups, steps = adamw_groups(source, optimizer_state, ds_config)
    carried = save_dir_files.list_save_dir_files(source.save_dir) if out.carries_save_dir else []
    if out.carries_save_dir:
        check_carried_files(source.save_dir, carried, out, out.directories + (RUN_STATE_NAME,))
    return source, OptimizerMapping(groups, steps), carried


def _copy_whole(fd: int, at: int, tensor, model_path: str, budget_bytes: int) -> int:
    """A tensor stored whole in the model-states file (or a pipeline's layer files, `ExportTensor.whole_runs`)
    as one blob at `at`: read, cast and written in pieces of at most a third of the budget (never held
    whole), then its CRC-32. Returns the blob's size."""
    template = blob_template(tuple(tensor.shape), tensor.dtype)
    pwrite_exact(fd, memoryview(template.head), at)
    pwrite_exact(fd, memoryview(template.tail), at + template.data_offset + template.data_bytes)
    ref = tensor.ref
    out_itemsize = dtype_of(tensor.dtype).itemsize
    step = max(1, (budget_bytes // 3) // max(ref.itemsize, out_itemsize))
    sources = {}
    try:
        for path, start, element, count in tensor.whole_runs(model_path):  # a pipeline's layer files: runs
            if path not in sources:
                sources[path] = os.open(path, os.O_RDONLY)
            for first in range(0, count, step):
                n = min(step, count - first)
                buffer = np.empty(n * ref.itemsize, dtype=np.uint8)
                pread_exact(sources[path], memoryview(buffer), start + first * ref.itemsize, path)
                pwrite_exact(fd, _cast(memoryview(buffer), ref.dtype, tensor.dtype),
                             at + template.data_offset + (element + first) * out_itemsize)
    finally:
        for source in sources.values():
            os.close(source)
    fill_crc(fd, PlacedBlob(f"model.{tensor.name}", 0, (0,) * len(tensor.shape), tuple(tensor.shape), tensor.dtype,
                            at, template), _read, _write)
    return template.size


class _Appender:
    """One file written front to back, created on first use (a directory with nothing to hold gets none)."""

    def __init__(self, root: str, path: str):
        self.root, self.path, self.fd, self.at = root, path, None, 0

    def claim(self) -> int:
        """Open the file if not yet; returns where the next blob starts."""
        if self.fd is None:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            self.fd = open_new_file(self.root, self.path, os.O_RDWR)
        return self.at

    def close(self) -> None:
        if self.fd is not None:
            os.fsync(self.fd)
            os.close(self.fd)
            self.fd = None


def write_replicated(out_dir: str, file_name: str, source: SourceCheckpoint, layout: DcpLayout,
                     mapping: OptimizerMapping, metadata: dict, budget_bytes: int,
                     out: DcpOutputLayout = OUTPUT_LAYOUTS["torch"]) -> None:
    """Worker 0's own file `file_name` in the model's and the optimizer's directory (one file where they are
    the same): the tensors stored whole in the model-states file (buffers, ZeRO-1/2 frozen parameters;
    copied in pieces under the budget), every parameter's Adam step, the param groups. `metadata`:
    directory -> its MetadataBuilder."""
    model_path = source.model_path(0)
    files = {d: _Appender(out_dir, confined(out_dir, os.path.join(out_dir, d, file_name))) for d in out.directories}
    try:
        def put(key: str, route: tuple, directory: str, blob: bytes, shape=None, dtype=None) -> None:
            file = files[directory]
            at = file.claim()
            pwrite_exact(file.fd, memoryview(blob), at)
            if shape is None:
                metadata[directory].add_bytes(key, route, file_name, at, len(blob))
            else:
                metadata[directory].add_chunk(key, route, shape, dtype, (0,) * len(shape), shape, file_name, at,
                                              len(blob))
            file.at += len(blob)

        for tensor in layout.tensors:
            if tensor.source != "whole":
                continue
            file = files[out.model_dir]
            at = file.claim()
            length = _copy_whole(file.fd, at, tensor, model_path, budget_bytes)
            metadata[out.model_dir].add_chunk(f"model.{tensor.name}", ("model", tensor.name), tensor.shape,
                                              tensor.dtype, (0,) * len(tensor.shape), tensor.shape, file_name, at,
                                              length)
            file.at += length
        prefix = out.optimizer_key
        for name, step in mapping.steps.items():
            put(f"{prefix}.state.{name}.step", (prefix, "state", name, "step"), out.optimizer_dir,
                tensor_blob(torch.tensor(step, dtype=torch.float32)), (), "float32")
        for i, group in enumerate(mapping.param_groups):
            for key, value in group.items():
                put(f"{prefix}.param_groups.{i}.{key}", (prefix, "param_groups", i, key), out.optimizer_dir,
                    bytes_blob(value))
    finally:
        for file in files.values():
            file.close()


def add_chunk_metadata(metadata: dict, layout: DcpLayout, streams: dict, names: list[str],
                       out: DcpOutputLayout = OUTPUT_LAYOUTS["torch"]) -> None:
    """Every chunk blob of every file (all workers'), into the MetadataBuilder of its directory."""
    for f in range(len(layout.files)):
        for directory, (placed, owners, _) in file_blobs(layout, streams, f, out).items():
            for (k, stream), blob in zip(owners, placed):
                tensor = layout.tensors[layout.files[f][k].tensor]
                key, route, _ = blob_key(tensor.name, stream, out)
                metadata[directory].add_chunk(key, route, tensor.shape, blob.dtype, blob.offsets, blob.sizes,
                                              names[f], blob.file_offset, blob.template.size)


def add_aliases(metadata: MetadataBuilder, layout: DcpLayout) -> None:
    """A tied alias (head.weight -> embed.weight) is in FSDP2's state dict under its own name: the
    same chunks as its owner, read from the owner's blobs."""
    for alias, owner in layout.aliases.items():
        entry = metadata.tensors.get(f"model.{owner}")
        if entry is None:
            continue
        shape, dtype, chunks = entry
        for offsets, sizes, relative, offset, length in list(chunks):
            metadata.add_chunk(f"model.{alias}", ("model", alias), shape, dtype, offsets, sizes, relative, offset,
                               length)


@dataclass(kw_only=True)
class DcpResult(ExportResult):
    """What a DCP export wrote, besides what every export reports (reshard.jobs.results.ExportResult)."""

    files: list
    """The .distcp files the workers wrote (worker 0's own file of whole tensors besides)."""
    layout: str = "torch"
    carried: list = field(default_factory=list)
    """Files of the save directory carried into OUT (the accelerate layout)."""

    format_name = " (PyTorch DCP)"

    def written(self) -> str:
        return counted(len(self.files), ".distcp file")

    def how_to_load(self) -> list[str]:
        if self.layout == "accelerate":
            load = (f"pytorch_model_fsdp_0/ and optimizer_0/ as Accelerate's FSDP2 SHARDED_STATE_DICT; "
                    f"{counted(len(self.carried), 'file')} of the save directory carried (trainer_state.json, "
                    "scheduler.pt...): resume with trainer.train(resume_from_checkpoint=OUT) under FSDP2 "
                    "(docs/moving-to-fsdp2.md)")
        else:
            load = "load with dcp.load + set_state_dict (docs/moving-to-fsdp2.md)"
        return [load, f"counters, LR scheduler and client_state (and an fp16 run's loss scaler) in {RUN_STATE_NAME}"]


def check_dcp_options(dtype: str, layout: str, chunk_bytes: int) -> None:
    """The DCP export's own options, refused by name before anything is read (the collective export's and an
    array task's alike: reshard.export.dcp_array)."""
    if dtype not in DTYPES:
        raise OptionError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if layout not in OUTPUT_LAYOUTS:
        raise OptionError(f"--layout must be one of {', '.join(OUTPUT_LAYOUTS)}, got {layout!r}")
    if chunk_bytes < 1:
        raise OptionError("--chunk-size must be positive")


def export_dcp(source: str, destination: str, *, dtype: str = "fp32", tag: str | None = None,
               memory_budget: int = 1 << 30, chunk_bytes: int = DEFAULT_CHUNK_BYTES, trust_pickle: bool = False,
               overwrite: bool = False, transport: Transport | None = None, backend: str = "auto",
               timeout: float = 600.0, durable_every: int = 1 << 30, layout: str = "torch") -> DcpResult:
    """`layout`: "torch" (one DCP directory, get_state_dict's keys) or "accelerate" (a checkpoint directory
    as Accelerate's FSDP2 resume and the HF Trainer read it: reshard.export.dcp_output_layout)."""
    check_dcp_options(dtype, layout, chunk_bytes)
    own_transport = transport is None
    transport = transport or transport_from_environment(backend, timeout)
    try:
        return _run(str(source), str(destination), DTYPES[dtype], tag, memory_budget, chunk_bytes, trust_pickle,
                    overwrite, durable_every, transport, OUTPUT_LAYOUTS[layout])
    finally:
        if own_transport:
            transport.close()


@dataclass(frozen=True)
class DcpExport:
    """What every worker of a collective export, and every SLURM array task, derives the same from the one
    inspection (`inspect_dcp`): the chunk layout over `files` files, the plan for that many workers (whose
    ownership names the files), the file names and the output's fingerprint."""

    source: SourceCheckpoint
    mapping: OptimizerMapping
    pipeline: PipelineExport | None
    carried: list
    layout: DcpLayout
    plan: ReshardPlan
    streams: dict
    names: list
    fingerprint: str
    out: DcpOutputLayout


def inspect_dcp(source_dir: str, destination: str, tag: str | None, out_dtype: str, trust_pickle: bool,
                out: DcpOutputLayout) -> tuple:
    """Worker 0: (source, OptimizerMapping, PipelineExport or None, files to carry) of any save reshard
    exports to DCP, or a refusal by name."""
    pipeline_tag = pipeline_tag_of(source_dir, tag)
    if pipeline_tag is not None:  # a PipelineModule save: its module's names, each parameter once and whole
        if out.carries_save_dir:
            raise UnsupportedCheckpoint(os.path.join(source_dir, pipeline_tag),
                                        f"is a PipelineModule save: the {out.name} layout is for Hugging Face "
                                        "Trainer saves; export it with the torch layout (the default)")
        return (*inspect_pipeline_for_dcp(source_dir, destination, pipeline_tag, out_dtype, trust_pickle), [])
    source, mapping, carried = inspect_for_dcp(source_dir, destination, tag, trust_pickle, out)
    return source, mapping, None, carried


def derive_export(inspected: tuple, files: int, out_dtype: str, chunk_bytes: int, budget: int,
                  out: DcpOutputLayout) -> DcpExport:
    """`inspected` (`inspect_dcp`'s result) laid out in chunks dealt to `files` files, one per worker (pure)."""
    source, mapping, pipeline, carried = inspected
    if pipeline is None:
        model = hf_layout(source, out_dtype, 1 << 62)
        tensors, aliases = [t for f in model.files for t in f.tensors], model.kept_for_tied
    else:
        tensors, aliases = list(pipeline.tensors), {}
    layout = dcp_layout(tensors, aliases, files, chunk_bytes)
    plan = plan_dcp(source, layout, files, budget, pipeline)
    fingerprint = export_fingerprint(source, {
        "format": "dcp", "dtype": out_dtype, "chunk_bytes": chunk_bytes, "layout": out.name, "carried": carried,
        **(pipeline.identity() if pipeline is not None else {})})
    return DcpExport(source, mapping, pipeline, list(carried), layout, plan, streams_of(source),
                     file_names(plan.ownership, len(layout.files)), fingerprint, out)


def complete_staging(export: DcpExport, tag_dir: str, budget: int, trust_pickle: bool) -> None:
    """Once every chunk file is in `tag_dir`: worker 0's own file, the run state, the carried files and
    `.metadata` (which makes the directory a checkpoint) written there too; publishing moves them."""
    out, layout, source = export.out, export.layout, export.source
    metadata = {directory: MetadataBuilder.empty() for directory in out.directories}
    own = sum(1 for f in range(len(layout.files)) if export.plan.ownership.writer(f) == 0)
    write_replicated(tag_dir, f"__0_{own}{DISTCP_SUFFIX}", source, layout, export.mapping, metadata, budget,
                     out)  # replaces a resumed run's attempt
    add_chunk_metadata(metadata, layout, export.streams, export.names, out)
    add_aliases(metadata[out.model_dir], layout)
    model_states = _load_mapped(source.model_path(0), trust_pickle)  # only the values touched are read
    optimizer_state = _load_mapped(source.optim_path(0), trust_pickle)[schema.OPTIM]
    torch.save(run_state(model_states, optimizer_state), os.path.join(tag_dir, RUN_STATE_NAME),
               pickle_module=classes)
    if export.carried:
        staged = save_dir_files.staging_dir(tag_dir)
        save_dir_files.stage(source.save_dir, export.carried, staged, tag_dir)
        save_dir_files.publish(staged, export.carried, tag_dir)
    for directory, builder in metadata.items():
        write_metadata(os.path.join(tag_dir, directory, METADATA_NAME),
                       builder.build(export.fingerprint + directory))


def _run(source_dir, destination, out_dtype, tag, budget, chunk_bytes, trust_pickle, overwrite, durable_every,
         transport, out: DcpOutputLayout) -> DcpResult:
    started = time.perf_counter()
    inspected = on_rank0(transport, lambda: inspect_dcp(source_dir, destination, tag, out_dtype, trust_pickle, out))
    export = derive_export(inspected, transport.size, out_dtype, chunk_bytes, budget, out)
    source, layout, plan, names = export.source, export.layout, export.plan, export.names
    output = ExportOutput(destination, source.tag, export.fingerprint, overwrite, durable_every)

    def open_writer(owned, staged, reuse_existing):
        return DcpWriter.create(layout, export.streams, names, staged, owned, reuse_existing, out)

    def publish(staging: Staging):
        # the chunk files are in staging; the rest is written there too, then every file moves into OUT,
        # .metadata last (the accelerate layout: one checkpoint per directory, the model's .metadata last)
        complete_staging(export, staging.tag_dir, budget, trust_pickle)
        publish_files(staging, last=out.complete_marker)

    done = run_export(transport, source, plan, output, open_writer, publish, trust_pickle=trust_pickle,
                      started=started)
    return DcpResult.of(done, files=[n for f, n in enumerate(names) if layout.files[f]], layout=out.name,
                        carried=list(export.carried))
