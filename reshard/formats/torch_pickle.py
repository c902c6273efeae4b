"""torch.save files read and written without torch: the pickle side (tensors, storages, names).

    from reshard.formats.torch_pickle import read_portable, write_skeleton_tree, NeedsTorch
    tree = read_portable("zero_pp_rank_0_mp_rank_00_optim_states.pt", deepspeed_names)   # TensorRefs
    offsets = write_skeleton_tree("out.pt", target_tree)     # {role: data offset}, as torch_archive's
                                                             # materialize + write_skeleton give

Both give what torch_archive's torch path gives, bit for bit: `read_portable` the same tree as
`portable(load_structure(path))`, `write_skeleton_tree` the same file as `torch.save` under
`torch.serialization.skip_data()` of `materialize(tree)` with deepspeed_classes as pickle
module. Anything outside the subset below raises `NeedsTorch`, and the caller uses torch.

Supported subset (torch 2.13; anything else -> NeedsTorch):
- Container: torch_zip (the zip rules of caffe2/serialize/inline_container.cc), byte order
  "little" (serialization.py `_save` writes `sys.byteorder`).
- Pickle globals read: collections.OrderedDict; torch.Size; the torch dtypes and legacy storage
  classes of torch_classes.STORAGE_TYPES (torch/storage.py `_dtype_to_storage_type_map`, no
  quantized types) and torch.UntypedStorage; torch._utils._rebuild_tensor_v2 (no conj/neg
  metadata, no backward hooks); torch._utils._rebuild_parameter(_with_state) and
  torch._tensor._rebuild_from_type_v2 with type torch.Tensor (Python attributes such as
  ZeRO-3's `ds_id` are dropped, as `portable` drops them); _codecs.encode (bytes at protocol
  2); the DeepSpeed classes the caller allows (deepspeed_classes). Persistent ids:
  ('storage', <storage class>, key, location, numel) with a record data/<key> of numel *
  itemsize bytes; the location is not kept (a meta load ignores it too).
- Pickle written: protocol 2 with pickle's pure-Python Pickler (deepspeed_classes.Pickler, the
  pickle module torch_archive hands torch.save), tensors as torch/_tensor.py
  `_reduce_ex_internal` reduces a plain CPU tensor: `_rebuild_tensor_v2(storage, offset,
  size, stride, requires_grad, OrderedDict())`, the storage through serialization.py
  `_save`'s `persistent_id`: ('storage', <legacy storage class>, str(order of first use),
  'cpu', numel of the typed storage). Trees may hold TensorRef/NewTensor leaves, plain Python
  data, OrderedDicts, torch_classes stand-ins and DeepSpeed stand-ins.
- Records written: data.pkl, .format_version "1", .storage_alignment "64", byteorder
  "little", data/<key> per storage in order of first use (reserved, not written), then what
  torch_zip.ArchiveWriter.finish adds (version, .data/serialization_id).
"""
from __future__ import annotations

import codecs
import io
import os
import pickle
from collections import OrderedDict
from dataclasses import replace
from typing import Any

from reshard.formats import deepspeed_classes as classes
from reshard.formats.torch_archive import NewTensor, TensorRef, is_ref, map_leaves
from reshard.formats.torch_classes import (
    ITEMSIZE,
    STORAGE_OF_DTYPE,
    TORCH_GLOBALS,
    NeedsTorch,
    TorchGlobal,
)
from reshard.formats.torch_zip import ArchiveReader, ArchiveWriter

__all__ = ["NeedsTorch", "read_portable", "write_skeleton_tree", "storage_offsets_of"]


# -- reading -----------------------------------------------------------------------------------

class _StorageRef:
    """One persistent id as loaded: where the storage's bytes are; `used` once a tensor took it."""

    __slots__ = ("offset", "nbytes", "dtype", "used")

    def __init__(self, offset: int, nbytes: int, dtype: str):
        self.offset, self.nbytes, self.dtype, self.used = offset, nbytes, dtype, False


