"""SLURM array mode beside the torchrun job: wall time and bytes read, on the same checkpoint.

    python bench/array_mode.py --quick                      # ~300 MB ZeRO-2 checkpoint, 2 -> 3 ranks
    python bench/array_mode.py --stage 3 --tasks 4 --workers 2 --repeat 3

Per repetition, page cache dropped before each contender (page_cache.py):
- torchrun: `torchrun --nproc_per_node=W bench/reshard_worker.py SRC DST --target-dp M` (one job);
- array, at once: K processes `bench/reshard_worker.py ... --array-task I --array-tasks K`
  started together (as SLURM would when K slots are free); wall = until the last one exits;
- array, one at a time: the same K tasks in order (a busy cluster giving one slot at a time);
  wall = sum of the task walls.
Bytes read = slices preadv'd from the source plus carried storages copied (WorkerReports), next
to the target's tensor bytes. Results go to bench/results/array-<timestamp>.json.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from bench_model import FULL, QUICK  # noqa: E402
from make_checkpoint import DEFAULT_CACHE, REPO, child_env, ensure_checkpoint, torchrun_command  # noqa: E402
from page_cache import drop_page_cache  # noqa: E402


def worker_command(src: str, dst: str, target: int, budget: int, out: str, *extra) -> list[str]:
    return [sys.executable, os.path.join(HERE, "reshard_worker.py"), src, dst, "--target-dp", str(target),
            "--memory-budget", str(budget), "--json", out, *map(str, extra)]


def read_bytes(report: dict) -> int:
    return sum(r["bytes_read"] + r["bytes_carried"] for r in report["reports"])


def run_torchrun(src, dst, target, workers, budget, scratch) -> dict:
    out = os.path.join(scratch, "torchrun.json")
    command = torchrun_command(workers, "reshard_worker.py", src, dst, "--target-dp", target,
                               "--memory-budget", budget, "--json", out)
    started = time.perf_counter()
    subprocess.run(command, env=child_env(), cwd=REPO, check=True, capture_output=True)
    wall = time.perf_counter() - started
    with open(out) as fd:
        report = json.load(fd)
    return {"wall_seconds": wall, "bytes_read": read_bytes(report), "bytes_written": report["bytes_written"]}


def run_array(src, dst, target, tasks, budget, scratch, at_once: bool) -> dict:
    outs = [os.path.join(scratch, f"task{i}.json") for i in range(tasks)]
    commands = [worker_command(src, dst, target, budget, outs[i], "--array-task", i, "--array-tasks", tasks)
                for i in range(tasks)]
    walls = []
    started = time.perf_counter()
    if at_once:
        processes = [subprocess.Popen(c, env=child_env(), cwd=REPO, stdout=subprocess.DEVNULL) for c in commands]
        for process in processes:
            if process.wait() != 0:
                raise RuntimeError(f"array task failed: {process.args}")
        wall = time.perf_counter() - started
    else:
        for command in commands:
            one = time.perf_counter()
            subprocess.run(command, env=child_env(), cwd=REPO, check=True, stdout=subprocess.DEVNULL)
            walls.append(time.perf_counter() - one)
        wall = sum(walls)
    reports = []
    for out in outs:
        with open(out) as fd:
            reports.append(json.load(fd))
    return {"wall_seconds": wall, "task_walls": walls, "bytes_read": sum(read_bytes(r) for r in reports),
            "bytes_read_per_task": [read_bytes(r) for r in reports],
            "bytes_written": sum(r["bytes_written"] for r in reports)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--ranks", type=int, default=None, help="source ranks (default 2 quick, 4 full)")
    parser.add_argument("--target", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2, help="torchrun workers")
    parser.add_argument("--tasks", type=int, default=4, help="array tasks K")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--cache-dir", default=DEFAULT_CACHE)
    parser.add_argument("--cache-drop", default="auto", choices=("auto", "proc", "fadvise"))
    args = parser.parse_args()
    cfg = QUICK if args.quick else FULL
    ranks = args.ranks or (2 if args.quick else 4)
    meta = ensure_checkpoint(cfg, args.stage, ranks, args.cache_dir)
    src = meta["save_dir"]
    budget = max(1 << 20, meta["bytes"] // 10)
    scratch_root = tempfile.mkdtemp(prefix="reshard-array-bench-", dir=args.cache_dir)
    rows = []
    try:
        for repetition in range(args.repeat):
            for name in ("torchrun", "array-at-once", "array-one-at-a-time"):
                scratch = os.path.join(scratch_root, f"{name}-{repetition}")
                os.makedirs(scratch)
                dst = os.path.join(scratch, "dst")
                method = drop_page_cache([src], args.cache_drop)
                if name == "torchrun":
                    row = run_torchrun(src, dst, args.target, args.workers, budget, scratch)
                else:
                    row = run_array(src, dst, args.target, args.tasks, budget, scratch, name == "array-at-once")
                row.update(name=name, repetition=repetition, cache_drop=method)
                rows.append(row)
                print(f"{name:>20}: {row['wall_seconds']:7.1f} s wall, read {row['bytes_read'] / 1e9:.3f} GB, "
                      f"wrote {row['bytes_written'] / 1e9:.3f} GB"
                      + (f", per task {[round(b / 1e9, 3) for b in row['bytes_read_per_task']]} GB"
                         if "bytes_read_per_task" in row else ""), flush=True)
                shutil.rmtree(dst, ignore_errors=True)
    finally:
        shutil.rmtree(scratch_root, ignore_errors=True)
    results = {"checkpoint": {k: meta[k] for k in ("save_dir", "stage", "ranks", "bytes", "params")},
               "target": args.target, "workers": args.workers, "tasks": args.tasks, "budget": budget, "rows": rows,
               "machine": {"cpus": os.cpu_count()}}
    path = os.path.join(HERE, "results", f"array-{time.strftime('%Y%m%d-%H%M%S')}.json")
    with open(path, "w") as fd:
        json.dump(results, fd, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
