"""Train and save a DeepSpeed AutoEP checkpoint folded with AutoTP (tensor and expert parallelism together), or judge loads of one.

    DS_ACCELERATOR=cpu torchrun --standalone --nproc_per_node=4 -m reshard_proof.folded_tp_ep \
        --stage 2 --tp 2 --ep 2 --save-dir /tmp/folded [--truth /tmp/folded.truth.pt]
    DS_ACCELERATOR=cpu torchrun --standalone --nproc_per_node=2 -m reshard_proof.folded_tp_ep \
        --stage 2 --tp 2 --ep 2 --check /tmp/out --truth /tmp/folded.truth.pt --verdict /tmp/v.json [--in-job]
    DS_ACCELERATOR=cpu torchrun --standalone --nproc_per_node=4 -m reshard_proof.folded_tp_ep --tp 2 --ep 2 \
        --train 2 /tmp/z2 /tmp/z2.truth.pt --train 3 /tmp/z3 /tmp/z3.truth.pt       # several saves, one launch
    DS_ACCELERATOR=cpu torchrun --standalone --nproc_per_node=2 -m reshard_proof.folded_tp_ep --tp 2 --ep 2 \
        --load 2 native /tmp/out /tmp/z2.truth.pt /tmp/v1.json --load 3 in_job /tmp/z3 /tmp/z3.truth.pt /tmp/v2.json

reshard reads and writes these at ZeRO-1/2 (reshard.formats.deepspeed_files.deepspeed_folding) and refuses them
at ZeRO-3 (formats/deepspeed_files/deepspeed_inspect.py `_refuse_tensor_and_expert_parallel`). DeepSpeed 0.19.8 trains and saves it on
CPU ranks at ZeRO-1, 2 and 3 (module_inject/auto_ep_folding.py `build_folding_spec`: TP groups of
consecutive ranks, dense DP strided over TP lanes, EP groups of consecutive ranks that may cross TP
lanes, expert DP across EP groups). The model is `AutoEPProofModel` (two AutoEP MoE layers) with a
column-parallel `up` and a row-parallel `down` AutoTP splits, so that the save holds TP shards as
well as experts. The ranks of a TP group train on the same micro-batch (AutoTP replicates the
activations over the TP group), chosen by the dense data-parallel rank.

Truth (`--truth`, written by rank 0 after the save): every trainable parameter's full fp32
master, exp_avg, exp_avg_sq and module value (DeepSpeed's safe getters on every rank, TP shards
joined as reshard_proof.tensor_parallel does, fused AutoEP experts cut per GLOBAL expert as
reshard_proof.moe_run does; ranks holding one value must agree bit for bit) and the step
counters. `--check DIR` builds an engine at (tp, ep) from another seed, loads DIR with plain
`engine.load_checkpoint` (`--in-job`: `reshard.deepspeed.load_checkpoint`), compares every
element with the truth, trains one more step and writes a JSON verdict. `--train` and `--load`
do several saves or loads in one launch (a launch costs far more than an engine), each in a
fresh engine of its own ZeRO stage, at the launch's (tp, ep).
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn

from reshard_proof.moe_model import AUTOEP_HIDDEN, AutoEPProofModel, autoep_model_at_ep_1, build_autoep_param_groups
from reshard_proof.truth_file import write_truth

TP_FFN = 12
LAYER_SPECS = [
    {"patterns": [r"^up\.weight$"], "partition_type": "column"},
    {"patterns": [r"^down\.weight$"], "partition_type": "row"},
]


class FoldedProofModel(AutoEPProofModel):
    """AutoEPProofModel with a TP-split MLP (`up` column, `down` row) after the embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(AUTOEP_HIDDEN, TP_FFN)
        self.down = nn.Linear(TP_FFN, AUTOEP_HIDDEN)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(tokens)
        hidden = hidden + self.down(F.gelu(self.up(hidden)))
        for layer in self.model.layers:
            out = layer.mlp(layer.norm(hidden))
            hidden = hidden + (out[0] if isinstance(out, tuple) else out)
        return F.cross_entropy(self.head(hidden).float().flatten(0, -2), targets.flatten())