def _rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad, backward_hooks, metadata=None):
    if not isinstance(storage, _StorageRef) or backward_hooks or metadata:
        raise NeedsTorch("a tensor with hooks, conj/neg metadata or no file storage")
    storage.used = True
    return TensorRef(storage.offset, storage.nbytes, storage.dtype, tuple(size), tuple(stride),
                     storage_offset, bool(requires_grad))


def _rebuild_parameter(data, requires_grad, backward_hooks, state=None):
    if not isinstance(data, TensorRef) or backward_hooks:
        raise NeedsTorch("a parameter with hooks")
    return replace(data, requires_grad=bool(requires_grad))


def _rebuild_from_type_v2(func, new_type, args, state):
    if new_type is not TORCH_GLOBALS["torch.Tensor"] or not isinstance(func, TorchGlobal):
        raise NeedsTorch(f"a tensor subclass ({new_type})")
    return func(*args)  # the Python attributes in `state` are not kept (nor by `portable`)


def _encode(text, encoding="utf-8"):
    if not isinstance(text, str) or encoding != "latin1":
        raise NeedsTorch("_codecs.encode other than bytes at protocol 2")
    return codecs.encode(text, encoding)


_READ_GLOBALS: dict[tuple[str, str], Any] = {
    ("collections", "OrderedDict"): OrderedDict,
    ("torch._utils", "_rebuild_tensor_v2"): TorchGlobal("torch._utils._rebuild_tensor_v2", _rebuild_tensor_v2),
    ("torch._utils", "_rebuild_parameter"): TorchGlobal("torch._utils._rebuild_parameter", _rebuild_parameter),
    ("torch._utils", "_rebuild_parameter_with_state"): TorchGlobal("torch._utils._rebuild_parameter_with_state",
                                                                   _rebuild_parameter),
    ("torch._tensor", "_rebuild_from_type_v2"): TorchGlobal("torch._tensor._rebuild_from_type_v2",
                                                            _rebuild_from_type_v2),
    ("_codecs", "encode"): _encode,
    # A set at protocol 2 (no set opcode): DeepSpeed <= 0.16's `sparse_tensor_module_names` (engine.py _save_checkpoint)
    ("__builtin__", "set"): set,
}
for _name, _standin in TORCH_GLOBALS.items():
    _READ_GLOBALS[tuple(_name.rsplit(".", 1))] = _standin


class _Reader(pickle.Unpickler):
    def __init__(self, data: bytes, archive: ArchiveReader, extra_globals: dict):
        super().__init__(io.BytesIO(data))
        self.archive, self.extra_globals = archive, extra_globals
        self.storages: dict[str, tuple[int, int, str]] = {}
        self.loaded: list[_StorageRef] = []

    def find_class(self, module, name):
        found = _READ_GLOBALS.get((module, name)) or self.extra_globals.get(f"{module}.{name}")
        if found is None:
            raise NeedsTorch(f"pickled global {module}.{name}")
        return found

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise NeedsTorch(f"persistent id {pid!r:.80}")
        _, storage_type, key, location, numel = pid
        if not (isinstance(storage_type, TorchGlobal) and storage_type.dtype and isinstance(key, str)
                and isinstance(location, str) and isinstance(numel, int)):
            raise NeedsTorch(f"persistent id {pid!r:.80}")
        known = self.storages.get(key)
        if known is None:
            record = f"data/{key}"
            nbytes = numel * ITEMSIZE[storage_type.dtype]
            if record not in self.archive.infos or self.archive.size(record) != nbytes:
                raise NeedsTorch(f"storage record {record} missing or not {nbytes} bytes")
            known = self.storages[key] = (self.archive.offset(record), nbytes, storage_type.dtype)
        elif known[2] != storage_type.dtype:
            raise NeedsTorch(f"storage {key} viewed as two dtypes")
        storage = _StorageRef(*known)  # one per persistent id: torch writes one per tensor
        self.loaded.append(storage)
        return storage


