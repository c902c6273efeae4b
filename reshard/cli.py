"""Command line: `python -m reshard SRC DST --target-dp M` (or under torchrun, one per worker).

    torchrun --standalone --nproc_per_node=4 -m reshard /ckpt/run1 /ckpt/run1-dp16 --target-dp 16
    python -m reshard /ckpt/run1 /ckpt/run1-dp16 --target-dp 16 --workers 4   # same, without torchrun
    python -m reshard /ckpt/run1 /ckpt/run1-dp3 --target-dp 3 --dry-run
    python -m reshard --config configs/example.yaml
    python -m reshard verify DST [--against SRC]       # see reshard.verify
    python -m reshard SRC DST --target-dp M --array-task I --array-tasks K   # see reshard.jobs.array_job
    python -m reshard publish DST                      # publish a finished array job
    python -m reshard inspect SRC [--tag TAG] [--json]   # see reshard.inspect_report
    python -m reshard export SRC OUT --format safetensors [--dtype bf16] [--max-shard-size 5GB]   # reshard.export
    python -m reshard export SRC OUT --format universal                 # DeepSpeed universal checkpoint
    python -m reshard export SRC OUT --format dcp                       # PyTorch DCP for FSDP2, with Adam state

Exit status: 0 only when DST holds the complete checkpoint (or the dry run printed its plan);
2 for bad input or options (the message names the file and the problem); 1 for anything else.
Under torchrun every worker exits with that status, but a refusal is printed once, by worker 0:
the workers agree on every failure (reshard.transport.collective), so worker 0's message names it, also
when another worker is the one that failed.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from reshard.errors import OptionError, ReshardError
from reshard.jobs.options import ReshardOptions, field_docs, parse_size
from reshard.jobs.results import print_summary, process_started, report_result
from reshard.transport import is_first_worker
from reshard.transport.forked import WorkerLost


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad value is one line on stderr and exit status 2 (never a usage dump)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _size(text: str) -> int:
    """argparse type for sizes: its errors become argparse errors (exit 2, one line)."""
    try:
        return parse_size(text)
    except OptionError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


DESCRIPTION = """Reshard a DeepSpeed ZeRO checkpoint for a new data-parallel world size, written natively
so that engine.load_checkpoint(DST) works at that size:  reshard SRC DST --target-dp M

subcommands (each has its own --help):
  verify DST [--against SRC]     check an output: every file against its manifest, or against SRC
  inspect SRC [--json]           describe a checkpoint (pickles only) and check every rank file
  export SRC OUT --format F      write Hugging Face safetensors, a DeepSpeed universal checkpoint or a PyTorch DCP
  publish DST                    publish a finished SLURM array job (every --array-task done)"""

POSITIONAL = {"source": "SRC", "destination": "DST"}  # the fields given by position, and how usage names them


def build_parser() -> argparse.ArgumentParser:
    """The reshard flags, one per field of ReshardOptions (name, docstring, metadata), plus --config."""
    parser = _Parser(prog="reshard", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    docs = field_docs(ReshardOptions)
    for field in dataclasses.fields(ReshardOptions):
        help_text = docs[field.name]
        if field.name in POSITIONAL:
            parser.add_argument(field.name, nargs="?", metavar=POSITIONAL[field.name], help=help_text)
            continue
        shown_default = field.default not in (None, False) and "default" not in help_text
        if field.metadata.get("size"):
            kind, default_text = _size, _size_text(field.default)
        else:
            kind, default_text = _type_of(field), field.default
        if shown_default:
            help_text = f"{help_text.rstrip('.')} (default {default_text})."
        if kind is bool:  # None when absent, so a job file's value stands unless the flag is given
            parser.add_argument(_flag(field.name), action="store_true", default=None, help=help_text)
        else:
            parser.add_argument(_flag(field.name), type=kind, choices=field.metadata.get("choices"),
                                metavar=field.metadata.get("metavar"), help=help_text)
    parser.add_argument("--config", metavar="FILE", help="YAML job file with the same option names (flags override it)")
    return parser


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _type_of(field: dataclasses.Field) -> type:
    """The Python type a field's annotation names ("int | None" -> int)."""
    for kind in (bool, int, float, str):
        if kind.__name__ in str(field.type).replace(" ", "").split("|"):
            return kind
    raise TypeError(f"ReshardOptions.{field.name}: no command-line type for {field.type!r}")


