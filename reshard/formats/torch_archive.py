"""torch.save files without reading or holding their tensors: structure, byte offsets, skeletons.

    from reshard.formats.torch_archive import load_portable, write_tree_skeleton
    tree = load_portable("zero_pp_rank_0_mp_rank_00_optim_states.pt", safe_globals)  # TensorRefs
    offsets = write_tree_skeleton("out.pt", target_tree)   # structure, no data: {role: byte offset}

Without torch first: `load_portable`, `write_tree_skeleton` and `locate_tree_storages` read and
write with reshard.formats.torch_pickle / torch_zip (no `import torch`, the same trees and
the same bytes as below, see torch_pickle for the subset), and fall back to torch for content
outside that subset (torch_classes.NeedsTorch) and --trust-pickle, and for writing when the
installed torch is not one the writer's bytes are pinned for (`writer_not_pinned`). Files that
torch.save would not write (damaged, crafted) are refused by name on either way
(torch_pickle.open_archive), never read one way by reshard and another by torch.

With torch (`load_structure`, `portable`, `materialize`, `write_skeleton`, `locate_storages`):
`torch.load(map_location="meta")` reads only the pickle; every storage then carries
`_checkpoint_offset`, the byte offset of its data in the file, and slices are read with
`os.pread` at offsets the plan names. Unlike an mmap, pread leaves nothing mapped in the
process, so resident memory stays at what the plan holds.

Writing (torch >= 2.6): the target object is built with `torch.empty` storages (never touched,
so never resident) and saved under `torch.serialization.skip_data()`, which writes the whole
structure and reserves each storage's bytes (they read back as zeros). Reloading that
skeleton with `map_location="meta"` gives each storage's offset; the data then goes there
with `os.pwrite` / `os.copy_file_range` as it arrives. The result is a normal torch file.

Tensors are found the way torch.save finds them: by pickling the object with a
`persistent_id` hook. That reaches tensors anywhere, inside custom classes included, and
visits them in the same order for any two objects of the same shape.
"""
from __future__ import annotations

import io
import os
import pickle
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable

from reshard.errors import CheckpointError
from reshard.formats.torch_classes import ITEMSIZE, NeedsTorch

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class TensorRef:
    """A tensor of a source file, by where its bytes are: storage key = byte offset in the file."""

    storage_key: int
    storage_nbytes: int
    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int
    requires_grad: bool

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def itemsize(self) -> int:
        size = ITEMSIZE.get(self.dtype)
        return dtype_of(self.dtype).itemsize if size is None else size

    @property
    def is_contiguous(self) -> bool:
        expected, stride = [], 1
        for size in reversed(self.shape):
            expected.append(stride)
            stride *= size
        return all(s == e for s, e, size in zip(self.stride, reversed(expected), self.shape) if size > 1)

    @property
    def byte_offset(self) -> int:
        """Offset of element 0 of this (contiguous) tensor in the file."""
        return self.storage_key + self.storage_offset * self.itemsize


@dataclass(frozen=True)
class NewTensor:
    """A tensor the writer creates: a 1-D buffer of `numel` elements (or of `shape`), filled by the exchange."""

    slot: tuple
    """What fills it, e.g. ("optim", buffer, stream); the writer maps slots to file offsets."""
    numel: int
    dtype: str
    requires_grad: bool = False
    shape: tuple[int, ...] | None = None
    """Its shape when it is not a flat buffer (module weights under tensor parallelism, or written
    whole by a ZeRO stage change)."""


def dtype_of(name: str) -> "torch.dtype":
    import torch

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"not a torch dtype: {name}")
    return dtype


def dtype_name(dtype: "torch.dtype") -> str:
    return str(dtype).removeprefix("torch.")


