"""Field-by-field comparison of two DeepSpeed tag directories (reshard's output, a native save).

    from native_compare import structural_differences
    structural_differences(ours_tag_dir, native_tag_dir)   # [] when every field agrees

Same files; in each, the same keys in the same order, the same list lengths, the same
non-tensor values, and tensors of the same shape, dtype and requires_grad. Tensor values are
not compared here: the native save comes from another training run (another ZeRO stage rounds
differently), and the values are proven against the truth by loading. `ds_config` is the user's
config dict and may hold stage-specific keys the source run did not have: only its
zero_optimization.stage is compared. `global_samples` is run history (samples seen at the
source's DP size, carried over as DeepSpeed's own load restores it), not a layout field.
"""
from __future__ import annotations

import os

import torch


def _load(path):
    return torch.load(path, map_location="cpu", weights_only=False)


def _walk(ours, native, path: str, out: list[str]) -> None:
    if path.endswith("['global_samples']"):
        return
    if path.endswith("['ds_config']"):
        stage = lambda c: (c or {}).get("zero_optimization", {}).get("stage")  # noqa: E731
        if stage(ours) != stage(native):
            out.append(f"{path}: zero_optimization.stage {stage(ours)} vs native {stage(native)}")
        return
    if torch.is_tensor(ours) or torch.is_tensor(native):
        if not (torch.is_tensor(ours) and torch.is_tensor(native)):
            out.append(f"{path}: {type(ours).__name__} vs native {type(native).__name__}")
        elif (ours.shape, ours.dtype, ours.requires_grad) != (native.shape, native.dtype, native.requires_grad):
            out.append(f"{path}: {tuple(ours.shape)} {ours.dtype} rg={ours.requires_grad} vs native "
                       f"{tuple(native.shape)} {native.dtype} rg={native.requires_grad}")
        return
    if type(ours) is not type(native) and not (isinstance(ours, dict) and isinstance(native, dict)):
        out.append(f"{path}: {type(ours).__name__} vs native {type(native).__name__}")
        return
    if isinstance(ours, dict):
        if list(ours) != list(native):
            out.append(f"{path}: keys {list(ours)} vs native {list(native)}")
        for key in ours:
            if key in native:
                _walk(ours[key], native[key], f"{path}[{key!r}]", out)
    elif isinstance(ours, (list, tuple)):
        if len(ours) != len(native):
            out.append(f"{path}: length {len(ours)} vs native {len(native)}")
        for i, (a, b) in enumerate(zip(ours, native)):
            _walk(a, b, f"{path}[{i}]", out)
    elif hasattr(ours, "__dict__") and not isinstance(ours, type):
        _walk(vars(ours), vars(native), f"{path}.__dict__", out)
    elif ours != native:
        out.append(f"{path}: {ours!r} vs native {native!r}")


def structural_differences(ours_dir, native_dir) -> list[str]:
    ours_files = sorted(f for f in os.listdir(ours_dir) if f.endswith(".pt"))
    native_files = sorted(f for f in os.listdir(native_dir) if f.endswith(".pt"))
    out = [] if ours_files == native_files else [f"files {ours_files} vs native {native_files}"]
    for name in set(ours_files) & set(native_files):
        _walk(_load(os.path.join(ours_dir, name)), _load(os.path.join(native_dir, name)), name, out)
    return sorted(out)


def tied_storage_shared(model_states_path, alias: str, owner: str) -> bool:
    module = _load(model_states_path)["module"]
    return module[alias].untyped_storage().data_ptr() == module[owner].untyped_storage().data_ptr()
