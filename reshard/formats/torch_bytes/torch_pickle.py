"""torch.save files read and written without torch: the pickle side (tensors, storages, names).

    from reshard.formats.torch_bytes.torch_pickle import read_portable, write_skeleton_tree, NeedsTorch
    names = globals_by_name(allowlist)       # {"module.Name": stand-in class}, e.g. DeepSpeed's
    tree = read_portable("zero_pp_rank_0_mp_rank_00_optim_states.pt", names)   # TensorRefs
    offsets = write_skeleton_tree("out.pt", target_tree, names)   # {role: data offset}, as torch_archive's
                                                                  # materialize + write_skeleton give

Both give what torch_archive's torch path gives, bit for bit: `read_portable` the same tree as
torch.load(weights_only=True) (as `portable` of a meta load), `write_skeleton_tree` the same file
as `torch.save` under `torch.serialization.skip_data()` of `materialize(tree)` with
torch_classes.stand_in_pickle_module(allowlist) as pickle module. The caller's stand-ins (for
DeepSpeed's classes, deepspeed_classes.safe_globals()) are a parameter: this module knows no
checkpoint format. tests/test_reader_fuzz.py and bench/fuzz_reader.py hold the
reader to that on mutants of real files; tests/test_crafted_files.py on issue 22's probes.

What the reader does with what torch.save does not write (torch 2.13; each CheckpointError names
the file; NeedsTorch sends the file to torch, which then reads it after `open_archive` passed):
- Refused (CheckpointError), because torch reads it otherwise than a stored-record reader would,
  or crashes: compressed (deflated) records (torch inflates them; reshard reads storages in
  place, so it refuses rather than inflate, which also stops zip bombs); two records of one name,
  also differing only in case (miniz's sorted lookup takes one of them); records overlapping each
  other or the directory, sizes or offsets beyond the file, encrypted or "directory" records,
  multi-disk or inconsistent end records, bytes before or after the archive (torch_zip
  `read_directory`); byteorder "big" (torch crashes byteswapping on the meta device) or
  anything but "little"; a version record torch would not take; a non-UTF-8 serialization id.
- Refused, because torch refuses it too: a tensor view outside its storage (c10
  `computeStorageNbytes` as `set_` checks it), requires_grad not a bool or set on an integer
  dtype, opcodes torch's weights_only unpickler does not take, APPEND to a non-list, SETITEM on a
  non-dict, a memo entry never put, data.pkl ending early.
- Refused, though torch would build it: trees nested deeper than MAX_TREE_DEPTH, containers
  that contain themselves, and trees that expand past `tree_limit` through shared references
  (a "billion laughs"): every later walk of an accepted tree is then bounded.
- Handed to torch (NeedsTorch): valid content outside the subset below, e.g. other globals,
  storages outside tensors, tensors with hooks or conj/neg metadata, subclasses, one storage
  declared with two dtypes or sizes, a tensor attribute other than DeepSpeed's `ds_*`.

Supported subset (torch 2.13; anything else -> NeedsTorch):
- Container: torch_zip's strict reader (the zip rules of caffe2/serialize/inline_container.cc),
  byte order "little" (serialization.py `_save` writes `sys.byteorder`).
- Pickle: the opcodes of torch/_weights_only_unpickler.py `Unpickler.load`, with its rules for
  BUILD, NEWOBJ, REDUCE, APPEND(S), SETITEM(S) (`_Reader.load`). Globals read:
  collections.OrderedDict; torch.Size; the torch dtypes and legacy storage
  classes of torch_classes.STORAGE_TYPES (torch/storage.py `_dtype_to_storage_type_map`, no
  quantized types) and torch.UntypedStorage; torch._utils._rebuild_tensor_v2 (no conj/neg
  metadata, no backward hooks); torch._utils._rebuild_parameter(_with_state) and
  torch._tensor._rebuild_from_type_v2 with type torch.Tensor (Python attributes such as
  ZeRO-3's `ds_id` are dropped, as `portable` drops them); _codecs.encode (bytes at protocol
  2); the stand-in classes the caller allows (`extra_globals`). Persistent ids:
  ('storage', <storage class>, key, location, numel) with a record data/<key> of numel *
  itemsize bytes; the location is not kept (a meta or map_location load ignores it too).
- Pickle written: protocol 2 with pickle's pure-Python Pickler (torch_classes.StandInPickler,
  the pickle module torch_archive hands torch.save), tensors as torch/_tensor.py
  `_reduce_ex_internal` reduces a plain CPU tensor: `_rebuild_tensor_v2(storage, offset,
  size, stride, requires_grad, OrderedDict())`, the storage through serialization.py
  `_save`'s `persistent_id`: ('storage', <legacy storage class>, str(order of first use),
  'cpu', numel of the typed storage). Trees may hold TensorRef/NewTensor leaves, plain Python
  data, OrderedDicts, torch_classes stand-ins and the caller's stand-ins (`extra_globals`).
- Records written (`SaveLayout`, by the torch release the bytes are pinned to): data.pkl,
  .format_version "1" and .storage_alignment "64" (torch 2.11-2.14; not in 2.4.1 or 2.5.1),
  byteorder "little", data/<key> per storage (reserved, not written) in order of first use
  (2.11-2.14) or with the keys sorted as text, "10" before "2" (2.4.1, 2.5.1), then what
  torch_zip.ArchiveWriter.finish adds (version, .data/serialization_id).
"""
from __future__ import annotations