def load_structure(path: str | os.PathLike, safe_globals: Iterable = (), trust_pickle: bool = False) -> Any:
    """Unpickle a torch file onto the meta device: structure and offsets, no tensor data.

    Loads with weights_only=True and the given allowlist unless `trust_pickle`; anything else
    is refused with a message naming the class and the file. The archive is checked first,
    without torch, as torch_pickle reads it (torch_pickle.open_archive: compressed, duplicate or
    overlapping records, sizes beyond the file, big-endian storages, which crash torch here), and
    the tree after: no deeper than torch_pickle.MAX_TREE_DEPTH, no "billion laughs", and every
    storage where a record of its size really is (a meta load computes offsets, not reads them).
    """
    from reshard.formats import torch_pickle

    path = os.fspath(path)
    with torch_pickle.open_archive(path) as archive:
        limit = torch_pickle.tree_limit(archive.size("data.pkl"))
        records = {(record.data_offset, record.file_size) for name, record in archive.infos.items()
                   if name.startswith("data/")}
    import torch
    try:
        if trust_pickle:
            obj = torch.load(path, map_location="meta", weights_only=False)
        else:
            # torch's allowlist is process-wide: counted and scoped, so threads loading at once keep
            # it, and the process finds it as it was afterwards (torch_allowlist)
            from reshard.formats.torch_allowlist import allowed_globals
            with allowed_globals(safe_globals):
                obj = torch.load(path, map_location="meta", weights_only=True)
    except pickle.UnpicklingError as error:
        message = str(error)
        if "Unsupported global" in message or "weights_only" in message:
            unsafe = _unsafe_globals(path)
            raise CheckpointError(path, f"holds pickled classes outside reshard's allowlist ({', '.join(unsafe) or message.splitlines()[0]}); "
                                        "loading it would run code from the checkpoint. If you trust this file, pass --trust-pickle") from None
        raise CheckpointError(path, f"is not a readable torch checkpoint ({message.splitlines()[0]})") from None
    except Exception as error:  # torch raises many kinds for damaged archives
        first = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise CheckpointError(path, f"is not a complete torch archive (truncated or corrupt?): {first}") from None
    torch_pickle.check_tree(obj, path, limit, _is_tensor, from_torch=True)
    for tensor in leaves_in_order(obj):
        storage = tensor.untyped_storage()
        offset = getattr(storage, "_checkpoint_offset", None)
        if offset is None or storage.nbytes() == 0:
            continue
        if (int(offset), storage.nbytes()) not in records:
            raise CheckpointError(path, f"holds a view past its storage, or records out of torch.save's order: a meta "
                                        f"load places a storage of {storage.nbytes()} bytes at byte {int(offset)}, "
                                        "where the file has no record of that size")
        problem = torch_pickle.view_problem(storage.nbytes(), tensor.element_size(), tensor.storage_offset(),
                                            tuple(tensor.shape), tuple(tensor.stride()))
        if problem:
            raise CheckpointError(path, f"holds {problem}")
    return obj


def check_archive(path: str | os.PathLike) -> None:
    """Refuse (CheckpointError) a file that torch.save would not write and torch would read
    otherwise than reshard (torch_pickle.open_archive), before a caller hands it to torch.load
    itself: an mmap load reads compressed records as raw bytes, and a meta load of a big-endian
    file crashes."""
    from reshard.formats import torch_pickle
    torch_pickle.open_archive(path).close()


def _unsafe_globals(path: str) -> list[str]:
    import torch

    try:
        from reshard.formats.deepspeed_schema import safe_global_names
        return [g for g in torch.serialization.get_unsafe_globals_in_checkpoint(path) if g not in safe_global_names()]
    except Exception:  # the message is best effort; the refusal stands regardless
        return []


class _LeafFinder(pickle.Pickler):
    """Pickles `obj` into `file`, noting every object `is_leaf` accepts, in torch.save's order."""

    def __init__(self, file, is_leaf: Callable[[Any], bool]):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.is_leaf = is_leaf
        self.found: list = []

    def persistent_id(self, obj):
        if self.is_leaf(obj):
            self.found.append(obj)
            return len(self.found) - 1
        return None


class _Replacer(pickle.Unpickler):
    def __init__(self, data: bytes, replacements: list):
        super().__init__(io.BytesIO(data))
        self.replacements = replacements

    def persistent_load(self, pid):
        return self.replacements[pid]


def _is_tensor(obj) -> bool:
    torch = sys.modules.get("torch")  # no tensor exists before torch is imported
    return torch is not None and isinstance(obj, torch.Tensor)


def leaves_in_order(obj: Any, is_leaf: Callable[[Any], bool] = _is_tensor) -> list:
    """Every leaf (by default every tensor) of `obj`, in the order torch.save meets them."""
    finder = _LeafFinder(io.BytesIO(), is_leaf)
    finder.dump(obj)
    return finder.found


