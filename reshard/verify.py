"""Check a reshard output: by its manifest hashes, or element by element against the source.

    python -m reshard verify DST                    # re-hash every file listed in the manifest
    torchrun --nproc_per_node=4 -m reshard verify DST --against SRC   # logical check, distributed

A pipeline output is checked the same way (the plan a pipeline reshard runs, the output's own stages as
the target's); its layer files by their bytes, at another tp as the plan re-cuts them, element by element
like the flat buffers, and its stages' cover of the parameters besides.

A ZeRO-0 MoE output is checked through its own plan (reshard.formats.deepspeed_files.deepspeed_zero0_moe.Zero0Moe, as the
reshard ran it): every element of each `expp_rank` file and of the model-states file's copy of EP rank
0's optimizer, and its expert files by their bytes.

`--against` replays the reshard plan, but where the job would write a slice it reads the
slice back from DST and compares bytes; every element of every target partition is checked
against its source element, with the same workers and memory budget as a reshard. It also
re-derives each DST file's unpartitioned content and metadata from SRC (counters, client
state, paddings, slice mappings, shapes) and compares those, so a DST that loads but holds
anything else is reported. Nothing is written.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

import numpy as np

from reshard.jobs import save_dir_files
from reshard.files.byte_io import hash_range, pread_exact
from reshard.transport.collective import on_rank0
from reshard.errors import CheckpointError
from reshard.jobs.execute import execute
from reshard.formats.deepspeed_files import deepspeed_schema as schema
from reshard.formats.deepspeed_files.deepspeed_inspect import (
    inspect_checkpoint,
    inspect_pipeline_columns,
    resolve_tag,
    source_rank_tensors,
)
from reshard.formats.deepspeed_files.deepspeed_spec import SourceCheckpoint, refuse_tensor_parallel
from reshard.formats.deepspeed_files.deepspeed_zero0_moe import (
    Zero0Moe,
    Zero0MoeCheckpoint,
    inspect_zero0_moe_checkpoint,
    is_zero0_moe,
    zero0_output_slots,
)
from reshard.formats.deepspeed_files.stage_change import SameStage
from reshard.formats.torch_bytes.torch_archive import (
    NewTensor,
    TensorRef,
    is_ref,
    leaves_in_order,
    load_portable,
    map_leaves,
)
from reshard.formats.torch_bytes.torch_classes import as_stand_in
from reshard.jobs.manifest import Manifest
from reshard.jobs.progress import Progress, progress_enabled
from reshard.formats.deepspeed_files.source_reader import SourceReader
from reshard.transport import Transport, transport_from_environment
from reshard.topology import Topology

MAX_REPORTED = 50


@dataclass
class VerifyResult:
    destination: str
    tag: str
    mode: str
    checked_files: int = 0
    checked_elements: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def summary(self) -> str:
        head = (f"verify {self.mode}: {self.destination} (tag {self.tag}): "
                f"{'OK' if self.ok else 'FAILED'} - {self.checked_files} files"
                + (f", {self.checked_elements:,} partition elements compared" if self.mode == "against source" else ""))
        return "\n".join([head] + [f"  {p}" for p in self.problems[:MAX_REPORTED]]
                         + ([f"  ... and {len(self.problems) - MAX_REPORTED} more"] if len(self.problems) > MAX_REPORTED else []))


def verify_hashes(destination: str, tag: str | None = None) -> VerifyResult:
    """Re-hash every file the manifest lists; report missing, resized or changed files."""
    destination = os.path.abspath(destination)
    tag = resolve_tag(destination, tag)
    tag_dir = os.path.join(destination, tag)
    manifest = Manifest.read(tag_dir)
    result = VerifyResult(destination, tag, "by manifest hashes", checked_files=len(manifest.files))
    with Progress("verify", progress_enabled(False)) as progress:
        progress.start(sum(entry["bytes"] for entry in manifest.files.values()))
        result.problems = manifest.check_files(tag_dir, on_file=progress.update)
    return result


class _Comparer:
    """Stands where the job's TargetWriter would: compares each arriving slice with DST's bytes."""

    def __init__(self, locations: dict, name_at=None):
        self.locations = locations
        self.name_at = name_at  # (rank, slot, element) -> the parameter there, where the layout says
        self.fds: dict = {}
        self.elements = 0
        self.problems: list[str] = []

    def write(self, rank: int, slot: tuple, element: int, itemsize: int, data: memoryview) -> None:
        path, ref = self.locations[(rank, slot)]
        fd = self.fds.get(path) or self.fds.setdefault(path, os.open(path, os.O_RDONLY))
        actual = bytearray(len(data))
        pread_exact(fd, memoryview(actual), ref.byte_offset + element * itemsize, path)
        count = len(data) // itemsize
        self.elements += count
        if actual != data:
            a = np.frombuffer(actual, dtype=np.uint8).reshape(count, itemsize)
            b = np.frombuffer(data, dtype=np.uint8).reshape(count, itemsize)
            first = int(np.flatnonzero((a != b).any(axis=1))[0])
            differing = int((a != b).any(axis=1).sum())
            name = self.name_at(rank, slot, element + first) if self.name_at is not None else None
            if slot[2] == "layer":  # a pipeline layer file's tensor, re-cut by the plan (Topology.layer_files)
                self.problems.append(f"{path}: {name}: {differing} of {count} elements from element {element} differ "
                                     f"from the source's re-cut (first at element {element + first})")
                return
            self.problems.append(f"{path}: {slot[2]} of flat buffer {slot[1]}: {differing} of {count} elements from "
                                 f"element {element} differ from the source (first at element {element + first}"
                                 f"{f', in {name}' if name else ''})")

    def sync(self) -> None:
        pass

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)


def _normalise(tree, expected_kinds: list, digest) -> object:
    """Replace leaves by comparable descriptions: partitions by dtype/size, other tensors by content."""
    position = iter(range(len(expected_kinds)))

    def describe(ref):
        i = next(position)
        if isinstance(expected_kinds[i], NewTensor):
            return ("partition", ref.dtype, ref.numel)
        return ("tensor", ref.dtype, ref.shape, ref.stride, ref.storage_offset, digest(ref))
    return map_leaves(tree, describe, is_ref)


def _same(a, b) -> bool:
    """Structural equality of normalised trees (NaN equals NaN, dict order matters; torch.Size and
    dtypes equal their stand-ins, torch_classes.as_stand_in).

    Iterative, and each pair of containers is compared once: trees read from files may share
    objects (torch_pickle.check_tree bounds how much), and a walk that followed every reference
    of a shared object would take exponential time on a "billion laughs" pickle."""
    pending = [(a, b)]
    compared: set[tuple[int, int]] = set()
    alive = []  # the pairs whose ids are in `compared`, kept so that no id is reused meanwhile
    while pending:
        a, b = pending.pop()
        if isinstance(a, (dict, list, tuple)) or hasattr(a, "__dict__"):
            pair = (id(a), id(b))
            if pair in compared:
                continue
            compared.add(pair)
            alive.append((a, b))
        a, b = as_stand_in(a), as_stand_in(b)
        if type(a) is not type(b):
            return False
        if isinstance(a, dict):
            if list(a) != list(b):
                return False
            pending.extend((a[key], b[key]) for key in a)
        elif isinstance(a, (list, tuple)):
            if len(a) != len(b):
                return False
            pending.extend(zip(a, b))
        elif isinstance(a, float):
            if not (a == b or (a != a and b != b)):
                return False
        elif hasattr(a, "__dict__") and not isinstance(a, type) and not hasattr(a, "_value_"):
            pending.append((vars(a), vars(b)))
        elif not a == b:
            return False
    return True


def _first_difference(a, b, path="") -> str:
    """Where two normalised trees differ, as a key path ("" when they are the same). Follows one
    path down, the first differing child at each level, in a loop (no recursion)."""
    if _same(a, b):
        return ""
    while True:
        step = _differing_child(a, b, path)
        if step is None:
            return f"{path or 'top level'}: expected {_clip(a)}, found {_clip(b)}"
        if isinstance(step, str):
            return step
        a, b, path = step


def _differing_child(a, b, path: str):
    """(child of a, child of b, its path) for the first children that differ; a message when the
    difference is in the keys; None when a and b differ as a whole (a leaf, or another type)."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in list(a) + [k for k in b if k not in a]:
            if key not in a or key not in b:
                return f"{path}[{key!r}] present on one side only"
            if not _same(a[key], b[key]):
                return a[key], b[key], f"{path}[{key!r}]"
        return f"{path}: keys in a different order"
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b) and not _is_leaf(a):
        for i, (x, y) in enumerate(zip(a, b)):
            if not _same(x, y):
                return x, y, f"{path}[{i}]"
    if type(a) is type(b) and hasattr(a, "__dict__") and not isinstance(a, type) and not hasattr(a, "_value_") \
            and not _same(vars(a), vars(b)):
        return vars(a), vars(b), path
    return None


