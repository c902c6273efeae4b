"""Load reshard's DCP exports into a real FSDP2 model and torch.optim.AdamW, and judge them against DeepSpeed's truth.

    torchrun --standalone --nproc_per_node=3 -m reshard_proof.fsdp2_judge \
        --case /tmp/z2-dcp /tmp/z2.truth.pt /tmp/z2-dcp.verdict3.json [--case ...]

For each case, on every rank: ProofModel from another seed, `fully_shard` (gloo, CPU: every parameter a
DTensor Shard(0)), AdamW with torch's default hyperparameters (so a lost one shows), then
`get_state_dict` -> `dcp.load` -> `set_state_dict`, as a training script resuming from DCP does. Then,
comparing full tensors (`full_tensor()`) with the truth the DeepSpeed engine recorded when it saved:
(A native DeepSpeed MoE save's truth, reshard_proof.moe_run's, names every expert globally: judged in
`MoEProofModel` built at ep 1, whose state_dict() names them so, with the param groups DeepSpeed's
`split_params_into_different_moe_groups_for_optimizer` makes, built by name after `fully_shard`. An AutoEP
save's truth is judged in `AutoEPProofModel` with DeepSpeed's AutoEP layers built at autoep_size 1
(`moe_model.autoep_model_at_ep_1`: `experts.w1/w2/w3` fused over every expert), the truth's expert slices
stacked likewise (`moe_model.fused_autoep_truth`).
A truth directory is a PipelineModule save's, tests/pipeline_run.py's: reshard_proof.pipeline_truth gives
it this shape and the model, its layers under PipelineModule.state_dict()'s names. An AutoTP save's truth,
reshard_proof.tensor_parallel's, holds every parameter joined whole: `tensor_parallel.judge_truth`, its model
built whole.)
- every trainable parameter equals its fp32 master, every frozen parameter and persistent buffer
  its saved value (upcast), exp_avg, exp_avg_sq and step equal DeepSpeed's, and every group's
  lr, betas, eps, weight_decay, initial_lr and name equal the DeepSpeed optimizer's;
- an fp16 run's loss scaler is in the run state as DeepSpeed saved it, and as a torch.amp.GradScaler
  state with the same scale and window (None where the run scaled nothing);
- the export's `.metadata` names the same keys, sizes, dtypes and state-dict paths as the one
  `dcp.save` writes for the model and optimizer just loaded (torch's own writer as the reference);
- one more AdamW step, with one fixed full gradient per parameter (the same on every rank,
  distributed as the parameter is), gives exactly the parameters that torch AdamW gives from the
  truth's masters, moments, step and hyperparameters on plain tensors: the update DeepSpeed's
  ZeRO runs with a client torch AdamW (it steps the same torch AdamW on its flat fp32 partition,
  element by element the same arithmetic), here with FSDP2's sharded state. Bit for bit.
Rank 0 writes the verdict (JSON: checks made, mismatches) atomically; exit 0 whatever the verdict.
With `--device cuda` (bench/gpu_check.sh) the model, its shards and the step live on the GPU over NCCL,
one rank per GPU; values are compared on the CPU, and the step's reference stays torch AdamW on the CPU,
so a CUDA kernel that rounds differently shows as a mismatch in the step's lines alone.
"""
import argparse
import json
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import distribute_tensor

from reshard_proof import pipeline_truth, tensor_parallel
from reshard_proof.bitwise import compare_trees
from reshard_proof.folded_tp_ep import folded_model_at_tp_1_ep_1
from reshard_proof.model import ProofModel, build_param_groups
from reshard_proof.moe_model import (
    MoEProofModel,
    autoep_model_at_ep_1,
    build_autoep_param_groups_by_name,
    build_moe_param_groups_by_name,
    fused_autoep_truth,
)
from reshard_proof.truth_file import read_truth
from reshard_proof.variants import decaying_lr_factor

HYPERPARAMETERS = ("lr", "betas", "eps", "weight_decay", "initial_lr", "name")
GRADIENT_SEED = 20261128


def full(value):
    return (value.full_tensor() if hasattr(value, "full_tensor") else value).cpu()


def fixed_gradients(shapes: dict) -> dict:
    generator = torch.Generator().manual_seed(GRADIENT_SEED)
    return {name: torch.randn(shape, generator=generator) for name, shape in shapes.items()}


def metadata_differences(ours, theirs, missing_ok=()) -> list[str]:
    """What our `.metadata` says differently from the one `dcp.save` wrote for the same model and
    optimizer: keys, tensor or bytes, sizes, dtypes, each key's path (`planner_data`). Chunks and
    files may differ (they are the writer's choice); `missing_ok`: keys we may lack."""
    found = []
    a, b = ours.state_dict_metadata, theirs.state_dict_metadata
    lacking = sorted(set(b) - set(a) - set(missing_ok))
    extra = sorted(set(a) - set(b))
    if lacking or extra:
        found.append(f"keys: ours lacks {lacking}, has extra {extra}")
    for key in sorted(set(a) & set(b)):
        if type(a[key]) is not type(b[key]):
            found.append(f"{key}: {type(a[key]).__name__} where dcp.save writes {type(b[key]).__name__}")
        elif hasattr(b[key], "size") and (a[key].size != b[key].size or a[key].properties.dtype != b[key].properties.dtype):
            found.append(f"{key}: {a[key].size} {a[key].properties.dtype} where dcp.save writes "
                         f"{b[key].size} {b[key].properties.dtype}")
        if ours.planner_data.get(key) != theirs.planner_data.get(key):
            found.append(f"{key}: path {ours.planner_data.get(key)} where dcp.save writes {theirs.planner_data.get(key)}")
    return found


