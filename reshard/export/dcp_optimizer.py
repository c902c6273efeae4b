"""DeepSpeed's optimizer settings as torch.optim.AdamW's, the step of every parameter, and the run's other state.

    from reshard.export.dcp_optimizer import adamw_groups, run_state
    groups, steps = adamw_groups(source, optimizer_state, ds_config)   # [{hp..., "params": [fqn...]}], {fqn: step}
    run_state(model_states, optimizer_state)   # {"global_steps", ..., "lr_scheduler", "client_state", "loss_scaler"}

What `get_state_dict(model, torch.optim.AdamW)` holds for an FSDP2 model (torch 2.13,
torch/distributed/checkpoint/state_dict.py `_get_optim_state_dict`), and so what the export writes:
`optim.state.<fqn>.{step, exp_avg, exp_avg_sq}` (step a 0-d float32 tensor) and
`optim.param_groups.<i>.<hyperparameter>` with `params` listing the group's FQNs.

Mapping (torch/optim/adamw.py and adam.py; DeepSpeed 0.19.8 runtime/engine.py
`_configure_basic_optimizer`, ops/adam/fused_adam.py, ops/adam/cpu_adam.py):
- a torch Adam/AdamW param group (it has `decoupled_weight_decay`): AdamW when it is True, and
  Adam with weight_decay 0 is the same update;
- a DeepSpeed FusedAdam / DeepSpeedCPUAdam group (it has `bias_correction`): decoupled when the
  config's optimizer is "AdamW", or "Adam" with `adam_w_mode` true (DeepSpeed's default);
- refused, by name: Adam with L2 weight decay (`adam_w_mode` false, or torch Adam with
  weight_decay != 0: torch AdamW cannot make that update), `bias_correction` false, amsgrad,
  and every optimizer whose state is not exactly exp_avg and exp_avg_sq (SGD's momentum_buffer...).
Every hyperparameter the group holds is kept (lr, betas, eps, weight_decay, initial_lr of an LR
scheduler, a group's name), DeepSpeed's own flags are dropped, and torch AdamW's defaults fill in
what is missing.
"""
from __future__ import annotations

from reshard.errors import UnsupportedCheckpoint
from reshard.export.hf_layout import export_names
from reshard.formats.deepspeed_files import deepspeed_schema as schema
from reshard.formats.deepspeed_files.deepspeed_client_state import DEEPSPEED_MODEL_KEYS
from reshard.formats.deepspeed_files.deepspeed_spec import SourceCheckpoint

ADAM_STATES = ("exp_avg", "exp_avg_sq")
ADAMW_DEFAULTS = {"amsgrad": False, "maximize": False, "foreach": None, "capturable": False, "differentiable": False,
                  "fused": None, "decoupled_weight_decay": True}
"""torch.optim.AdamW's defaults (torch 2.13 adamw.py); foreach/fused None: the loading job's device decides."""
DEEPSPEED_GROUP_FLAGS = ("bias_correction", "adam_w_mode", "torch_adam")
RUN_STATE_NAME = "reshard_run_state.pt"


def check_adam_states(source: SourceCheckpoint) -> None:
    """Refuse an optimizer whose per-parameter state is not Adam's (before anything is written)."""
    states = tuple(s.name for s in source.spec.streams if s.name != "fp32")
    if sorted(states) != sorted(ADAM_STATES):
        raise UnsupportedCheckpoint(source.optim_path(0), f"its optimizer keeps {', '.join(states) or 'no state'} per "
                                                          "parameter, not Adam's exp_avg and exp_avg_sq: the DCP export "
                                                          "writes torch.optim.AdamW state only")


def _decoupled(group: dict, ds_config: dict, where: str) -> bool:
    if "decoupled_weight_decay" in group:
        return bool(group["decoupled_weight_decay"])
    if "bias_correction" in group:
        if not group["bias_correction"]:
            raise UnsupportedCheckpoint(where, "its Adam runs with bias_correction false; torch AdamW always "
                                               "corrects the bias")
        if "adam_w_mode" in group:
            return bool(group["adam_w_mode"])
        config = (ds_config or {}).get("optimizer") or {}
        kind = str(config.get("type", "")).lower()
        if kind == "adamw":
            return True
        return bool((config.get("params") or {}).get("adam_w_mode", True))
    raise UnsupportedCheckpoint(where, f"its optimizer param group (keys {sorted(group)}) is not Adam's: the DCP "
                                       "export writes torch.optim.AdamW state only")


