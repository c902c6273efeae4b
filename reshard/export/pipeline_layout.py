"""The tensors of a PipelineModule save's exports: their names, their order, and where their values are.

    from reshard.export.pipeline_layout import inspect_pipeline_export
    found = inspect_pipeline_export(save_dir, tag, "float32", trust_pickle=False)   # worker 0
    found.tensors     # ExportTensors in PipelineModule.state_dict() order
    found.params      # the trainable ones as the export's optimizer space, each once

Names. A PipelineModule registers each layer built from a LayerSpec (or given as an nn.Module) as
the child `str(global index)` and each TiedLayerSpec module once, as `tied_modules.<key>`
(DeepSpeed 0.19.8 runtime/pipe/module.py `_build`), so `PipelineModule.state_dict()` names a tensor
`<index>.<name>` or `tied_modules.<key>.<name>`: the names every stage's `param_shapes` and
optimizer use, and the names a PipelineModule built with the same layers at any number of stages
(pp=1 included) loads with `load_state_dict(strict=True)`. Every export (safetensors, universal, DCP)
uses them.

Where each tensor comes from:
    trainable parameters   "optim": the fp32 masters, moved by the exchange from the first stage whose
                           optimizer holds them (a tied module's parameters sit in every stage holding
                           it, equal; reshard.planning.checkpoint_plan.trainable_pieces reads one copy);
    frozen parameters,     "whole": the layer file `layer_XX-model_states.pt` that holds them (runtime/pipe/
    persistent buffers     module.py `save_state_dict`: the layer's own state_dict, its keys without
                           the prefix), copied in chunks. ZeRO-1 records frozen parameters nowhere else.
A layer file is named by its index when some stage lists a parameter or buffer `<index>.<key>` for
one of its keys (a tied module is never registered under an index); otherwise by the tied module
whose trainable parameters it holds, all of them, with their shapes; otherwise by its index. A
tied module none of whose parameters is trainable therefore cannot be told from a frozen layer
and is named by its index (documented in docs/supported.md).

With a model axis (PipeModelDataParallelTopology) each tensor's whole shape is its rules' join over
the model ranks (the save's universal_checkpoint_info, reshard.layouts.model_axis); at tp > 1 a save
without patterns is refused (`export_rules`).
"""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass

from reshard.errors import CheckpointError, UnsupportedCheckpoint
from reshard.export.hf_layout import ExportTensor, out_dtype_for
from reshard.formats.deepspeed_files import deepspeed_schema as schema
from reshard.formats.deepspeed_files.deepspeed_inspect import inspect_pipeline_columns
from reshard.formats.deepspeed_files.deepspeed_pipeline import (
    LAYER_RE,
    PipelineSource,
    inspect_pipeline,
    layer_file_name,
    load_whole,
    saved_model_axis_info,
)
from reshard.formats.deepspeed_files.deepspeed_spec import SourceCheckpoint
from reshard.formats.torch_bytes.torch_archive import TensorRef, load_portable
from reshard.jobs.manifest import source_identity
from reshard.layouts.model_axis import ModelAxisError, ModelAxisRules, model_axis_rules
from reshard.layouts.zero import ParamSpec

TRAINABLE = "optim"
"""ExportTensor.source of a trainable parameter (its values: the fp32 masters, exchanged)."""
LAYER = "whole"
"""ExportTensor.source of a frozen parameter or buffer (its values: a layer file's tensor)."""


@dataclass(frozen=True)
class ModuleTensor:
    """One tensor of `PipelineModule.state_dict()` and where its values are."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    """torch dtype name of the values found: float32 for a master, the layer file's otherwise."""
    stage: int = -1
    """A trainable parameter: the first stage whose optimizer holds it; -1 otherwise."""
    layer_file: str = ""
    """A frozen parameter or buffer: the layer file holding it (its key there: `key`)."""
    key: str = ""


@dataclass(frozen=True)
class PipelineModel:
    """Every tensor of the module, in state_dict() order: tied modules first (keys in order of
    their first layer), then the layers by index, each in its own order."""

    tensors: tuple[ModuleTensor, ...]
    tied_files: dict
    """Layer file -> the tied key it was named by (what the summary reports)."""
    rules: ModelAxisRules | None = None
    """With a model axis: the save's universal_checkpoint_info rules, by which every tensor is joined
    over the model ranks (`shape` is then the whole tensor's); None without (or at tp 1 without patterns)."""