def folded_model_at_tp_1_ep_1() -> nn.Module:
    """`FoldedProofModel` as a run without AutoTP at autoep_size 1 holds it (`moe_model.autoep_model_at_ep_1`):
    `up` and `down` whole, each AutoEP weight's experts fused over every expert. What an export of a folded save
    is loaded into (reshard_proof.fsdp2_judge)."""
    return autoep_model_at_ep_1(FoldedProofModel())


def ds_config(stage: int, tp: int, ep: int, precision: str = "fp32") -> dict:
    """`precision`: fp32, bf16 (DeepSpeedZeroOptimizer) or bf16_optimizer (BF16_Optimizer: bf16
    at ZeRO-1 with fp32 gradient accumulation)."""
    extra = {} if precision == "fp32" else {"bf16": {"enabled": True}}
    if precision == "bf16_optimizer":
        extra["data_types"] = {"grad_accum_dtype": "fp32"}
    return {
        **extra,
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "steps_per_print": 1_000_000,
        "expert_parallel": {"enabled": True, "autoep_size": ep, "preset_model": "mixtral"},
        "tensor_parallel": {"autotp_size": tp,
                            "partition_config": {"use_default_specs": False, "layer_specs": LAYER_SPECS}},
    }


def build_engine(stage: int, tp: int, ep: int, seed: int, precision: str = "fp32"):
    """A fresh FoldedProofModel from `seed` in an engine at (tp, ep), started as in a fresh process
    even after other engines in this one (engine_setup.start_as_a_fresh_process)."""
    import deepspeed
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    from reshard_proof.engine_setup import start_as_a_fresh_process

    start_as_a_fresh_process()
    torch.manual_seed(seed)
    model = FoldedProofModel()
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=build_autoep_param_groups(model),
        optimizer=lambda groups: torch.optim.AdamW(
            split_params_into_different_moe_groups_for_optimizer([dict(group) for group in groups])),
        config=ds_config(stage, tp, ep, precision))
    return engine


def train_steps(engine, tp: int, first: int, count: int, seed: int = 0) -> list[float]:
    from reshard_proof.batches import train_batch

    dense_dp_rank = torch.distributed.get_rank() // tp  # auto_ep_folding.py `expected_folding_group_tables`
    losses = []
    for step in range(first, first + count):
        tokens, targets = train_batch(seed=seed, step=step, rank=dense_dp_rank, batch_size=2)
        loss = engine(tokens, targets)
        engine.backward(loss)
        engine.step()
        if not torch.isfinite(loss.detach()):
            raise RuntimeError(f"loss {loss.item()} at step {step}")
        losses.append(float(loss.detach()))
    return losses


def full_view(engine, tp: int) -> dict:
    """{name: {"fp32", "state", "module"}} of every trainable parameter, whole, experts by global id. Collective."""
    import deepspeed.comm as dist

    from reshard_proof.moe_run import autoep_fused_experts
    from reshard_proof.tensor_parallel import join_shards, local_state, partition_of

    params = dict(engine.module.named_parameters())
    fused = autoep_fused_experts(engine)
    mine = {}
    for name, entry in local_state(engine).items():
        if name in fused:
            first, count = fused[name]
            for local in range(count):
                mine[f"{name}.{first + local}"] = (None, {"fp32": entry["fp32"][local], "module": entry["module"][local],
                                                          "state": {k: v[local] for k, v in entry["state"].items()}})
        else:
            mine[name] = (partition_of(params[name]), entry)
    views = [None] * dist.get_world_size()
    dist.all_gather_object(views, mine)
    full = {}
    for name in sorted({n for view in views for n in view}):
        layout = views[0][name][0] if name in views[0] else None
        if layout is not None and tp > 1:  # TP shards: ranks 0..tp-1 are TP ranks 0..tp-1 of dp rank 0
            shards = [views[r][name][1] for r in range(tp)]
            join = lambda key: join_shards([s[key] for s in shards], *layout)  # noqa: E731
            full[name] = {"fp32": join("fp32"), "module": join("module"),
                          "state": {k: join_shards([s["state"][k] for s in shards], *layout)
                                    for k in shards[0]["state"]}}
            continue
        holders = [view[name][1] for view in views if name in view]
        for other in holders[1:]:
            same = torch.equal(other["fp32"], holders[0]["fp32"]) and all(
                torch.equal(other["state"][k], v) for k, v in holders[0]["state"].items())
            if not same:
                raise RuntimeError(f"ranks holding {name} disagree")
        full[name] = holders[0]
    return full


