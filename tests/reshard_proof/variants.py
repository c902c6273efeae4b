"""DeepSpeed configurations the harness trains, saves and judges, one `Variant` per name.

    python -m reshard_proof.variants            # list the variants
    python -m reshard_proof.variants z2_fp32    # print one variant's ds_config as JSON

Every variant trains the same model with a client optimizer built here (two param groups with
different hyperparameters), gradient clipping and an LR scheduler, so that a checkpoint carries
per-group hyperparameters and non-trivial scheduler state.
"""

import dataclasses
import json
import sys
from dataclasses import dataclass
from typing import Literal

import torch

from reshard_proof.model import DECAY_GROUP, NO_DECAY_GROUP

MICRO_BATCH_SIZE = 2
GRADIENT_CLIPPING = 1.0
# Small so the fp16 loss scale stays far from overflow in a tiny model yet starts off the default.
FP16_INITIAL_SCALE_POWER = 8
# Short, so a few steps without overflow already grow the scale and move the scaler's counters.
FP16_LOSS_SCALE_WINDOW = 2
# Large enough that one of the first three scaled backwards overflows fp16 (step 1 of 0..2 on the
# reference machine, with hysteresis 1): one skipped step, a cut scale, a lagging scheduler.
FP16_OVERFLOW_SCALE_POWER = 15
SGD_MOMENTUM = 0.9
CPU_ADAM_HYPERPARAMETERS = {"betas": (0.9, 0.95), "eps": 1e-8}
Z3_SUBGROUP_SIZE = 8


def decaying_lr_factor(step: int) -> float:
    """LambdaLR factor: a module-level function, because a lambda would not survive pickling."""
    return 0.9 ** step / (1 + 0.5 * step)


