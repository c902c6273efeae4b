"""Exports of a DeepSpeed PipelineModule save (ZeRO-1): safetensors under the module's own names, or universal.

    python -m reshard export /ckpt/pipe /models/pipe-hf --format safetensors [--dtype bf16] [--max-shard-size 5GB]
    python -m reshard export /ckpt/pipe /ckpt/pipe-universal --format universal
    torchrun --standalone --nproc_per_node=2 -m reshard export /ckpt/pipe /models/pipe-hf --format safetensors

`export_safetensors` and `export_universal` (reshard.export) hand a pipeline save here.

Names. A PipelineModule registers each layer built from a LayerSpec (or given as an nn.Module) as
the child `str(global index)` and each TiedLayerSpec module once, as `tied_modules.<key>`
(DeepSpeed 0.19.8 runtime/pipe/module.py `_build`), so `PipelineModule.state_dict()` names a tensor
`<index>.<name>` or `tied_modules.<key>.<name>`: the names every stage's `param_shapes` and
optimizer use, and the names a PipelineModule built with the same layers at any number of stages
(pp=1 included) loads with `load_state_dict(strict=True)`. Both exports use them.

Where each tensor comes from:
    trainable parameters   the fp32 masters of the first stage whose optimizer holds them (a tied
                           module's parameters sit in every stage holding it, equal);
    frozen parameters,     the layer file `layer_XX-model_states.pt` that holds them (runtime/pipe/
    persistent buffers     module.py `save_state_dict`: the layer's own state_dict, its keys without
                           the prefix). ZeRO-1 records frozen parameters nowhere else.
A layer file is named by its index when some stage lists a parameter or buffer `<index>.<key>` for
one of its keys (a tied module is never registered under an index); otherwise by the tied module
whose trainable parameters it holds, all of them, with their shapes; otherwise by its index. A
tied module none of whose parameters is trainable therefore cannot be told from a frozen layer
and is named by its index (documented in docs/supported.md).

safetensors: the tensors of the non-pipeline export (reshard.export.hf_layout: trainable from the
masters cast to --dtype, frozen parameters and buffers with floating ones cast, shards by
--max-shard-size, `model.safetensors.index.json` last, the model's config/tokenizer files carried).
Output file f is written whole by worker f % W: for each stage holding one of its tensors, that
stage's optimizer files are joined (whole tensors, one stage at a time, as reshard.jobs.pipeline_job),
then the layer files' tensors are copied. Byte-identical for any W.

universal: what DeepSpeed's checkpoint/ds_to_universal.py `main` writes for a pipeline save, read
back by `load_universal` into a PipelineModule engine at any (pp, dp):

    OUT/latest_universal                    the tag
    OUT/TAG/mp_rank_XX_model_states.pt      every stage's, copied unchanged (the engine reads
                                            counters, scheduler and client state from them)
    OUT/TAG/zero/optimizer_state.pt         stage 0 dp rank 0's optimizer state without its
                                            partitions, plus `param_groups` (`_save_optimizer_state`)
    OUT/TAG/zero/<name>/fp32.pt, <state>.pt {"cat_dim": 0, "param": tensor of the parameter's shape},
                                            every trainable parameter, once (a tied one from its
                                            first stage; `extract_zero_shards`, `merge_tp_slices`)
    OUT/TAG/zero/<name>/step.pt             the parameter's group step
and, beyond ds_to_universal (which finds no `module` in a pipeline stage file and writes nothing
for them), `zero/<name>/fp32.pt` {"param": value.float()} for each frozen parameter and buffer of
the layer files, as ds_to_universal writes for every non-trainable module entry of a save without
a pipeline. DeepSpeed's `load_universal` restores trainable parameters only (engine.py
`_load_checkpoint` skips the module load), so those files are a record, not something it reads.
Stage s's parameters are written by worker s % W; worker 0 writes the rest and publishes.

With a model axis (PipeModelDataParallelTopology): both exports write each tensor whole, joined over
the model ranks by the save's universal_checkpoint_info rules (reshard.layouts.model_axis;
deepspeed_pipeline.joined_stage_states and join_model_slices, the join of the tp change), under the
same names, so a copy of the model without a model axis loads the safetensors; the universal files
carry the keys `merge_tp_slices` writes for each rule (`universal_entry`) and every (stage, model
rank)'s model-states file is copied. At tp > 1 a save without patterns is refused (`export_rules`).

Both run the one lifecycle (reshard.jobs.lifecycle: OUT checked, lock, staging, atomic publish
with `publish_files` or `publish_tag_dir`); whole files, so an interrupted export starts afresh.
Refused by name: what reshard.formats.deepspeed_pipeline.inspect_pipeline refuses (ZeRO-0,
BF16_Optimizer, parameter_alignment, round_robin_gradients), a model axis at tp > 1 without usable
universal_checkpoint_info patterns, a --memory-budget the stage
joins cannot keep, and layer files whose names are ambiguous.
"""
from __future__ import annotations