def map_leaves(obj: Any, fn: Callable[[Any], Any], is_leaf: Callable[[Any], bool] = _is_tensor) -> Any:
    """A copy of `obj` with every leaf replaced by fn(leaf); a leaf met twice maps to one object.

    Only for objects reshard itself holds (already safely loaded): the copy is made by
    pickling and unpickling them in memory.
    """
    out = io.BytesIO()
    pickler = _LeafFinder(out, is_leaf)
    pickler.dump(obj)
    memo: dict[int, Any] = {}
    replacements = []
    for leaf in pickler.found:
        if id(leaf) not in memo:
            memo[id(leaf)] = fn(leaf)
        replacements.append(memo[id(leaf)])
    return _Replacer(out.getvalue(), replacements).load()


def tensor_ref(tensor: "torch.Tensor") -> TensorRef:
    """Where a meta-loaded tensor's bytes are in its file."""
    storage = tensor.untyped_storage()
    key = getattr(storage, "_checkpoint_offset", None)
    if key is None:
        raise ValueError("tensor was not loaded with map_location='meta' from a file")
    return TensorRef(int(key), storage.nbytes(), dtype_name(tensor.dtype), tuple(tensor.shape),
                     tuple(tensor.stride()), tensor.storage_offset(), bool(tensor.requires_grad))


def portable(meta_obj: Any) -> Any:
    """`meta_obj` with every tensor replaced by its TensorRef: plain data, picklable, comparable."""
    return map_leaves(meta_obj, tensor_ref)


def is_ref(obj) -> bool:
    return isinstance(obj, (TensorRef, NewTensor))


def refs_in(tree: Any) -> list:
    return leaves_in_order(tree, is_ref)


def materialize(tree: Any) -> tuple[Any, dict]:
    """Turn a tree of TensorRef/NewTensor into real CPU tensors with untouched storages.

    Tensors that shared a storage in the source share one here, and NewTensors of one slot (a
    tied alias) are one tensor. Returns the object and
    {storage identity: TensorRef storage key (int) or NewTensor slot (tuple)}.
    """
    import torch

    storages: dict[int, torch.UntypedStorage] = {}
    roles: dict[int, Any] = {}
    made: dict[tuple, torch.Tensor] = {}

    def build(ref):
        if isinstance(ref, NewTensor):
            if ref.slot in made:
                return made[ref.slot]
            tensor = made[ref.slot] = torch.empty(ref.numel if ref.shape is None else ref.shape,
                                                 dtype=dtype_of(ref.dtype))
            roles[_identity(tensor)] = ref.slot
        else:
            storage = storages.get(ref.storage_key)
            if storage is None:
                storage = storages[ref.storage_key] = torch.UntypedStorage(ref.storage_nbytes)
            tensor = torch.empty(0, dtype=dtype_of(ref.dtype)).set_(storage, ref.storage_offset, ref.shape, ref.stride)
            roles[_identity(tensor)] = ref.storage_key
        if ref.requires_grad:
            tensor.requires_grad_(True)
        return tensor

    return map_leaves(tree, build, is_ref), roles


def _identity(tensor: "torch.Tensor") -> int:
    return tensor.untyped_storage()._cdata


def write_skeleton(path: str, obj: Any, roles: dict, pickle_module=None, safe_globals: Iterable = ()) -> dict:
    """torch.save `obj` without tensor data; return {role: byte offset of its storage in `path`}.

    `pickle_module` (default: pickle) pickles the structure, `safe_globals` reloads it (see
    `locate_storages`).
    """
    import torch
    from torch.serialization import skip_data

    with skip_data():
        torch.save(obj, path, **({"pickle_module": pickle_module} if pickle_module is not None else {}))
    return locate_storages(path, obj, roles, safe_globals)


def locate_storages(path: str, obj: Any, roles: dict, safe_globals: Iterable = ()) -> dict:
    """{role: byte offset} of `obj`'s storages in `path`, a file saved from an object of the same shape.

    The file (reshard's own) is reloaded with the `safe_globals` allowlist; one holding other
    classes (carried from a source loaded with trust_pickle) is reloaded trusting its pickle.
    Raises CheckpointError when the file does not have that shape (e.g. a damaged skeleton).
    """
    try:
        reloaded = load_structure(path, safe_globals)
    except CheckpointError as error:
        if "allowlist" not in str(error):
            raise
        reloaded = load_structure(path, trust_pickle=True)
    mine, theirs = leaves_in_order(obj), leaves_in_order(reloaded)
    if len(mine) != len(theirs) or any(a.shape != b.shape or a.dtype != b.dtype for a, b in zip(mine, theirs)):
        raise CheckpointError(path, "does not have the structure reshard wrote for it (changed since?)")
    offsets = {}
    for a, b in zip(mine, theirs):
        role = roles.get(_identity(a))
        if role is None or a.untyped_storage().nbytes() == 0:
            continue
        offset = int(b.untyped_storage()._checkpoint_offset)
        if offsets.setdefault(role, offset) != offset:
            raise AssertionError(f"{path}: one source storage was saved twice")
    return offsets