def _is_leaf(value) -> bool:
    return isinstance(value, tuple) and bool(value) and value[0] in ("tensor", "partition")


def _clip(value) -> str:
    if isinstance(value, tuple) and value and value[0] == "tensor":
        return f"a {value[1]} tensor of shape {list(value[2])} with other contents"
    text = repr(value)
    return text if len(text) < 120 else text[:120] + "..."


def _compare_unpartitioned(source: SourceCheckpoint, destination_tag_dir: str, target_topology, rank: int,
                           trust_pickle: bool, files_of) -> tuple[list[str], int]:
    """Problems in the unpartitioned content of one target rank's files (`files_of(source, topology, rank)`:
    the stage form's), and how many files were checked."""
    problems, memo = [], {}
    targets = files_of(source, target_topology, rank)
    for target in targets:
        path = os.path.join(destination_tag_dir, target.name)
        if not os.path.isfile(path):
            problems.append(f"{path}: missing")
            continue
        actual = load_portable(path, schema.safe_globals(), trust_pickle)
        expected_leaves = leaves_in_order(target.tree, is_ref)
        if len(leaves_in_order(actual, is_ref)) != len(expected_leaves):
            problems.append(f"{path}: holds a different number of tensors than the source implies")
            continue
        carried = source.carried.get(target.template)
        template_path = os.path.join(source.tag_dir, target.template)
        expected = _normalise(target.tree, expected_leaves, lambda ref: _digest(template_path, ref, carried, memo))
        found = _normalise(actual, expected_leaves, lambda ref: _digest(path, ref, None, memo))
        difference = _first_difference(expected, found)
        if difference:
            problems.append(f"{path}: {difference}")
    return problems, len(targets)


