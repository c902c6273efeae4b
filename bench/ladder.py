"""Size ladder: reshard against DeepSpeed's universal-checkpoint path from 100 MB to 10 GB, one run.

    pip install -e '.[bench]'                       # matplotlib for the plot
    python bench/ladder.py                          # 100M 1G 2.5G 10G (sizes that fit the machine)
    python bench/ladder.py --sizes 100M 1G          # some sizes only
    python bench/ladder.py --repeat 3               # every contender 3 times per size, medians compared
    python bench/ladder.py --plot-only bench/results/ladder.json

For each size: a ZeRO-2 fp32 AdamW checkpoint of a `bench_model.LADDER` model trained one step
with real DeepSpeed on N=2 CPU ranks (cached, see make_checkpoint.py), resumed at M=1, as in
issue 14. Where training would not fit this machine's memory (10G), the source is written by
synthetic_checkpoint.py instead (the same files and trees, a known seeded state; validated by
tests/test_synthetic_checkpoint.py) and deleted after the size is measured. Each contender
starts with the page cache dropped and its code cached (run.Cold):

  offline   python -m reshard SRC DST --target-dp M --workers W (forked workers, no torchrun),
            then engine.load_checkpoint(DST) at M ranks (load_timing.py)
  torchrun  torchrun --nproc_per_node=W -m reshard SRC DST --target-dp M (the same job launched
            by torchrun's agent), reported beside it
  in-job    reshard.deepspeed.load_checkpoint(engine, SRC) at M ranks (load_timing.py --in-job)
  DeepSpeed ds_to_universal.py (W extract and merge workers) + load_checkpoint with load_universal
  I/O floor io_floor.py: W processes read every source byte once and write the target's bytes

Where loading at M=1 would not fit in memory either (10G), the size is measured conversion only
(`"conversion_only": true`: reshard offline, under torchrun, ds_to_universal, the floor; no
loads, no in-job path) and drawn as such.

Reshard walls are whole commands; its per-phase wall times and each worker's peak RSS are read
from the summary (against the budget it names, to check RSS <= budget + 300 MB). Loads are timed around load_checkpoint (slowest rank), as in run.py.
Ratios are (DeepSpeed's conversion + universal load) / (ours), from the same run. Writes
bench/results/ladder-<timestamp>.json, bench/results/ladder.json and bench/results/ladder.png
(log-log: seconds against checkpoint size). A size whose training or load would not fit this
machine's memory is skipped and recorded as such.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)

import psutil  # noqa: E402
from bench_model import LADDER  # noqa: E402
from io_floor import measure_io_floor  # noqa: E402
from make_checkpoint import DEFAULT_CACHE, child_env, ensure_checkpoint, tree_bytes  # noqa: E402
from process_tree import run_watched  # noqa: E402
from run import Cold, log, machine_info, median_run, require_success, run_load, run_universal_conversion  # noqa: E402

SOURCE_RANKS, TARGET_RANKS = 2, 1
TRAIN_RSS_PER_BYTE = 2.8
UNIVERSAL_RSS_PER_BYTE = 1.25
"""Memory ds_to_universal may need at W=2 (main: model states; each extract worker: one optim file),
plus headroom, per checkpoint byte; the conversion-only path waits for that much to be available."""
"""Peak summed RSS of training divided by checkpoint bytes (6.9 GB for the 2.5 GB model here);
loading at M=1 needs about as much."""
PHASES_RE = re.compile(r"phases : (.*?) \(slowest")
BUDGET_RE = re.compile(r"under a ([\d.]+) ([KMG]iB) budget")
WORKER_RE = re.compile(r"^\s+(\d+)\s+\S+\s+\S+\s+.*?([\d.]+) ([KMG]?i?B)\s*$", re.M)
UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def reshard_command(src: str, dst: str, workers: int, launcher: str) -> list[str]:
    args = [src, dst, "--target-dp", str(TARGET_RANKS), "--quiet"]
    if launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={workers}",
                "-m", "reshard", *args]
    return [sys.executable, "-m", "reshard", *args, "--workers", str(workers)]


def run_reshard(src: str, dst: str, workers: int, launcher: str, scratch: str) -> dict:
    shutil.rmtree(dst, ignore_errors=True)
    log_path = os.path.join(scratch, f"reshard-{launcher}.log")
    run = run_watched(reshard_command(src, dst, workers, launcher), env=child_env(), cwd=REPO, log_path=log_path,
                      disk_path=scratch)
    require_success(run, f"reshard ({launcher})", os.path.join(dst, "latest"))
    with open(log_path) as fd:
        text = fd.read()
    found = PHASES_RE.search(text)
    phases = {name: float(seconds) for name, seconds in re.findall(r"([a-z+-]+) (\d+\.\d+) s", found[1])} \
        if found else {}
    budget = BUDGET_RE.search(text)
    # the summary's per-worker column: "peak anon" (anonymous memory) now, "peak RSS" before
    header = "peak anon" if "peak anon" in text else "peak RSS"
    table = text[text.find(header):] if header in text else ""
    return {"wall_seconds": run.wall_seconds, "phases": phases, "peak_tree_rss_bytes": run.peak_tree_rss_bytes,
            "peak_process_anon_rss_bytes": run.peak_process_anon_rss_bytes,
            "memory_budget_bytes": int(float(budget[1]) * UNITS[budget[2]]) if budget else None,
            "worker_peak_rss_bytes": [int(float(v) * UNITS[u]) for _, v, u in WORKER_RE.findall(table)],
            "summary": text[text.find("reshard done"):] if "reshard done" in text else text[-2000:]}


def fits(size_bytes: int) -> tuple[bool, str]:
    need = TRAIN_RSS_PER_BYTE * size_bytes
    total = psutil.virtual_memory().total
    if need > 0.8 * total:
        return False, (f"skipped: training and loading a {size_bytes / 1e9:.1f} GB checkpoint needs about "
                       f"{need / 1e9:.0f} GB of memory; this machine has {total / 1e9:.0f} GB (shared)")
    return True, ""


def synthetic_source(cfg, cache_dir: str) -> dict:
    """A ZeRO-2 checkpoint at SOURCE_RANKS written by synthetic_checkpoint.py (cached; meta.json last)."""
    from synthetic_checkpoint import write_checkpoint
    root = os.path.join(cache_dir, f"synthetic-{cfg.name}-z2-n{SOURCE_RANKS}-{cfg.key(stage=2, ranks=SOURCE_RANKS)}")
    meta_path = os.path.join(root, "meta.json")
    if os.path.isfile(meta_path):
        with open(meta_path) as fd:
            return json.load(fd)
    shutil.rmtree(root, ignore_errors=True)
    log(f"writing a synthetic {cfg.name} checkpoint ({cfg.param_count / 1e6:.0f}M params, ZeRO-2, "
        f"{SOURCE_RANKS} ranks): training would not fit ...")
    meta = write_checkpoint(os.path.join(root, "save"), cfg, 2, SOURCE_RANKS, seed=0)
    meta["root"] = root
    with open(meta_path + ".tmp", "w") as fd:
        json.dump(meta, fd, indent=1)
    os.replace(meta_path + ".tmp", meta_path)
    log(f"  written: {meta['bytes'] / 1e9:.2f} GB in {meta['write_seconds']:.0f} s")
    return meta


def run_size(label: str, args, cold: Cold) -> dict:
    cfg = LADDER[label]
    estimate = cfg.param_count * 16
    ok, why = fits(estimate)
    conversion_only = not ok
    if not ok and not args.synthetic:
        log(f"{label}: {why}")
        return {"size": label, "skipped": why, "estimated_bytes": estimate}
    if ok:
        meta = ensure_checkpoint(cfg, 2, SOURCE_RANKS, args.cache_dir, log=log)
        source_kind = "trained (make_checkpoint.py)"
    else:
        log(f"{label}: {why}: conversion only, from a synthetic source")
        meta = synthetic_source(cfg, args.cache_dir)
        source_kind = "synthetic (synthetic_checkpoint.py, seed 0)"
    src, tag = meta["save_dir"], meta["tag"]
    scratch = os.path.join(args.cache_dir, "work", f"ladder-{cfg.name}")
    os.makedirs(scratch, exist_ok=True)
    dst, universal = os.path.join(scratch, "reshard"), os.path.join(scratch, "universal")
    case = {"size": label, "checkpoint_bytes": meta["bytes"], "params": meta["params"], "workers": args.workers,
            "source": source_kind, "conversion_only": conversion_only}
    if conversion_only:
        case["not_measured"] = f"{why}: no loads, no in-job path"
    try:
        measure(case, cfg, src, tag, dst, universal, scratch, args, cold)
    finally:
        shutil.rmtree(dst, ignore_errors=True)
        shutil.rmtree(universal, ignore_errors=True)
        if conversion_only and not args.keep_synthetic:
            shutil.rmtree(meta["root"], ignore_errors=True)
    return case


def wait_for_memory(need: int, patience: float = 900.0) -> bool:
    """Wait (up to `patience` s) until the shared machine has `need` bytes available."""
    deadline = time.monotonic() + patience
    while psutil.virtual_memory().available < need:
        if time.monotonic() > deadline:
            return False
        log(f"  waiting for {need / 1e9:.0f} GB of available memory "
            f"(now {psutil.virtual_memory().available / 1e9:.1f} GB) ...")
        time.sleep(30)
    return True


def run_deepspeed_path(case: dict, cfg, src: str, tag: str, universal: str, scratch: str, args, cold: Cold) -> None:
    label = case["size"]
    # ds_to_universal holds the model-states file in its main process and one whole optim-states
    # file per extract worker: about the checkpoint's size at W = 2.
    need = int(UNIVERSAL_RSS_PER_BYTE * case["checkpoint_bytes"])
    if case["conversion_only"] and args.big_not_before:  # shared machine: the big step waits for its slot
        slot = datetime.datetime.strptime(args.big_not_before, "%H:%M").time()
        while datetime.datetime.now(datetime.timezone.utc).time() < slot:
            log(f"  waiting until {args.big_not_before} UTC before ds_to_universal (--big-not-before) ...")
            time.sleep(30)
    if case["conversion_only"] and not wait_for_memory(need):
        case["conversion"] = {"skipped": f"not run: less than {need / 1e9:.0f} GB of memory available"}
        return
    runs = []
    for _ in range(args.repeat):
        cold()
        log(f"{label}: ds_to_universal ({case['checkpoint_bytes'] / 1e9:.2f} GB) ...")
        run = {"conversion": run_universal_conversion(os.path.join(src, tag), universal, tag, args.workers, scratch)}
        run["seconds"] = run["conversion"]["wall_seconds"]
        log(f"  ds_to_universal: {run['seconds']:.1f} s, peak tree RSS "
            f"{run['conversion']['peak_tree_rss_bytes'] / 1e9:.1f} GB")
        if not case["conversion_only"]:
            cold()
            run["universal_load"] = run_load(cfg, 2, TARGET_RANKS, universal, True, scratch)
            run["seconds"] += run["universal_load"]["load_seconds"]
        shutil.rmtree(universal, ignore_errors=True)
        runs.append(run)
    case["deepspeed_runs_seconds"] = [run["seconds"] for run in runs]
    case.update({k: v for k, v in median_run(runs, "seconds").items() if k != "seconds"})


def cold_runs(times: int, cold: Cold, run) -> list:
    """`run()` `times` times, each after `cold()` (page cache dropped)."""
    results = []
    for _ in range(times):
        cold()
        results.append(run())
    return results


def measure(case: dict, cfg, src: str, tag: str, dst: str, universal: str, scratch: str, args, cold: Cold) -> None:
    """Every contender on one size. Conversion only: DeepSpeed's converter last, once memory allows."""
    label, conversion_only = case["size"], case["conversion_only"]
    if not conversion_only:
        run_deepspeed_path(case, cfg, src, tag, universal, scratch, args, cold)

    for launcher in ("torchrun", "workers"):
        runs = []
        for _ in range(args.repeat):
            cold()
            runs.append(run_reshard(src, dst, args.workers, launcher, scratch))
            log(f"  reshard ({launcher}): {runs[-1]['wall_seconds']:.1f} s; {runs[-1]['phases']}")
        case[f"reshard_{launcher}_runs"] = runs
        case[f"reshard_{launcher}"] = median_run(runs, "wall_seconds")
    case["target_bytes"] = tree_bytes(os.path.join(dst, tag))
    if not conversion_only:
        loads = cold_runs(args.repeat, cold, lambda: run_load(cfg, 2, TARGET_RANKS, dst, False, scratch))
        case["native_load_runs_seconds"] = [load["load_seconds"] for load in loads]
        case["native_load"] = median_run(loads, "load_seconds")
    shutil.rmtree(dst, ignore_errors=True)
    floors = cold_runs(args.repeat, cold, lambda: measure_io_floor(os.path.join(src, tag), case["target_bytes"],
                                                                   args.workers, os.path.join(scratch, "floor")))
    case["io_floor_runs"] = floors
    case["io_floor"] = median_run(floors, "wall_seconds")
    workers = case["reshard_workers"]
    case["floor_ratio"] = workers["wall_seconds"] / case["io_floor"]["wall_seconds"]
    budget = workers["memory_budget_bytes"]
    case["worker_rss_over_budget_bytes"] = [rss - budget for rss in workers["worker_peak_rss_bytes"]] if budget else None
    log(f"  I/O floor {case['io_floor']['wall_seconds']:.1f} s: reshard --workers is {case['floor_ratio']:.2f}x; "
        f"worker peak RSS {[round(r / 2**20) for r in workers['worker_peak_rss_bytes']]} MiB "
        f"(budget {budget / 2**20 if budget else '?'} MiB)")
    if conversion_only:
        run_deepspeed_path(case, cfg, src, tag, universal, scratch, args, cold)
        if "skipped" in case["conversion"]:
            return
        theirs, offline = case["conversion"]["wall_seconds"], workers["wall_seconds"]
        torchrun = case["reshard_torchrun"]["wall_seconds"]
        case["conversion_seconds"] = {"deepspeed": theirs, "offline": offline, "offline_torchrun": torchrun}
        case["conversion_ratios"] = {"offline": theirs / offline, "offline_torchrun": theirs / torchrun}
        case["beyond_moving_bytes_seconds"] = offline - workers["phases"].get("exchange+write", 0.0)
        log(f"  {label} (conversion only): ds_to_universal {theirs:.1f} s, reshard --workers {offline:.1f} s "
            f"({theirs / offline:.2f}x), torchrun {torchrun:.1f} s ({theirs / torchrun:.2f}x)")
        return
    loads = cold_runs(args.repeat, cold,
                      lambda: run_load(cfg, 2, TARGET_RANKS, src, False, scratch, in_job_budget=1 << 30))
    case["in_job_load_runs_seconds"] = [load["load_seconds"] for load in loads]
    case["in_job_load"] = median_run(loads, "load_seconds")

    theirs = case["conversion"]["wall_seconds"] + case["universal_load"]["load_seconds"]
    offline = case["reshard_workers"]["wall_seconds"] + case["native_load"]["load_seconds"]
    torchrun = case["reshard_torchrun"]["wall_seconds"] + case["native_load"]["load_seconds"]
    in_job = case["in_job_load"]["load_seconds"]
    case["seconds"] = {"deepspeed": theirs, "offline": offline, "offline_torchrun": torchrun, "in_job": in_job}
    case["ratios"] = {"offline": theirs / offline, "offline_torchrun": theirs / torchrun, "in_job": theirs / in_job}
    phases = case["reshard_workers"]["phases"]
    moving = phases.get("exchange+write", 0.0)
    case["beyond_moving_bytes_seconds"] = case["reshard_workers"]["wall_seconds"] - moving
    log(f"  {label}: DeepSpeed {theirs:.1f} s, offline {offline:.1f} s ({case['ratios']['offline']:.2f}x), "
        f"torchrun offline {torchrun:.1f} s ({case['ratios']['offline_torchrun']:.2f}x), in-job {in_job:.1f} s "
        f"({case['ratios']['in_job']:.2f}x)")