def adamw_group(group: dict, names: list[str], ds_config: dict, where: str) -> dict:
    """One DeepSpeed param group as torch AdamW's, `params` the FQNs of `names`."""
    if "betas" not in group or "eps" not in group:
        raise UnsupportedCheckpoint(where, f"its optimizer param group (keys {sorted(group)}) has no betas/eps: not "
                                           "Adam, which the DCP export writes")
    decoupled = _decoupled(group, ds_config, where)
    if not decoupled and float(group.get("weight_decay", 0.0)) != 0.0:
        raise UnsupportedCheckpoint(where, f"its Adam adds weight decay {group['weight_decay']} to the gradient (L2, "
                                           "adam_w_mode false); torch AdamW decays decoupled, so the run would change")
    if group.get("amsgrad"):
        raise UnsupportedCheckpoint(where, "its Adam runs with amsgrad, whose max_exp_avg_sq DeepSpeed's checkpoint "
                                           "does not give per parameter here")
    out = {k: v for k, v in group.items() if k != "params" and k not in DEEPSPEED_GROUP_FLAGS}
    for key, value in ADAMW_DEFAULTS.items():
        out.setdefault(key, value)
    out.update(decoupled_weight_decay=True, capturable=False, differentiable=False, foreach=None, fused=None)
    out["betas"] = tuple(float(b) for b in out["betas"])
    out["params"] = list(names)
    return out


def _step_value(step, where: str) -> float:
    value = float(step.item() if hasattr(step, "item") else step)
    if value != int(value):
        raise UnsupportedCheckpoint(where, f"its Adam step {value} is not a whole number")
    return value


def adamw_groups(source: SourceCheckpoint, optimizer_state: dict, ds_config: dict) -> tuple[list[dict], dict]:
    """`optimizer_state`: rank 0's `optimizer_state_dict`. Returns torch AdamW param groups (FQN lists)
    and each trainable parameter's step (a float: the group's step, written as a 0-d float32 tensor)."""
    spec = source.spec
    where = source.optim_path(0)
    if spec.stage == 3:  # stage3.py `_rigid_state_dict`: groups list sub-group ids, state per sub-group
        inner = optimizer_state[schema.OPTIM]
        groups, state = inner["param_groups"], inner["state"]
        step_of = [[state.get(sg, {}).get("step") for sg in g["params"]] for g in groups]
    else:  # stage_1_and_2.py / bf16_optimizer.py `state_dict`: the base optimizer's, one flat tensor per group
        base = optimizer_state["base_optimizer_state"]
        groups, state = base["param_groups"], base["state"]
        step_of = [[state.get(g, {}).get("step")] for g in range(len(groups))]
    if len(groups) != len(spec.groups):
        raise UnsupportedCheckpoint(where, f"{len(groups)} optimizer param groups, but the model states name "
                                           f"{len(spec.groups)}")
    out, steps = [], {}
    exported = export_names(spec)  # an AutoEP expert's slices: one fused tensor, listed once
    for g, (group, ids) in enumerate(zip(groups, spec.groups)):
        names = list(dict.fromkeys(exported[p] for p in ids))
        out.append(adamw_group(group, names, ds_config, where))
        values = {_step_value(s, where) for s in step_of[g] if s is not None}
        if len(values) > 1:
            raise UnsupportedCheckpoint(where, f"param group {g} holds different Adam steps {sorted(values)} in its "
                                               "sub-groups; torch AdamW keeps one per parameter, from one group step")
        if not values and names:
            raise UnsupportedCheckpoint(where, f"param group {g} has no Adam step (the optimizer never stepped?)")
        for name in names:
            steps[name] = next(iter(values))
    return out, steps


LOSS_SCALER_FIELDS = ("cur_scale", "cur_iter", "last_overflow_iter", "scale_factor", "scale_window", "min_scale",
                      "delayed_shift", "cur_hysteresis", "consecutive_hysteresis", "dynamic")
"""DeepSpeed 0.19.8 runtime/fp16/loss_scaler.py: LossScaler (`cur_scale`) and DynamicLossScaler's state."""


