"""Check a reshard output: by its manifest hashes, or element by element against the source.

    python -m reshard verify DST                    # re-hash every file listed in the manifest
    torchrun --nproc_per_node=4 -m reshard verify DST --against SRC   # logical check, distributed

A pipeline output is checked the same way (the plan a pipeline reshard runs, the output's own stages as
the target's); its layer files by their bytes and its stages' cover of the parameters besides. Only a
pipeline output at another tp is still checked with whole tensors (verify_pipeline_against, issue 37).

`--against` replays the reshard plan, but where the job would write a slice it reads the
slice back from DST and compares bytes; every element of every target partition is checked
against its source element, with the same workers and memory budget as a reshard. It also
re-derives each DST file's unpartitioned content and metadata from SRC (counters, client
state, paddings, slice mappings, shapes) and compares those, so a DST that loads but holds
anything else is reported. Nothing is written.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

from reshard.jobs import save_dir_files
from reshard.files.byte_io import hash_range, pread_exact
from reshard.planning.checkpoint_plan import plan_reshard
from reshard.transport.collective import on_rank0
from reshard.errors import CheckpointError
from reshard.jobs.execute import execute
from reshard.formats import deepspeed_schema as schema
from reshard.formats.deepspeed_inspect import (
    inspect_checkpoint,
    inspect_pipeline_columns,
    resolve_tag,
    source_rank_tensors,
)
from reshard.formats.deepspeed_spec import SourceCheckpoint, refuse_tensor_parallel
from reshard.formats.deepspeed_target import target_files
from reshard.formats.torch_archive import (
    NewTensor,
    TensorRef,
    is_ref,
    leaves_in_order,
    load_portable,
    map_leaves,
)
from reshard.formats.torch_classes import as_stand_in
from reshard.jobs.manifest import Manifest
from reshard.jobs.progress import Progress, progress_enabled
from reshard.formats.source_reader import SourceReader
from reshard.transport import Transport, transport_from_environment

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
                           trust_pickle: bool) -> tuple[list[str], int]:
    """Problems in the unpartitioned content of one target rank's files, and how many files were checked."""
    problems, memo = [], {}
    targets = target_files(source, target_topology, rank)
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
        if pipeline_tag is not None and not on_rank0(transport, lambda: _keeps_columns(source_dir, destination,
                                                                                        pipeline_tag)):
            # a tp change: whole tensors still (issue 37, until the plan re-slices a pipeline's model axis)
            return verify_pipeline_against(destination, source_dir, pipeline_tag, transport, trust_pickle)

        def inspect_both():
            if pipeline_tag is not None:
                return _inspect_pipeline_pair(source_dir, destination, pipeline_tag, trust_pickle)
            src = inspect_checkpoint(source_dir, tag, trust_pickle=trust_pickle)
            refuse_tensor_parallel(src, "verify --against")
            dst = inspect_checkpoint(destination, src.tag, trust_pickle=trust_pickle, carry_model_bytes=False)
            _check_same_model(src, dst)
            return src, dst
        source, target = on_rank0(transport, inspect_both)
        plan = plan_reshard(source.spec, target.spec.topology, transport.size, memory_budget)
        own = plan.ownership
        result = VerifyResult(destination, source.tag, "against source")
        if transport.rank == 0:  # files beside the tag directory (HF Trainer, Accelerate): same bytes
            result.problems, result.checked_files = save_dir_files.differences(source.save_dir, target.save_dir)
            if pipeline_tag is not None:  # layer files by their bytes, each parameter in a stage, the stages' order
                more, checked = _pipeline_file_problems(
                    *_inspect_pipelines(source_dir, destination, pipeline_tag, trust_pickle))
                result.problems, result.checked_files = result.problems + more, result.checked_files + checked
        def open_comparer() -> _Comparer:
            locations = {}
            for rank in own.target_ranks_of(transport.rank):
                for slot, found in source_rank_tensors(target, rank, trust_pickle=trust_pickle).items():
                    locations[(rank, slot)] = found
                problems, files = _compare_unpartitioned(source, target.tag_dir, target.spec.topology, rank,
                                                         trust_pickle)
                result.problems += problems
                result.checked_files += files
            return _Comparer(locations, (lambda rank, slot, element: _column_parameter_at(
                source.spec, target.spec.topology, rank, slot[1], element)) if pipeline_tag is not None else None)

        def gather(reader, comparer, finished) -> None:
            reports = transport.all_gather_object((result.problems + comparer.problems, comparer.elements,
                                                   result.checked_files))
            result.problems = [p for problems, _, _ in reports for p in problems]
            result.checked_elements = sum(n for _, n, _ in reports)
            result.checked_files = sum(f for _, _, f in reports)

        execute(plan, transport,
                open_source=lambda: SourceReader.open(source, own.source_ranks_of(transport.rank),
                                                      trust_pickle=trust_pickle),
                open_sink=open_comparer, opening="opening files", after=gather,
                progress=Progress("verify", progress_enabled(False, transport.rank == 0)))
        return result
    finally:
        if own_transport:
            transport.close()


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


