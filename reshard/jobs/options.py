"""Job options: one dataclass, filled from the command line, a YAML file, or keyword arguments.

    from reshard.jobs.options import ReshardOptions, parse_size
    options = ReshardOptions(source="/ckpt/a", destination="/ckpt/b", target_dp=16,
                             memory_budget=parse_size("4G"))

A YAML job file (see configs/) uses the field names as keys; command-line flags override it.
The command-line flags are made from the fields (reshard.cli): a field's name gives the flag
(`memory_budget` -> `--memory-budget`), its docstring the help, its metadata (`flag(...)`) the
choices or metavar.
"""
from __future__ import annotations

import ast
import dataclasses
import inspect
import math
import os
import re
from dataclasses import dataclass

from reshard.errors import OptionError
from reshard.files.paths import check_output_file, check_tag
from reshard.topology import Topology

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str | int) -> int:
    """'512M', '4G', '1.5G', '65536' -> bytes (binary units)."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise OptionError(f"cannot read size {text!r}: a size is not negative")
        return text
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*", str(text), re.IGNORECASE)
    if not match:
        raise OptionError(f"cannot read size {text!r}: use bytes or a number with K, M, G or T (e.g. 512M, 4G)")
    return int(float(match[1]) * _UNITS[match[2].upper()])


def flag(default, *, choices: tuple | None = None, metavar: str | None = None, size: bool = False):
    """A field whose command-line flag takes only `choices`, shows `metavar`, or reads a size (512M)."""
    return dataclasses.field(default=default, metadata={"choices": choices, "metavar": metavar, "size": size})


def field_docs(cls) -> dict[str, str]:
    """Each field's docstring (the string under it), whitespace collapsed: the help of its flag."""
    body = ast.parse(inspect.getsource(cls)).body[0].body
    return {field.target.id: " ".join(doc.value.value.split())
            for field, doc in zip(body, body[1:])
            if isinstance(field, ast.AnnAssign) and isinstance(field.target, ast.Name)
            and isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant) and isinstance(doc.value.value, str)}