def _digest(path: str, ref: TensorRef, carried: dict | None, memo: dict) -> str:
    """BLAKE3 of a storage's bytes; once per storage, though many views (module weights) share one."""
    key = (path, ref.storage_key)
    if key not in memo:
        if carried is not None and ref.storage_key in carried:
            from blake3 import blake3
            memo[key] = blake3(carried[ref.storage_key]).hexdigest()
        else:
            memo[key] = hash_range(path, ref.storage_key, ref.storage_nbytes)
    return memo[key]


def verify_against(destination: str, source_dir: str, *, tag: str | None = None, memory_budget: int = 1 << 30,
                   trust_pickle: bool = False, transport: Transport | None = None) -> VerifyResult:
    """Every element and every unpartitioned value of DST, derived again from SRC and compared."""
    destination, source_dir = os.path.abspath(destination), os.path.abspath(source_dir)
    own_transport = transport is None
    transport = transport or transport_from_environment()
    try:
        pipeline_tag = on_rank0(transport, lambda: _pipeline_tag(source_dir, tag))

        def inspect_both():
            if pipeline_tag is not None:
                return _inspect_pipeline_pair(source_dir, destination, pipeline_tag, trust_pickle)
            resolved = resolve_tag(source_dir, tag)
            if is_zero0_moe(os.path.join(source_dir, resolved)):
                return _inspect_zero0_moe_pair(source_dir, destination, resolved, trust_pickle)
            src = inspect_checkpoint(source_dir, tag, trust_pickle=trust_pickle)
            refuse_tensor_parallel(src, "verify --against")
            dst = inspect_checkpoint(destination, src.tag, trust_pickle=trust_pickle, carry_model_bytes=False)
            _check_same_model(src, dst)
            return src, dst
        source, target = on_rank0(transport, inspect_both)
        # the stage form plans, names the files and the source slots, as the reshard did (a ZeRO-0 MoE
        # save's: reshard.formats.deepspeed_files.deepspeed_zero0_moe.Zero0Moe)
        zero0 = isinstance(source, Zero0MoeCheckpoint)
        zero = Zero0Moe(trust_pickle=trust_pickle) if zero0 else SameStage(source.spec.stage)
        plan = zero.plan(source, target.spec.topology, transport.size, memory_budget)
        own = plan.ownership
        result = VerifyResult(destination, source.tag, "against source")
        if transport.rank == 0:  # files beside the tag directory (HF Trainer, Accelerate): same bytes
            result.problems, result.checked_files = save_dir_files.differences(source.save_dir, target.save_dir)
            if zero0:  # the expert files, carried whole by the reshard
                more, checked = _whole_file_problems(source, target)
                result.problems, result.checked_files = result.problems + more, result.checked_files + checked
            if pipeline_tag is not None:  # layer files by their bytes (at another tp by the plan), each parameter
                # in a stage, the stages' order
                more, checked = _pipeline_file_problems(
                    *_inspect_pipelines(source_dir, destination, pipeline_tag, trust_pickle))
                result.problems, result.checked_files = result.problems + more, result.checked_files + checked
        def open_comparer() -> _Comparer:
            locations = {}
            for rank in own.target_ranks_of(transport.rank):
                found_in = (zero0_output_slots(target, rank, trust_pickle) if zero0
                            else source_rank_tensors(target, rank, target=_layer_files_as_written(
                                target.spec.topology), trust_pickle=trust_pickle))
                for slot, found in found_in.items():
                    locations[(rank, slot)] = found
                problems, files = _compare_unpartitioned(source, target.tag_dir, target.spec.topology, rank,
                                                         trust_pickle, zero.files)
                result.problems += problems
                result.checked_files += files
            return _Comparer(locations, (lambda rank, slot, element: _pipeline_tensor_at(
                source.spec, target.spec.topology, rank, slot, element)) if pipeline_tag is not None else None)

        def gather(reader, comparer, finished) -> None:
            reports = transport.all_gather_object((result.problems + comparer.problems, comparer.elements,
                                                   result.checked_files))
            result.problems = [p for problems, _, _ in reports for p in problems]
            result.checked_elements = sum(n for _, n, _ in reports)
            result.checked_files = sum(f for _, _, f in reports)

        execute(plan, transport,
                open_source=lambda: SourceReader.open(source, own.source_ranks_of(transport.rank),
                                                      target=target.spec.topology, trust_pickle=trust_pickle,
                                                      extra_slots=zero.source_slots),
                open_sink=open_comparer, opening="opening files", after=gather,
                progress=Progress("verify", progress_enabled(False, transport.rank == 0)))
        return result
    finally:
        if own_transport:
            transport.close()