def _keeps_columns(source_dir: str, destination: str, tag: str) -> bool:
    """Whether a pipeline output is checked on the main road: the collective job's one predicate
    (collective_job.keeps_pipeline_columns), asked for the output's (pp, dp, tp). The output's own stage
    files say which parameters each of its stages holds, so the layer list a reshard's pp change needs
    is not needed here: the predicate is asked as for a reshard given one. An output at another tp is
    still checked with whole tensors (`verify_pipeline_against`): this check builds the output's columns
    at the source's tp (`with_target_stages`) and does not yet re-cut slices (issue 37)."""
    from reshard.formats.deepspeed_pipeline import is_pipeline, saved_pipeline_topology
    from reshard.jobs.collective_job import keeps_pipeline_columns
    from reshard.jobs.options import ReshardOptions
    tag_dir = os.path.join(destination, tag)
    if not is_pipeline(tag_dir):
        raise CheckpointError(tag_dir, f"is not a pipeline checkpoint, but {os.path.join(source_dir, tag)} is")
    pp, dp, tp = saved_pipeline_topology(tag_dir)
    if tp != saved_pipeline_topology(os.path.join(source_dir, tag))[2]:
        return False
    return keeps_pipeline_columns(ReshardOptions(target_dp=dp, target_tp=tp, target_pp=pp, pipeline_layers=True),
                                  os.path.join(source_dir, tag))


def _inspect_pipelines(source_dir: str, destination: str, tag: str, trust_pickle: bool):
    """(source, output) as deepspeed_pipeline.inspect_pipeline reads them, the output's layer files
    unread (they are compared with the source's by their bytes)."""
    from reshard.formats.deepspeed_pipeline import inspect_pipeline
    return (inspect_pipeline(source_dir, tag, trust_pickle),
            inspect_pipeline(destination, tag, trust_pickle, layer_shapes=False))


def _inspect_pipeline_pair(source_dir: str, destination: str, tag: str, trust_pickle: bool
                           ) -> tuple[SourceCheckpoint, SourceCheckpoint]:
    """A pipeline source and output as the main road takes them (inspect_pipeline_columns); at another pp
    the source's target columns are the output's own stages (collective_job.with_target_stages), which
    `_pipeline_file_problems` checks against the source's parameters and layers."""
    from reshard.jobs.collective_job import with_target_stages
    source_pipe, target_pipe = _inspect_pipelines(source_dir, destination, tag, trust_pickle)
    if target_pipe.bf16 != source_pipe.bf16:
        raise CheckpointError(target_pipe.tag_dir, f"is not a reshard of {source_pipe.tag_dir}: bf16 prefix differs")
    source = inspect_pipeline_columns(source_dir, tag, trust_pickle=trust_pickle)
    target = inspect_pipeline_columns(destination, tag, trust_pickle=trust_pickle, layer_shapes=False)
    if target_pipe.pp != source_pipe.pp:
        known = {n for spec in source_pipe.stages for group in spec.names for n in group}
        for spec in target_pipe.stages:
            unknown = sorted({n for group in spec.names for n in group} - known)
            if unknown:
                raise CheckpointError(target_pipe.model_path(spec.index), f"is not a reshard of {source_pipe.tag_dir}:"
                                                                          f" it holds {unknown}, which no source stage"
                                                                          " holds")
        source = with_target_stages(source, source_pipe, [[n for group in spec.names for n in group]
                                                          for spec in target_pipe.stages],
                                    [spec.buffer_names for spec in target_pipe.stages])
    elif target.spec.columns != source.spec.columns:
        raise CheckpointError(target.tag_dir, f"is not a reshard of {source.tag_dir}: its stages hold other "
                                              "parameters or param groups at the same number of stages")
    for name in ("stage", "optimizer", "bf16_prefix", "lp_dtype", "streams"):
        if getattr(source.spec, name) != getattr(target.spec, name):
            raise CheckpointError(target.tag_dir, f"is not a reshard of {source.tag_dir}: {name} differs "
                                                  f"({_clip(getattr(source.spec, name))} vs "
                                                  f"{_clip(getattr(target.spec, name))})")
    return source, target


