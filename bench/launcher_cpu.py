"""Launchers by CPU time: what a torchrun-started reshard costs the machine beyond torchrun and `--workers`.

    python bench/launcher_cpu.py                         # 100M, 3 turns
    python bench/launcher_cpu.py --repeat 5 --code /tmp/old-checkout   # the same for another checkout

The contenders of bench/launchers.py (floor, workers, torchrun: same commands, same cached
synthetic ZeRO-2 source, 2 -> 3 ranks, W = 2), timed by wall clock and by CPU time: user + system
seconds of the whole process tree (`resource.getrusage(RUSAGE_CHILDREN)` around each command; the
agent waits for its workers and `--workers` for its forks, so every process is counted). On a
shared machine wall times swing with the load; CPU time barely does, so it shows what the
torchrun path spends beyond the floor and beyond `--workers` even when the walls cannot. `--code`
runs another checkout's reshard (PYTHONPATH) with this script, for before/after figures. Writes
bench/results/launcher_cpu-<timestamp>.json and prints medians.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from launchers import command, ensure_source  # noqa: E402
from make_checkpoint import child_env  # noqa: E402

CONTENDERS = ("floor", "workers", "torchrun")


def _cpu() -> tuple[float, float]:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime, usage.ru_stime


def run_once(contender: str, src: str, dst: str, noop: str, code: str) -> dict:
    shutil.rmtree(dst, ignore_errors=True)
    env = child_env()
    env["PYTHONPATH"] = os.pathsep.join([code, env["PYTHONPATH"]])
    user, system = _cpu()
    started = time.perf_counter()
    done = subprocess.run(command(contender, src, dst, noop), capture_output=True, text=True, env=env, cwd=code)
    wall = time.perf_counter() - started
    user_after, system_after = _cpu()
    if done.returncode != 0:
        raise RuntimeError(f"{contender} failed (exit {done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return {"wall_seconds": wall, "user_seconds": user_after - user, "system_seconds": system_after - system,
            "cpu_seconds": user_after - user + system_after - system}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="100M")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--code", default=REPO, help="the checkout whose reshard runs (default: this one)")
    parser.add_argument("--label", default="", help="a name for this run in the results file")
    parser.add_argument("--scratch", default=os.path.join("/tmp", "reshard-launchers"))
    args = parser.parse_args(argv)
    os.makedirs(args.scratch, exist_ok=True)
    noop = os.path.join(args.scratch, "noop.py")
    with open(noop, "w") as fd:
        fd.write("# a torchrun worker that does nothing: the launcher's floor\n")
    src = ensure_source(args.size, args.scratch)
    dst = os.path.join(args.scratch, f"dst-cpu-{args.size}")
    run_once("workers", src, dst, noop, args.code)  # warms the page cache and the code
    loads, runs = [], {name: [] for name in CONTENDERS}
    for turn in range(args.repeat):
        for name in CONTENDERS:
            with open("/proc/loadavg") as fd:
                loads.append(float(fd.read().split()[0]))
            runs[name].append(run_once(name, src, dst, noop, args.code))
            run = runs[name][-1]
            print(f"  turn {turn + 1}: {name:<9} wall {run['wall_seconds']:6.2f} s  cpu {run['cpu_seconds']:5.2f} s "
                  f"(user {run['user_seconds']:.2f}, sys {run['system_seconds']:.2f})  load {loads[-1]:.1f}", flush=True)
    shutil.rmtree(dst, ignore_errors=True)
    median = {name: {key: statistics.median(r[key] for r in runs[name]) for key in ("wall_seconds", "cpu_seconds")}
              for name in CONTENDERS}
    beyond = {"torchrun_minus_floor_cpu": median["torchrun"]["cpu_seconds"] - median["floor"]["cpu_seconds"],
              "workers_cpu": median["workers"]["cpu_seconds"]}
    record = {"when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "label": args.label, "code": os.path.abspath(args.code), "cpus": os.cpu_count(), "size": args.size,
              "load_average_1min": {"min": min(loads), "max": max(loads)}, "repeat": args.repeat,
              "runs": runs, "median": median, **beyond}
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    with open(os.path.join(HERE, "results", f"launcher_cpu-{stamp}.json"), "w") as fd:
        json.dump(record, fd, indent=1)
    print(f"\nmedians of {args.repeat}, {os.cpu_count()} CPUs, 1-min load {min(loads):.1f}-{max(loads):.1f}:")
    for name in CONTENDERS:
        print(f"  {name:<9} wall {median[name]['wall_seconds']:6.2f} s  cpu {median[name]['cpu_seconds']:5.2f} s")
    print(f"  torchrun - floor: cpu {beyond['torchrun_minus_floor_cpu']:.2f} s; workers: cpu {beyond['workers_cpu']:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
