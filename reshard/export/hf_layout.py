"""Hugging Face safetensors layout of a checkpoint, pure: which tensor goes to which file, where.

    from reshard.export.hf_layout import hf_layout
    layout = hf_layout(source, out_dtype="bfloat16", max_shard_bytes=5 * 10**9)
    layout.files[0].name               # "model-00001-of-00003.safetensors"
    layout.files[0].tensors[0].name    # "embed.weight"
    layout.trainable_pieces()          # PieceTable: optimizer space -> (file, tensor index, element)

Tensors and their order are those of the model's `state_dict()`, as the model-states file's
`module` records it (runtime/engine.py `module_state_dict`): trainable parameters (values from
the fp32 master partitions), frozen parameters and persistent buffers. A tied alias
(`shared_params`: alias -> owner, e.g. head.weight -> embed.weight) is stored once, under the
owner's name, which is the name `named_parameters()` yields and the one HF's `save_pretrained`
keeps for an embedding tied to its output head (safetensors refuses two names for one storage).
Frozen parameters excluded at save and non-persistent buffers are not in the checkpoint, so not
in the export.
A mixture-of-experts save (native DeepSpeed MoE, AutoEP; ZeRO-1/2, BF16_Optimizer; AutoEP at ZeRO-3; AutoEP folded
with AutoTP at ZeRO-1/2, DCP only) is exported as the
model at ep 1 (`export_names`): its module lists no expert, so each layer's experts follow the layer's
gate, under their global index (AutoEP: each weight's experts as one fused tensor).

Shards follow huggingface_hub's `split_torch_state_dict_into_shards`: tensors in order, a new
file when the next tensor would push the current one past `max_shard_bytes` (a tensor larger
than that gets a file of its own). Within a file, tensors lie in that order, back to back.

Where each tensor's values come from:
    "optim"   a trainable parameter: element range of the ZeRO optimizer space (fp32 masters),
              moved by the exchange like any reshard;
    "frozen"  a ZeRO-3 frozen parameter: partitioned in `frozen_param_fragments`, also exchanged;
    "whole"   stored whole in the rank-0 model-states file (buffers; ZeRO-1/2 frozen
              parameters): copied in chunks by the worker that writes its output file.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import numpy as np

from reshard.errors import UnsupportedCheckpoint
from reshard.formats.deepspeed_files.deepspeed_spec import SourceCheckpoint
from reshard.formats.torch_bytes.torch_archive import TensorRef, dtype_of
from reshard.layouts.expert_placement import autoep_fused_name
from reshard.layouts.zero import PieceTable, logical_bases

# safetensors dtype codes (safetensors/src/tensor.rs `Dtype`), by torch dtype name.
SAFETENSORS_DTYPES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64",
                      "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL"}
INDEX_NAME = "model.safetensors.index.json"


@dataclass(frozen=True)
class ExportTensor:
    """One tensor of the export, where it comes from, and where it goes."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    """torch dtype name written to the file."""
    source: str
    """"optim", "frozen" or "whole" (see the module docstring)."""
    index: int
    """Parameter id in the optimizer space ("optim"), frozen id ("frozen"); -1 for "whole"."""
    ref: TensorRef | None = None
    """The source tensor in the rank-0 model-states file, or in `path` ("whole" only)."""
    path: str = ""
    """"whole": the file holding `ref` when not the rank-0 model-states file (a pipeline's layer file)."""
    runs: tuple = ()
    """"whole", joined over a model axis: (file, byte offset, element of this tensor, elements) of every
    run of every model rank's slice (reshard.export.pipeline_layout); empty: `ref` is the whole tensor."""
    data_offset: int = 0
    """Byte offset in the file's data section (after the header)."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * dtype_of(self.dtype).itemsize

    def whole_runs(self, model_path: str) -> tuple:
        """A "whole" tensor's (file, byte offset, element of this tensor, elements) runs, in order:
        `runs`, or the one run of `ref` in `path` (default: `model_path`, the rank-0 model-states file)."""
        return self.runs or ((self.path or model_path, self.ref.byte_offset, 0, self.numel),)


@dataclass(frozen=True)
class ExportFile:
    name: str
    tensors: tuple[ExportTensor, ...]

    @property
    def data_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


@dataclass(frozen=True)
class ExportLayout:
    """Output files, each holding whole tensors; the same on every worker. Its `pieces` make the
    files the target "ranks" of a plan (also used by the universal export, one "file" per bundle
    of parameters)."""

    files: tuple[ExportFile, ...]
    kept_for_tied: dict
    """alias -> the name it is stored under."""
    params_total: int
    """Elements of the optimizer space (so the pieces tile it)."""
    frozen_total: int
    params: tuple = ()
    """The optimizer space's parameters (ParamSpec), in the order "optim" tensors' `index` counts, when
    not the source spec's `params` (a pipeline save: each parameter once, reshard.export.pipeline_layout)."""

    @property
    def total_size(self) -> int:
        return sum(f.data_bytes for f in self.files)

    def weight_map(self) -> dict:
        return {t.name: f.name for f in self.files for t in f.tensors}

    def pieces(self, source_kind: str, numels) -> PieceTable:
        """Where each element of a source space ("optim" or "frozen") goes: rank = file,
        buffer = tensor's index in its file, offset = element in the tensor."""
        bases = logical_bases(numels)
        start, rank, buffer = [], [], []
        for f, file in enumerate(self.files):
            for k, tensor in enumerate(file.tensors):
                if tensor.source == source_kind and tensor.numel:
                    start.append(bases[tensor.index])
                    rank.append(f)
                    buffer.append(k)
        return PieceTable.from_unsorted(start, rank, buffer, np.zeros(len(start), np.int64), int(np.sum(numels)))

    def buffer_numels(self) -> list[int]:
        """Per tensor index, the largest tensor at that index in any file (round windows)."""
        width = max((len(f.tensors) for f in self.files), default=0)
        return [max((f.tensors[k].numel for f in self.files if k < len(f.tensors)), default=0) for k in range(width)]


def refuse_unnamed_experts(source: SourceCheckpoint, export: str) -> None:
    """A mixture-of-experts save is exported as the model at ep 1 (`export_names`): native MoE and AutoEP at
    ZeRO-1/2 and BF16_Optimizer, and AutoEP at ZeRO-3 (its `zero3_partitioned` experts are parameters of the
    ZeRO-3 partitions like any other, `layouts/experts.expert_zero3_layout`, so the same lowering), and AutoEP
    folded with AutoTP at ZeRO-1/2 (the DCP export only, which joins TP slices: `folded_export_pieces`).
    Refused by name: folded TP+EP at ZeRO-3, which no export test covers yet."""
    experts = source.spec.experts
    if experts is None:
        return
    if source.spec.tensor is not None and source.spec.stage == 3:
        raise UnsupportedCheckpoint(source.model_path(0), "is a ZeRO-3 AutoEP mixture-of-experts checkpoint folded "
                                                          f"with AutoTP; exporting it to {export} is not supported yet "
                                                          "(ZeRO-1/2 folded checkpoints are, to DCP)")


def export_names(spec) -> list[str]:
    """Per trainable parameter of `spec`, the name the model at ep 1 gives it (what every export writes).

    Native DeepSpeed MoE (deepspeed.moe.layer.MoE): its own name, which holds the GLOBAL expert index, as the
    expert files name it (runtime/engine.py `_save_moe_checkpoint`: local expert j of EP rank e is
    `deepspeed_experts.{e * num_local_experts + j}`) and as `state_dict()` of the module built with ep_size=1
    does. AutoEP: the per-expert slice `...experts.w1.{G}` belongs to the fused `...experts.w1` of shape
    [num_experts, ...] that the AutoEPMoELayer built at autoep_size 1 holds (module_inject/auto_ep_layer.py:
    EP rank e holds experts e * E/ep ..., stacked on dim 0). Everything else: its own name."""
    experts = spec.experts
    if experts is None or not experts.autoep:
        return [p.name for p in spec.params]
    return [p.name if e is None else autoep_fused_name(p.name) for p, e in zip(spec.params, experts.expert_of)]


def _fused_experts(spec, pids: list[int], path: str) -> list[tuple[str, tuple, int]]:
    """(fused name, shape [num_experts, ...], first parameter id) of each AutoEP fused tensor among `pids`: its
    experts' slices must lie end to end in the optimizer space, expert 0 first (`layouts/experts.py` lists them
    weight by weight, expert by expert), so the fused tensor is one run of it."""
    names = export_names(spec)
    fused: dict[str, list[int]] = {}
    for pid in pids:
        fused.setdefault(names[pid], []).append(pid)
    out = []
    for name, members in fused.items():
        members.sort()
        layer = spec.experts.expert_of[members[0]][0]
        shapes = {tuple(spec.params[p].shape) for p in members}
        if (members != list(range(members[0], members[0] + len(members))) or len(shapes) != 1
                or [spec.experts.expert_of[p] for p in members] != [(layer, g) for g in range(len(members))]
                or len(members) != spec.experts.num_experts[layer]):
            raise UnsupportedCheckpoint(path, f"the AutoEP experts of {name} do not lie expert by expert in one run of "
                                              "the optimizer's space; they cannot be exported as one fused tensor")
        out.append((name, (len(members), *shapes.pop()), members[0]))
    return out


def out_dtype_for(source_dtype: str, out_dtype: str) -> str:
    """Floating tensors are written as `out_dtype`; integer and bool buffers keep their dtype."""
    return out_dtype if dtype_of(source_dtype).is_floating_point else source_dtype


def hf_layout(source: SourceCheckpoint, out_dtype: str = "float32", max_shard_bytes: int = 5 * 10**9) -> ExportLayout:
    spec, model = source.spec, source.model_template
    module = model.get("module") or {}
    shared = dict(model.get("shared_params") or {})
    trainable = {p.name: i for i, p in enumerate(spec.params)}
    frozen = {p.name: i for i, p in enumerate(spec.frozen)}
    path = source.model_path(0)
    tensors = []
    seen = set()
    shared.update(_router_aliases(spec, module, trainable))
    for name, ref in module.items():
        if name in shared:
            continue
        if name in trainable:
            p = spec.params[trainable[name]]
            tensors.append(ExportTensor(name, p.shape, out_dtype, "optim", trainable[name]))
        elif name in frozen:
            p = spec.frozen[frozen[name]]
            tensors.append(ExportTensor(name, p.shape, out_dtype_for(spec.frozen_dtype, out_dtype), "frozen", frozen[name]))
        elif isinstance(ref, TensorRef):
            if not ref.is_contiguous:
                raise UnsupportedCheckpoint(path, f"module tensor {name} is not stored contiguously")
            tensors.append(ExportTensor(name, ref.shape, out_dtype_for(ref.dtype, out_dtype), "whole", -1, ref))
        else:
            continue
        seen.add(name)
    # An MoE save's module lists no expert (engine.py `_get_non_moe_state_dict`): each layer's experts (AutoEP's
    # fused, `_fused_experts`) go right after that layer's last module entry (its gate), global expert by global
    # expert, as the ep-1 module's state_dict() orders them (within one native expert, the optimizer's order:
    # weights before biases). Any other parameter the module dict does not list (it should not happen) is still
    # exported, at the end.
    refuse_unnamed_experts(source, "safetensors or DCP")  # the exports call it first, by name
    left = sorted((i for n, i in trainable.items() if n not in seen), key=_expert_order(spec))
    autoep = [i for i in left if spec.experts is not None and spec.experts.autoep and spec.experts.expert_of[i]]
    placed = [(spec.params[i].name, tuple(spec.params[i].shape), i) for i in left if i not in set(autoep)]
    placed += _fused_experts(spec, autoep, path) if autoep else []
    for name, shape, i in sorted(placed, key=lambda item: _expert_order(spec)(item[2])):
        layer = _moe_layer_of(spec, i)
        after = [k for k, t in enumerate(tensors) if layer is not None and t.name.startswith(layer)]
        tensors.insert(after[-1] + 1 if after else len(tensors), ExportTensor(name, shape, out_dtype, "optim", i))
    for name, i in frozen.items():
        if name not in seen:
            tensors.append(ExportTensor(name, spec.frozen[i].shape, out_dtype_for(spec.frozen_dtype, out_dtype), "frozen", i))

    for tensor in tensors:
        if tensor.dtype not in SAFETENSORS_DTYPES:
            raise UnsupportedCheckpoint(path, f"{tensor.name} is {tensor.dtype}, which safetensors cannot store")
    files = shard_files(tensors, max_shard_bytes)
    kept = {alias: owner for alias, owner in shared.items()}
    return ExportLayout(tuple(files), kept, spec.total_elements, sum(p.numel for p in spec.frozen))


def _router_aliases(spec, module: dict, trainable: dict) -> dict:
    """alias -> owner of every AutoEP router parameter the module also lists under the router's alias: an
    AutoEPMoELayer registers its router a second time under the name the replaced block gave its gate
    (module_inject/auto_ep_layer.py `AutoEPMoELayer.__init__`, `setattr(self, alias_target, self.router)`), so
    `mlp.gate.gate.weight` is the parameter `mlp.router.gate.weight`. The save holds the two as separate copies;
    the export stores the trainable one (its fp32 master) and the alias as a tied name, read from its chunks."""
    if spec.experts is None or not spec.experts.autoep:
        return {}
    aliases = {}
    for prefix in spec.experts.layer_prefixes:  # "model.layers.0.mlp.experts."
        layer = prefix[:prefix.index("experts.")]
        for name in module:
            head, _, rest = name[len(layer):].partition(".") if name.startswith(layer) else ("", "", "")
            owner = f"{layer}router.{rest}"
            if head and head not in ("router", "experts") and name not in trainable and owner in trainable:
                aliases[name] = owner
    return aliases


def _moe_layer_of(spec, pid: int) -> str | None:
    """The name prefix of the MoE module holding expert parameter `pid` ("moe.0.deepspeed_moe."), or None."""
    if spec.experts is None or spec.experts.expert_of[pid] is None:
        return None
    prefix = spec.experts.layer_prefixes[spec.experts.expert_of[pid][0]]
    return prefix[:prefix.index("experts.")]


def _expert_order(spec):
    """Sort key of a parameter id: experts by (MoE layer, global expert), the spec's order within one expert."""
    def key(pid):
        expert = None if spec.experts is None else spec.experts.expert_of[pid]
        return (0, 0, pid) if expert is None else (1, expert, pid)
    return key


def shard_files(tensors: list, max_shard_bytes: int) -> tuple[ExportFile, ...]:
    """`tensors` packed into `model-0000i-of-0000n.safetensors` shards (`pack_in_order`), each placed
    back to back in its file."""
    shards = pack_in_order(tensors, max_shard_bytes)
    files = []
    for number, members in enumerate(shards, start=1):
        placed, offset = [], 0
        for tensor in members:
            placed.append(ExportTensor(**{**tensor.__dict__, "data_offset": offset}))
            offset += tensor.nbytes
        files.append(ExportFile(f"model-{number:05d}-of-{len(shards):05d}.safetensors", tuple(placed)))
    return tuple(files)


def safetensors_header(file: ExportFile) -> bytes:
    """The header of a safetensors file: 8-byte little-endian length, then JSON padded with
    spaces so the data starts 8-byte aligned (safetensors/src/tensor.rs `prepare`).

    Written here rather than by `safetensors.torch.save_file` because that needs every tensor
    in memory at once; reshard reserves the file and fills it at offsets as slices arrive."""
    header = {"__metadata__": {"format": "pt"}}
    for t in file.tensors:
        header[t.name] = {"dtype": SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape),
                          "data_offsets": [t.data_offset, t.data_offset + t.nbytes]}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 8)
    return len(text).to_bytes(8, "little") + text


def pack_in_order(tensors: list, limit: int) -> list[list]:
    """Consecutive groups of `tensors`, each closed before it would pass `limit` bytes (a tensor
    larger than `limit` gets a group of its own, as save_pretrained does); at least one group."""
    groups, current, size = [], [], 0
    for tensor in tensors:
        if current and size + tensor.nbytes > limit:
            groups.append(current)
            current, size = [], 0
        current.append(tensor)
        size += tensor.nbytes
    groups.append(current)
    return groups


def write_index(directory: str, total_size: int, weight_map: dict) -> None:
    """`model.safetensors.index.json` as transformers' save_pretrained writes it, atomically."""
    index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
    path = os.path.join(directory, INDEX_NAME)
    with open(path + ".partial", "w") as fd:
        json.dump(index, fd, indent=2, sort_keys=True)
        fd.write("\n")
        fd.flush()
        os.fsync(fd.fileno())
    os.replace(path + ".partial", path)