def _pipeline_tag(source_dir: str, tag: str | None) -> str | None:
    """The source's tag when it is a pipeline save (reshard.formats.deepspeed_pipeline), else None."""
    from reshard.formats.deepspeed_pipeline import is_pipeline
    tag = resolve_tag(source_dir, tag)
    return tag if is_pipeline(os.path.join(source_dir, tag)) else None


def _check_same_model(source: SourceCheckpoint, target: SourceCheckpoint) -> None:
    a, b = source.spec, target.spec
    for name in ("stage", "optimizer", "bf16_prefix", "params", "groups", "round_robin", "param_alignment",
                 "lp_dtype", "streams", "frozen"):
        if getattr(a, name) != getattr(b, name):
            raise CheckpointError(target.tag_dir, f"is not a reshard of {source.tag_dir}: {name} differs "
                                                  f"({_clip(getattr(a, name))} vs {_clip(getattr(b, name))})")


# Pipeline outputs at another tp (reshard.jobs.pipeline_job; every other pipeline output is checked
# through the plan, above). The job works with whole tensors, so does this check: each target stage's
# optimizer files are joined by the target's own layout and every parameter's fp32 master and
# per-element state are compared by name with the cut of the source's, which owes nothing to how the
# job cut them. Keys the job recomputes (partition counts, paddings, slice mappings, world sizes,
# param_shapes) are checked against the target's own (pp, dp); everything else must equal the source
# file it came from. The model axis is re-cut by the save's universal_checkpoint_info patterns
# (reshard.layouts.model_axis): every source tensor is joined whole over the source's model ranks
# (deepspeed_pipeline.model_axis_states, whose join checks replicated tensors equal) and each
# target (stage, model rank)'s states, and each target layer file's tensors, must equal the cut
# of that join for its model rank (`ModelAxisChange`); param_shapes the target's local shapes.

FP32_GROUPS = "single_partition_of_fp32_groups"
_PIPELINE_RECOMPUTED_OPTIM = ("single_partition_of_fp32_groups", "base_optimizer_state", "partition_count",
                              "group_paddings", "param_alignment_paddings", "param_slice_mappings")
_PIPELINE_RECOMPUTED_MODEL = ("param_shapes", "dp_world_size", "mp_world_size", "checkpoint_parallel_dimensions")


def _plain(tree):
    """`tree` with every tensor replaced by (dtype, shape, BLAKE3 of its bytes), for _same and
    _first_difference; a tree nested deeper than Python's recursion limit is reported as such."""
    import torch
    from blake3 import blake3

    def walk(value):
        if isinstance(value, torch.Tensor):
            data = value.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
            return ("tensor", str(value.dtype), tuple(value.shape), blake3(data.tobytes()).hexdigest())
        if isinstance(value, dict):
            return type(value)((key, walk(item)) for key, item in value.items()) \
                if type(value) is not dict else {key: walk(item) for key, item in value.items()}
        if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
            return type(value)(walk(item) for item in value)
        return value
    try:
        return walk(tree)
    except RecursionError:
        return ("nested too deeply to compare",)