import math
import os
import shutil
import time
from dataclasses import dataclass, field

from reshard.errors import CheckpointError, UnsupportedCheckpoint
from reshard.export.hf_layout import (
    INDEX_NAME,
    SAFETENSORS_DTYPES,
    ExportFile,
    ExportTensor,
    out_dtype_for,
    pack_in_order,
    safetensors_header,
    write_index,
)
from reshard.export.pipeline_layout import LAYER, TRAINABLE, ModuleTensor, PipelineModel, export_rules, module_tensors
from reshard.export.model_files import copy_model_files, missing_notes, model_files_in
from reshard.export.universal_names import (
    LATEST_UNIVERSAL,
    OPTIMIZER_STATE,
    UNIVERSAL_PARAM,
    check_directory_name,
    universal_entry,
)
from reshard.files.byte_io import pwrite_exact
from reshard.files.paths import confined, open_new_file, write_named_file
from reshard.files.resources import peak_resident_bytes
from reshard.formats import deepspeed_classes as classes
from reshard.formats.deepspeed_pipeline import (
    BASE,
    LAYER_RE,
    OPTIM,
    PipelineSource,
    inspect_pipeline,
    join_model_slices,
    joined_stage_states,
    joined_state_bytes,
    layer_file_name,
    load_whole,
    read_stage,
    stage_model_name,
    states_by_name,
)
from reshard.jobs.destination import RESHARD_NAMES, Staging, check_paths
from reshard.jobs.lifecycle import EXPORT, JobOutput, Lifecycle, publish_files, publish_tag_dir
from reshard.jobs.manifest import export_files_fingerprint, source_identity
from reshard.jobs.pipeline_job import refuse_over_budget, stages_written_by
from reshard.jobs.progress import Progress, progress_enabled
from reshard.jobs.results import counted
from reshard.transport.collective import check_peers, on_rank0



def _layer_value(source: PipelineSource, model: PipelineModel, tensor: ModuleTensor, trust_pickle: bool):
    """A frozen parameter's or buffer's value; with a model axis joined over every model rank's
    layer file by its rule (reshard.formats.deepspeed_pipeline.join_model_slices, as the tp change)."""
    path = os.path.join(source.tag_dir, tensor.layer_file)
    if model.rules is None or source.tp == 1:
        return load_whole(path, trust_pickle)[tensor.key]
    index = int(LAYER_RE.match(tensor.layer_file)[1])
    pieces = []
    for rank in range(source.tp):
        rank_path = os.path.join(source.tag_dir, layer_file_name(index, rank))
        state = load_whole(rank_path, trust_pickle)
        if not isinstance(state, dict) or tensor.key not in state:
            raise CheckpointError(rank_path, f"does not hold {tensor.key}, which {tensor.layer_file} holds")
        pieces.append(state[tensor.key])
    return join_model_slices(model.rules.rule(tensor.name), pieces, tuple(pieces[0].shape), tensor.name, path)


def _stage_values(source: PipelineSource, model: PipelineModel, stage: int, trust_pickle: bool,
                  moments: bool) -> dict[str, dict]:
    """{name: {"fp32": tensor, <state>: tensor}} of one stage's trainable parameters (flat without a
    model axis; whole tensors joined over the model ranks with one); without `moments` fp32 only."""
    if model.rules is not None:
        return joined_stage_states(source, stage, model.rules, trust_pickle, moments)
    _, masters, flats = read_stage(source, stage, trust_pickle)
    return states_by_name(source.stages[stage], masters, flats if moments else [{} for _ in flats])


def stages_of(tensors_by_file: dict, owned) -> list[int]:
    """The stages whose optimizer files the output files `owned` need (`tensors_by_file`: file -> its ModuleTensors)."""
    return sorted({t.stage for f in owned for t in tensors_by_file[f] if t.stage >= 0})


