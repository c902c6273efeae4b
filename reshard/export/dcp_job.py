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
   served yet (pipeline saves, tensor and expert parallelism), and works out the param groups and
   steps; every worker receives them;
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

from reshard.errors import OptionError
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
from reshard.export.dcp_optimizer import RUN_STATE_NAME, adamw_groups, check_adam_states, pipeline_adamw_groups, run_state
from reshard.export.pipeline_layout import PipelineExport, inspect_pipeline_export
from reshard.export.hf_layout import hf_layout

from reshard.export.runner import ExportOutput, run_export
from reshard.export.safetensors_job import DTYPES
from reshard.files.byte_io import pread_exact, pwrite_exact
from reshard.files.paths import confined, open_new_file
from reshard.formats import deepspeed_classes as classes
from reshard.formats import deepspeed_schema as schema
from reshard.formats.deepspeed_inspect import inspect_checkpoint, pipeline_tag_of
from reshard.formats.deepspeed_spec import SourceCheckpoint, refuse_experts, refuse_tensor_parallel
from reshard.formats.torch_archive import dtype_of, load_checked
from reshard.jobs.destination import Staging, check_paths
from reshard.jobs.lifecycle import publish_files
from reshard.jobs.manifest import export_fingerprint
from reshard.jobs.results import counted
from reshard.planning.checkpoint_plan import source_rank_count, trainable_pieces
from reshard.planning.plan import Ownership, ReshardPlan, plan_space
from reshard.transport import Transport, transport_from_environment
from reshard.transport.collective import on_rank0

MODEL_STREAMS = ("fp32", "frozen")
"""Streams that are the model's own values (`model.<fqn>`); the others are optimizer state."""


def blob_key(name: str, stream: str) -> tuple[str, tuple]:
    """The flat DCP key of a stream of tensor `name`, and its path in the nested state dict."""
    if stream in MODEL_STREAMS:
        return f"model.{name}", ("model", name)
    return f"optim.state.{name}.{stream}", ("optim", "state", name, stream)


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


def file_blobs(layout: DcpLayout, streams: dict, f: int) -> tuple[list[PlacedBlob], list[tuple[int, str]], int]:
    """The blobs of output file `f`, chunk by chunk, each chunk's streams in the source's order; for each
    blob its (chunk index in the file, stream name); the file's size."""
    entries, owners = [], []
    for k, chunk in enumerate(layout.files[f]):
        tensor = layout.tensors[chunk.tensor]
        for stream in streams[tensor.source]:
            key, _ = blob_key(tensor.name, stream.name)
            dtype = tensor.dtype if stream.name in MODEL_STREAMS else stream.dtype
            entries.append((key, k, chunk.offsets(tensor.shape), chunk.sizes(tensor.shape), dtype))
            owners.append((k, stream.name))
    placed, size = place_blobs(entries)
    return placed, owners, size


def plan_dcp(source: SourceCheckpoint, layout: DcpLayout, workers: int, budget_bytes: int,
             pipeline: PipelineExport | None = None) -> ReshardPlan:
    """Move every stream of every parameter (and ZeRO-3 frozen fragments) to the writer of its chunk (pure);
    of a pipeline save, each parameter once and whole (`trainable_pieces`, joined over a model axis)."""
    spec = source.spec
    ownership = Ownership(source_rank_count(spec), len(layout.files), workers)
    numels = layout.buffer_numels()
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
    """file -> its PlacedBlobs"""
    located: dict = field(default_factory=dict)
    """(file, chunk index, stream) -> PlacedBlob"""
    stream_dtypes: dict = field(default_factory=dict)
    """stream name -> dtype the exchange delivers"""
    fds: dict = field(default_factory=dict)
    bytes_written: int = 0

    @classmethod
    def create(cls, layout: DcpLayout, streams: dict, names: list[str], out_dir: str, owned,
               reuse_existing: bool = False) -> "DcpWriter":
        """`reuse_existing`: resuming, keep the values the files hold (the structure, the same bytes, is
        written again; the CRC fields are filled at the end either way)."""
        writer = cls(stream_dtypes={s.name: s.dtype for group in streams.values() for s in group})
        try:
            for f in owned:
                placed, owners, size = file_blobs(layout, streams, f)
                if not placed:
                    continue
                path = confined(out_dir, os.path.join(out_dir, names[f]))
                fd = (os.open(path, os.O_RDWR | os.O_NOFOLLOW) if reuse_existing
                      else open_new_file(out_dir, path, os.O_RDWR))
                writer.fds[f] = fd
                if not reuse_existing:
                    os.ftruncate(fd, size)  # the data regions read as zeros until written
                for blob in placed:
                    _write(fd, blob.template.head, blob.file_offset)
                    _write(fd, blob.template.tail, blob.data_at + blob.template.data_bytes)
                writer.blobs[f] = placed
                for (k, stream), blob in zip(owners, placed):
                    writer.located[(f, k, stream)] = blob
        except BaseException:
            writer.close()
            raise
        return writer

    def write(self, rank: int, slot: tuple, element: int, itemsize: int, data: memoryview) -> None:
        _space, k, stream = slot
        blob = self.located[(rank, k, stream)]
        out = _cast(data, self.stream_dtypes[stream], blob.dtype)
        pwrite_exact(self.fds[rank], out, blob.data_at + element * dtype_of(blob.dtype).itemsize)
        self.bytes_written += len(out)

    def sync(self) -> None:
        """The values written so far made durable (the journal then records their rounds)."""
        for fd in self.fds.values():
            os.fsync(fd)

    def finish(self) -> None:
        for f, placed in self.blobs.items():
            for blob in placed:
                fill_crc(self.fds[f], blob, _read, _write)
            os.fsync(self.fds[f])
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


