"""What a DeepSpeed ZeRO checkpoint is: its spec (layout-relevant facts) and where its files are.

    source = inspect_checkpoint("/ckpt/run1")        # reshard.formats.deepspeed_files.deepspeed_inspect
    source.spec.layout(16)                           # the same model laid out for 16 ranks
    source.optim_path(3)                             # .../zero_pp_rank_3_mp_rank_00_optim_states.pt

A `CheckpointSpec` holds only what does not depend on the world size (parameters, groups,
flags, streams), so one spec serves the source layout, every target layout and the plan.
`SourceCheckpoint` adds the directory, the tag and the rank-0 file trees target files are
derived from.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from reshard.layouts.experts import (
    ExpertParams,
    ExpertZero3Layout,
    ExpertZero12Layout,
    expert_zero3_layout,
    expert_zero12_layout,
)
from reshard.formats.deepspeed_files import deepspeed_schema as schema
from reshard.formats.torch_bytes.torch_archive import dtype_of
from reshard.formats.torch_bytes.torch_classes import ITEMSIZE
from reshard.layouts.zero import (
    ParamSpec,
    PieceTable,
    Stream,
    Zero3Layout,
    Zero12Layout,
    frozen_pieces,
    zero3_chunk,
    zero3_layout,
    zero12_layout,
)
from reshard.layouts.tensor_parallel import TensorParallelSpec
from reshard.topology import Topology


_LOCAL_PARAMS_CACHE = "_local_params_cache"


@dataclass(frozen=True)
class CheckpointSpec:
    """What a ZeRO checkpoint holds, independent of world size and of where its bytes are."""

    stage: int
    """ZeRO stage: 1, 2 or 3."""
    optimizer: str
    """"zero" (DeepSpeedZeroOptimizer or stage 3) or "bf16_optimizer" (BF16_Optimizer)."""
    bf16_prefix: bool
    """Optim files are named bf16_zero_pp_rank_*: the engine had bf16.enabled."""
    topology: Topology
    """Parallel sizes the checkpoint was saved at (today data parallelism only: tp = ep = pp = 1)."""
    params: tuple[ParamSpec, ...]
    """Trainable parameters; their order defines the logical space."""
    groups: tuple[tuple[int, ...], ...]
    """Parameter ids of each optimizer param group, in the model's order."""
    round_robin: bool
    param_alignment: int
    """Per-parameter alignment in elements (1: none)."""
    sub_group_size: int
    lp_dtype: str
    """dtype of the model (low-precision) parameters."""
    streams: tuple[Stream, ...]
    """Per-partition tensors: "fp32" master weights, then each optimizer state tensor."""
    frozen: tuple[ParamSpec, ...] = ()
    """ZeRO-3 frozen parameters, partitioned in the model-states files."""
    frozen_dtype: str | None = None
    tensor: TensorParallelSpec | None = None
    """AutoTP split of every parameter (None: no tensor parallelism); `params` then hold global shapes.
    With experts too (AutoEP folded with AutoTP) it covers the DENSE parameters only, in `params`'
    order: experts are never split by TP (`reshard.topology`)."""
    experts: ExpertParams | None = None
    """Native DeepSpeed MoE: which params are experts (params then hold every GLOBAL expert)."""
    columns: tuple | None = None
    """A PipelineModule save (tp and pp kept): per column, mp index stage * tp + model rank, its own
    (params, groups), a ZeRO-1 save over that stage's parameters; `params` then holds every column's
    end to end (the space) and `groups` column 0's. None for every other save."""

    @property
    def dp_world_size(self) -> int:
        return self.topology.dp

    def local_params(self, tp: int | None = None, tp_rank: int = 0) -> tuple[ParamSpec, ...]:
        """Trainable parameters with the shapes TP rank `tp_rank` of `tp` holds (default: the source's TP)."""
        if self.tensor is None:
            return self.params
        key = (self.topology.tp if tp is None else tp, tp_rank)
        # memoised: planning lays out the source and the target from the same local shapes
        # whenever their TP sizes agree (10^5 ParamSpecs cost ~0.3 s to build); kept out of pickles
        cache = self.__dict__.setdefault(_LOCAL_PARAMS_CACHE, {})
        if key not in cache:
            shapes = iter(self.tensor.params.local_shapes(*key))
            dense = [True] * len(self.params) if self.experts is None else \
                [e is None for e in self.experts.expert_of]  # folded: experts whole on every TP rank
            cache[key] = tuple(ParamSpec(p.name, next(shapes)) if d else p for p, d in zip(self.params, dense))
        return cache[key]

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != _LOCAL_PARAMS_CACHE}

    def layout(self, world: int | Topology, tp: int | None = None, tp_rank: int = 0, pp_rank: int = 0
               ) -> Zero12Layout | Zero3Layout | ExpertZero12Layout | ExpertZero3Layout:
        """ZeRO layout over `world` (a Topology, or a dp size) of the TP-local parameters of TP rank
        `tp_rank` of `tp` (default: the source's TP size); of a pipeline save, that of column
        (stage `pp_rank`, model rank `tp_rank`), at a target Topology of another pp or tp that target's own
        stages (`Topology.stages`). An MoE checkpoint's layout depends on ep, so it takes a Topology."""
        if self.columns is not None:
            stages = world.stages if isinstance(world, Topology) else None
            columns = self.columns if stages is None or \
                (world.pp, world.tp) == (self.topology.pp, self.topology.tp) else stages.columns  # the target's
            params, groups = columns[pp_rank * (self.topology.tp if tp is None else tp) + tp_rank]
            return zero12_layout(params, groups, world.dp if isinstance(world, Topology) else world,
                                 round_robin=self.round_robin, param_alignment=self.param_alignment)
        if self.experts is not None:
            if not isinstance(world, Topology):
                raise TypeError("an MoE checkpoint's layout depends on ep: pass a Topology, not a dp size")
            if self.stage == 3:
                return expert_zero3_layout(self.local_params(world.tp, tp_rank), self.groups, self.experts, world,
                                           self.sub_group_size, tp_rank)
            return expert_zero12_layout(self.local_params(world.tp, tp_rank), self.groups, self.experts, world,
                                        round_robin=self.round_robin, param_alignment=self.param_alignment,
                                        tp_rank=tp_rank)
        world_size = world.dp if isinstance(world, Topology) else world
        params = self.local_params(tp, tp_rank)
        if self.stage == 3:
            return zero3_layout(params, self.groups, world_size, self.sub_group_size)
        return zero12_layout(params, self.groups, world_size, round_robin=self.round_robin,
                             param_alignment=self.param_alignment)

    @property
    def module_streams(self) -> tuple[Stream, ...]:
        """The stream of the split module tensors (ZeRO-1/2 model states under TP)."""
        if self.tensor is None or not self.tensor.module.names:
            return ()
        return (Stream("module", self.lp_dtype, itemsize(self.lp_dtype)),)

    def frozen_layout(self, world_size: int) -> tuple[PieceTable, tuple[int, ...]]:
        """Pieces of the ZeRO-3 frozen space and the size of each frozen chunk at `world_size`."""
        return frozen_pieces(self.frozen, world_size), tuple(zero3_chunk(p.numel, world_size) for p in self.frozen)

    @property
    def frozen_streams(self) -> tuple[Stream, ...]:
        if not self.frozen:
            return ()
        return (Stream("frozen", self.frozen_dtype, itemsize(self.frozen_dtype)),)

    @property
    def total_elements(self) -> int:
        return sum(p.numel for p in self.params)

    def describe(self) -> str:
        kind = "BF16_Optimizer" if self.optimizer == "bf16_optimizer" else f"ZeRO-{self.stage}"
        extras = [name for name, on in (("round-robin", self.round_robin),
                                         ("parameter alignment", self.param_alignment > 1)) if on]
        ranks = f"{self.dp_world_size} dp ranks" + (f" x {self.topology.tp} tp ranks" if self.tensor else "")
        if self.columns is not None:
            ranks += (f" x {self.topology.tp} model ranks x {self.topology.pp} pipeline stages (PipelineModule, "
                      f"each of its {len(self.columns)} columns a ZeRO-1 save; column 0's groups)")
        if self.tensor is not None and self.experts is not None:
            ranks += " (AutoEP folded with AutoTP)" if self.topology.folded else ""
        if self.experts is not None:
            ranks += (f", {'AutoEP' if self.experts.autoep else 'MoE'} {len(self.experts.num_experts)} layers x "
                      f"{'/'.join(map(str, sorted(set(self.experts.num_experts))))} experts at ep={self.topology.ep}")
        return (f"{kind} {self.lp_dtype}, {ranks}, {len(self.groups)} param groups, "
                f"{len(self.params)} trainable params ({self.total_elements:,} elements)"
                f"{', ' + str(len(self.frozen)) + ' partitioned frozen params' if self.frozen else ''}, "
                f"state {'+'.join(s.name for s in self.streams)}" + (f" ({', '.join(extras)})" if extras else ""))


