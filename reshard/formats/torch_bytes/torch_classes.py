"""torch's pickled names, by name, without importing torch: stand-ins for reading and writing.

    from reshard.formats.torch_bytes.torch_classes import TORCH_GLOBALS, TorchSize, NeedsTorch
    TORCH_GLOBALS["torch.float16"]          # the stand-in written as GLOBAL 'torch float16'
    TorchSize((2, 3))                       # written as torch.Size((2, 3)) is

A torch.save pickle names torch objects by module and name (torch/serialization.py `_save`
pickles at protocol 2 with a `persistent_id` for storages; torch/_tensor.py
`_reduce_ex_internal` reduces a tensor to `torch._utils._rebuild_tensor_v2`). Each such name
has one `TorchGlobal` here: a callable (so pickle can REDUCE it) that builds what reshard
keeps of it, e.g. a TensorRef for `_rebuild_tensor_v2`, and that picklers write back as the
same GLOBAL (`StandInPickler`, which also writes a caller's own stand-ins, such as
deepspeed_classes', under the names its allowlist gives them: `stand_in_pickle_module`). A name
not here raises `NeedsTorch`: the caller then reads or writes that file with torch itself.
"""
from __future__ import annotations

import pickle
import types
from collections.abc import Iterable


class NeedsTorch(Exception):
    """The content is outside what reshard reads and writes without torch: use torch for this file."""


class TorchGlobal:
    """A global of torch's namespace, by its dotted name; calling it builds reshard's stand-in."""

    __slots__ = ("name", "build", "dtype", "__weakref__")

    def __init__(self, name: str, build=None, dtype: str | None = None):
        self.name, self.build, self.dtype = name, build, dtype

    def __call__(self, *args):
        if self.build is None:
            raise NeedsTorch(f"{self.name} called with {len(args)} arguments")
        return self.build(*args)

    def __reduce__(self):  # pickled as itself in memory copies (torch_archive.map_leaves)
        return (torch_global, (self.name,))

    def __repr__(self):
        return self.name

    @property
    def module(self) -> str:
        return self.name.rpartition(".")[0]

    @property
    def qualname(self) -> str:
        return self.name.rpartition(".")[2]


TORCH_GLOBALS: dict[str, TorchGlobal] = {}


def torch_global(name: str) -> TorchGlobal:
    return TORCH_GLOBALS[name]


def _register(name: str, build=None, dtype: str | None = None) -> TorchGlobal:
    TORCH_GLOBALS[name] = TorchGlobal(name, build, dtype)
    return TORCH_GLOBALS[name]


ITEMSIZE = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2,
            "int8": 1, "uint8": 1, "bool": 1, "complex64": 8, "complex128": 16}
"""Bytes per element of the dtypes torch pickles with a legacy storage class."""

STORAGE_TYPES = {"DoubleStorage": "float64", "FloatStorage": "float32", "HalfStorage": "float16",
                 "BFloat16Storage": "bfloat16", "LongStorage": "int64", "IntStorage": "int32",
                 "ShortStorage": "int16", "CharStorage": "int8", "ByteStorage": "uint8", "BoolStorage": "bool",
                 "ComplexFloatStorage": "complex64", "ComplexDoubleStorage": "complex128"}
"""torch/storage.py `_dtype_to_storage_type_map` without the quantized types: storage class -> dtype."""

STORAGE_OF_DTYPE = {dtype: name for name, dtype in STORAGE_TYPES.items()}

for _storage, _dtype in STORAGE_TYPES.items():
    _register(f"torch.{_storage}", dtype=_dtype)
    _register(f"torch.{_dtype}", dtype=_dtype)  # the dtype itself (torch.dtype.__reduce__ gives its name)
_register("torch.UntypedStorage", dtype="uint8")
_register("torch.Tensor")


class TorchSize(tuple):
    """Stand-in for torch.Size: a tuple, pickled as torch.Size((...)) (its `__reduce__`)."""

    def __reduce__(self):
        return (SIZE, (tuple(self),))

    def __repr__(self):
        return f"torch.Size({list(self)})"


def _size(values=()) -> TorchSize:
    """torch.Size(values) as torch builds it from a pickle: a tuple or list of int64s (other
    iterables are left to torch; values it would refuse are refused)."""
    if type(values) not in (tuple, list):
        raise NeedsTorch(f"torch.Size of a {type(values).__name__}")
    if not all(type(v) is int and -(1 << 63) <= v < (1 << 63) for v in values):
        raise ValueError(f"torch.Size({values!r:.60}) of values that are not int64s")
    return TorchSize(values)


SIZE = _register("torch.Size", _size)


def as_torch(value):
    """The real torch object a stand-in stands for (torch.Size, a dtype, ...; imports torch), for
    objects handed to a live engine (deepspeed_classes.to_deepspeed); anything else as is."""
    if isinstance(value, TorchSize):
        import torch
        return torch.Size(value)
    if isinstance(value, TorchGlobal):
        import importlib
        return getattr(importlib.import_module(value.module), value.qualname)
    return value


