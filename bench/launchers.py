"""Launchers side by side: what `torchrun -m reshard` costs beyond torchrun itself and beyond `--workers`.

    python bench/launchers.py                          # 100M and 1G, best of 2
    python bench/launchers.py --sizes 100M 1G 2.5G --repeat 3
    python bench/launchers.py --scratch /big/disk      # where sources and outputs go (default /tmp)

For each size, a ZeRO-2 fp32 checkpoint of a `bench_model.LADDER` model at N=2 ranks, written by
synthetic_checkpoint.py (real DeepSpeed files and trees, no training; cached in SCRATCH), is
resharded to M=3 with W=2 workers by each contender, in turns (one turn runs every contender
once, so that a busy moment of a shared machine falls on all of them alike):

  floor          torchrun --standalone --nproc_per_node=2 of a worker that does nothing: the
                 agent's start (it imports torch), two interpreters, the rendezvous and the exit
  workers        python -m reshard SRC DST --target-dp 3 --workers 2 (forked, shared memory)
  torchrun-torch torchrun ... -m reshard SRC DST --target-dp 3 --transport torch (gloo: before issue 26)
  torchrun       torchrun ... -m reshard SRC DST --target-dp 3 (one host: shared memory, no torch)

The page cache is warm (one untimed `--workers` run per size first): this compares launchers,
not disks. Walls are whole commands (perf_counter around the process), best of --repeat. Each
worker's peak RSS (VmHWM: every resident page, the page cache of files it mapped included) and
peak anonymous memory are read from the summary. The goal from issue 26:
torchrun <= floor + 1.1 x workers. Writes bench/results/launchers-<timestamp>.json and
bench/results/launchers.json, and prints a table.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from make_checkpoint import child_env, tree_bytes  # noqa: E402

SOURCE_RANKS, TARGET_RANKS, WORKERS = 2, 3, 2
CONTENDERS = ("floor", "workers", "torchrun-torch", "torchrun")
TRANSPORT_RE = re.compile(r"worker\(s\) over (.*?); ")
IO_RE = re.compile(r"^  io     : (.*)$", re.M)
PHASES_RE = re.compile(r"phases : (.*?) \(slowest")
SIZE = r"([\d.]+) ([KMG]?i?B)"
WORKER_RE = re.compile(rf"^\s+(\d+)\s+\S+\s+\S+\s+{SIZE}\s+{SIZE}\s+{SIZE}\s+{SIZE}\s*$", re.M)
"""A summary's worker line: worker, reads ranks, writes ranks, read, written, peak RSS, peak anon."""
UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def _bytes(number: str, unit: str) -> int:
    return int(float(number) * UNITS[unit])


def torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={WORKERS}", *args]


def command(contender: str, src: str, dst: str, noop: str) -> list[str]:
    job = [src, dst, "--target-dp", str(TARGET_RANKS), "--quiet"]
    if contender == "floor":
        return torchrun(noop)
    if contender == "workers":
        return [sys.executable, "-m", "reshard", *job, "--workers", str(WORKERS)]
    if contender == "torchrun-torch":
        return torchrun("-m", "reshard", *job, "--transport", "torch")
    return torchrun("-m", "reshard", *job)


def run_once(contender: str, src: str, dst: str, noop: str) -> dict:
    shutil.rmtree(dst, ignore_errors=True)
    os.sync()
    started = time.perf_counter()
    done = subprocess.run(command(contender, src, dst, noop), capture_output=True, text=True, env=child_env(),
                          cwd=REPO)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"{contender} failed (exit {done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    run = {"seconds": wall}
    if contender != "floor":
        transport, io, phases = TRANSPORT_RE.search(done.stdout), IO_RE.search(done.stdout), PHASES_RE.search(done.stdout)
        run.update(transport=transport and transport.group(1), io=io and io.group(1), phases=phases and phases.group(1),
                   workers=[{"worker": int(m[0]), "peak_rss_bytes": _bytes(m[5], m[6]),
                             "peak_anonymous_bytes": _bytes(m[7], m[8])} for m in WORKER_RE.findall(done.stdout)])
        if len(run["workers"]) != WORKERS:
            raise RuntimeError(f"{contender}: no worker lines in its summary:\n{done.stdout}")
    return run


