"""DeepSpeed's pickled classes, by name, without importing DeepSpeed (about a second per process).

    from reshard.formats import deepspeed_classes as classes
    torch.serialization.add_safe_globals(classes.safe_globals())   # load: stand-ins under DeepSpeed's names
    torch.save(obj, path, pickle_module=classes)                  # save: written under DeepSpeed's names
    real = classes.to_deepspeed(obj)                              # in a DeepSpeed job: the real classes

DeepSpeed 0.19.8 pickles four classes of its own into optimizer-states files (found with
`torch.serialization.get_unsafe_globals_in_checkpoint`):

    deepspeed.runtime.fp16.loss_scaler.LossScaler          stage_1_and_2.py / stage3.py `state_dict`: loss_scaler
    deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler   (fp16 with dynamic loss scaling)
    deepspeed.runtime.zero.config.ZeroStageEnum            zero_stage
    deepspeed.utils.tensor_fragment.fragment_address       param_slice_mappings values

reshard only carries them through, so stand-ins do: each is unpickled (weights_only, by the
name registered for it) into a class of this module with the same state, and pickled back
under DeepSpeed's name with the same opcodes the real class gives (GLOBAL name, then the same
reduce tuple and state), so the files are byte-identical to those written with DeepSpeed's
own classes and DeepSpeed loads them as its own. `Pickler` is the pure-Python pickler (the C
one insists on importing a class's module to check its name) with only `save_global` changed.
"""
from __future__ import annotations

import pickle
from dataclasses import dataclass
from enum import Enum

from reshard.formats.torch_classes import TorchGlobal


class LossScaler:
    """Stand-in for deepspeed.runtime.fp16.loss_scaler.LossScaler: attributes only."""


class DynamicLossScaler:
    """Stand-in for deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler: attributes only."""


class ZeroStageEnum(int, Enum):
    """Stand-in for deepspeed.runtime.zero.config.ZeroStageEnum (same members and values)."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3
    max_stage = 3


@dataclass
class fragment_address:  # noqa: N801 (DeepSpeed's name)
    """Stand-in for deepspeed.utils.tensor_fragment.fragment_address (same fields, same order)."""

    numel: int
    start: int


DEEPSPEED_NAMES: dict[type, str] = {
    LossScaler: "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    DynamicLossScaler: "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    ZeroStageEnum: "deepspeed.runtime.zero.config.ZeroStageEnum",
    fragment_address: "deepspeed.utils.tensor_fragment.fragment_address",
}


def safe_globals() -> list[tuple[type, str]]:
    """The weights_only allowlist: each stand-in under the DeepSpeed name it replaces."""
    return [(cls, name) for cls, name in DEEPSPEED_NAMES.items()]


def safe_global_names() -> set[str]:
    return set(DEEPSPEED_NAMES.values())


class Pickler(pickle._Pickler):
    """pickle's own Pickler, writing each stand-in class as the DeepSpeed class it stands for,
    and each torch stand-in (torch_classes.TorchGlobal: dtypes, torch.Size, storage classes) as
    the torch global it stands for."""

    dispatch = dict(pickle._Pickler.dispatch)
    dispatch[TorchGlobal] = lambda self, obj: self.save_global(obj)

    def save_global(self, obj, name=None):
        if type(obj) is TorchGlobal:
            dotted = obj.name
        else:
            dotted = DEEPSPEED_NAMES.get(obj) if isinstance(obj, type) else None
        if dotted is None:
            dotted = _torch_or_deepspeed_name(obj, name)
            if dotted is None:
                return super().save_global(obj, name)
        # A stand-in and the real object it stands for (torch.Size and torch_classes' SIZE in one
        # tree) are one global: written once, then fetched from the memo, as one object would be.
        seen = self._names.get(dotted) if hasattr(self, "_names") else None
        if seen is not None:
            self.write(self.get(seen))  # not memoized again: memo indices count entries
            return
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


def _torch_or_deepspeed_name(obj, name) -> str | None:
    """The dotted name of a real torch or DeepSpeed global (torch.Size, a dtype, a DeepSpeed class)."""
    qualname = name or getattr(obj, "__qualname__", None)
    if not isinstance(qualname, str) or "." in qualname:
        return None
    module = pickle.whichmodule(obj, qualname)
    if module == "torch" or module.startswith(("torch.", "deepspeed.")):
        return f"{module}.{qualname}"
    return None


def to_deepspeed(obj):
    """`obj` with every stand-in replaced by an instance of DeepSpeed's own class (imports DeepSpeed).

    For objects handed to a live DeepSpeed engine, which calls the loss scaler's methods. torch's
    own objects read without torch (torch_classes stand-ins: a dtype, torch.Size) become torch's.
    """
    import torch

    from reshard.formats.torch_archive import map_leaves
    from reshard.formats.torch_classes import TorchSize, as_torch
    real = _real_classes()

    def convert(stand_in):
        if isinstance(stand_in, torch.Tensor):
            return stand_in  # the same tensor (its storage is being filled), never a copy
        if isinstance(stand_in, (TorchGlobal, TorchSize)):
            return as_torch(stand_in)  # torch's own dtype / Size, as torch.load would give
        cls = real[type(stand_in)]
        if isinstance(stand_in, Enum):
            return cls(stand_in.value)
        instance = cls.__new__(cls)
        instance.__dict__.update(vars(stand_in))
        for name, value in vars(stand_in).items():  # e.g. the loss scaler's dtype
            if isinstance(value, (TorchGlobal, TorchSize)):
                instance.__dict__[name] = as_torch(value)
        return instance
    return map_leaves(obj, convert, lambda leaf: (type(leaf) in DEEPSPEED_NAMES or isinstance(leaf, torch.Tensor)
                                                  or isinstance(leaf, (TorchGlobal, TorchSize))))


def _real_classes() -> dict[type, type]:
    import importlib
    real = {}
    for stand_in, dotted in DEEPSPEED_NAMES.items():
        module, _, qualname = dotted.rpartition(".")
        real[stand_in] = getattr(importlib.import_module(module), qualname)
    return real