# -- without torch where the content allows (torch_pickle), with torch otherwise ---------------

torch_fallbacks: list[tuple[str, str]] = []
"""(path, why) of every file this process read or wrote with torch after trying without it."""

PINNED_WRITER_VERSIONS = ("2.11.0", "2.13.", "2.14.1")
"""torch versions whose torch.save bytes the torch-free writer is pinned to by tests
(tests/test_torch_free_archive.py byte-identity on 2.13; DESIGN §8: 2.14.1 writes the same bytes)."""


def _fell_back(path, why: BaseException | str) -> None:
    text = why if isinstance(why, str) else f"{type(why).__name__}: {why}"
    torch_fallbacks.append((os.fspath(path), text[:200]))


def installed_torch_version() -> str | None:
    """The installed torch's version, from its metadata (importing torch takes seconds)."""
    import importlib.metadata
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None


def writer_not_pinned() -> str | None:
    """Why the torch-free writer must not write for the installed torch, or None when it may:
    its bytes mirror torch 2.13's, checked by tests for PINNED_WRITER_VERSIONS only. Without
    torch installed there is no other writer, and 2.13's files load in every torch since."""
    version = installed_torch_version()
    if version is None:
        return None
    release = version.split("+")[0]
    if release in ("2.11.0", "2.14.1") or release.startswith("2.13."):
        return None
    return (f"torch {version} is installed; the torch-free writer's bytes are pinned for torch 2.11.0, 2.13.x and "
            "2.14.1 only, so torch writes this file")


def load_portable(path: str | os.PathLike, safe_globals: Iterable = (), trust_pickle: bool = False) -> Any:
    """`portable(load_structure(path, safe_globals, trust_pickle))`, read without importing torch
    when the file is within torch_pickle's subset (every DeepSpeed file reshard knows is).

    A file that torch.save would not write is refused (CheckpointError) either way. torch reads
    the rest of what the subset leaves out (torch_classes.NeedsTorch), and every file under
    `trust_pickle` (real DeepSpeed classes, not stand-ins, as torch gives them)."""
    if not trust_pickle:
        from reshard.formats import torch_pickle
        try:
            return torch_pickle.read_portable(path, torch_pickle.deepspeed_globals(safe_globals))
        except NeedsTorch as error:
            _fell_back(path, error)
    else:
        _fell_back(path, "--trust-pickle: torch.load reads it, with DeepSpeed's own classes")
    return portable(load_structure(path, safe_globals, trust_pickle))


def write_tree_skeleton(path: str, tree: Any, safe_globals: Iterable = ()) -> dict:
    """`write_skeleton(path, *materialize(tree), deepspeed_classes, safe_globals)`: the same bytes
    and offsets, written without torch unless the tree needs it (torch_pickle.NeedsTorch) or the
    installed torch is not one the writer's bytes are pinned for (`writer_not_pinned`)."""
    from reshard.formats import deepspeed_classes, torch_pickle
    unpinned = writer_not_pinned()
    if unpinned is None:
        try:
            return torch_pickle.write_skeleton_tree(path, tree)
        except NeedsTorch as error:
            _fell_back(path, error)
    else:
        _fell_back(path, unpinned)
    obj, roles = materialize(tree)
    return write_skeleton(path, obj, roles, deepspeed_classes, safe_globals)


def locate_tree_storages(path: str, tree: Any, safe_globals: Iterable = ()) -> dict:
    """`locate_storages(path, *materialize(tree), safe_globals)` without torch where the file allows."""
    from reshard.formats import torch_pickle
    try:
        return torch_pickle.storage_offsets_of(path, tree, torch_pickle.deepspeed_globals(safe_globals))
    except ValueError:
        raise CheckpointError(path, "does not have the structure reshard wrote for it (changed since?)") from None
    except NeedsTorch as error:
        _fell_back(path, error)
    obj, roles = materialize(tree)
    return locate_storages(path, obj, roles, safe_globals)