def _pipeline_layout_problems(path: str, osd: dict, template: dict, spec, dp: int, rank: int) -> list[str]:
    """What one target optimizer file holds against its stage's layout at `dp` and its template
    (the source file it was derived from): sizes, recomputed keys, and every other key equal."""
    from reshard.layouts.zero import zero12_group
    problems = []
    if list(osd) != list(template):
        return [f"{path}: optimizer_state_dict keys {list(osd)}, the source's {list(template)}"]
    for key in osd:
        if key not in _PIPELINE_RECOMPUTED_OPTIM and not _same(_plain(template[key]), _plain(osd[key])):
            problems.append(f"{path}: optimizer_state_dict[{key!r}]: "
                            f"{_first_difference(_plain(template[key]), _plain(osd[key]))}")
    groups = len(spec.names)
    layouts = [zero12_group(range(len(spec.numels[g])), spec.numels[g], dp) for g in range(groups)]
    expected = {"partition_count": [dp] * groups,
                "group_paddings": [layouts[g].tail_padding(rank) for g in range(groups)],
                "param_slice_mappings": [{spec.names[g][pid]: (numel, start)
                                          for pid, numel, start in layouts[g].slice_mappings(rank, spec.numels[g])}
                                         for g in range(groups)]}
    if "param_alignment_paddings" in template:
        expected["param_alignment_paddings"] = [[0] * len(spec.names[g]) for g in range(groups)]
    found = dict(osd)
    found["partition_count"] = [int(count) for count in osd["partition_count"]]
    found["param_slice_mappings"] = [{name: (getattr(address, "numel", None), getattr(address, "start", None))
                                      for name, address in group.items()} for group in osd["param_slice_mappings"]]
    for key, value in expected.items():
        if found[key] != value:
            problems.append(f"{path}: {key} {_clip(found[key])}, expected {_clip(value)} for dp rank {rank} of {dp}")
    masters, base, base_template = osd[FP32_GROUPS], osd["base_optimizer_state"], template["base_optimizer_state"]
    for g in range(groups):
        if g >= len(masters) or masters[g].numel() != layouts[g].lean_numel(rank):
            problems.append(f"{path}: fp32 partition of group {g} has "
                            f"{masters[g].numel() if g < len(masters) else 'no'} elements, "
                            f"{layouts[g].lean_numel(rank)} expected")
    if list(base) != list(base_template) or not _same(_plain(base.get("param_groups")),
                                                      _plain(base_template.get("param_groups"))):
        problems.append(f"{path}: base_optimizer_state param_groups (hyperparameters) differ from the source's")
    for g in range(groups):
        state, want = base.get("state", {}).get(g, {}), base_template.get("state", {}).get(g, {})
        if list(state) != list(want):
            problems.append(f"{path}: optimizer state keys of group {g} {list(state)}, the source's {list(want)}")
            continue
        for key, value in state.items():
            if hasattr(value, "dim") and value.dim() == 1 and hasattr(want[key], "dim") and want[key].dim() == 1:
                if value.numel() != layouts[g].partition_numel:
                    problems.append(f"{path}: {key} of group {g} has {value.numel()} elements, "
                                    f"{layouts[g].partition_numel} expected")
            elif not _same(_plain(value), _plain(want[key])):
                problems.append(f"{path}: {key} of group {g}: {_first_difference(_plain(want[key]), _plain(value))}")
    return problems


@dataclass(frozen=True)
class ModelAxisChange:
    """What a tp-changed pipeline output is checked by: the save's rules and the layer list as far
    as naming a layer file's tensors needs it (`_layers_from_names`)."""

    rules: object
    """reshard.layouts.model_axis.ModelAxisRules of the source's universal_checkpoint_info."""
    shapes: dict
    """Every trainable parameter's shape on one target model rank."""
    layers: object
    """reshard.layouts.pipeline.PipelineLayers: which layer index holds which tied module."""


