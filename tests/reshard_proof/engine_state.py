"""Capture, from a live DeepSpeed engine, everything a checkpoint of it must carry, as full tensors.

Runs inside torchrun entry points (train records it as the truth, check_load compares against it):

    torchrun --standalone --nproc_per_node=2 -m reshard_proof.train --variant z3_fp32 ...

`capture_engine_state` is COLLECTIVE: every rank must call it, in the same order, because full
fp32 masters and optimizer states are assembled with all-reduces (DeepSpeed's getters) or
all-gathers (the internals route) and ZeRO-3 params are gathered for the module values.

Schema of the captured dict (the truth's "engine" entry):
    master:      {param: {"fp32": T, "state": {key: T}, "scalars": {key: value}}}  trainable only;
                 "state" holds every optimizer tensor of partition shape (exp_avg, momentum_buffer...),
                 "scalars" the rest of the state of the flat tensor holding the param (Adam's step)
    module:      {param: T}  low-precision module value of each trainable param (ZeRO-3: gathered)
    frozen:      {param: T}  frozen params (requires_grad False), module dtype
    buffers:     {name: T}   persistent buffers (what state_dict saves)
    non_persistent_buffers: {name: T}  rebuilt by the constructor, never saved: a sanity check
    tied:        {alias: owner}  parameter names that share one tensor (head.weight -> embed.weight)
    counters:    {"global_steps", "global_samples", "skipped_steps"}
    param_groups: [{hyperparameter: value}]  every key of each optimizer group except "params"
    lr_scheduler: lr_scheduler.state_dict()
    loss_scaler: {attribute: value} of engine.optimizer.loss_scaler, or None when there is none
"""

from collections.abc import Iterable

import torch

from reshard_proof.variants import Variant

MASTER_FROM_GETTERS = "getters"
MASTER_FROM_INTERNALS = "internals"

_SCALER_VALUE_TYPES = (bool, int, float, str, type(None))


def master_route(variant: Variant) -> str:
    """DeepSpeed's full-tensor getters use wrong offsets with round_robin_gradients; read internals there."""
    return MASTER_FROM_INTERNALS if variant.round_robin_gradients else MASTER_FROM_GETTERS


def capture_engine_state(engine, *, master_from: str) -> dict:
    """The dict described in the module docstring. Collective."""
    names = _trainable_names(engine)
    state = {
        "master": capture_master_state(engine, master_from),
        **_capture_module_values(engine, names),
        "buffers": {},
        "non_persistent_buffers": {},
        "tied": _tied_aliases(engine.module),
        "counters": {
            "global_steps": engine.global_steps,
            "global_samples": engine.global_samples,
            "skipped_steps": engine.skipped_steps,
        },
        "param_groups": [{key: value for key, value in group.items() if key != "params"}
                         for group in _basic_optimizer(engine).param_groups],
        "lr_scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
        "loss_scaler": _loss_scaler_state(engine.optimizer),
    }
    for module_name, module in engine.module.named_modules():
        for buffer_name, buffer in module.named_buffers(recurse=False):
            full_name = f"{module_name}.{buffer_name}" if module_name else buffer_name
            kind = "non_persistent_buffers" if buffer_name in module._non_persistent_buffers_set else "buffers"
            state[kind][full_name] = buffer.detach().clone()
    return state


def capture_master_state(engine, master_from: str) -> dict:
    """{param: {"fp32", "state", "scalars"}} by the chosen route. Collective."""
    if master_from == MASTER_FROM_GETTERS:
        return _master_from_getters(engine)
    if master_from == MASTER_FROM_INTERNALS:
        return _master_from_internals(engine)
    raise ValueError(f"unknown master route {master_from!r}")


def _basic_optimizer(engine) -> torch.optim.Optimizer:
    """The torch optimizer under DeepSpeed's wrapper (ZeRO-0 in fp32 has none: it is the client's)."""
    return getattr(engine.optimizer, "optimizer", engine.optimizer)


def _trainable_names(engine) -> dict[int, str]:
    return {id(param): name for name, param in engine.module.named_parameters() if param.requires_grad}


def _tied_aliases(module: torch.nn.Module) -> dict[str, str]:
    owner_by_id: dict[int, str] = {}
    aliases = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        if id(param) in owner_by_id:
            aliases[name] = owner_by_id[id(param)]
        else:
            owner_by_id[id(param)] = name
    return aliases


