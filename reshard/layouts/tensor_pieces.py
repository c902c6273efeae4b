"""Piece tables of tensor-parallel ZeRO checkpoints over one global space. Pure, no torch.

    from reshard.layouts.tensor_pieces import GlobalSpace, zero12_pieces
    space = GlobalSpace.of(spec.tensor.params, source_tp=spec.topology.tp, target_tp=1)
    source = zero12_pieces(spec.tensor.params, space, spec.topology, lambda t: spec.layout(2, 2, t), "source")
    frozen = zero3_frozen_pieces(spec.frozen, GlobalSpace.of(replicated(spec.frozen), source_tp=2, target_tp=1),
                                 spec.topology, "source")

The logical space is the GLOBAL (unsharded) parameters laid end to end, so the 1-D core
(`reshard.planning.plan`) intersects a source and a target of any (tp, dp). Each parameter is
row-major, except one split inside its rows (row-parallel): that one is taken strip by strip
between both sides' shard boundaries, so a ZeRO range of a shard is one strided piece per
strip, not one piece per row (`reshard.layouts.local_to_global`); the space is built for one pair of
TP sizes. A replicated parameter is held by every TP rank: the space gives it one copy per
TARGET TP rank (copy t is what target TP rank t writes); on the source side every copy is
mapped to the bytes of source TP rank 0 (the other source TP ranks' copies are not read). The
exchange reads those bytes once and serves the other copies from its send buffers (same or
previous round, `reshard.transport.read_once`); copies more than a round apart read them again.

Each (dp, tp) rank's pieces come from the ZeRO rules over its TP-local shapes and the dp
size (`reshard.layouts.zero`), then are lowered from the rank's local space to the global one
(`reshard.layouts.local_to_global`); a piece's rank is the global rank, tp fastest
(`reshard.topology`). A fused sub-parameter split (several boxes of the global parameter per
local tensor) is lowered box by box, one run per row (`local_to_global.globalize_boxes`,
pieces cut where the local tensor passes from one sub-parameter's piece to the next). The
same holds under ZeRO-3 (`reshard.layouts.zero.Zero3Layout`: each TP rank's local parameters
chunked over its dp group, engine.py `_get_zero_ckpt_name` names the file by (dp, tp)), and
for its partitioned frozen parameters (`frozen_param_fragments`), which AutoTP leaves whole:
each TP rank holds the same chunks, read from source TP rank 0. Module tensors (the split lp
weights of the ZeRO-1/2 model-states files, one file per TP rank, written by its dp rank 0)
form a second space the same way: buffer j of a rank is its local tensor j. DeepSpeed saves
them as views of each param group's flat lp buffer, whose order and padding depend on the
TP-local shapes, so every trainable module tensor (replicated ones too) gets its own storage
in the target files.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import numpy as np

from reshard.layouts.zero import ParamSpec, PieceTable, Zero3Layout, Zero12Layout, frozen_pieces, logical_bases, \
    table_from_columns, zero12_layout
from reshard.layouts.tensor_parallel import REPLICATED, TensorParallelParams, TensorSplit, numel
from reshard.layouts.local_to_global import ShardGrid, globalize, globalize_boxes
from reshard.layouts.strided_runs import CONTIGUOUS
from reshard.topology import Topology


@dataclass(frozen=True, eq=False)
class GlobalSpace:
    """Global parameters end to end; a replicated parameter once per target TP rank; each
    parameter in the order `reshard.layouts.local_to_global` gives it for these two TP sizes."""

    numels: np.ndarray
    copies: np.ndarray
    bases: np.ndarray
    """Start of copy 0 of each parameter; copy c starts at bases + c * numels."""
    total: int
    grid: ShardGrid
    replicated: np.ndarray
    """[P] held whole by every TP rank."""
    fused: np.ndarray
    """[P] a sub-parameter split: lowered box by box (`globalize_boxes`), row-major, not by the grid."""

    @classmethod
    def of(cls, params: TensorParallelParams, *, source_tp: int, target_tp: int) -> "GlobalSpace":
        fused = np.asarray([split.view is not None for split in params.splits], dtype=bool)
        grid = ShardGrid.of(params.shapes, [None if f else split.dim for split, f in zip(params.splits, fused)],
                            source_tp, target_tp, params.grain)
        numels = grid.numels
        replicated = np.asarray([split.dim is None for split in params.splits], dtype=bool)
        copies = np.where(replicated, target_tp, 1).astype(np.int64)
        sizes = numels * copies
        return cls(numels, copies, logical_bases(sizes), int(sizes.sum()), grid, replicated, fused)

    def copies_from(self, side: str, tp_rank: int) -> tuple[np.ndarray, np.ndarray]:
        """(first copy's start, number of copies) each parameter of `side`'s TP rank `tp_rank` fills.

        Split parameters fill their one copy; a replicated parameter fills copy t on target TP rank
        t, and every copy from source TP rank 0 (the other source TP ranks' copies are not read)."""
        base, count = self.bases, np.ones(len(self.bases), np.int64)
        if side == "target":
            base = np.where(self.replicated, self.bases + tp_rank * self.numels, self.bases)
        else:
            count = np.where(self.replicated, self.copies if tp_rank == 0 else 0, 1)
        return base, count

    def local_numels(self, params: TensorParallelParams, side: str, tp: int, tp_rank: int) -> np.ndarray:
        """[P] elements of each parameter on `side`'s TP rank `tp_rank` of `tp`."""
        numels = self.grid.local_numels(side, tp_rank)
        for p in np.flatnonzero(self.fused).tolist():
            numels[p] = numel(params.local_shape(p, tp, tp_rank))
        return numels

    def table(self, columns) -> PieceTable:
        """A piece table of 7 columns (start, rank, buffer, offset, col, width, stride); the
        stride columns are kept only when some parameter is strided (otherwise every piece is
        contiguous, the plain 1-D case)."""
        if not self.grid.strided.any():
            columns = [c[:4] for c in columns]
        return table_from_columns(columns, self.total)


def _fused_placements(params: TensorParallelParams, space: GlobalSpace, side: str, tp: int, tp_rank: int,
                      local_bases: np.ndarray) -> tuple[np.ndarray, list]:
    """The local space of the fused parameters cut into pieces each one box of a global parameter:
    their local starts and their `globalize_boxes` placements."""
    base, count = space.copies_from(side, tp_rank)
    starts, placements = [], []
    for p in np.flatnonzero(space.fused).tolist():
        copies = [int(base[p]) + c * int(space.numels[p]) for c in range(int(count[p]))]
        for offset, box, shape in params.local_pieces(p, tp, tp_rank):
            starts.append(int(local_bases[p]) + offset)
            placements.append((box, shape, copies))
    return np.asarray(starts, dtype=np.int64), placements


def _cut_at(cuts: np.ndarray, start, rank, buffer, offset, length) -> tuple[np.ndarray, ...]:
    """ZeRO pieces (start, rank, buffer, offset, length) of a local space, cut wherever one of
    the sorted local positions `cuts` falls strictly inside one, so each lies in one box."""
    start, rank, buffer, offset, length = (np.asarray(c, dtype=np.int64) for c in (start, rank, buffer, offset, length))
    end = start + length
    first = np.searchsorted(cuts, start, side="right")       # the first cut after each start
    inner = np.searchsorted(cuts, end, side="left") - first  # cuts strictly inside each piece
    if not inner.any():
        return start, rank, buffer, offset, length
    counts = inner + 1
    item = np.repeat(np.arange(len(start)), counts)
    k = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    top = max(len(cuts) - 1, 0)
    left = np.where(k == 0, start[item], cuts[np.minimum(first[item] + k - 1, top)])
    right = np.where(k == counts[item] - 1, end[item], cuts[np.minimum(first[item] + k, top)])
    return left, rank[item], buffer[item], offset[item] + left - start[item], right - left


def _lower(params: TensorParallelParams, space: GlobalSpace, side: str, tp: int, tp_rank: int, local_bases,
           start, rank, buffer, offset, length, param=None) -> tuple[np.ndarray, ...]:
    """`globalize` the pieces of one TP rank's local space (its parameters end to end at
    `local_bases`), each inside one parameter; fused parameters box by box. `param`: each
    piece's local parameter, when known."""
    start, rank, buffer, offset, length = (np.asarray(c, dtype=np.int64) for c in (start, rank, buffer, offset, length))
    base, count = space.copies_from(side, tp_rank)
    columns = [globalize(start, rank, buffer, offset, length, local_bases, space.grid, side, tp_rank, base,
                         np.where(space.fused, 0, count), param)]
    if space.fused.any():
        mine = space.fused[np.searchsorted(local_bases, start, side="right") - 1]
        box_starts, placements = _fused_placements(params, space, side, tp, tp_rank, local_bases)
        cut = _cut_at(box_starts, start[mine], rank[mine], buffer[mine], offset[mine], length[mine])
        s, r, b, o = globalize_boxes(*cut, box_starts, placements)
        columns.append((s, r, b, o, np.zeros(len(s), np.int64), np.full(len(s), CONTIGUOUS, np.int64),
                        np.full(len(s), CONTIGUOUS, np.int64)))
    if len(columns) == 1:  # no fused parameters: the columns as they are, not a copy
        return columns[0]
    return tuple(np.concatenate(c) for c in zip(*columns))


def shared_layouts(params: TensorParallelParams, space: GlobalSpace, side: str, tp: int,
                   layout_of: Callable[[int], Zero12Layout | Zero3Layout]) -> list:
    """`layout_of(t)` for every TP rank t of `side`, built once per distinct set of local shapes
    (TP ranks of even shards share one layout: it depends on the local shapes only)."""
    built: dict = {}
    layouts = []
    for t in range(tp):
        key = space.local_numels(params, side, tp, t).tobytes()
        if key not in built:
            built[key] = layout_of(t)
        layouts.append(built[key])
    return layouts


def zero12_pieces(params: TensorParallelParams, space: GlobalSpace, topology: Topology,
                  layout_of: Callable[[int], Zero12Layout | Zero3Layout], side: str) -> PieceTable:
    """Pieces of every (dp, tp) rank of `topology` over `space`; `layout_of(t)` is TP rank t's
    ZeRO layout (stage 1/2, or 3) over its local shapes at `topology.dp` ranks (asked once per
    distinct layout)."""
    columns, local = [], {}
    for t, layout in enumerate(shared_layouts(params, space, side, topology.tp, layout_of)):
        if id(layout) not in local:  # TP ranks of one layout share its pieces and their parameters
            pieces, local_bases = layout.pieces, logical_bases([p.numel for p in layout.params])
            local[id(layout)] = (pieces, local_bases, pieces.length,
                                 np.searchsorted(local_bases, pieces.start, side="right") - 1)
        pieces, local_bases, length, param = local[id(layout)]
        start, dp_rank, buffer, offset, *strides = _lower(params, space, side, topology.tp, t, local_bases,
                                                          pieces.start, pieces.rank, pieces.buffer, pieces.offset,
                                                          length, param)
        columns.append((start, dp_rank * topology.tp + t, buffer, offset, *strides))
    return space.table(columns)


@dataclass(frozen=True)
class _FrozenChunks:
    """ZeRO-3 frozen parameters at one dp size, shaped as `zero12_pieces` reads a layout."""

    params: tuple[ParamSpec, ...]
    pieces: PieceTable


def replicated(frozen: tuple[ParamSpec, ...]) -> TensorParallelParams:
    """Frozen parameters as AutoTP leaves them (whole on every TP rank; split ones are refused
    at inspect, `deepspeed_tensor.tensor_parallel_spec`)."""
    return TensorParallelParams(tuple(p.name for p in frozen), tuple(tuple(p.shape) for p in frozen),
                                (REPLICATED,) * len(frozen))


def zero3_frozen_pieces(frozen: tuple[ParamSpec, ...], space: GlobalSpace, topology: Topology,
                        side: str) -> PieceTable:
    """Pieces of the ZeRO-3 `frozen_param_fragments` of every (dp, tp) rank over `space`
    (`GlobalSpace.of(replicated(frozen), ...)`): frozen parameter j alone in buffer j,
    chunked over dp (layout.py `frozen_pieces`), the same chunks on every TP rank."""
    chunks = _FrozenChunks(tuple(frozen), frozen_pieces(frozen, topology.dp))
    return zero12_pieces(replicated(frozen), space, topology, lambda t: chunks, side)


def module_pieces(module: TensorParallelParams, space: GlobalSpace, topology: Topology, side: str,
                  stages: Sequence[int] | None = None) -> PieceTable:
    """Pieces of the module tensors of the model-states files: TP rank t's local tensor j is
    buffer j of global rank (dp 0, tp t), from element 0; replicated ones as in `zero12_pieces`.
    `stages`: tensor j's pipeline stage (a pipeline's layer files, reshard.layouts.model_axis.LayerFileSpace),
    so that it is buffer j of rank (dp 0, tp t, stage stages[j]); None: every tensor on stage 0."""
    stage_of = np.zeros(len(module.names), np.int64) if stages is None else np.asarray(stages, np.int64)
    columns = []
    for t in range(topology.tp):
        numels = space.local_numels(module, side, topology.tp, t)
        local_bases = logical_bases(numels)
        keep = numels > 0
        count = int(keep.sum())
        start, _, buffer, offset, *strides = _lower(module, space, side, topology.tp, t, local_bases,
                                                    local_bases[keep], np.zeros(count), np.flatnonzero(keep),
                                                    np.zeros(count), numels[keep])
        ranks = np.array([topology.rank_of(0, t, stage) for stage in range(topology.pp)], np.int64)
        columns.append((start, ranks[stage_of[buffer]], buffer, offset, *strides))
    return space.table(columns)


def module_buffer_numels(module: TensorParallelParams, space: GlobalSpace, tp: int) -> tuple[int, ...]:
    """Largest shard of each split module tensor over the target's TP ranks (round windows need a bound)."""
    if not tp or not len(space.numels):
        return tuple(int(n) for n in space.numels)
    return tuple(np.max([space.local_numels(module, "target", tp, t) for t in range(tp)], axis=0).tolist())


def pipeline_model_axis_pieces(source_columns, target_columns, splits: Mapping[str, TensorSplit],
                               shapes: Mapping[str, Sequence[int]], source: Topology, target: Topology
                               ) -> tuple[PieceTable, PieceTable]:
    """(source pieces, target pieces) of a PipelineModule save whose model axis (tp) changes, its stages
    kept or re-assigned (docs/architecture.md, "One road").

        old, new = pipeline_model_axis_pieces(spec.columns, target.stages.columns, axis.splits, axis.shapes,
                                              spec.topology, target)

    `*_columns`: per column (mp index stage * tp + model rank) its (params at that side's local shapes,
    groups), a ZeRO-1 save over its stage's parameters (CheckpointSpec.columns / the target's Topology.stages); every
    model rank of a stage holds the same names. `splits`, `shapes`: each parameter's split over the model
    axis and whole shape, by name (reshard.layouts.model_axis.PipelineModelAxis). The space is the target
    stages end to end, each the `GlobalSpace` of its parameters (whole, a replicated one once per target
    model rank), so a column's local ranges are lowered exactly as an AutoTP rank's (`_lower`: strips
    for a row-parallel cut, boxes for two fused sub-parameters). Each source parameter is read from the
    first source stage holding it (a tied parameter: every stage's copy is equal, see
    `reshard.planning.checkpoint_plan.pipeline_stage_change_pieces`) and from source model rank 0 when
    replicated, and written into every target stage holding it. ValueError when a target parameter has no
    source, a source parameter no target, or a local shape is not the split's."""
    stages = []  # per target stage: (params, space, base, name -> index)
    total = 0
    for stage in range(target.pp):
        names = [p.name for p in target_columns[stage * target.tp][0]]
        if not names:  # a stage of no parameter (DeepSpeed's ZeRO-1 cannot build one; callers refuse it)
            stages.append((None, None, total, {}))
            continue
        params = TensorParallelParams(tuple(names), tuple(tuple(int(d) for d in shapes[n]) for n in names),
                                      tuple(splits[n] for n in names))
        space = GlobalSpace.of(params, source_tp=source.tp, target_tp=target.tp)
        stages.append((params, space, total, {name: q for q, name in enumerate(names)}))
        total += space.total
    first_stage: dict[str, int] = {}
    for column, (params, _) in enumerate(source_columns):
        for param in params:
            first_stage.setdefault(param.name, column // source.tp)
    missing = sorted({n for _, _, _, index in stages for n in index} - set(first_stage))
    if missing:
        raise ValueError(f"the target stages hold {missing[:3]}, which no source stage holds (another layer list?)")
    strided = any(space.grid.strided.any() for _, space, _, _ in stages if space is not None)
    target_pieces = []
    for column, (params, groups) in enumerate(target_columns):
        stage, model = divmod(column, target.tp)
        stage_params, space, base, _ = stages[stage]
        if space is None:
            continue
        _check_local_shapes(params, stage_params, target.tp, model, f"target stage {stage}, model rank {model}")
        start, dp, buffer, offset, length, param = _param_pieces(params, groups, target.dp)
        start, dp, buffer, offset, *strides = _lower(stage_params, space, "target", target.tp, model,
                                                     logical_bases([p.numel for p in params]), start, dp, buffer,
                                                     offset, length, param)
        ranks = np.array([target.rank_of(d, model, stage) for d in range(target.dp)], dtype=np.int64)
        target_pieces.append((start + base, ranks[dp], buffer, offset, *strides))
    source_pieces = []
    for column, (params, groups) in enumerate(source_columns):
        stage, model = divmod(column, source.tp)
        start, dp, buffer, offset, length, pid = _param_pieces(params, groups, source.dp)
        local_bases = logical_bases([p.numel for p in params])
        ranks = np.array([source.rank_of(d, model, stage) for d in range(source.dp)], dtype=np.int64)
        held = np.zeros(len(params), bool)
        for t, (stage_params, space, base, index) in enumerate(stages):
            q_of = np.array([index.get(p.name, -1) if first_stage[p.name] == stage else -1 for p in params],
                            dtype=np.int64)
            held |= q_of >= 0
            q = q_of[pid] if len(pid) else pid
            keep = q >= 0
            if not keep.any():
                continue
            # the source column's ranges of this target stage's parameters, in a local space laid out as
            # if the column held exactly that stage's parameters (what `_lower` reads)
            mine = [p for p in params if index.get(p.name, -1) >= 0 and first_stage[p.name] == stage]
            _check_local_shapes(mine, stage_params, source.tp, model, f"source stage {stage}, model rank {model}",
                                [index[p.name] for p in mine])
            virtual = logical_bases(space.local_numels(stage_params, "source", source.tp, model))
            q = q[keep]
            lowered = _lower(stage_params, space, "source", source.tp, model, virtual,
                             virtual[q] + start[keep] - local_bases[pid[keep]], ranks[dp[keep]], buffer[keep],
                             offset[keep], length[keep], q)
            source_pieces.append((lowered[0] + base, *lowered[1:]))
        stray = [p.name for p, h in zip(params, held) if not h and first_stage[p.name] == stage]
        if stray:
            raise ValueError(f"source stage {stage} holds {stray[:3]}, which no target stage holds "
                             "(another layer list?)")
    columns = [c if strided else c[:4] for c in source_pieces], [c if strided else c[:4] for c in target_pieces]
    return table_from_columns(columns[0], total), table_from_columns(columns[1], total)


def _param_pieces(params, groups, dp: int) -> tuple[np.ndarray, ...]:
    """A ZeRO-1 column's pieces at `dp` ranks (start, dp rank, buffer, offset, length) cut at its
    parameters' bounds, with each piece's parameter."""
    layout = zero12_layout(params, groups, dp)
    pieces, bases = layout.pieces, logical_bases([p.numel for p in params])
    start, rank, buffer, offset, length = _cut_at(np.asarray(bases, np.int64), pieces.start, pieces.rank,
                                                  pieces.buffer, pieces.offset, pieces.length)
    keep = length > 0
    start, rank, buffer, offset, length = start[keep], rank[keep], buffer[keep], offset[keep], length[keep]
    return start, rank, buffer, offset, length, np.searchsorted(bases, start, side="right") - 1


def _check_local_shapes(params, stage_params: TensorParallelParams, tp: int, model: int, where: str,
                        indices: Sequence[int] | None = None) -> None:
    for param, q in zip(params, range(len(params)) if indices is None else indices):
        local = stage_params.local_shape(q, tp, model)
        if stage_params.names[q] != param.name or tuple(local) != tuple(param.shape):
            raise ValueError(f"{where}: {param.name!r} has shape {tuple(param.shape)}, its split at tp {tp} "
                             f"gives {stage_params.names[q]!r} {tuple(local)}")