def _model_axis_change(source, target, trust_pickle: bool) -> ModelAxisChange:
    """The rules a tp change was made by; CheckpointError naming the file where the output cannot be
    one (no model axis on either side, no rules the job could have used)."""
    from reshard.formats.deepspeed_pipeline import saved_model_axis_info, source_shapes
    from reshard.layouts.model_axis import ModelAxisError, model_axis_rules, target_local_shapes
    if not (source.has_model_axis and target.has_model_axis):
        raise CheckpointError(target.tag_dir, f"is not a reshard of {source.tag_dir}: its model axis has tp "
                                              f"{target.tp}, the source's {source.tp}, and "
                                              f"{'the source' if not source.has_model_axis else 'it'} has no "
                                              "model axis (layer files without -model_XX)")
    path = source.model_path(0)
    try:
        rules = model_axis_rules(saved_model_axis_info(source, trust_pickle))
        shapes = target_local_shapes(rules, source_shapes(source), source.tp, target.tp)
    except ModelAxisError as error:
        raise CheckpointError(target.tag_dir, f"is not a reshard of {source.tag_dir}: its model axis has tp "
                                              f"{target.tp}, the source's {source.tp}, and {path} {error}") from None
    return ModelAxisChange(rules, shapes, _layers_from_names(source, trust_pickle))


def _layers_from_names(source, trust_pickle: bool = False):
    """PipelineLayers naming each layer file's tensors, from the stages' parameter names (verify has
    no --pipeline-tied): a layer index with parameters `<index>.*` is its own; one without, whose
    file's tensors include every trainable `tied_modules.<key>.*` of exactly one tied key, holds
    that tied module (runtime/pipe/module.py saves a TiedLayerSpec module once, under its first
    index). CheckpointError naming the layer file where that is not one key."""
    from reshard.formats.deepspeed_pipeline import layer_file_name, layer_indices, load_whole, source_shapes
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


def _pipeline_stage_problems(source, target, stage: int, source_states: dict, trust_pickle: bool,
                             model_rank: int = 0, change: ModelAxisChange | None = None) -> tuple[list, int, int]:
    """(problems, files checked, elements compared) for target stage `stage` of model rank
    `model_rank` (`source_states`: that model rank's column of the source; with tp changed, every
    parameter's states cut for `model_rank` from the join over the source's model ranks)."""
    import torch

    from reshard.formats.deepspeed_pipeline import OPTIM, load_whole, read_stage
    from reshard.layouts.zero import zero12_group
    problems, spec = [], target.stages[stage]
    kept = target.pp == source.pp and change is None  # a tp change re-assigns the stages as another pp does
    origin = stage if kept else 0  # the job builds a new stage's files from source stage 0's
    # with tp changed, a model rank the source lacks takes model rank 0's file (write_repartitioned_stage),
    # and the optimizer files' template is model rank 0's (model_axis_states)
    model_origin = model_rank if model_rank < source.tp else 0
    optim_origin = 0 if change is not None else model_rank
    model_path = target.model_path(stage, model_rank)
    model, want = load_whole(model_path, trust_pickle), load_whole(source.model_path(origin, model_origin), trust_pickle)
    # with new stages, each stage's buffer_names follow its layers (checked in _pipeline_file_problems)
    recomputed = _PIPELINE_RECOMPUTED_MODEL + (() if kept else ("buffer_names",))
    rest = {key: value for key, value in model.items() if key not in recomputed}
    rest_wanted = {key: value for key, value in want.items() if key not in recomputed}
    if not _same(_plain(rest_wanted), _plain(rest)):
        problems.append(f"{model_path}: {_first_difference(_plain(rest_wanted), _plain(rest))}")
    dims = want.get("checkpoint_parallel_dimensions") if kept else \
        {**(want.get("checkpoint_parallel_dimensions") or {}), "pp_degree": target.pp,
         **({"tp_degree": target.tp} if change is not None else {})}
    if (model.get("dp_world_size"), model.get("mp_world_size"), model.get("checkpoint_parallel_dimensions")) != \
            (target.dp, target.pp * target.tp, dims):
        problems.append(f"{model_path}: dp_world_size {model.get('dp_world_size')}, mp_world_size "
                        f"{model.get('mp_world_size')}, checkpoint_parallel_dimensions "
                        f"{model.get('checkpoint_parallel_dimensions')}; expected {target.dp}, "
                        f"{target.pp * target.tp}, {dims}")
    source_shapes = change.shapes if change is not None else {
        name: shape for s in source.stages for names, shapes in zip(s.names, s.shapes)
        for name, shape in zip(names, shapes)}
    if kept and spec.names != source.stages[stage].names:
        problems.append(f"{model_path}: param_shapes lists {_clip(spec.names)}, the source stage "
                        f"{_clip(source.stages[stage].names)}")
    for names, shapes in zip(spec.names, spec.shapes):
        for name, shape in zip(names, shapes):
            if name not in source_shapes:
                problems.append(f"{model_path}: lists {name}, which no source stage holds")
            elif tuple(source_shapes[name]) != tuple(shape):
                problems.append(f"{model_path}: {name} has shape {list(shape)}, the source's "
                                f"{list(source_shapes[name])}" + (f" at tp {target.tp}" if change is not None else ""))
    if problems:
        return problems, 1, 0
    try:
        files, masters, moments = read_stage(target, stage, trust_pickle, model_rank)
    except CheckpointError as error:
        return [str(error)], 1, 0
    template = load_whole(source.optim_path(origin, 0, optim_origin), trust_pickle)
    for rank, tree in enumerate(files):
        path = target.optim_path(stage, rank, model_rank)
        others, wanted = ({k: v for k, v in tree.items() if k != OPTIM}, {k: v for k, v in template.items() if k != OPTIM})
        if not _same(_plain(wanted), _plain(others)):
            problems.append(f"{path}: {_first_difference(_plain(wanted), _plain(others))}")
        problems += _pipeline_layout_problems(path, tree[OPTIM], template[OPTIM], spec, target.dp, rank)
    elements = 0
    for group, (names, numels) in enumerate(zip(spec.names, spec.numels)):
        partition = zero12_group(range(len(numels)), numels, target.dp).partition_numel
        offset = 0
        for name, numel in zip(names, numels):
            start, offset = offset, offset + numel
            expected = source_states.get(name)
            if expected is None:
                continue  # reported above
            states = {"fp32": masters[group][start:offset],
                      **{key: flat[start:offset] for key, flat in moments[group].items()}}
            if list(states) != list(expected):
                problems.append(f"{target.optim_path(stage, 0, model_rank)}: {name} holds states {list(states)}, the source "
                                f"{list(expected)}")
                continue
            for key, value in states.items():
                elements += value.numel()
                if value.shape != expected[key].shape or not torch.equal(value, expected[key]):
                    differs = (value != expected[key]) if value.shape == expected[key].shape else \
                        torch.ones(value.numel(), dtype=torch.bool)
                    first = int(differs.nonzero()[0])
                    rank = (start + first) // partition  # the dp rank whose partition holds that element
                    problems.append(f"{target.optim_path(stage, rank, model_rank)}: {name} {key}: {int(differs.sum())} of "
                                    f"{value.numel()} elements differ from the source (first at element {first})")
    return problems, 1 + len(files), elements


