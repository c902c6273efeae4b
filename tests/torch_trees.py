"""Trees as torch and as reshard's torch-free reader give them, in one comparable form.

    from torch_trees import comparable_tree
    assert comparable_tree(torch_pickle.read_portable(path, names)) == comparable_tree(portable(load_structure(path)))
"""
from __future__ import annotations

import torch

from reshard.formats.torch_bytes.torch_classes import TorchGlobal, TorchSize


def comparable_tree(value):
    """torch's objects and reshard's stand-ins in one form (torch.Size vs TorchSize, dtypes)."""
    if isinstance(value, (torch.Size, TorchSize)):
        return ("Size", tuple(value))
    if isinstance(value, torch.dtype):
        return ("global", str(value))
    if isinstance(value, TorchGlobal):
        return ("global", value.name)
    if isinstance(value, dict):
        return (type(value).__name__, [(k, comparable_tree(v)) for k, v in value.items()],
                comparable_tree(getattr(value, "_metadata", None)))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, [comparable_tree(v) for v in value])
    if isinstance(value, float) and value != value:
        return ("nan",)
    if hasattr(value, "__dict__") and not isinstance(value, type):
        return (type(value).__name__, comparable_tree(vars(value)))
    return value
