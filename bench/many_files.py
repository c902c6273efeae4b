"""Many files: N = 256 ZeRO-2 and ZeRO-3 checkpoints resharded to 512 ranks with W = 4, checked by zero_to_fp32.

    python bench/many_files.py                          # N=256 -> 512, W=4, stages 2 and 3 (a few minutes)
    python bench/many_files.py --ranks 256 --target 512 --workers 4 --scaling 32 64 128

DeepSpeed cannot train 256 ranks here, so each source is written by synthetic_checkpoint.py
(a real-format checkpoint of a small bench model, known seeded state; validated against
trained checkpoints by tests/test_synthetic_checkpoint.py). Then, with the page cache dropped
(run.Cold), `python -m reshard SRC DST --target-dp M --workers W` runs as a watched process tree
(process_tree.run_watched: wall, peak summed RSS, peak open file descriptors of one process and
of the tree), its summary gives the per-phase wall times and every worker's peak RSS, and
DeepSpeed's own deepspeed/utils/zero_to_fp32.py (`get_fp32_state_dict_from_zero_checkpoint`)
consolidates DST, which must equal the known state element by element (source too).

`--scaling N1 N2 ...` repeats the reshard for smaller sources (N -> 2N, same model, same W) so
that a hidden O(N x M) step shows as a phase that grows faster than N. Each run once: these
figures are noisy on a shared machine. Writes bench/results/many_files-<timestamp>.json and
bench/results/many_files.json. Checkpoints live under --cache-dir/work and are deleted after.
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

from make_checkpoint import DEFAULT_CACHE, child_env, tree_bytes  # noqa: E402
from process_tree import run_watched  # noqa: E402
from run import Cold, log, machine_info  # noqa: E402
from synthetic_checkpoint import MODELS, write_checkpoint  # noqa: E402

PHASES_RE = re.compile(r"phases : (.*?) \(slowest")
WORKER_RE = re.compile(r"^\s+(\d+)\s+\S+\s+\S+\s+.*?([\d.]+ [KMG]iB|[\d.]+ B)\s*$", re.M)
UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def parse_summary(text: str) -> dict:
    """Per-phase wall seconds and each worker's peak RSS from reshard's summary."""
    found = PHASES_RE.search(text)
    phases = {name: float(s) for name, s in re.findall(r"([a-z+-]+) (\d+\.\d+) s", found[1])} if found else {}
    rss = {}
    table = text[text.find("peak RSS"):] if "peak RSS" in text else ""
    for worker, size in WORKER_RE.findall(table):
        value, unit = size.split()
        rss[int(worker)] = int(float(value) * UNITS[unit])
    return {"phases": phases, "worker_peak_rss_bytes": rss}


def zero_to_fp32_check(save_dir: str, model: str, stage: int, seed: int) -> dict:
    """DeepSpeed's zero_to_fp32 in its own process, against the known state."""
    started = time.perf_counter()
    run = subprocess.run([sys.executable, os.path.join(HERE, "synthetic_checkpoint.py"), save_dir, "--check",
                          "--model", model, "--stage", str(stage), "--seed", str(seed)],
                         env=child_env(), cwd=REPO, capture_output=True, text=True)
    lines = [line for line in run.stdout.splitlines() if line.startswith("{")]
    mismatches = json.loads(lines[-1])["zero_to_fp32_mismatches"] if lines else [run.stderr[-2000:]]
    return {"ok": run.returncode == 0 and not mismatches, "mismatches": mismatches[:10],
            "seconds": time.perf_counter() - started}


