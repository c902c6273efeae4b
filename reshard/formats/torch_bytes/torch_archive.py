"""torch.save files without reading or holding their tensors: structure, byte offsets, skeletons.

    from reshard.formats.torch_bytes.torch_archive import load_portable, write_tree_skeleton
    tree = load_portable("zero_pp_rank_0_mp_rank_00_optim_states.pt", safe_globals)  # TensorRefs
    offsets = write_tree_skeleton("out.pt", target_tree)   # structure, no data: {role: byte offset}

Without torch first: `load_portable`, `write_tree_skeleton` and `locate_tree_storages` read and
write with reshard.formats.torch_bytes.torch_pickle / torch_zip (no `import torch`, the same trees and
the same bytes as below, see torch_pickle for the subset), and fall back to torch for content
outside that subset (torch_classes.NeedsTorch) and --trust-pickle, and for writing when the
installed torch is not one the writer's bytes are pinned for (`pinned_writer_layout`). Files that
torch.save would not write (damaged, crafted) are refused by name on either way
(torch_pickle.open_archive), never read one way by reshard and another by torch.

With torch (`load_structure`, `portable`, `materialize`, `write_skeleton`, `locate_storages`):
`torch.load(map_location="meta")` reads only the pickle; every storage then carries
`_checkpoint_offset`, the byte offset of its data in the file, and slices are read with
`os.pread` at offsets the plan names. Unlike an mmap, pread leaves nothing mapped in the
process, so resident memory stays at what the plan holds.

Writing (torch >= 2.5, torch_release): the target object is built with `torch.empty` storages (never touched,
so never resident) and saved under `torch.serialization.skip_data()`, which writes the whole
structure and reserves each storage's bytes (they read back as zeros). Reloading that
skeleton without torch (torch_pickle.storage_offsets_of; with `map_location="meta"` where it
holds what only torch reads) gives each storage's offset; the data then goes there
with `os.pwrite` / `os.copy_file_range` as it arrives. The result is a normal torch file.

Tensors are found the way torch.save finds them: by pickling the object with a
`persistent_id` hook. That reaches tensors anywhere, inside custom classes included, and
visits them in the same order for any two objects of the same shape.
"""
from __future__ import annotations

import os
import pickle
from typing import TYPE_CHECKING, Any, Iterable

from reshard.errors import CheckpointError, UnsupportedTorch
from reshard.formats.torch_bytes import torch_pickle
from reshard.formats.torch_bytes.torch_classes import (
    NeedsTorch,
    globals_by_name,
    stand_in_pickle_module,
)
from reshard.formats.torch_bytes.torch_release import installed_version, require

# The portable tree's types and walks live in torch_tree (torch_pickle uses them too); they are
# re-exported here, where the callers above the torch-byte layer have always found them.
from reshard.formats.torch_bytes.torch_tree import (  # noqa: F401
    NewTensor,
    TensorRef,
    dtype_name,
    dtype_of,
    is_ref,
    is_tensor,
    leaves_in_order,
    map_leaves,
    refs_in,
)

if TYPE_CHECKING:
    import torch


def load_structure(path: str | os.PathLike, safe_globals: Iterable = (), trust_pickle: bool = False) -> Any:
    """Unpickle a torch file onto the meta device: structure and offsets, no tensor data.

    Loads with weights_only=True and the given allowlist unless `trust_pickle`; anything else
    is refused with a message naming the class and the file. The archive is checked first,
    without torch, as torch_pickle reads it (torch_pickle.open_archive: compressed, duplicate or
    overlapping records, sizes beyond the file, big-endian storages, which crash torch here), and
    the tree after: no deeper than torch_pickle.MAX_TREE_DEPTH, no "billion laughs", every view
    inside its storage with no overlapping elements, and every storage at the offset of ITS OWN
    record (the one its key names, as a plain torch.load reads it) and of that record's size: a
    meta load computes offsets from the order storages appear in (serialization.py `_get_offset`),
    not from their keys, so a memory-mapped load of the same file, which slices the mapping at each
    key's record, must put every storage at the same offset (`_same_storages`).
    """
    obj, records = _meta_load(path, safe_globals, trust_pickle)
    _same_storages(os.fspath(path), obj, _torch_load(path, safe_globals, trust_pickle, mmap=True), records)
    return obj


