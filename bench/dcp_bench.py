"""DCP export benchmark: `reshard export --format dcp` beside the only path that exists without it.

    python bench/dcp_bench.py --size 1G [--workers 2] [--budget 100M] [--scratch /tmp/dcp-bench]
    python bench/dcp_bench.py --save-dir SAVE_DIR ...        # a checkpoint you have (e.g. make_checkpoint.py's)

With --size, a synthetic ZeRO-2 fp32 checkpoint of that ladder size (bench_model.LADDER: 1G, 2.5G,
10G) is written first by `synthetic_checkpoint.py` (2 ranks; not timed). Then each contender runs as
a watched process tree (`process_tree.run_watched`: wall time, peak RSS of the largest single
process, i.e. per worker, and of the whole tree), with the page cache dropped before each:

    reshard export --format dcp      torchrun --nproc_per_node=W -m reshard export SRC OUT --format dcp:
                                     model AND Adam state (exp_avg, exp_avg_sq, step, param groups)
    zero_to_fp32 + torch_save_to_dcp DeepSpeed's consolidation to one pytorch_model.bin, then
                                     torch.distributed.checkpoint.format_utils.torch_save_to_dcp of it,
                                     one process each: WEIGHTS ONLY (no optimizer state), so it moves
                                     about a third of the bytes reshard moves

Prints a table and writes bench/results/dcp-<timestamp>.json. On a shared machine read the times as rough.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from page_cache import drop_page_cache  # noqa: E402
from process_tree import run_watched  # noqa: E402

TORCH_SAVE_TO_DCP = ("import sys, glob; from torch.distributed.checkpoint.format_utils import torch_save_to_dcp; "
                     "files = glob.glob(sys.argv[1] + '/*.bin'); assert len(files) == 1, files; "
                     "torch_save_to_dcp(files[0], sys.argv[2])")


def child_env() -> dict:
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, env.get("PYTHONPATH")]))
    return env


def contenders(save_dir: str, out: str, workers: int, budget: str) -> list[tuple[str, list[list[str]]]]:
    """(name, commands run one after the other, timed together)."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={workers}",
                "-m", "reshard", "export"]
    return [
        ("reshard export --format dcp", [torchrun + [save_dir, f"{out}/dcp", "--format", "dcp",
                                                     "--memory-budget", budget]]),
        ("zero_to_fp32 + torch_save_to_dcp (weights only)", [
            [sys.executable, "-m", "deepspeed.utils.zero_to_fp32", save_dir, f"{out}/z2f", "--max_shard_size", "1000GB"],
            [sys.executable, "-c", TORCH_SAVE_TO_DCP, f"{out}/z2f", f"{out}/z2f-dcp"]]),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--size", help="synthetic ZeRO-2 fp32 checkpoint of this ladder size (1G, 2.5G, 10G)")
    where.add_argument("--save-dir")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--budget", default="100M")
    parser.add_argument("--scratch", default="/tmp/dcp-bench")
    parser.add_argument("--cache-method", default="fadvise", help="fadvise (default; polite on a shared machine) or proc")
    args = parser.parse_args()
    shutil.rmtree(args.scratch, ignore_errors=True)
    os.makedirs(args.scratch)
    save_dir = args.save_dir
    if save_dir is None:
        save_dir = os.path.join(args.scratch, "source")
        subprocess.run([sys.executable, os.path.join(HERE, "synthetic_checkpoint.py"), save_dir, "--stage", "2",
                        "--ranks", "2", "--model", args.size], check=True, env=child_env(), cwd=REPO)
    size = sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(save_dir) for f in files)
    rows = []
    for name, commands in contenders(save_dir, args.scratch, args.workers, args.budget):
        os.sync()
        method = drop_page_cache([save_dir], args.cache_method)
        row = {"name": name, "returncode": 0, "wall_seconds": 0.0, "peak_process_rss_bytes": 0,
               "peak_tree_rss_bytes": 0, "cache_drop": method}
        for i, command in enumerate(commands):
            run = run_watched(command, env=child_env(), cwd=REPO, disk_path=args.scratch,
                              log_path=os.path.join(args.scratch, f"{name.split()[0]}-{i}.log"))
            row["returncode"] = row["returncode"] or run.returncode
            row["wall_seconds"] = round(row["wall_seconds"] + run.wall_seconds, 2)
            row["peak_process_rss_bytes"] = max(row["peak_process_rss_bytes"], run.peak_process_rss_bytes)
            row["peak_tree_rss_bytes"] = max(row["peak_tree_rss_bytes"], run.peak_tree_rss_bytes)
        rows.append(row)
        print(f"{name:50s} rc={row['returncode']:<3d} wall {row['wall_seconds']:7.1f} s  peak RSS/process "
              f"{row['peak_process_rss_bytes'] / 2**20:7.0f} MiB  tree {row['peak_tree_rss_bytes'] / 2**20:7.0f} MiB",
              flush=True)
        for sub in ("dcp", "z2f", "z2f-dcp"):
            shutil.rmtree(os.path.join(args.scratch, sub), ignore_errors=True)
    result = {"save_dir": save_dir, "checkpoint_bytes": size, "workers": args.workers, "budget": args.budget,
              "rows": rows, "when": time.strftime("%Y%m%d-%H%M%S")}
    path = os.path.join(HERE, "results", f"dcp-{result['when']}.json")
    with open(path, "w") as fd:
        json.dump(result, fd, indent=2)
    print(f"checkpoint {size / 1e9:.2f} GB -> {path}")


if __name__ == "__main__":
    main()