@dataclass
class ReshardOptions:
    """Everything a reshard job needs to know."""

    source: str = ""
    """DeepSpeed save directory to read (the save_dir given to engine.save_checkpoint), or one tag
    directory in it (SRC/global_step3 reads that tag; DST is then the save directory to write it into)."""
    destination: str = ""
    """Save directory to create, loadable with engine.load_checkpoint at the target size."""
    target_dp: int | None = flag(None, metavar="M")
    """Data-parallel world size the checkpoint is resharded for (required)."""
    target_sp: int | None = flag(None, metavar="S")
    """DeepSpeed Ulysses sequence-parallel size of the job that loads the output; default: the save's.
    --target-dp then counts sp x dp ranks (ZeRO partitions over both, as the save's dp_world_size
    does) and must be a multiple of it; the batch config is checked at dp = --target-dp / sp."""
    target_tp: int | None = flag(None, metavar="T")
    """Tensor-parallel size to reshard for (AutoTP checkpoints, pipeline model axes); default: the source's."""
    target_stage: int | None = flag(None, choices=(1, 2, 3))
    """ZeRO stage to write for (1, 2 or 3); default: the source's stage."""
    target_ep: int | None = flag(None, metavar="E")
    """Expert-parallel size to reshard an MoE checkpoint for (divides --target-dp); default: the source's."""
    target_pp: int | None = flag(None, metavar="P")
    """Pipeline stages to reshard a PipelineModule checkpoint for; default: the source's."""
    pipeline_layers: int | None = flag(None, metavar="N")
    """With another --target-pp: len(layers) of the PipelineModule (functions and parameterless layers included)."""
    pipeline_tied: str | None = flag(None, metavar="KEY:I,J[;KEY:I,J]")
    """With another --target-pp: where TiedLayerSpec layers sit, "KEY:I,J[;KEY2:K,L]" (global layer indices)."""
    pipeline_partition: str = flag("parameters", metavar="METHOD")
    """With another --target-pp: DeepSpeed's partition_method, parameters or uniform, or boundaries "0,3,7"."""
    tag: str | None = flag(None, metavar="TAG")
    """Checkpoint tag to reshard; default: the one named by SRC/latest."""
    all_tags: bool = False
    """Reshard every tag directory (best_* included), not only the one `latest` names."""
    memory_budget: int = flag(1 << 30, size=True, metavar="SIZE")
    """Bytes of slices one worker holds at once (send plus receive buffers of a round), e.g. 512M, 4G."""
    overwrite: bool = False
    """Allow a non-empty destination; the tag directory and `latest` there are replaced."""
    dry_run: bool = False
    """Print the plan (files and bytes per worker) without reading tensors or writing."""
    quiet: bool = False
    """No progress bar; the final summary is still printed."""
    trust_pickle: bool = False
    """Unpickle classes outside the DeepSpeed allowlist (runs code from the checkpoint)."""
    ignore_batch_config: bool = False
    """Proceed although the checkpoint's ds_config batch settings cannot run at the target size."""
    durable_every: int = flag(1 << 30, size=True, metavar="SIZE")
    """Bytes moved (all workers) between fsync points a re-run can resume from."""
    backend: str = flag("auto", choices=("auto", "gloo", "nccl"))
    """torch.distributed backend under torchrun: auto (nccl with CUDA, else gloo), gloo or nccl."""
    timeout: float = flag(600.0, metavar="SECONDS")
    """Seconds any collective may wait; a worker whose peer died exits instead of hanging."""
    array_task: int | None = flag(None, metavar="I")
    """This process's index (0 .. --array-tasks minus 1) in a SLURM array job without collectives."""
    array_tasks: int | None = flag(None, metavar="K")
    """Number of array tasks sharing the target files; each runs alone, any time, in any order."""
    transport: str = flag("auto", choices=("auto", "torch", "mpi"))
    """How workers talk: torch (torch.distributed), mpi (mpi4py), or auto (MPI when an MPI launcher
    started the process and torchrun did not; with --workers above 1, shared memory between the forked
    workers, and torch means gloo between them)."""
    workers: int = flag(1, metavar="W")
    """Worker processes `python -m reshard` starts on this host (forked after the imports; shared
    memory, or gloo with --transport torch); under torchrun the launcher starts them instead."""
    node_local: bool = False
    """SRC and DST are node-local paths, the same on every node (DeepSpeed's use_node_local_storage):
    each node reads what it sees and receives its target ranks' files."""
    target_ranks_per_node: int | None = flag(None, metavar="G")
    """With --node-local: target rank r runs on node r // G, and its files are written there."""
    result_json: str | None = flag(None, metavar="PATH")
    """Also write the result (bytes, seconds, phases, workers, bytes between nodes and the plan's
    figure) as JSON to PATH, from worker 0; a refused job writes {"refused": true, "exit_status": 2,
    "error"} there instead. PATH must lie outside SRC and DST and not be the job file."""

    def validate(self) -> "ReshardOptions":
        if self.target_dp is None:
            raise OptionError("--target-dp is required: the data-parallel world size to reshard for "
                              "(target_dp in a job file)")
        if not isinstance(self.target_dp, int) or isinstance(self.target_dp, bool) or self.target_dp < 1:
            raise OptionError(f"--target-dp must be an integer >= 1, got {self.target_dp!r}")
        if self.target_tp is not None and (not isinstance(self.target_tp, int) or isinstance(self.target_tp, bool)
                                           or self.target_tp < 1):
            raise OptionError(f"--target-tp must be an integer >= 1, got {self.target_tp!r}")
        if self.target_sp is not None and (not isinstance(self.target_sp, int) or isinstance(self.target_sp, bool)
                                           or self.target_sp < 1):
            raise OptionError(f"--target-sp must be an integer >= 1, got {self.target_sp!r}")
        if self.target_ep is not None and (not isinstance(self.target_ep, int) or isinstance(self.target_ep, bool)
                                           or self.target_ep < 1):
            raise OptionError(f"--target-ep must be an integer >= 1, got {self.target_ep!r}")
        if self.target_pp is not None and (not isinstance(self.target_pp, int) or isinstance(self.target_pp, bool)
                                           or self.target_pp < 1):
            raise OptionError(f"--target-pp must be an integer >= 1, got {self.target_pp!r}")
        self.target_topology  # noqa: B018  (validates the sizes together)
        if self.target_stage is not None and (self.target_stage not in (1, 2, 3) or isinstance(self.target_stage, bool)):
            raise OptionError(f"--target-stage must be 1, 2 or 3, got {self.target_stage!r}")
        if self.target_stage is not None and self.array_tasks is not None:
            raise OptionError("--target-stage does not combine with --array-task yet: run the stage change "
                              "with torchrun, MPI or --workers")
        if self.target_stage is not None and (self.target_tp is not None or self.node_local):
            raise OptionError("--target-stage does not combine with --target-tp or --node-local yet (data "
                              "parallelism on a shared file system only)")
        for name in ("memory_budget", "durable_every"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                setattr(self, name, value := parse_size(value))
        if self.memory_budget < 1024:
            raise OptionError(f"--memory-budget must be at least 1K, got {self.memory_budget} bytes")
        if self.durable_every < 1:
            raise OptionError(f"--durable-every must be at least 1 byte, got {self.durable_every}")
        if self.backend not in ("auto", "gloo", "nccl"):
            raise OptionError(f"--backend must be auto, gloo or nccl, got {self.backend!r}")
        if self.transport not in ("auto", "torch", "mpi"):
            raise OptionError(f"--transport must be auto, torch or mpi, got {self.transport!r}")
        if (self.array_task is None) != (self.array_tasks is None):
            raise OptionError("--array-task and --array-tasks go together (task index and number of tasks)")
        if self.array_tasks is not None and not (isinstance(self.array_tasks, int) and self.array_tasks >= 1
                                                 and isinstance(self.array_task, int)
                                                 and 0 <= self.array_task < self.array_tasks):
            raise OptionError(f"--array-task must be in 0..--array-tasks-1 and --array-tasks >= 1, got task "
                              f"{self.array_task!r} of {self.array_tasks!r}")
        if not isinstance(self.workers, int) or isinstance(self.workers, bool) or self.workers < 1:
            raise OptionError(f"--workers must be an integer >= 1, got {self.workers!r}")
        if self.workers > 1 and (self.transport == "mpi" or self.array_tasks is not None):
            raise OptionError("--workers starts local workers; it does not combine with --transport mpi "
                              "or --array-task (the MPI launcher or the array starts the processes)")
        if self.node_local or self.target_ranks_per_node is not None:
            self._validate_node_local()
        if (not isinstance(self.timeout, (int, float)) or isinstance(self.timeout, bool)
                or not math.isfinite(self.timeout) or self.timeout <= 0):
            raise OptionError(f"--timeout must be a positive number of seconds, got {self.timeout!r}")
        for name, shown in (("source", "SRC"), ("destination", "DST")):
            if not isinstance(getattr(self, name), str):
                raise OptionError(f"{shown} must be a path, got {getattr(self, name)!r}")
        if not self.source or not self.destination:
            raise OptionError("both SRC and DST are required")
        # resolved once, here: every layer below compares and joins absolute paths, whatever the
        # working directory (a relative DST once failed in publishing against its own absolute form)
        self.source, self.destination = os.path.abspath(self.source), os.path.abspath(self.destination)
        if self.result_json is not None:
            self.result_json = check_output_file(self.result_json, "--result-json",
                                                 {"SRC": self.source, "DST": self.destination})
        if self.tag is not None:
            check_tag(self.tag, "--tag")
        return self

    def _validate_node_local(self) -> None:
        if not self.node_local:
            raise OptionError("--target-ranks-per-node goes with --node-local")
        g = self.target_ranks_per_node
        if not isinstance(g, int) or isinstance(g, bool) or g < 1:
            raise OptionError(f"--node-local needs --target-ranks-per-node G >= 1 (target rank r runs on node r // G), "
                              f"got {g!r}")
        if self.array_tasks is not None or self.workers > 1 or self.all_tags:
            raise OptionError("--node-local runs under a multi-node launcher (torchrun, SLURM) on one tag; it does "
                              "not combine with --array-task, --workers or --all-tags")

    @property
    def target_topology(self) -> Topology:
        """The sizes the options give, checked together (tp, ep 1 when not given): for `validate`
        before any source is read. Not a job's target: that is `checked_target` (tp and ep default
        to the source's), derived once per checkpoint by reshard.jobs.preflight.target_topology."""
        return Topology(dp=self.target_dp, tp=self.target_tp or 1, ep=self.target_ep or 1)

    def target_for(self, source: Topology) -> Topology:
        """The topology to write for a source saved at `source`: --target-tp and --target-ep default
        to its TP and EP."""
        return Topology(dp=self.target_dp, tp=source.tp if self.target_tp is None else self.target_tp,
                        ep=source.ep if self.target_ep is None else self.target_ep, pp=source.pp)

    def checked_target(self, source: Topology, expert_problem, path: str) -> Topology:
        """`target_for(source)`, refused naming `path` where DeepSpeed could not build it: a
        topology that does not validate, or one whose ep `expert_problem(target)` (a checkpoint's
        own check: None when its experts fit) says cannot hold the experts."""
        from reshard.errors import TopologyError
        if self.target_pp not in (None, source.pp):  # pipeline saves: pipeline_stage_change
            raise OptionError(f"{path}: --target-pp {self.target_pp} is for DeepSpeed PipelineModule checkpoints; "
                              "this one has no pipeline stages (no layer_XX-model_states.pt files)")
        try:
            target = self.target_for(source)
        except TopologyError as error:
            raise OptionError(f"{path}: cannot reshard for --target-dp {self.target_dp}: {error}") from None
        problem = expert_problem(target)
        if problem:
            raise OptionError(f"{path}: cannot reshard for {target.describe()}: {problem}")
        return target

    @classmethod
    def from_yaml(cls, path: str, **overrides) -> "ReshardOptions":
        import yaml
        try:
            with open(path) as fd:
                data = yaml.safe_load(fd) or {}
        except OSError as error:
            raise OptionError(f"{path}: cannot read the job file ({error.strerror})") from None
        except yaml.YAMLError as error:
            raise OptionError(f"{path}: is not valid YAML ({str(error).splitlines()[0]})") from None
        if not isinstance(data, dict):
            raise OptionError(f"{path}: a job file is a mapping of option names to values")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise OptionError(f"{path}: unknown option(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        for name in ("memory_budget", "durable_every"):
            if name in data:
                data[name] = parse_size(data[name])
        data.update({k: v for k, v in overrides.items() if v is not None})
        if data.get("result_json") is not None:  # the job file is read: never the record's place
            check_output_file(data["result_json"], "--result-json", {}, reads=[path])
        return cls(**data)
