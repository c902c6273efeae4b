"""Pipeline size ladder: reshard --workers against ds_to_universal + load_universal, repeated, per size.

    python bench/pipeline_ladder.py                         # 2 GB rung, dp change and pp 2 -> 1, 3 repeats
    python bench/pipeline_ladder.py --sizes 0.6G,2G --repeat 3 --budget 32M
    python bench/pipeline_ladder.py --sizes 2G --targets 1,2 --repeat 1   # one target, one run each
    nice -n 10 python bench/pipeline_ladder.py --sizes 2G --tp-from 2 --targets "2,2;1,2" --repeat 2  # tp 2 -> 1

Per size, one PipelineModule save is trained here with real DeepSpeed on 2 CPU ranks at (pp, dp) =
(2, 1), as bench/pipeline_bench.py trains its save (the same worker modes: a tied embedding/head, Linear
pairs of odd widths, ZeRO-1 fp32, Adam), sized by `--dim`/`--pairs` per rung (SIZES). Then, for each
target (default: the dp change (2, 2) and the pp change (1, 2)), `--repeat` turns of, in this order:

    reshard       python -m reshard SRC DST --workers W --target-dp D --target-pp P --pipeline-layers N
                  --pipeline-tied embed:0,N-1 --memory-budget B (forked workers, no torchrun),
                  then plain load_checkpoint(DST) in a PipelineModule engine at (P, D)
    universal     ds_to_universal.py (W extract and merge workers; converted once per turn, it serves
                  every target), then load_checkpoint with "load_universal" at (P, D)

With `--tp-from T` the rung is the tp-change rung: the source is trained on 2 x T ranks at (pp, tp, dp) =
(2, T, 1) with pipeline_bench.py's Megatron-style model (ColumnParallelLinear / RowParallelLinear pairs,
`PipeModelDataParallelTopology`, the save's `universal_checkpoint_info` patterns; the rung's hidden width
rounded up to a multiple of T), every target is built at tp `--tp-to` (default 1), reshard gets
`--target-tp`, and the source engine's dumps are joined over its model ranks and cut again at the target
tp before they are compared (pipeline_bench.joined_truth). ds_to_universal + load_universal supports the
tp change, so it stays the baseline.

Every run is a watched process tree (process_tree.run_watched). The first turn's loads dump every
parameter's full fp32 master and Adam moments by name; they must equal the source engine's dumps and
each other, bit for bit, or the bench exits 1. From reshard's `--result-json`: bytes read (beside the
source's bytes); from its summary, every worker's peak anonymous (private) memory, against budget + 300 MB
(issue 37's goal).
Timings are printed as min and median of the turns: this bench was built on a 2-core machine shared
with other people's test runs, where a single wall time says little. The page cache is not dropped.
Writes bench/results/pipeline-ladder-<timestamp>.json.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, REPO)

SIZES = {  # rung -> (dim, hidden, pairs): 16 bytes per element (fp32 weights + master, exp_avg, exp_avg_sq)
    "0.6G": (1536, 1535, 8),   # 40.8M elements, 647 MB: pipeline_bench.py's 32M-budget runs
    "2G": (2048, 2047, 15),    # 127.8M elements, ~2.05 GB
    "tiny": (256, 255, 2),     # a smoke test of the bench itself (~5 MB)
}
READ_RE = re.compile(r"moved\s*: read ([\d.]+) ([KMG]iB)")
WORKER_ROW_RE = re.compile(r"^\s+(\d+)\s+\S+\s+\S+\s+([\d.]+) ([KMG]iB)\s+([\d.]+) ([KMG]iB)\s+([\d.]+) ([KMG]iB)"
                           r"\s+([\d.]+) ([KMG]iB)\s*$", re.M)
UNITS = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
HEADROOM = 300 * 10**6  # issue 37: peak private memory per worker at most budget + 300 MB


def summary_figures(text: str) -> dict:
    """From reshard's summary: bytes read and, per worker, (read, written, peak RSS, peak anon) bytes, each
    as the summary rounds it."""
    read = READ_RE.search(text)
    workers = [[int(float(row[i]) * UNITS[row[i + 1]]) for i in (1, 3, 5, 7)] for row in WORKER_ROW_RE.findall(text)]
    return {"read_bytes": int(float(read[1]) * UNITS[read[2]]) if read else None,
            "worker_read_bytes": [w[0] for w in workers], "worker_written_bytes": [w[1] for w in workers],
            "worker_peak_rss_bytes": [w[2] for w in workers], "worker_peak_anon_bytes": [w[3] for w in workers]}


def spread(values: list[float]) -> dict:
    return {"runs": values, "min": min(values), "median": statistics.median(values)}


def reshard_run(src: str, dst: str, target: tuple[int, int], layers: int, args, scratch: str, turn: int) -> dict:
    from pipeline_bench import watched
    shutil.rmtree(dst, ignore_errors=True)
    pp, dp = target
    command = [sys.executable, "-m", "reshard", src, dst, "--workers", args.workers, "--target-dp", dp,
               "--target-pp", pp, "--pipeline-layers", layers, "--pipeline-tied", f"embed:0,{layers - 1}",
               "--memory-budget", args.budget, "--ignore-batch-config",
               *(["--target-tp", args.tp_to] if args.tp_from > 1 else [])]
    what = f"reshard {pp}x{dp} turn {turn}"
    record = os.path.join(scratch, what.replace(" ", "_") + ".json")
    run = watched([*command, "--result-json", record], what, scratch, os.path.join(dst, "latest"))
    with open(os.path.join(scratch, what.replace(" ", "_") + ".log")) as fd:
        text = fd.read()
    run["summary"] = text[text.find("reshard done"):] if "reshard done" in text else text[-4000:]
    run.update(summary_figures(text))
    with open(record) as fd:  # exact bytes (the summary rounds them)
        run["read_bytes"] = json.load(fd)["checkpoints"][0]["bytes_read"]
    return run


def load_run(shape: list, target: tuple[int, int], tp: int, load_dir: str, dump: str, universal: bool, scratch: str,
             turn: int) -> dict:
    from pipeline_bench import read_dumps, torchrun, watched
    pp, dp = target
    shutil.rmtree(dump, ignore_errors=True)
    what = f"{'universal' if universal else 'native'} load {pp}x{dp} turn {turn}"
    run = watched(torchrun(pp * tp * dp, "load", "--pp", pp, "--tp", tp, *shape, "--load", load_dir, "--dump", dump,
                           *(["--universal"] if universal else [])), what, scratch)
    _, extras = read_dumps(dump)
    run["load_seconds"] = max(e["load_seconds"] for e in extras)
    return run


def rung(size: str, args, results: dict) -> dict:
    from make_checkpoint import tree_bytes
    from pipeline_bench import TAG, differences, joined_truth, read_dumps, torchrun, watched
    from run import log, run_universal_conversion
    dim, hidden, pairs = SIZES[size]
    stp, ttp = args.tp_from, args.tp_to
    if stp > 1:  # the Megatron-style pairs cut hidden evenly at both tps
        step = stp * ttp
        hidden = -(-hidden // step) * step
    layers = 3 * pairs + 3
    shape = ["--dim", dim, "--hidden", hidden, "--pairs", pairs, *(["--model-axis"] if stp > 1 else [])]
    scratch = os.path.join(os.path.abspath(args.scratch), size)
    shutil.rmtree(scratch, ignore_errors=True)
    os.makedirs(scratch)
    src, uni = os.path.join(scratch, "src"), os.path.join(scratch, "universal")
    case = {"size": size, "dim": dim, "hidden": hidden, "pairs": pairs, "layers": layers,
            "source": {"pp": 2, "tp": stp, "dp": 1}, "target_tp": ttp,
            "load_average_at_start": os.getloadavg()}
    log(f"[{size}] training the source at (pp, tp, dp) = (2, {stp}, 1), dim {dim}, hidden {hidden}, {pairs} pairs ...")
    case["train"] = watched(torchrun(2 * stp, "train", "--pp", 2, "--tp", stp, *shape, "--save", src, "--dump",
                                     os.path.join(scratch, "truth")), "train", scratch)
    case["source_bytes"] = tree_bytes(src)
    truth, _ = read_dumps(os.path.join(scratch, "truth"))
    case["elements"] = sum(v["fp32"].numel() for v in joined_truth(truth, pairs, stp, 1).values())
    truth = joined_truth(truth, pairs, stp, ttp)  # as an engine at the target tp holds it
    log(f"  source {case['source_bytes'] / 1e9:.2f} GB, {case['elements'] / 1e6:.1f}M elements")
    case["targets"] = {}
    conversions = []
    for turn in range(args.repeat):
        conversions.append(run_universal_conversion(os.path.join(src, TAG), uni, TAG, args.workers, scratch))
        log(f"  turn {turn}: ds_to_universal {conversions[-1]['wall_seconds']:.1f} s")
        for target in args.targets:
            key = f"{target[0]}x{target[1]}" + (f" tp {stp}->{ttp}" if stp > 1 else "")
            entry = case["targets"].setdefault(key, {"target": {"pp": target[0], "tp": ttp, "dp": target[1]}, "reshard": [],
                                                     "native_load": [], "universal_load": []})
            dst = os.path.join(scratch, f"reshard-{key}".replace(" ", "-").replace(">", ""))
            entry["reshard"].append(reshard_run(src, dst, target, layers, args, scratch, turn))
            ours, theirs = (os.path.join(scratch, f"dump-{kind}-{target[0]}x{target[1]}") for kind in ("native", "universal"))
            entry["native_load"].append(load_run(shape, target, ttp, dst, ours, False, scratch, turn))
            entry["universal_load"].append(load_run(shape, target, ttp, uni, theirs, True, scratch, turn))
            if turn == 0:  # the judgement: every master and moment, by name
                got, want = read_dumps(ours)[0], read_dumps(theirs)[0]
                entry["reshard_vs_source"] = differences(got, truth)
                entry["reshard_vs_universal"] = differences(got, want)
                entry["universal_vs_source"] = differences(want, truth)
            shutil.rmtree(ours, ignore_errors=True)
            shutil.rmtree(theirs, ignore_errors=True)
            r = entry["reshard"][-1]
            log(f"  turn {turn} {key}: reshard {r['wall_seconds']:.1f} s + load "
                f"{entry['native_load'][-1]['load_seconds']:.1f} s; universal load "
                f"{entry['universal_load'][-1]['load_seconds']:.1f} s")
    case["ds_to_universal"] = conversions
    case["conversion_seconds"] = spread([c["wall_seconds"] for c in conversions])
    budget = parse_budget(args.budget)
    for key, entry in case["targets"].items():
        ours = [r["wall_seconds"] + ld["load_seconds"] for r, ld in zip(entry["reshard"], entry["native_load"])]
        theirs = [c["wall_seconds"] + ld["load_seconds"] for c, ld in zip(conversions, entry["universal_load"])]
        entry["reshard_seconds"] = spread([r["wall_seconds"] for r in entry["reshard"]])
        entry["native_load_seconds"] = spread([ld["load_seconds"] for ld in entry["native_load"]])
        entry["universal_load_seconds"] = spread([ld["load_seconds"] for ld in entry["universal_load"]])
        entry["reshard_plus_native_load_seconds"] = spread(ours)
        entry["universal_plus_load_seconds"] = spread(theirs)
        entry["ratio_of_medians"] = statistics.median(theirs) / statistics.median(ours)
        entry["ratio_of_mins"] = min(theirs) / min(ours)
        entry["read_bytes"] = [r["read_bytes"] for r in entry["reshard"]]
        entry["max_worker_peak_anon_bytes"] = max(max(r["worker_peak_anon_bytes"] or [0]) for r in entry["reshard"])
        entry["max_worker_peak_rss_bytes"] = max(max(r["worker_peak_rss_bytes"] or [0]) for r in entry["reshard"])
        entry["memory_goal_bytes"] = budget + HEADROOM
        entry["equal"] = not (entry["reshard_vs_source"] or entry["reshard_vs_universal"])
    case["load_average_at_end"] = os.getloadavg()
    if not args.keep:
        shutil.rmtree(scratch, ignore_errors=True)
    return case


def parse_budget(text: str) -> int:
    from reshard.jobs.options import parse_size
    return parse_size(text)


def report(results: dict) -> None:
    print(f"\n== pipeline ladder: (pp, tp, dp) (2, {results['tp_from']}, 1) -> targets (pp, dp) at tp {results['tp_to']}, reshard --workers {results['workers']} at "
          f"--memory-budget {results['memory_budget']}, {results['repeat']} turns (min / median s) ==")
    print(f"{'size':>5} {'target':>14} {'reshard':>12} {'+ load':>12} {'ds_to_univ':>12} {'+ load':>12} "
          f"{'ratio med':>9} {'read / source':>16} {'worker anon max':>16} {'equal':>6}")
    for case in results["cases"]:
        conv = case["conversion_seconds"]
        for key, e in case["targets"].items():
            ours, theirs = e["reshard_plus_native_load_seconds"], e["universal_plus_load_seconds"]
            read = max(e["read_bytes"]) if all(e["read_bytes"]) else 0
            print(f"{case['size']:>5} {key:>14} {e['reshard_seconds']['min']:5.1f}/{e['reshard_seconds']['median']:<6.1f}"
                  f"{ours['min']:5.1f}/{ours['median']:<6.1f} {conv['min']:5.1f}/{conv['median']:<6.1f}"
                  f"{theirs['min']:5.1f}/{theirs['median']:<6.1f} {e['ratio_of_medians']:8.2f}x "
                  f"{read / 1e9:6.2f}/{case['source_bytes'] / 1e9:.2f} GB "
                  f"{e['max_worker_peak_anon_bytes'] / 1e6:7.0f} MB (<={e['memory_goal_bytes'] / 1e6:.0f}) "
                  f"{str(e['equal']):>6}")
        print(f"      load average at start {case['load_average_at_start']}, at end {case['load_average_at_end']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="2G", help=f"comma-separated rungs of {sorted(SIZES)}")
    parser.add_argument("--targets", default="2,2;1,2", help="'pp,dp;pp,dp': the target shapes (source (2, 1))")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--tp-from", type=int, default=1, help="> 1: the tp-change rung, source (2, T, 1)")
    parser.add_argument("--tp-to", type=int, default=1, help="the targets' tp (reshard --target-tp)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--budget", default="32M", help="reshard's --memory-budget")
    parser.add_argument("--scratch", default=os.path.join(HERE, ".cache", "pipeline-ladder"))
    parser.add_argument("--keep", action="store_true", help="keep the scratch directory")
    args = parser.parse_args()
    args.targets = [tuple(int(x) for x in t.split(",")) for t in args.targets.split(";")]
    if args.tp_from == 1 and args.tp_to != 1:
        parser.error("--tp-to needs a source with a model axis (--tp-from > 1)")
    from run import machine_info
    results = {"started": datetime.datetime.now(datetime.UTC), "machine": machine_info(), "workers": args.workers,
               "memory_budget": args.budget, "repeat": args.repeat, "tp_from": args.tp_from, "tp_to": args.tp_to,
               "nice": os.nice(0), "cases": []}
    for size in args.sizes.split(","):
        results["cases"].append(rung(size, args, results))
    report(results)
    name = "pipeline-ladder" + (f"-tp{args.tp_from}to{args.tp_to}" if args.tp_from > 1 else "")
    path = os.path.join(HERE, "results", f"{name}-{results['started']:%Y%m%d-%H%M%S}.json")
    with open(path, "w") as fd:
        json.dump(results, fd, indent=1, default=str)
    print(f"wrote {path}")
    if not all(e["equal"] for c in results["cases"] for e in c["targets"].values()):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