@dataclass(frozen=True)
class Variant:
    """One DeepSpeed setup: ZeRO stage, precision, optimizer and the layout options under test."""

    name: str
    """Registry key, also written into truth and verdict files."""
    zero_stage: Literal[0, 1, 2, 3]
    """zero_optimization.stage (0: no ZeRO, for native MoE only)."""
    precision: Literal["fp32", "fp16", "bf16"]
    """Module dtype; fp16 uses dynamic loss scaling."""
    expected_optimizer: str
    """Class name of engine.optimizer that DeepSpeed must pick; train asserts it."""
    optimizer: Literal["adamw", "sgd_momentum", "ds_cpu_adam"] = "adamw"
    """Client optimizer; sgd_momentum keeps `momentum_buffer` instead of exp_avg/exp_avg_sq;
    ds_cpu_adam: DeepSpeedCPUAdam, which DeepSpeed builds from the config's AdamW under optimizer
    offload (engine.py `get_optimizer_configuration`), else handed in as the client optimizer."""
    scheduler: Literal["lambda", "warmup_decay"] = "lambda"
    """torch LambdaLR passed to initialize, or DeepSpeed's WarmupDecayLR from the config."""
    fp32_grad_accum: bool = False
    """data_types.grad_accum_dtype=fp32; with bf16 + ZeRO-1 this selects BF16_Optimizer."""
    sub_group_size: int | None = None
    """zero_optimization.sub_group_size (stage 3); None keeps DeepSpeed's default (1e9)."""
    round_robin_gradients: bool = False
    """zero_optimization.round_robin_gradients: the flat order of params depends on world size."""
    parameter_alignment: bool = False
    """zero_optimization.parameter_alignment: padding between params in the flat groups."""
    exclude_frozen_parameters: bool = False
    """save_checkpoint(exclude_frozen_parameters=True); load then needs load_module_strict=False."""
    fp16_initial_scale_power: int = FP16_INITIAL_SCALE_POWER
    """fp16.initial_scale_power: the dynamic loss scale starts at 2**power."""
    fp16_hysteresis: int = 2
    """fp16.hysteresis: overflows tolerated before the scale is cut."""
    node_local_storage: bool = False
    """checkpoint.use_node_local_storage: each node saves its part into its own directory."""
    moe: bool = False
    """Train the native DeepSpeed MoE model (reshard_proof.moe_model) at an expert-parallel size
    given at launch (reshard_proof.moe_run --ep), instead of the proof model."""
    autoep: bool = False
    """Train reshard_proof.moe_model.AutoEPProofModel under AutoEP at the launch's --ep."""
    load_universal: bool = False
    """checkpoint.load_universal: the engine loads DeepSpeed's universal checkpoints (an oracle)."""
    offload: bool = False
    """ZeRO-Offload: zero_optimization.offload_optimizer {device: cpu}, and at stage 3 offload_param
    too. `NAME@nooffload` is the variant without offload (the same DeepSpeedCPUAdam, as a client
    optimizer), the engine an offload save is also loaded into."""
    sequence_parallel: int = 0
    """DeepSpeed Ulysses: train reshard_proof.ulysses_model.UlyssesProofModel with this
    sequence_parallel_size (1: the same model without sp, the engine an sp save is resharded for);
    0: not an sp variant. `NAME@spK` is the variant at sp K."""

    def ds_config(self, ep: int = 1) -> dict:
        """The DeepSpeed config dict; train_batch_size is left for DeepSpeed to derive from W.
        `ep`: AutoEP's autoep_size (AutoEP variants only)."""
        zero: dict = {"stage": self.zero_stage}
        if self.zero_stage == 3:
            # Partition every parameter, however small; the default threshold (1e5) would keep
            # this whole model resident and leave the stage-3 partitioning of params untested.
            zero["stage3_param_persistence_threshold"] = 0
        if self.sub_group_size is not None:
            zero["sub_group_size"] = self.sub_group_size
        if self.round_robin_gradients:
            zero["round_robin_gradients"] = True
        if self.parameter_alignment:
            zero["parameter_alignment"] = True

        config: dict = {
            "train_micro_batch_size_per_gpu": MICRO_BATCH_SIZE,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": GRADIENT_CLIPPING,
            "zero_optimization": zero,
            "steps_per_print": 1_000_000,
            "wall_clock_breakdown": False,
        }
        if self.precision == "fp16":
            config["fp16"] = {
                "enabled": True,
                "loss_scale": 0,  # 0 means dynamic
                "initial_scale_power": self.fp16_initial_scale_power,
                "loss_scale_window": FP16_LOSS_SCALE_WINDOW,
                "hysteresis": self.fp16_hysteresis,
                "min_loss_scale": 1,
            }
        elif self.precision == "bf16":
            config["bf16"] = {"enabled": True}
        if self.fp32_grad_accum:
            config["data_types"] = {"grad_accum_dtype": "fp32"}
        if self.optimizer == "sgd_momentum":
            config["zero_allow_untested_optimizer"] = True
        if self.load_universal:
            config.setdefault("checkpoint", {})["load_universal"] = True
        if self.autoep:
            config["expert_parallel"] = {"enabled": True, "autoep_size": ep, "preset_model": "mixtral"}
        if self.node_local_storage:
            config.setdefault("checkpoint", {})["use_node_local_storage"] = True
        if self.offload:
            zero["offload_optimizer"] = {"device": "cpu"}
            if self.zero_stage == 3:
                zero["offload_param"] = {"device": "cpu"}
        if self.optimizer == "ds_cpu_adam" and self.offload:
            # the type users write; DeepSpeed picks DeepSpeedCPUAdam for it under offload
            config["optimizer"] = {"type": "AdamW", "params": dict(CPU_ADAM_HYPERPARAMETERS)}
        if self.sequence_parallel > 1:
            # as HF Transformers / ALST write it; the groups come from the sp mpu (engine_setup)
            config["sequence_parallel_size"] = self.sequence_parallel
        if self.scheduler == "warmup_decay":
            # Per-group lists: a scalar (or DeepSpeed's default when left out) would give both
            # groups the same lr and hide a lost per-group hyperparameter.
            config["scheduler"] = {
                "type": "WarmupDecayLR",
                "params": {"total_num_steps": 50, "warmup_num_steps": 3, "warmup_type": "linear",
                           "warmup_min_lr": [1e-5, 3e-5],
                           "warmup_max_lr": [DECAY_GROUP["lr"], NO_DECAY_GROUP["lr"]]},
            }
        return config

    def build_optimizer(self, param_groups: list[dict]) -> torch.optim.Optimizer | None:
        """The client optimizer, over groups that already carry their own lr and weight_decay; None
        where the config names it (ds_cpu_adam under offload: deepspeed.initialize builds it)."""
        if self.optimizer == "ds_cpu_adam":
            if self.offload:
                return None
            from deepspeed.ops.adam import DeepSpeedCPUAdam
            return DeepSpeedCPUAdam(param_groups, adamw_mode=True, **CPU_ADAM_HYPERPARAMETERS)
        if self.optimizer == "adamw":
            return torch.optim.AdamW(param_groups, betas=(0.9, 0.95), eps=1e-8)
        return torch.optim.SGD(param_groups, momentum=SGD_MOMENTUM, dampening=0.1, nesterov=False)

    def build_lr_scheduler(self, optimizer: torch.optim.Optimizer):
        """A torch scheduler to hand to deepspeed.initialize, or None when the config has one."""
        if self.scheduler == "lambda":
            return torch.optim.lr_scheduler.LambdaLR(optimizer, decaying_lr_factor)
        return None


