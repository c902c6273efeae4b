"""Two nodes simulated on one host beside one node: time, and the bytes that cross between the nodes.

    python bench/multinode.py                          # 100M, best of 2
    python bench/multinode.py --sizes 100M 1G 2.5G --repeat 3 --per-node 1 2
    python bench/multinode.py --scratch /big/disk      # where sources and outputs go (default /tmp)
    python bench/multinode.py --per-node 2 --memory-budget 8M   # a leader's memory under a small budget

For each size, the ZeRO-2 fp32 checkpoint of bench/launchers.py (a `bench_model.LADDER` model at
N=2 ranks, synthetic_checkpoint.py, cached in SCRATCH) is resharded to M=3 by each contender, in
turns (one turn runs every contender once, so a busy moment of a shared machine falls on all alike):

  floor          torchrun --standalone --nproc_per_node=2 of a worker that does nothing (launchers.py)
  nodes-floor-2xK  two torchrun agents as below, of a worker that does nothing: the agents' own
                 multi-node rendezvous, start and exit barrier
  workers        python -m reshard SRC DST --target-dp 3 --workers 2 (forked, shared memory)
  torchrun       torchrun --standalone --nproc_per_node=2 -m reshard ... (one node: shared memory)
  nodes-2xK      two torchrun agents, --nnodes 2 --nproc_per_node K, c10d rendezvous on localhost,
                 each agent one node: shared memory inside a node, gloo between the two node leaders
                 (reshard.transport.nodes); `--result-json` gives the bytes the leaders sent between
                 nodes and the plan's figure, which must be equal

Walls are whole commands (perf_counter around the processes), best of --repeat, warm page cache
(one untimed `--workers` run first). The outputs of every contender are compared file by file with
the `--workers` output of the same turn. Each worker's peak RSS (VmHWM) and peak anonymous memory
are recorded, and each node leader's staging peak (the most cross-node bytes it held at once,
leaving and arriving, `reshard.transport.nodes.staging_window`) beside `--memory-budget`. Writes bench/results/multinode-<timestamp>.json and
bench/results/multinode.json, and prints a table.
"""
from __future__ import annotations

import argparse
import datetime
import filecmp
import json
import os
import shutil
import socket
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from launchers import SOURCE_RANKS, TARGET_RANKS, WORKERS, ensure_source, torchrun  # noqa: E402
from make_checkpoint import child_env, tree_bytes  # noqa: E402


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


MEMORY_BUDGET: list[str] = []
"""`--memory-budget SIZE` for every reshard contender, when given on the command line."""


def _job(src: str, dst: str, result: str) -> list[str]:
    return [src, dst, "--target-dp", str(TARGET_RANKS), "--quiet", "--result-json", result, *MEMORY_BUDGET]


def run_once(contender: str, src: str, dst: str, scratch: str) -> dict:
    shutil.rmtree(dst, ignore_errors=True)
    result_path = os.path.join(scratch, "result.json")
    if os.path.exists(result_path):
        os.unlink(result_path)
    floor = "floor" in contender
    job = [os.path.join(scratch, "noop.py")] if floor else ["-m", "reshard", *_job(src, dst, result_path)]
    os.sync()
    started = time.perf_counter()
    if contender.startswith("nodes-"):
        per_node = int(contender.split("x")[-1])
        port = _free_port()
        agents = [subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--nproc_per_node={per_node}",
             "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}", f"--rdzv_id=bench-{port}",
             f"--local_addr=127.0.0.{node + 1}", *job],
            env=child_env(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for node in (0, 1)]
        outputs = [agent.communicate()[0] for agent in agents]
        codes = [agent.returncode for agent in agents]
    else:
        command = [sys.executable, *job, "--workers", str(WORKERS)] if contender == "workers" else torchrun(*job)
        done = subprocess.run(command, capture_output=True, text=True, env=child_env(), cwd=REPO)
        outputs, codes = [done.stdout + done.stderr], [done.returncode]
    wall = time.perf_counter() - started
    if floor and not any(codes):
        return {"seconds": wall, "bytes_between_nodes": 0, "plan_bytes_between_nodes": 0}
    if any(codes) or not os.path.exists(result_path):
        raise RuntimeError(f"{contender} failed (exit {codes}):\n" + "\n".join(out[-3000:] for out in outputs))
    with open(result_path) as fd:
        (checkpoint,) = json.load(fd)["checkpoints"]
    return {"seconds": wall, "transport": checkpoint["transport"], "workers": checkpoint["workers"],
            "nodes": checkpoint["nodes"], "bytes_between_nodes": checkpoint["bytes_between_nodes"],
            "plan_bytes_between_nodes": checkpoint["plan_bytes_between_nodes"], "phases": checkpoint["phases"],
            "peak_rss_bytes": [w["peak_rss_bytes"] for w in checkpoint["workers_report"]],
            "peak_anonymous_bytes": [w["peak_anonymous_bytes"] for w in checkpoint["workers_report"]],
            "staging_peak_bytes": [w.get("staging_peak_bytes", 0) for w in checkpoint["workers_report"]],
            "torch_imported": [w["torch_imported"] for w in checkpoint["workers_report"]]}