def dtype_name(value) -> str:
    return str(value.dtype).removeprefix("torch.")


def module_tensors(source: PipelineSource, trust_pickle: bool = False,
                   rules: ModelAxisRules | None = None) -> PipelineModel:
    """Name every tensor of the layer files and every trainable parameter of the stages (worker 0;
    the layer files are mapped, not read). With a model axis, of model rank 0's layer files and
    stage files (every rank holds the same names, inspect_pipeline checks the stages'), each shape
    then joined over the model ranks by `rules`."""
    trainable: dict[str, tuple[int, tuple[int, ...]]] = {}
    for spec in source.stages:
        for names, shapes in zip(spec.names, spec.shapes):
            for name, shape in zip(names, shapes):
                trainable.setdefault(name, (spec.index, tuple(shape)))
    known = set(trainable) | {name for spec in source.stages for name in spec.buffer_names}
    tied_keys: dict[str, dict[str, tuple[int, ...]]] = {}
    for name, (_, shape) in trainable.items():
        head, _, rest = name.partition(".")
        if head == "tied_modules":
            key, _, param = rest.partition(".")
            tied_keys.setdefault(key, {})[param] = shape
    found: dict[str, ModuleTensor] = {}
    held_by: dict[str, tuple[str, str]] = {}
    """name -> (layer file, key) it was first read from"""
    order: list[tuple[tuple, str]] = []
    tied_files = {}
    files = sorted((f for f in source.layer_files if LAYER_RE.match(f)[3] is None or int(LAYER_RE.match(f)[3]) == 0),
                   key=lambda f: int(LAYER_RE.match(f)[1]))
    for file in files:
        index = int(LAYER_RE.match(file)[1])
        path = os.path.join(source.tag_dir, file)
        state = load_whole(path, trust_pickle)
        if not isinstance(state, dict):
            raise CheckpointError(path, "does not hold a layer's state_dict")
        tensors = {str(k): v for k, v in state.items() if hasattr(v, "dtype") and hasattr(v, "shape")}
        prefix = f"{index}."
        if not any(prefix + key in known for key in tensors):
            owners = [key for key, params in tied_keys.items()
                      if all(p in tensors and tuple(tensors[p].shape) == shape for p, shape in params.items())]
            if len(owners) > 1:
                raise UnsupportedCheckpoint(path, f"holds the trainable parameters of tied modules {owners}; "
                                                  "which one it is cannot be told from the checkpoint")
            if owners:
                prefix = f"tied_modules.{owners[0]}."
                tied_files[file] = owners[0]
        rank = (0, min(int(LAYER_RE.match(f)[1]) for f, k in tied_files.items() if k == tied_files[file])) \
            if file in tied_files else (1, index)
        for key, value in tensors.items():
            name = prefix + key
            if name in found:  # a tied module without forward_fn is saved at each of its indices: one module
                earlier_file, earlier_key = held_by[name]
                if not same_tensor(source, earlier_file, earlier_key, value, trust_pickle):
                    raise UnsupportedCheckpoint(path, f"holds {key}, named {name} like {earlier_file}'s {earlier_key}, "
                                                      "with other values: whether it is that tied module cannot be "
                                                      "told from the checkpoint")
                continue
            held_by[name] = (file, key)
            if name in trainable:
                stage, shape = trainable[name]
                if tuple(value.shape) != shape:
                    raise CheckpointError(path, f"holds {key} of shape {tuple(value.shape)}, but stage {stage}'s "
                                                f"param_shapes give {name} the shape {shape}")
                found[name] = ModuleTensor(name, shape, "float32", stage=stage)
            else:
                found[name] = ModuleTensor(name, tuple(int(x) for x in value.shape), dtype_name(value),
                                           layer_file=file, key=key)
            order.append((rank, name))
    # a trainable parameter no layer file holds (a tied module used only through forward_fn is saved nowhere)
    for name, (stage, shape) in trainable.items():
        if name not in found:
            found[name] = ModuleTensor(name, shape, "float32", stage=stage)
            head = name.split(".")[0]
            order.append(((0, -1) if head == "tied_modules" else (1, int(head) if head.isdigit() else 1 << 30), name))
    ranked = sorted(range(len(order)), key=lambda i: (order[i][0], i))
    tensors = tuple(found[order[i][1]] for i in ranked)
    if rules is not None:
        tensors = tuple(whole_shape(source, rules, t) for t in tensors)
    return PipelineModel(tensors, tied_files, rules)