def _pipeline_tensor_at(spec, topology, rank: int, slot: tuple, element: int) -> str | None:
    """What a pipeline output's differing element belongs to: a parameter of its column's flat buffer
    (`_column_parameter_at`), or under a tp change the layer file tensor of a layer space's slot
    (`topology.layer_files`: slot (space name, tensor, "layer")), by its layer and key."""
    layer_files = topology.layer_files
    space = next((s for s in layer_files.axis.layer_spaces if s.name == slot[0]), None) \
        if layer_files is not None else None
    if space is not None:
        index, key = space.keys[slot[1]]
        return f"{key} of layer {index} ({space.tensors.names[slot[1]]})"
    return _column_parameter_at(spec, topology, rank, slot[1], element)


def _column_parameter_at(spec, topology, rank: int, buffer: int, element: int) -> str | None:
    """The parameter whose element sits at `element` of flat buffer `buffer` of pipeline rank `rank` of
    `topology` (its column's ZeRO-1 layout, spec.layout: pieces over the column's parameters end to end),
    or None in padding."""
    at = topology.coordinates(rank)
    layout = spec.layout(topology, topology.tp, at.tp, at.pp)
    pieces = layout.pieces
    inside = (pieces.rank == at.dp) & (pieces.buffer == buffer) & (pieces.offset <= element) & \
        (element < pieces.offset + pieces.length)
    if not inside.any():
        return None
    i = int(np.flatnonzero(inside)[0])
    position = int(pieces.start[i]) + element - int(pieces.offset[i])
    ends = np.cumsum(layout.numels)
    index = int(np.searchsorted(ends, position, side="right"))
    return layout.params[index].name if index < len(layout.params) else None