def _size_text(size: int) -> str:
    """1073741824 -> "1G": the largest binary unit that divides `size`."""
    for unit, scale in (("T", 1 << 40), ("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if size % scale == 0:
            return f"{size // scale}{unit}"
    return str(size)


def options_from_args(args: argparse.Namespace) -> ReshardOptions:
    overrides = {field.name: getattr(args, field.name) for field in dataclasses.fields(ReshardOptions)}
    if args.config:
        return ReshardOptions.from_yaml(args.config, **overrides).validate()
    return ReshardOptions(**{k: v for k, v in overrides.items() if v is not None}).validate()


def _refusal_record_path(args: argparse.Namespace) -> str | None:
    """Where to record a job refused before its options were whole: --result-json as given, only
    where a valid job could have written it (outside SRC and DST, not the job file); else nowhere."""
    from reshard.files.paths import output_file_problem
    if not args.result_json:
        return None
    source, destination = args.source, args.destination
    if args.config:
        try:
            named = ReshardOptions.from_yaml(args.config, source=source, destination=destination,
                                             result_json=args.result_json)
        except ReshardError:
            return None
        source, destination = named.source, named.destination
    inside = {what: path for what, path in (("SRC", source), ("DST", destination)) if isinstance(path, str) and path}
    if output_file_problem(args.result_json, inside, reads=[args.config]) is not None:
        return None
    return args.result_json


def build_verify_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="reshard verify", description="Check a reshard output: re-hash every file against its manifest, "
                                           "or (with --against) compare every element with the source.")
    parser.add_argument("destination", help="save directory written by reshard")
    parser.add_argument("--tag", help="tag to check (default: DST/latest)")
    parser.add_argument("--against", metavar="SRC", help="source save directory to compare element by element")
    parser.add_argument("--memory-budget", type=_size, default=1 << 30, help="as for reshard (default 1G)")
    parser.add_argument("--trust-pickle", action="store_true", help="as for reshard")
    parser.add_argument("--quiet", action="store_true", help="no progress bar (as for reshard)")
    return parser


def verify_main(argv: list[str]) -> int:
    args = build_verify_parser().parse_args(argv)
    _quiet(args.quiet)
    from reshard.verify import verify_against, verify_hashes
    try:
        if args.against:
            result = verify_against(args.destination, args.against, tag=args.tag, memory_budget=args.memory_budget,
                                    trust_pickle=args.trust_pickle)
        else:
            result = verify_hashes(args.destination, args.tag)
    except ReshardError as error:
        _print_once(f"reshard verify: error: {error}")
        return 2
    if _is_worker0():
        print_summary(result.summary())
    return 0 if result.ok else 1


def _quiet(quiet: bool) -> None:
    """A subcommand's --quiet: no progress bar (reshard.jobs.progress) while it runs; `main` puts the
    environment back afterwards."""
    if quiet:
        from reshard.jobs.progress import PROGRESS_VARIABLE
        os.environ[PROGRESS_VARIABLE] = "0"


#: How long a torchrun worker other than worker 0 waits before leaving on a refusal with --result-json.
REFUSAL_RECORD_GRACE_SECONDS = 3.0


def _is_worker0() -> bool:
    return is_first_worker()  # torchrun's RANK or the MPI launcher's rank


def _print_once(message: str) -> None:
    """A refusal on stderr from worker 0 only (every worker raised the same error or learnt of it)."""
    if _is_worker0():
        print(message, file=sys.stderr)


def build_inspect_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="reshard inspect", description="Describe a DeepSpeed checkpoint (reads pickles, not tensors) and "
                                            "check every rank file; exit 2 when a check fails.")
    parser.add_argument("source", help="DeepSpeed save directory (the one holding `latest`), or one tag directory")
    parser.add_argument("--tag", help="checkpoint tag (default: the one in SRC/latest)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON (schema reshard.inspect/1)")
    parser.add_argument("--trust-pickle", action="store_true", help="as for reshard")
    return parser


