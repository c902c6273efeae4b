"""Values every rank of a DeepSpeed checkpoint saves alike, checked equal to rank 0's.

    from reshard.formats.deepspeed_files.deepspeed_rank_values import compare, optim_rank_values
    difference, tensors = compare(optim_rank_values(tree), optim_rank_values(source.optim_template))
    # difference: None, or (key path, value in this file, value in rank 0's file);
    # tensors: (key path, ref here, ref in rank 0's file) pairs whose bytes the caller compares

A target rank's files are built from rank 0's (reshard.formats.deepspeed_files.deepspeed_target): there is no
source rank a target rank of another world size corresponds to, so a value that differs between
source ranks has no right place to go, and carrying rank 0's would be a silent choice. Each value
listed here is one DeepSpeed keeps the same on every rank (and, except ds_config, which no load
reads, reads back per rank from that rank's own file), so a difference means a damaged or mixed
checkpoint, and is refused. Where the check runs: deepspeed_inspect `source_rank_tensors`, by the
worker that reads the rank's files anyway, against rank 0's trees every worker already holds.

- optim files, every rank: `loss_scaler` (cur_scale, ...), `dynamic_loss_scale`, `overflow`
  (stage_1_and_2.py `state_dict`, stage3.py `_rigid_state_dict`; loaded by stage_1_and_2.py
  `_load_legacy_checkpoint` -> `_load_global_state(state_dict_list[dp_rank])` and stage3.py
  `_rigid_load_state_dict`). Every rank steps its scaler from the same overflow flag, all-reduced
  with MAX over the dp group (stage_1_and_2.py `has_overflow`). `clip_grad` (the config's
  gradient_clipping; bf16_optimizer.py `_load_legacy_checkpoint` reads it from `current_rank_sd`
  too), `ds_version`, the file's `ds_config` (engine.py `_save_zero_checkpoint`: `self.config`, the
  one config dict every rank was started with), and the torch optimizer's hyperparameters per
  param group (`lr`, betas, weight_decay, ...: every rank's scheduler steps alike;
  `self.optimizer.load_state_dict(current_rank_sd[BASE_OPTIMIZER_STATE])`). Not `params`: ids
  the target recomputes. Optimizer `step` counters are checked by
  deepspeed_inspect `_check_same_counters`.
- model-states files of other ranks (ZeRO-3: every dp rank, engine.py `_get_ckpt_name` with
  `zero_pp_rank_{dp}`; AutoTP: every TP rank): `global_steps`, `global_samples`,
  `skipped_steps`, `lr_scheduler` (engine.py `_load_checkpoint` reads them from the rank's own
  file), `ds_config`, `ds_version`, `mp_world_size`, `buffer_names`, `frozen_param_shapes`.

Not checked here, because they may differ per rank: what depends on the rank's partition (checked
against the layout rules by deepspeed_inspect `validate_optim_tree`), `shared_params` (engine.py
`_get_shared_params` fills it on global rank 0 only), AutoEP/AutoTP metadata (per rank by design),
and client_state merged into a ZeRO-3 model-states file (`state.update(client_state)`: the
user's, possibly per rank, such as RNG states): a target rank gets rank 0's, and the job's summary
names the keys that differ (reshard.formats.deepspeed_files.deepspeed_client_state).
"""
from __future__ import annotations

import math
from enum import Enum
from typing import Any

from reshard.formats.deepspeed_files.deepspeed_schema import OPTIM as OPT
from reshard.formats.torch_bytes.torch_archive import TensorRef

MODEL_VALUES = ("global_steps", "global_samples", "skipped_steps", "lr_scheduler", "ds_config", "ds_version",
                "mp_world_size", "buffer_names", "frozen_param_shapes")
"""Model-states keys every rank's file holds alike (see the module docstring)."""
_OPTIM_SCALARS = ("loss_scaler", "dynamic_loss_scale", "overflow", "clip_grad", "ds_version")
_ABSENT = "(absent)"


def optim_rank_values(tree: Any) -> dict:
    """{key path: value} of an optim-states tree's values that are the same on every rank."""
    values = {key: tree.get(key, _ABSENT) for key in ("ds_config", "ds_version")} if isinstance(tree, dict) else {}
    osd = tree.get(OPT) if isinstance(tree, dict) else None
    if not isinstance(osd, dict):
        return values
    for key in _OPTIM_SCALARS:
        if key in osd:
            values[f"{OPT}.{key}"] = osd[key]
    for name in ("base_optimizer_state", OPT):  # ZeRO-1/2 and BF16_Optimizer; ZeRO-3
        groups = osd.get(name, {}).get("param_groups") if isinstance(osd.get(name), dict) else None
        if isinstance(groups, list):
            values[f"{OPT}.{name}.param_groups"] = [
                {k: v for k, v in group.items() if k != "params"} if isinstance(group, dict) else group
                for group in groups]
    return values