def judge_case(directory: str, truth_path: str, seed: int, resave_to: str, device: str = "cpu") -> dict:
    # a directory: a PipelineModule save's truth (tests/pipeline_run.py), judged in a model of its layers
    # under PipelineModule.state_dict()'s names (reshard_proof.pipeline_truth)
    # a file reshard_proof.tensor_parallel wrote: an AutoTP save's, judged in its model built whole (tp 1)
    pipeline = os.path.isdir(truth_path)
    truth = pipeline_truth.judge_truth(truth_path) if pipeline else read_truth(truth_path)
    autotp = not pipeline and tensor_parallel.is_truth(truth)
    variant = "" if pipeline else str(truth.get("meta", {}).get("variant", ""))
    moe, autoep = variant.startswith("moe_"), variant.startswith("autoep_")
    if autoep:
        truth = dict(truth, engine=fused_autoep_truth(truth["engine"]))
    if autotp:
        truth = tensor_parallel.judge_truth(truth)
    engine = truth["engine"]
    torch.manual_seed(seed)
    if pipeline:
        model = pipeline_truth.proof_model(truth["model"])
    elif moe:  # every global expert in one module: the same model at ep 1
        model = MoEProofModel(ep=1)
    elif autoep:  # DeepSpeed's AutoEP layers built at autoep_size 1: every expert in one fused tensor per weight
        # (a folded TP+EP save's: its model at tp 1 too, reshard_proof.folded_tp_ep)
        model = folded_model_at_tp_1_ep_1() if variant.startswith("autoep_folded_") else autoep_model_at_ep_1()
    else:
        model = tensor_parallel.MODELS[truth["model"]]() if autotp else ProofModel()
    model = model.to(device)
    fully_shard(model)
    if pipeline:
        groups = pipeline_truth.proof_param_groups(model, truth["model"])
    elif moe:
        groups = build_moe_param_groups_by_name(model)
    elif autoep:
        groups = build_autoep_param_groups_by_name(model)
    else:
        groups = tensor_parallel.param_groups(model) if autotp else build_param_groups(model)
    optimizer = torch.optim.AdamW(groups)
    # built before the load, as a training script does: it gives each group its initial_lr, and dcp.load
    # reads only the keys the state dict it is given holds. A DeepSpeed scheduler from the config
    # (WarmupDecayLR) has no torch class: its saved state is compared as it is.
    torch_scheduler = "lr_lambdas" in (engine.get("lr_scheduler") or {})
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, decaying_lr_factor) if torch_scheduler else None
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    # frozen parameters excluded at save are in no DeepSpeed file, so not in the export: the model
    # keeps its own (this model builds them from a fixed seed), as DeepSpeed's load_module_strict=False does
    partial = bool(truth["meta"].get("exclude_frozen_parameters"))
    dcp.load(state, checkpoint_id=directory, planner=DefaultLoadPlanner(allow_partial_load=partial))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=StateDictOptions(strict=not partial))
    run_state = torch.load(os.path.join(directory, "reshard_run_state.pt"), weights_only=True)
    if scheduler is not None:
        scheduler.load_state_dict(run_state["lr_scheduler"])

    checks, mismatches = 0, []

    def same(what: str, got, want) -> None:
        nonlocal checks
        checks += 1
        if torch.is_tensor(want):
            ok = torch.is_tensor(got) and got.shape == want.shape and torch.equal(got.to(want.dtype), want)
        else:
            ok = got == want
        if not ok:
            mismatches.append(f"{what}: got {got!r:.200} want {want!r:.200}")

    trainable = {}
    for name, param in model.named_parameters():
        value = full(param.detach())
        if name in engine["master"]:
            trainable[name] = param
            same(f"model.{name}", value, engine["master"][name]["fp32"])
            opt_state = optimizer.state[param]
            for key in ("exp_avg", "exp_avg_sq"):
                same(f"optim.state.{name}.{key}", full(opt_state[key]), engine["master"][name]["state"][key])
            same(f"optim.state.{name}.step", float(opt_state["step"]), float(engine["master"][name]["scalars"]["step"]))
        elif name in engine["frozen"]:
            same(f"model.{name} (frozen)", value, engine["frozen"][name].float())
        else:
            mismatches.append(f"{name}: neither trainable nor frozen in the truth")
    for name, buffer in model.named_buffers():
        if name in engine["buffers"]:
            same(f"model.{name} (buffer)", full(buffer), engine["buffers"][name])
    if set(trainable) != set(engine["master"]):
        mismatches.append(f"trainable parameters {sorted(trainable)} != the truth's {sorted(engine['master'])}")
    for g, (group, want) in enumerate(zip(optimizer.param_groups, engine["param_groups"])):
        for key in HYPERPARAMETERS:
            if key in want:
                same(f"param_groups[{g}].{key}", group.get(key), want[key])

    for key, want in engine["counters"].items():
        same(f"run state {key}", run_state[key], want)
    scheduler_state = scheduler.state_dict() if scheduler is not None else run_state["lr_scheduler"]
    compared = [("client_state", truth["client_state"], run_state["client_state"])]
    if "lr_scheduler" in engine:
        compared.insert(0, ("lr scheduler", engine["lr_scheduler"], scheduler_state))
    for what, want, got in compared:
        checks += 1
        comparison = compare_trees(want, got)
        if not comparison.ok:
            mismatches.append(f"{what}: {'; '.join(comparison.mismatches)}")

    # an fp16 run's loss scaler: DeepSpeed's attributes as it saved them, and a torch.amp.GradScaler loaded
    # from the carried state holds the same scale and window; a run with nothing to scale carries None
    scaler, carried = engine.get("loss_scaler"), run_state.get("loss_scaler")
    if scaler and (scaler.get("dynamic") or scaler.get("cur_scale", 1.0) != 1.0):
        saved = (carried or {}).get("deepspeed") or {}
        for key in ("cur_scale", "cur_iter", "last_overflow_iter", "scale_factor", "scale_window", "dynamic"):
            if key in scaler:
                same(f"loss scaler {key}", saved.get(key), scaler[key])
        if scaler.get("dynamic") and carried and carried.get("grad_scaler"):
            grad_scaler = torch.amp.GradScaler("cpu")
            grad_scaler.load_state_dict(carried["grad_scaler"])
            same("GradScaler scale", grad_scaler.get_scale(), scaler["cur_scale"])
            same("GradScaler growth_interval", grad_scaler.get_growth_interval(), scaler["scale_window"])
        elif scaler.get("dynamic"):
            mismatches.append("loss scaler: a dynamic DeepSpeed scaler, but no GradScaler state carried")
    else:
        same("loss scaler (none to carry)", carried, None)

    # the format against torch's own: dcp.save of the state just loaded writes the same keys, sizes,
    # dtypes and paths as the export's .metadata (exported with the default --dtype fp32)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=resave_to)
    frozen = [f"model.{name}" for name in engine["frozen"]] if partial else []
    checks += 1
    for difference in metadata_differences(FileSystemReader(directory).read_metadata(),
                                           FileSystemReader(resave_to).read_metadata(), frozen):
        mismatches.append(f".metadata: {difference}")

    # one more step: the same fixed full gradient on FSDP2's shards and on plain tensors from the truth
    gradients = fixed_gradients({name: tuple(p.shape) for name, p in trainable.items()})
    for name, param in trainable.items():
        param.grad = distribute_tensor(gradients[name].to(param.device), param.device_mesh, param.placements)
    optimizer.step()
    names_of = {id(p): n for n, p in trainable.items()}
    plain, groups = {}, []
    for g, group in enumerate(optimizer.param_groups):
        want = engine["param_groups"][g]
        names = [names_of[id(p)] for p in group["params"]]
        tensors = []
        for name in names:
            plain[name] = torch.nn.Parameter(engine["master"][name]["fp32"].clone())
            plain[name].grad = gradients[name].clone()
            tensors.append(plain[name])
        groups.append({"params": tensors, "lr": want["lr"], "betas": want["betas"], "eps": want["eps"],
                       "weight_decay": want["weight_decay"]})
    reference = torch.optim.AdamW(groups)
    for name, param in plain.items():
        master = engine["master"][name]
        reference.state[param] = {"step": torch.tensor(float(master["scalars"]["step"]), dtype=torch.float32),
                                  "exp_avg": master["state"]["exp_avg"].clone(),
                                  "exp_avg_sq": master["state"]["exp_avg_sq"].clone()}
    reference.step()
    for name, param in trainable.items():
        same(f"after one more step: {name}", full(param.detach()), plain[name].detach())
        same(f"after one more step: {name}.exp_avg_sq", full(optimizer.state[param]["exp_avg_sq"]),
             reference.state[plain[name]]["exp_avg_sq"])
    return {"checks": checks, "mismatches": mismatches, "world_size": dist.get_world_size()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", nargs=3, action="append", required=True, metavar=("DCP_DIR", "TRUTH", "VERDICT"))
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args()
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    for i, (directory, truth_path, verdict_path) in enumerate(args.case):
        try:
            verdict = judge_case(directory, truth_path, seed=1000 + i, resave_to=verdict_path + ".resaved",
                                 device=args.device)
        except (Exception, CheckpointException) as error:  # a load that raises is a verdict too, the test reads it
            verdict = {"checks": 0, "mismatches": [f"{type(error).__name__}: {error}"],
                       "world_size": dist.get_world_size()}
        if dist.get_rank() == 0:
            with open(verdict_path + ".partial", "w") as out:
                json.dump(verdict, out, indent=1)
            os.replace(verdict_path + ".partial", verdict_path)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
