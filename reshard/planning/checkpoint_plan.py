"""The plan for one checkpoint: its spaces, from the spec and the two topologies. Pure, no torch.

    from reshard.planning.checkpoint_plan import plan_reshard
    plan = plan_reshard(source.spec, Topology(dp=16), workers=8, budget_bytes=1 << 30)
    plan.rounds, plan.traffic()

Every worker calls this with the same arguments and gets the same plan (it reads nothing).
`plan_reshard` asks the save's layout (`save_layout`: the first of `SAVE_LAYOUTS` that holds the spec:
a PipelineModule save's columns, ZeRO-0 MoE, AutoTP, else data-parallel ZeRO) for its ownership and
spaces; it branches on no kind of save.
A checkpoint has one or two logical spaces, moved one after the other: the optimizer space
(fp32 master weights and every per-partition optimizer state) and, under ZeRO-3, the
partitioned frozen parameters. ZeRO-1/2 layouts have O(params + ranks) pieces and are planned
from their piece tables (`reshard.planning.plan`); ZeRO-3 layouts are evenly chunked and planned per
worker by arithmetic (`reshard.planning.chunked_plan`). Tensor-parallel (AutoTP) ZeRO-1/2 checkpoints
are planned over the global parameters (`reshard.layouts.tensor_pieces`), with a second space for the
split module weights of their model-states files; AutoTP ZeRO-3 checkpoints likewise, from
piece tables (O(params x dp x tp) pieces), with their partitioned frozen parameters as the
second space.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from reshard.planning.chunked_plan import ChunkedSide, plan_chunked_space
from reshard.layouts.zero import ParamSpec, PieceTable, buffer_numels, logical_bases, table_from_columns
from reshard.planning.plan import Ownership, ReshardPlan, plan_space, sorted_distinct
from reshard.layouts.zero import zero3_chunk, zero12_layout
from reshard.layouts.tensor_pieces import (
    GlobalSpace,
    module_buffer_numels,
    module_pieces,
    pipeline_model_axis_pieces,
    replicated,
    shared_layouts,
    zero3_frozen_pieces,
    zero12_pieces,
)
from reshard.layouts.zero0_expert_groups import zero0_pieces
from reshard.topology import Topology


def plan_reshard(spec, target: Topology, workers: int, budget_bytes: int, *, tabulated: bool = False,
                 ownership: Ownership | None = None) -> ReshardPlan:
    """The plan for moving a checkpoint of `spec` (a CheckpointSpec: topology, layout rules,
    streams with item sizes) to the `target` topology with `workers` workers: the spaces its layout
    (`save_layout`) lays out, under the budget. Branches on no kind of save.

    `tabulated`: plan every space from its piece tables, ZeRO-3 too. A SLURM array task
    (`reshard.jobs.array_job`) restricts a one-worker plan to its files by selecting segments, which
    needs the table; it plans once per task, so the O(params x ranks) table is affordable there.
    `ownership`: who reads and writes which ranks, when not the layout's arithmetic blocks (node-local
    checkpoints: `reshard.jobs.node_local.node_local_ownership`)."""
    return plan_layout(save_layout(spec), target, workers, budget_bytes, tabulated=tabulated, ownership=ownership)


def plan_layout(layout: "SaveLayout", target: Topology, workers: int, budget_bytes: int, *, tabulated: bool = False,
                ownership: Ownership | None = None) -> ReshardPlan:
    """The plan of a save whose layout is known (`plan_reshard` finds it from the spec)."""
    ownership = ownership or layout.ownership(target, workers)
    return ReshardPlan(ownership, layout.spaces(target, ownership, budget_bytes, tabulated), budget_bytes)


class SaveLayout(Protocol):
    """One kind of save lowered to pieces of global parameters, for the planner (docs/architecture.md,
    "The seam"): given the one target value, which ranks read and write (`ownership`) and each space's
    source and target pieces, planned into rounds (`spaces`). A new parallelism adds a class to
    `SAVE_LAYOUTS`, not a branch to `plan_reshard`. Built by `save_layout` from the spec alone."""

    spec: object

    @staticmethod
    def holds(spec) -> bool:
        """Whether `spec` is a save of this kind (asked of the kinds in `SAVE_LAYOUTS`' order)."""

    def ownership(self, target: Topology, workers: int) -> Ownership:
        """The source and target ranks, blocked over `workers` (when the job does not place them)."""

    def spaces(self, target: Topology, ownership: Ownership, budget_bytes: int, tabulated: bool = False
               ) -> tuple:
        """Every space of this save at `target` (SpacePlan or ChunkedSpacePlan), in the order they move, their
        rounds numbered on."""


@dataclass(frozen=True)
class PipelineSave:
    """A PipelineModule save (spec.columns): its columns re-cut over the target dp
    (`plan_pipeline_columns`), re-assigned to the target stages (`plan_pipeline_stage_change`) or, at
    another tp, re-sliced with the layer files as module tensors (`plan_pipeline_model_axis`); with tp kept,
    the layer files a node-local job writes as plan items too (`plan_kept_layer_files`)."""

    spec: object

    @staticmethod
    def holds(spec) -> bool:
        return getattr(spec, "columns", None) is not None  # planners' stand-ins have no columns

    def ownership(self, target: Topology, workers: int) -> Ownership:
        return Ownership.between(self.spec.topology, target, workers)

    def spaces(self, target: Topology, ownership: Ownership, budget_bytes: int, tabulated: bool = False
               ) -> tuple:
        spec = self.spec
        if target.tp != spec.topology.tp:
            return plan_pipeline_model_axis(spec, target, ownership, budget_bytes)
        if target.pp != spec.topology.pp:
            optim = plan_pipeline_stage_change(spec, target, ownership, budget_bytes)
        else:
            optim = plan_pipeline_columns(spec, target, ownership, budget_bytes)
        return (optim, *plan_kept_layer_files(spec, target, ownership, budget_bytes, optim))


@dataclass(frozen=True)
class Zero0ExpertSave:
    """A ZeRO-0 MoE save (formats/deepspeed_files/deepspeed_zero0_moe.Zero0MoeSpec, stage 0): whole parameters, one
    buffer each, in its `spaces` (`plan_zero0_moe`). Source ranks are its EP ranks, target ranks the
    target's plus the model-states file's copy of EP rank 0's optimizer; or, with `copies`, target rank t
    writes file `copies[t]` of those (a node-local job: every node's copy of the files its ranks load)."""

    spec: object
    copies: tuple[int, ...] | None = None

    @staticmethod
    def holds(spec) -> bool:
        return getattr(spec, "stage", None) == 0

    def target_ranks(self, target: Topology) -> int:
        return target.ep + 1 if self.copies is None else len(self.copies)

    def ownership(self, target: Topology, workers: int) -> Ownership:
        return Ownership(self.spec.topology.ep, self.target_ranks(target), workers)

    def spaces(self, target: Topology, ownership: Ownership, budget_bytes: int, tabulated: bool = False
               ) -> tuple:
        spec, spaces, offset = self.spec, [], 0
        for space in spec.spaces:
            old, new, sizes = zero0_pieces(space.numels, spec.orders, spec.group_lengths, spec.topology.ep,
                                           target.ep, self.copies)
            # a dense parameter's states go from one reader to every target rank at one buffer position:
            # windows sized for that reader's sends keep its copies in one round, so they are read once
            spaces.append(plan_space(space.name, old, new, space.streams, sizes, ownership, budget_bytes,
                                     round_offset=offset, receiving_ranks=self.target_ranks(target)))
            offset += spaces[-1].rounds
        return tuple(spaces)


@dataclass(frozen=True)
class TensorParallelSave:
    """An AutoTP save (spec.tensor), with AutoEP experts folded in or not: planned over the global
    parameters (`plan_tensor_parallel_spaces`)."""

    spec: object

    @staticmethod
    def holds(spec) -> bool:
        return spec.tensor is not None

    def ownership(self, target: Topology, workers: int) -> Ownership:
        return Ownership.between(self.spec.topology, target, workers)

    def spaces(self, target: Topology, ownership: Ownership, budget_bytes: int, tabulated: bool = False
               ) -> tuple:
        return plan_tensor_parallel_spaces(self.spec, target, ownership, budget_bytes)


@dataclass(frozen=True)
class DataParallelSave:
    """A ZeRO-1/2/3 save over dp ranks (native MoE and AutoEP experts included): the optimizer space, then
    under ZeRO-3 the partitioned frozen parameters; ZeRO-3 evenly chunked and planned by arithmetic
    (`reshard.planning.chunked_plan`) unless `tabulated` or with experts."""

    spec: object

    @staticmethod
    def holds(spec) -> bool:
        return True

    def ownership(self, target: Topology, workers: int) -> Ownership:
        return Ownership.between(self.spec.topology, target, workers)

    def spaces(self, target: Topology, ownership: Ownership, budget_bytes: int, tabulated: bool = False
               ) -> tuple:
        spec = self.spec
        old, new = spec.layout(spec.topology), spec.layout(target)
        if spec.stage == 3 and not tabulated and spec.experts is None:  # AutoEP ZeRO-3: from its piece tables
            bases = logical_bases([p.numel for p in spec.params])
            spaces = [plan_chunked_space("optim", ChunkedSide.of_zero3(old), ChunkedSide.of_zero3(new),
                                         spec.streams, bases, ownership, budget_bytes)]
        else:
            spaces = [plan_space("optim", old.pieces, new.pieces, spec.streams, buffer_numels(new), ownership,
                                 budget_bytes)]
        if spec.frozen and tabulated:
            (old_frozen, _), (new_frozen, chunks) = (spec.frozen_layout(spec.topology.dp),
                                                     spec.frozen_layout(target.dp))
            spaces.append(plan_space("frozen", old_frozen, new_frozen, spec.frozen_streams, chunks, ownership,
                                     budget_bytes, round_offset=spaces[0].rounds))
        elif spec.frozen:
            numels = [p.numel for p in spec.frozen]
            spaces.append(plan_chunked_space("frozen", ChunkedSide.of_frozen(numels, spec.topology.dp),
                                             ChunkedSide.of_frozen(numels, target.dp), spec.frozen_streams,
                                             logical_bases(numels), ownership, budget_bytes,
                                             round_offset=spaces[0].rounds))
        return tuple(spaces)


SAVE_LAYOUTS: tuple[type[SaveLayout], ...] = (PipelineSave, Zero0ExpertSave, TensorParallelSave, DataParallelSave)
"""Every kind of save the planner lays out, asked in this order (`holds`); the last holds any spec."""


def save_layout(spec) -> SaveLayout:
    """The layout of `spec`'s kind of save (the first of `SAVE_LAYOUTS` that holds it)."""
    return next(kind(spec) for kind in SAVE_LAYOUTS if kind.holds(spec))


@dataclass(frozen=True)
class _DenseView:
    """The dense family of a folded layout, shaped as `zero12_pieces` reads a layout."""

    params: tuple
    pieces: PieceTable


def _folded_pieces(spec, topology: Topology, space: GlobalSpace, side: str) -> PieceTable:
    """Pieces of an AutoEP checkpoint with AutoTP layers at `topology` (folded when tp > 1,
    `reshard.topology`): the dense parameters over the global tensors of `space` (TP shards
    lowered per TP rank, `reshard.layouts.tensor_pieces`), then every expert slice once, after them.
    Ranks are global; buffers are the param groups of the optim-states files."""
    layouts = [spec.layout(topology, topology.tp, t) for t in range(topology.tp)]
    dense = zero12_pieces(spec.tensor.params, space, topology,
                          lambda t: _DenseView(layouts[t].dense_params, layouts[t].dense_pieces), side)
    experts = layouts[0].expert_pieces  # experts are whole on every TP rank: global ranks already
    columns = [(dense.start, dense.rank, dense.buffer, dense.offset, *dense.stride_columns()),
               (experts.start + space.total, experts.rank, experts.buffer, experts.offset,
                *experts.stride_columns())]
    if not dense.strided:
        columns = [c[:4] for c in columns]
    return table_from_columns(columns, space.total + experts.total)


def plan_folded_optim_space(spec, target: Topology, space: GlobalSpace, ownership: Ownership, budget_bytes: int):
    """The optimizer space of AutoEP with AutoTP layers: dense and expert families side by side."""
    sizes = np.max([buffer_numels(spec.layout(target, target.tp, t)) for t in range(target.tp)], axis=0)
    return plan_space("optim", _folded_pieces(spec, spec.topology, space, "source"),
                      _folded_pieces(spec, target, space, "target"), spec.streams, tuple(int(n) for n in sizes),
                      ownership, budget_bytes)


def plan_tensor_parallel_spaces(spec, target: Topology, ownership: Ownership, budget_bytes: int) -> tuple:
    """AutoTP: the optimizer space over global parameters (TP shards resliced and DP partitions
    recut in one plan), then the module tensors of the ZeRO-1/2 model-states files, or the
    ZeRO-3 frozen fragments."""
    params, source = spec.tensor.params, spec.topology
    space = GlobalSpace.of(params, source_tp=source.tp, target_tp=target.tp)
    if spec.experts is not None:
        spaces = [plan_folded_optim_space(spec, target, space, ownership, budget_bytes)]
    else:
        old_layouts = shared_layouts(params, space, "source", source.tp,
                                     lambda t: spec.layout(source.dp, source.tp, t))
        new_layouts = shared_layouts(params, space, "target", target.tp,
                                     lambda t: spec.layout(target.dp, target.tp, t))
        sizes = np.max([buffer_numels(layout) for layout in {id(x): x for x in new_layouts}.values()], axis=0)
        spaces = [plan_space("optim", zero12_pieces(params, space, source, old_layouts.__getitem__, "source"),
                             zero12_pieces(params, space, target, new_layouts.__getitem__, "target"), spec.streams,
                             tuple(int(n) for n in sizes), ownership, budget_bytes)]
        del old_layouts, new_layouts
    module = spec.tensor.module
    if module.names:
        # the module tensors are usually the trainable parameters themselves: one grid for both
        module_space = space if module == params else GlobalSpace.of(module, source_tp=source.tp,
                                                                      target_tp=target.tp)
        targets = module_pieces(module, module_space, target, "target")
        # only dp rank 0 of each TP rank holds module tensors: windows sized for those ranks
        holders = np.bincount(ownership.writers(sorted_distinct(targets.rank)), minlength=ownership.workers)
        spaces.append(plan_space("module", module_pieces(module, module_space, source, "source"), targets,
                                 spec.module_streams, module_buffer_numels(module, module_space, target.tp),
                                 ownership, budget_bytes, round_offset=spaces[0].rounds,
                                 receiving_ranks=int(holders.max())))
    if spec.frozen:  # ZeRO-3 only
        frozen_space = GlobalSpace.of(replicated(spec.frozen), source_tp=source.tp, target_tp=target.tp)
        spaces.append(plan_space("frozen", zero3_frozen_pieces(spec.frozen, frozen_space, source, "source"),
                                 zero3_frozen_pieces(spec.frozen, frozen_space, target, "target"),
                                 spec.frozen_streams, tuple(zero3_chunk(p.numel, target.dp) for p in spec.frozen),
                                 ownership, budget_bytes, round_offset=spaces[-1].rounds + spaces[-1].round_offset))
    return tuple(spaces)


def pipeline_column_pieces(spec, topology: Topology) -> PieceTable:
    """The pieces of a pipeline save (spec.columns) at `topology` (its tp and pp): each column's ZeRO-1
    pieces at topology.dp, offset by the column's base in the space (its parameters come after the
    columns before it), on the global ranks of (dp rank, model rank, stage)."""
    columns, base = [], 0
    for column, (params, _) in enumerate(spec.columns):
        stage, model = divmod(column, topology.tp)
        pieces = spec.layout(topology.dp, topology.tp, model, stage).pieces
        ranks = np.array([topology.rank_of(d, model, stage) for d in range(topology.dp)], dtype=np.int64)
        columns.append((pieces.start + base, ranks[pieces.rank], pieces.buffer, pieces.offset))
        base += sum(p.numel for p in params)
    return table_from_columns(columns, base)


def plan_pipeline_columns(spec, target: Topology, ownership: Ownership, budget_bytes: int):
    """A PipelineModule save with its stages and model ranks kept: one optimizer space over every
    column's parameters, each column re-cut over the target dp as the ZeRO-1 save it is
    (docs/architecture.md, "One road")."""
    return plan_space("optim", pipeline_column_pieces(spec, spec.topology), pipeline_column_pieces(spec, target),
                      spec.streams, _widest_column_buffers(spec, target), ownership, budget_bytes)


def plan_pipeline_stage_change(spec, target: Topology, ownership: Ownership, budget_bytes: int):
    """A PipelineModule save resharded to another number of stages, tp kept (target.stages: the target
    stages' columns): one optimizer space over the target columns (pipeline_stage_change_pieces)."""
    old, new = pipeline_stage_change_pieces(spec.columns, target.stages.columns, spec.topology, target)
    return plan_space("optim", old, new, spec.streams, _widest_column_buffers(spec, target), ownership, budget_bytes)


def plan_pipeline_model_axis(spec, target: Topology, ownership: Ownership, budget_bytes: int) -> tuple:
    """A PipelineModule save resharded to another tp, its stages kept or re-assigned (target.stages: its columns
    at the target's local shapes; target.layer_files, re-cut: each parameter's split, the layer files' tensors): one
    optimizer space over the target stages' global parameters (tensor_pieces.pipeline_model_axis_pieces),
    then each dtype's layer-file tensors as module tensors, re-cut for the target's model ranks
    (`module_pieces` of each tensor's stage: dp rank 0 of each (stage, model rank) holds them)."""
    axis, copies = target.layer_files.axis, target.layer_files.copies
    old, new = pipeline_model_axis_pieces(spec.columns, target.stages.columns, axis.splits, axis.shapes,
                                          spec.topology, target)
    spaces = [plan_space("optim", old, new, spec.streams, _widest_column_buffers(spec, target), ownership,
                         budget_bytes)]
    del old, new
    for layer in axis.layer_spaces:
        sizes = module_buffer_numels(layer.tensors, GlobalSpace.of(layer.tensors, source_tp=spec.topology.tp,
                                                                   target_tp=target.tp), target.tp)
        old, new = every_copy_pieces(layer_copy_pieces, layer, spec.topology, target, copies)
        holders = np.bincount(ownership.writers(sorted_distinct(new.rank)), minlength=ownership.workers)
        spaces.append(plan_space(layer.name, old, new, (layer.stream,), sizes, ownership, budget_bytes,
                                 round_offset=spaces[-1].round_offset + spaces[-1].rounds,
                                 receiving_ranks=int(holders.max())))
    return tuple(spaces)


def plan_kept_layer_files(spec, target: Topology, ownership: Ownership, budget_bytes: int, after) -> list:
    """A PipelineModule save with tp kept whose layer files are tensors of the plan (target.layer_files, whole:
    a node-local job): each dtype's layer-file tensors, each model rank's whole, moved after the space `after`,
    for dp rank 0 of each column and every extra copy (`LayerFiles.copies`) in one space (`every_copy_pieces`)."""
    spaces, layer_files = [after], target.layer_files
    for layer in layer_files.axis.layer_spaces if layer_files is not None else ():
        sizes = tuple(int(np.prod(shape, dtype=np.int64)) for shape in layer.tensors.shapes)
        old, new = every_copy_pieces(kept_layer_pieces, layer, spec.topology, target, layer_files.copies)
        holders = np.bincount(ownership.writers(sorted_distinct(new.rank)), minlength=ownership.workers)
        spaces.append(plan_space(layer.name, old, new, (layer.stream,), sizes, ownership, budget_bytes,
                                 round_offset=spaces[-1].round_offset + spaces[-1].rounds,
                                 receiving_ranks=int(holders.max()) if len(new.rank) else 1))
    return spaces[1:]


def every_copy_pieces(copy_pieces, layer, source: Topology, target: Topology,
                      copies: Sequence[Sequence[int]]) -> tuple[PieceTable, PieceTable]:
    """(source pieces, target pieces) of every copy of a pipeline's layer files of one dtype in one space:
    `copy_pieces(layer, source, target, copy)` (`layer_copy_pieces` or `kept_layer_pieces`) of dp rank 0's
    copy, then of each of `copies` (topology.LayerFiles.copies), their logical spaces laid end to end. Every
    copy of a tensor maps to the same source elements and fills the same buffer (tensor j is buffer j) on its
    ranks, so it falls in the same round window: the reader packs those elements once and copies them for
    the other copies (transport/read_once.py), as GlobalSpace's replicated parameters are served to every
    target TP rank, and each source byte is read once however many nodes get the files. Pure."""
    pairs = [copy_pieces(layer, source, target, copy) for copy in (None, *copies)]
    return joined_pieces([old for old, _ in pairs]), joined_pieces([new for _, new in pairs])


def joined_pieces(tables: Sequence[PieceTable]) -> PieceTable:
    """The piece tables laid end to end in one logical space (table k's pieces after those of the tables
    before it), strided columns kept where any table has them. Pure."""
    strided, base, columns = any(t.strided for t in tables), 0, []
    for table in tables:
        columns.append((table.start + base, table.rank, table.buffer, table.offset,
                        *(table.stride_columns() if strided else ())))
        base += table.total
    return table_from_columns(columns, base)


def kept_layer_pieces(layer, source: Topology, target: Topology, copy: Sequence[int] | None = None
                      ) -> tuple[PieceTable, PieceTable]:
    """(source pieces, target pieces) of one copy of a pipeline's layer files of one dtype with tp kept
    (reshard.layouts.model_axis.LayerFileSpace, every tensor whole): model rank t's tensor j is buffer j of
    (dp rank 0, model rank t, its source stage) and is written whole into buffer j of (dp rank 0, model rank t,
    its target stage), or of `copy`'s writer of that column (as `layer_copy_pieces`). The space is the model
    ranks one after the other, each its tensors end to end; a tensor without elements has no piece. Pure."""
    numels = np.asarray([int(np.prod(shape, dtype=np.int64)) for shape in layer.tensors.shapes], np.int64)
    stages, sources = np.asarray(layer.target_stages, np.int64), np.asarray(layer.source_stages, np.int64)
    kept = np.flatnonzero(numels > 0)
    if copy is not None:
        columns = np.asarray(copy, np.int64).reshape(target.pp, target.tp)
        kept = kept[(columns >= 0).any(axis=1)[stages[kept]]]
    bases = np.asarray(logical_bases(numels[kept].tolist()), np.int64)
    each = int(numels[kept].sum())
    writer = np.arange(target.world_size, dtype=np.int64)
    for column, rank in enumerate(copy or ()):
        stage, model = divmod(column, target.tp)
        if rank >= 0:
            writer[target.rank_of(0, model, stage)] = rank
    old, new = [], []
    zeros = np.zeros(len(kept), np.int64)
    for t in range(source.tp):
        start = bases + t * each
        old.append((start, np.asarray([source.rank_of(0, t, int(s)) for s in sources[kept]], np.int64), kept, zeros))
        new.append((start, writer[np.asarray([target.rank_of(0, t, int(s)) for s in stages[kept]], np.int64)], kept,
                    zeros))
    return table_from_columns(old, each * source.tp), table_from_columns(new, each * source.tp)


def layer_copy_pieces(layer, source: Topology, target: Topology, copy: Sequence[int] | None = None
                      ) -> tuple[PieceTable, PieceTable]:
    """(source pieces, target pieces) of one copy of a pipeline's layer files of one dtype
    (reshard.layouts.model_axis.LayerFileSpace) re-cut for `target`'s model ranks: `copy` None, the files
    of dp rank 0 of each (stage, model rank) (`module_pieces`); else per target column (stage * tp + model
    rank) the rank writing another copy of its files, -1 where its stage has none (topology.LayerFiles.copies:
    a node-local job writes a column's layer files on each node whose ranks load them). A copy covers the
    tensors of the stages it writes, each tensor keeping its buffer number (tensor j is buffer j), so that
    the same file slots are filled on every rank that writes them. Pure."""
    stages = np.asarray(layer.target_stages, np.int64)
    if copy is None:
        kept = np.arange(len(stages))
    else:
        columns = np.asarray(copy, np.int64).reshape(target.pp, target.tp)
        kept = np.flatnonzero((columns >= 0).any(axis=1)[stages])
    tensors = layer.tensors
    if copy is not None:
        tensors = dataclasses.replace(tensors, names=tuple(tensors.names[j] for j in kept),
                                      shapes=tuple(tensors.shapes[j] for j in kept),
                                      splits=tuple(tensors.splits[j] for j in kept))
    space = GlobalSpace.of(tensors, source_tp=source.tp, target_tp=target.tp)
    old = module_pieces(tensors, space, source, "source", [layer.source_stages[j] for j in kept])
    new = module_pieces(tensors, space, target, "target", stages[kept])
    if copy is None:
        return old, new
    writer = np.arange(target.world_size, dtype=np.int64)  # dp rank 0 of a column -> its copy's writer
    for column, rank in enumerate(copy):
        stage, model = divmod(column, target.tp)
        if rank >= 0:
            writer[target.rank_of(0, model, stage)] = rank
    return (dataclasses.replace(old, buffer=kept[old.buffer]),
            dataclasses.replace(new, rank=writer[new.rank], buffer=kept[new.buffer]))


def _widest_column_buffers(spec, target: Topology) -> tuple[int, ...]:
    """Per flat buffer, the most elements any target rank's holds."""
    sizes = [buffer_numels(spec.layout(target, target.tp, model, stage))
             for stage in range(target.pp) for model in range(target.tp)]
    return tuple(int(max((s[b] for s in sizes if b < len(s)), default=0)) for b in range(max(map(len, sizes))))


def source_rank_count(spec) -> int:
    """The source ranks whose files an export's plan reads: every (dp rank, model rank, stage) of a
    pipeline save and every (dp rank, tp rank) of an AutoTP save (their global ranks, `Topology.rank_of`),
    the dp ranks of any other save it serves."""
    if getattr(spec, "columns", None) is not None or getattr(spec, "tensor", None) is not None:
        return spec.topology.world_size
    return spec.dp_world_size


def trainable_pieces(spec, params: tuple[ParamSpec, ...] | None = None, rule_of=None
                     ) -> tuple[tuple[ParamSpec, ...], PieceTable]:
    """(the trainable parameters of an export's space, each once and whole, and the source's pieces over
    them end to end): what every export reads (reshard.export: one global tensor per parameter).

        params, pieces = trainable_pieces(source.spec)                                  # a ZeRO save
        params, pieces = trainable_pieces(source.spec, export_params, rules.rule)       # a pipeline save

    A save without pipeline columns: its own parameters and layout. A PipelineModule save
    (spec.columns): `params` (every parameter, each once, by name, at its whole shape, in the export's
    order), its pieces from `pipeline_export_pieces`; `rule_of(name)` (a ModelAxisRule) says how a
    model axis cuts each parameter. `params` may be left out at tp 1 only (then the order the columns
    first hold them in, at their stage shapes)."""
    if getattr(spec, "columns", None) is None:
        return spec.params, spec.layout(spec.topology).pieces
    if params is None:  # tp 1: the order the columns first hold them in
        params = tuple({p.name: p for column_params, _ in spec.columns for p in column_params}.values())
    return tuple(params), pipeline_export_pieces(spec.columns, params, spec.topology, rule_of)


@dataclass(frozen=True)
class _WholeTensors:
    """An export's tensors laid whole end to end (row-major), shaped as `zero12_pieces` reads a layout."""

    params: tuple
    pieces: PieceTable


def tensor_parallel_export_pieces(spec, export_pieces: PieceTable, writers: int, kind: str = "optim"
                                  ) -> tuple[PieceTable, PieceTable]:
    """(source pieces, target pieces) of an AutoTP save (spec.tensor) for an export of one global tensor per
    parameter: each TP-sliced parameter joined whole, a replicated one read once, from TP rank 0. Pure.

        old, new = tensor_parallel_export_pieces(spec, layout.pieces("optim", [p.numel for p in spec.params]), files)

    `export_pieces`: where each element of the parameters (`kind` "optim": spec.params; "frozen": the ZeRO-3
    frozen ones, which AutoTP leaves whole) laid whole end to end in row-major order goes (rank: the output
    file, below `writers`). Both sides are lowered into the `GlobalSpace` at target tp 1, the space a reshard
    to tp 1 plans over (`plan_tensor_parallel_spaces`), which orders a row-parallel parameter strip by strip:
    the export's row-major pieces are lowered as a tp-1 rank's local space is."""
    source = spec.topology
    if kind == "optim":
        params, whole = spec.tensor.params, tuple(spec.params)
        space = GlobalSpace.of(params, source_tp=source.tp, target_tp=1)
        old = zero12_pieces(params, space, source, lambda t: spec.layout(source.dp, source.tp, t), "source")
    else:
        params, whole = replicated(spec.frozen), tuple(spec.frozen)
        space = GlobalSpace.of(params, source_tp=source.tp, target_tp=1)
        old = zero3_frozen_pieces(spec.frozen, space, source, "source")
    view = _WholeTensors(whole, export_pieces)
    return old, zero12_pieces(params, space, Topology(writers), lambda t: view, "target")


def folded_export_pieces(spec, export_pieces: PieceTable, writers: int) -> tuple[PieceTable, PieceTable]:
    """(source pieces, target pieces) of an AutoEP save with AutoTP layers (folded TP+EP, spec.tensor and
    spec.experts) for an export of one global tensor per parameter: the dense parameters joined whole over the
    TP ranks as `tensor_parallel_export_pieces` joins them, every expert slice read once (experts are whole on
    every TP rank). Pure.

        old, new = folded_export_pieces(spec, layout.pieces("optim", [p.numel for p in spec.params]), files)

    Both sides are laid over the space a reshard of the save plans over (`_folded_pieces`): the dense family
    lowered into the `GlobalSpace` at target tp 1, then the expert slices in spec.params' order. spec.params
    lists the dense parameters (spec.tensor.params, at their global shapes) first, so the export's row-major
    pieces of element D onwards (D: the dense elements) are already the expert family's, offset by D."""
    source, dense = spec.topology, spec.tensor.params
    space = GlobalSpace.of(dense, source_tp=source.tp, target_tp=1)
    count = len(dense.names)
    whole = tuple(spec.params[:count])
    if tuple(p.name for p in whole) != tuple(dense.names) or sum(p.numel for p in whole) != space.total:
        raise ValueError("a folded save's parameters do not list its dense parameters first, at their global shapes")
    in_dense = export_pieces.start < space.total
    view = _WholeTensors(whole, dataclasses.replace(export_pieces.select(in_dense), total=space.total))
    joined = zero12_pieces(dense, space, Topology(writers), lambda t: view, "target")
    experts = export_pieces.select(~in_dense)
    columns = [(joined.start, joined.rank, joined.buffer, joined.offset, *joined.stride_columns()),
               (experts.start, experts.rank, experts.buffer, experts.offset, *experts.stride_columns())]
    if not joined.strided:
        columns = [c[:4] for c in columns]
    return _folded_pieces(spec, source, space, "source"), table_from_columns(columns, export_pieces.total)


def pipeline_export_pieces(columns, params, topology: Topology, rule_of=None) -> PieceTable:
    """A PipelineModule save's pieces over `params` (its parameters, each once and whole, end to end in
    row-major order): what an export to one global tensor per parameter reads (docs/architecture.md,
    "One road"). Pure.

        pieces = pipeline_export_pieces(spec.columns, params, spec.topology, rules.rule)

    Each column (stage s, model rank m; mp index s * tp + m) is a ZeRO-1 save over its stage's local
    parameters (`columns`, CheckpointSpec.columns) at topology.dp. A parameter held by several stages
    (tied) is read from the first stage holding it (every stage's copy is equal: runtime/pipe/engine.py
    `_exec_reduce_tied_grads`), as `pipeline_stage_change_pieces` reads it. With a model axis (tp > 1)
    `rule_of(name)` (reshard.layouts.model_axis.ModelAxisRule) says how the model ranks cut it, as
    ds_to_universal.py `merge_tp_slices` joins them: a replicated (or averaged) tensor is read from model
    rank 0 alone (its copies are not read, so not compared: the whole-tensor road compared them); a
    tensor cut on dim d is, on each rank, prod(local[:d]) runs of prod(local[d:]) elements, run o of rank
    m at o * tp * run + m * run of the whole tensor (dim 0: one run per rank; a row-parallel weight:
    one per row); two fused sub-parameters on dim 0 are two runs per rank (`merge_tp_slices` joins the
    first halves of every rank, then the second). A piece is cut at every run and every ZeRO partition
    bound, so it is contiguous on both sides. ValueError when a parameter of `params` has no source, a
    stage holds one `params` lacks, or shapes disagree."""
    tp = topology.tp
    index = {p.name: i for i, p in enumerate(params)}
    bases = logical_bases([p.numel for p in params])
    total = int(sum(p.numel for p in params))
    read, found = set(), []
    for column, (column_params, groups) in enumerate(columns):
        stage, model = divmod(column, tp)
        pieces = zero12_layout(column_params, groups, topology.dp).pieces
        local_bases = logical_bases([p.numel for p in column_params])
        ranks = np.array([topology.rank_of(d, model, stage) for d in range(topology.dp)], dtype=np.int64)
        for pid, param in enumerate(column_params):
            if param.name not in index:
                raise ValueError(f"stage {stage} holds {param.name!r}, which the export does not name")
            rule = rule_of(param.name) if rule_of is not None and tp > 1 else None
            whole = rule is None or rule.whole
            key = param.name if whole else (param.name, model)
            if key in read or (whole and model != 0):
                continue  # a tied copy of a later stage, or a replicated copy of another model rank
            read.add(key)
            n, want = param.numel, params[index[param.name]]
            if want.numel != n * (1 if whole else tp):
                raise ValueError(f"{param.name!r}: shape {tuple(param.shape)} on model rank {model} of stage {stage}, "
                                 f"{tuple(want.shape)} whole")
            if whole:
                outer = 1
            elif rule.kind == "two-sub-params":
                outer = 2
            else:
                outer = int(np.prod(param.shape[:rule.dim], dtype=np.int64))
            run = n // outer if outer else 0
            if not n:
                continue
            lo = local_bases[pid]
            inside = pieces.start[(pieces.start > lo) & (pieces.start < lo + n)] - lo
            cuts = sorted_distinct(np.concatenate((np.arange(outer, dtype=np.int64) * run, inside)))
            at = np.searchsorted(pieces.start, cuts + lo, side="right") - 1
            o = cuts // run
            start = bases[index[param.name]] + o * (1 if whole else tp) * run + (0 if whole else model * run) \
                + cuts - o * run
            found.append((start, ranks[pieces.rank[at]], pieces.buffer[at], pieces.offset[at] + cuts + lo -
                          pieces.start[at]))
    missing = [p.name for p in params if p.name not in read and not any((p.name, m) in read for m in range(tp))]
    partial = sorted({name for name, m in (k for k in read if isinstance(k, tuple))
                      if sum((name, r) in read for r in range(tp)) != tp})
    if missing or partial:
        raise ValueError(f"no stage holds {(missing or partial)[:3]} (on every model rank)")
    return table_from_columns(found, total)


def pipeline_stage_change_pieces(source_columns, target_columns, source: Topology, target: Topology
                                 ) -> tuple[PieceTable, PieceTable]:
    """(source pieces, target pieces) of a PipelineModule save whose stage count changes, tp kept
    (docs/architecture.md, "One road": a pp change only changes which parameters a column holds).

        old, new = pipeline_stage_change_pieces(source.spec.columns, target_columns, source_topology, target)
        segments = intersect(old, new)

    `*_columns`: per column (mp index stage * tp + model rank) its (params, groups), a ZeRO-1 save over
    its stage's parameters (CheckpointSpec.columns); a target's come from the target layer partition
    (layouts/pipeline.StageAssignment), each parameter by its global name. The space is the target
    columns end to end, so the target pieces are each column's ZeRO-1 pieces at target.dp offset by its
    base (`pipeline_column_pieces`); each parameter's source pieces, cut at its bounds in its source
    column's flat, are placed at every copy the target columns hold of it. A tied parameter (held by
    several stages) is a replicated piece: read from the first source stage holding it (every stage's
    copy is equal: runtime/pipe/engine.py `_exec_reduce_tied_grads` all-reduces tied gradients over the
    stages holding them) and written into every target column holding it, as `GlobalSpace` reads a
    replicated TP parameter from source TP rank 0 once per target copy. ValueError when a target
    parameter has no source, a source parameter no target, or a shape differs (tp is kept)."""
    if source.tp != target.tp:
        raise ValueError(f"a stage change keeps tp: source tp {source.tp}, target tp {target.tp}")
    tp = target.tp
    copies, target_bases, base = {}, [], 0  # (model rank, name) -> [(space start, shape)]
    for column, (params, _) in enumerate(target_columns):
        target_bases.append(base)
        for param in params:
            copies.setdefault((column % tp, param.name), []).append((base, param.shape))
            base += param.numel
    total, read = base, set()
    columns = []
    for column, (params, groups) in enumerate(source_columns):
        stage, model = divmod(column, tp)
        pieces = zero12_layout(params, groups, source.dp).pieces
        param_bases = logical_bases([p.numel for p in params])
        cuts = sorted_distinct(np.concatenate((pieces.start, np.asarray(param_bases, np.int64))))
        cuts = cuts[cuts < pieces.total]
        i = np.searchsorted(pieces.start, cuts, side="right") - 1
        p = np.searchsorted(param_bases, cuts, side="right") - 1
        ranks = np.array([source.rank_of(d, model, stage) for d in range(source.dp)], dtype=np.int64)
        for pid, param in enumerate(params):
            key = (model, param.name)
            if key not in copies:
                raise ValueError(f"source stage {stage} holds {param.name!r}, which no target stage holds "
                                 "(another layer list?)")
            if key in read:  # a tied parameter: its first source stage's copy is read
                continue
            read.add(key)
            here = np.flatnonzero(p == pid)
            for start, shape in copies[key]:
                if tuple(shape) != tuple(param.shape):
                    raise ValueError(f"{param.name!r}: shape {tuple(param.shape)} at source stage {stage}, "
                                     f"{tuple(shape)} at the target (tp is kept)")
                columns.append((start + cuts[here] - param_bases[pid], ranks[pieces.rank[i[here]]],
                                pieces.buffer[i[here]], pieces.offset[i[here]] + cuts[here] - pieces.start[i[here]]))
    missing = sorted({name for (_, name) in copies} - {name for (_, name) in read})
    if missing:
        raise ValueError(f"the target stages hold {missing[:3]}, which no source stage holds (another layer list?)")
    target_pieces = []
    for column, (params, groups) in enumerate(target_columns):
        stage, model = divmod(column, tp)
        pieces = zero12_layout(params, groups, target.dp).pieces
        ranks = np.array([target.rank_of(d, model, stage) for d in range(target.dp)], dtype=np.int64)
        target_pieces.append((pieces.start + target_bases[column], ranks[pieces.rank], pieces.buffer, pieces.offset))
    return table_from_columns(columns, total), table_from_columns(target_pieces, total)


def plan_zero0_moe(spec, target: Topology, workers: int, budget_bytes: int,
                   ownership: Ownership | None = None, copies: tuple[int, ...] | None = None) -> ReshardPlan:
    """A ZeRO-0 MoE save (formats/deepspeed_files/deepspeed_zero0_moe.Zero0MoeSpec) at `target`'s ep: one space per
    kind of per-parameter tensor (`spec.spaces`: states, 0-d states, fp32 masters), each parameter a
    whole buffer (layouts/zero0_expert_groups.zero0_pieces); the plan its layout gives
    (`Zero0ExpertSave`). Source ranks are the source's EP ranks (their `expp_rank_{e}` files), target
    ranks the target's plus one for the model-states file's copy of EP rank 0's optimizer; dp does not
    place anything at stage 0. `copies`: `Zero0ExpertSave.copies`."""
    return plan_layout(Zero0ExpertSave(spec, copies), target, workers, budget_bytes, ownership=ownership)