import codecs
import io
import os
import pickle
import struct
import types
from collections import OrderedDict
from dataclasses import dataclass, replace
from enum import Enum
from typing import Any, Callable

from reshard.errors import CheckpointError
from reshard.formats.torch_bytes.torch_classes import (
    ITEMSIZE,
    STORAGE_OF_DTYPE,
    STORAGE_TYPES,
    TORCH_GLOBALS,
    NeedsTorch,
    StandInPickler,
    TorchGlobal,
    TorchSize,
    globals_by_name,
)
from reshard.formats.torch_bytes.torch_tree import NewTensor, TensorRef, is_ref, map_leaves, refs_in
from reshard.formats.torch_bytes.torch_zip import ArchiveFormatError, ArchiveReader, ArchiveWriter

__all__ = ["NeedsTorch", "SaveLayout", "globals_by_name", "read_portable", "write_skeleton_tree", "storage_offsets_of"]


# -- reading -----------------------------------------------------------------------------------

MAX_TREE_DEPTH = 100
"""Containers nested deeper than this are refused: DeepSpeed's trees are about 10 deep, and
every later walk of a tree (pickling copies, verify's comparison) may then recurse safely."""


class PickleRefusal(ValueError):
    """data.pkl holds something torch.load(weights_only=True) would refuse, or that this reader
    refuses rather than risk reading it otherwise than torch; the message says what."""


class _StorageRef:
    """One persistent id as loaded: where the storage's bytes are; `used` once a tensor took it."""

    __slots__ = ("offset", "nbytes", "dtype", "used")

    def __init__(self, offset: int, nbytes: int, dtype: str):
        self.offset, self.nbytes, self.dtype, self.used = offset, nbytes, dtype, False


_GRAD_DTYPES = {"float64", "float32", "float16", "bfloat16", "complex64", "complex128"}
_INT64 = 1 << 62  # sizes, strides and offsets below this never overflow torch's int64 arithmetic


def _int_sequence(values, what: str) -> tuple[int, ...]:
    if type(values) not in (tuple, list, TorchSize):
        raise NeedsTorch(f"a tensor {what} that is a {type(values).__name__}")
    for value in values:
        if type(value) is not int or not 0 <= value < _INT64:
            raise PickleRefusal(f"a tensor {what} holds {value!r:.40}")
    return tuple(values)


def view_problem(storage_nbytes: int, itemsize: int, offset: int, shape, stride) -> str | None:
    """Why a view (offset, shape, stride in elements) does not lie inside a storage of
    `storage_nbytes` bytes, or None. torch's rule (c10 `computeStorageNbytes`, checked by
    `Tensor.set_`): a view with no elements fits anywhere; any other needs
    (offset + sum((size - 1) * stride) + 1) * itemsize bytes."""
    numel = 1
    for size in shape:
        numel *= size
    if numel == 0:
        nonzero = 1
        for size in shape:
            nonzero *= max(size, 1)
        return None if nonzero < _INT64 and offset < _INT64 // 16 else "a view of absurd size"
    last = offset + sum((size - 1) * step for size, step in zip(shape, stride))
    if (last + 1) * itemsize > storage_nbytes:
        return (f"a view past its storage: offset {offset}, shape {list(shape)}, stride {list(stride)} end at byte "
                f"{(last + 1) * itemsize} of a storage of {storage_nbytes} bytes (torch refuses it too)")
    return overlap_problem(shape, stride)