def check_budget(source: PipelineSource, stages_by_worker: list, budget: int, what: str) -> list[int]:
    """Per worker, the most bytes it holds joining one stage (reshard.formats.deepspeed_pipeline.
    joined_state_bytes: the stage's files mapped, its flats, what torch keeps besides); a
    --memory-budget that cannot hold it is refused (no rounds to cut: whole tensors)."""
    # with a model axis every model rank's files of the stage (model=None), then each tensor whole
    needed = [max((joined_state_bytes(source, 1, kept_stage=s, model=None) for s in stages), default=0)
              for stages in stages_by_worker]
    refuse_over_budget(source, needed, budget, f"{what} of a pipeline checkpoint joins each stage's optimizer files "
                                               "whole" + (" over every model rank" if source.tp > 1 else ""))
    return needed


@dataclass
class PipelineExportResult:
    source: str
    destination: str
    tag: str
    format: str
    files: list
    total_size: int
    workers: int
    seconds: float = 0.0
    peak_rss_bytes: list = field(default_factory=list)
    tied_files: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)
    model_files: list = field(default_factory=list)

    def summary(self) -> str:
        what = (f"{counted(len(self.files), 'safetensors file')}, {self.total_size:,} bytes of tensors"
                if self.format == "safetensors" else f"{len(self.files)} parameters and buffers (DeepSpeed universal)")
        tied = ", ".join(f"{file} as tied_modules.{key}" for file, key in self.tied_files.items())
        return (f"export done: {self.source} (tag {self.tag}, pipeline) -> {self.destination}\n"
                f"  {what}; {counted(self.workers, 'worker')}, whole tensors, {self.seconds:.1f} s; names as "
                "PipelineModule.state_dict() gives them"
                + (f"\n  tied: {tied}" if tied else "")
                + (f"\n  copied from the save directory: {', '.join(self.model_files)}" if self.model_files else "")
                + ("\n  load with \"checkpoint\": {\"load_universal\": true}" if self.format == "universal" else "")
                + "".join(f"\n  note: {note}" for note in [*self.notes, *(missing_notes(self.model_files)
                                                                      if self.format == "safetensors" else [])]))


def _begin(transport, source: PipelineSource, destination: str, overwrite: bool, export: dict) -> Lifecycle:
    """The lifecycle's step 1 for a whole-file export: OUT may hold reshard's staging and lock only;
    no plan fingerprint, so an interrupted export starts afresh."""
    life = Lifecycle(destination, source.tag, leader=transport.rank == 0, overwrite=overwrite, words=EXPORT)

    def describe() -> JobOutput:
        units = [(s, m) for s in range(source.pp) for m in range(source.tp)]
        names = {*source.layer_files, *(stage_model_name(s, m, source.tp) for s, m in units),
                 *(os.path.basename(source.optim_path(s, d, m)) for s, m in units for d in range(source.dp))}
        identity = source_identity(source.tag_dir, names)
        return JobOutput(export_files_fingerprint(source.save_dir, source.tag, identity, {**export, "pipeline": True}),
                         set(RESHARD_NAMES))

    life.begin(transport, describe)
    return life


def _run_work(transport, life: Lifecycle, write, place) -> None:
    """Each worker's `write(staging)`, all agree, then worker 0's `place(staging)`; a failure
    removes the staging (the lifecycle)."""
    def work() -> None:
        failure = None  # whole files: rounds_started stays False, so a failure removes the staging
        # whole tensors, no rounds to count: the seconds worker 0 has spent writing its share
        progress = Progress("export, worker 0's files", progress_enabled(False, transport.rank == 0))
        try:
            progress.start(None)
            write(life.staging)
        except Exception as error:  # noqa: BLE001 (every worker learns it; the failing one re-raises)
            failure = error
        finally:
            progress.close()
        check_peers(transport, failure, "writing the output files")
        life.publish(transport, None, lambda _: place(life.staging))

    life.run(work)


def _inspect(source_dir: str, destination: str, tag: str, trust_pickle: bool):
    check_paths(source_dir, destination)
    source = inspect_pipeline(source_dir, tag, trust_pickle)
    return source, module_tensors(source, trust_pickle, export_rules(source, trust_pickle))


# ---- safetensors ------------------------------------------------------------------------------

