"""DeepSpeed's pickled classes, by name, without importing DeepSpeed (about a second per process).

    from reshard.formats.deepspeed_files import deepspeed_classes as classes
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
own classes and DeepSpeed loads them as its own. `Pickler` is torch_classes.StandInPickler over
these names. The torch-byte modules (torch_archive, torch_pickle) take this allowlist,
`safe_globals()`, as a parameter from the DeepSpeed layer; they import nothing from here.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from reshard.formats.torch_bytes.torch_classes import StandInPickler, TorchGlobal


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


class Pickler(StandInPickler):
    """pickle's own Pickler, writing each stand-in class as the DeepSpeed class it stands for, and
    each torch stand-in (torch_classes.TorchGlobal: dtypes, torch.Size, storage classes) as the
    torch global it stands for (torch_classes.StandInPickler over DEEPSPEED_NAMES: the pickler of
    `stand_in_pickle_module(safe_globals())`)."""

    stand_ins = DEEPSPEED_NAMES


def to_deepspeed(obj):
    """`obj` with every stand-in replaced by an instance of DeepSpeed's own class (imports DeepSpeed).

    For objects handed to a live DeepSpeed engine, which calls the loss scaler's methods. torch's
    own objects read without torch (torch_classes stand-ins: a dtype, torch.Size) become torch's.
    """
    import torch

    from reshard.formats.torch_bytes.torch_archive import map_leaves
    from reshard.formats.torch_bytes.torch_classes import TorchSize, as_torch
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