def same_files(a: str, b: str) -> bool:
    tag = open(os.path.join(a, "latest")).read()
    names = sorted(os.listdir(os.path.join(a, tag)))
    if names != sorted(os.listdir(os.path.join(b, tag))):
        return False
    _, mismatch, errors = filecmp.cmpfiles(os.path.join(a, tag), os.path.join(b, tag), names, shallow=False)
    return not mismatch and not errors


def measure(size: str, scratch: str, repeat: int, contenders: list[str]) -> dict:
    src = ensure_source(size, scratch)
    reference = os.path.join(scratch, f"reference-{size}")
    run_once("workers", src, reference, scratch)  # warms the page cache and the code; the bytes to match
    dst = os.path.join(scratch, f"dst-{size}")
    runs: dict[str, list] = {name: [] for name in contenders}
    for turn in range(repeat):
        for name in contenders:
            run = run_once(name, src, dst, scratch)
            run["identical_to_workers"] = True if "floor" in name else same_files(reference, dst)
            runs[name].append(run)
            print(f"  {size} turn {turn + 1}: {name:<15} {run['seconds']:6.2f} s  between nodes "
                  f"{run['bytes_between_nodes']} B (plan {run['plan_bytes_between_nodes']} B)"
                  f"{'' if run['identical_to_workers'] else '  OUTPUT DIFFERS'}", flush=True)
    shutil.rmtree(dst, ignore_errors=True)
    shutil.rmtree(reference, ignore_errors=True)
    best = {name: min(r["seconds"] for r in runs[name]) for name in contenders}
    return {"size": size, "source_bytes": tree_bytes(src), "runs": runs, "best_seconds": best}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", nargs="+", default=["100M"])
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--per-node", nargs="+", type=int, default=[1],
                        help="workers per simulated node (one contender nodes-2xK each)")
    parser.add_argument("--scratch", default=os.path.join("/tmp", "reshard-multinode"))
    parser.add_argument("--keep-sources", action="store_true", help="leave the synthetic sources in SCRATCH")
    parser.add_argument("--memory-budget", help="reshard's --memory-budget for every contender (default: its own)")
    args = parser.parse_args(argv)
    if args.memory_budget:
        MEMORY_BUDGET[:] = ["--memory-budget", args.memory_budget]
    os.makedirs(args.scratch, exist_ok=True)
    contenders = ["floor", "workers", "torchrun", "nodes-floor-2x1", *(f"nodes-2x{k}" for k in args.per_node)]
    with open(os.path.join(args.scratch, "noop.py"), "w") as fd:
        fd.write("# a torchrun worker that does nothing: the launcher's floor\n")
    with open("/proc/loadavg") as fd:
        load_before = fd.read().split()[:3]
    results = []
    for size in args.sizes:
        results.append(measure(size, args.scratch, args.repeat, contenders))
        if not args.keep_sources:
            shutil.rmtree(os.path.join(args.scratch, f"src-{size}"), ignore_errors=True)
    with open("/proc/loadavg") as fd:
        load_after = fd.read().split()[:3]
    record = {"when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "cpus": os.cpu_count(), "load_average_before": load_before, "load_average_after": load_after,
              "source_ranks": SOURCE_RANKS, "target_ranks": TARGET_RANKS, "repeat": args.repeat,
              "memory_budget": args.memory_budget or "default (1G)",
              "page_cache": "warm", "sizes": results}
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    for name in (f"multinode-{stamp}.json", "multinode.json"):
        with open(os.path.join(HERE, "results", name), "w") as fd:
            json.dump(record, fd, indent=1)
    print(f"\nbest of {args.repeat}, warm page cache, {os.cpu_count()} CPUs, load average {' '.join(load_before)} "
          f"-> {' '.join(load_after)}")
    print(f"{'size':>6} {'GB':>6} " + " ".join(f"{name:>15}" for name in contenders) +
          "  bytes between nodes (measured / plan)")
    for r in results:
        crossing = "; ".join(f"{name}: {r['runs'][name][0]['bytes_between_nodes']} / "
                             f"{r['runs'][name][0]['plan_bytes_between_nodes']}" for name in contenders
                             if name.startswith("nodes-") and "floor" not in name)
        same = all(run["identical_to_workers"] for name in contenders for run in r["runs"][name])
        print(f"{r['size']:>6} {r['source_bytes'] / 1e9:6.2f} " +
              " ".join(f"{r['best_seconds'][name]:15.2f}" for name in contenders) +
              f"  {crossing}{'' if same else '  (SOME OUTPUT DIFFERS)'}")
        for name in contenders:
            if name.startswith("nodes-") and "floor" not in name:
                run = min(r["runs"][name], key=lambda run: run["seconds"])
                print(f"{'':>14}{name}: peak RSS / anon / staging per worker (MB): " + ", ".join(
                    f"{rss / 1e6:.0f}/{anon / 1e6:.0f}/{staged / 1e6:.2f}" for rss, anon, staged in
                    zip(run["peak_rss_bytes"], run["peak_anonymous_bytes"], run["staging_peak_bytes"])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
