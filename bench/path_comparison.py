"""The summary a bench prints when it runs reshard + native load beside DeepSpeed's universal path.

    from path_comparison import summarize, write_result
    result["summary"] = summarize(result)       # result: the bench's dict of watched runs
    write_result(result, "tp")                  # bench/results/tp-YYYYmmdd-HHMMSS.json

`result` holds the watched runs under fixed keys: "reshard" (the command), "reshard_native_load",
"in_job", "ds_to_universal" and "universal_load" (each with "returncode" and, for loads, the
per-rank "sums" of masters and moments). Used by bench/tp_bench.py and bench/moe_bench.py, which
also share how a contender runs (`watched`: from a dropped page cache, its process tree sampled)
and how one rank times its load (`timed_load`).
"""
from __future__ import annotations

import datetime
import json
import os
import time

from make_checkpoint import child_env
from page_cache import drop_page_cache
from process_tree import run_watched

HERE = os.path.dirname(os.path.abspath(__file__))


def watched(command, log, disk_path, timeout=1800) -> dict:
    """Run one contender from a dropped page cache (page_cache.py), its process tree sampled."""
    found = {"page_cache": drop_page_cache([disk_path])}
    run = run_watched([str(c) for c in command], env=child_env(), cwd=os.path.dirname(HERE), log_path=log,
                      disk_path=disk_path, timeout=timeout)
    found.update({"wall_seconds": round(run.wall_seconds, 2), "returncode": run.returncode,
                  "peak_rss_largest_process_bytes": run.peak_process_rss_bytes,
                  "peak_rss_tree_bytes": run.peak_tree_rss_bytes, "peak_disk_added_bytes": run.peak_disk_bytes})
    if run.returncode != 0:
        with open(log, errors="replace") as handle:
            found["failure_tail"] = handle.read()[-2500:]
    return found


def timed_load(engine, how: str, directory: str, json_path: str) -> None:
    """In one rank of a launched load job: time loading `directory` into a ZeRO-1/2 `engine`.

    how: "in-job" (reshard.deepspeed.load_checkpoint) or anything else (engine.load_checkpoint,
    native or universal as the engine was configured). Every rank then reports the sum of each
    fp32 partition and of its Adam moments; rank 0 writes {"seconds": slowest rank, "ranks": [...]}
    to `json_path`.
    """
    import torch
    torch.distributed.barrier()
    started = time.perf_counter()
    if how == "in-job":
        import reshard.deepspeed
        reshard.deepspeed.load_checkpoint(engine, directory)
    else:
        engine.load_checkpoint(directory)
    seconds = time.perf_counter() - started
    optimizer = engine.optimizer
    partitions = optimizer.single_partition_of_fp32_groups
    sums = {"fp32": [float(p.detach().double().sum()) for p in partitions]}
    for key in ("exp_avg", "exp_avg_sq"):
        sums[key] = [float(optimizer.optimizer.state[p][key].double().sum()) for p in partitions]
    everyone = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, {"seconds": seconds, "sums": sums})
    if torch.distributed.get_rank() == 0:
        with open(json_path, "w") as handle:
            json.dump({"seconds": max(r["seconds"] for r in everyone), "ranks": everyone}, handle)


def summarize(result: dict) -> dict:
    """Speed-up, peak RSS and extra disk of both paths, and whether every rank loaded the same sums."""
    ours = result["reshard"]["wall_seconds"] + result["reshard_native_load"]["load"]["seconds"]
    summary = {"reshard_plus_native_load_s": round(ours, 2),
               "in_job_reshard_plus_load_s": result["in_job"].get("load", {}).get("seconds"),
               "reshard_wall_s": result["reshard"]["wall_seconds"],
               "reshard_peak_rss_largest_process_bytes": result["reshard"]["peak_rss_largest_process_bytes"],
               "reshard_peak_rss_tree_bytes": result["reshard"].get("peak_rss_tree_bytes"),
               "reshard_extra_disk_bytes": result["reshard"]["output_bytes"]}
    if result.get("universal_load", {}).get("returncode") == 0:
        converter = result["ds_to_universal"]
        theirs = converter["wall_seconds"] + result["universal_load"]["load"]["seconds"]
        summary.update({"universal_plus_load_s": round(theirs, 2), "speed_up": round(theirs / ours, 2),
                        "ds_to_universal_wall_s": converter["wall_seconds"],
                        "universal_peak_rss_largest_process_bytes": converter["peak_rss_largest_process_bytes"],
                        "universal_peak_rss_tree_bytes": converter.get("peak_rss_tree_bytes"),
                        "universal_extra_disk_bytes": converter["output_bytes"],
                        "universal_peak_disk_added_bytes": converter.get("peak_disk_added_bytes")})
        mine, theirs_sums = (result[k]["load"]["ranks"] for k in ("reshard_native_load", "universal_load"))
        summary["native_vs_universal_sums_equal"] = [a["sums"] == b["sums"] for a, b in zip(mine, theirs_sums)]
    else:
        failed = result.get("universal_load") or result["ds_to_universal"]
        summary["universal_failed"] = (failed.get("failure_tail") or "")[-800:]
    if result["in_job"]["returncode"] == 0 and result["reshard_native_load"]["returncode"] == 0:
        summary["in_job_vs_native_sums_equal"] = [
            a["sums"] == b["sums"] for a, b in zip(result["in_job"]["load"]["ranks"],
                                                   result["reshard_native_load"]["load"]["ranks"])]
    return summary


def write_result(result: dict, prefix: str) -> str:
    """Print the summary and write the whole result under bench/results/; returns the path."""
    print(json.dumps(result["summary"], indent=1))
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    path = os.path.join(HERE, "results", f"{prefix}-{datetime.datetime.now(datetime.timezone.utc):%Y%m%d-%H%M%S}.json")
    with open(path, "w") as handle:
        json.dump(result, handle, indent=1)
    print(f"wrote {path}")
    return path