def _model_axis_layer_problems(source, target, change: ModelAxisChange, trust_pickle: bool) -> tuple[list[str], int]:
    """With tp changed: the target's layer files are one per layer index and target model rank, each
    holding the source's entries, every tensor (dtype and values) the cut for its model rank of the
    join over the source's model ranks, every other entry the source model rank 0 file's."""
    import torch

    from reshard.formats.deepspeed_pipeline import layer_file_name, layer_indices, layer_tensor_name, load_whole, \
        model_axis_layer_states
    problems, checked = [], 0
    indices = layer_indices(source)
    wanted = {layer_file_name(i, m) for i in indices for m in range(target.tp)}
    if set(target.layer_files) != wanted:
        problems.append(f"{target.tag_dir}: layer files {sorted(target.layer_files)}, expected {sorted(wanted)} "
                        f"(the source's {len(indices)} layers at tp {target.tp})")
    for index in indices:
        # what the job writes for every target model rank: the same join and cut (one rule, one code)
        cuts = model_axis_layer_states(source, change.layers, change.rules, index, target.tp, range(target.tp),
                                       trust_pickle)
        for model, expected in enumerate(cuts):
            path = os.path.join(target.tag_dir, layer_file_name(index, model))
            if not os.path.isfile(path):
                continue  # reported above
            checked += 1
            found = load_whole(path, trust_pickle)
            if not isinstance(found, dict) or list(found) != list(expected):
                problems.append(f"{path}: entries {list(found) if isinstance(found, dict) else type(found).__name__}, "
                                f"the source's {list(expected)}")
                continue
            for key, value in found.items():
                want = expected[key]
                if not hasattr(want, "shape"):  # a non-tensor entry: the source model rank 0 file's
                    if not _same(_plain(value), _plain(want)):
                        problems.append(f"{path}: {key}: {_first_difference(_plain(want), _plain(value))}")
                    continue
                if not hasattr(value, "shape") or value.dtype != want.dtype or value.shape != want.shape \
                        or not torch.equal(value, want):
                    problems.append(f"{path}: {key} differs from model rank {model}'s cut of the source's "
                                    f"{layer_tensor_name(change.layers, index, key)} joined over {source.tp} "
                                    "model ranks")
    return problems, checked