def _plain(stage: int, precision: str, **overrides) -> Variant:
    if stage == 3:
        expected = "DeepSpeedZeroOptimizer_Stage3"
    else:
        expected = "DeepSpeedZeroOptimizer"
    fields = dict(name=f"z{stage}_{precision}", zero_stage=stage, precision=precision, expected_optimizer=expected,
                  scheduler="warmup_decay" if stage == 1 else "lambda")
    fields.update(overrides)
    return Variant(**fields)


def _registry() -> dict[str, Variant]:
    variants = [_plain(stage, precision) for stage in (1, 2, 3) for precision in ("fp32", "fp16", "bf16")]
    variants += [
        Variant("bf16_optimizer", 1, "bf16", "BF16_Optimizer", fp32_grad_accum=True, scheduler="warmup_decay"),
        _plain(3, "fp32", name="z3_subgroups", sub_group_size=Z3_SUBGROUP_SIZE),
        _plain(2, "fp32", name="z2_round_robin", round_robin_gradients=True),
        _plain(2, "fp32", name="z2_param_alignment", parameter_alignment=True),
        _plain(1, "bf16", name="z1_bf16_param_alignment", parameter_alignment=True),
        _plain(2, "fp32", name="z2_exclude_frozen", exclude_frozen_parameters=True),
        _plain(3, "fp32", name="z3_exclude_frozen", exclude_frozen_parameters=True),
        _plain(2, "fp32", name="z2_sgd_momentum", optimizer="sgd_momentum"),
        _plain(3, "fp32", name="z3_sgd_momentum", optimizer="sgd_momentum"),
        _plain(2, "fp32", name="z2_node_local", node_local_storage=True),
        _plain(3, "bf16", name="z3_node_local", node_local_storage=True),
        # Beyond the required set: a scale so large that an early step overflows and is skipped,
        # so skipped_steps, last_overflow_iter, Adam's step < global_steps and a scheduler that
        # lags global_steps are all exercised.
        # Native DeepSpeed MoE (expert parallelism): see reshard_proof.moe_run. Four param groups
        # (decay, no_decay and their expert halves), so the two-group WarmupDecayLR lists do not fit.
        _plain(1, "fp32", name="moe_z1_fp32", moe=True, scheduler="lambda"),
        _plain(2, "fp32", name="moe_z2_fp32", moe=True),
        _plain(2, "bf16", name="moe_z2_bf16", moe=True),
        Variant("moe_bf16_optimizer", 1, "bf16", "BF16_Optimizer", fp32_grad_accum=True, moe=True),
        # AutoEP (also reshard_proof.moe_run): decay, no_decay and the engine's `ep_size_{ep}` group.
        _plain(2, "fp32", name="autoep_z2_fp32", autoep=True, scheduler="lambda"),
        _plain(1, "bf16", name="autoep_z1_bf16", autoep=True, scheduler="lambda"),  # checked by hand, not in CI
        _plain(3, "fp32", name="autoep_z3_fp32", autoep=True, scheduler="lambda"),
        Variant("autoep_bf16_optimizer", 1, "bf16", "BF16_Optimizer", fp32_grad_accum=True, autoep=True,
                scheduler="lambda"),
        # ZeRO-0 MoE: the client torch optimizer as is (fp32), or wrapped by FP16_UnfusedOptimizer
        # in bf16 (engine.py `_do_optimizer_sanity_check`: DDP_BFLOAT16); DeepSpeed writes one
        # optimizer file per EP rank (`expp_rank_{e}_mp_rank_00_optim_states.pt`).
        Variant("moe_z0_fp32", 0, "fp32", "AdamW", moe=True),
        Variant("moe_z0_bf16", 0, "bf16", "FP16_UnfusedOptimizer", moe=True),
        # DeepSpeed Ulysses sequence parallelism (reshard_proof.ulysses_model), saved at sp 2;
        # `ulysses_z2@sp1` is the same variant at sp 1 (the engine a (sp 1, dp M) target loads into).
        _plain(2, "fp32", name="ulysses_z2", sequence_parallel=2),
        _plain(3, "bf16", name="ulysses_z3", sequence_parallel=2),
        # ZeRO-Offload (DeepSpeedCPUAdam, a CPU op DeepSpeed builds once: reshard_proof.cpu_ops).
        _plain(2, "fp32", name="z2_offload", optimizer="ds_cpu_adam", offload=True),
        _plain(3, "bf16", name="z3_offload", optimizer="ds_cpu_adam", offload=True),
        _plain(2, "fp16", name="z2_fp16_overflow", fp16_initial_scale_power=FP16_OVERFLOW_SCALE_POWER,
               fp16_hysteresis=1),
    ]
    return {variant.name: variant for variant in variants}


