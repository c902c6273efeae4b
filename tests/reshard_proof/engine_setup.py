"""Build the proof model's DeepSpeed engine on the current torchrun ranks, and train it.

Used by the torchrun entry points (train, check_load); not runnable by itself:

    torchrun --standalone --nproc_per_node=2 -m reshard_proof.train --variant z2_fp32 ...

Requires DS_ACCELERATOR=cpu in the environment (launch.py sets it).
"""

import math
import os
import sys
from datetime import timedelta

import torch

from reshard.deepspeed_version import check_installed_deepspeed
from reshard_proof.batches import eval_batch, train_batch
from reshard_proof.model import ProofModel, build_param_groups
from reshard_proof.variants import Variant

check_installed_deepspeed()  # the torchrun entry points build engines with the installed DeepSpeed

# A tiny model needs seconds per collective; when one rank fails inside a collective (say a load
# that raises on one rank only), the others should die soon rather than wait out gloo's 30 minutes.
COLLECTIVE_TIMEOUT = timedelta(minutes=3)


def init_distributed() -> None:
    """Join the torchrun process group: gloo, what CPU runs use, unless RESHARD_PROOF_BACKEND
    names another (nccl for the GPU check, bench/gpu_check.sh)."""
    import deepspeed

    backend = os.environ.get("RESHARD_PROOF_BACKEND", "gloo")
    deepspeed.init_distributed(dist_backend=backend, timeout=COLLECTIVE_TIMEOUT)


def node_path(path: str) -> str:
    """`path` with "{node}" replaced by this worker's node rank (torchrun's GROUP_RANK): a directory
    per node, as node-local storage has on real nodes, when several agents play nodes on one host."""
    return str(path).replace("{node}", os.environ.get("GROUP_RANK", "0"))


def undo_zero3_linear_patch() -> None:
    """Put torch's own linear back as torch.nn.functional.linear.

    Building a ZeRO-3 engine runs DeepSpeed's Init over the module, which replaces
    torch.nn.functional.linear by zero3_linear_wrap for the rest of the process ("This will persist
    unless manually reset": runtime/zero/partition_parameters.py `_enable_mem_efficient_linear`).
    Every nn.Linear of an engine built after it in the same process, whatever its stage, then runs
    LinearFunctionForZeroStage3 (matmul, then the bias added) instead of torch's fused addmm: the
    same weights give another eval loss in bf16/fp16 (z2_bf16: 4.985396 against 4.988028 from a
    fresh process). F.linear is the builtin torch._C._nn.linear (torch/nn/functional.py), and a
    later ZeRO-3 engine patches again, since DeepSpeed patches whenever F.linear is its backup."""
    torch.nn.functional.linear = torch._C._nn.linear


def restart_zero3_param_ids() -> None:
    """Number the next ZeRO-3 engine's parameters from 0, as in a fresh process.

    ZeRO-3's Init gives each parameter `ds_id` from a counter kept on the class for the whole
    process (runtime/zero/partition_parameters.py `Init._convert_to_deepspeed_param`:
    `param.ds_id = Init.param_id; Init.param_id += 1`), and the optimizer files save the ids of the
    flat groups' params ("9_14" for a second engine where a fresh process writes "1_6"). Only a
    dead engine of this process can hold the ids handed out before."""
    from deepspeed.runtime.zero.partition_parameters import Init
    Init.param_id = 0


def forget_sequence_parallel_mpu() -> None:
    """Drop the sp mpu an earlier Ulysses engine of this process handed to DeepSpeed's groups.

    engine.py `_configure_distributed_model` sets `groups.mpu = self.mpu` when an engine has one and
    never clears it, so every later engine of the process would partition ZeRO over that engine's
    sequence-data-parallel group and read its sp size (utils/groups.py
    `_get_sequence_parallel_world_size`). A fresh process has no mpu there. Releases before
    runtime/sequence_parallel existed (0.16 and older: tests/test_older_deepspeed.py) have none to drop."""
    try:
        from deepspeed.runtime.sequence_parallel import parallel_state_sp
    except ImportError:
        return
    from deepspeed.utils import groups
    if groups.mpu is parallel_state_sp:
        groups.mpu = None


def start_as_a_fresh_process() -> None:
    """Undo what an earlier engine of this process left behind for the next engine, of any stage
    (undo_zero3_linear_patch, restart_zero3_param_ids, forget_sequence_parallel_mpu). Every builder
    of proof engines calls it first: build_engine here, and reshard_proof.tensor_parallel and
    folded_tp_ep, which build their own models."""
    undo_zero3_linear_patch()
    restart_zero3_param_ids()
    forget_sequence_parallel_mpu()


