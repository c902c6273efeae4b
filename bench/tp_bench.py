"""The tensor-parallel row: an AutoTP checkpoint of the bench model, (tp, dp) = (2, 2) -> (1, 4).

    python bench/tp_bench.py [--cache-dir bench/.cache] [--workers 2] [--frozen]

The bench model (bench_model.QUICK, ~23M parameters, ZeRO-2 fp32 AdamW) with AutoTP over its
MLPs (`tensor_parallel.partition_config.layer_specs`: every block's `up` column-parallel,
`down` row-parallel; attention, norms and the tied embedding stay whole on every TP rank),
trained one step on 4 CPU ranks at (tp 2, dp 2) and saved (cached). Then, each watched for wall
time, peak RSS of its largest process and of its whole tree, and disk it added:
  reshard    python -m reshard SRC DST --target-dp 4 --target-tp 1 --workers W, then
             engine.load_checkpoint(DST) at (1, 4)
  in-job     reshard.deepspeed.load_checkpoint(engine, SRC) at (1, 4): no copy on disk
  universal  DeepSpeed's ds_to_universal.py on SRC, then load_checkpoint with load_universal at (1, 4)
A failure of a contender is recorded with the tail of its output. Each load rank reports the
float64 sum of its fp32 master partition and Adam moments, so the loads can be compared.
Without --frozen the model has no frozen parameter: DeepSpeed 0.19.8's ds_to_universal stops on
AutoTP checkpoints with frozen parameters ("Unused patterns ... while merging tp slices"); with
--frozen that failure is what the universal row records. JSON in bench/results/tp-*.json.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from bench_model import QUICK, ModelConfig, build_model, config_from_json, config_to_json, param_groups  # noqa: E402
from make_checkpoint import child_env, torchrun_command, tree_bytes, versions  # noqa: E402
from path_comparison import summarize, timed_load, watched, write_result  # noqa: E402

SOURCE = (2, 2)  # (tp, dp)
TARGET = (1, 4)
TAG = "global_step1"
LAYER_SPECS = [{"patterns": [r"^blocks\.\d+\.up\.weight$"], "partition_type": "column"},
               {"patterns": [r"^blocks\.\d+\.down\.weight$"], "partition_type": "row"}]


def tp_config(tp: int, micro_batch: int, universal: bool = False) -> dict:
    config = {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": 1,
              "gradient_clipping": 1.0, "steps_per_print": 1_000_000,
              "zero_optimization": {"stage": 2, "reduce_bucket_size": 50_000_000,
                                    "allgather_bucket_size": 50_000_000},
              "tensor_parallel": {"autotp_size": tp, "partition_config": {"use_default_specs": False,
                                                                            "layer_specs": LAYER_SPECS}}}
    if universal:
        config["checkpoint"] = {"load_universal": True}
    return config


def build_tp_engine(cfg: ModelConfig, tp: int, universal: bool = False):
    import deepspeed
    import torch
    torch.manual_seed(0)
    model = build_model(cfg)
    optimizer = torch.optim.AdamW(param_groups(model), betas=(0.9, 0.95), eps=1e-8)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer,
                                      config=tp_config(tp, cfg.micro_batch, universal))
    return engine


def rank_train(args) -> None:
    """One rank: train one step at (tp, dp) and save."""
    import deepspeed
    import torch
    deepspeed.init_distributed(dist_backend="gloo")
    cfg = config_from_json(args.config_json)
    engine = build_tp_engine(cfg, args.tp)
    from deepspeed.utils import groups
    dp_rank = groups.get_data_parallel_rank() if args.tp > 1 else torch.distributed.get_rank()
    generator = torch.Generator().manual_seed(1000 + dp_rank)
    tokens = torch.randint(0, cfg.vocab_size, (cfg.micro_batch, cfg.seq_len + 1), generator=generator)
    loss = engine(tokens[:, :-1], tokens[:, 1:])
    engine.backward(loss)
    engine.step()
    engine.save_checkpoint(args.dir, tag=TAG)
    torch.distributed.barrier()


def rank_load(args) -> None:
    """One rank: build the engine at (tp, dp), time one load, report checksums; rank 0 writes JSON."""
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")
    engine = build_tp_engine(config_from_json(args.config_json), args.tp, universal=args.how == "universal")
    timed_load(engine, args.how, args.dir, args.json)


def load(cfg, how, directory, out, name) -> dict:
    tp, dp = TARGET
    result_json = os.path.join(out, f"{name}.json")
    found = watched(torchrun_command(tp * dp, "tp_bench.py", "_load", "--config-json", config_to_json(cfg),
                                     "--tp", tp, "--dir", directory, "--how", how, "--json", result_json),
                    os.path.join(out, f"{name}.log"), out)
    if found["returncode"] == 0:
        with open(result_json) as handle:
            found["load"] = json.load(handle)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", nargs="?", default="run", choices=["run", "_train", "_load"])
    parser.add_argument("--cache-dir", default=os.path.join(HERE, ".cache"))
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--frozen", action="store_true", help="keep the bench model's frozen position embedding")
    parser.add_argument("--config-json")
    parser.add_argument("--tp", type=int)
    parser.add_argument("--dir")
    parser.add_argument("--how", choices=["native", "universal", "in-job"])
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.command == "_train":
        return rank_train(args)
    if args.command == "_load":
        return rank_load(args)

    cfg = dataclasses.replace(QUICK, frozen_position=args.frozen)
    root = os.path.join(args.cache_dir, f"tp-{cfg.key(tp=SOURCE, stage=2)}")
    source = os.path.join(root, "source")
    out = os.path.join(root, "run")
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    if not os.path.exists(os.path.join(source, "latest")):
        shutil.rmtree(source, ignore_errors=True)
        started = time.perf_counter()
        subprocess.run(torchrun_command(SOURCE[0] * SOURCE[1], "tp_bench.py", "_train", "--config-json",
                                        config_to_json(cfg), "--tp", SOURCE[0], "--dir", source),
                       env=child_env(), check=True, capture_output=True)
        print(f"trained and saved the (tp, dp) = {SOURCE} source in {time.perf_counter() - started:.0f} s")
    result = {"when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                          "note": "shared 2-core machine, ~4 other agents running: timings are noisy"},
              "versions": versions(), "model": dataclasses.asdict(cfg), "source_tp_dp": SOURCE,
              "target_tp_dp": TARGET, "workers": args.workers, "source_bytes": tree_bytes(source)}

    destination = os.path.join(out, "resharded")
    result["reshard"] = watched([sys.executable, "-m", "reshard", source, destination, "--target-dp",
                                 TARGET[1], "--target-tp", TARGET[0], "--workers", args.workers, "--quiet"],
                                os.path.join(out, "reshard.log"), out)
    result["reshard"]["output_bytes"] = tree_bytes(destination) if os.path.isdir(destination) else None
    result["reshard_native_load"] = load(cfg, "native", destination, out, "native")
    shutil.rmtree(destination, ignore_errors=True)
    result["in_job"] = load(cfg, "in-job", source, out, "in_job")

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
        result["universal_load"] = load(cfg, "universal", universal, out, "universal")
    shutil.rmtree(universal, ignore_errors=True)

    # as bench/run.py `speedup`: command wall of the conversion + the load's own seconds inside the ranks
    result["summary"] = summarize(result)
    write_result(result, "tp")


if __name__ == "__main__":
    main()
