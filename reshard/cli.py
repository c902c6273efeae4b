"""Command line: `python -m reshard SRC DST --target-dp M` (or under torchrun, one per worker).

    torchrun --standalone --nproc_per_node=4 -m reshard /ckpt/run1 /ckpt/run1-dp16 --target-dp 16
    python -m reshard /ckpt/run1 /ckpt/run1-dp16 --target-dp 16 --workers 4   # same, without torchrun
    python -m reshard /ckpt/run1 /ckpt/run1-dp3 --target-dp 3 --dry-run
    python -m reshard --config configs/example.yaml
    python -m reshard verify DST [--against SRC]       # see reshard.verify

Exit status: 0 only when DST holds the complete checkpoint (or the dry run printed its plan);
2 for bad input or options (the message names the file and the problem); 1 for anything else.
"""
from __future__ import annotations

import argparse
import os
import sys

from reshard.errors import OptionError, ReshardError
from reshard.options import ReshardOptions, parse_size
from reshard.results import process_started


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="reshard", description="Reshard a DeepSpeed ZeRO checkpoint for a new data-parallel world size, "
                                    "written natively so that engine.load_checkpoint(DST) works at that size.")
    parser.add_argument("source", nargs="?", help="DeepSpeed save directory (the one holding `latest`)")
    parser.add_argument("destination", nargs="?", help="save directory to create")
    parser.add_argument("--target-dp", type=int, help="data-parallel world size to reshard for")
    parser.add_argument("--tag", help="checkpoint tag (default: the one in SRC/latest)")
    parser.add_argument("--all-tags", action="store_true", default=None,
                        help="reshard every tag directory of each save directory (best_* included)")
    parser.add_argument("--memory-budget", type=parse_size,
                        help="bytes of slices a worker holds at once, e.g. 512M, 4G (default 1G)")
    parser.add_argument("--overwrite", action="store_true", default=None,
                        help="allow a non-empty DST; replaces the tag directory and `latest` there")
    parser.add_argument("--dry-run", action="store_true", default=None,
                        help="print the plan (files and bytes per worker); read no tensors, write nothing")
    parser.add_argument("--quiet", action="store_true", default=None, help="no progress bar")
    parser.add_argument("--trust-pickle", action="store_true", default=None,
                        help="unpickle classes outside the DeepSpeed allowlist (runs code from the checkpoint)")
    parser.add_argument("--durable-every", type=parse_size,
                        help="fsync and record progress each time this much has moved, for resuming (default 1G)")
    parser.add_argument("--ignore-batch-config", action="store_true", default=None,
                        help="reshard although the saved ds_config batch sizes cannot run at --target-dp")
    parser.add_argument("--backend", choices=("auto", "gloo", "nccl"), help="torch.distributed backend under torchrun")
    parser.add_argument("--workers", type=int,
                        help="worker processes to start on this host, without torchrun (default 1)")
    parser.add_argument("--timeout", type=float, help="seconds a collective may wait for a peer (default 600)")
    parser.add_argument("--config", help="YAML job file with the same option names (flags override it)")
    return parser


def options_from_args(args: argparse.Namespace) -> ReshardOptions:
    overrides = {"source": args.source, "destination": args.destination, "target_dp": args.target_dp,
                 "tag": args.tag, "all_tags": args.all_tags, "memory_budget": args.memory_budget, "overwrite": args.overwrite,
                 "dry_run": args.dry_run, "quiet": args.quiet, "trust_pickle": args.trust_pickle, "ignore_batch_config": args.ignore_batch_config, "durable_every": args.durable_every,
                 "backend": args.backend, "timeout": args.timeout, "workers": args.workers}
    if args.config:
        return ReshardOptions.from_yaml(args.config, **overrides).validate()
    return ReshardOptions(**{k: v for k, v in overrides.items() if v is not None}).validate()


def build_verify_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="reshard verify", description="Check a reshard output: re-hash every file against its manifest, "
                                           "or (with --against) compare every element with the source.")
    parser.add_argument("destination", help="save directory written by reshard")
    parser.add_argument("--tag", help="tag to check (default: DST/latest)")
    parser.add_argument("--against", metavar="SRC", help="source save directory to compare element by element")
    parser.add_argument("--memory-budget", type=parse_size, default=1 << 30, help="as for reshard (default 1G)")
    parser.add_argument("--trust-pickle", action="store_true", help="as for reshard")
    return parser


def verify_main(argv: list[str]) -> int:
    args = build_verify_parser().parse_args(argv)
    from reshard.verify import verify_against, verify_hashes
    try:
        if args.against:
            result = verify_against(args.destination, args.against, tag=args.tag, memory_budget=args.memory_budget,
                                    trust_pickle=args.trust_pickle)
        else:
            result = verify_hashes(args.destination, args.tag)
    except ReshardError as error:
        print(f"reshard verify: error: {error}", file=sys.stderr)
        return 2
    if os.environ.get("RANK", "0") == "0":
        print(result.summary())
    return 0 if result.ok else 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "verify":
        return verify_main(argv[1:])
    args = build_parser().parse_args(argv)
    started = process_started()
    try:
        options = options_from_args(args)
        if options.workers > 1:
            if int(os.environ.get("WORLD_SIZE", "1")) > 1:
                raise OptionError("--workers starts its own worker processes: run it without torchrun, or drop it")
            from reshard.local_workers import run_local_workers
            return run_local_workers(options, started)
        from reshard.job import run_job
        result = run_job(options, started=started)
    except ReshardError as error:
        print(f"reshard: error: {error}", file=sys.stderr)
        return 2
    if os.environ.get("RANK", "0") == "0":
        print(result.summary())
    return 0