def read_portable(path: str | os.PathLike, extra_globals: dict | None = None) -> Any:
    """The object in a torch.save file with every tensor as its TensorRef (torch_archive.portable
    of a meta load), read without torch. `extra_globals`: {dotted name: class} a caller allows
    besides torch's (the DeepSpeed stand-ins). Raises NeedsTorch for anything else, OSError and
    zip/pickle errors for damaged files (the caller then asks torch, whose messages it knows)."""
    with ArchiveReader(os.fspath(path)) as archive:
        if "data.pkl" not in archive.infos:
            raise NeedsTorch("no data.pkl record (not a torch.save file)")
        if "byteorder" in archive.infos and archive.read("byteorder") != b"little":
            raise NeedsTorch("big-endian storages")
        reader = _Reader(archive.read("data.pkl"), archive, extra_globals or {})
        tree = reader.load()
        if not all(storage.used for storage in reader.loaded):
            raise NeedsTorch("a storage outside any tensor")
        return tree


def deepspeed_globals(safe_globals) -> dict:
    """{dotted name: class} of a torch allowlist ([(class, name)] or classes) for read_portable."""
    out = {}
    for entry in safe_globals:
        if isinstance(entry, tuple):
            cls, name = entry
        else:
            cls, name = entry, f"{entry.__module__}.{entry.__qualname__}"
        out[name] = cls
    return out


# -- writing -----------------------------------------------------------------------------------

class _Storage:
    """One storage of the skeleton: its size, what fills it (role), the dtype it is viewed as."""

    __slots__ = ("nbytes", "role", "dtype")

    def __init__(self, nbytes: int, role):
        self.nbytes, self.role, self.dtype = nbytes, role, None


class _TypedStorage:
    """What `Tensor.storage()` hands torch's persistent_id: a storage seen as one dtype."""

    __slots__ = ("storage", "dtype")

    def __init__(self, storage: _Storage, dtype: str):
        self.storage, self.dtype = storage, dtype


_REBUILD_TENSOR_V2 = _READ_GLOBALS[("torch._utils", "_rebuild_tensor_v2")]


class _Tensor:
    """A tensor of the skeleton, reduced as torch/_tensor.py `_reduce_ex_internal` reduces a
    plain CPU tensor."""

    __slots__ = ("storage", "dtype", "offset", "shape", "stride", "requires_grad")

    def __init__(self, storage, dtype, offset, shape, stride, requires_grad):
        if dtype not in STORAGE_OF_DTYPE:
            raise NeedsTorch(f"dtype {dtype} has no legacy storage class")
        if storage.nbytes and storage.dtype not in (None, dtype):
            # torch refuses this too ("Cannot save multiple tensors or storages that view the same data as different types")
            raise NeedsTorch("one storage viewed as two dtypes")
        storage.dtype = dtype
        self.storage, self.dtype, self.offset = storage, dtype, offset
        self.shape, self.stride, self.requires_grad = shape, stride, requires_grad

    def __reduce_ex__(self, protocol):
        return (_REBUILD_TENSOR_V2, (_TypedStorage(self.storage, self.dtype), self.offset, tuple(self.shape),
                                     tuple(self.stride), self.requires_grad, OrderedDict()))