def _meta_load(path, safe_globals: Iterable, trust_pickle: bool) -> tuple[Any, dict[int, int]]:
    """The meta load and its checks but the key one (load_structure), and {data offset: size} of
    the file's storage records."""
    path = os.fspath(path)
    with torch_pickle.open_archive(path) as archive:
        limit = torch_pickle.tree_limit(archive.size("data.pkl"))
        records = {record.data_offset: record.file_size for name, record in archive.infos.items()
                   if name.startswith("data/")}
    import torch
    obj = _torch_load(path, safe_globals, trust_pickle, map_location="meta")
    torch_pickle.check_tree(obj, path, limit, is_tensor, from_torch=True)
    for tensor in _tensors_of(path, obj):
        storage = tensor.untyped_storage()
        offset = getattr(storage, "_checkpoint_offset", None)
        if storage.nbytes() == 0:
            continue
        if offset is None:  # torch 2.5.1's meta load sets none (torch_release)
            raise CheckpointError(path, f"needs torch to be read, and torch {torch.__version__}'s meta load gives no "
                                        "storage offsets (`_checkpoint_offset`, set by torch 2.13)")
        if records.get(int(offset)) != storage.nbytes():
            raise CheckpointError(path, f"holds a view past its storage, or records out of torch.save's order: a meta "
                                        f"load places a storage of {storage.nbytes()} bytes at byte {int(offset)}, "
                                        "where the file has no record of that size")
        problem = torch_pickle.view_problem(storage.nbytes(), tensor.element_size(), tensor.storage_offset(),
                                            tuple(tensor.shape), tuple(tensor.stride()))
        if problem:
            raise CheckpointError(path, f"holds {problem}")
    return obj, records


def _tensors_of(path: str, obj: Any) -> list:
    """leaves_in_order(obj), refused by name when the tree holds what cannot be walked so (a bare
    storage as a value, which torch gives as an object of its own; an object that will not pickle)."""
    try:
        return leaves_in_order(obj)
    except Exception as error:  # noqa: BLE001 (whatever the object raises: the file is refused)
        raise CheckpointError(path, f"holds a value reshard does not read ({type(error).__name__}: "
                                    f"{str(error).splitlines()[0] if str(error) else ''})") from None


def _torch_load(path, safe_globals: Iterable, trust_pickle: bool, map_location="cpu", mmap: bool = False) -> Any:
    """torch.load, weights_only with `safe_globals` allowed for this load alone unless `trust_pickle`,
    its failures refused as CheckpointErrors naming the file."""
    import torch
    path = os.fspath(path)
    try:
        if trust_pickle:
            return torch.load(path, map_location=map_location, mmap=mmap, weights_only=False)
        # torch's allowlist is process-wide: counted and scoped, so threads loading at once keep
        # it, and the process finds it as it was afterwards (torch_allowlist)
        from reshard.formats.torch_bytes.torch_allowlist import allowed_globals
        with allowed_globals(safe_globals):
            return torch.load(path, map_location=map_location, mmap=mmap, weights_only=True)
    except UnsupportedTorch as error:
        raise CheckpointError(path, f"needs torch to be read, and {error}") from None
    except pickle.UnpicklingError as error:
        message = str(error)
        if "Unsupported global" in message or "weights_only" in message:
            unsafe = _unsafe_globals(path, safe_globals)
            raise CheckpointError(path, f"holds pickled classes outside reshard's allowlist ({', '.join(unsafe) or message.splitlines()[0]}); "
                                        "loading it would run code from the checkpoint. If you trust this file, pass --trust-pickle") from None
        raise CheckpointError(path, f"is not a readable torch checkpoint ({message.splitlines()[0]})") from None
    except Exception as error:  # torch raises many kinds for damaged archives
        first = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise CheckpointError(path, f"is not a complete torch archive (truncated or corrupt?): {first}") from None