def overlap_problem(shape, stride) -> str | None:
    """Why a view's elements overlap one another, or None: a stride of 0 over a dimension longer
    than 1 (`expand`), or strides that revisit elements. torch reads such a view, but its element
    count is no longer bounded by the bytes the file holds (a 4-byte storage expanded to a billion
    elements), so whatever copies it whole allocates what the pickle claims; torch.save of a
    checkpoint writes none (DeepSpeed's flats, partitions and module tensors are dense). Refused
    by every reader (torch_archive.load_checked too). The sufficient rule: dimensions taken by
    increasing stride, each stride exceeds the furthest element the smaller ones reach."""
    reach = 0
    for step, size in sorted((step, size) for size, step in zip(shape, stride) if size > 1):
        if step <= reach:
            return (f"a view whose elements overlap (shape {list(shape)}, stride {list(stride)}: an expanded or "
                    "self-overlapping view, which a checkpoint does not hold)")
        reach += (size - 1) * step
    return None


def _requires_grad(value, dtype: str) -> bool:
    if type(value) is not bool:  # torch: "requires_grad must be a bool"
        raise PickleRefusal(f"requires_grad {value!r:.40}")
    if value and dtype not in _GRAD_DTYPES:  # torch: "only Tensors of floating point and complex dtype ..."
        raise PickleRefusal(f"requires_grad on a {dtype} tensor")
    return value


def _empty_hooks(hooks) -> None:
    if type(hooks) is not OrderedDict or hooks:
        raise NeedsTorch("a tensor with backward hooks")


def _rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad, backward_hooks, metadata=None):
    """torch/_utils.py `_rebuild_tensor_v2`: `set_` a view on the storage, then requires_grad."""
    if not isinstance(storage, _StorageRef):
        raise NeedsTorch("a tensor with no file storage")
    _empty_hooks(backward_hooks)
    if metadata:
        raise NeedsTorch("a tensor with conj/neg metadata")
    if type(storage_offset) is not int or not 0 <= storage_offset < _INT64:
        raise PickleRefusal(f"a tensor storage offset {storage_offset!r:.40}")
    shape, strides = _int_sequence(size, "shape"), _int_sequence(stride, "stride")
    if len(shape) != len(strides):
        raise PickleRefusal(f"a tensor of shape {list(shape)} with strides {list(strides)}")
    problem = view_problem(storage.nbytes, ITEMSIZE[storage.dtype], storage_offset, shape, strides)
    if problem:
        raise PickleRefusal(problem)  # read_portable prefixes "is not a readable torch checkpoint"
    grad = _requires_grad(requires_grad, storage.dtype)
    storage.used = True
    return TensorRef(storage.offset, storage.nbytes, storage.dtype, shape, strides, storage_offset, grad)


def _rebuild_parameter(data, requires_grad, backward_hooks, state=None):
    """torch/_utils.py `_rebuild_parameter(_with_state)`: nn.Parameter(data, requires_grad)."""
    if type(data) is not TensorRef:
        raise NeedsTorch("a parameter of something other than a file tensor")
    _empty_hooks(backward_hooks)
    _plain_state(state)
    return replace(data, requires_grad=_requires_grad(requires_grad, data.dtype))


def _plain_state(state) -> None:
    """A tensor's pickled Python attributes (torch/_utils.py `_set_obj_state` sets them with
    setattr), which reshard does not keep (nor does `portable`): only DeepSpeed's own `ds_*`
    names, which cannot change what torch builds; anything else could (`requires_grad`, `data`)."""
    if isinstance(state, tuple):
        if len(state) != 2:
            raise PickleRefusal(f"a tensor state {state!r:.60}")
        if state[1]:
            raise NeedsTorch("a tensor with slot attributes")
        state = state[0]
    if not state:
        return
    if type(state) is not dict or not all(type(k) is str and k.startswith("ds_") for k in state):
        raise NeedsTorch(f"tensor attributes {list(state)[:5] if isinstance(state, dict) else state!r:.60}")


def _rebuild_from_type_v2(func, new_type, args, state):
    """torch/_tensor.py `_rebuild_from_type_v2`, for plain tensors that carry Python attributes."""
    if new_type is not TORCH_GLOBALS["torch.Tensor"] or func is not _REBUILD_TENSOR_V2 or type(args) is not tuple:
        raise NeedsTorch(f"a tensor subclass ({new_type})")
    _plain_state(state)
    return func(*args)


def _encode(text, encoding="utf-8"):
    if not isinstance(text, str) or encoding != "latin1":
        raise NeedsTorch("_codecs.encode other than bytes at protocol 2")
    return codecs.encode(text, encoding)


