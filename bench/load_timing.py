"""Time engine.load_checkpoint at the target world size, inside every rank; rank 0 writes JSON.

    DS_ACCELERATOR=cpu torchrun --standalone --nproc_per_node=6 bench/load_timing.py \
        --config-json '{...}' --stage 2 --load-dir DST --json out.json [--universal]

Each rank builds the benchmark model's engine (storage allocated, not initialised: the load
overwrites it), waits for all ranks, then times `engine.load_checkpoint(load_dir)`. With
--universal the DeepSpeed config carries "checkpoint": {"load_universal": true}, and
load_checkpoint reads the tag from LOAD_DIR/latest_universal. With --in-job LOAD_DIR is the
source checkpoint (another world size) and reshard.deepspeed.load_checkpoint reshards it in
the job, from memory, before DeepSpeed loads it.

Per rank: load seconds, RSS just before the load, the peak RSS sampled every 20 ms during the
load, ru_maxrss of the whole process, engine build seconds, and checksums (float64 sums of the
fp32 master partition and every optimizer-state tensor of each base-optimizer param group, plus
each group's lr / weight_decay, plus this rank's share of the frozen parameters) so two ways of
loading the same state can be compared.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_model import build_engine, config_from_json  # noqa: E402

PAGE = os.sysconf("SC_PAGE_SIZE")


def current_rss() -> int:
    with open("/proc/self/statm") as fd:
        return int(fd.read().split()[1]) * PAGE


class PeakRssSampler:
    """Samples this process's RSS in a thread while active; `.peak` is the largest seen."""

    def __init__(self, interval: float = 0.02):
        self.interval, self.peak = interval, current_rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, current_rss())
            self._stop.wait(self.interval)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, current_rss())


def optimizer_checksums(engine) -> list[dict]:
    """Per base-optimizer param group: sums of its flat fp32 partitions and their state tensors."""
    import torch
    optimizer = engine.optimizer.optimizer
    groups = []
    for group in optimizer.param_groups:
        sums = {"fp32": 0.0}
        for param in group["params"]:
            sums["fp32"] += float(param.detach().double().sum())
            for key, value in optimizer.state.get(param, {}).items():
                if torch.is_tensor(value) and value.numel() > 1:
                    sums[key] = sums.get(key, 0.0) + float(value.double().sum())
        groups.append({"sums": sums, "lr": group.get("lr"), "weight_decay": group.get("weight_decay")})
    return groups


def frozen_checksum(engine) -> float:
    """float64 sum of this rank's share of the frozen parameters (ZeRO-3: its partition)."""
    total = 0.0
    for param in engine.module.parameters():
        if not param.requires_grad:
            local = getattr(param, "ds_tensor", None)
            total += float((local if local is not None else param).detach().double().sum())
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config-json", required=True)
    parser.add_argument("--stage", type=int, required=True)
    parser.add_argument("--load-dir", required=True)
    parser.add_argument("--json", required=True)
    parser.add_argument("--universal", action="store_true")
    parser.add_argument("--in-job", action="store_true",
                        help="load LOAD_DIR (saved at another size) through reshard.deepspeed.load_checkpoint")
    parser.add_argument("--memory-budget", type=int, default=1 << 30)
    args = parser.parse_args()

    import deepspeed
    import torch.distributed as dist
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    started = time.perf_counter()
    engine = build_engine(config_from_json(args.config_json), args.stage, initialise=False, universal=args.universal)
    built = time.perf_counter()
    dist.barrier()
    rss_before = current_rss()
    maxrss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    with PeakRssSampler() as sampler:
        t0 = time.perf_counter()
        if args.in_job:
            import reshard.deepspeed
            load_path, _ = reshard.deepspeed.load_checkpoint(engine, args.load_dir, memory_budget=args.memory_budget)
        else:
            load_path, _ = engine.load_checkpoint(args.load_dir)
        load_seconds = time.perf_counter() - t0
    dist.barrier()
    all_done = time.perf_counter() - t0
    record = {"rank": rank, "load_seconds": load_seconds, "load_seconds_all_ranks": all_done,
              "build_seconds": built - started, "rss_before_bytes": rss_before, "load_peak_rss_bytes": sampler.peak,
              "maxrss_before_load_bytes": maxrss_before,
              "ru_maxrss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
              "load_path": load_path, "groups": optimizer_checksums(engine),
              "frozen_sum": frozen_checksum(engine)}
    records = [None] * dist.get_world_size()
    dist.all_gather_object(records, record)
    if rank == 0:
        with open(args.json + ".tmp", "w") as fd:
            json.dump({"world_size": len(records), "universal": args.universal, "in_job": args.in_job,
                       "ranks": records}, fd, indent=1)
        os.replace(args.json + ".tmp", args.json)


if __name__ == "__main__":
    main()