def model_rank_values(tree: Any, keys=MODEL_VALUES) -> dict:
    """{key: value} of a model-states tree's values that are the same on every rank."""
    if not isinstance(tree, dict):
        return {}
    return {key: tree.get(key, _ABSENT) for key in keys}


def compare(found: Any, wanted: Any) -> tuple[tuple[str, Any, Any] | None, list]:
    """(first difference (key path, found, wanted) or None, [(key path, found ref, wanted ref)]).

    An iterative walk, memoised over the pairs of objects already compared, so shared sub-trees
    (a crafted pickle's nested shared tuples) cost their distinct pairs, not their expansion.
    Floats compare by value with NaN equal to NaN; types must agree (1 is not True or 1.0). Stand-in
    objects (LossScaler, ...) compare by class and attributes. Tensors compare by dtype, shape and
    stride here; the caller compares the bytes of the returned pairs."""
    stack = [("", found, wanted)]
    seen: set[tuple[int, int]] = set()
    tensors, alive = [], []
    while stack:
        where, a, b = stack.pop()
        if (id(a), id(b)) in seen:
            continue
        seen.add((id(a), id(b)))
        if type(a) is not type(b):
            return (where, a, b), tensors
        if isinstance(a, TensorRef):
            if (a.dtype, tuple(a.shape), tuple(a.stride)) != (b.dtype, tuple(b.shape), tuple(b.stride)):
                return (where, a, b), tensors
            tensors.append((where, a, b))
        elif isinstance(a, dict):
            if list(a) != list(b):
                return (where, a, b), tensors
            stack += [(_join(where, key), a[key], b[key]) for key in reversed(list(a))]
        elif isinstance(a, (list, tuple)) and all(type(x) is int for x in (*a, *b)):  # shapes: whole
            if tuple(a) != tuple(b):
                return (where, a, b), tensors
        elif isinstance(a, (list, tuple)):
            if len(a) != len(b):
                return (where, a, b), tensors
            stack += [(f"{where}[{i}]", a[i], b[i]) for i in reversed(range(len(a)))]
        elif isinstance(a, float):
            if not (a == b or (math.isnan(a) and math.isnan(b))):
                return (where, a, b), tensors
        elif hasattr(a, "tolist") and hasattr(a, "dtype"):  # a torch tensor (whole-file torch loads)
            pair = ((str(a.dtype), list(a.shape), a.tolist()), (str(b.dtype), list(b.shape), b.tolist()))
            alive.append(pair)  # ids in `seen` must stay unique
            stack.append((where, *pair))
        elif hasattr(a, "__dict__") and not isinstance(a, (type, Enum)):  # stand-ins of DeepSpeed's classes
            stack.append((where, vars(a), vars(b)))
        elif a != b:
            return (where, a, b), tensors
    return None, tensors


def refuse(path: str, where: str, here: str, rank0_path: str, there: str):
    """Raise the CheckpointError for a value `where` that is `here` in `path` and `there` in rank 0's."""
    from reshard.errors import CheckpointError
    raise CheckpointError(path, f"{where} is {here}, but {rank0_path} has {there}: DeepSpeed saves this value alike "
                                "on every rank, and every target rank would get rank 0's (files of different saves "
                                "mixed, or a file edited?)")


def _join(where: str, key: Any) -> str:
    return f"{where}.{key}" if where else str(key)


def describe(value: Any, limit: int = 120) -> str:
    """A value as a message shows it: stand-ins by their attributes, long values cut."""
    if isinstance(value, tuple) and type(value) is not tuple and all(type(x) is int for x in value):
        text = repr(list(value))  # torch.Size (the reader's stand-in) as a shape
    elif hasattr(value, "__dict__") and not isinstance(value, (type, TensorRef, Enum)):
        text = f"{type(value).__name__}({', '.join(f'{k}={v!r}' for k, v in vars(value).items())})"
    elif isinstance(value, TensorRef):
        text = f"tensor {value.dtype} {list(value.shape)}"
    else:
        text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
