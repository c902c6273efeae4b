"""Export a DeepSpeed universal checkpoint (what `ds_to_universal.py` writes), with W workers.

    python -m reshard export /ckpt/run1 /ckpt/run1-universal --format universal
    torchrun --standalone --nproc_per_node=4 -m reshard export /ckpt/run1 /ckpt/run1-universal --format universal
    # then, at any world size, with "checkpoint": {"load_universal": true} in the DeepSpeed config:
    engine.load_checkpoint("/ckpt/run1-universal")

Output (DeepSpeed 0.19.8 checkpoint/ds_to_universal.py `main`, read back by
checkpoint/universal_checkpoint.py `load_hp_checkpoint_state` (ZeRO-1/2, BF16_Optimizer) and
runtime/zero/stage3.py `load_hp_checkpoint_state_from_checkpoint_dir_stage3`):

    OUT/latest_universal                        the tag
    OUT/TAG/<model-states files>                copied unchanged (ZeRO-3: every rank's)
    OUT/TAG/zero/optimizer_state.pt             rank 0's optimizer state without its partitions,
                                                plus `param_groups`
    OUT/TAG/zero/<param>/<state>.pt             fp32 and every optimizer state (exp_avg,
                                                exp_avg_sq, momentum_buffer...), whole:
                                                ZeRO-1/2 {"cat_dim": 0, "param": tensor of the
                                                param's shape}; ZeRO-3 a flat tensor
    OUT/TAG/zero/<param>/step.pt                ZeRO-1/2: the param group's step
    OUT/TAG/zero/<name>/fp32.pt                 ZeRO-1/2: {"param": value.float()} for every other
                                                module entry (frozen, buffers, tied alias)

Unlike ds_to_universal, no temporary fragment files: the parameters are cut into bundles,
each bundle a target "rank" of the plan written by one worker, and each per-parameter file is
reserved as a torch archive (`skip_data`) and filled at offsets as slices arrive. ZeRO-3's
optimizer_state.pt leaves out rank 0's flat partitions (fp32_flat_groups and partitioned
state), which DeepSpeed's loader never reads.
"""
from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from reshard.files.byte_io import pread_exact, pwrite_exact
from reshard.transport.collective import on_rank0
from reshard.jobs.destination import Staging, check_paths
from reshard.errors import UnsupportedCheckpoint
from reshard.export.hf_layout import ExportFile, ExportLayout, ExportTensor, pack_in_order
from reshard.export.runner import ExportOutput, run_export
from reshard.export.pipeline_layout import PipelineExport, inspect_pipeline_export
from reshard.export.universal_names import LATEST_UNIVERSAL, check_directory_name, universal_entry
from reshard.formats.deepspeed_files import deepspeed_classes as classes
from reshard.formats.deepspeed_files import deepspeed_schema as schema
from reshard.formats.deepspeed_files.deepspeed_inspect import inspect_checkpoint, pipeline_tag_of
from reshard.formats.deepspeed_files.deepspeed_spec import SourceCheckpoint, refuse_experts, refuse_tensor_parallel
from reshard.formats.torch_bytes.torch_archive import NewTensor, dtype_of, is_ref, load_checked, locate_storages, materialize, write_skeleton
from reshard.formats.torch_bytes.torch_zip import seal_crcs
from reshard.jobs.lifecycle import publish_tag_dir
from reshard.jobs.manifest import export_fingerprint
from reshard.jobs.results import ExportResult
from reshard.files.paths import confined
from reshard.planning.checkpoint_plan import source_rank_count, trainable_pieces
from reshard.planning.plan import Ownership, ReshardPlan, plan_space
from reshard.transport import Transport, transport_from_environment

# Bundles per worker: enough that the writers' shares even out, few enough that rounds stay large.
BUNDLES_PER_WORKER = 4
# Per-parameter files kept open at once by a writer.
_OPEN_FILES = 256


