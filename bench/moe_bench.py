"""The MoE row: a native DeepSpeed MoE ZeRO-2 checkpoint, (ep 1, dp 2) -> (ep 1, dp 1).

    python bench/moe_bench.py [--cache-dir bench/.cache] [--workers 2]

A model of token embedding, one dense layer, three `deepspeed.moe.layer.MoE` layers of 8 experts
(320 -> 1280 -> 320 MLPs, top-2 routing) and an untied head, about 25M parameters, four param
groups (decay / no_decay, each split into dense and expert groups by DeepSpeed's
`split_params_into_different_moe_groups_for_optimizer`), trained one fp32 AdamW step at ZeRO-2
on 2 CPU ranks at ep 1 and saved (about 400 MB, cached). ep 1 -> ep 1 is where DeepSpeed's own
path works for native MoE: `ds_to_universal.py` crashes on an ep > 1 source ("shape '[7, 9]' is
invalid", the expert parameters' local shapes), and its ep 1 output loaded at ep 2 gives EP rank
1 the experts of EP rank 0 without a word (both checked with reshard_proof.moe_run on
CPU, DeepSpeed 0.19.8). Each contender is watched for wall time, peak RSS of its largest process
and of its whole tree, and the disk it added:
  reshard    python -m reshard SRC DST --target-dp 1 --workers W, then engine.load_checkpoint(DST) at 1
  in-job     reshard.deepspeed.load_checkpoint(engine, SRC) at 1: no copy on disk
  universal  ds_to_universal.py on SRC, then load_checkpoint with load_universal at 1
Each load rank reports the float64 sums of its fp32 master partitions and Adam moments, so the
loads can be compared. JSON in bench/results/moe-*.json.
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from make_checkpoint import child_env, torchrun_command, tree_bytes, versions  # noqa: E402
from path_comparison import summarize, timed_load, watched, write_result  # noqa: E402

SOURCE = (1, 2)  # (ep, dp)
TARGET = (1, 1)
TAG = "global_step1"
MODEL = {"vocab": 8192, "hidden": 320, "ffn": 1280, "experts": 8, "moe_layers": 3, "micro_batch": 4, "seq_len": 64}


def build_engine(ep: int, universal: bool = False):
    import deepspeed
    import torch
    import torch.nn.functional as F
    from deepspeed.moe.layer import MoE
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
    from torch import nn

    m = MODEL

    class Expert(nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = nn.Linear(m["hidden"], m["ffn"]), nn.Linear(m["ffn"], m["hidden"])

        def forward(self, x):
            return self.down(F.gelu(self.up(x)))

    class MoEBenchModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(m["vocab"], m["hidden"])
            self.dense = nn.Linear(m["hidden"], m["hidden"])
            self.moe = nn.ModuleList(MoE(m["hidden"], Expert(), num_experts=m["experts"], ep_size=ep, k=2,
                                         min_capacity=4, drop_tokens=False) for _ in range(m["moe_layers"]))
            self.head = nn.Linear(m["hidden"], m["vocab"])

        def forward(self, tokens, targets):
            hidden = self.embed(tokens)
            hidden = hidden + F.gelu(self.dense(hidden))
            aux = 0.0
            for layer in self.moe:
                out, layer_aux, _ = layer(hidden)
                hidden, aux = hidden + out, aux + layer_aux
            return F.cross_entropy(self.head(hidden).flatten(0, -2), targets.flatten()) + 0.01 * aux

    torch.manual_seed(0)
    model = MoEBenchModel()
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    groups = split_params_into_different_moe_groups_for_optimizer(
        [{"name": "decay", "params": decay, "weight_decay": 0.1}, {"name": "no_decay", "params": no_decay,
                                                                    "weight_decay": 0.0}])
    optimizer = torch.optim.AdamW(groups, lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
    config = {"train_micro_batch_size_per_gpu": m["micro_batch"], "gradient_accumulation_steps": 1,
              "gradient_clipping": 1.0, "steps_per_print": 1_000_000,
              "zero_optimization": {"stage": 2, "reduce_bucket_size": 50_000_000, "allgather_bucket_size": 50_000_000}}
    if universal:
        config["checkpoint"] = {"load_universal": True}
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def rank_train(args) -> None:
    import deepspeed
    import torch
    deepspeed.init_distributed(dist_backend="gloo")
    engine = build_engine(args.ep)
    generator = torch.Generator().manual_seed(1000 + torch.distributed.get_rank())
    tokens = torch.randint(0, MODEL["vocab"], (MODEL["micro_batch"], MODEL["seq_len"] + 1), generator=generator)
    loss = engine(tokens[:, :-1], tokens[:, 1:])
    engine.backward(loss)
    engine.step()
    engine.save_checkpoint(args.dir, tag=TAG)
    torch.distributed.barrier()


def rank_load(args) -> None:
    """One rank: build the engine at the target EP, time one load, report checksums; rank 0 writes JSON."""
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")
    timed_load(build_engine(args.ep, universal=args.how == "universal"), args.how, args.dir, args.json)


def load(how, directory, out, name) -> dict:
    ep, dp = TARGET
    result_json = os.path.join(out, f"{name}.json")
    found = watched(torchrun_command(dp, "moe_bench.py", "_load", "--ep", ep, "--dir", directory, "--how", how,
                                     "--json", result_json), os.path.join(out, f"{name}.log"), out)
    if found["returncode"] == 0:
        with open(result_json) as handle:
            found["load"] = json.load(handle)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", nargs="?", default="run", choices=["run", "_train", "_load"])
    parser.add_argument("--cache-dir", default=os.path.join(HERE, ".cache"))
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--ep", type=int)
    parser.add_argument("--dir")
    parser.add_argument("--how", choices=["native", "universal", "in-job"])
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.command == "_train":
        return rank_train(args)
    if args.command == "_load":
        return rank_load(args)

    key = hashlib.sha256(json.dumps([MODEL, SOURCE, versions()], sort_keys=True).encode()).hexdigest()[:12]
    root = os.path.join(args.cache_dir, f"moe-{key}")
    source, out = os.path.join(root, "source"), os.path.join(root, "run")
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    if not os.path.exists(os.path.join(source, "latest")):
        shutil.rmtree(source, ignore_errors=True)
        started = time.perf_counter()
        subprocess.run(torchrun_command(SOURCE[1], "moe_bench.py", "_train", "--ep", SOURCE[0], "--dir", source),
                       env=child_env(), check=True, capture_output=True)
        print(f"trained and saved the (ep, dp) = {SOURCE} source in {time.perf_counter() - started:.0f} s")
    result = {"when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                          "note": "shared 2-core machine, ~5 other agents running: timings are noisy"},
              "versions": versions(), "model": MODEL, "source_ep_dp": SOURCE, "target_ep_dp": TARGET,
              "workers": args.workers, "source_bytes": tree_bytes(source)}

    destination = os.path.join(out, "resharded")
    result["reshard"] = watched([sys.executable, "-m", "reshard", source, destination, "--target-dp", TARGET[1],
                                 "--target-ep", TARGET[0], "--workers", args.workers, "--quiet"],
                                os.path.join(out, "reshard.log"), out)
    result["reshard"]["output_bytes"] = tree_bytes(destination) if os.path.isdir(destination) else None
    result["reshard_native_load"] = load("native", destination, out, "native")
    shutil.rmtree(destination, ignore_errors=True)
    result["in_job"] = load("in-job", source, out, "in_job")

    universal = os.path.join(out, "universal")
    result["ds_to_universal"] = watched(
        [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", os.path.join(source, TAG),
         "--output_folder", os.path.join(universal, TAG), "--num_extract_workers", args.workers,
         "--num_merge_workers", args.workers, "--inject_missing_state"],
        os.path.join(out, "ds_to_universal.log"), out)
    if result["ds_to_universal"]["returncode"] == 0:
        result["ds_to_universal"]["output_bytes"] = tree_bytes(universal)
        with open(os.path.join(universal, "latest_universal"), "w") as handle:
            handle.write(TAG)
        result["universal_load"] = load("universal", universal, out, "universal")
    shutil.rmtree(universal, ignore_errors=True)

    # as tp_bench.py: command wall of the conversion + the load's own seconds inside the ranks
    result["summary"] = summarize(result)
    write_result(result, "moe")


if __name__ == "__main__":
    main()
