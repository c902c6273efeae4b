"""Check a reshard output: by its manifest hashes, or element by element against the source.

    python -m reshard verify DST                    # re-hash every file listed in the manifest
    torchrun --nproc_per_node=4 -m reshard verify DST --against SRC   # logical check, distributed

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
    tag = resolve_tag(destination, tag)
    tag_dir = os.path.join(destination, tag)
    manifest = Manifest.read(tag_dir)
    result = VerifyResult(destination, tag, "by manifest hashes", checked_files=len(manifest.files))
    result.problems = manifest.check_files(tag_dir)
    return result


class _Comparer:
    """Stands where the job's TargetWriter would: compares each arriving slice with DST's bytes."""

    def __init__(self, locations: dict):
        self.locations = locations
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
            self.problems.append(f"{path}: {slot[2]} of flat buffer {slot[1]}: {differing} of {count} elements from "
                                 f"element {element} differ from the source (first at element {element + first})")

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
    own_transport = transport is None
    transport = transport or transport_from_environment()
    try:
        def inspect_both():
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
        def open_comparer() -> _Comparer:
            locations = {}
            for rank in own.target_ranks_of(transport.rank):
                for slot, found in source_rank_tensors(target, rank, trust_pickle=trust_pickle).items():
                    locations[(rank, slot)] = found
                problems, files = _compare_unpartitioned(source, target.tag_dir, target.spec.topology, rank,
                                                         trust_pickle)
                result.problems += problems
                result.checked_files += files
            return _Comparer(locations)

        def gather(reader, comparer, finished) -> None:
            reports = transport.all_gather_object((result.problems + comparer.problems, comparer.elements,
                                                   result.checked_files))
            result.problems = [p for problems, _, _ in reports for p in problems]
            result.checked_elements = sum(n for _, n, _ in reports)
            result.checked_files = sum(f for _, _, f in reports)

        execute(plan, transport,
                open_source=lambda: SourceReader.open(source, own.source_ranks_of(transport.rank),
                                                      trust_pickle=trust_pickle),
                open_sink=open_comparer, opening="opening files", after=gather)
        return result
    finally:
        if own_transport:
            transport.close()


def _check_same_model(source: SourceCheckpoint, target: SourceCheckpoint) -> None:
    a, b = source.spec, target.spec
    for name in ("stage", "optimizer", "bf16_prefix", "params", "groups", "round_robin", "param_alignment",
                 "lp_dtype", "streams", "frozen"):
        if getattr(a, name) != getattr(b, name):
            raise CheckpointError(target.tag_dir, f"is not a reshard of {source.tag_dir}: {name} differs "
                                                  f"({_clip(getattr(a, name))} vs {_clip(getattr(b, name))})")