def ensure_source(size: str, scratch: str) -> str:
    src = os.path.join(scratch, f"src-{size}")
    marker = os.path.join(src, ".complete")
    if not os.path.isfile(marker):
        shutil.rmtree(src, ignore_errors=True)
        subprocess.run([sys.executable, os.path.join(HERE, "synthetic_checkpoint.py"), src, "--stage", "2",
                        "--ranks", str(SOURCE_RANKS), "--model", size], check=True, env=child_env(), cwd=REPO)
        open(marker, "w").close()
    return src


def measure(size: str, scratch: str, repeat: int, noop: str) -> dict:
    src = ensure_source(size, scratch)
    dst = os.path.join(scratch, f"dst-{size}")
    run_once("workers", src, dst, noop)  # warms the page cache and the code
    runs: dict[str, list] = {name: [] for name in CONTENDERS}
    for turn in range(repeat):
        for name in CONTENDERS:
            runs[name].append(run_once(name, src, dst, noop))
            print(f"  {size} turn {turn + 1}: {name:<15} {runs[name][-1]['seconds']:6.2f} s", flush=True)
    shutil.rmtree(dst, ignore_errors=True)
    best = {name: min(r["seconds"] for r in runs[name]) for name in CONTENDERS}
    goal = best["floor"] + 1.1 * best["workers"]
    return {"size": size, "source_bytes": tree_bytes(src), "runs": runs, "best_seconds": best,
            "goal_seconds": goal, "goal_met": best["torchrun"] <= goal}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", nargs="+", default=["100M", "1G"])
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--scratch", default=os.path.join("/tmp", "reshard-launchers"))
    parser.add_argument("--keep-sources", action="store_true", help="leave the synthetic sources in SCRATCH")
    args = parser.parse_args(argv)
    os.makedirs(args.scratch, exist_ok=True)
    noop = os.path.join(args.scratch, "noop.py")
    with open(noop, "w") as fd:
        fd.write("# a torchrun worker that does nothing: the launcher's floor\n")
    with open("/proc/loadavg") as fd:
        load_before = fd.read().split()[:3]
    results = []
    for size in args.sizes:
        results.append(measure(size, args.scratch, args.repeat, noop))
        if not args.keep_sources:
            shutil.rmtree(os.path.join(args.scratch, f"src-{size}"), ignore_errors=True)
    with open("/proc/loadavg") as fd:
        load_after = fd.read().split()[:3]
    record = {"when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "cpus": os.cpu_count(), "load_average_before": load_before, "load_average_after": load_after,
              "source_ranks": SOURCE_RANKS, "target_ranks": TARGET_RANKS, "workers": WORKERS,
              "repeat": args.repeat, "page_cache": "warm", "sizes": results}
    out_dir = os.path.join(HERE, "results")
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    for name in (f"launchers-{stamp}.json", "launchers.json"):
        with open(os.path.join(out_dir, name), "w") as fd:
            json.dump(record, fd, indent=1)
    print(f"\nbest of {args.repeat}, warm page cache, {os.cpu_count()} CPUs, load average {' '.join(load_before)} "
          f"-> {' '.join(load_after)}")
    print(f"{'size':>6} {'GB':>6} {'floor':>7} {'workers':>8} {'tr-torch':>9} {'torchrun':>9} {'goal':>7}  "
          f"peak RSS per worker (torchrun / workers / tr-torch, MB)")
    def rss(size_result: dict, name: str) -> str:
        best_run = min(size_result["runs"][name], key=lambda run: run["seconds"])
        return "+".join(f"{w['peak_rss_bytes'] / 1e6:.0f}" for w in best_run["workers"])

    for r in results:
        b = r["best_seconds"]

        print(f"{r['size']:>6} {r['source_bytes'] / 1e9:6.2f} {b['floor']:7.2f} {b['workers']:8.2f} "
              f"{b['torchrun-torch']:9.2f} {b['torchrun']:9.2f} {r['goal_seconds']:7.2f}{' ok' if r['goal_met'] else ' MISSED'}"
              f"  {rss(r, 'torchrun')} / {rss(r, 'workers')} / {rss(r, 'torchrun-torch')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