def check_universal_names(source: SourceCheckpoint) -> None:
    """Refuse, before anything is written, every name that cannot become a path of the output: the
    directories of trainable parameters and (ZeRO-1/2) of the other module entries, and the
    `<state>.pt` files in them, which must not be `step.pt` or `fp32.pt` written beside them."""
    for p in source.spec.params:
        check_directory_name(p.name, source)
    for stream in source.spec.streams:
        check_directory_name(stream.name, source)
        if stream.name == "step":
            raise UnsupportedCheckpoint(source.model_path(0), "optimizer state 'step' is partitioned here, but "
                                                              "step.pt holds the param group's step counter")
    if source.spec.stage != 3:
        module = (source.model_template or {}).get("module") or {}
        trainable = {p.name for p in source.spec.params}
        for name, value in module.items():
            if name not in trainable and is_ref(value):
                check_directory_name(name, source)


def check_pipeline_universal_names(found: PipelineExport) -> None:
    """check_universal_names for a PipelineModule save: every tensor of its module (trainable ones and
    the layer files' frozen parameters and buffers) and every optimizer state."""
    for tensor in found.tensors:
        check_directory_name(tensor.name, found.source)
    for stream in found.source.spec.streams:
        check_directory_name(stream.name, found.source)


def universal_bundles(source: SourceCheckpoint, workers: int, params: tuple = ()) -> ExportLayout:
    """Trainable parameters in order (`params` when not the spec's: a pipeline save's, each once), cut
    into about `BUNDLES_PER_WORKER * workers` bundles of equal bytes."""
    spec = source.spec
    space = params or spec.params
    for p in space:
        check_directory_name(p.name, source)
    tensors = [ExportTensor(p.name, p.shape, "float32", "optim", i) for i, p in enumerate(space)]
    target = max(1, sum(t.nbytes for t in tensors) // (BUNDLES_PER_WORKER * workers))
    bundles = pack_in_order(tensors, target)
    files = tuple(ExportFile(f"bundle-{k}", tuple(b)) for k, b in enumerate(bundles))
    return ExportLayout(files, {}, sum(p.numel for p in space), 0, tuple(params))


def plan_universal(source: SourceCheckpoint, bundles: ExportLayout, workers: int, budget_bytes: int, rules=None
                   ) -> ReshardPlan:
    """Every stream (fp32 and optimizer states) of every parameter to the writer of its bundle (pure); of a
    pipeline save, each trainable parameter once, joined over its model axis by `rules` (`trainable_pieces`)."""
    spec = source.spec
    refuse_experts(source, "exporting")
    ownership = Ownership(source_rank_count(spec), len(bundles.files), workers)
    params, pieces = trainable_pieces(spec, bundles.params or None, None if rules is None else rules.rule)
    space = plan_space("optim", pieces, bundles.pieces("optim", [p.numel for p in params]), spec.streams,
                       bundles.buffer_numels(), ownership, budget_bytes)
    return ReshardPlan(ownership, (space,), budget_bytes)


@dataclass
class UniversalWriter:
    """Per-parameter state files of the bundles one worker owns, reserved then filled at offsets."""

    locations: dict = field(default_factory=dict)
    """(bundle, index in bundle, stream) -> (path, byte offset of element 0)"""
    fds: dict = field(default_factory=dict)
    bytes_written: int = 0

    @classmethod
    def create(cls, source: SourceCheckpoint, bundles: ExportLayout, zero_dir: str, owned,
               reuse_existing: bool = False, rules=None, grad_streams=()) -> "UniversalWriter":
        """`reuse_existing`: resuming, the files exist already: locate their storages, write nothing.
        `rules`: a pipeline save's model-axis rules (reshard.layouts.model_axis), which set the keys of
        each parameter's files (universal_entry); None: {"cat_dim": 0, "param"}. `grad_streams`: the
        streams written with requires_grad (a pipeline save's masters, PipelineExport.masters_require_grad)."""
        writer = cls()
        spec = source.spec
        for b in owned:
            for k, tensor in enumerate(bundles.files[b].tensors):
                os.makedirs(confined(zero_dir, os.path.join(zero_dir, tensor.name)), exist_ok=True)
                for stream in spec.streams:
                    check_directory_name(stream.name, source)
                    path = confined(zero_dir, os.path.join(zero_dir, tensor.name, f"{stream.name}.pt"))
                    if os.path.islink(path) and not reuse_existing:
                        os.unlink(path)
                    slot = (b, k, stream.name)
                    flat = NewTensor(slot, tensor.numel, stream.dtype)
                    tree = flat if spec.stage == 3 else universal_entry(
                        None if rules is None else rules.rule(tensor.name), flat)
                    obj, roles = materialize(tree)
                    if spec.stage != 3:
                        obj["param"] = obj["param"].view(tensor.shape)  # same storage, so the same role
                        obj["param"].requires_grad_(stream.name in grad_streams)
                    offsets = (locate_storages(path, obj, roles) if reuse_existing
                               else write_skeleton(path, obj, roles))
                    if slot in offsets:
                        writer.locations[slot] = (path, offsets[slot])
        return writer

    def _fd(self, path: str) -> int:
        fd = self.fds.get(path)
        if fd is None:
            if len(self.fds) >= _OPEN_FILES:
                self._close_all(sync=True)
            fd = self.fds[path] = os.open(path, os.O_RDWR)
        return fd

    def write(self, rank: int, slot: tuple, element: int, itemsize: int, data: memoryview) -> None:
        _space, k, stream = slot
        path, base = self.locations[(rank, k, stream)]
        pwrite_exact(self._fd(path), data, base + element * itemsize)
        self.bytes_written += len(data)

    def _close_all(self, sync: bool) -> None:
        for fd in self.fds.values():
            if sync:
                os.fsync(fd)
            os.close(fd)
        self.fds.clear()

    def sync(self) -> None:
        for fd in self.fds.values():
            os.fsync(fd)

    def finish(self) -> None:
        """Every file's real CRC-32s (its skeleton recorded 0; torch_zip.seal_crcs), then fsync and close."""
        for path in dict.fromkeys(path for path, _ in self.locations.values()):
            seal_crcs(path, self._fd(path))
        self._close_all(sync=True)

    def close(self) -> None:
        self._close_all(sync=False)


def _load_small(path: str, trust_pickle: bool):
    """A DeepSpeed file mapped, not read: only the values touched (counters, hyperparameters) are paged in."""
    return load_checked(path, schema.safe_globals(), trust_pickle)  # the process's allowlist stays as it was


def write_universal_metadata(source: SourceCheckpoint, tag_dir: str, trust_pickle: bool = False) -> None:
    """Everything but the per-parameter state: optimizer_state.pt, step.pt, the ZeRO-1/2 extra
    fp32.pt of non-trainable entries, and the model-states files (worker 0, after the rounds)."""
    spec = source.spec
    zero_dir = os.path.join(tag_dir, "zero")
    osd = _load_small(source.optim_path(0), trust_pickle)[schema.OPTIM]
    partitioned = {s.name for s in spec.streams}
    if spec.stage == 3:
        inner = osd[schema.OPTIM]
        lean_inner = {**inner, "state": {sg: {k: v for k, v in state.items() if k not in partitioned}
                                         for sg, state in inner["state"].items()}}
        out = {k: v for k, v in osd.items() if k != "fp32_flat_groups"}
        out[schema.OPTIM] = lean_inner
        out["param_groups"] = inner["param_groups"]
    else:
        base = osd["base_optimizer_state"]
        out = {k: v for k, v in osd.items()
               if k not in ("base_optimizer_state", "param_slice_mappings", "single_partition_of_fp32_groups")}
        out["param_groups"] = base["param_groups"]
        for g, ids in enumerate(spec.groups):
            step = base["state"].get(g, {}).get("step")
            if step is None:
                continue
            for p in ids:
                torch.save(step, os.path.join(zero_dir, spec.params[p].name, "step.pt"))
        trainable = {p.name for p in spec.params}
        module = _load_small(source.model_path(0), trust_pickle).get("module") or {}
        for name, value in module.items():
            if name in trainable or not torch.is_tensor(value):
                continue
            check_directory_name(name, source)
            os.makedirs(os.path.join(zero_dir, name), exist_ok=True)
            torch.save({"param": value.float()}, os.path.join(zero_dir, name, "fp32.pt"))
    # out holds the loss scaler etc. as reshard's stand-ins: pickle them under DeepSpeed's names
    torch.save(out, os.path.join(zero_dir, "optimizer_state.pt"), pickle_module=classes)
    ranks = range(spec.dp_world_size) if spec.stage == 3 else [0]
    for rank in ranks:
        shutil.copyfile(source.model_path(rank), os.path.join(tag_dir, source.model_name(rank)))


def _joined_value(tensor: ExportTensor) -> torch.Tensor:
    """A layer tensor joined over the model axis from its runs (a frozen parameter or buffer: whole, as
    write_universal_metadata holds a module entry)."""
    itemsize = tensor.ref.itemsize
    buffer = np.empty(tensor.numel * itemsize, dtype=np.uint8)
    for path, at, element, count in tensor.whole_runs(""):
        fd = os.open(path, os.O_RDONLY)
        try:
            pread_exact(fd, memoryview(buffer)[element * itemsize:(element + count) * itemsize], at, path)
        finally:
            os.close(fd)
    return torch.frombuffer(buffer, dtype=dtype_of(tensor.ref.dtype)).reshape(tensor.shape)


def write_pipeline_universal_metadata(found: PipelineExport, tag_dir: str, trust_pickle: bool = False) -> None:
    """A PipelineModule save's rest, as ds_to_universal writes it (worker 0, after the rounds):
    optimizer_state.pt of stage 0's dp rank 0 (`_save_optimizer_state`), each parameter's step.pt from
    the first stage holding it (its group's step there), and, beyond ds_to_universal (which finds no
    `module` in a stage file and writes nothing for them), zero/<name>/fp32.pt {"param": value.float()}
    of every frozen parameter and buffer of the layer files, as it writes for every non-trainable module
    entry of a save without a pipeline; then every stage's model-states file, copied."""
    source, spec = found.source, found.source.spec
    zero_dir = os.path.join(tag_dir, "zero")
    osd = _load_small(source.optim_path(0), trust_pickle)[schema.OPTIM]
    out = {k: v for k, v in osd.items()
           if k not in ("base_optimizer_state", "param_slice_mappings", "single_partition_of_fp32_groups")}
    out["param_groups"] = osd["base_optimizer_state"]["param_groups"]
    torch.save(out, os.path.join(zero_dir, "optimizer_state.pt"), pickle_module=classes)
    first_stage = {t.name: t.stage for t in found.model.tensors}
    for column, (params, groups) in enumerate(spec.columns):
        stage = column // spec.topology.tp
        rank = spec.topology.rank_of(0, 0, stage)
        base = _load_small(source.optim_path(rank), trust_pickle)[schema.OPTIM]["base_optimizer_state"]
        for g, ids in enumerate(groups):
            step = base["state"].get(g, {}).get("step")
            for p in ids:
                if step is not None and first_stage[params[p].name] == stage:
                    torch.save(step, os.path.join(zero_dir, check_directory_name(params[p].name, source), "step.pt"))
    layer_files, keys = {}, {t.name: t.key for t in found.model.tensors}
    for tensor in found.tensors:
        if tensor.source != "whole":
            continue
        directory = os.path.join(zero_dir, check_directory_name(tensor.name, source))
        os.makedirs(directory, exist_ok=True)
        if tensor.runs:  # joined over the model axis (pipeline_layout.export_tensors)
            value = _joined_value(tensor)
        else:
            if tensor.path not in layer_files:
                layer_files[tensor.path] = _load_small(tensor.path, trust_pickle)
            value = layer_files[tensor.path][keys[tensor.name]]
        torch.save({"param": value.float()}, os.path.join(directory, "fp32.pt"))
    for rank in range(spec.topology.world_size):
        at = spec.topology.coordinates(rank)
        if at.dp == 0:  # ds_to_universal copies every (stage, model rank)'s file
            shutil.copyfile(source.model_path(rank), os.path.join(tag_dir, source.model_name(rank)))


@dataclass(kw_only=True)
class UniversalResult(ExportResult):
    """What a universal export wrote, besides what every export reports (reshard.jobs.results.ExportResult)."""

    params: int
    """Parameters written, each a directory under OUT/TAG/zero."""

    format_name = " (DeepSpeed universal)"

    def written(self) -> str:
        return f"{self.params} parameters"

    def how_to_load(self) -> list[str]:
        return ['load with "checkpoint": {"load_universal": true}']


def export_universal(source: str, destination: str, *, tag: str | None = None, memory_budget: int = 1 << 30,
                     trust_pickle: bool = False, overwrite: bool = False, transport: Transport | None = None,
                     backend: str = "auto", timeout: float = 600.0, durable_every: int = 1 << 30) -> UniversalResult:
    own_transport = transport is None
    transport = transport or transport_from_environment(backend, timeout)
    try:
        # absolute once, here: the layers below compare OUT with paths built from it
        return _run(os.path.abspath(source), os.path.abspath(destination), tag, memory_budget, trust_pickle, overwrite, durable_every,
                    transport)
    finally:
        if own_transport:
            transport.close()


@dataclass(frozen=True)
class UniversalExport:
    """What every worker of a collective export, and every SLURM array task (reshard.export.array_export),
    derives the same from the one inspection (`inspect_universal`): the bundles for `workers` workers, the
    plan (whose ownership names each bundle's writer) and the output's fingerprint."""

    source: SourceCheckpoint
    found: PipelineExport | None
    bundles: ExportLayout
    plan: ReshardPlan
    fingerprint: str

    def bundle_files(self, b: int) -> dict[str, int]:
        """Bundle `b`'s files, relative to the tag directory -> about their bytes (the values; the archive's
        own records besides)."""
        return {os.path.join("zero", tensor.name, f"{stream.name}.pt"): tensor.numel * dtype_of(stream.dtype).itemsize
                for tensor in self.bundles.files[b].tensors for stream in self.source.spec.streams}


def inspect_universal(source_dir: str, destination: str, tag: str | None, trust_pickle: bool) -> tuple:
    """Worker 0: (source, PipelineExport or None) of any save reshard exports as a universal checkpoint, or a
    refusal by name."""
    pipeline_tag = pipeline_tag_of(source_dir, tag)
    check_paths(source_dir, destination)  # OUT's contents: the lifecycle checks them (reshard.export.runner)
    if pipeline_tag is not None:  # a PipelineModule save: the module's own names, each parameter once
        found = inspect_pipeline_export(source_dir, pipeline_tag, "float32", trust_pickle)
        check_pipeline_universal_names(found)
        return found.source, found
    source = inspect_checkpoint(source_dir, tag, trust_pickle=trust_pickle, carry_model_bytes=False)
    refuse_tensor_parallel(source, "the universal export")
    check_universal_names(source)
    return source, None


def derive_export(inspected: tuple, workers: int, budget: int) -> UniversalExport:
    """`inspected` (`inspect_universal`'s result) cut into bundles for `workers` workers and planned (pure)."""
    source, found = inspected
    bundles = universal_bundles(source, workers, found.params if found else ())
    plan = plan_universal(source, bundles, workers, budget, found.model.rules if found else None)
    fingerprint = export_fingerprint(source, {"format": "universal", **(found.identity() if found else {})})
    return UniversalExport(source, found, bundles, plan, fingerprint)


def open_universal_writer(export: UniversalExport, owned, staged: str, reuse_existing: bool) -> UniversalWriter:
    """The writer of bundles `owned`: their per-parameter files reserved under `staged`/zero."""
    zero_dir = os.path.join(staged, "zero")
    os.makedirs(zero_dir, exist_ok=True)
    found = export.found
    return UniversalWriter.create(export.source, export.bundles, zero_dir, owned, reuse_existing,
                                  found.model.rules if found else None,
                                  ("fp32",) if found and found.masters_require_grad else ())


def complete_staging(export: UniversalExport, staging: Staging, trust_pickle: bool) -> None:
    """Once every bundle's files are in staging/zero: the rest written there (worker 0's part), then the
    lifecycle's publish: the tag directory into place by one rename, then latest_universal (replaced
    atomically) names it."""
    if export.found is None:
        write_universal_metadata(export.source, staging.tag_dir, trust_pickle)
    else:
        write_pipeline_universal_metadata(export.found, staging.tag_dir, trust_pickle)
    publish_tag_dir(staging, None, export.source.tag, scripts_from=None, latest_name=LATEST_UNIVERSAL)


def _run(source_dir, destination, tag, budget, trust_pickle, overwrite, durable_every, transport) -> UniversalResult:
    started = time.perf_counter()
    export = derive_export(on_rank0(transport, lambda: inspect_universal(source_dir, destination, tag, trust_pickle)),
                           transport.size, budget)
    output = ExportOutput(destination, export.source.tag, export.fingerprint, overwrite, durable_every)
    done = run_export(transport, export.source, export.plan, output,
                      lambda owned, staged, reuse: open_universal_writer(export, owned, staged, reuse),
                      lambda staging: complete_staging(export, staging, trust_pickle), trust_pickle=trust_pickle,
                      started=started)
    return UniversalResult.of(done, params=len(export.bundles.params or export.source.spec.params))