VARIANTS: dict[str, Variant] = _registry()


STAGE_SUFFIX = "@stage"
SEQUENCE_PARALLEL_SUFFIX = "@sp"
NO_OFFLOAD_SUFFIX = "@nooffload"


def get_variant(name: str) -> Variant:
    """The registered variant called `name`; the error lists the known names.

    `NAME@stageS` is variant NAME at ZeRO stage S, everything else (scheduler, optimizer,
    precision, the name written into truth files) unchanged: the engine a checkpoint resharded
    with `--target-stage S` loads into, or a native save at that stage to compare it with."""
    base, _, stage = name.partition(STAGE_SUFFIX)
    base, _, sp = base.partition(SEQUENCE_PARALLEL_SUFFIX)
    base, no_offload, _ = base.partition(NO_OFFLOAD_SUFFIX)
    try:
        variant = VARIANTS[base]
    except KeyError:
        raise KeyError(f"unknown variant {name!r}; known: {', '.join(VARIANTS)}") from None
    if sp:
        if not sp.isdigit() or int(sp) < 1 or not variant.sequence_parallel:
            raise KeyError(f"{name!r}: a sequence-parallel suffix is @spK (K >= 1), on a sequence-parallel variant")
        variant = dataclasses.replace(variant, sequence_parallel=int(sp))
    if no_offload:
        if not variant.offload:
            raise KeyError(f"{name!r}: {NO_OFFLOAD_SUFFIX} goes on an offload variant")
        variant = dataclasses.replace(variant, offload=False)
    if not stage:
        return variant
    if stage not in ("1", "2", "3") or variant.expected_optimizer == "BF16_Optimizer":
        raise KeyError(f"{name!r}: a stage suffix is @stage1, @stage2 or @stage3, on a ZeRO variant")
    expected = "DeepSpeedZeroOptimizer_Stage3" if stage == "3" else "DeepSpeedZeroOptimizer"
    if stage == "3":  # stage 3 knows neither (stage3.py); ZeRO-1 and 2 both honour them
        variant = dataclasses.replace(variant, round_robin_gradients=False, parameter_alignment=False)
    return dataclasses.replace(variant, zero_stage=int(stage), expected_optimizer=expected)


if __name__ == "__main__":
    if len(sys.argv) > 1:
        chosen = get_variant(sys.argv[1])
        print(json.dumps({"variant": dataclasses.asdict(chosen), "ds_config": chosen.ds_config()}, indent=2))
    else:
        for variant in VARIANTS.values():
            print(f"{variant.name:26s} stage={variant.zero_stage} {variant.precision:4s} "
                  f"{variant.optimizer:12s} {variant.expected_optimizer}")