def _inspect_pipelines(source_dir: str, destination: str, tag: str, trust_pickle: bool):
    """(source, output) as deepspeed_pipeline.inspect_pipeline reads them, the output's layer files
    unread (they are compared with the source's by their bytes)."""
    from reshard.formats.deepspeed_files.deepspeed_pipeline import inspect_pipeline
    return (inspect_pipeline(source_dir, tag, trust_pickle),
            inspect_pipeline(destination, tag, trust_pickle, layer_shapes=False))


def _inspect_pipeline_pair(source_dir: str, destination: str, tag: str, trust_pickle: bool
                           ) -> tuple[SourceCheckpoint, SourceCheckpoint]:
    """A pipeline source and output as the main road takes them (inspect_pipeline_columns); at another pp
    the output's topology, which the plan takes as the target, carries its own stages (`Topology.stages`,
    collective_job.target_stages), which `_pipeline_file_problems` checks against the source's parameters and
    layers."""
    from reshard.jobs.collective_job import target_stages
    source_pipe, target_pipe = _inspect_pipelines(source_dir, destination, tag, trust_pickle)
    if target_pipe.bf16 != source_pipe.bf16:
        raise CheckpointError(target_pipe.tag_dir, f"is not a reshard of {source_pipe.tag_dir}: bf16 prefix differs")
    source = inspect_pipeline_columns(source_dir, tag, trust_pickle=trust_pickle)
    target = inspect_pipeline_columns(destination, tag, trust_pickle=trust_pickle, layer_shapes=False)
    if target_pipe.tp != source_pipe.tp:
        return _with_model_axis_change(source, target, source_pipe, target_pipe, trust_pickle)
    if target_pipe.pp != source_pipe.pp:
        _refuse_unknown_parameters(source_pipe, target_pipe)
        target = _with_stages(target, target_stages(source_pipe, [[n for group in spec.names for n in group]
                                                                 for spec in target_pipe.stages],
                                                    [spec.buffer_names for spec in target_pipe.stages]))
    elif target.spec.columns != source.spec.columns:
        raise CheckpointError(target.tag_dir, f"is not a reshard of {source.tag_dir}: its stages hold other "
                                              "parameters or param groups at the same number of stages")
    _refuse_differing_specs(source, target, ("stage", "optimizer", "bf16_prefix", "lp_dtype", "streams"))
    return source, target