def _same_storages(path: str, meta: Any, mapped: Any, records: dict[int, int]) -> None:
    """Refuse a file whose meta load (`meta`, offsets by order) and memory-mapped load (`mapped`,
    of the same file: each storage sliced from one mapping at its key's record, for as many bytes
    as the pickle claims, unchecked in torch 2.13's serialization.py `load_tensor`) disagree on
    where a storage is: storage keys swapped or pointed at a record of another size (found by
    tests/reader_fuzz.py's op_key mutants). A plain torch.load refuses the size mismatches ("record
    size ... does not match expected size") and reads swapped keys by key, as the mapping does."""
    ours, theirs = _tensors_of(path, meta), _tensors_of(path, mapped)
    base = None
    for a, b in zip(ours, theirs, strict=False):
        nbytes = a.untyped_storage().nbytes()
        if b.untyped_storage().nbytes() != nbytes:
            break
        if nbytes == 0:
            continue
        offset, pointer = int(a.untyped_storage()._checkpoint_offset), b.untyped_storage().data_ptr()
        base = pointer - offset if base is None else base
        if pointer - base != offset or records.get(offset) != nbytes:
            break
    else:
        if len(ours) == len(theirs):
            return
    raise CheckpointError(path, "holds storage keys that do not name records of their storages' sizes in torch.save's "
                                "order (keys swapped, or pointed at another record): torch reads such a file by key, or "
                                "refuses it")


def check_archive(path: str | os.PathLike) -> None:
    """Refuse (CheckpointError) a file that torch.save would not write and torch would read
    otherwise than reshard (torch_pickle.open_archive), before a caller hands it to torch.load
    itself: an mmap load reads compressed records as raw bytes, and a meta load of a big-endian
    file crashes."""
    torch_pickle.open_archive(path).close()


def load_checked(path: str | os.PathLike, safe_globals: Iterable = (), trust_pickle: bool = False,
                 mmap: bool = True) -> Any:
    """torch.load of a whole file (tensors memory-mapped by default, on the CPU), only after every
    check `load_structure` makes (check_archive first: a mapped load takes a deflated record's raw
    bytes as tensor data; the tree's size and depth; every view inside its storage with no
    overlapping elements, whose element count a file would not bound; every storage at its own
    record, of that record's size, which a mapped load does not check), with `safe_globals`
    allowed for this load alone (weights_only unless `trust_pickle`). The one way reshard hands a
    file to torch.load for its data (tests/test_layering.py refuses any other call outside the
    torch-byte modules). Refusals are CheckpointErrors naming the file."""
    path = os.fspath(path)
    meta, records = _meta_load(path, safe_globals, trust_pickle)
    mapped = _torch_load(path, safe_globals, trust_pickle, mmap=True)
    _same_storages(path, meta, mapped, records)
    for tensor in _tensors_of(path, mapped):  # the views again, as the data load built them
        storage = tensor.untyped_storage()
        problem = torch_pickle.view_problem(storage.nbytes(), tensor.element_size(), tensor.storage_offset(),
                                            tuple(tensor.shape), tuple(tensor.stride()))
        if problem:
            raise CheckpointError(path, f"holds {problem}")
    return mapped if mmap else _torch_load(path, safe_globals, trust_pickle)


def _unsafe_globals(path: str, safe_globals: Iterable) -> list[str]:
    """The pickled globals of `path` that neither torch nor the caller's allowlist allows."""
    import torch

    try:
        allowed = set(globals_by_name(safe_globals))
        return [g for g in torch.serialization.get_unsafe_globals_in_checkpoint(path) if g not in allowed]
    except Exception:  # the message is best effort; the refusal stands regardless
        return []


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
    _save_skeleton(path, obj, pickle_module)
    return locate_storages(path, obj, roles, safe_globals)


def _save_skeleton(path: str, obj: Any, pickle_module=None) -> None:
    """torch.save `obj` under skip_data: the structure, each storage's bytes reserved."""
    require("skip_data")
    import torch
    from torch.serialization import skip_data

    with skip_data():
        torch.save(obj, path, **({"pickle_module": pickle_module} if pickle_module is not None else {}))


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

PINNED_WRITER_LAYOUTS = {
    "2.4.1": torch_pickle.TORCH_2_4_LAYOUT,
    "2.5.1": torch_pickle.TORCH_2_4_LAYOUT,
    "2.11.0": torch_pickle.TORCH_2_11_LAYOUT,
    "2.13.": torch_pickle.TORCH_2_11_LAYOUT,
    "2.14.1": torch_pickle.TORCH_2_11_LAYOUT,
}
"""torch release -> the torch.save record layout the torch-free writer mirrors for it, for the
releases a test has compared its bytes with; an entry ending in "." is a prefix (every 2.13
patch), any other an exact release. 2.13: tests/test_torch_free_archive.py against the installed
torch; 2.14.1: DESIGN section 8; 2.11.0: on a GPU host (docs/versions.md); 2.4.1 and 2.5.1:
files those releases wrote, kept in tests/data/torch_saves and compared byte for byte in
tests/test_torch_save_layouts.py (made by bench/torch_save_layouts.py under each release)."""