def safetensors_files(model: PipelineModel, out_dtype: str, max_shard_bytes: int,
                      tag_dir: str = "") -> tuple[ExportFile, ...]:
    """The shards, as reshard.export.hf_layout lays out a save without a pipeline (`tag_dir`: where the
    layer files named in a refusal are)."""
    tensors = []
    for i, t in enumerate(model.tensors):
        dtype = out_dtype if t.stage >= 0 else out_dtype_for(t.dtype, out_dtype)
        if dtype not in SAFETENSORS_DTYPES:
            raise UnsupportedCheckpoint(os.path.join(tag_dir, t.layer_file),
                                        f"{t.name} is {dtype}, which safetensors cannot store")
        tensors.append(ExportTensor(t.name, t.shape, dtype, TRAINABLE if t.stage >= 0 else LAYER, i))
    shards = pack_in_order(tensors, max_shard_bytes)
    files = []
    for number, members in enumerate(shards, start=1):
        placed, offset = [], 0
        for tensor in members:
            placed.append(ExportTensor(**{**tensor.__dict__, "data_offset": offset}))
            offset += tensor.nbytes
        files.append(ExportFile(f"model-{number:05d}-of-{len(shards):05d}.safetensors", tuple(placed)))
    return tuple(files)


def _write_safetensors(source, model, files, owned, staged_dir, trust_pickle) -> None:
    import torch

    from reshard.formats.torch_archive import dtype_of
    fds, starts = {}, {}
    try:
        for f in owned:
            header = safetensors_header(files[f])
            fds[f] = open_new_file(staged_dir, os.path.join(staged_dir, files[f].name), os.O_RDWR)
            pwrite_exact(fds[f], memoryview(header), 0)
            os.ftruncate(fds[f], len(header) + files[f].data_bytes)
            starts[f] = len(header)

        def put(f: int, placed: ExportTensor, value) -> None:
            out = value.detach().reshape(-1).to(dtype_of(placed.dtype)).contiguous()
            if out.numel():
                pwrite_exact(fds[f], memoryview(out.view(torch.uint8).numpy()), starts[f] + placed.data_offset)

        for stage in stages_of({f: [model.tensors[t.index] for t in files[f].tensors] for f in owned}, owned):
            states = _stage_values(source, model, stage, trust_pickle, moments=False)
            for f in owned:
                for placed in files[f].tensors:
                    if model.tensors[placed.index].stage == stage:
                        put(f, placed, states[placed.name]["fp32"])
            del states
        for f in owned:
            for placed in files[f].tensors:
                tensor = model.tensors[placed.index]
                if tensor.stage < 0:
                    put(f, placed, _layer_value(source, model, tensor, trust_pickle))
        for fd in fds.values():
            os.fsync(fd)
    finally:
        for fd in fds.values():
            os.close(fd)


def export_pipeline_safetensors(source_dir: str, destination: str, tag: str, out_dtype: str, max_shard_bytes: int,
                                budget: int, trust_pickle: bool, overwrite: bool, transport) -> PipelineExportResult:
    started = time.perf_counter()

    def inspect():
        source, model = _inspect(source_dir, destination, tag, trust_pickle)
        files = safetensors_files(model, out_dtype, max_shard_bytes, source.tag_dir)
        owned = [range(w, len(files), transport.size) for w in range(transport.size)]
        tensors = {f: [model.tensors[t.index] for t in files[f].tensors] for f in range(len(files))}
        check_budget(source, [stages_of(tensors, own) for own in owned], budget, "the safetensors export")
        return source, model, files

    source, model, files = on_rank0(transport, inspect)
    life = _begin(transport, source, destination, overwrite,
                  {"format": "safetensors", "dtype": out_dtype, "max_shard_bytes": max_shard_bytes})
    owned = list(range(transport.rank, len(files), transport.size))
    model_files = model_files_in(source.save_dir)

    def place(staging: Staging) -> None:
        copy_model_files(source.save_dir, staging.tag_dir, model_files)
        copy_model_files(source.save_dir, destination, ())  # removes an earlier export's model files from OUT
        write_index(staging.tag_dir, sum(f.data_bytes for f in files),
                    {t.name: f.name for f in files for t in f.tensors})
        publish_files(staging, last=INDEX_NAME)

    _run_work(transport, life, lambda staging: _write_safetensors(source, model, files, owned, staging.tag_dir,
                                                                   trust_pickle), place)
    rss = transport.all_gather_object(peak_resident_bytes())
    return PipelineExportResult(source.save_dir, destination, source.tag, "safetensors", [f.name for f in files],
                                sum(f.data_bytes for f in files), transport.size, time.perf_counter() - started,
                                rss, model.tied_files, list(life.start.notes), model_files)


# ---- universal --------------------------------------------------------------------------------