def _with_model_axis_change(source: SourceCheckpoint, target: SourceCheckpoint, source_pipe, target_pipe,
                            trust_pickle: bool) -> tuple[SourceCheckpoint, SourceCheckpoint]:
    """A pipeline output at another tp, as the plan replays it: the source's target columns the output's
    stages at the output's local shapes, on the output's topology, and its model axis (collective_job.target_stages and
    with_model_axis, by the save's rules, formats/deepspeed_files/pipeline_target.model_axis_plan, the layer list as far as
    naming a layer file's tensors needs it, `_layers_from_names`), as the output's topology's layer files
    (`Topology.layer_files`, which `_layer_files_as_written` reads the output's own layer files by), so
    that each target rank's re-cut layer tensors are compared like its flat buffers. CheckpointError naming
    the file where the output cannot be such a reshard (no model axis on either side, no rules)."""
    from reshard.formats.deepspeed_files.pipeline_target import model_axis_plan
    from reshard.jobs.collective_job import target_stages, with_model_axis
    if not (source_pipe.has_model_axis and target_pipe.has_model_axis):
        raise CheckpointError(target.tag_dir, f"is not a reshard of {source.tag_dir}: its model axis has tp "
                                              f"{target_pipe.tp}, the source's {source_pipe.tp}, and "
                                              f"{'the source' if not source_pipe.has_model_axis else 'it'} has no "
                                              "model axis (layer files without -model_XX)")
    _refuse_unknown_parameters(source_pipe, target_pipe)
    layers = _layers_from_names(source_pipe, trust_pickle)
    rules, shapes = model_axis_plan(source_pipe, layers, target_pipe.tp, f"an output at tp {target_pipe.tp}")
    stages = target_stages(source_pipe, [[n for group in spec.names for n in group] for spec in target_pipe.stages],
                           [spec.buffer_names for spec in target_pipe.stages], shapes=shapes, tp=target_pipe.tp)
    source, layer_files = with_model_axis(source, source_pipe, rules, layers,
                                          _stage_bounds(target_pipe, layers.count), target_pipe.tp, trust_pickle)
    target = _with_stages(target, stages, layer_files)
    _refuse_differing_specs(source, target, ("stage", "optimizer", "bf16_prefix", "lp_dtype", "streams"))
    return source, target


def _with_stages(output: SourceCheckpoint, stages, layer_files=None) -> SourceCheckpoint:
    """`output` whose topology, the target the plan replays the reshard to, carries the stages it was written
    with (`Topology.stages`), and at another tp the layer files the reshard re-cut (`Topology.layer_files`):
    they are its own, so reading it lays out its own columns as before."""
    spec = output.spec
    return dataclasses.replace(output, spec=dataclasses.replace(spec, topology=dataclasses.replace(
        spec.topology, stages=stages, layer_files=layer_files)))


def _layer_files_as_written(output: Topology) -> Topology:
    """`output` (an output's topology, `_with_stages`) whose re-cut layer files, if any, are read where they
    were written: each by its target stage (SourceCheckpoint.layer_file_names), not by the source stage that
    the plan reads it from."""
    if output.layer_files is None:
        return output
    return dataclasses.replace(output, layer_files=dataclasses.replace(output.layer_files, templates=tuple(
        (index, stage, stage, tree) for index, _, stage, tree in output.layer_files.templates)))


def _stage_bounds(pipe, count: int) -> tuple[int, ...]:
    """The first layer index of each stage of `pipe` (module.py `parts`, which a save does not record), from
    the layers its parameters and buffers name (`<index>.*`); a stage naming none starts where the previous
    one does. Which stage a layer file falls to only says which worker compares it: any ascending bounds
    compare every layer file once."""
    bounds = [0]
    for spec in pipe.stages[1:]:
        held = [int(n.partition(".")[0]) for group in spec.names for n in group if n.partition(".")[0].isdigit()]
        held += [int(n.partition(".")[0]) for n in spec.buffer_names if n.partition(".")[0].isdigit()]
        bounds.append(max(bounds[-1], min(held, default=bounds[-1])))
    return (*bounds, count)


def _pipeline_tag(source_dir: str, tag: str | None) -> str | None:
    """The source's tag when it is a pipeline save (reshard.formats.deepspeed_files.deepspeed_pipeline), else None."""
    from reshard.formats.deepspeed_files.deepspeed_pipeline import is_pipeline
    tag = resolve_tag(source_dir, tag)
    return tag if is_pipeline(os.path.join(source_dir, tag)) else None