def _fell_back(path, why: BaseException | str) -> None:
    text = why if isinstance(why, str) else f"{type(why).__name__}: {why}"
    torch_fallbacks.append((os.fspath(path), text[:200]))


installed_torch_version = installed_version  # where callers have found it


def pinned_writer_layout(version: str | None = None) -> tuple[torch_pickle.SaveLayout | None, str | None]:
    """(layout, None) when the torch-free writer may write for torch `version` (default: the
    installed one), in that release's record layout; (None, why not) when torch must write. Without
    torch installed there is no other writer, and the 2.11-2.14 layout loads in every torch since 2.4."""
    version = version or installed_torch_version()
    if version is None:
        return torch_pickle.TORCH_2_11_LAYOUT, None
    release = version.split("+")[0]
    for pinned, layout in PINNED_WRITER_LAYOUTS.items():
        if release.startswith(pinned) if pinned.endswith(".") else release == pinned:
            return layout, None
    return None, (f"torch {version} is installed; the torch-free writer's bytes are pinned for torch "
                  f"{', '.join(p + 'x' if p.endswith('.') else p for p in PINNED_WRITER_LAYOUTS)} only, "
                  "so torch writes this file")


def load_portable(path: str | os.PathLike, safe_globals: Iterable = (), trust_pickle: bool = False) -> Any:
    """`portable(load_structure(path, safe_globals, trust_pickle))`, read without importing torch
    when the file is within torch_pickle's subset (every DeepSpeed file reshard knows is).

    A file that torch.save would not write is refused (CheckpointError) either way. torch reads
    the rest of what the subset leaves out (torch_classes.NeedsTorch), and every file under
    `trust_pickle` (real DeepSpeed classes, not stand-ins, as torch gives them)."""
    if not trust_pickle:
        try:
            return torch_pickle.read_portable(path, globals_by_name(safe_globals))
        except NeedsTorch as error:
            _fell_back(path, error)
    else:
        _fell_back(path, "--trust-pickle: torch.load reads it, with DeepSpeed's own classes")
    return portable(load_structure(path, safe_globals, trust_pickle))


def write_tree_skeleton(path: str, tree: Any, safe_globals: Iterable = ()) -> dict:
    """`write_skeleton(path, *materialize(tree), stand_in_pickle_module(safe_globals), safe_globals)`:
    the same bytes and offsets, written without torch unless the tree needs it
    (torch_pickle.NeedsTorch) or the installed torch is not one the writer's bytes are pinned for
    (`pinned_writer_layout`). `safe_globals` names the tree's stand-ins (for DeepSpeed's files,
    deepspeed_classes.safe_globals()): both ways write them under those names."""
    layout, unpinned = pinned_writer_layout()
    if unpinned is None:
        try:
            return torch_pickle.write_skeleton_tree(path, tree, globals_by_name(safe_globals), layout)
        except NeedsTorch as error:
            _fell_back(path, error)
    else:
        _fell_back(path, unpinned)
    obj, roles = materialize(tree)
    _save_skeleton(path, obj, stand_in_pickle_module(safe_globals))
    # torch wrote it; the offsets are read without torch where the tree allows, so a torch whose
    # meta load gives no offsets or takes no named allowlist (2.5, torch_release) writes here too
    try:
        return torch_pickle.storage_offsets_of(path, tree, globals_by_name(safe_globals))
    except ValueError:
        raise CheckpointError(path, "does not have the structure reshard wrote for it (changed since?)") from None
    except NeedsTorch:
        pass  # the tree's own NeedsTorch is already recorded for this path
    return locate_storages(path, obj, roles, safe_globals)


def locate_tree_storages(path: str, tree: Any, safe_globals: Iterable = ()) -> dict:
    """`locate_storages(path, *materialize(tree), safe_globals)` without torch where the file allows."""
    try:
        return torch_pickle.storage_offsets_of(path, tree, globals_by_name(safe_globals))
    except ValueError:
        raise CheckpointError(path, "does not have the structure reshard wrote for it (changed since?)") from None
    except NeedsTorch as error:
        _fell_back(path, error)
    obj, roles = materialize(tree)
    return locate_storages(path, obj, roles, safe_globals)