def export_rules(source: PipelineSource, trust_pickle: bool = False) -> ModelAxisRules | None:
    """How each tensor of a model-axis save is joined over the model ranks: the rules of the
    universal_checkpoint_info in stage 0's model-states file (client state, the same in every stage
    file; reshard.layouts.model_axis). None without a model axis, and at tp 1 without usable patterns
    (one model rank holds every tensor whole: nothing to join). At tp > 1 a save without them is
    refused naming the file and what is missing: which dim a tensor is sliced on is recorded nowhere else."""
    if not source.has_model_axis:
        return None
    path = source.model_path(0)
    try:
        return model_axis_rules(saved_model_axis_info(source, trust_pickle))
    except ModelAxisError as error:
        if source.tp == 1:
            return None
        raise UnsupportedCheckpoint(path, f"is a pipeline save with a model axis (tp {source.tp}); the export joins "
                                          "each tensor over the model ranks by the universal_checkpoint_info patterns "
                                          f"of its client state, and it {error}") from None


def whole_shape(source: PipelineSource, rules: ModelAxisRules, tensor: ModuleTensor) -> ModuleTensor:
    """`tensor` at its whole shape, joined over the source's model ranks by its rule; a vocabulary
    tensor must need no padding change (ModelAxisRules.check_vocabulary), as for a tp change."""
    rule = rules.rule(tensor.name)
    where = (os.path.join(source.tag_dir, tensor.layer_file) if tensor.stage < 0
             else source.optim_path(tensor.stage, 0, 0))
    try:
        shape = rule.joined_shape(tensor.shape, source.tp)
        if rule.kind == "vocabulary":
            rules.check_vocabulary(tensor.name, shape)
    except ModelAxisError as error:
        text = str(error)
        raise UnsupportedCheckpoint(where, text if text.startswith(tensor.name) else f"{tensor.name} {text}") from None
    return dataclasses.replace(tensor, shape=shape)


def same_tensor(source: PipelineSource, file: str, key: str, value, trust_pickle: bool) -> bool:
    import torch
    other = load_whole(os.path.join(source.tag_dir, file), trust_pickle)[key]
    return other.dtype == value.dtype and torch.equal(other, value)


@dataclass(frozen=True)
class PipelineExport:
    """What worker 0 finds in a PipelineModule save for an export, the same for every worker."""

    source: SourceCheckpoint
    """The save as the main road reads it (deepspeed_inspect.inspect_pipeline_columns: spec.columns)."""
    pipe: PipelineSource
    model: PipelineModel
    tensors: tuple[ExportTensor, ...]
    """Every tensor of PipelineModule.state_dict(), in its order: "optim" ones index `params`, "whole"
    ones carry their layer file's path and TensorRef."""
    params: tuple[ParamSpec, ...]
    """The trainable parameters, each once, in the order of `tensors`: the export's optimizer space."""
    masters_require_grad: bool = False
    """The stages' fp32 master partitions are saved with requires_grad (ZeRO-1's
    `single_partition_of_fp32_groups` are: runtime/zero/stage_1_and_2.py sets it); the universal export
    writes each master so, as ds_to_universal's slices of them are (and the pipeline road did)."""

    @property
    def tied_files(self) -> dict:
        return self.model.tied_files

    def identity(self) -> dict:
        """What an export's fingerprint adds for this save (jobs.manifest.export_fingerprint names the
        stage and optimizer files): the layer files' sizes and mtimes, so a changed one is not resumed."""
        return {"layer_files": source_identity(self.pipe.tag_dir, self.pipe.layer_files)}