def compare(truth: dict, view: dict) -> tuple[list[str], int]:
    problems, checked = [], 0
    if sorted(truth) != sorted(view):
        problems.append(f"parameters differ: {sorted(set(truth) ^ set(view))[:6]}")
    for name in sorted(set(truth) & set(view)):
        pairs = [("fp32", truth[name]["fp32"], view[name]["fp32"]), ("module", truth[name]["module"], view[name]["module"])]
        pairs += [(k, v, view[name]["state"][k]) for k, v in truth[name]["state"].items()]
        for key, want, got in pairs:
            checked += 1
            if want.shape != got.shape or not torch.equal(want, got):
                problems.append(f"{name}.{key} differs")
    return problems, checked


def main() -> None:
    from reshard_proof.engine_setup import finish_and_exit, init_distributed

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stage", type=int)
    parser.add_argument("--train", nargs=3, action="append", default=[], metavar=("STAGE", "SAVE_DIR", "TRUTH"),
                        help="train and save one more checkpoint at this ZeRO stage in this launch")
    parser.add_argument("--load", nargs=5, action="append", default=[],
                        metavar=("STAGE", "HOW", "LOAD_DIR", "TRUTH", "VERDICT"),
                        help="judge one more load in this launch (HOW: native or in_job)")
    parser.add_argument("--tp", type=int, required=True)
    parser.add_argument("--ep", type=int, required=True)
    parser.add_argument("--precision", choices=["fp32", "bf16", "bf16_optimizer"], default="fp32")
    parser.add_argument("--save-dir")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--truth")
    parser.add_argument("--check", help="load this directory and judge it against --truth")
    parser.add_argument("--verdict")
    parser.add_argument("--in-job", action="store_true", help="load with reshard.deepspeed.load_checkpoint")
    args = parser.parse_args()

    trains = [(int(stage), save, truth) for stage, save, truth in args.train]
    loads = [(int(stage), how, load_dir, truth, verdict) for stage, how, load_dir, truth, verdict in args.load]
    if args.check is not None:
        loads.insert(0, (args.stage, "in_job" if args.in_job else "native", args.check, args.truth, args.verdict))
    elif args.save_dir is not None:
        trains.insert(0, (args.stage, args.save_dir, args.truth))
    if any(stage is None for stage, *_ in trains + loads) or any(how not in ("native", "in_job") for _, how, *_ in loads):
        parser.error("--save-dir and --check need --stage; a --load's HOW is native or in_job")
    init_distributed()
    for stage, save_dir, truth_path in trains:
        train_one(args, stage, save_dir, truth_path)
    for stage, how, load_dir, truth_path, verdict_path in loads:
        check_one(args, stage, how, load_dir, truth_path, verdict_path)
    finish_and_exit()


def train_one(args, stage: int, save_dir: str, truth_path: str | None) -> None:
    """Train a fresh engine at `stage` from seed 0, save it, write its truth. Collective."""
    rank = torch.distributed.get_rank()
    engine = build_engine(stage, args.tp, args.ep, seed=0, precision=args.precision)
    train_steps(engine, args.tp, 0, args.steps)
    engine.save_checkpoint(save_dir)
    if truth_path:
        view = full_view(engine, args.tp)
        if rank == 0:
            torch.save({"params": view, "global_steps": engine.global_steps, "steps": args.steps}, truth_path)
            if stage in (1, 2):  # what the DCP export serves of a folded save
                write_truth(judge_truth_path(truth_path), judge_truth(engine, view, stage, args))
    torch.distributed.barrier()


def judge_truth_path(truth_path) -> str:
    """Where `train_one` writes the truth reshard_proof.fsdp2_judge reads, beside `truth_path`."""
    return f"{truth_path}.fsdp2.pt"