def inspect_main(argv: list[str]) -> int:
    args = build_inspect_parser().parse_args(argv)
    try:
        source, tag = _checkpoint_to_read(args.source, args.tag, "inspect")
    except ReshardError as error:
        print(f"reshard inspect: error: {error}", file=sys.stderr)
        return 2
    from reshard.formats.deepspeed_files.deepspeed_pipeline import pipeline_summary, pipeline_summary_text
    try:
        pipeline = pipeline_summary(source, tag, args.trust_pickle)
    except ReshardError as error:  # a pipeline save inspect_pipeline refuses: by name, exit 2
        _print_once(f"reshard inspect: error: {error}")
        return 2
    if pipeline is not None:
        import json
        print_summary(json.dumps(pipeline, indent=2) if args.json else pipeline_summary_text(pipeline))
        return 0
    from reshard.inspect_report import inspect_report
    report = inspect_report(source, tag, trust_pickle=args.trust_pickle)
    if args.json:
        import json
        print_summary(json.dumps(report.as_dict(), indent=2))
    else:
        print_summary(report.text())
    return 0 if report.ok else 2


def _checkpoint_to_read(source: str, tag: str | None, verb: str) -> tuple[str, str | None]:
    """(save directory, tag) that `inspect` and `export` read: a tag directory stands for its save
    directory and tag (reshard.jobs.runs.as_save_dir); a directory holding no checkpoint is refused."""
    from reshard.errors import CheckpointError
    from reshard.jobs.runs import as_save_dir, is_save_dir
    if not os.path.isdir(source):
        raise CheckpointError(source, "is not a directory (expected a DeepSpeed save directory)")
    source, tag = as_save_dir(source, tag)
    if tag is None and not is_save_dir(source):
        inside = sorted(d for d in os.listdir(source) if is_save_dir(os.path.join(source, d)))
        raise CheckpointError(os.path.join(source, "latest"),
                              "does not exist, and no sub-directory is a tag directory: "
                              + (f"nothing to {verb} here; its sub-directories {', '.join(inside)} are save "
                                 f"directories: {verb} each" if inside else
                                 f"nothing to {verb} here (pass the save_dir given to engine.save_checkpoint, "
                                 "or one tag directory in it)"))
    return source, tag


EXPORT_HELP = """What is exported (--format safetensors): every tensor of the model's state_dict() as the
checkpoint saved it, named as in state_dict(): trainable parameters from the fp32 master weights
(cast to --dtype), frozen parameters and persistent buffers (floating ones cast to --dtype, integer
ones as they are). A tied weight (shared_params, e.g. head.weight -> embed.weight) is stored once,
under the owner's name, as save_pretrained does. Not exported: optimizer state, LR scheduler,
counters, client_state, non-persistent buffers, frozen parameters excluded at save, and the HF
config.json / tokenizer (copy those from your model). Files: model-0000k-of-0000n.safetensors and
model.safetensors.index.json, written last.

--format universal writes what DeepSpeed's ds_to_universal.py writes (OUT/TAG/zero/<param>/
{fp32,exp_avg,exp_avg_sq,step}.pt, zero/optimizer_state.pt, the model-states files,
OUT/latest_universal): load it at any size with "checkpoint": {"load_universal": true}.
A PipelineModule save (layer_XX-model_states.pt files) is exported under the names
PipelineModule.state_dict() gives (<layer index>.<name>, tied_modules.<key>.<name>), frozen
parameters and buffers from its layer files (docs/supported.md, Pipeline parallelism).
--format dcp writes a PyTorch Distributed Checkpoint (OUT/.metadata, OUT/__{worker}_{i}.distcp) that
dcp.load + set_state_dict load into an FSDP2 model and torch.optim.AdamW at any world size: keys
model.<fqn> (fp32 masters cast to --dtype), optim.state.<fqn>.{step,exp_avg,exp_avg_sq},
optim.param_groups.<i>.<hyperparameter>; counters, LR scheduler and client_state in
OUT/reshard_run_state.pt (docs/moving-to-fsdp2.md). Adam/AdamW state only; pipeline saves not yet.
--layout accelerate (dcp only) writes OUT/pytorch_model_fsdp_0/ and OUT/optimizer_0/ as Accelerate's FSDP2
SHARDED_STATE_DICT checkpoint, plus the save directory's own files (trainer_state.json, scheduler.pt,
rng_state_*.pth...): a Hugging Face Trainer under FSDP2 resumes with train(resume_from_checkpoint=OUT).
--max-shard-size applies to safetensors only, --chunk-size to dcp only."""


