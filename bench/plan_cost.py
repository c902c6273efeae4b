"""Plan cost alone: reshard's pure layout + plan for a synthetic model at large world sizes.

    python bench/plan_cost.py                      # the standard suite, each case in its own process
    python bench/plan_cost.py --suite pipeline     # 96- and 128-stage PipelineModule plans, ~8,192 ranks
    python bench/plan_cost.py --case --stage 3 --params 100000 --source 4096 --target 8192 \
        --workers 8 --budget 1073741824            # one case, JSON on stdout

The synthetic model: `--params` parameters in model order, one matrix (rows and columns in
128..1024, multiples of 128) then three vectors (128..4096), repeated; matrices form param
group 0 (decay), vectors group 1. 100k parameters hold about 7.4e9 elements. `--model moe`:
DeepSeek-V3-like layers (attention, norms, router, 256 experts of three matrices), 100k
parameters hold about 1.4e12 elements. Streams are fp32, exp_avg and exp_avg_sq (12 bytes per
element).

Timed separately, in one process, for one worker (`--worker`, default 0): `plan_reshard` (the
plan every worker derives: layouts, and for ZeRO-1/2 the segment table; for ZeRO-3 only O(params)
arithmetic), the worker's setup (buffer sizes), then that worker's blocks round by round as the
exchange asks for them (`WorkerPlan.round`). A worker's ZeRO-3 share is O(its segments): at W = 8
that is ~10^8 segments, computed a round at a time while the exchange runs; the bench times
`--round-seconds` of rounds and projects the rest from their mean. Memory: peak RSS (ru_maxrss)
minus the RSS before planning.
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

def current_rss() -> int:
    with open("/proc/self/statm") as fd:
        return int(fd.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def synthetic_params(count: int, seed: int = 0):
    """(ParamSpec tuple, groups): one matrix then three vectors, repeated, in model order."""
    from reshard.layouts.zero import ParamSpec
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


def moe_params(count: int, hidden: int = 7168, expert_hidden: int = 2048, experts: int = 256):
    """(ParamSpec tuple, groups) shaped like a DeepSeek-V3-class MoE, truncated to `count`
    parameters: per layer q, k, v, o [hidden, hidden], two norms [hidden], a router
    [experts, hidden], then per expert w1, w3 [expert_hidden, hidden] and w2 [hidden, expert_hidden].
    Group 0: matrices (decay), group 1: norms. 100k parameters are ~130 layers, ~1.4e12 elements."""
    from reshard.layouts.zero import ParamSpec
    params, matrices, vectors = [], [], []
    layer = 0
    while len(params) < count:
        names = [(f"l{layer}.attn.{k}", (hidden, hidden)) for k in "qkvo"]
        names += [(f"l{layer}.norm{k}", (hidden,)) for k in (1, 2)]
        names += [(f"l{layer}.router", (experts, hidden))]
        for e in range(experts):
            names += [(f"l{layer}.e{e}.w1", (expert_hidden, hidden)), (f"l{layer}.e{e}.w2", (hidden, expert_hidden)),
                      (f"l{layer}.e{e}.w3", (expert_hidden, hidden))]
        for name, shape in names[:count - len(params)]:
            (vectors if len(shape) == 1 else matrices).append(len(params))
            params.append(ParamSpec(name, shape))
        layer += 1
    return tuple(params), [tuple(matrices), tuple(vectors)]


class SyntheticSpec:
    """The parts of a CheckpointSpec the planner reads (topology, layout rules, streams)."""

    tensor = None
    experts = None

    def __init__(self, stage: int, params, groups, source: int):
        from reshard.planning.plan import Stream
        from reshard.topology import Topology
        self.stage, self.params, self.groups, self.topology = stage, params, groups, Topology(source)
        self.streams = (Stream("fp32", "float32", 4), Stream("exp_avg", "float32", 4),
                        Stream("exp_avg_sq", "float32", 4))
        self.frozen = ()

    def layout(self, world):
        from reshard.layouts.zero import zero3_layout, zero12_layout
        world = getattr(world, "dp", world)
        return zero3_layout(self.params, self.groups, world) if self.stage == 3 else \
            zero12_layout(self.params, self.groups, world)


def megatron_splits(params):
    """AutoTP-like splits of the synthetic model: matrices alternate column-parallel (dim 0, as
    qkv and fc1) and row-parallel (dim 1, as o and fc2); the first vector after a column matrix
    is its bias (column), the others are replicated (norms, a row-parallel layer's bias)."""
    from reshard.layouts.tensor_parallel import REPLICATED, TensorSplit
    splits, column_next, previous = [], True, None
    for p in params:
        if len(p.shape) == 2:
            previous = "column" if column_next else "row"
            column_next = not column_next
            splits.append(TensorSplit(previous, 0 if previous == "column" else 1))
        else:
            splits.append(TensorSplit("column", 0) if previous == "column" else REPLICATED)
            previous = None
    return tuple(splits)


class TensorParallelSyntheticSpec(SyntheticSpec):
    """A ZeRO-1/2 AutoTP checkpoint of the synthetic model at `source` ranks, `tp` of them per TP
    group; the model-states module tensors are the same parameters (as AutoTP's lp weights)."""

    def __init__(self, params, groups, source: int, tp: int):
        from reshard.layouts.tensor_parallel import TensorParallelParams, TensorParallelSpec
        from reshard.planning.plan import Stream
        from reshard.topology import Topology
        super().__init__(2, params, groups, source)
        self.topology = Topology(dp=source // tp, tp=tp)
        split = TensorParallelParams(tuple(p.name for p in params), tuple(p.shape for p in params),
                                     megatron_splits(params))
        self.tensor = TensorParallelSpec(split, split, {}, ())
        self.module_streams = (Stream("module", "bfloat16", 2),)
        self.local_params = {}

    def layout(self, world, tp=None, tp_rank=0):
        from reshard.layouts.zero import ParamSpec, zero12_layout
        key = (self.topology.tp if tp is None else tp, tp_rank)
        if key not in self.local_params:  # memoised as CheckpointSpec.local_params
            shapes = self.tensor.params.local_shapes(*key)
            self.local_params[key] = tuple(ParamSpec(p.name, s) for p, s in zip(self.params, shapes))
        return zero12_layout(self.local_params[key], self.groups, getattr(world, "dp", world))


class ExpertSyntheticSpec(SyntheticSpec):
    """A native-MoE ZeRO-1/2 checkpoint of the moe model: every expert matrix in an expert param
    group (`moe: True`), experts placed over `ep` expert-parallel ranks."""

    def __init__(self, params, groups, source: int, ep: int):
        from reshard.layouts.experts import ExpertParams
        from reshard.topology import Topology
        super().__init__(2, params, groups, source)
        self.topology = Topology(dp=source, ep=ep)
        expert_of, layers = [], {}
        for p in params:
            parts = p.name.split(".")
            if parts[1].startswith("e") and parts[1][1:].isdigit():
                layer = layers.setdefault(parts[0], len(layers))
                expert_of.append((layer, int(parts[1][1:])))
            else:
                expert_of.append(None)
        dense = [tuple(i for i in g if expert_of[i] is None) for g in groups]
        experts = tuple(i for g in groups for i in g if expert_of[i] is not None)
        self.groups = [*dense, experts]
        counts = [256] * len(layers)
        self.experts = ExpertParams((False,) * len(dense) + (True,), tuple(counts), tuple(layers), tuple(expert_of))

    def layout(self, world):
        from reshard.layouts.experts import expert_zero12_layout
        return expert_zero12_layout(self.params, self.groups, self.experts, world)


def make_spec(model: str, stage: int, count: int, source: int, tp: int = 1, ep: int = 1):
    params, groups = moe_params(count) if model == "moe" else synthetic_params(count)
    if tp > 1:
        return TensorParallelSyntheticSpec(params, groups, source, tp)
    if ep > 1:  # whole MoE layers only: DeepSpeed places every layer's experts alike
        per_layer = 7 + 3 * 256
        params, groups = moe_params(count // per_layer * per_layer)
        return ExpertSyntheticSpec(params, groups, source, ep)
    return SyntheticSpec(stage, params, groups, source)


def run_case(stage: int, count: int, source: int, target: int, workers: int, budget: int, worker: int = 0,
             round_seconds: float = 60.0, model: str = "mixed", tp: int = 1, ep: int = 1) -> dict:
    """Time and measure one worker's planning in this process: the plan every worker derives
    (`plan_reshard`), then that worker's blocks round by round, as the exchange asks for them.
    Rounds stop after `round_seconds`; the rest is projected from the mean round."""
    from reshard.planning.checkpoint_plan import plan_reshard
    from reshard.topology import Topology
    spec = make_spec(model, stage, count, source, tp, ep)
    params = spec.params
    rss_start = current_rss()
    cpu0 = time.process_time()
    t0 = time.perf_counter()
    plan = plan_reshard(spec, Topology(dp=target // tp, tp=tp, ep=ep), workers, budget)
    t1 = time.perf_counter()
    view = plan.worker_view(worker)
    send_buffer, receive_buffer = view.buffer_bytes()
    t2 = time.perf_counter()
    upfront_cpu = time.process_time() - cpu0
    upfront_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    segments = elements = rounds_done = 0
    first_round = None
    while rounds_done < plan.rounds and time.perf_counter() - t2 < round_seconds:
        _, sends, receives = view.round(rounds_done)
        segments += sum(len(b.segments) for b in sends) + sum(len(b.segments) for b in receives)
        elements += sum(b.elements for b in sends) + sum(b.elements for b in receives)
        rounds_done += 1
        if first_round is None:
            first_round = time.perf_counter() - t2
    t3 = time.perf_counter()
    cpu = time.process_time() - cpu0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    rounds_seconds = t3 - t2
    projected = rounds_seconds * plan.rounds / rounds_done if rounds_done else 0.0
    return {"model": model, "stage": stage, "tp": tp, "ep": ep, "params": len(params), "elements": int(sum(p.numel for p in params)), "source_ranks": source,
            "target_ranks": target, "workers": workers, "worker": worker, "budget_bytes": budget,
            "planner": type(plan.spaces[0]).__name__, "rounds": plan.rounds, "rounds_timed": rounds_done,
            "plan_segments": sum(len(getattr(space, "table", ())) for space in plan.spaces),  # uncut table rows
            "worker_segments_timed": segments, "worker_elements_timed": elements,
            "send_buffer_bytes": send_buffer, "receive_buffer_bytes": receive_buffer,
            "plan_seconds": t1 - t0, "upfront_cpu_seconds": upfront_cpu,
            "upfront_peak_rss_delta_bytes": upfront_peak - rss_start, "worker_setup_seconds": t2 - t1, "first_round_seconds": first_round or 0.0,
            "rounds_seconds": rounds_seconds, "all_rounds_projected_seconds": projected,
            "worker_share_seconds": (t2 - t0) + projected, "cpu_seconds_timed": cpu,
            "cpu_share_projected_seconds": cpu * ((t2 - t0) + projected) / max(t3 - t0, 1e-9), "rss_before_bytes": rss_start, "peak_rss_bytes": peak,
            "peak_rss_delta_bytes": peak - rss_start}


SUITE = [
    # (model, stage, params, source N, target M, workers W, tp, ep); stage 1 lays out as stage 2;
    # N and M count every rank (dp * tp)
    ("mixed", 2, 100_000, 4096, 8192, 1024, 1, 1),
    ("mixed", 2, 100_000, 4096, 8192, 8, 1, 1),
    ("mixed", 3, 100_000, 4096, 8192, 1024, 1, 1),
    ("mixed", 3, 100_000, 4096, 8192, 8, 1, 1),
    ("moe", 2, 100_000, 4096, 8192, 1024, 1, 1),
    ("moe", 2, 100_000, 4096, 8192, 8, 1, 1),
    ("moe", 3, 100_000, 4096, 8192, 1024, 1, 1),
    ("moe", 3, 100_000, 4096, 8192, 8, 1, 1),
    ("mixed", 3, 100_000, 64, 128, 32, 1, 1),
    ("mixed", 3, 1_000, 4096, 8192, 512, 1, 1),
]
TOPOLOGY_SUITE = [  # `--suite topology`: TP 8 (ZeRO-1/2 AutoTP) and EP 64 (native MoE ZeRO-1/2)
    ("mixed", 2, 100_000, 4096, 8192, 1024, 8, 1),
    ("mixed", 2, 100_000, 4096, 8192, 8, 8, 1),
    ("moe", 2, 100_000, 4096, 8192, 1024, 1, 64),
    ("moe", 2, 100_000, 4096, 8192, 8, 1, 64),
    # before rounds were cut per worker and per round, W = 8 at 100k MoE parameters (1.4e12
    # elements) cut ~2.6e8 window segments up front and needed > 23 GB; two whole MoE layers
    # (1,550 parameters, 2.2e10 elements) were the largest that ran
    ("moe", 2, 1_550, 4096, 8192, 8, 1, 64),
]


def pipeline_model(layers: int, per_layer: int, seed: int = 0):
    """(PipelineLayers, numels by name) of a PipelineModule: an embedding tied to the head at layers 0
    and `layers - 1`, and `per_layer` parameters (matrices and vectors of random sizes) in each layer
    between. 258 layers of 390 parameters hold about 100k parameters."""
    from reshard.layouts.pipeline import PipelineLayers
    rng = np.random.default_rng(seed)
    numels = {"tied_modules.embed.weight": 50_304 * 4096}
    for layer in range(1, layers - 1):
        for p in range(per_layer):
            numels[f"{layer}.p{p}"] = int(rng.integers(1, 9)) * 128 * (int(rng.integers(1, 33)) * 128 if p % 4 == 0 else 1)
    return PipelineLayers(layers, {"embed": (0, layers - 1)}), numels


def run_pipeline_case(source_pp: int, source_dp: int, target_pp: int, target_dp: int, workers: int,
                      layers: int = 258, per_layer: int = 390, worker: int = 0) -> dict:
    """One worker's planning of a pipeline job that changes the number of stages, as the whole-tensor pipeline
    job (deleted; bench/pipeline_plan_cost.py times the main road's planning) did it:
    the layer list checked against the source's stages (`assign_stages` at the source's pp, as
    check_layers_reproduce_source does), the target's assignment (`assign_stages` at the target's pp,
    once per job), and for each stage this worker builds, its ZeRO-1 layout over the target's dp with
    every rank's `param_slice_mappings` (what build_optimizers derives). Reading and writing tensors
    are not planning and are not timed here (bench/pipeline_bench.py times whole jobs)."""
    from reshard.layouts.pipeline import assign_stages
    from reshard.layouts.zero import zero12_group
    pipeline, numels = pipeline_model(layers, per_layer)
    rss_start = current_rss()
    t0 = time.perf_counter()
    assign_stages("parameters", pipeline, numels, source_pp)  # what the source check derives
    t1 = time.perf_counter()
    target = assign_stages("parameters", pipeline, numels, target_pp)
    t2 = time.perf_counter()
    mappings = 0
    built = tuple(range(worker, target_pp, workers))  # stage s by worker s % W
    for stage in built:
        counts = [numels[name] for name in target.names[stage]]
        group = zero12_group(range(len(counts)), counts, target_dp)
        for rank in range(target_dp):
            mappings += len(group.slice_mappings(rank, counts))
    t3 = time.perf_counter()
    return {"model": "pipeline", "params": len(numels), "elements": sum(numels.values()), "layers": layers,
            "source": [source_pp, source_dp], "target": [target_pp, target_dp], "source_ranks": source_pp * source_dp,
            "target_ranks": target_pp * target_dp, "workers": workers, "worker": worker,
            "source_check_seconds": t1 - t0, "target_assignment_seconds": t2 - t1,
            "stages_built": len(built), "stage_layouts_seconds": t3 - t2, "slice_mappings": mappings,
            "worker_share_seconds": t3 - t0, "largest_stage_params": max(map(len, target.names)),
            "peak_rss_delta_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss_start}


PIPELINE_SUITE = [  # `--suite pipeline`: (source pp, dp) -> (target pp, dp), workers W; ~100k parameters
    (96, 85, 128, 64, 8),      # 8,160 -> 8,192 ranks, 16 target stages per worker
    (128, 64, 96, 85, 8),      # 8,192 -> 8,160 ranks, 12 target stages per worker
    (128, 64, 96, 85, 96),     # one target stage per worker
]


def run_pipeline_suite() -> list[dict]:
    """Each case in a fresh process, so every peak RSS is that case's own."""
    results = []
    for source_pp, source_dp, target_pp, target_dp, workers in PIPELINE_SUITE:
        command = [sys.executable, os.path.abspath(__file__), "--case", "--suite", "pipeline",
                   "--source", f"{source_pp}x{source_dp}", "--target", f"{target_pp}x{target_dp}",
                   "--workers", str(workers)]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            results.append({"model": "pipeline", "source": [source_pp, source_dp], "target": [target_pp, target_dp],
                            "workers": workers, "failed": done.stderr[-2000:]})
            continue
        results.append(json.loads(done.stdout))
    return results


def describe_pipeline(result: dict) -> str:
    head = (f"pipeline {result.get('params', 0):>7,} params (pp, dp) {tuple(result['source'])} -> "
            f"{tuple(result['target'])} W={result['workers']:>3}")
    if "failed" in result:
        return f"{head}: FAILED {result['failed'].splitlines()[-1]}"
    return (f"{head}: source check {result['source_check_seconds']:.2f} s, target assignment "
            f"{result['target_assignment_seconds']:.2f} s, {result['stages_built']} stage layouts "
            f"({result['slice_mappings']:,} slice mappings) {result['stage_layouts_seconds']:.2f} s; worker share "
            f"{result['worker_share_seconds']:.2f} s, peak RSS +{result['peak_rss_delta_bytes'] / 1e6:.0f} MB")


def run_suite(budget: int, round_seconds: float, suite=SUITE) -> list[dict]:
    """Each case in a fresh process, so every peak RSS is that case's own."""
    results = []
    for model, stage, count, source, target, workers, tp, ep in suite:
        case = {"model": model, "stage": stage, "tp": tp, "ep": ep, "params": count, "source_ranks": source,
                "target_ranks": target, "workers": workers}
        command = [sys.executable, os.path.abspath(__file__), "--case", "--stage", str(stage), "--params", str(count),
                   "--source", str(source), "--target", str(target), "--workers", str(workers), "--budget", str(budget),
                   "--round-seconds", str(round_seconds), "--model", model, "--tp", str(tp), "--ep", str(ep)]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            results.append({**case, "failed": done.stderr[-2000:]})
            continue
        results.append(json.loads(done.stdout))
    return results


def describe(result: dict) -> str:
    head = (f"{result.get('model', 'mixed'):>5} ZeRO-{result['stage']} tp={result.get('tp', 1)} ep={result.get('ep', 1):<2} "
            f"{result['params']:>7,} params N={result['source_ranks']:>5} "
            f"M={result['target_ranks']:>5} W={result['workers']:>4}")
    if "skipped" in result:
        return f"{head}: skipped, {result['skipped']}"
    if "failed" in result:
        return f"{head}: FAILED {result['failed'].splitlines()[-1]}"
    projected = "" if result["rounds_timed"] == result["rounds"] else \
        f" ({result['rounds_timed']} timed, the rest projected)"
    return (f"{head}: {result['rounds']:>5} rounds; up-front CPU {result.get('upfront_cpu_seconds', 0):.2f} s, "
            f"+{result.get('upfront_peak_rss_delta_bytes', 0) / 1e6:.0f} MB; plan {result['plan_seconds']:6.2f} s, worker setup "
            f"{result['worker_setup_seconds']:5.2f} s, first round {result['first_round_seconds']:5.2f} s, "
            f"worker share {result['worker_share_seconds']:7.2f} s{projected} "
            f"(CPU {result['cpu_share_projected_seconds']:.2f} s), "
            f"{result['worker_segments_timed']:,} segments; peak RSS +{result['peak_rss_delta_bytes'] / 1e6:.0f} MB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", action="store_true", help="run one case in this process, JSON to stdout")
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--params", type=int, default=100_000)
    parser.add_argument("--source", default="4096", help="ranks, or PPxDP with --suite pipeline")
    parser.add_argument("--target", default="8192", help="ranks, or PPxDP with --suite pipeline")
    parser.add_argument("--workers", type=int, default=1024)
    parser.add_argument("--model", choices=("mixed", "moe"), default="mixed",
                        help="mixed: matrices and vectors of random sizes; moe: DeepSeek-V3-like layers and experts")
    parser.add_argument("--tp", type=int, default=1, help="AutoTP size of both sides (ZeRO-1/2; N and M count tp)")
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel size of both sides (--model moe, ZeRO-1/2)")
    parser.add_argument("--suite", choices=("data", "topology", "pipeline"), default="data",
                        help="data: the data-parallel cases; topology: TP 8 and EP 64; pipeline: 96 and 128 stages")
    parser.add_argument("--worker", type=int, default=0, help="the worker whose share is timed")
    parser.add_argument("--round-seconds", type=float, default=60.0,
                        help="time this long of round-by-round planning, project the rest")
    parser.add_argument("--budget", type=int, default=1 << 30)
    parser.add_argument("--json", help="write the suite's results here")
    args = parser.parse_args()
    if args.case and args.suite == "pipeline":
        (source_pp, source_dp), (target_pp, target_dp) = (map(int, side.split("x")) for side in (args.source, args.target))
        print(json.dumps(run_pipeline_case(source_pp, source_dp, target_pp, target_dp, args.workers, worker=args.worker)))
        return
    if args.case:
        print(json.dumps(run_case(args.stage, args.params, int(args.source), int(args.target), args.workers,
                                  args.budget, args.worker, args.round_seconds, args.model, args.tp, args.ep)))
        return
    if args.suite == "pipeline":
        results = run_pipeline_suite()
        for result in results:
            print(describe_pipeline(result))
    else:
        results = run_suite(args.budget, args.round_seconds, TOPOLOGY_SUITE if args.suite == "topology" else SUITE)
        for result in results:
            print(describe(result))
    if args.json:
        with open(args.json, "w") as fd:
            json.dump(results, fd, indent=1)


if __name__ == "__main__":
    main()