def _loss_scaler_state(optimizer) -> dict | None:
    scaler = getattr(optimizer, "loss_scaler", None)
    if scaler is None:
        return None
    captured = {"class": type(scaler).__name__}
    for key, value in sorted(vars(scaler).items()):
        if isinstance(value, _SCALER_VALUE_TYPES):
            captured[key] = value
        elif isinstance(value, torch.dtype):
            captured[key] = str(value)
        elif isinstance(value, torch.Tensor):
            captured[key] = value.detach().clone()
    return captured


def _capture_module_values(engine, names: dict[int, str]) -> dict:
    """Low-precision value of every parameter; ZeRO-3 params are gathered to full size first."""
    import deepspeed

    params = list(engine.module.named_parameters())
    module_values, frozen_values = {}, {}
    gather = engine.zero_optimization_partition_weights()
    for name, param in params:
        # One parameter per gather. Before 0.19, DeepSpeed's coalesced ZeRO-3 all-gather waits on its
        # last gloo handle only (runtime/zero/partition_parameters.py `_allgather_params_coalesced`:
        # `launch_handles[-1].wait()`, and the CPU synchronize() is a no-op), so on CPU an earlier
        # parameter could be read before its gather landed: 0.16.9 once gave rank 0 zeros for all 63
        # elements of one weight while the eval loss equalled the truth (0.15.4 once gave uninitialised
        # values). 0.19.8 waits on every handle; a single parameter takes the blocking `_allgather_params`
        # in every release.
        context = deepspeed.zero.GatheredParameters([param], modifier_rank=None) if gather else _NullContext()
        with context:
            target = module_values if id(param) in names else frozen_values
            target[name] = param.detach().clone()
    return {"module": module_values, "frozen": frozen_values}


class _NullContext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# --- master weights and optimizer state -------------------------------------------------------

def _partitioned_keys(optimizer_state: dict, flat_partitions: Iterable[torch.Tensor]) -> list[str]:
    """Tensor state keys whose tensors have the flat partition's shape, as DeepSpeed's linkage sees them.

    Sorted: the full tensors are assembled with collectives, so every rank must visit the keys in
    the same order, and after a universal load DeepSpeed fills the state in the order of a Python
    set (`map_to_flat_opt_states`), which differs between processes with different hash seeds."""
    keys: list[str] = []
    for flat in flat_partitions:
        for key, value in optimizer_state.get(flat, {}).items():
            if torch.is_tensor(value) and value.shape == flat.shape and key not in keys:
                keys.append(key)
    return sorted(keys)


def _scalars(optimizer_state: dict, flat: torch.Tensor) -> dict:
    scalars = {}
    for key, value in optimizer_state.get(flat, {}).items():
        if torch.is_tensor(value) and value.shape == flat.shape:
            continue
        scalars[key] = value.detach().clone() if torch.is_tensor(value) else value
    return scalars


def _flat_partitions_by_param(engine) -> tuple[list[torch.Tensor], dict[int, torch.Tensor]]:
    """This rank's fp32 flat tensors and, for every trainable param, the one whose state it shares."""
    optimizer = engine.optimizer
    if hasattr(optimizer, "fp32_partitioned_groups_flat"):  # ZeRO-3: one flat tensor per sub-group
        flats = list(optimizer.fp32_partitioned_groups_flat)
        holder = {}
        for sub_group, params in enumerate(optimizer.fp16_groups):
            for param in params:
                holder[id(param)] = flats[sub_group]
        return flats, holder
    flats, groups = _stage12_flat_and_params(optimizer)
    holder = {id(param): flats[index] for index, params in enumerate(groups) for param in params}
    return flats, holder


def _stage12_flat_and_params(optimizer) -> tuple[list[torch.Tensor], list[list[torch.nn.Parameter]]]:
    if hasattr(optimizer, "fp32_groups_flat_partition"):  # BF16_Optimizer
        return list(optimizer.fp32_groups_flat_partition), list(optimizer.bf16_groups)
    return list(optimizer.single_partition_of_fp32_groups), list(optimizer.bit16_groups)


def relink_optimizer_fragments(engine) -> None:
    """DeepSpeed links each param's optimizer-state views once, lazily, after the first step; a
    load replaces the state tensors, and with several groups the first link can predate the
    other groups' states. Relinking makes the getters read the current tensors."""
    optimizer = engine.optimizer
    if hasattr(optimizer, "_lazy_init_hp_params_optimizer_state"):
        optimizer._hp_optimizer_states_linked = False
        optimizer._lazy_init_hp_params_optimizer_state()