def judge_truth(engine, view: dict, stage: int, args) -> dict:
    """The truth an export of this save is judged by in FSDP2 (reshard_proof.fsdp2_judge), in moe_run's form:
    every parameter of the model at tp 1 and ep 1, whole (`full_view`: TP shards joined, experts by global id),
    with its master, moments and step, and the engine's param groups, counters and scheduler. Rank 0."""
    optimizer = engine.optimizer.optimizer  # the client torch AdamW under ZeRO-1/2
    steps = {float(state["step"]) for state in optimizer.state.values() if "step" in state}
    if len(steps) != 1:
        raise RuntimeError(f"the optimizer's partitions hold different steps {sorted(steps)}")
    step = steps.pop()
    master = {name: {"fp32": entry["fp32"], "state": dict(entry["state"]), "scalars": {"step": step}}
              for name, entry in view.items()}
    engine_state = {
        "master": master, "frozen": {},
        "buffers": {name: buffer.detach().clone() for name, buffer in engine.module.named_buffers()
                    if not name.endswith(".tokens_per_expert")},  # AutoEP's per-rank routing counts: never saved
        "counters": {"global_steps": engine.global_steps, "global_samples": engine.global_samples,
                     "skipped_steps": engine.skipped_steps},
        "param_groups": [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups],
        "lr_scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
        "loss_scaler": None,
    }
    return {"meta": {"variant": f"autoep_folded_z{stage}_{args.precision}", "world_size":
                     torch.distributed.get_world_size(), "tp": args.tp, "ep": args.ep, "steps": args.steps},
            "engine": engine_state, "client_state": {}}


def check_one(args, stage: int, how: str, load_dir: str, truth_path: str, verdict_path: str) -> None:
    """Load `load_dir` into a fresh engine at `stage` from seed 1, judge it, write the verdict. Collective."""
    import json

    rank = torch.distributed.get_rank()
    truth = torch.load(truth_path, weights_only=False)
    engine = build_engine(stage, args.tp, args.ep, seed=1, precision=args.precision)
    error, problems, checked, extra = None, [], 0, []
    try:
        if how == "in_job":
            from reshard.deepspeed import load_checkpoint
            path, _ = load_checkpoint(engine, load_dir)
        else:
            path, _ = engine.load_checkpoint(load_dir)
        if path is None:
            error = f"load_checkpoint returned no path for {load_dir}"
    except Exception as failure:  # judged below, on every rank
        error = f"{type(failure).__name__}: {failure}"
    errors = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(errors, error)
    errors = [f"rank {r}: {e}" for r, e in enumerate(errors) if e]
    if not errors:
        problems, checked = compare(truth["params"], full_view(engine, args.tp))
        if engine.global_steps != truth["global_steps"]:
            problems.append(f"global_steps {engine.global_steps} != {truth['global_steps']}")
        extra = train_steps(engine, args.tp, truth["steps"], 1, seed=0)
    if rank == 0:
        with open(verdict_path, "w") as fd:
            json.dump({"ok": not errors and not problems and checked > 0, "load_error": errors, "mismatches": problems[:20],
                       "checked_tensors": checked, "extra_step_losses": extra, "world_size":
                       torch.distributed.get_world_size(), "tp": args.tp, "ep": args.ep, "stage": stage,
                       "how": how, "load_dir": load_dir}, fd)
    torch.distributed.barrier()

def train_folded(nproc: int, tp: int, ep: int, saves, timeout: float = 900) -> None:
    """Train and save each (stage, save_dir, truth) of `saves` at (tp, ep) over nproc ranks, in ONE launch."""
    from pathlib import Path

    from reshard_proof.launch import run_torchrun
    args = ["--tp", tp, "--ep", ep]
    for stage, save_dir, truth in saves:
        args += ["--train", stage, save_dir, truth]
    run_torchrun("reshard_proof.folded_tp_ep", nproc, args, timeout=timeout,
                 expect_files=[Path(save_dir) / "latest" for _, save_dir, _ in saves] + [truth for *_, truth in saves])


def judge_folded_together(loads, timeout: float = 1200) -> dict:
    """Judge loads (nproc, tp, ep, stage, how, load_dir, truth, verdict) with one launch per
    (nproc, tp, ep), each load in a fresh engine of its stage. {str(verdict): verdict dict, or the
    exception judging it raised} (reshard_proof.launch `judge_in_shared_launches`: a failed shared
    launch is judged again one load per launch)."""
    from reshard_proof.launch import judge_in_shared_launches
    return judge_in_shared_launches("reshard_proof.folded_tp_ep", loads, timeout=timeout,
                                    launch=lambda load: (load[0], ["--tp", load[1], "--ep", load[2]]),
                                    job_args=lambda load: ["--load", *load[3:8]], verdict=lambda load: load[7])


if __name__ == "__main__":
    main()
