"""Profile one reshard run on a cached benchmark checkpoint: a call timeline, then cProfile.

    python bench/profile_reshard.py --stage 2 --target 6 [--quick] [--workers 2] [--top 25]

Uses the checkpoint run.py made (same cache key; made on a miss) and drops the page cache the
same way before each run. First run: `reshard_worker.py --trace-io` (no profiler): per worker,
time until its first read, seconds and GB/s in preadv / pwritev / fsync / copy_file_range /
all_to_all, the time after its last round, and RSS when its file I/O starts and at peak. Second run: `--profile-dir` (cProfile in every worker): the share of the job under
reshard's entry points, then the top functions by own and by cumulative time. The pstats and
trace files stay under the cache dir. cProfile inflates Python-heavy code: compare shares.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import pstats
import shutil
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from bench_model import FULL, QUICK  # noqa: E402
from make_checkpoint import (  # noqa: E402
    DEFAULT_CACHE,
    child_env,
    ensure_checkpoint,
    torchrun_command,
)
from page_cache import drop_page_cache  # noqa: E402
from process_tree import run_watched  # noqa: E402

ENTRY_POINTS = {
    "inspect (worker 0)": ("deepspeed_inspect.py", "inspect_checkpoint"),
    "plan": ("checkpoint_plan.py", "plan_reshard"),
    "decide start, lock, journal (worker 0)": ("lifecycle.py", "decide_start"),
    "open sources (check pickles)": ("source_reader.py", "open"),
    "create targets (skeletons, carried bytes)": ("target_writer.py", "create"),
    "  write_skeleton": ("torch_archive.py", "write_skeleton"),
    "  copy_bytes (copy_file_range)": ("torch_archive.py", "copy_bytes"),
    "run_rounds": ("exchange.py", "run_rounds"),
    "  read_batch (pread)": ("source_reader.py", "read_batch"),
    "  all_to_all (incl. waiting for the peer)": ("transport.py", "all_to_all"),
    "  write (pwrite)": ("target_writer.py", "write"),
    "  sync (fsync)": ("target_writer.py", "sync"),
    "  check_peers (all_gather_object)": ("exchange.py", "check_peers"),
    "finish (fsync, close)": ("target_writer.py", "finish"),
    "hashes (BLAKE3 of every output file)": ("target_writer.py", "hashes"),
    "_publish (worker 0)": ("job.py", "_publish"),
    "reshard_checkpoint (total)": ("job.py", "reshard_checkpoint"),
}


def cumulative_of(stats: pstats.Stats, file_suffix: str, function: str) -> float:
    return sum(value[3] for (path, _, name), value in stats.stats.items()
               if path.endswith(file_suffix) and name == function)


def print_profile(path: str, top: int) -> None:
    stats = pstats.Stats(path)
    total = cumulative_of(stats, "job.py", "reshard_checkpoint") or stats.total_tt
    print(f"\n#### {os.path.basename(path)}: reshard_checkpoint {total:.2f} s under cProfile")
    for label, (file_suffix, function) in ENTRY_POINTS.items():
        seconds = cumulative_of(stats, file_suffix, function)
        print(f"  {label:<42}{seconds:8.2f} s {100 * seconds / total:6.1f} %")
    for order in ("tottime", "cumulative"):
        buffer = io.StringIO()
        pstats.Stats(path, stream=buffer).sort_stats(order).print_stats(top)
        text = buffer.getvalue()
        print(text[text.index("   ncalls"):] if "   ncalls" in text else text)


def summarize_trace(path: str) -> None:
    with open(path) as fd:
        trace = json.load(fd)
    calls, rss = trace["calls"], trace["rss"]
    exchanges = [t for name, t, _, _ in calls if name == "all_to_all"]
    first_io = next((t for name, t, _, _ in calls if name in ("preadv", "pwritev", "copy_file_range")), 0.0)
    last = max(t + d for _, t, d, _ in calls)
    before_io = [r for t, r in rss if t <= first_io]
    print(f"\n#### {os.path.basename(path)}: first file I/O at {first_io:.2f} s after the script started; "
          f"{len(exchanges)} all_to_all; last call ends at {last:.2f} s")
    totals: dict = {}
    for name, _, seconds, nbytes in calls:
        entry = totals.setdefault(name, [0, 0.0, 0])
        entry[0], entry[1], entry[2] = entry[0] + 1, entry[1] + seconds, entry[2] + (nbytes or 0)
    for name, (count, seconds, nbytes) in sorted(totals.items(), key=lambda item: -item[1][1]):
        rate = f"{nbytes / seconds / 1e9:6.2f} GB/s" if seconds and nbytes else ""
        print(f"  {name:<16}{count:>6} calls {seconds:7.2f} s {nbytes / 1e9:7.2f} GB {rate}")
    print(f"  RSS: {max(before_io, default=0) / 1e6:.0f} MB when file I/O starts, "
          f"peak {max(r for _, r in rss) / 1e6:.0f} MB")


def run_once(meta: dict, target: int, workers: int, scratch: str, cache_dir: str, extra: list) -> None:
    dst = os.path.join(scratch, "out")
    shutil.rmtree(dst, ignore_errors=True)
    print(f"page cache: {drop_page_cache([cache_dir])}")
    command = torchrun_command(workers, "reshard_worker.py", meta["save_dir"], dst, "--target-dp", target,
                               "--memory-budget", meta["bytes"] // 10, "--json", os.path.join(scratch, "result.json"),
                               *extra)
    run = run_watched(command, env=child_env(), cwd=os.path.dirname(HERE), log_path=os.path.join(scratch, "log"))
    with open(os.path.join(scratch, "result.json")) as fd:
        seconds = json.load(fd)["seconds"]
    print(f"command wall {run.wall_seconds:.1f} s, in job {seconds:.1f} s, exit {run.returncode}")
    shutil.rmtree(dst, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stage", type=int, choices=(2, 3), default=2)
    parser.add_argument("--target", type=int, required=True)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--cache-dir", default=DEFAULT_CACHE)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    cfg, ranks = (QUICK, 2) if args.quick else (FULL, 4)
    meta = ensure_checkpoint(cfg, args.stage, ranks, os.path.abspath(args.cache_dir))
    cache_dir = os.path.abspath(args.cache_dir)
    scratch = os.path.join(cache_dir, "work", "profile")
    shutil.rmtree(scratch, ignore_errors=True)
    os.makedirs(scratch)
    trace_dir, profile_dir = os.path.join(scratch, "trace"), os.path.join(scratch, "pstats")
    print(f"== ZeRO-{args.stage} {meta['ranks']} -> {args.target}, W={args.workers}: call timeline ==")
    run_once(meta, args.target, args.workers, scratch, cache_dir, ["--trace-io", trace_dir])
    for name in sorted(os.listdir(trace_dir)):
        summarize_trace(os.path.join(trace_dir, name))
    print(f"\n== ZeRO-{args.stage} {meta['ranks']} -> {args.target}, W={args.workers}: cProfile ==")
    run_once(meta, args.target, args.workers, scratch, cache_dir, ["--profile-dir", profile_dir])
    for name in sorted(os.listdir(profile_dir)):
        print_profile(os.path.join(profile_dir, name), args.top)


if __name__ == "__main__":
    main()