def plot(results: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    cases = [c for c in results["cases"] if "seconds" in c]
    sizes = [c["checkpoint_bytes"] / 1e9 for c in cases]
    fig, ax = plt.subplots(figsize=(7, 5))
    for key, label, style in (("deepspeed", "ds_to_universal + universal load", "s-"),
                              ("offline_torchrun", "reshard offline (torchrun) + native load", "v--"),
                              ("offline", "reshard offline (--workers) + native load", "o-"),
                              ("in_job", "reshard in-job (load_checkpoint)", "^-")):
        ax.plot(sizes, [c["seconds"][key] for c in cases], style, label=label)
    for c, x in zip(cases, sizes):
        ax.annotate(f"{c['ratios']['offline']:.1f}x / {c['ratios']['in_job']:.1f}x", (x, c["seconds"]["offline"]),
                    textcoords="offset points", xytext=(4, -12), fontsize=8)
    only = [c for c in results["cases"] if "conversion_seconds" in c]
    for key, label, style in (("deepspeed", "ds_to_universal alone (load does not fit)", "ks"),
                              ("offline", "reshard --workers alone (load does not fit)", "ko")):
        if only:
            ax.plot([c["checkpoint_bytes"] / 1e9 for c in only], [c["conversion_seconds"][key] for c in only], style,
                    fillstyle="none", label=label)
    for c in only:
        ax.annotate(f"{c['conversion_ratios']['offline']:.1f}x (conversion)",
                    (c["checkpoint_bytes"] / 1e9, c["conversion_seconds"]["offline"]), textcoords="offset points",
                    xytext=(-60, -14), fontsize=8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("checkpoint size (GB, ZeRO-2 fp32 AdamW, saved at 2 ranks)")
    ax.set_ylabel(f"seconds to resume at {TARGET_RANKS} rank (conversion + load)")
    skipped = [c["size"] for c in results["cases"] if "skipped" in c]
    note = f"; not run: {', '.join(skipped)} (memory)" if skipped else ""
    ax.set_title(f"2 -> 1 ranks, W={results['workers']}, {results['machine']['cpus']} shared CPU cores{note}\n"
                 "labels: speed-up of offline / in-job over DeepSpeed's path", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def print_table(results: dict) -> None:
    print(f"\n== ladder: ZeRO-2 fp32, {SOURCE_RANKS} -> {TARGET_RANKS} ranks, W={results['workers']} ==")
    print(f"  {'size':>6}{'GB':>7}{'convert s':>10}{'uload s':>8}{'DS sum':>8} |{'reshard s':>10}{'torchrun s':>11}"
          f"{'load s':>7}{'offline':>8}{'ratio':>6}{'tr ratio':>9} |{'in-job s':>9}{'ratio':>6} | beyond bytes s")
    for c in results["cases"]:
        if "skipped" in c or "seconds" not in c:
            print(f"  {c['size']:>6}  {c.get('skipped', 'conversion only: see below')}")
            continue
        s, r = c["seconds"], c["ratios"]
        print(f"  {c['size']:>6}{c['checkpoint_bytes'] / 1e9:>7.2f}{c['conversion']['wall_seconds']:>10.1f}"
              f"{c['universal_load']['load_seconds']:>8.1f}{s['deepspeed']:>8.1f} |"
              f"{c['reshard_workers']['wall_seconds']:>10.1f}{c['reshard_torchrun']['wall_seconds']:>11.1f}"
              f"{c['native_load']['load_seconds']:>7.1f}{s['offline']:>8.1f}{r['offline']:>6.2f}"
              f"{r['offline_torchrun']:>9.2f} |{s['in_job']:>9.1f}{r['in_job']:>6.2f} | "
              f"{c['beyond_moving_bytes_seconds']:.1f}")
        print(f"  {'':>6} phases (--workers): {c['reshard_workers']['phases']}")
    for c in results["cases"]:
        if "io_floor" in c:
            w = c["reshard_workers"]
            print(f"  {c['size']:>6}: I/O floor {c['io_floor']['wall_seconds']:.1f} s, reshard --workers "
                  f"{w['wall_seconds']:.1f} s = {c['floor_ratio']:.2f}x floor; worker peak RSS "
                  f"{[round(r / 2**20) for r in w['worker_peak_rss_bytes']]} MiB, budget "
                  f"{(w['memory_budget_bytes'] or 0) / 2**20:.0f} MiB")
        if "conversion_seconds" in c:
            s, r = c["conversion_seconds"], c["conversion_ratios"]
            print(f"  {c['size']:>6}: conversion only ({c['not_measured']}): ds_to_universal {s['deepspeed']:.1f} s "
                  f"(peak tree RSS {c['conversion']['peak_tree_rss_bytes'] / 1e9:.1f} GB), reshard --workers "
                  f"{s['offline']:.1f} s ({r['offline']:.2f}x), torchrun {s['offline_torchrun']:.1f} s "
                  f"({r['offline_torchrun']:.2f}x); phases {c['reshard_workers']['phases']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=list(LADDER), choices=list(LADDER))
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=1,
                        help="runs of every contender per size (median kept; ratios compare medians)")
    parser.add_argument("--cache-dir", default=DEFAULT_CACHE)
    parser.add_argument("--cache-drop", default="auto", choices=("auto", "proc", "fadvise"))
    parser.add_argument("--plot-only", metavar="JSON", help="redraw the PNG from a results file")
    parser.add_argument("--no-synthetic", dest="synthetic", action="store_false",
                        help="skip sizes whose training would not fit instead of writing a synthetic source")
    parser.add_argument("--keep-synthetic", action="store_true", help="keep synthetic sources in the cache")
    parser.add_argument("--big-not-before", metavar="HH:MM",
                        help="conversion-only sizes: start DeepSpeed's converter (GBs of RAM) not before this UTC time")
    parser.add_argument("--update", action="store_true",
                        help="keep the other sizes' cases of the current ladder.json (each marked with its run)")
    args = parser.parse_args()
    folder = os.path.join(HERE, "results")
    if args.plot_only:
        with open(args.plot_only) as fd:
            plot(json.load(fd), os.path.join(folder, "ladder.png"))
        return
    args.cache_dir = os.path.abspath(args.cache_dir)
    started = datetime.datetime.now()
    results = {"started": started, "machine": machine_info(), "workers": args.workers, "repeat": args.repeat,
               "source_ranks": SOURCE_RANKS, "target_ranks": TARGET_RANKS, "cases": [],
               "note": "shared machine: other jobs ran at the same time, so every figure is noisy"}
    cold = Cold(args.cache_drop, [args.cache_dir])
    earlier = {}
    if args.update and os.path.isfile(os.path.join(folder, "ladder.json")):
        with open(os.path.join(folder, "ladder.json")) as fd:
            previous = json.load(fd)
        earlier = {c["size"]: {**c, "run_started": c.get("run_started", previous["started"])}
                   for c in previous["cases"]}
    for label in LADDER:
        if label in args.sizes:
            results["cases"].append({**run_size(label, args, cold), "run_started": str(started)})
        elif label in earlier:
            results["cases"].append(earlier[label])
    results["cache_drop_method"] = cold.used
    results["finished"] = datetime.datetime.now()
    text = json.dumps(results, indent=1, default=str)
    for name in (f"ladder-{started:%Y%m%d-%H%M%S}.json", "ladder.json"):
        with open(os.path.join(folder, name), "w") as fd:
            fd.write(text)
    print_table(results)
    plot(json.loads(text), os.path.join(folder, "ladder.png"))
    print(f"\nresults: {os.path.join(folder, 'ladder.json')}, plot: {os.path.join(folder, 'ladder.png')}")


if __name__ == "__main__":
    main()
