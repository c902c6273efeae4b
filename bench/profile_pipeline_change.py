"""Profile one pipeline reshard: every forked worker's job under cProfile, then its top functions.

    nice -n 10 python bench/profile_pipeline_change.py --out /tmp/prof -- SRC DST --workers 2 \\
        --target-dp 2 --target-pp 1 --target-tp 1 --pipeline-layers 27 --pipeline-tied embed:0,26 \\
        --memory-budget 32M --ignore-batch-config

The arguments after `--` are `python -m reshard`'s. The 0.6 GB rung's saves (docs/benchmarks.md,
"Pipeline pp and tp change: where the exchange+write time went") come from
`torchrun --nproc_per_node=2 bench/pipeline_bench.py train --pp 2 --tp 1 --dim 1536 --hidden 1535
--pairs 8 --steps 0 --save SRC` (with `--nproc_per_node=4 ... --tp 2 --model-axis --hidden 1536` for the
tp change). Each worker's stats go to OUT/worker{rank}.pstats; printed: the job's summary, then per
worker the top `--top` functions by own time. cProfile inflates Python-heavy code: compare shares.
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for worker{rank}.pstats")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("reshard_args", nargs=argparse.REMAINDER, help="-- then python -m reshard's arguments")
    args = parser.parse_args()
    reshard_args = args.reshard_args[1:] if args.reshard_args[:1] == ["--"] else args.reshard_args
    os.makedirs(args.out, exist_ok=True)
    import reshard.jobs.collective_job as collective_job
    from reshard.cli import main as reshard_main
    job = collective_job.run_job

    def profiled(options, transport, **kwargs):
        profile = cProfile.Profile()
        try:
            return profile.runcall(job, options, transport, **kwargs)
        finally:
            profile.dump_stats(os.path.join(args.out, f"worker{transport.rank}.pstats"))

    collective_job.run_job = profiled  # local_workers imports run_job when the job starts
    code = reshard_main(reshard_args)
    for name in sorted(os.listdir(args.out)):
        if name.endswith(".pstats"):
            print(f"\n== {name} ==")
            pstats.Stats(os.path.join(args.out, name)).sort_stats("tottime").print_stats(args.top)
    raise SystemExit(code)


if __name__ == "__main__":
    main()