def inspect_for_dcp(source_dir: str, destination: str, tag: str | None, trust_pickle: bool):
    """Worker 0: the source, refused unless its optimizer maps to torch AdamW, and the mapping."""
    check_paths(source_dir, destination)
    source = inspect_checkpoint(source_dir, tag, trust_pickle=trust_pickle, carry_model_bytes=False)
    refuse_tensor_parallel(source, "the DCP export")
    refuse_experts(source, "exporting to DCP")
    check_adam_states(source)
    ds_config = _load_mapped(source.model_path(0), trust_pickle).get("ds_config") or {}
    optimizer_state = _load_mapped(source.optim_path(0), trust_pickle)[schema.OPTIM]
    groups, steps = adamw_groups(source, optimizer_state, ds_config)
    return source, OptimizerMapping(groups, steps), None


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


def write_replicated(path: str, source: SourceCheckpoint, layout: DcpLayout, mapping: OptimizerMapping,
                     metadata: MetadataBuilder, budget_bytes: int) -> None:
    """Worker 0's own file: the tensors stored whole in the model-states file (buffers, ZeRO-1/2 frozen
    parameters; copied in pieces under the budget), every parameter's Adam step, the param groups."""
    relative = os.path.basename(path)
    model_path = source.model_path(0)
    fd = open_new_file(os.path.dirname(path), path, os.O_RDWR)
    at = 0
    try:
        def put(key: str, route: tuple, blob: bytes, shape=None, dtype=None) -> None:
            nonlocal at
            pwrite_exact(fd, memoryview(blob), at)
            if shape is None:
                metadata.add_bytes(key, route, relative, at, len(blob))
            else:
                metadata.add_chunk(key, route, shape, dtype, (0,) * len(shape), shape, relative, at, len(blob))
            at += len(blob)

        for tensor in layout.tensors:
            if tensor.source != "whole":
                continue
            length = _copy_whole(fd, at, tensor, model_path, budget_bytes)
            metadata.add_chunk(f"model.{tensor.name}", ("model", tensor.name), tensor.shape, tensor.dtype,
                               (0,) * len(tensor.shape), tensor.shape, relative, at, length)
            at += length
        for name, step in mapping.steps.items():
            put(f"optim.state.{name}.step", ("optim", "state", name, "step"),
                tensor_blob(torch.tensor(step, dtype=torch.float32)), (), "float32")
        for i, group in enumerate(mapping.param_groups):
            for key, value in group.items():
                put(f"optim.param_groups.{i}.{key}", ("optim", "param_groups", i, key), bytes_blob(value))
        os.fsync(fd)
    finally:
        os.close(fd)


def add_chunk_metadata(metadata: MetadataBuilder, layout: DcpLayout, streams: dict, names: list[str]) -> None:
    """Every chunk blob of every file (all workers'), and each tied alias as its owner's chunks."""
    for f in range(len(layout.files)):
        placed, owners, _ = file_blobs(layout, streams, f)
        for (k, stream), blob in zip(owners, placed):
            tensor = layout.tensors[layout.files[f][k].tensor]
            key, route = blob_key(tensor.name, stream)
            metadata.add_chunk(key, route, tensor.shape, blob.dtype, blob.offsets, blob.sizes, names[f],
                               blob.file_offset, blob.template.size)


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


