"""One SLURM array task as its own process, exactly as `python -m reshard` runs it, plus a report.

    python tests/entry/array_task.py REPORT.json SRC DST --target-dp 4 --array-task 1 --array-tasks 3

Writes REPORT.json with the bytes the task read from the source (slices and carried storages)
and wrote, so that tests can add up what separate processes read. Exit status as the CLI's.
"""
import json
import sys

from reshard.cli import build_parser, options_from_args
from reshard.errors import ReshardError
from reshard.jobs.collective_job import run_job


def main() -> int:
    report_path, argv = sys.argv[1], sys.argv[2:]
    try:
        result = run_job(options_from_args(build_parser().parse_args(argv)))
    except ReshardError as error:
        print(f"reshard: error: {error}", file=sys.stderr)
        return 2
    print(result.summary())
    reports = [r for c in result.checkpoints for r in c.reports]
    with open(report_path, "w") as fd:
        json.dump({"bytes_read": sum(r.bytes_read for r in reports),
                   "bytes_carried": sum(r.bytes_carried for r in reports),
                   "bytes_written": sum(r.bytes_written for r in reports),
                   "notes": result.notes}, fd)
    return 0


if __name__ == "__main__":
    sys.exit(main())