def build_export_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="reshard export", description="Export a DeepSpeed ZeRO checkpoint as Hugging Face safetensors shards, "
                                           "a DeepSpeed universal checkpoint or a PyTorch DCP, with W workers under "
                                           "torchrun or --workers W.",
        epilog=EXPORT_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", help="DeepSpeed save directory (the one holding `latest`), or one tag directory")
    parser.add_argument("destination", help="directory to write the files into (created; must be empty)")
    parser.add_argument("--format", choices=("safetensors", "universal", "dcp"), required=True, help="output format")
    parser.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32",
                        help="dtype of floating tensors in the output (default fp32, the master weights as they are)")
    parser.add_argument("--max-shard-size", default="5GB", help="largest file, HF style: 5GB = 5*10^9 bytes (default 5GB)")
    parser.add_argument("--chunk-size", type=_size, default=64 << 20,
                        help="dcp: largest row block of a tensor stored as one chunk, in fp32 bytes (default 64M)")
    parser.add_argument("--layout", choices=("torch", "accelerate"), default=None,
                        help="dcp: torch = one DCP checkpoint with get_state_dict's keys (default); accelerate = "
                             "pytorch_model_fsdp_0/ + optimizer_0/ and the save directory's Trainer files, as an "
                             "Accelerate / HF Trainer FSDP2 checkpoint")
    parser.add_argument("--tag", help="checkpoint tag (default: the one in SRC/latest)")
    parser.add_argument("--memory-budget", type=_size, default=1 << 30, help="as for reshard (default 1G)")
    parser.add_argument("--overwrite", action="store_true", help="allow a non-empty destination")
    parser.add_argument("--trust-pickle", action="store_true", help="as for reshard")
    parser.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto", help="as for reshard")
    parser.add_argument("--timeout", type=float, default=600.0, help="as for reshard")
    parser.add_argument("--workers", type=int, default=1,
                        help="W worker processes on this host without torchrun (forked, as for reshard; default 1)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar (as for reshard)")
    parser.add_argument("--array-task", type=int, metavar="I",
                        help="SLURM array task I of --array-tasks K: write worker I's files of a K-worker "
                             "export, no collectives; then `reshard publish OUT`")
    parser.add_argument("--array-tasks", type=int, metavar="K", help="the number of array tasks")
    return parser


def export_main(argv: list[str]) -> int:
    args = build_export_parser().parse_args(argv)
    _quiet(args.quiet)
    from reshard.export import export_dcp, export_safetensors, export_universal

    def export(source, tag, transport=None):
        if args.format == "dcp":
            return export_dcp(source, args.destination, dtype=args.dtype, tag=tag,
                              memory_budget=args.memory_budget, chunk_bytes=args.chunk_size,
                              trust_pickle=args.trust_pickle, overwrite=args.overwrite, backend=args.backend,
                              timeout=args.timeout, transport=transport, layout=args.layout or "torch")
        if args.format == "universal":
            return export_universal(source, args.destination, tag=tag, memory_budget=args.memory_budget,
                                    trust_pickle=args.trust_pickle, overwrite=args.overwrite, backend=args.backend,
                                    timeout=args.timeout, transport=transport)
        return export_safetensors(source, args.destination, dtype=args.dtype,
                                  max_shard_size=args.max_shard_size, tag=tag,
                                  memory_budget=args.memory_budget, trust_pickle=args.trust_pickle,
                                  overwrite=args.overwrite, backend=args.backend, timeout=args.timeout,
                                  transport=transport)

    if args.workers < 1:
        _print_once("reshard export: error: --workers must be at least 1")
        return 2
    if args.layout is not None and args.format != "dcp":
        _print_once(f"reshard export: error: --layout applies to --format dcp only, not {args.format}")
        return 2
    if (args.array_task is None) != (args.array_tasks is None):
        _print_once("reshard export: error: --array-task and --array-tasks go together")
        return 2
    if args.array_tasks is not None and args.workers > 1:
        _print_once("reshard export: error: --array-task runs one process per task (not with --workers)")
        return 2
    if args.array_tasks is not None and not 0 <= args.array_task < args.array_tasks:
        _print_once(f"reshard export: error: --array-task must be in [0, --array-tasks), got {args.array_task} of "
                    f"{args.array_tasks}")
        return 2
    if args.workers > 1 and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        _print_once("reshard export: error: --workers starts its own worker processes: run it without torchrun, "
                    "or drop it")
        return 2
    try:
        source, tag = _checkpoint_to_read(args.source, args.tag, "export")
        if args.array_tasks is not None:
            result = _export_array_task(args, source, tag)
            print_summary(result.summary())
            return 0
        if args.workers > 1:  # worker 0 prints the summary or the refusal itself
            from reshard.local_workers import run_forked
            return run_forked(args.workers, args.timeout, lambda transport: export(source, tag, transport),
                              prefix="reshard export")
        result = export(source, tag)
    except ReshardError as error:
        _print_once(f"reshard export: error: {error}")
        return 2
    if _is_worker0():
        report_result(result)
    return 0