def _write_universal_stage(source: PipelineSource, model: PipelineModel, stage: int, zero_dir: str,
                           trust_pickle: bool) -> None:
    """Stage `stage`'s parameters that it is the first to hold: fp32.pt, each state's .pt, step.pt
    (with a model axis, each tensor joined whole over the model ranks)."""
    import torch

    spec = source.stages[stage]
    tag_dir = os.path.dirname(zero_dir)  # what is published: the scratch of write_named_file lies beside it
    states = _stage_values(source, model, stage, trust_pickle, moments=True)
    by_name = {t.name: t for t in model.tensors}
    base_state = load_whole(source.optim_path(stage, 0), trust_pickle)[OPTIM][BASE]["state"]
    for group, names in enumerate(spec.names):
        step = base_state.get(group, {}).get("step")
        for name in names:
            if by_name[name].stage != stage:
                continue  # a tied parameter, written from the first stage holding it
            check_directory_name(name, source)
            directory = confined(zero_dir, os.path.join(zero_dir, name))
            os.makedirs(directory, exist_ok=True)
            rule = None if model.rules is None else model.rules.rule(name)
            for key, flat in states[name].items():
                check_directory_name(key, source)
                # a clone: a slice would save the whole joined flat's storage
                entry = universal_entry(rule, flat.reshape(by_name[name].shape).clone())
                write_named_file(tag_dir, os.path.join(directory, f"{key}.pt"),
                                 lambda path, entry=entry: torch.save(entry, path))
            if step is not None:
                write_named_file(tag_dir, os.path.join(directory, "step.pt"),
                                 lambda path, step=step: torch.save(step, path))


def _write_universal_rest(source: PipelineSource, model: PipelineModel, tag_dir: str, trust_pickle: bool) -> None:
    """Worker 0, after every stage: optimizer_state.pt (ds_to_universal `_save_optimizer_state`: stage
    0, dp rank 0), fp32.pt of frozen parameters and buffers, every stage's model-states file."""
    import torch

    zero_dir = os.path.join(tag_dir, "zero")
    os.makedirs(zero_dir, exist_ok=True)
    osd = load_whole(source.optim_path(0, 0), trust_pickle)[OPTIM]
    out = {k: v for k, v in osd.items() if k not in (BASE, "param_slice_mappings", "single_partition_of_fp32_groups")}
    out["param_groups"] = osd[BASE]["param_groups"]
    write_named_file(tag_dir, os.path.join(zero_dir, OPTIMIZER_STATE),
                     lambda path: torch.save(out, path, pickle_module=classes))
    for tensor in model.tensors:
        if tensor.stage >= 0:
            continue
        check_directory_name(tensor.name, source)
        directory = confined(zero_dir, os.path.join(zero_dir, tensor.name))
        os.makedirs(directory, exist_ok=True)
        entry = {UNIVERSAL_PARAM: _layer_value(source, model, tensor, trust_pickle).float()}
        write_named_file(tag_dir, os.path.join(directory, "fp32.pt"), lambda path, entry=entry: torch.save(entry, path))
    for stage in range(source.pp):
        for rank in range(source.tp):  # ds_to_universal copies every (stage, model rank)'s file
            copied = source.model_path(stage, rank)
            write_named_file(tag_dir, os.path.join(tag_dir, stage_model_name(stage, rank, source.tp)),
                             lambda path, copied=copied: shutil.copyfile(copied, path))


def export_pipeline_universal(source_dir: str, destination: str, tag: str, budget: int, trust_pickle: bool,
                              overwrite: bool, transport) -> PipelineExportResult:
    started = time.perf_counter()

    def inspect():
        source, model = _inspect(source_dir, destination, tag, trust_pickle)
        check_budget(source, stages_written_by(source.pp, transport.size), budget, "the universal export")
        return source, model

    source, model = on_rank0(transport, inspect)
    life = _begin(transport, source, destination, overwrite, {"format": "universal"})

    def write(staging: Staging) -> None:
        zero_dir = os.path.join(staging.tag_dir, "zero")
        os.makedirs(zero_dir, exist_ok=True)
        for stage in stages_written_by(source.pp, transport.size)[transport.rank]:
            _write_universal_stage(source, model, stage, zero_dir, trust_pickle)

    def place(staging: Staging) -> None:
        _write_universal_rest(source, model, staging.tag_dir, trust_pickle)
        publish_tag_dir(staging, None, source.tag, scripts_from=None, latest_name=LATEST_UNIVERSAL)

    _run_work(transport, life, write, place)
    rss = transport.all_gather_object(peak_resident_bytes())
    return PipelineExportResult(source.save_dir, destination, source.tag, "universal", [t.name for t in model.tensors],
                                sum(4 * math.prod(t.shape) for t in model.tensors), transport.size,
                                time.perf_counter() - started, rss, model.tied_files, list(life.start.notes))