def _inspect_zero0_moe_pair(source_dir: str, destination: str, tag: str, trust_pickle: bool
                            ) -> tuple[Zero0MoeCheckpoint, Zero0MoeCheckpoint]:
    """A ZeRO-0 MoE source and its output, both inspected as sources (deepspeed_zero0_moe), refused,
    naming the output, where it is not a reshard of the same model: other optimizer kind, precision,
    experts per layer or param groups."""
    src = inspect_zero0_moe_checkpoint(source_dir, tag, trust_pickle=trust_pickle)
    dst = inspect_zero0_moe_checkpoint(destination, tag, trust_pickle=trust_pickle)
    _refuse_differing_specs(src, dst, ("optimizer", "lp_dtype", "wrapped", "orders"))
    if src.num_experts != dst.num_experts:
        raise CheckpointError(dst.tag_dir, f"is not a reshard of {src.tag_dir}: experts per MoE layer differ "
                                           f"({list(src.num_experts)} vs {list(dst.num_experts)})")
    return src, dst


def _whole_file_problems(source: SourceCheckpoint, target: SourceCheckpoint) -> tuple[list[str], int]:
    """The source's files that a reshard carries whole (`other_files`: a ZeRO-0 MoE save's expert files),
    each compared by its bytes with the output's; and how many were checked."""
    problems = []
    for name in source.other_files:
        path = os.path.join(target.tag_dir, name)
        if not os.path.isfile(path):
            problems.append(f"{path}: missing")
            continue
        size = os.path.getsize(os.path.join(source.tag_dir, name))
        if os.path.getsize(path) != size or hash_range(path, 0, size) != hash_range(
                os.path.join(source.tag_dir, name), 0, size):
            problems.append(f"{path}: differs from {os.path.join(source.tag_dir, name)}, which the reshard copies whole")
    return problems, len(source.other_files)


def _check_same_model(source: SourceCheckpoint, target: SourceCheckpoint) -> None:
    _refuse_differing_specs(source, target, ("stage", "optimizer", "bf16_prefix", "params", "groups", "round_robin",
                                             "param_alignment", "lp_dtype", "streams", "frozen"))


def _refuse_differing_specs(source: SourceCheckpoint, target: SourceCheckpoint, names) -> None:
    """CheckpointError naming the output where its spec's field `name` (of `names`) is not the source's."""
    for name in names:
        if getattr(source.spec, name) != getattr(target.spec, name):
            raise CheckpointError(target.tag_dir, f"is not a reshard of {source.tag_dir}: {name} differs "
                                                  f"({_clip(getattr(source.spec, name))} vs "
                                                  f"{_clip(getattr(target.spec, name))})")


def _refuse_unknown_parameters(source_pipe, target_pipe) -> None:
    """CheckpointError naming the output stage's model-states file that holds a parameter no source stage holds."""
    known = {n for spec in source_pipe.stages for group in spec.names for n in group}
    for spec in target_pipe.stages:
        unknown = sorted({n for group in spec.names for n in group} - known)
        if unknown:
            raise CheckpointError(target_pipe.model_path(spec.index), f"is not a reshard of {source_pipe.tag_dir}: it "
                                                                      f"holds {unknown}, which no source stage holds")


def _layers_from_names(source, trust_pickle: bool = False):
    """PipelineLayers naming each layer file's tensors, from the stages' parameter names (verify has
    no --pipeline-tied): a layer index with parameters `<index>.*` is its own; one without, whose
    file's tensors include every trainable `tied_modules.<key>.*` of exactly one tied key, holds
    that tied module (runtime/pipe/module.py saves a TiedLayerSpec module once, under its first
    index). CheckpointError naming the layer file where that is not one key."""
    from reshard.formats.deepspeed_files.deepspeed_pipeline import layer_file_name, layer_indices, load_whole, source_shapes
    from reshard.layouts.pipeline import PipelineLayers
    names = set(source_shapes(source))
    tied_params: dict[str, set] = {}
    for name in names:
        if name.startswith("tied_modules."):
            key, _, param = name[len("tied_modules."):].partition(".")
            tied_params.setdefault(key, set()).add(param)
    tied, indices = {}, layer_indices(source)
    for index in indices:
        if any(name.startswith(f"{index}.") for name in names):
            continue
        path = os.path.join(source.tag_dir, layer_file_name(index, 0))
        keys = {key for key, value in load_whole(path, trust_pickle).items() if hasattr(value, "shape")}
        owners = [key for key, params in tied_params.items() if params <= keys and key not in tied]
        if len(owners) > 1:
            raise CheckpointError(path, f"holds the tensors of tied modules {sorted(owners)} alike; which one it "
                                        "holds is not recorded, so its tensors' model-axis rules are unknown")
        if owners:
            tied[owners[0]] = (index,)
    return PipelineLayers(max(indices, default=0) + 1, tied)


