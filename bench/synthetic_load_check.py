"""Load a checkpoint with DeepSpeed's plain load_checkpoint at N ranks and compare it with a known state.

    DS_ACCELERATOR=cpu torchrun --standalone --nproc_per_node=N bench/synthetic_load_check.py \
        SAVE_DIR --model tiny --stage 2 --seed 0 --verdict verdict.json

Builds the bench model's engine (`bench_model.build_engine`, the engine make_checkpoint.py
trains), calls `engine.load_checkpoint(SAVE_DIR)` and compares, for every trainable parameter,
DeepSpeed's own view of the fp32 master and of AdamW's exp_avg / exp_avg_sq
(`deepspeed.utils.safe_get_full_fp32_param`, `safe_get_full_optimizer_state`; collective under
ZeRO-3) and the module weight, and every frozen weight, with `synthetic_checkpoint.known_tensor`
element by element. Rank 0 writes {"mismatches": [...], "checked": n} to --verdict.
Only for models small enough to gather whole.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from synthetic_checkpoint import MODELS, known_tensor, model_params  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("save_dir")
    parser.add_argument("--model", default="tiny", choices=list(MODELS))
    parser.add_argument("--stage", type=int, choices=(2, 3), required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--verdict", required=True)
    args = parser.parse_args()

    import deepspeed
    import torch
    from bench_model import build_engine
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    from reshard_proof.engine_state import relink_optimizer_fragments

    deepspeed.init_distributed(dist_backend="gloo")
    cfg = MODELS[args.model]
    engine = build_engine(cfg, args.stage, initialise=False)
    path, _ = engine.load_checkpoint(args.save_dir)
    mismatches, checked = [], 0
    if path is None:
        mismatches.append("load_checkpoint returned no path")
    relink_optimizer_fragments(engine)  # ZeRO-1/2 link the state views lazily, after a first step
    params = model_params(cfg)
    trainable_id = {name: i for i, (name, _) in enumerate(params.trainable)}
    frozen_id = {name: j for j, (name, _) in enumerate(params.frozen)}

    def compare(what: str, got, want) -> None:
        nonlocal checked
        checked += 1
        if got is None or tuple(got.shape) != tuple(want.shape) or got.dtype != want.dtype \
                or not bool(torch.equal(got, want)):
            mismatches.append(f"{what}: differs from the known state")

    for name, param in engine.module.named_parameters():
        if name in trainable_id:
            pid, shape = trainable_id[name], tuple(param.ds_shape if hasattr(param, "ds_shape") else param.shape)
            compare(f"{name} fp32", safe_get_full_fp32_param(param), known_tensor(args.seed, "fp32", pid, shape))
            for state in ("exp_avg", "exp_avg_sq"):
                compare(f"{name} {state}", safe_get_full_optimizer_state(param, state),
                        known_tensor(args.seed, state, pid, shape))
            if args.stage != 3:
                compare(f"{name} module weight", param.data, known_tensor(args.seed, "fp32", pid, shape))
        else:
            with deepspeed.zero.GatheredParameters([param], enabled=args.stage == 3):
                data = param.data.clone()
            compare(f"{name} frozen", data, known_tensor(args.seed, "frozen", frozen_id[name], tuple(data.shape)))
    views = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(views, mismatches)
    if torch.distributed.get_rank() == 0:
        everyone = sorted({m for view in views for m in view})
        with open(args.verdict + ".tmp", "w") as fd:
            json.dump({"mismatches": everyone, "checked": checked, "ranks": len(views)}, fd)
        os.replace(args.verdict + ".tmp", args.verdict)
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