def _export_array_task(args, source: str, tag: str | None):
    """`reshard export ... --array-task I --array-tasks K`: one task of the export in array mode."""
    from reshard.export.array_formats import export_safetensors_array_task, export_universal_array_task
    from reshard.export.dcp_array import export_dcp_array_task
    common = dict(task=args.array_task, tasks=args.array_tasks, tag=tag, memory_budget=args.memory_budget,
                  trust_pickle=args.trust_pickle, overwrite=args.overwrite, quiet=args.quiet)
    if args.format == "dcp":
        return export_dcp_array_task(source, args.destination, dtype=args.dtype, chunk_bytes=args.chunk_size,
                                     layout=args.layout or "torch", **common)
    if args.format == "universal":
        return export_universal_array_task(source, args.destination, **common)
    return export_safetensors_array_task(source, args.destination, dtype=args.dtype,
                                         max_shard_size=args.max_shard_size, **common)


def publish_main(argv: list[str]) -> int:
    from reshard.export.array_formats import PLACERS
    from reshard.jobs.array_job import publish_main as publish
    return publish(argv, PLACERS)  # reshards' array sets, and every export's


#: `reshard NAME ...` runs SUBCOMMANDS[NAME] (DESCRIPTION gives each one line in --help)
SUBCOMMANDS = {"verify": verify_main, "inspect": inspect_main, "export": export_main, "publish": publish_main}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in SUBCOMMANDS:
        from reshard.jobs.progress import PROGRESS_VARIABLE
        before = os.environ.get(PROGRESS_VARIABLE)
        try:
            return SUBCOMMANDS[argv[0]](argv[1:])
        finally:  # a subcommand's --quiet sets it (_quiet): for this command only
            if before is None:
                os.environ.pop(PROGRESS_VARIABLE, None)
            else:
                os.environ[PROGRESS_VARIABLE] = before
    parser = build_parser()
    if not argv:  # a first try: how to call it, not a complaint about the first flag it lacks
        parser.print_usage(sys.stderr)
        print(f"{parser.prog}: give SRC DST --target-dp M (or --config FILE, or a subcommand: "
              f"{', '.join(SUBCOMMANDS)}); {parser.prog} --help explains every flag", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    started = process_started()
    options = None
    try:
        options = options_from_args(args)
        if not options.node_local:  # node-local paths differ by node: each node reads its own save directory
            from reshard.jobs.runs import as_save_dir
            options.source, options.tag = as_save_dir(options.source, options.tag, options.all_tags)
        if options.workers > 1:
            if int(os.environ.get("WORLD_SIZE", "1")) > 1:
                raise OptionError("--workers starts its own worker processes: run it without torchrun, or drop it")
            from reshard.local_workers import run_local_workers
            return run_local_workers(options, started)
        from reshard.jobs.collective_job import run_job
        result = run_job(options, started=started)
    except ReshardError as error:
        _print_once(f"reshard: error: {error}")
        record = options.result_json if options is not None else _refusal_record_path(args)
        if record and _is_worker0():
            from reshard.jobs.results import write_refusal_json
            write_refusal_json(record, error)
        elif record and "TORCHELASTIC_RUN_ID" in os.environ:
            # Every worker learnt of the refusal at once. torchrun's agent SIGTERMs the workers still
            # running as soon as it sees one exit non-zero (torch/distributed/elastic/multiprocessing/
            # api.py `SubprocessContext._poll`), which, under load, could end worker 0 before it wrote
            # the record: the other workers leave a moment later.
            import time
            time.sleep(REFUSAL_RECORD_GRACE_SECONDS)
        return 2
    except WorkerLost as error:  # a torchrun peer on this host died or never came: every worker says so
        print(f"reshard: error: {error}", file=sys.stderr)
        return 1
    if _is_worker0():
        report_result(result, options.result_json)
    return 0