def _pipeline_file_problems(source, target) -> tuple[list[str], int]:
    """Rank 0's share: layer and other files the source's bytes (with tp changed, the layer files one per
    layer and target model rank, their tensors compared by the plan, the rest by `_compare_unpartitioned`),
    every parameter in some stage, an untied one in exactly one, and stages holding ascending layer ranges."""
    from reshard.files.byte_io import hash_file
    from reshard.formats.deepspeed_files.deepspeed_pipeline import layer_file_name, layer_indices
    from reshard.jobs.manifest import MANIFEST_NAME
    problems, checked = [], 0
    tp_changed = target.tp != source.tp
    if tp_changed:
        indices = layer_indices(source)
        wanted = {layer_file_name(i, m) for i in indices for m in range(target.tp)}
        if set(target.layer_files) != wanted:
            problems.append(f"{target.tag_dir}: layer files {sorted(target.layer_files)}, expected {sorted(wanted)} "
                            f"(the source's {len(indices)} layers at tp {target.tp})")
    elif set(target.layer_files) != set(source.layer_files):
        problems.append(f"{target.tag_dir}: layer files {sorted(target.layer_files)}, the source's "
                        f"{sorted(source.layer_files)}")
    extra = sorted(set(target.other_files) - set(source.other_files) - {MANIFEST_NAME})
    if extra:
        problems.append(f"{target.tag_dir}: holds {extra}, which the source does not")
    for name in sorted((set() if tp_changed else set(source.layer_files)) | set(source.other_files)):
        path = os.path.join(target.tag_dir, name)
        checked += 1
        if not os.path.isfile(path):
            problems.append(f"{path}: missing")
        elif hash_file(path) != hash_file(os.path.join(source.tag_dir, name)):
            problems.append(f"{path}: content differs from {os.path.join(source.tag_dir, name)}")
    held: dict[str, list[int]] = {}
    for spec in target.stages:
        for name in (n for group in spec.names for n in group):
            held.setdefault(name, []).append(spec.index)
    source_names = {n for spec in source.stages for group in spec.names for n in group}
    for name in sorted(source_names - set(held)):
        problems.append(f"{target.tag_dir}: no stage holds {name}")
    buffers = {name: [spec.index for spec in target.stages if name in spec.buffer_names]
               for spec in source.stages for name in spec.buffer_names}
    for name, stages in sorted(buffers.items()):
        owner = name.partition(".")[0] + "."  # a layer's buffer sits with that layer's parameters
        with_params = sorted({s for n, ss in held.items() if n.startswith(owner) for s in ss})
        if not stages or (owner[:-1].isdigit() and with_params and stages != with_params):
            problems.append(f"{target.tag_dir}: buffer {name} is listed by stages {stages}, its layer's "
                            f"parameters are on stages {with_params}")
    extra_buffers = sorted({n for spec in target.stages for n in spec.buffer_names} - set(buffers))
    if extra_buffers:
        problems.append(f"{target.tag_dir}: lists buffers {extra_buffers}, which no source stage does")
    for name, stages in sorted(held.items()):
        if len(stages) > 1 and not name.startswith("tied_modules."):
            problems.append(f"{target.tag_dir}: {name} is held by stages {stages}; only tied modules are shared")
    last = -1
    for spec in target.stages:  # runtime/pipe/module.py: stage s holds layers parts[s] .. parts[s + 1] - 1
        indices = sorted({int(n.partition(".")[0]) for group in spec.names for n in group
                          if n.partition(".")[0].isdigit()})
        if indices and indices[0] <= last:
            problems.append(f"{target.model_path(spec.index)}: holds layer {indices[0]}, not after the previous "
                            f"stages' last layer {last}")
        last = max([last, *indices])
    return problems, checked