def export_tensors(pipe: PipelineSource, model: PipelineModel, out_dtype: str, trust_pickle: bool = False
                   ) -> tuple[tuple[ExportTensor, ...], tuple[ParamSpec, ...]]:
    """The export's tensors of `model` (trainable ones cast to `out_dtype`, floating layer tensors too)
    and its trainable parameters in that order, each at its whole shape. A layer tensor a model axis
    cuts (tp > 1, not replicated) is joined from every model rank's layer file run by run
    (ExportTensor.runs, as `pipeline_export_pieces` joins a trainable one); a replicated one is model
    rank 0's."""
    tensors, params, trees = [], [], {}

    def ref_of(path: str, key: str, where: str) -> TensorRef:
        if path not in trees:
            trees[path] = load_portable(path, schema.safe_globals(), trust_pickle)
        ref = trees[path].get(key) if isinstance(trees[path], dict) else None
        if not isinstance(ref, TensorRef):
            raise CheckpointError(path, f"does not hold {key} as a tensor, which {where} holds")
        if not ref.is_contiguous:
            raise UnsupportedCheckpoint(path, f"layer tensor {key} is not stored contiguously")
        return ref

    for t in model.tensors:
        if model.rules is not None and pipe.tp > 1 and model.rules.rule(t.name).kind == "average":
            # ds_to_universal averages the model ranks' copies; the export reads model rank 0's alone and
            # compares none (the whole-tensor exporter did): refused rather than taken unchecked
            raise UnsupportedCheckpoint(pipe.model_path(0), f"{t.name} matches parameter_to_average_patterns: the "
                                                            "export reads one model rank's copy and cannot check that "
                                                            f"the {pipe.tp} model ranks' copies are equal")
        if t.stage >= 0:
            tensors.append(ExportTensor(t.name, t.shape, out_dtype, TRAINABLE, len(params)))
            params.append(ParamSpec(t.name, t.shape))
            continue
        path = os.path.join(pipe.tag_dir, t.layer_file)
        ref = ref_of(path, t.key, t.layer_file)
        rule = model.rules.rule(t.name) if model.rules is not None and pipe.tp > 1 else None
        runs = ()
        if rule is not None and not rule.whole:
            index = int(LAYER_RE.match(t.layer_file)[1])
            outer = 2 if rule.kind == "two-sub-params" else math.prod(ref.shape[:rule.dim])
            run = ref.numel // outer
            parts = []
            for m in range(pipe.tp):
                rank_path = os.path.join(pipe.tag_dir, layer_file_name(index, m))
                part = ref_of(rank_path, t.key, t.layer_file)
                if (part.shape, part.dtype) != (ref.shape, ref.dtype):
                    raise CheckpointError(rank_path, f"holds {t.key} as {part.dtype} {list(part.shape)}, "
                                                     f"{t.layer_file} as {ref.dtype} {list(ref.shape)}")
                parts.append((rank_path, part))
            runs = tuple((rank_path, part.byte_offset + o * run * part.itemsize, o * pipe.tp * run + m * run, run)
                         for o in range(outer) for m, (rank_path, part) in enumerate(parts) if run)
        tensors.append(ExportTensor(t.name, t.shape, out_dtype_for(t.dtype, out_dtype), LAYER, -1, ref, path, runs))
    return tuple(tensors), tuple(params)


def inspect_pipeline_export(save_dir: str, tag: str, out_dtype: str, trust_pickle: bool = False) -> PipelineExport:
    """Worker 0: the save (checked as every pipeline job checks it), its tensors' names, whole shapes and
    sources."""
    source = inspect_pipeline_columns(save_dir, tag, trust_pickle=trust_pickle)  # counters carried: checked per rank
    pipe = inspect_pipeline(source.save_dir, source.tag, trust_pickle)
    model = module_tensors(pipe, trust_pickle, export_rules(pipe, trust_pickle))
    tensors, params = export_tensors(pipe, model, out_dtype, trust_pickle)
    masters = source.column_templates[0][0][schema.OPTIM]["single_partition_of_fp32_groups"]
    grad = any(isinstance(ref, TensorRef) and ref.requires_grad for ref in masters)
    return PipelineExport(source, pipe, model, tensors, params, grad)