_REBUILD_TENSOR_V2 = TorchGlobal("torch._utils._rebuild_tensor_v2", _rebuild_tensor_v2)
_READ_GLOBALS: dict[tuple[str, str], Any] = {
    ("collections", "OrderedDict"): OrderedDict,
    ("torch._utils", "_rebuild_tensor_v2"): _REBUILD_TENSOR_V2,
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
_STORAGE_CLASSES = {TORCH_GLOBALS[f"torch.{name}"] for name in STORAGE_TYPES} | {TORCH_GLOBALS["torch.UntypedStorage"]}

# The opcodes torch's weights_only unpickler (torch/_weights_only_unpickler.py `Unpickler.load`)
# takes, and no others: protocol 2 as torch.save writes it.
_OP = {name: code[0] for name, code in [
    ("PROTO", b"\x80"), ("STOP", b"."), ("GLOBAL", b"c"), ("NEWOBJ", b"\x81"), ("REDUCE", b"R"), ("BUILD", b"b"),
    ("APPEND", b"a"), ("APPENDS", b"e"), ("SETITEM", b"s"), ("SETITEMS", b"u"), ("MARK", b"("), ("TUPLE", b"t"),
    ("TUPLE1", b"\x85"), ("TUPLE2", b"\x86"), ("TUPLE3", b"\x87"), ("NONE", b"N"), ("NEWFALSE", b"\x89"),
    ("NEWTRUE", b"\x88"), ("EMPTY_TUPLE", b")"), ("EMPTY_LIST", b"]"), ("EMPTY_DICT", b"}"),
    ("EMPTY_SET", b"\x8f"), ("BININT", b"J"), ("BININT1", b"K"), ("BININT2", b"M"), ("BINFLOAT", b"G"),
    ("BINUNICODE", b"X"), ("SHORT_BINSTRING", b"U"), ("BINPERSID", b"Q"), ("BINGET", b"h"),
    ("LONG_BINGET", b"j"), ("BINPUT", b"q"), ("LONG_BINPUT", b"r"), ("LONG1", b"\x8a")]}
_NAMES = {code: name for name, code in _OP.items()}
_CONSTANTS = {"NONE": lambda: None, "NEWTRUE": lambda: True, "NEWFALSE": lambda: False, "EMPTY_TUPLE": tuple,
              "EMPTY_LIST": list, "EMPTY_DICT": dict, "EMPTY_SET": set}


class _Reader:
    """An unpickler for torch.save's data.pkl with the semantics of torch's weights_only
    unpickler, opcode by opcode, over reshard's stand-ins: iterative (no recursion, whatever the
    nesting), one opcode per byte at least (work and memory bounded by data.pkl's size)."""

    def __init__(self, data: bytes, archive: ArchiveReader, extra_globals: dict):
        self.data, self.position = data, 0
        self.archive, self.extra_globals = archive, extra_globals
        self.storages: dict[str, tuple[int, int, str]] = {}
        self.loaded: list[_StorageRef] = []
        self.globals: dict[int, Any] = {}  # id -> every object find_class gave: what REDUCE may call

    def find_class(self, module, name):
        found = _READ_GLOBALS.get((module, name)) or self.extra_globals.get(f"{module}.{name}")
        if found is None:
            raise NeedsTorch(f"pickled global {module}.{name}")
        return found

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise NeedsTorch(f"persistent id {pid!r:.80}")
        _, storage_type, key, location, numel = pid
        if not (storage_type in _STORAGE_CLASSES and isinstance(key, str) and isinstance(location, str)
                and type(numel) is int and numel >= 0):
            raise NeedsTorch(f"persistent id {pid!r:.80}")
        nbytes = numel * ITEMSIZE[storage_type.dtype]
        known = self.storages.get(key)
        if known is None:
            record = f"data/{key}"
            if record not in self.archive.infos or self.archive.size(record) != nbytes:
                raise NeedsTorch(f"storage record {record} missing or not {nbytes} bytes")
            known = self.storages[key] = (self.archive.offset(record), nbytes, storage_type.dtype)
        elif known[1:] != (nbytes, storage_type.dtype):  # torch keeps the first (or, empty, reloads it)
            raise NeedsTorch(f"storage {key} declared with two sizes or dtypes")
        storage = _StorageRef(*known)  # one per persistent id: torch writes one per tensor
        self.loaded.append(storage)
        return storage

    def _take(self, count: int) -> bytes:
        end = self.position + count
        if end > len(self.data):
            raise PickleRefusal("data.pkl ends inside an opcode (truncated)")
        chunk = self.data[self.position:end]
        self.position = end
        return chunk

    def _line(self) -> str:
        end = self.data.find(b"\n", self.position)
        if end < 0:
            raise PickleRefusal("data.pkl ends inside a GLOBAL name")
        line = self.data[self.position:end]
        self.position = end + 1
        return line.decode("utf-8")

    def load(self) -> Any:
        """The object data.pkl pickles. The frequent opcodes are handled in this loop, the rest by
        `_other`; which opcodes exist and what each does follow torch's `Unpickler.load`."""
        data, size = self.data, len(self.data)
        stack: list = []
        marks: list[list] = []
        memo: dict[int, Any] = {}
        position = 0
        while True:
            if position >= size:
                raise PickleRefusal("data.pkl ends before its STOP opcode")
            code = data[position]
            position += 1
            if code == 0x71 or code == 0x68:  # BINPUT, BINGET: a 1-byte memo index
                if position >= size:
                    raise PickleRefusal("data.pkl ends inside an opcode (truncated)")
                index = data[position]
                position += 1
                if code == 0x71:
                    memo[index] = _top(stack, "BINPUT")
                elif index in memo:
                    stack.append(memo[index])
                else:
                    raise PickleRefusal(f"BINGET of memo entry {index}, which was never put")
            elif code == 0x58:  # BINUNICODE
                start = position + 4
                if start > size:
                    raise PickleRefusal("data.pkl ends inside an opcode (truncated)")
                end = start + int.from_bytes(data[position:start], "little")
                if end > size:
                    raise PickleRefusal("data.pkl ends inside an opcode (truncated)")
                stack.append(str(data[start:end], "utf-8", "surrogatepass"))
                position = end
            elif code == 0x4B:  # BININT1
                if position >= size:
                    raise PickleRefusal("data.pkl ends inside an opcode (truncated)")
                stack.append(data[position])
                position += 1
            elif code == 0x28:  # MARK
                marks.append(stack)
                stack = []
            elif code == 0x74 or code == 0x65 or code == 0x75:  # TUPLE, APPENDS, SETITEMS: pop the mark
                op = _NAMES[code]
                if not marks:
                    raise PickleRefusal(f"{op} without a MARK")
                items, stack = stack, marks.pop()
                if code == 0x74:
                    stack.append(tuple(items))
                    continue
                target = _top(stack, op)
                if code == 0x65:
                    if type(target) is not list:
                        raise PickleRefusal(f"APPENDS to a {type(target).__name__}")
                    target.extend(items)
                else:
                    _check_mapping(target)
                    if len(items) % 2:
                        raise PickleRefusal("SETITEMS with a key and no value")
                    for i in range(0, len(items), 2):
                        target[items[i]] = items[i + 1]
            elif code == 0x2E:  # STOP
                if not stack:
                    raise PickleRefusal("STOP with an empty stack")
                return stack.pop()  # torch ignores what follows STOP and what is left below it
            else:
                op = _NAMES.get(code)
                if op is None:
                    raise PickleRefusal(f"pickle opcode {bytes([code])!r} at byte {position - 1}, which torch's "
                                        "weights_only unpickler does not take")
                self.position = position
                self._other(op, stack, memo)
                position = self.position

    def _other(self, op: str, stack: list, memo: dict) -> None:
        """One opcode that neither pops a mark nor is among the most frequent."""
        take, unpack = self._take, struct.unpack
        if op == "PROTO":
            take(1)
        elif op == "GLOBAL":
            module, name = self._line(), self._line()
            found = self.find_class(module, name)
            self.globals[id(found)] = found
            stack.append(found)
        elif op == "APPEND":
            item = _pop(stack, op)
            target = _top(stack, op)
            if type(target) is not list:
                raise PickleRefusal(f"APPEND to a {type(target).__name__}")
            target.append(item)
        elif op == "SETITEM":
            value, key = _pop(stack, op), _pop(stack, op)
            target = _top(stack, op)
            _check_mapping(target)
            target[key] = value
        elif op in ("TUPLE1", "TUPLE2", "TUPLE3"):
            n = int(op[-1])
            if len(stack) < n:
                raise PickleRefusal(f"{op} on a stack of {len(stack)}")
            stack[-n:] = [tuple(stack[-n:])]
        elif op == "REDUCE":
            args = _pop(stack, op)
            func = _top(stack, op)
            if self.globals.get(id(func)) is not func:
                raise PickleRefusal(f"REDUCE of {type(func).__name__}, which is no global")
            if type(args) is not tuple:
                raise NeedsTorch(f"REDUCE with arguments of type {type(args).__name__}")
            stack[-1] = func(*args)
        elif op == "NEWOBJ":
            args, cls = _pop(stack, op), _pop(stack, op)
            if not isinstance(cls, type) or self.globals.get(id(cls)) is not cls or type(args) is not tuple:
                raise NeedsTorch(f"NEWOBJ of {cls!r:.60}")
            stack.append(cls.__new__(cls, *args))
        elif op == "BUILD":
            state = _pop(stack, op)
            self._build(_top(stack, op), state)
        elif op in _CONSTANTS:
            stack.append(_CONSTANTS[op]())
        elif op == "BININT":
            stack.append(unpack("<i", take(4))[0])
        elif op == "BININT2":
            stack.append(unpack("<H", take(2))[0])
        elif op == "LONG1":
            stack.append(int.from_bytes(take(take(1)[0]), "little", signed=True))
        elif op == "BINFLOAT":
            stack.append(unpack(">d", take(8))[0])
        elif op == "SHORT_BINSTRING":
            stack.append(take(take(1)[0]).decode("utf-8", "strict"))  # torch.load's encoding="utf-8"
        elif op == "BINPERSID":
            stack.append(self.persistent_load(_pop(stack, op)))
        elif op == "LONG_BINGET":
            index = unpack("<I", take(4))[0]
            if index not in memo:
                raise PickleRefusal(f"{op} of memo entry {index}, which was never put")
            stack.append(memo[index])
        elif op == "LONG_BINPUT":
            memo[unpack("<I", take(4))[0]] = _top(stack, op)
        else:  # the opcodes handled in `load`
            raise AssertionError(op)

    def _build(self, inst, state) -> None:
        """BUILD as torch's weights_only unpickler does it for the types reshard gives."""
        kind = type(inst)
        if kind is OrderedDict:
            inst.__dict__.update(state)
        elif kind in self.extra_globals.values() and not isinstance(inst, Enum):
            if hasattr(inst, "__setstate__"):
                inst.__setstate__(state)
            else:  # as pickle's load_build
                slots = None
                if isinstance(state, tuple) and len(state) == 2:
                    state, slots = state
                if state:
                    inst.__dict__.update(state)
                if slots:
                    for name, value in slots.items():
                        setattr(inst, name, value)
        else:
            raise NeedsTorch(f"BUILD of a {kind.__name__}")


def _pop(stack: list, op: str):
    if not stack:
        raise PickleRefusal(f"{op} on an empty stack")
    return stack.pop()


def _top(stack: list, op: str):
    if not stack:
        raise PickleRefusal(f"{op} on an empty stack")
    return stack[-1]


def _check_mapping(target) -> None:
    if type(target) not in (dict, OrderedDict):
        raise PickleRefusal(f"SETITEM(S) on a {type(target).__name__}")


def _check_byte_order_and_version(archive: ArchiveReader) -> None:
    """The records torch.load reads besides data.pkl, judged as torch judges them
    (torch/serialization.py `_load`, inline_container.cc `PyTorchStreamReader::init`)."""
    if "byteorder" in archive.infos:
        order = archive.read("byteorder")
        if order == b"big":  # torch would byteswap each storage; it crashes doing so inside reshard
            raise PickleRefusal("holds big-endian storages (its byteorder record says \"big\"); reshard reads "
                                "little-endian torch files only: load and re-save it with torch on a little-endian host")
        if order != b"little":
            raise PickleRefusal(f"has byteorder record {order[:20]!r}: torch refuses it too (\"Unknown endianness type\")")
    version = ".data/version" if ".data/version" in archive.infos else "version"
    if version not in archive.infos:
        raise PickleRefusal("has no version record (torch refuses it: \"failed finding central directory\" or "
                            "\"version\")")
    text = archive.read(version) if archive.size(version) <= 20 else b"?"
    if not (text.rstrip(b"\n").isdigit() and text.count(b"\n") <= 1 and 1 <= int(text) <= 10):
        raise PickleRefusal(f"has format version {text[:20]!r}, which torch does not read")
    if ".storage_alignment" in archive.infos:
        try:
            int(archive.read(".storage_alignment"))  # torch reads it with int() and fails otherwise
        except ValueError:
            raise PickleRefusal("has a .storage_alignment record that is not a number") from None
    if ".data/serialization_id" in archive.infos:
        try:  # torch hands it to Python as a str after every load (serialization.py `_load`)
            archive.read(".data/serialization_id").decode("utf-8")
        except UnicodeDecodeError:
            raise PickleRefusal("has a .data/serialization_id record that is not UTF-8 text") from None
    if "constants.pkl" in archive.infos:
        raise PickleRefusal("is a TorchScript archive, not a torch.save file")
    if "data.pkl" not in archive.infos:
        raise PickleRefusal("has no data.pkl record (not a torch.save file)")


def open_archive(path: str | os.PathLike) -> ArchiveReader:
    """The archive of a torch.save file, its records checked as torch would read them; refuses
    (CheckpointError naming the file) anything torch.save would not write and torch would read
    otherwise than reshard: compressed or duplicate or overlapping records, sizes beyond the file,
    big-endian storages. Both ways of reading a file (with and without torch) start here."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as file:
            start = file.read(4)
        if not start:
            raise CheckpointError(path, "is empty (0 bytes): the save did not finish or the file was truncated")
        if start != b"PK\x03\x04":
            raise CheckpointError(path, "is not a torch.save archive (no zip header): not a checkpoint file, "
                                        "or saved with the legacy _use_new_zipfile_serialization=False format")
        archive = ArchiveReader(path)
    except ArchiveFormatError as error:
        raise CheckpointError(path, str(error)) from None
    except OSError as error:
        raise CheckpointError(path, f"cannot be read: {error.strerror or error}") from None
    try:
        _check_byte_order_and_version(archive)
    except PickleRefusal as error:
        archive.close()
        raise CheckpointError(path, str(error)) from None
    except BaseException:
        archive.close()
        raise
    return archive


def tree_limit(pickle_bytes: int) -> int:
    """The most nodes (counting a shared object once per place it appears) a tree unpickled from
    `pickle_bytes` may have: each node a pickle names costs it an opcode, so only sharing
    (the "billion laughs": tuples of tuples of one tuple) can exceed this."""
    return 4 * pickle_bytes + 100_000


def read_portable(path: str | os.PathLike, extra_globals: dict | None = None) -> Any:
    """The object in a torch.save file with every tensor as its TensorRef (torch_archive.portable
    of a meta load), read without torch. `extra_globals`: {dotted name: class} a caller allows
    besides torch's (the DeepSpeed stand-ins).

    Returns exactly what torch.load(weights_only=True) gives (with reshard's stand-ins), or
    raises CheckpointError (naming the file: something torch.save does not write, see
    `open_archive`, or that torch would refuse), or NeedsTorch (valid content outside the
    subset: the caller asks torch)."""
    path = os.fspath(path)
    with open_archive(path) as archive:
        data = archive.read("data.pkl")
        reader = _Reader(data, archive, extra_globals or {})
        try:
            tree = reader.load()
        except (NeedsTorch, CheckpointError):
            raise
        except PickleRefusal as error:
            raise CheckpointError(path, f"data.pkl: {error}") from None
        except RecursionError:  # a stand-in's own code recursing: the file is refused like any other
            raise CheckpointError(path, "data.pkl nests too deeply") from None
        except (TypeError, ValueError, KeyError, IndexError, AttributeError, OverflowError, struct.error) as error:
            # what Python raises for malformed data, as torch's unpickler does: a key that is no key,
            # a stand-in called with the wrong arguments. Anything else is a bug, and stays one.
            raise CheckpointError(path, f"is not a readable torch checkpoint (data.pkl: "
                                        f"{type(error).__name__}: {str(error)[:200]})") from None
        if not all(storage.used for storage in reader.loaded):
            raise NeedsTorch("a storage outside any tensor")
        check_tree(tree, path, tree_limit(len(data)))
        return tree


_ATOMS = (type(None), bool, int, float, complex, str, bytes)


def check_tree(tree: Any, path: str, max_nodes: int, is_leaf: Callable[[Any], bool] = lambda obj: False,
               from_torch: bool = False) -> None:
    """Refuse (CheckpointError) a tree that contains itself, nests deeper than MAX_TREE_DEPTH or
    expands to more than `max_nodes` nodes when shared objects are counted where they appear.
    Iterative and memoised by object id: a billion-laughs tree is measured in time linear in
    its distinct objects. Any later walk of an accepted tree is then bounded. Leaves: atoms,
    TensorRefs, globals, classes, enum members, and whatever `is_leaf` accepts (torch tensors).
    A tree this module read (not `from_torch`) must also hold no value torch would give as an
    object of its own (a storage, a function, a torch global other than a dtype): NeedsTorch."""
    measured: dict[int, int] = {}  # id -> expanded node count of a finished container
    on_path: set[int] = set()
    frames: list[list] = []  # [node, children, next index, nodes so far]

    def enter(node) -> int | None:
        """The node's count if known now, else None after pushing its frame."""
        if isinstance(node, _ATOMS) or type(node) in (TensorRef, TorchGlobal, _StorageRef) or \
                isinstance(node, (type, Enum)) or is_leaf(node):
            if type(node) is _StorageRef:
                raise NeedsTorch("a storage outside any tensor")
            if type(node) is TorchGlobal and (node.dtype is None or node in _STORAGE_CLASSES):
                raise NeedsTorch(f"{node.name} as a value (torch gives its own object for it)")
            return 1
        if not from_torch and isinstance(node, (types.FunctionType, types.BuiltinFunctionType)):
            raise NeedsTorch(f"a function ({node!r:.60}) as a value")
        key = id(node)
        if key in measured:
            return measured[key]
        if key in on_path:
            raise CheckpointError(path, "data.pkl holds a container that contains itself")
        if len(frames) >= MAX_TREE_DEPTH:
            raise CheckpointError(path, f"data.pkl nests containers more than {MAX_TREE_DEPTH} deep")
        if isinstance(node, dict):
            children = [item for pair in node.items() for item in pair]
        elif isinstance(node, (list, tuple, set, frozenset)):
            children = list(node)
        else:
            children = []
        attributes = getattr(node, "__dict__", None)
        if isinstance(attributes, dict) and attributes:
            children.append(attributes)
        on_path.add(key)
        frames.append([node, children, 0, 1])
        return None

    enter(tree)
    while frames:
        frame = frames[-1]
        node, children, index, count = frame
        if index < len(children):
            frame[2] = index + 1
            found = enter(children[index])
            if found is not None:
                frame[3] = count + found
                if frame[3] > max_nodes:
                    raise CheckpointError(path, f"data.pkl expands to more than {max_nodes:,} objects through "
                                                "shared references (a \"billion laughs\" pickle?)")
            continue
        frames.pop()
        on_path.discard(id(node))
        measured[id(node)] = count
        if frames:
            frames[-1][3] += count
            if frames[-1][3] > max_nodes:
                raise CheckpointError(path, f"data.pkl expands to more than {max_nodes:,} objects through "
                                            "shared references (a \"billion laughs\" pickle?)")


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


class _SkeletonPickler(StandInPickler):
    """serialization.py `_save`'s PyTorchPickler over the pickler of stand_in_pickle_module(allowlist)."""

    def __init__(self, file, extra_globals: dict):
        super().__init__(file, protocol=2)  # serialization.py DEFAULT_PROTOCOL
        self.stand_ins = {cls: name for name, cls in extra_globals.items()}
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


@dataclass(frozen=True)
class SaveLayout:
    """The records torch.save writes around data.pkl, which differ between torch releases
    (torch/serialization.py `_save`); data.pkl and the zip container are the same in all of them."""

    releases: str
    """The releases whose bytes a test has compared with this layout's (torch_archive.PINNED_WRITER_LAYOUTS)."""
    format_records: bool
    """`.format_version` "1" and `.storage_alignment` "64" follow data.pkl."""
    storage_keys_as_text: bool
    """Storage records in `sorted(serialized_storages.keys())` order: the keys are decimal strings,
    so "10" comes before "2"; otherwise in order of first use (`for key in serialized_storages`)."""


TORCH_2_4_LAYOUT = SaveLayout("2.4.1, 2.5.1", format_records=False, storage_keys_as_text=True)
TORCH_2_11_LAYOUT = SaveLayout("2.11.0, 2.13.x, 2.14.1", format_records=True, storage_keys_as_text=False)


def write_skeleton_tree(path: str | os.PathLike, tree: Any, extra_globals: dict | None = None,
                        layout: SaveLayout = TORCH_2_11_LAYOUT) -> dict:
    """torch.save(materialize(tree)[0], path) under skip_data with
    torch_classes.stand_in_pickle_module(allowlist) as pickle module, byte for byte, without torch.
    `extra_globals`: {dotted name: stand-in class} (`globals_by_name(allowlist)`), the names the
    tree's stand-ins are written under (a stand-in it does not name is refused); returns {role: byte offset of its storage's data}
    (TensorRef storage key or NewTensor slot), as torch_archive.write_skeleton does. `layout`:
    the records of the torch release the bytes must equal (SaveLayout). Raises NeedsTorch before
    creating the file when the tree is outside the subset."""
    obj, _ = _skeleton_object(tree)
    buffer = io.BytesIO()
    pickler = _SkeletonPickler(buffer, extra_globals or {})
    try:
        pickler.dump(obj)
    except NeedsTorch:
        raise
    except (pickle.PicklingError, TypeError, AttributeError) as error:
        raise NeedsTorch(f"cannot pickle without torch: {error}") from None
    writer = ArchiveWriter(os.fspath(path))
    try:
        writer.add("data.pkl", buffer.getvalue())
        if layout.format_records:
            writer.add(".format_version", b"1")
            writer.add(".storage_alignment", b"64")
        writer.add("byteorder", b"little")
        offsets: dict = {}
        keys = sorted(pickler.storages) if layout.storage_keys_as_text else list(pickler.storages)
        for key in keys:
            storage = pickler.storages[key]
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
