"""Export benchmark: reshard's safetensors / universal export against DeepSpeed's own converters.

    python bench/export_bench.py SAVE_DIR [--workers 2] [--budget 100M] [--scratch /tmp/export-bench]

On one checkpoint (a save directory, e.g. one `make_checkpoint.py` made), each contender runs as a
watched process tree (`process_tree.run_watched`: wall time, peak RSS of the largest single
process and of the whole tree, peak extra disk), with the page cache dropped before each
(`page_cache.py`, as in run.py):

    reshard export --format safetensors   torchrun --nproc_per_node=W -m reshard export ...
    zero_to_fp32.py --safe_serialization  DeepSpeed's consolidation to safetensors (it refuses a
                                          model with a tied weight after doing all the work)
    zero_to_fp32.py                       the same to pytorch_model*.bin (works with tied weights)
    reshard export --format universal     torchrun --nproc_per_node=W -m reshard export ...
    ds_to_universal.py                    --num_extract_workers W --num_merge_workers W --inject_missing_state

Prints a table and writes bench/results/export-<timestamp>.json.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from page_cache import drop_page_cache  # noqa: E402
from process_tree import run_watched  # noqa: E402


def child_env() -> dict:
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, env.get("PYTHONPATH")]))
    return env


def contenders(save_dir: str, tag: str, out: str, workers: int, budget: str) -> list[tuple[str, list[str]]]:
    import deepspeed
    root = os.path.dirname(deepspeed.__file__)
    # as a module: run as a script from deepspeed/utils, its sibling torch.py would shadow torch
    zero_to_fp32 = ["-m", "deepspeed.utils.zero_to_fp32"]
    ds_to_universal = os.path.join(root, "checkpoint", "ds_to_universal.py")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={workers}",
                "-m", "reshard", "export"]
    return [
        ("reshard export safetensors", torchrun + [save_dir, f"{out}/st", "--format", "safetensors",
                                                    "--memory-budget", budget]),
        ("zero_to_fp32 --safe_serialization", [sys.executable, *zero_to_fp32, save_dir, f"{out}/z2f-st",
                                               "--safe_serialization"]),
        ("zero_to_fp32 (.bin)", [sys.executable, *zero_to_fp32, save_dir, f"{out}/z2f-bin"]),
        ("reshard export universal", torchrun + [save_dir, f"{out}/uni", "--format", "universal",
                                                  "--memory-budget", budget]),
        ("ds_to_universal", [sys.executable, ds_to_universal, "--input_folder", os.path.join(save_dir, tag),
                             "--output_folder", f"{out}/dsu/{tag}", "--num_extract_workers", str(workers),
                             "--num_merge_workers", str(workers), "--inject_missing_state"]),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("save_dir")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--budget", default="100M")
    parser.add_argument("--scratch", default="/tmp/export-bench")
    parser.add_argument("--cache-method", default="fadvise", help="fadvise (default; polite on a shared machine) or proc")
    args = parser.parse_args()
    tag = open(os.path.join(args.save_dir, "latest")).read().strip()
    shutil.rmtree(args.scratch, ignore_errors=True)
    os.makedirs(args.scratch)
    rows = []
    for name, command in contenders(args.save_dir, tag, args.scratch, args.workers, args.budget):
        os.sync()
        method = drop_page_cache([args.save_dir], args.cache_method)
        run = run_watched(command, env=child_env(), cwd=REPO, log_path=os.path.join(args.scratch, name.replace(" ", "_") + ".log"),
                          disk_path=args.scratch)
        rows.append({"name": name, "returncode": run.returncode, "wall_seconds": round(run.wall_seconds, 2),
                     "peak_process_rss_bytes": run.peak_process_rss_bytes, "peak_tree_rss_bytes": run.peak_tree_rss_bytes,
                     "peak_disk_bytes": run.peak_disk_bytes, "cache_drop": method})
        print(f"{name:36s} rc={run.returncode:<3d} wall {run.wall_seconds:7.1f} s  peak RSS/process "
              f"{run.peak_process_rss_bytes / 2**20:7.0f} MiB  tree {run.peak_tree_rss_bytes / 2**20:7.0f} MiB", flush=True)
        for sub in ("st", "z2f-st", "z2f-bin", "uni", "dsu"):
            shutil.rmtree(os.path.join(args.scratch, sub), ignore_errors=True)
    result = {"save_dir": args.save_dir, "workers": args.workers, "budget": args.budget, "rows": rows,
              "when": time.strftime("%Y%m%d-%H%M%S")}
    path = os.path.join(HERE, "results", f"export-{result['when']}.json")
    with open(path, "w") as fd:
        json.dump(result, fd, indent=2)
    print(f"-> {path}")


if __name__ == "__main__":
    main()