@dataclass(frozen=True)
class SourceCheckpoint:
    """A source checkpoint: its spec, the rank-0 file trees the targets are built from, and
    the bytes of their small unpartitioned tensors (step counters, buffers, client state)."""

    save_dir: str
    tag: str
    spec: CheckpointSpec
    optim_template: Any
    """Portable tree of rank 0's optim file (tensors as TensorRef)."""
    model_template: Any
    """Portable tree of rank 0's model-states file."""
    carried: dict = field(default_factory=dict)
    """file name -> storage key -> bytes, for templates small enough to ship to every worker."""
    other_files: tuple[str, ...] = ()
    """Files in the tag directory that are not DeepSpeed's, by relative path (copied unchanged)."""
    other_dirs: tuple[str, ...] = ()
    """Sub-directories of the tag directory, by relative path (re-created, empty ones too)."""
    column_templates: tuple = ()
    """A pipeline save: per column (spec.columns), the portable trees of its dp rank 0 optim file and
    its model-states file, which its target files are built from."""
    manifest_source: dict | None = None
    """A pipeline save: the manifest's "source" entry (less "files") as the pipeline job writes it, so that
    every job kind's output of it is the same, manifest included (SLURM array tasks still take that job)."""
    pipeline: Any = None
    """A pipeline save as inspected (deepspeed_pipeline.PipelineSource), kept only until its target is worked
    out (collective_job.source_target, which needs it for another pp or tp and then drops it), so the stage
    pickles are read once and never shipped to the workers."""

    def templates(self, at, target: Topology) -> tuple[Any, Any, str, str]:
        """(optim tree, model tree, optim file name, model file name) the target files of the rank at
        coordinates `at` of `target` are built from: rank 0's, or its pipeline column's dp rank 0's (at a
        target with stages of its own, `Topology.stages`, stage 0's)."""
        if not self.column_templates:
            return self.optim_template, self.model_template, self.optim_name(0), self.model_name(0)
        tp = self.spec.topology.tp
        if target.layer_files is not None and target.layer_files.recut:  # another tp: model rank 0's stage 0
            # optimizer file, as the pipeline job's were (pinned bytes), and the stage 0 model file of the
            # same model rank, or of model rank 0 where the source has none
            optim_column, model_column = 0, at.tp if at.tp < tp else 0
        else:  # a stage change: stage 0's, as the pipeline job's (deepspeed_pipeline.named_states)
            optim_column = model_column = at.tp if target.stages is not None \
                else at.pp * tp + at.tp
        optim_rank, model_rank = (self.spec.topology.rank_of(0, c % tp, c // tp) for c in (optim_column, model_column))
        return (self.column_templates[optim_column][0], self.column_templates[model_column][1],
                self.optim_name(optim_rank), self.model_name(model_rank))

    def layer_file_names(self, rank: int, target: Topology | None) -> list[str]:
        """The layer files source rank `rank` reads where `target`'s layer files move through the plan
        (`Topology.layer_files`: those of its model rank whose layers its stage reads, dp rank 0 only;
        reshard.formats.deepspeed_files.deepspeed_pipeline.pipeline_model_axis); none without a target."""
        at = self.spec.topology.coordinates(rank)
        layer_files = target.layer_files if target is not None else None
        if layer_files is None or at.dp != 0:
            return []
        model = layer_files.axis.layer_file_model(at.tp)
        return [schema.layer_file_name(index, model) for index, stage, _, _ in layer_files.templates
                if stage == at.pp]

    @property
    def tag_dir(self) -> str:
        return os.path.join(self.save_dir, self.tag)

    def optim_name(self, rank: int) -> str:
        return schema.optim_file_name_of(self.spec.topology, rank, self.spec.bf16_prefix)

    def model_name(self, rank: int = 0) -> str:
        return schema.model_file_name_of(self.spec.topology, rank, self.spec.stage)

    def optim_path(self, rank: int) -> str:
        return os.path.join(self.tag_dir, self.optim_name(rank))

    def model_path(self, rank: int = 0) -> str:
        return os.path.join(self.tag_dir, self.model_name(rank))

    def expert_problem(self, target: Topology) -> str | None:
        """Why `target` cannot hold this checkpoint's experts (None: it can; no experts: ep must be 1)."""
        experts = self.spec.experts
        if experts is None:
            return None if target.ep == 1 else f"has no experts, so the target ep must be 1 (got ep={target.ep})"
        return experts.ep_problem(target.ep)

    def source_files(self, rank: int, target: Topology | None) -> list[str]:
        """The files of one source rank (the model-states file of a TP rank belongs to its dp
        rank 0 under ZeRO-1/2), with the layer files it reads for `target` (`layer_file_names`)."""
        files = [self.optim_path(rank)]
        if self.spec.stage == 3 or self.spec.topology.coordinates(rank).dp == 0:
            files.append(self.model_path(rank))
        return files + [os.path.join(self.tag_dir, name) for name in self.layer_file_names(rank, target)]


def refuse_experts(source: SourceCheckpoint, doing: str) -> None:
    """Refuse an MoE checkpoint where only data-parallel checkpoints are supported yet."""
    if source.spec.experts is not None:
        from reshard.errors import UnsupportedCheckpoint
        raise UnsupportedCheckpoint(source.model_path(0), f"is a mixture-of-experts checkpoint; {doing} MoE "
                                                          "checkpoints is not supported yet")


def itemsize(dtype: str) -> int:
    size = ITEMSIZE.get(dtype)  # the dtypes torch pickles by name: no torch needed
    return dtype_of(dtype).itemsize if size is None else size


def refuse_tensor_parallel(source: SourceCheckpoint, what: str) -> None:
    """Raise for a tensor-parallel (AutoTP) checkpoint where `what` does not handle one yet."""
    if source.spec.tensor is not None:
        from reshard.errors import UnsupportedCheckpoint
        raise UnsupportedCheckpoint(source.tag_dir, f"is a tensor-parallel (AutoTP, tp={source.spec.topology.tp}) "
                                                    f"checkpoint; {what} does not support tensor parallelism yet "
                                                    "(`reshard SRC DST --target-dp D --target-tp T` does)")