def one_case(stage: int, n: int, m: int, args, cold: Cold, check: bool) -> dict:
    scratch = os.path.join(args.cache_dir, "work", f"many-z{stage}-n{n}")
    shutil.rmtree(scratch, ignore_errors=True)
    os.makedirs(scratch)
    src, dst = os.path.join(scratch, "src"), os.path.join(scratch, "dst")
    case = {"stage": stage, "source_ranks": n, "target_ranks": m, "workers": args.workers, "model": args.model}
    try:
        meta = write_checkpoint(src, MODELS[args.model], stage, n, seed=args.seed)
        case["source"] = {k: meta[k] for k in ("files", "bytes", "params", "write_seconds")}
        if check:
            case["source_zero_to_fp32"] = zero_to_fp32_check(src, args.model, stage, args.seed)
        cold()
        command = [sys.executable, "-m", "reshard", src, dst, "--target-dp", str(m), "--workers", str(args.workers),
                   "--quiet"] + (["--memory-budget", args.memory_budget] if args.memory_budget else [])
        run = run_watched(command, env=child_env(), cwd=REPO, log_path=os.path.join(scratch, "reshard.log"),
                          disk_path=scratch)
        with open(run.log_path) as fd:
            text = fd.read()
        if run.returncode != 0:
            raise RuntimeError(f"reshard failed ({run.returncode}):\n{text[-3000:]}")
        case["reshard"] = {"wall_seconds": run.wall_seconds, "peak_tree_rss_bytes": run.peak_tree_rss_bytes,
                           "peak_process_rss_bytes": run.peak_process_rss_bytes,
                           "peak_process_fds": run.peak_process_fds, "peak_tree_fds": run.peak_tree_fds,
                           **parse_summary(text), "summary": text[text.find("reshard done"):]}
        case["target"] = {"files": len(os.listdir(os.path.join(dst, "global_step1"))),
                          "bytes": tree_bytes(os.path.join(dst, "global_step1"))}
        if check:
            case["target_zero_to_fp32"] = zero_to_fp32_check(dst, args.model, stage, args.seed)
    finally:
        if not args.keep:
            shutil.rmtree(scratch, ignore_errors=True)
    r = case["reshard"]
    log(f"ZeRO-{stage} {n} -> {m}: wall {r['wall_seconds']:.1f} s, phases {r['phases']}, peak fds/process "
        f"{r['peak_process_fds']} (tree {r['peak_tree_fds']}), worker RSS "
        f"{[round(v / 2**20) for v in r['worker_peak_rss_bytes'].values()]} MiB"
        + (f", zero_to_fp32 source {case['source_zero_to_fp32']['ok']} target {case['target_zero_to_fp32']['ok']}"
           if check else ""))
    return case


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=256)
    parser.add_argument("--target", type=int, default=512)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--model", default="small", choices=list(MODELS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--memory-budget", help="passed to reshard (default: reshard's)")
    parser.add_argument("--scaling", type=int, nargs="*", default=[32, 64, 128],
                        help="smaller source rank counts, each resharded to twice as many (no zero_to_fp32 check)")
    parser.add_argument("--cache-dir", default=DEFAULT_CACHE)
    parser.add_argument("--cache-drop", default="auto", choices=("auto", "proc", "fadvise"))
    parser.add_argument("--keep", action="store_true", help="keep the checkpoints under --cache-dir/work")
    args = parser.parse_args()
    args.cache_dir = os.path.abspath(args.cache_dir)
    started = datetime.datetime.now()
    cold = Cold(args.cache_drop, [os.path.join(args.cache_dir, "work")])
    results = {"started": started, "machine": machine_info(), "args": vars(args), "cases": [], "scaling": [],
               "note": "shared machine (other engineers' test runs at the same time); each figure from one run: noisy"}
    for stage in args.stages:
        results["cases"].append(one_case(stage, args.ranks, args.target, args, cold, check=True))
        for n in args.scaling:
            results["scaling"].append(one_case(stage, n, 2 * n, args, cold, check=False))
    results["cache_drop_method"] = cold.used
    results["finished"] = datetime.datetime.now()
    text = json.dumps(results, indent=1, default=str)
    folder = os.path.join(HERE, "results")
    for name in (f"many_files-{started:%Y%m%d-%H%M%S}.json", "many_files.json"):
        with open(os.path.join(folder, name), "w") as fd:
            fd.write(text)
    print(f"results: {os.path.join(folder, 'many_files.json')}")


if __name__ == "__main__":
    main()