def _master_from_getters(engine) -> dict:
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    if not engine.zero_optimization():
        return _master_unpartitioned(engine)
    relink_optimizer_fragments(engine)
    names = _trainable_names(engine)
    optimizer_state = _basic_optimizer(engine).state
    flats, holder = _flat_partitions_by_param(engine)
    keys = _partitioned_keys(optimizer_state, flats)
    master = {}
    for name, param in engine.module.named_parameters():  # same order on every rank: collectives
        if id(param) not in names:
            continue
        master[name] = {
            "fp32": safe_get_full_fp32_param(param).detach().cpu().clone(),
            "state": {key: safe_get_full_optimizer_state(param, key).detach().cpu().clone() for key in keys},
            "scalars": _scalars(optimizer_state, holder[id(param)]),
        }
    return master


def _master_unpartitioned(engine) -> dict:
    """ZeRO-0: every rank holds whole masters of its own parameters (its EP rank's experts and
    every dense one), and DeepSpeed's getters return None. fp32: the client optimizer steps the
    module's parameters themselves; bf16/fp16: FP16_UnfusedOptimizer (fp16/unfused_optimizer.py)
    keeps an fp32 copy per parameter, `fp32_groups[g][i]` beside `fp16_groups[g][i]`. No collectives."""
    names = _trainable_names(engine)
    optimizer = engine.optimizer
    master_of = {id(param): param for group in _basic_optimizer(engine).param_groups for param in group["params"]}
    if hasattr(optimizer, "fp32_groups"):
        master_of = {id(lp): hp for lp_group, hp_group in zip(optimizer.fp16_groups, optimizer.fp32_groups)
                     for lp, hp in zip(lp_group, hp_group)}
    optimizer_state = _basic_optimizer(engine).state
    master = {}
    for name, param in engine.module.named_parameters():
        if id(param) not in names:
            continue
        hp = master_of[id(param)]
        entry = optimizer_state.get(hp, {})
        master[name] = {
            "fp32": hp.detach().float().cpu().clone(),
            "state": {key: value.detach().cpu().clone() for key, value in sorted(entry.items())
                      if torch.is_tensor(value) and value.shape == hp.shape},
            "scalars": _scalars(optimizer_state, hp),
        }
    return master


def _master_from_internals(engine) -> dict:
    """ZeRO-1/2 and BF16_Optimizer only: all-gather each group's fp32 partition and its state
    partitions into the padded flat group, and cut every param out at its own flat offset.

    Offsets come from DeepSpeed's own layout (`round_robin_bit16_offsets`, which honours both
    round_robin_gradients reordering and parameter_alignment padding; stage_1_and_2.py __init__),
    or are consecutive for BF16_Optimizer (bf16_optimizer.py, no reordering, no padding between params).
    """
    import torch.distributed as dist

    optimizer = engine.optimizer
    if hasattr(optimizer, "fp32_partitioned_groups_flat"):
        raise NotImplementedError("the internals route covers ZeRO-1/2 and BF16_Optimizer, not ZeRO-3")
    names = _trainable_names(engine)
    optimizer_state = _basic_optimizer(engine).state
    flats, groups = _stage12_flat_and_params(optimizer)
    keys = _partitioned_keys(optimizer_state, flats)

    def gather(local: torch.Tensor) -> torch.Tensor:
        pieces = [torch.empty_like(local) for _ in range(dist.get_world_size())]
        dist.all_gather(pieces, local.contiguous())
        return torch.cat(pieces)

    master = {}
    for group_index, flat in enumerate(flats):
        if hasattr(optimizer, "round_robin_bit16_offsets"):
            ordered = list(zip(optimizer.round_robin_bit16_groups[group_index],
                               optimizer.round_robin_bit16_offsets[group_index]))
        elif hasattr(optimizer, "round_robin_bit16_groups"):  # DeepSpeed <= 0.16: no alignment padding
            ordered, offset = [], 0
            for param in optimizer.round_robin_bit16_groups[group_index]:
                ordered.append((param, offset))
                offset += param.numel()
        else:
            ordered, offset = [], 0
            for param in groups[group_index]:
                ordered.append((param, offset))
                offset += param.numel()
        full_fp32 = gather(flat.detach())
        full_state = {key: gather(optimizer_state[flat][key].detach()) for key in keys}
        scalars = _scalars(optimizer_state, flat)
        for param, offset in ordered:
            count, shape = param.numel(), param.shape
            master[names[id(param)]] = {
                "fp32": full_fp32[offset:offset + count].view(shape).clone(),
                "state": {key: value[offset:offset + count].view(shape).clone() for key, value in full_state.items()},
                "scalars": {key: value.clone() if torch.is_tensor(value) else value for key, value in scalars.items()},
            }
    # named_parameters order, so the captured dict is laid out the same way by both routes
    order = [name for name, param in engine.module.named_parameters() if id(param) in names]
    return {name: master[name] for name in order}
