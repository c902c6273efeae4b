"""Plan cost alone: reshard's pure layout + plan for a synthetic model at large world sizes.

    python bench/plan_cost.py                      # the standard suite, each case in its own process
    python bench/plan_cost.py --case --stage 2 --params 100000 --source 4096 --target 8192 \
        --workers 512 --budget 1073741824          # one case, JSON on stdout

The synthetic model: `--params` parameters in model order, one matrix (rows and columns in
128..1024, multiples of 128) then three vectors (128..4096), repeated; matrices form param
group 0 (decay), vectors group 1. 100k parameters hold about 7.4e9 elements. Streams are fp32,
exp_avg and exp_avg_sq (12 bytes per element).

Timed separately, in one process: building both layouts and their piece tables; `plan_space`
(intersection and rounds); `ReshardPlan(...).worker_view(0)` (worker 0's sends and receives).
Every worker of a real job computes all three. Memory: peak RSS (ru_maxrss) minus the RSS before
the layouts were built. ZeRO-3 has one piece per parameter per rank, so the suite climbs a
ladder of sizes and skips a case whose estimated memory exceeds --max-gb.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

BYTES_PER_PIECE_ESTIMATE = 250
"""Peak bytes per ZeRO-3 piece (source + target), ~225 measured on the smaller cases; used to skip."""


def current_rss() -> int:
    with open("/proc/self/statm") as fd:
        return int(fd.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def synthetic_params(count: int, seed: int = 0):
    """(ParamSpec tuple, groups): one matrix then three vectors, repeated, in model order."""
    from reshard.layout import ParamSpec
    rng = np.random.default_rng(seed)
    params, matrices, vectors = [], [], []
    for i in range(count):
        if i % 4 == 0:
            shape = (int(rng.integers(1, 9)) * 128, int(rng.integers(1, 8)) * 128)
            matrices.append(i)
        else:
            shape = (int(rng.integers(1, 33)) * 128,)
            vectors.append(i)
        params.append(ParamSpec(f"layer{i // 4}.p{i % 4}", shape))
    return tuple(params), [tuple(matrices), tuple(vectors)]


def zero3_piece_estimate(params, world_sizes) -> int:
    sizes = np.asarray([p.numel for p in params], dtype=np.int64)
    total = 0
    for world in world_sizes:
        chunks = -(-sizes // world)
        total += int((-(-sizes // chunks)).sum())
    return total


def build_layout(stage: int, params, groups, world: int):
    from reshard.layout import zero3_layout, zero12_layout
    return zero3_layout(params, groups, world) if stage == 3 else zero12_layout(params, groups, world)


def run_case(stage: int, count: int, source: int, target: int, workers: int, budget: int) -> dict:
    """Time and measure one planning case in this process."""
    from reshard.formats.deepspeed_spec import buffer_numels
    from reshard.plan import Ownership, ReshardPlan, Stream, plan_space
    params, groups = synthetic_params(count)
    streams = (Stream("fp32", "float32", 4), Stream("exp_avg", "float32", 4), Stream("exp_avg_sq", "float32", 4))
    rss_start = current_rss()
    t0 = time.perf_counter()
    src, dst = build_layout(stage, params, groups, source), build_layout(stage, params, groups, target)
    src_pieces, dst_pieces = src.pieces, dst.pieces
    t1 = time.perf_counter()
    ownership = Ownership(source, target, workers)
    space = plan_space("optim", src_pieces, dst_pieces, streams, buffer_numels(dst), ownership, budget)
    t2 = time.perf_counter()
    view = ReshardPlan(ownership, (space,), budget).worker_view(0)
    t3 = time.perf_counter()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"stage": stage, "params": count, "elements": int(sum(p.numel for p in params)), "source_ranks": source,
            "target_ranks": target, "workers": workers, "budget_bytes": budget,
            "pieces": len(src_pieces) + len(dst_pieces), "segments": len(space.segments), "rounds": space.rounds,
            "worker0_send_rounds": len(view.sends), "worker0_receive_rounds": len(view.receives),
            "layout_seconds": t1 - t0, "plan_space_seconds": t2 - t1, "worker_view_seconds": t3 - t2,
            "plan_seconds": t3 - t1, "total_seconds": t3 - t0, "rss_before_bytes": rss_start, "peak_rss_bytes": peak,
            "peak_rss_delta_bytes": peak - rss_start}


SUITE = [
    # (stage, params, source N, target M, workers W): the goal case first
    (2, 100_000, 4096, 8192, 512),
    (3, 100_000, 16, 32, 8),
    (3, 100_000, 64, 128, 32),
    (3, 100_000, 256, 512, 64),
    (3, 100_000, 4096, 8192, 512),
    (3, 1_000, 4096, 8192, 512),
]


def run_suite(budget: int, max_gb: float) -> list[dict]:
    """Each case in a fresh process, so every peak RSS is that case's own."""
    results = []
    for stage, count, source, target, workers in SUITE:
        case = {"stage": stage, "params": count, "source_ranks": source, "target_ranks": target, "workers": workers}
        if stage == 3:
            params, _ = synthetic_params(count)
            pieces = zero3_piece_estimate(params, (source, target))
            estimate = pieces * BYTES_PER_PIECE_ESTIMATE / 1e9
            if estimate > max_gb:
                results.append({**case, "skipped": f"{pieces:,} pieces, about {estimate:.0f} GB estimated "
                                                   f"(> {max_gb:g} GB)", "pieces": pieces})
                continue
        command = [sys.executable, os.path.abspath(__file__), "--case", "--stage", str(stage), "--params", str(count),
                   "--source", str(source), "--target", str(target), "--workers", str(workers), "--budget", str(budget)]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            results.append({**case, "failed": done.stderr[-2000:]})
            continue
        results.append(json.loads(done.stdout))
    return results


def describe(result: dict) -> str:
    head = (f"ZeRO-{result['stage']} {result['params']:>7,} params N={result['source_ranks']:>5} "
            f"M={result['target_ranks']:>5} W={result['workers']:>4}")
    if "skipped" in result:
        return f"{head}: skipped, {result['skipped']}"
    if "failed" in result:
        return f"{head}: FAILED {result['failed'].splitlines()[-1]}"
    return (f"{head}: {result['pieces']:>11,} pieces {result['segments']:>11,} segments {result['rounds']:>4} rounds; "
            f"layout {result['layout_seconds']:7.2f} s, plan_space {result['plan_space_seconds']:7.2f} s, "
            f"worker_view {result['worker_view_seconds']:6.2f} s; peak RSS +{result['peak_rss_delta_bytes'] / 1e9:.2f} GB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", action="store_true", help="run one case in this process, JSON to stdout")
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--params", type=int, default=100_000)
    parser.add_argument("--source", type=int, default=4096)
    parser.add_argument("--target", type=int, default=8192)
    parser.add_argument("--workers", type=int, default=512)
    parser.add_argument("--budget", type=int, default=1 << 30)
    parser.add_argument("--max-gb", type=float, default=8.0, help="skip ZeRO-3 cases estimated above this")
    parser.add_argument("--json", help="write the suite's results here")
    args = parser.parse_args()
    if args.case:
        print(json.dumps(run_case(args.stage, args.params, args.source, args.target, args.workers, args.budget)))
        return
    results = run_suite(args.budget, args.max_gb)
    for result in results:
        print(describe(result))
    if args.json:
        with open(args.json, "w") as fd:
            json.dump(results, fd, indent=1)


if __name__ == "__main__":
    main()
