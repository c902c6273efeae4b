"""The reshard benchmark, end to end: one command, a table on stdout, JSON in bench/results/.

    python bench/run.py --quick        # ~300 MB checkpoints on 2 ranks -> 3 and 1: a few minutes
    python bench/run.py                # ~272M-parameter model, 4 ranks -> 6 and 2: a long while

Options: --cache-dir DIR (checkpoints and scratch outputs; default bench/.cache), --workers W
(reshard and I/O-floor processes, default 2), --stages 2 3, --cache-drop auto|proc|fadvise,
--repeat R (reshard and I/O floor runs per case, alternating; medians compared; default 3),
--keep-outputs, --skip-universal, --skip-plan-cost, --no-frozen (no frozen parameter; see
bench_model.ModelConfig.frozen_position).

For each ZeRO stage (2 and 3, fp32, AdamW, trained one step with real DeepSpeed on N CPU ranks,
cached), and each target M:
  reshard    torchrun -nproc W bench/reshard_worker.py SRC DST --target-dp M, budget = size / 10
  I/O floor  W processes read every source byte once and write the target's byte count (fsync)
  universal  DeepSpeed's ds_to_universal.py (once per stage; the result serves every M), then
             engine.load_checkpoint with "load_universal" at M ranks
  native     engine.load_checkpoint(DST) at M ranks
Before each measurement the page cache is dropped the same way (page_cache.py) and the code is
re-warmed by importing torch, deepspeed and reshard once, so every contender starts with its
program cached and its data not. Then the synthetic planning cost (plan_cost.py).
Goals, each a ratio from this run, are printed PASS/MISS.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.util
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time

import psutil

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from bench_model import FULL, QUICK, config_to_json  # noqa: E402
from io_floor import measure_io_floor  # noqa: E402
from make_checkpoint import (  # noqa: E402
    DEFAULT_CACHE,
    child_env,
    ensure_checkpoint,
    torchrun_command,
    tree_bytes,
)
from page_cache import drop_page_cache  # noqa: E402
from process_tree import run_watched  # noqa: E402

GOAL_FLOOR_RATIO = 1.3
GOAL_SPEEDUP = 3.0
GOAL_RSS_SLACK = 300_000_000
GOAL_PLAN_SECONDS = 2.0
GB = 1e9


def log(message: str) -> None:
    print(f"[{datetime.datetime.now():%H:%M:%S}] {message}", flush=True)


class Cold:
    """Drop the page cache (same method every time), then re-cache the code of every contender."""

    def __init__(self, method: str, paths: list[str]):
        self.method, self.paths, self.used = method, paths, None

    def __call__(self) -> None:
        os.sync()
        time.sleep(2)  # let discards of just-deleted outputs (ext4 -o discard) settle first
        self.used = drop_page_cache(self.paths, self.method)
        subprocess.run([sys.executable, "-c", "import torch, deepspeed, reshard, numpy, psutil"], env=child_env(),
                       cwd=REPO, check=True, capture_output=True)


def ds_to_universal_path() -> str:
    spec = importlib.util.find_spec("deepspeed")
    return os.path.join(spec.submodule_search_locations[0], "checkpoint", "ds_to_universal.py")


def require_success(run, what: str, expected_file: str | None = None) -> None:
    """A run counts when it exited 0, or died at teardown after writing its result file."""
    if run.returncode == 0 or (expected_file and os.path.isfile(expected_file)):
        return
    raise RuntimeError(f"{what} failed (exit {run.returncode}); log {run.log_path}:\n{run.output_tail}")


def read_json(path: str) -> dict:
    with open(path) as fd:
        return json.load(fd)


def run_reshard(src: str, dst: str, target: int, workers: int, budget: int, scratch: str) -> dict:
    shutil.rmtree(dst, ignore_errors=True)
    out = os.path.join(scratch, f"reshard-{os.path.basename(dst)}.json")
    if os.path.exists(out):
        os.unlink(out)
    command = torchrun_command(workers, "reshard_worker.py", src, dst, "--target-dp", target,
                               "--memory-budget", budget, "--json", out)
    run = run_watched(command, env=child_env(), cwd=REPO, log_path=out + ".log", disk_path=scratch)
    require_success(run, f"reshard -> {target}", out)
    result = read_json(out)
    result["command_wall_seconds"] = run.wall_seconds
    result["tree"] = {k: v for k, v in run.to_dict().items() if k not in ("output_tail", "command")}
    result["command"] = " ".join(run.command)
    result["reshard_source"] = reshard_source()  # the code can change between runs of a long benchmark
    return result


def run_universal_conversion(tag_dir: str, out_root: str, tag: str, workers: int, scratch: str) -> dict:
    shutil.rmtree(out_root, ignore_errors=True)
    os.makedirs(out_root)
    command = [sys.executable, ds_to_universal_path(), "--input_folder", tag_dir, "--output_folder",
               os.path.join(out_root, tag), "--num_extract_workers", workers, "--num_merge_workers", workers,
               "--inject_missing_state"]
    command = [str(c) for c in command]
    run = run_watched(command, env=child_env(), cwd=REPO, log_path=os.path.join(scratch, "ds_to_universal.log"),
                      disk_path=scratch)
    require_success(run, "ds_to_universal")
    latest = os.path.join(out_root, "latest_universal")
    wrote_latest = os.path.isfile(latest)
    if not wrote_latest:  # what ds_to_universal users do by hand when the tool does not
        with open(latest, "w") as fd:
            fd.write(tag)
    result = {k: v for k, v in run.to_dict().items() if k not in ("output_tail",)}
    result.update({"command": " ".join(run.command), "output_bytes": tree_bytes(out_root),
                   "output_files": sum(len(f) for _, _, f in os.walk(out_root)),
                   "tool_wrote_latest_universal": wrote_latest})
    return result


def run_load(cfg, stage: int, world: int, load_dir: str, universal: bool, scratch: str, in_job_budget: int = 0) -> dict:
    kind = "universal" if universal else "in-job" if in_job_budget else "native"
    out = os.path.join(scratch, f"load-{kind}-z{stage}-m{world}.json")
    if os.path.exists(out):
        os.unlink(out)
    args = ["--config-json", config_to_json(cfg), "--stage", stage, "--load-dir", load_dir, "--json", out]
    if in_job_budget:
        args += ["--in-job", "--memory-budget", in_job_budget]
    command = torchrun_command(world, "load_timing.py", *args, *(["--universal"] if universal else []))
    run = run_watched(command, env=child_env(), cwd=REPO, log_path=out + ".log", disk_path=scratch)
    require_success(run, f"{kind} load at {world} ranks", out)
    result = read_json(out)
    ranks = result["ranks"]
    result["load_seconds"] = max(r["load_seconds_all_ranks"] for r in ranks)
    result["max_load_peak_rss_bytes"] = max(r["load_peak_rss_bytes"] for r in ranks)
    result["max_ru_maxrss_bytes"] = max(r["ru_maxrss_bytes"] for r in ranks)
    result["command_wall_seconds"] = run.wall_seconds
    result["tree"] = {k: v for k, v in run.to_dict().items() if k not in ("output_tail", "command")}
    return result


def median_run(runs: list[dict], key: str) -> dict:
    """The run whose `key` is the median (the lower middle one for an even count)."""
    ordered = sorted(runs, key=lambda r: r[key])
    return ordered[(len(ordered) - 1) // 2]


def measure_launch_floor(workers: int, repeat: int, cold: "Cold", scratch: str) -> dict:
    runs = []
    for _ in range(repeat):
        cold()
        run = run_watched(torchrun_command(workers, "launch_floor.py"), env=child_env(), cwd=REPO,
                          log_path=os.path.join(scratch, "launch_floor.log"), disk_path=scratch)
        require_success(run, "launch floor")
        runs.append(run.wall_seconds)
    return {"wall_seconds": statistics.median(runs), "runs": runs}


def checksums_agree(native: dict, universal: dict, rel: float = 1e-9) -> bool:
    """Per rank, group and tensor kind, the float64 sums of the two loads agree."""
    for a, b in zip(native["ranks"], universal["ranks"]):
        for ga, gb in zip(a["groups"], b["groups"]):
            for key, value in ga["sums"].items():
                other = gb["sums"].get(key)
                if other is None or abs(value - other) > rel * max(1.0, abs(value)):
                    return False
    return True


def group_hparams(load: dict) -> list:
    return [(g["lr"], g["weight_decay"]) for g in load["ranks"][0]["groups"]]


def run_stage(cfg, stage: int, source_ranks: int, targets: list[int], args, cold: Cold, results: dict) -> None:
    meta = ensure_checkpoint(cfg, stage, source_ranks, args.cache_dir, log=log)
    results["checkpoints"][f"z{stage}"] = meta
    src, tag = meta["save_dir"], meta["tag"]
    tag_dir = os.path.join(src, tag)
    scratch = os.path.join(args.cache_dir, "work", f"z{stage}")
    os.makedirs(scratch, exist_ok=True)
    budget = meta["bytes"] // 10
    universal_root = os.path.join(scratch, "universal")

    conversion = None
    if not args.skip_universal:
        cold()
        log(f"ZeRO-{stage}: ds_to_universal ({meta['bytes'] / GB:.2f} GB) ...")
        conversion = run_universal_conversion(tag_dir, universal_root, tag, args.workers, scratch)
        log(f"  converted in {conversion['wall_seconds']:.1f} s, peak tree RSS "
            f"{conversion['peak_tree_rss_bytes'] / GB:.2f} GB, output {conversion['output_bytes'] / GB:.2f} GB")
        results["universal"][f"z{stage}"] = conversion

    for target in targets:
        case = {"stage": stage, "source_ranks": source_ranks, "target_ranks": target, "workers": args.workers,
                "budget_bytes": budget, "checkpoint_bytes": meta["bytes"]}
        dst = os.path.join(scratch, f"reshard-m{target}")
        case["reshard_runs"], case["io_floor_runs"] = [], []
        for attempt in range(args.repeat):  # alternate the two contenders; the medians are compared
            cold()
            log(f"ZeRO-{stage} {source_ranks} -> {target}: reshard with W={args.workers}, budget {budget / 1e6:.0f} MB "
                f"(run {attempt + 1}/{args.repeat}) ...")
            run = run_reshard(src, dst, target, args.workers, budget, scratch)
            case["reshard_runs"].append(run)
            case["target_bytes"] = tree_bytes(os.path.join(dst, tag))
            log(f"  {run['command_wall_seconds']:.1f} s wall ({run['seconds']:.1f} s in job)")
            cold()
            floor = measure_io_floor(tag_dir, case["target_bytes"], args.workers, os.path.join(scratch, "floor"))
            case["io_floor_runs"].append(floor)
            log(f"  I/O floor {floor['wall_seconds']:.1f} s")
        case["reshard"] = median_run(case["reshard_runs"], "command_wall_seconds")
        case["io_floor"] = median_run(case["io_floor_runs"], "wall_seconds")

        cold()
        case["native_load"] = run_load(cfg, stage, target, dst, False, scratch)
        log(f"  native load at {target} ranks: {case['native_load']['load_seconds']:.1f} s")
        cold()
        case["in_job_load"] = run_load(cfg, stage, target, src, False, scratch, in_job_budget=budget)
        log(f"  in-job reshard + load at {target} ranks: {case['in_job_load']['load_seconds']:.1f} s")
        if conversion is not None:
            cold()
            case["universal_load"] = run_load(cfg, stage, target, universal_root, True, scratch)
            case["checksums_agree"] = checksums_agree(case["native_load"], case["universal_load"])
            case["frozen_agree"] = all(a["frozen_sum"] == b["frozen_sum"] for a, b in
                                       zip(case["native_load"]["ranks"], case["universal_load"]["ranks"]))
            case["hparams_native"] = group_hparams(case["native_load"])
            case["hparams_universal"] = group_hparams(case["universal_load"])
            log(f"  universal load at {target} ranks: {case['universal_load']['load_seconds']:.1f} s; "
                f"state checksums agree: {case['checksums_agree']}, frozen params agree: {case['frozen_agree']}")
        results["cases"].append(case)
        if not args.keep_outputs:
            shutil.rmtree(dst, ignore_errors=True)
    if not args.keep_outputs:
        shutil.rmtree(universal_root, ignore_errors=True)
    results["cache_drop_method"] = cold.used


def run_plan_cost(results: dict, scratch: str) -> None:
    log("plan cost (synthetic layouts) ...")
    out = os.path.join(scratch, "plan_cost.json")
    subprocess.run([sys.executable, os.path.join(HERE, "plan_cost.py"), "--json", out], cwd=REPO, check=True,
                   env=child_env(), stdout=subprocess.DEVNULL)
    results["plan_cost"] = read_json(out)


def evaluate_goals(results: dict) -> list[dict]:
    goals = []
    cases = results["cases"]
    if cases:
        ratios = [c["reshard"]["command_wall_seconds"] / c["io_floor"]["wall_seconds"] for c in cases]
        goals.append({"goal": f"reshard wall <= {GOAL_FLOOR_RATIO}x I/O floor", "worst": max(ratios),
                      "values": ratios, "pass": max(ratios) <= GOAL_FLOOR_RATIO})
        limits = [(max(r["peak_rss_bytes"] for r in c["reshard"]["reports"]), c["budget_bytes"] + GOAL_RSS_SLACK)
                  for c in cases]
        goals.append({"goal": "peak RSS per reshard worker <= budget + 300 MB", "worst": max(p / lim for p, lim in limits),
                      "values": [p / lim for p, lim in limits], "pass": all(p <= lim for p, lim in limits)})
        with_universal = [c for c in cases if "universal_load" in c]
        if with_universal:
            speedups = [speedup(c, results) for c in with_universal]
            goals.append({"goal": f"(universal conversion + load) / (reshard + native load) >= {GOAL_SPEEDUP}",
                          "worst": min(speedups), "values": speedups, "pass": min(speedups) >= GOAL_SPEEDUP})
    goal_case = next((p for p in results.get("plan_cost", []) if p.get("stage") == 2 and "plan_seconds" in p), None)
    if goal_case:
        goals.append({"goal": f"planning {goal_case['target_ranks']} x {goal_case['params']:,} < {GOAL_PLAN_SECONDS} s",
                      "worst": goal_case["plan_seconds"], "values": [goal_case["plan_seconds"]],
                      "pass": goal_case["plan_seconds"] < GOAL_PLAN_SECONDS})
    return goals


def speedup(case: dict, results: dict) -> float:
    conversion = results["universal"][f"z{case['stage']}"]["wall_seconds"]
    theirs = conversion + case["universal_load"]["load_seconds"]
    ours = case["reshard"]["command_wall_seconds"] + case["native_load"]["load_seconds"]
    return theirs / ours


def span(values: list[float]) -> str:
    return f"({min(values):.1f}-{max(values):.1f})"


def gb(n: float) -> str:
    return f"{n / GB:.2f}"


def print_tables(results: dict) -> None:
    print("\n== checkpoints (fp32, AdamW, 1 step, real DeepSpeed) ==")
    for name, meta in results["checkpoints"].items():
        print(f"  {name}: {meta['config']['name']} {meta['params'] / 1e6:.0f}M params, N={meta['ranks']}, "
              f"{gb(meta['bytes'])} GB on disk, trained+saved in {meta['train_wall_seconds']:.0f} s "
              f"(peak tree RSS {gb(meta['train_peak_tree_rss_bytes'])} GB)")
    print(f"  page cache dropped with: {results.get('cache_drop_method')}; W = {results['workers']}")

    launch = results.get("launch_floor", {}).get("wall_seconds", 0.0)
    print(f"\n== reshard vs I/O floor (medians of {results['repeat']} alternating runs; launch floor "
          f"{launch:.1f} s = torchrun + {results['workers']} workers importing torch/deepspeed/reshard, gloo init) ==")
    head = (f"  {'case':<12}{'wall s':>8}{'(min-max)':>12}{'in-job s':>9}{'GB/s':>6}{'read GB':>8}{'wrote GB':>9}"
            f"{'budget MB':>10}{'w0 RSS MB':>10}{'w1 RSS MB':>10}{'tree MB':>8}{'floor s':>8}{'(min-max)':>12}"
            f"{'ratio':>6}{'in-job ratio':>13}")
    print(head)
    for c in results["cases"]:
        r = c["reshard"]
        walls = [x["command_wall_seconds"] for x in c["reshard_runs"]]
        floors = [x["wall_seconds"] for x in c["io_floor_runs"]]
        rss = [f"{w['peak_rss_bytes'] / 1e6:>10.0f}" for w in r["reports"]]
        print(f"  {case_name(c):<12}{r['command_wall_seconds']:>8.1f}{span(walls):>12}{r['seconds']:>9.1f}"
              f"{r['bytes_written'] / r['command_wall_seconds'] / GB:>6.2f}{gb(r['bytes_read']):>8}"
              f"{gb(r['bytes_written']):>9}{c['budget_bytes'] / 1e6:>10.0f}{''.join(rss[:2])}"
              f"{r['tree']['peak_tree_rss_bytes'] / 1e6:>8.0f}{c['io_floor']['wall_seconds']:>8.1f}{span(floors):>12}"
              f"{r['command_wall_seconds'] / c['io_floor']['wall_seconds']:>6.2f}"
              f"{r['seconds'] / c['io_floor']['wall_seconds']:>13.2f}")
    print("  wall = whole torchrun command; in-job = result.seconds; GB/s = bytes written / wall; "
          "RSS = ru_maxrss per worker; tree = peak summed RSS incl. torchrun")

    print("\n== reshard + native load vs ds_to_universal + universal load ==")
    print("  (last two columns: reshard.deepspeed.load_checkpoint at M straight from the source, resharding in the "
          "job, and the speed-up of that path)")
    print(f"  {'case':<12}{'reshard s':>10}{'load s':>8}{'load RSS MB':>12}{'sum s':>8}  |{'convert s':>10}"
          f"{'conv RSS MB':>12}{'conv disk GB':>13}{'uload s':>8}{'uload RSS MB':>13}{'sum s':>8}{'speedup':>8}"
          f"{'state==':>8}{'frozen==':>9}{'in-job s':>9}{'speedup':>8}")
    for c in results["cases"]:
        n = c["native_load"]
        ours = c["reshard"]["command_wall_seconds"] + n["load_seconds"]
        line = (f"  {case_name(c):<12}{c['reshard']['command_wall_seconds']:>10.1f}{n['load_seconds']:>8.1f}"
                f"{n['max_load_peak_rss_bytes'] / 1e6:>12.0f}{ours:>8.1f}  |")
        if "universal_load" in c:
            conv, u = results["universal"][f"z{c['stage']}"], c["universal_load"]
            theirs = conv["wall_seconds"] + u["load_seconds"]
            line += (f"{conv['wall_seconds']:>10.1f}{conv['peak_tree_rss_bytes'] / 1e6:>12.0f}"
                     f"{conv['peak_disk_bytes'] / GB:>13.2f}{u['load_seconds']:>8.1f}"
                     f"{u['max_load_peak_rss_bytes'] / 1e6:>13.0f}{theirs:>8.1f}{theirs / ours:>8.2f}"
                     f"{'yes' if c['checksums_agree'] else 'NO':>8}{'yes' if c['frozen_agree'] else 'NO':>9}")
            if "in_job_load" in c:
                in_job = c["in_job_load"]["load_seconds"]
                line += f"{in_job:>9.1f}{theirs / in_job:>8.2f}"
        print(line)
    for c in results["cases"]:
        if "universal_load" in c and c["hparams_native"] != c["hparams_universal"]:
            print(f"  note {case_name(c)}: per-group (lr, weight_decay) after native load {c['hparams_native']}, "
                  f"after universal load {c['hparams_universal']}")

    if results.get("plan_cost"):
        print("\n== plan cost (one process, synthetic layouts; budget 1 GiB) ==")
        from plan_cost import describe
        for p in results["plan_cost"]:
            print("  " + describe(p))

    print("\n== goals ==")
    for g in results["goals"]:
        values = ", ".join(f"{v:.2f}" for v in g["values"])
        print(f"  {'PASS' if g['pass'] else 'MISS'}  {g['goal']}: [{values}]")


def case_name(case: dict) -> str:
    return f"z{case['stage']} {case['source_ranks']}->{case['target_ranks']}"


def reshard_source() -> dict:
    """Which reshard was measured: git HEAD, whether reshard/ differs from it, a hash of its sources."""
    import hashlib
    digest = hashlib.sha256()
    for root, _, names in sorted(os.walk(os.path.join(REPO, "reshard"))):
        for name in sorted(n for n in names if n.endswith(".py")):
            with open(os.path.join(root, name), "rb") as fd:
                digest.update(name.encode() + fd.read())

    def git(*args):
        done = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True)
        return done.stdout.strip() if done.returncode == 0 else None
    return {"head": git("rev-parse", "HEAD"), "dirty": git("status", "--short", "reshard"),
            "sources_sha256": digest.hexdigest()[:16]}


def machine_info() -> dict:
    from importlib.metadata import version
    return {"reshard": reshard_source(), "host": platform.node(), "kernel": platform.release(), "cpus": os.cpu_count(),
            "memory_bytes": psutil.virtual_memory().total, "python": platform.python_version(),
            "torch": version("torch"), "deepspeed": version("deepspeed"), "numpy": version("numpy")}


def write_results(results: dict) -> str:
    folder = os.path.join(HERE, "results")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{results['started']:%Y%m%d-%H%M%S}.json".replace(":", ""))
    text = json.dumps(results, indent=1, default=str)
    for target in (path, os.path.join(folder, "latest.json")):
        with open(target + ".tmp", "w") as fd:
            fd.write(text)
        os.replace(target + ".tmp", target)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="~300 MB checkpoints on 2 ranks (smoke test)")
    parser.add_argument("--cache-dir", default=DEFAULT_CACHE)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 3], choices=(2, 3))
    parser.add_argument("--cache-drop", default="auto", choices=("auto", "proc", "fadvise"))
    parser.add_argument("--keep-outputs", action="store_true", help="keep resharded and universal outputs")
    parser.add_argument("--repeat", type=int, default=3,
                        help="runs of reshard and of the I/O floor per case, alternating; medians compared")
    parser.add_argument("--skip-universal", action="store_true")
    parser.add_argument("--skip-plan-cost", action="store_true")
    parser.add_argument("--no-frozen", action="store_true",
                        help="no frozen parameter in the model (ZeRO-3: reshard currently refuses such checkpoints)")
    args = parser.parse_args()
    args.cache_dir = os.path.abspath(args.cache_dir)

    cfg, source_ranks = (QUICK, 2) if args.quick else (FULL, 4)
    if args.no_frozen:
        cfg = dataclasses.replace(cfg, frozen_position=False, name=cfg.name + "-nofrozen")
    targets = [source_ranks * 3 // 2, source_ranks // 2]
    started = datetime.datetime.now()
    results = {"started": started, "mode": "quick" if args.quick else "full", "machine": machine_info(),
               "workers": args.workers, "repeat": args.repeat, "model": json.loads(config_to_json(cfg)),
               "cache_protocol": "page cache dropped, then code re-cached by importing torch/deepspeed/reshard once",
               "checkpoints": {}, "universal": {}, "cases": []}
    cold = Cold(args.cache_drop, [args.cache_dir])
    os.makedirs(os.path.join(args.cache_dir, "work"), exist_ok=True)
    log(f"launch floor: torchrun + {args.workers} workers importing torch/deepspeed/reshard, gloo init, exit ...")
    results["launch_floor"] = measure_launch_floor(args.workers, args.repeat, cold, os.path.join(args.cache_dir, "work"))
    log(f"  {results['launch_floor']['wall_seconds']:.1f} s")
    for stage in args.stages:
        run_stage(cfg, stage, source_ranks, targets, args, cold, results)
    if not args.skip_plan_cost:
        run_plan_cost(results, os.path.join(args.cache_dir, "work"))
    results["goals"] = evaluate_goals(results)
    results["finished"] = datetime.datetime.now()
    print_tables(results)
    print(f"\nresults: {write_results(results)}")


if __name__ == "__main__":
    main()
