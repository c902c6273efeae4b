"""One reshard worker under torchrun, through the Python API; worker 0 writes the result as JSON.

    DS_ACCELERATOR=cpu torchrun --standalone --nproc_per_node=2 bench/reshard_worker.py \
        SRC DST --target-dp 6 --memory-budget 400000000 --json out.json [--profile-dir DIR]

JSON: seconds (inside reshard_checkpoint), import_seconds (interpreter start to the call),
rounds, workers, bytes_read, bytes_written and per-worker reports (bytes_read, bytes_written,
bytes_carried, peak_rss_bytes). With --profile-dir every worker runs under cProfile and dumps
worker<k>.pstats there. With --trace-io DIR every worker records each preadv, pwritev, fsync,
copy_file_range and all_to_all it makes (start, seconds, bytes) to DIR/worker<k>.json, and its
RSS every 50 ms: a timeline of where the time and memory go.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

STARTED = time.perf_counter()


def result_as_dict(result, import_seconds: float) -> dict:
    """The documented fields (seconds, reports, bytes_read, bytes_written), plus round counts and
    descriptions where the result carries them (per checkpoint in newer reshard versions)."""
    parts = getattr(result, "checkpoints", None) or [result]
    return {"seconds": result.seconds, "import_seconds": import_seconds,
            "rounds": sum(getattr(p, "rounds", 0) for p in parts),
            "workers": getattr(parts[0], "workers", None), "transport": getattr(parts[0], "transport", None),
            "description": getattr(parts[0], "description", None),
            "bytes_read": result.bytes_read, "bytes_written": result.bytes_written,
            "reports": [dataclasses.asdict(r) for r in result.reports]}


class IoTrace:
    """Wraps the system calls and the collective reshard moves bytes with; records every call."""

    def __init__(self):
        self.started = time.perf_counter()
        self.calls, self.rss = [], []
        self._stop = None

    def wrap(self, owner, name: str, size_of) -> None:
        original = getattr(owner, name)

        def traced(*args, **kwargs):
            t0 = time.perf_counter()
            out = original(*args, **kwargs)
            self.calls.append((name, t0 - self.started, time.perf_counter() - t0, size_of(args, out)))
            return out
        setattr(owner, name, traced)

    def install(self) -> None:
        import threading

        from reshard import transport
        self.wrap(os, "preadv", lambda args, out: out)
        self.wrap(os, "pwritev", lambda args, out: out)
        self.wrap(os, "fsync", lambda args, out: 0)
        self.wrap(os, "copy_file_range", lambda args, out: out)
        self.wrap(transport.TorchDistributedTransport, "all_to_all", lambda args, out: int(sum(args[2])))
        self._stop = threading.Event()
        threading.Thread(target=self._sample_rss, daemon=True).start()

    def _sample_rss(self) -> None:
        page = os.sysconf("SC_PAGE_SIZE")
        while not self._stop.is_set():
            with open("/proc/self/statm") as fd:
                self.rss.append((time.perf_counter() - self.started, int(fd.read().split()[1]) * page))
            self._stop.wait(0.05)

    def dump(self, path: str) -> None:
        self._stop.set()
        with open(path, "w") as fd:
            json.dump({"calls": self.calls, "rss": self.rss}, fd)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source")
    parser.add_argument("destination")
    parser.add_argument("--target-dp", type=int, required=True)
    parser.add_argument("--memory-budget", type=int, required=True, help="bytes")
    parser.add_argument("--json", required=True)
    parser.add_argument("--profile-dir")
    parser.add_argument("--trace-io", help="directory for per-worker call timelines")
    parser.add_argument("--array-task", type=int, help="SLURM array mode: this task (with --array-tasks)")
    parser.add_argument("--array-tasks", type=int)
    args = parser.parse_args()
    trace = IoTrace() if args.trace_io else None

    import reshard
    import_seconds = time.perf_counter() - STARTED
    if trace:
        trace.install()

    def run():
        array = {"array_task": args.array_task, "array_tasks": args.array_tasks} if args.array_tasks else {}
        return reshard.reshard_checkpoint(args.source, args.destination, args.target_dp,
                                          memory_budget=args.memory_budget, quiet=True, **array)

    rank = int(os.environ.get("RANK", "0"))
    if args.profile_dir:
        import cProfile
        os.makedirs(args.profile_dir, exist_ok=True)
        profiler = cProfile.Profile()
        result = profiler.runcall(run)
        profiler.dump_stats(os.path.join(args.profile_dir, f"worker{rank}.pstats"))
    else:
        result = run()
    if trace:
        os.makedirs(args.trace_io, exist_ok=True)
        trace.dump(os.path.join(args.trace_io, f"worker{rank}.json"))
    if rank == 0:
        with open(args.json + ".tmp", "w") as fd:
            json.dump(result_as_dict(result, import_seconds), fd, indent=1)
        os.replace(args.json + ".tmp", args.json)


if __name__ == "__main__":
    main()