@dataclass
class DcpResult:
    source: str
    destination: str
    tag: str
    files: list
    workers: int
    rounds: int
    seconds: float = 0.0
    peak_rss_bytes: list = field(default_factory=list)
    notes: list = field(default_factory=list)

    def summary(self) -> str:
        return (f"export done: {self.source} (tag {self.tag}) -> {self.destination} (PyTorch DCP)\n"
                f"  {counted(len(self.files), '.distcp file')}; {counted(self.workers, 'worker')}, "
                f"{counted(self.rounds, 'round')}, "
                f"{self.seconds:.1f} s; load with dcp.load + set_state_dict (docs/moving-to-fsdp2.md); counters, "
                f"LR scheduler and client_state in {RUN_STATE_NAME}"
                + "".join(f"\n  note: {note}" for note in self.notes))


def export_dcp(source: str, destination: str, *, dtype: str = "fp32", tag: str | None = None,
               memory_budget: int = 1 << 30, chunk_bytes: int = DEFAULT_CHUNK_BYTES, trust_pickle: bool = False,
               overwrite: bool = False, transport: Transport | None = None, backend: str = "auto",
               timeout: float = 600.0, durable_every: int = 1 << 30) -> DcpResult:
    if dtype not in DTYPES:
        raise OptionError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if chunk_bytes < 1:
        raise OptionError("--chunk-size must be positive")
    own_transport = transport is None
    transport = transport or transport_from_environment(backend, timeout)
    try:
        return _run(str(source), str(destination), DTYPES[dtype], tag, memory_budget, chunk_bytes, trust_pickle,
                    overwrite, durable_every, transport)
    finally:
        if own_transport:
            transport.close()


def _run(source_dir, destination, out_dtype, tag, budget, chunk_bytes, trust_pickle, overwrite, durable_every,
         transport) -> DcpResult:
    started = time.perf_counter()

    def inspect():
        pipeline_tag = pipeline_tag_of(source_dir, tag)
        if pipeline_tag is not None:  # a PipelineModule save: its module's names, each parameter once and whole
            return inspect_pipeline_for_dcp(source_dir, destination, pipeline_tag, out_dtype, trust_pickle)
        return inspect_for_dcp(source_dir, destination, tag, trust_pickle)

    source, mapping, pipeline = on_rank0(transport, inspect)
    if pipeline is None:
        model = hf_layout(source, out_dtype, 1 << 62)
        tensors, aliases = [t for f in model.files for t in f.tensors], model.kept_for_tied
    else:
        tensors, aliases = list(pipeline.tensors), {}
    layout = dcp_layout(tensors, aliases, transport.size, chunk_bytes)
    plan = plan_dcp(source, layout, transport.size, budget, pipeline)
    streams = streams_of(source)
    names = file_names(plan.ownership, len(layout.files))
    output = ExportOutput(destination, source.tag, export_fingerprint(
        source, {"format": "dcp", "dtype": out_dtype, "chunk_bytes": chunk_bytes,
                 **(pipeline.identity() if pipeline is not None else {})}), overwrite, durable_every)

    def open_writer(owned, staged, reuse_existing):
        return DcpWriter.create(layout, streams, names, staged, owned, reuse_existing)

    def publish(staging: Staging):
        # the chunk files are in staging; worker 0's own file, the run state and .metadata (which makes
        # the directory a checkpoint) are written there too, then every file moves into OUT, .metadata last
        metadata = MetadataBuilder.empty()
        own = sum(1 for f in range(len(layout.files)) if plan.ownership.writer(f) == 0)
        replicated = os.path.join(staging.tag_dir, f"__0_{own}{DISTCP_SUFFIX}")
        write_replicated(replicated, source, layout, mapping, metadata, budget)  # replaces a resumed run's attempt
        add_chunk_metadata(metadata, layout, streams, names)
        add_aliases(metadata, layout)
        model_states = _load_mapped(source.model_path(0), trust_pickle)  # only the values touched are read
        torch.save(run_state(model_states), os.path.join(staging.tag_dir, RUN_STATE_NAME), pickle_module=classes)
        write_metadata(os.path.join(staging.tag_dir, METADATA_NAME), metadata.build(output.fingerprint))
        publish_files(staging, last=METADATA_NAME)

    rss = run_export(transport, source, plan, output, open_writer, publish, trust_pickle=trust_pickle)
    written = [n for f, n in enumerate(names) if layout.files[f]]
    result = DcpResult(source.save_dir, destination, source.tag, written, transport.size, plan.rounds,
                       peak_rss_bytes=rss, notes=output.notes)
    result.seconds = time.perf_counter() - started
    return result