def as_stand_in(value):
    """`value` with a real torch.Size or torch dtype replaced by its stand-in (anything else as
    is), so that trees read with and without torch compare equal (reshard.verify)."""
    kind = type(value)
    if kind.__module__ != "torch":
        return value
    if kind.__name__ == "Size":
        return TorchSize(value)
    if kind.__name__ == "dtype":
        return TORCH_GLOBALS.get(str(value), value)
    return value


# -- a caller's stand-ins, and the pickler that writes every stand-in under its real name ------

def globals_by_name(safe_globals: Iterable) -> dict[str, type]:
    """{dotted name: class} of a torch weights_only allowlist ([(class, "module.Name")] or classes,
    as `torch.serialization.safe_globals` takes it): the names a caller's stand-ins are read under."""
    out = {}
    for entry in safe_globals:
        if isinstance(entry, tuple):
            cls, name = entry
        else:
            cls, name = entry, f"{entry.__module__}.{entry.__qualname__}"
        out[name] = cls
    return out


class StandInPickler(pickle._Pickler):
    """pickle's own Pickler (the C one insists on importing a class's module to check its name)
    with only `save_global` changed: each torch stand-in (TorchGlobal: dtypes, torch.Size, storage
    classes) is written as the torch global it stands for, and each class of `stand_ins` (a
    subclass sets it: {class: "module.Name"}, the caller's allowlist, e.g. DeepSpeed's classes) as
    the global it stands for, with the opcodes pickle writes for a top-level class of that module.
    `stand_in_pickle_module` makes one for torch.save."""

    stand_ins: dict[type, str] = {}
    dispatch = dict(pickle._Pickler.dispatch)
    dispatch[TorchGlobal] = lambda self, obj: self.save_global(obj)

    def save_global(self, obj, name=None):
        if type(obj) is TorchGlobal:
            dotted = obj.name
        else:
            dotted = self.stand_ins.get(obj) if isinstance(obj, type) else None
        if dotted is None:
            dotted = self._real_name(obj, name)
            if dotted is None:
                return super().save_global(obj, name)
        # A stand-in and the real object it stands for (torch.Size and torch_classes' SIZE in one
        # tree) are one global: written once, then fetched from the memo, as one object would be.
        seen = self._names.get(dotted) if hasattr(self, "_names") else None
        if seen is not None:
            self.write(self.get(seen))  # not memoized again: memo indices count entries
            return None
        module, _, qualname = dotted.rpartition(".")
        # As pickle._Pickler.save_global writes a top-level class found in its module.
        if self.proto >= 4:
            self.save(module)
            self.save(qualname)
            self.write(pickle.STACK_GLOBAL)
        else:
            self.write(pickle.GLOBAL + module.encode("ascii") + b"\n" + qualname.encode("ascii") + b"\n")
        self.memoize(obj)
        if not hasattr(self, "_names"):
            self._names = {}
        self._names[dotted] = self.memo[id(obj)][0]
        return None

    def _real_name(self, obj, name) -> str | None:
        """The dotted name of a real global of torch or of a package the stand-ins stand for (a
        real DeepSpeed class read under --trust-pickle), so it shares the memo with its stand-in.
        A reshard class no stand-in names is refused: written under reshard's own module name it
        would make a file no loader reads as the caller meant."""
        qualname = name or getattr(obj, "__qualname__", None)
        if not isinstance(qualname, str) or "." in qualname:
            return None
        module = pickle.whichmodule(obj, qualname)
        if module == "torch" or module.startswith(("torch.", *_packages_of(self.stand_ins))):
            return f"{module}.{qualname}"
        if module == "reshard" or module.startswith("reshard."):
            raise pickle.PicklingError(f"{module}.{qualname} is a reshard stand-in that the allowlist does not name")
        return None


def _packages_of(stand_ins: dict[type, str]) -> tuple[str, ...]:
    """("deepspeed.",) for stand-ins of DeepSpeed's classes: the top-level packages they name."""
    return tuple(sorted({dotted.split(".")[0] + "." for dotted in stand_ins.values()}))


def stand_in_pickle_module(safe_globals: Iterable) -> types.ModuleType:
    """A pickle module for torch.save (`pickle_module=`) whose Pickler writes the allowlist's
    stand-ins ([(class, "module.Name")] or classes) under their names, and torch's stand-ins as
    torch's globals: the bytes StandInPickler writes, which torch_pickle's writer mirrors."""
    names = {cls: name for name, cls in globals_by_name(safe_globals).items()}
    module = types.ModuleType("reshard_stand_in_pickle")
    module.Pickler = type("Pickler", (StandInPickler,), {"stand_ins": names})
    return module