def _pipeline_file_problems(source, target, change: ModelAxisChange | None = None,
                            trust_pickle: bool = False) -> tuple[list[str], int]:
    """Rank 0's share: layer and other files the source's bytes (with tp changed, the layer files
    re-cut: _model_axis_layer_problems), every parameter in some stage, an untied one in exactly
    one, and stages holding ascending layer ranges."""
    from reshard.files.byte_io import hash_file
    from reshard.jobs.manifest import MANIFEST_NAME
    problems, checked = [], 0
    if change is not None:
        problems, checked = _model_axis_layer_problems(source, target, change, trust_pickle)
    elif set(target.layer_files) != set(source.layer_files):
        problems.append(f"{target.tag_dir}: layer files {sorted(target.layer_files)}, the source's "
                        f"{sorted(source.layer_files)}")
    extra = sorted(set(target.other_files) - set(source.other_files) - {MANIFEST_NAME})
    if extra:
        problems.append(f"{target.tag_dir}: holds {extra}, which the source does not")
    for name in sorted((set() if change is not None else set(source.layer_files)) | set(source.other_files)):
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


def verify_pipeline_against(destination: str, source_dir: str, tag: str, transport: Transport,
                            trust_pickle: bool = False) -> VerifyResult:
    """verify --against for a pipeline output at another tp (the one case the plan does not take yet,
    issue 37): target (stage, model rank) unit u = stage * tp + model checked by worker u % W
    (reshard.jobs.pipeline_job.stage_files_written_by, as the job builds them), the layer files and the
    parameter cover by worker 0; each worker joins every source tensor over the model ranks once and
    compares its units with their cuts (ModelAxisChange)."""
    from reshard.formats.deepspeed_pipeline import cut_model_axis_states, model_axis_states
    from reshard.jobs.pipeline_job import stage_files_written_by

    def inspect_both():
        # the output's layer files are judged below against the source's re-cut, so that a damaged one
        # is reported as a difference rather than refused as unreadable input
        source, target = _inspect_pipelines(source_dir, destination, tag, trust_pickle)
        if target.bf16 != source.bf16:
            raise CheckpointError(target.tag_dir, f"is not a reshard of {source.tag_dir}: bf16 prefix differs")
        return source, target, _model_axis_change(source, target, trust_pickle)
    source, target, change = on_rank0(transport, inspect_both)
    result = VerifyResult(destination, tag, "against source")
    problems, files, elements = [], 0, 0
    if transport.rank == 0:
        problems, files = save_dir_files.differences(source.save_dir, target.save_dir)
        more, checked = _pipeline_file_problems(source, target, change, trust_pickle)
        problems, files = problems + more, files + checked
    joined = None
    for stage, model in stage_files_written_by(target.pp, target.tp, transport.size)[transport.rank]:
        if joined is None:  # every source tensor joined whole over the model ranks once, as the job
            joined = model_axis_states(source, change.rules, trust_pickle)[1]
        names = [name for group in target.stages[stage].names for name in group if name in joined]
        source_states = cut_model_axis_states(joined, change.rules, names, target.tp, model)
        more, checked, compared = _pipeline_stage_problems(source, target, stage, source_states, trust_pickle, model,
                                                           change)
        problems, files, elements = problems + more, files + checked, elements + compared
    reports = transport.all_gather_object((problems, elements, files))
    result.problems = [p for found, _, _ in reports for p in found]
    result.checked_elements = sum(n for _, n, _ in reports)
    result.checked_files = sum(f for _, _, f in reports)
    return result