def loss_scaler_state(optimizer_state: dict) -> dict | None:
    """An fp16 run's loss scaler from rank 0's `optimizer_state_dict` (`loss_scaler`, pickled by ZeRO's
    `state_dict`), or None where there is none to carry: no scaler, or the scale-1 `LossScaler` DeepSpeed
    creates for fp32 and bf16 runs (loss_scaler.py `CreateLossScaler`), which scales nothing.

    {"deepspeed": its attributes (LOSS_SCALER_FIELDS it has), "grad_scaler": the same state as
    `torch.amp.GradScaler.state_dict()` (torch/amp/grad_scaler.py) for a dynamic scaler, else None}.
    DeepSpeed grows the scale on an update when the clean updates before it since the last overflow,
    `c = cur_iter - last_overflow_iter - 1`, are a positive multiple of `scale_window`; GradScaler grows
    on the step where `_growth_tracker + 1` reaches `growth_interval`. So `_growth_tracker` is
    `(c - 1) mod scale_window`, and the next growth comes on the same step, except where no clean update
    came yet since the start or the last overflow (c = 0): `_growth_tracker` is then 0 and GradScaler grows
    one step before DeepSpeed would, as it always does after a backoff (tests/test_loss_scaler_state.py). DeepSpeed's hysteresis (`delayed_shift` > 1:
    overflows tolerated before backing off) and `min_scale` have no GradScaler counterpart."""
    scaler = (optimizer_state or {}).get("loss_scaler")
    if scaler is None:
        return None
    values = {k: getattr(scaler, k) for k in LOSS_SCALER_FIELDS if hasattr(scaler, k)}
    dynamic = bool(values.get("dynamic", False))
    if not dynamic and float(values.get("cur_scale", 1.0)) == 1.0:
        return None
    grad_scaler = None
    if dynamic:
        window = int(values["scale_window"])
        clean = int(values["cur_iter"]) - int(values["last_overflow_iter"]) - 1
        grad_scaler = {"scale": float(values["cur_scale"]), "growth_factor": float(values["scale_factor"]),
                       "backoff_factor": 1.0 / float(values["scale_factor"]), "growth_interval": window,
                       "_growth_tracker": (clean - 1) % window if clean >= 1 else 0}
    return {"deepspeed": values, "grad_scaler": grad_scaler}


def pipeline_adamw_groups(found, optimizer_states: list, ds_config: dict) -> tuple[list[dict], dict]:
    """adamw_groups of a PipelineModule save (`found`: reshard.export.pipeline_layout.PipelineExport):
    `optimizer_states`, per stage, its model rank 0's dp rank 0 `optimizer_state_dict`. Every stage
    runs its own optimizer with the same param groups (deepspeed.initialize's, each stage keeping the
    parameters it holds), so torch AdamW group g holds every stage's group-g parameters, each once, in
    the module's order; its hyperparameters are stage 0's, and a stage whose differ is refused by name.
    A parameter's step is its group's step on the first stage holding it (a tied one's copies step
    together: runtime/pipe/engine.py `_exec_reduce_tied_grads`)."""
    spec = found.source.spec
    first_stage = {t.name: t.stage for t in found.model.tensors if t.stage >= 0}
    order = {p.name: i for i, p in enumerate(found.params)}
    names_of, steps, hyper = {}, {}, None
    for stage, osd in enumerate(optimizer_states):
        where = found.source.optim_path(spec.topology.rank_of(0, 0, stage))
        params, groups = spec.columns[stage * spec.topology.tp]
        base = osd["base_optimizer_state"]
        kept = [{k: v for k, v in g.items() if k != "params"} for g in base["param_groups"]]
        if hyper is None:
            hyper, first = kept, where
        elif kept != hyper:
            raise UnsupportedCheckpoint(where, f"its optimizer param groups {kept} differ from those of {first} "
                                               f"({hyper}); torch AdamW keeps one set of param groups")
        if len(kept) != len(groups):
            raise UnsupportedCheckpoint(where, f"{len(kept)} optimizer param groups, but the stage's model states "
                                               f"name {len(groups)}")
        for g, ids in enumerate(groups):
            step = base["state"].get(g, {}).get("step")
            for p in ids:
                name = params[p].name
                if first_stage[name] != stage:
                    continue
                if step is None:
                    raise UnsupportedCheckpoint(where, f"param group {g} has no Adam step (the optimizer never stepped?)")
                names_of.setdefault(g, []).append(name)
                steps[name] = _step_value(step, where)
    base0 = optimizer_states[0]["base_optimizer_state"]["param_groups"]
    out = [adamw_group(group, sorted(names_of.get(g, []), key=order.__getitem__), ds_config, first)
           for g, group in enumerate(base0)]
    return out, steps


def run_state(model_states: dict, optimizer_state: dict | None = None) -> dict:
    """What `load_checkpoint` restores besides the model and optimizer, for a training script to restore
    itself: DeepSpeed's counters, the LR scheduler's state_dict, the client_state (every top-level
    key DeepSpeed did not write itself: engine.py `_save_checkpoint` merges client_state there) and an
    fp16 run's loss scaler (`loss_scaler_state`, from rank 0's `optimizer_state_dict`)."""
    return {
        "format": "reshard DCP export run state, version 1",
        "global_steps": model_states.get("global_steps"),
        "global_samples": model_states.get("global_samples"),
        "skipped_steps": model_states.get("skipped_steps"),
        "lr_scheduler": model_states.get("lr_scheduler"),
        "client_state": {k: v for k, v in model_states.items() if k not in DEEPSPEED_MODEL_KEYS},
        "loss_scaler": loss_scaler_state(optimizer_state),
    }