def _contiguous_strides(shape) -> tuple[int, ...]:
    """torch's contiguous strides (c10 `contiguous_strides`: sizes of 0 count as 1)."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


class _SkeletonPickler(classes.Pickler):
    """serialization.py `_save`'s PyTorchPickler over deepspeed_classes.Pickler."""

    def __init__(self, file):
        super().__init__(file, protocol=2)  # serialization.py DEFAULT_PROTOCOL
        self.id_map: dict[int, str] = {}
        self.storages: dict[str, _Storage] = {}

    def persistent_id(self, obj):
        if type(obj) is not _TypedStorage:
            return None
        storage = obj.storage
        key = self.id_map.setdefault(id(storage), str(len(self.id_map)))
        self.storages[key] = storage
        return ("storage", TORCH_GLOBALS[f"torch.{STORAGE_OF_DTYPE[obj.dtype]}"], key, "cpu",
                storage.nbytes // ITEMSIZE[obj.dtype])


def _skeleton_object(tree: Any) -> tuple[Any, list]:
    """materialize(tree) with stand-in tensors: the same sharing, the same order."""
    storages: dict[int, _Storage] = {}
    made: dict[tuple, _Tensor] = {}
    tensors: list[_Tensor] = []

    def build(ref):
        if ref.dtype not in STORAGE_OF_DTYPE:
            raise NeedsTorch(f"dtype {ref.dtype} has no legacy storage class")
        if isinstance(ref, NewTensor):
            if ref.slot in made:
                return made[ref.slot]
            shape = (ref.numel,) if ref.shape is None else tuple(ref.shape)
            numel = 1
            for size in shape:
                numel *= size
            tensor = made[ref.slot] = _Tensor(_Storage(numel * ITEMSIZE[ref.dtype], ref.slot), ref.dtype, 0,
                                              shape, _contiguous_strides(shape), bool(ref.requires_grad))
        else:
            storage = storages.get(ref.storage_key)
            if storage is None:
                storage = storages[ref.storage_key] = _Storage(ref.storage_nbytes, ref.storage_key)
            tensor = _Tensor(storage, ref.dtype, ref.storage_offset, tuple(ref.shape), tuple(ref.stride),
                             bool(ref.requires_grad))
        tensors.append(tensor)
        return tensor

    return map_leaves(tree, build, is_ref), tensors


def write_skeleton_tree(path: str | os.PathLike, tree: Any) -> dict:
    """torch.save(materialize(tree)[0], path) under skip_data with deepspeed_classes as pickle
    module, byte for byte, without torch; returns {role: byte offset of its storage's data}
    (TensorRef storage key or NewTensor slot), as torch_archive.write_skeleton does. Raises
    NeedsTorch before creating the file when the tree is outside the subset."""
    obj, _ = _skeleton_object(tree)
    buffer = io.BytesIO()
    pickler = _SkeletonPickler(buffer)
    try:
        pickler.dump(obj)
    except NeedsTorch:
        raise
    except (pickle.PicklingError, TypeError, AttributeError) as error:
        raise NeedsTorch(f"cannot pickle without torch: {error}") from None
    writer = ArchiveWriter(os.fspath(path))
    try:
        writer.add("data.pkl", buffer.getvalue())
        writer.add(".format_version", b"1")
        writer.add(".storage_alignment", b"64")
        writer.add("byteorder", b"little")
        offsets: dict = {}
        for key, storage in pickler.storages.items():
            at = writer.reserve(f"data/{key}", storage.nbytes)
            if storage.nbytes and offsets.setdefault(storage.role, at) != at:
                raise AssertionError(f"{path}: one source storage was saved twice")
        writer.finish()
    finally:
        writer.close()
    return offsets


def storage_offsets_of(path: str | os.PathLike, tree: Any, extra_globals: dict | None = None) -> dict:
    """{role: byte offset} of `tree`'s storages in `path`, a file written from a tree of the same
    shape (torch_archive.locate_storages without torch). Raises ValueError when the file does not
    have that shape, NeedsTorch when it cannot be read without torch."""
    from reshard.formats.torch_archive import refs_in

    wanted, written = refs_in(tree), refs_in(read_portable(path, extra_globals))
    if len(wanted) != len(written):
        raise ValueError("a different number of tensors")
    offsets: dict = {}
    for mine, theirs in zip(wanted, written):
        if isinstance(mine, NewTensor):
            shape = (mine.numel,) if mine.shape is None else tuple(mine.shape)
            role, nbytes = mine.slot, theirs.storage_nbytes
        else:
            shape, role, nbytes = tuple(mine.shape), mine.storage_key, mine.storage_nbytes
        if shape != theirs.shape or mine.dtype != theirs.dtype:
            raise ValueError("tensors of other shapes or dtypes")
        if nbytes == 0:
            continue
        if offsets.setdefault(role, theirs.storage_key) != theirs.storage_key:
            raise AssertionError(f"{path}: one source storage was saved twice")
    return offsets