def build_engine(variant: Variant, seed: int, ep: int = 1):
    """A fresh model from `seed`, wrapped by deepspeed.initialize with the variant's config
    (MoE and AutoEP variants: experts sharded over `ep` expert-parallel ranks). The engine starts
    from what a fresh process holds, even after other engines in this one (undo_zero3_linear_patch,
    restart_zero3_param_ids)."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    start_as_a_fresh_process()

    if variant.precision == "fp16":
        # DeepSpeed's CPU accelerator refuses fp16, but torch computes in fp16 on CPU; lying
        # here is the only way to make real fp16 ZeRO checkpoints on a CPU machine.
        get_accelerator().is_fp16_supported = lambda: True

    torch.manual_seed(seed)
    if variant.moe:
        from reshard_proof.moe_model import MoEProofModel, build_moe_param_groups
        model = MoEProofModel(ep)
        optimizer = variant.build_optimizer(build_moe_param_groups(model))
    elif variant.autoep:
        return _build_autoep_engine(variant, ep)
    elif variant.sequence_parallel:
        return _build_ulysses_engine(variant)
    else:
        model = ProofModel()
        optimizer = variant.build_optimizer(build_param_groups(model))
    if optimizer is None:  # the config names it: DeepSpeed builds it over these groups, then the scheduler
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=build_param_groups(model),
                                               lr_scheduler=variant.build_lr_scheduler, config=variant.ds_config(ep))
        return _checked(engine, variant)
    lr_scheduler = variant.build_lr_scheduler(optimizer)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=lr_scheduler,
                                           config=variant.ds_config(ep))
    return _checked(engine, variant)


def _build_autoep_engine(variant: Variant, ep: int):
    """AutoEP replaces the MoE blocks inside deepspeed.initialize, and ZeRO then wants an expert
    group (`moe: True`) in the optimizer: the optimizer and scheduler are callables, which
    DeepSpeed calls after the replacement with the remapped decay / no_decay groups
    (engine.py `_remap_model_parameters_after_module_replacement`), and the experts are split
    into `ep_size_{ep}` groups by DeepSpeed's own helper."""
    import deepspeed
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    from reshard_proof.moe_model import AutoEPProofModel, build_autoep_param_groups

    model = AutoEPProofModel()
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=build_autoep_param_groups(model),
        optimizer=lambda groups: variant.build_optimizer(split_params_into_different_moe_groups_for_optimizer(
            [dict(group) for group in groups])),
        lr_scheduler=variant.build_lr_scheduler, config=variant.ds_config(ep))
    return _checked(engine, variant)


def _build_ulysses_engine(variant: Variant):
    """UlyssesProofModel at the variant's sp size. At sp > 1 the groups come from DeepSpeed's own sp
    mpu (runtime/sequence_parallel/parallel_state_sp.py, as HF Transformers' ALST passes it), built
    before the model (DistributedAttention takes the group) and handed to initialize as `mpu`; its
    references are released first, since a process may build more than one engine."""
    import deepspeed
    from deepspeed.runtime.sequence_parallel import parallel_state_sp

    from reshard_proof.ulysses_model import UlyssesProofModel

    mpu = None
    if variant.sequence_parallel > 1:
        parallel_state_sp._release_sequence_parallel_groups()
        parallel_state_sp.initialize_sequence_parallel(variant.sequence_parallel)
        mpu = parallel_state_sp
    model = UlyssesProofModel(variant.sequence_parallel)
    optimizer = variant.build_optimizer(build_param_groups(model))
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, mpu=mpu,
                                           lr_scheduler=variant.build_lr_scheduler(optimizer),
                                           config=variant.ds_config())
    return _checked(engine, variant)


def _checked(engine, variant: Variant):
    actual = type(engine.optimizer).__name__
    if actual != variant.expected_optimizer:
        raise RuntimeError(f"variant {variant.name}: DeepSpeed chose {actual}, expected {variant.expected_optimizer}")
    base = type(getattr(engine.optimizer, "optimizer", None)).__name__
    if variant.optimizer == "ds_cpu_adam" and base != "DeepSpeedCPUAdam":
        raise RuntimeError(f"variant {variant.name}: DeepSpeed optimizes with {base}, expected DeepSpeedCPUAdam")
    return engine


def train_steps(engine, *, seed: int, first_step: int, count: int) -> list[float]:
    """Run `count` optimizer steps on this rank's own micro-batches; returns this rank's losses."""
    import deepspeed.comm as dist

    # the ranks of one sequence-parallel group share a micro-batch (each trains on its slice of it)
    rank = dist.get_rank() // max(getattr(engine.module, "sequence_parallel", 1), 1)
    engine.train()
    losses = []
    for step in range(first_step, first_step + count):
        tokens, targets = train_batch(seed=seed, step=step, rank=rank,
                                      batch_size=engine.train_micro_batch_size_per_gpu())
        tokens, targets = tokens.to(engine.device), targets.to(engine.device)
        loss = engine(tokens, targets)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach().float()))
    return losses


def finish_and_exit() -> None:
    """Leave the process group, then exit without interpreter teardown.

    About one launch in forty to seventy dies at teardown with "terminate called without an active
    exception" (a C++ thread object destroyed while joinable) after all its work is done. Skipping
    the static destructors with os._exit avoids that path; how much it helps was not measured, so
    launch.py still retries a run that died after writing its files."""
    import deepspeed.comm as dist

    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def eval_loss(engine) -> torch.Tensor:
    """Loss on the fixed eval batch, eval mode, no_grad: it changes no state (running stats
    update only in training). Collective under ZeRO-3, where the forward gathers params."""
    tokens, targets = eval_batch()
    tokens, targets = tokens.to(engine.device), targets.to(engine.device)
    engine.eval()
    with torch.no_grad():
        loss = engine(tokens, targets).detach().float().cpu().clone()
    engine.train()
    return loss


def all_finite(values: list[float]) -> bool:
    return all(math.isfinite(value) for value in values)
