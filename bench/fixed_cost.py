"""Where the offline command's fixed cost goes (issue 14: <= 1.5 s beyond moving bytes on a W = 2 job).

    python bench/fixed_cost.py [--repeat 3] [--workers 2]

On a tiny checkpoint (synthetic_checkpoint.py, ZeRO-2, N = 2 -> M = 1, 60 KB: moving bytes
costs nothing), measures with the page cache warm:
  interpreter   `python -c pass`
  imports       `python -X importtime -c "import reshard.cli"`: what `python -m reshard` imports
                before it can parse its arguments, by top-level package (cumulative microseconds)
  command       `python -m reshard SRC DST --target-dp 1 --workers W`: wall time, the per-phase
                wall times of its summary, and wall - exchange+write ("beyond moving bytes")
Writes bench/results/fixed_cost.json. Figures from a shared machine: noisy, medians of --repeat.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from make_checkpoint import child_env  # noqa: E402
from run import machine_info  # noqa: E402
from synthetic_checkpoint import MODELS, write_checkpoint  # noqa: E402

PHASES_RE = re.compile(r"phases : (.*?) \(slowest")


def timed(command: list[str]) -> tuple[float, subprocess.CompletedProcess]:
    started = time.perf_counter()
    done = subprocess.run(command, env=child_env(), cwd=REPO, capture_output=True, text=True)
    return time.perf_counter() - started, done


def import_shares() -> dict:
    """Cumulative import microseconds of each top-level package `import reshard.cli` pulls in first."""
    _, done = timed([sys.executable, "-X", "importtime", "-c", "import reshard.cli"])
    shares, total = {}, 0
    for line in done.stderr.splitlines():
        found = re.match(r"import time:\s+\d+ \|\s+(\d+) \| (\s*)(\S+)", line)
        if not found:
            continue
        cumulative, depth, name = int(found[1]), len(found[2]) // 2, found[3]
        if name == "reshard.cli":
            total = cumulative
        top = name.split(".")[0]
        if depth <= 2 and top != "reshard":  # imported directly by reshard's modules (or Python's start)
            shares[top] = shares.get(top, 0) + cumulative
    return {"total_seconds": total / 1e6, "by_package_seconds": {k: v / 1e6 for k, v in
                                                                 sorted(shares.items(), key=lambda kv: -kv[1])[:8]}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--scratch", default="/tmp/reshard-fixed-cost")
    args = parser.parse_args()
    shutil.rmtree(args.scratch, ignore_errors=True)
    src, dst = os.path.join(args.scratch, "src"), os.path.join(args.scratch, "dst")
    write_checkpoint(src, MODELS["tiny"], 2, 2)
    results = {"started": datetime.datetime.now(), "machine": machine_info(), "workers": args.workers,
               "note": "shared machine (other engineers' tests running): noisy; medians of the repeats",
               "interpreter": [], "imports": [], "command": []}
    for _ in range(args.repeat):
        results["interpreter"].append(timed([sys.executable, "-c", "pass"])[0])
        results["imports"].append(import_shares())
        shutil.rmtree(dst, ignore_errors=True)
        wall, done = timed([sys.executable, "-m", "reshard", src, dst, "--target-dp", "1", "--workers",
                            str(args.workers)])
        if done.returncode != 0:
            raise RuntimeError(done.stdout[-2000:] + done.stderr[-2000:])
        found = PHASES_RE.search(done.stdout + done.stderr)
        phases = {k: float(v) for k, v in re.findall(r"([a-z+-]+) (\d+\.\d+) s", found[1])} if found else {}
        results["command"].append({"wall_seconds": wall, "phases": phases,
                                   "beyond_moving_bytes_seconds": wall - phases.get("exchange+write", 0.0),
                                   "unaccounted_seconds": wall - sum(phases.values())})
    median = statistics.median
    results["median"] = {
        "interpreter_seconds": median(results["interpreter"]),
        "import_reshard_cli_seconds": median(i["total_seconds"] for i in results["imports"]),
        "import_torch_seconds": median(i["by_package_seconds"].get("torch", 0.0) for i in results["imports"]),
        "command_wall_seconds": median(c["wall_seconds"] for c in results["command"]),
        "beyond_moving_bytes_seconds": median(c["beyond_moving_bytes_seconds"] for c in results["command"]),
        "phases_seconds": {k: median(c["phases"].get(k, 0.0) for c in results["command"])
                           for k in results["command"][0]["phases"]},
        "outside_phases_seconds": median(c["unaccounted_seconds"] for c in results["command"]),
    }
    results["finished"] = datetime.datetime.now()
    shutil.rmtree(args.scratch, ignore_errors=True)
    with open(os.path.join(HERE, "results", "fixed_cost.json"), "w") as fd:
        json.dump(results, fd, indent=1, default=str)
    print(json.dumps(results["median"], indent=1))


if __name__ == "__main__":
    main()
