"""Issue 37's pipeline tp change as pieces of global parameters: the source and target piece tables.

    python -m pytest -q tests/test_pipeline_tp_change_plan.py

`tensor_pieces.pipeline_model_axis_pieces` lowers a PipelineModule save whose model axis (tp) changes,
its stages kept or re-assigned, onto the target stages' global parameters (docs/architecture.md, "One
road"). Checked here without a process, on random layer lists (a tied module among them), stage counts,
dp sizes, tp sizes (1, 2, 4 on either side), two param groups and every split a save's
universal_checkpoint_info gives (column: dim 0; row: dim 1, so the segments are strided; replicated;
two fused sub-parameters on dim 0): every source column's ZeRO-1 flats are filled with each parameter's
slice of its whole values (cut here by numpy slicing, not by reshard's rules), `plan.intersect`'s
segments are run as copies element by element (strided ones through `strided_runs.advance`), and each
target column's flats must equal the ZeRO-1 flats built directly from the target's slices; every source
element is read exactly as often as the target holds it from there: a sliced one once per target stage
holding it, a replicated one from model rank 0 once per (target stage, model rank), nothing from another
model rank, and a tied parameter only from its first source stage.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reshard.layouts.model_axis import ModelAxisRule
from reshard.layouts.pipeline import PipelineLayers, assign_stages, split_by_group
from reshard.layouts.strided_runs import CONTIGUOUS, advance
from reshard.layouts.tensor_pieces import pipeline_model_axis_pieces
from reshard.layouts.zero import ParamSpec, zero12_layout
from reshard.planning.plan import intersect
from reshard.topology import Topology

KINDS = ("column", "row", "replicated", "two-sub-params")


@st.composite
def pipeline_models(draw):
    """(layers, {name: (kind, whole shape)}, {name: group}) of a small Megatron-style PipelineModule, a tied
    module at some layers; every sliced dim divisible by 8 (tp 4 of two sub-parameters)."""
    count = draw(st.integers(3, 8))
    tied_at = draw(st.sets(st.integers(0, count - 1), max_size=3))
    params = {}

    def param():
        kind = draw(st.sampled_from(KINDS))
        rows, cols = 8 * draw(st.integers(1, 2)), draw(st.integers(1, 3)) * (8 if kind == "row" else 1)
        shape = (rows, cols) if kind != "replicated" or draw(st.booleans()) else (rows,)
        return kind, shape
    for index in range(count):
        if index in tied_at:
            for name in ("weight", "bias"):
                params.setdefault(f"tied_modules.embed.{name}", param())
            continue
        for p in range(draw(st.integers(0, 3))):
            params[f"{index}.p{p}"] = param()
    groups = {name: draw(st.integers(0, 1)) for name in params}
    return PipelineLayers(count, {"embed": tuple(sorted(tied_at))} if tied_at else {}), params, groups


def rule(kind: str) -> ModelAxisRule:
    return ModelAxisRule(kind, None if kind == "replicated" else (1 if kind == "row" else 0))


def local_shape(kind: str, shape, tp: int) -> tuple[int, ...]:
    return rule(kind).local_shape(shape, tp)


def cut(kind: str, whole: np.ndarray, tp: int, m: int) -> np.ndarray:
    """Model rank m's slice of `whole` at `tp`, by plain numpy slicing (Megatron's even cuts)."""
    if kind == "replicated":
        return whole
    if kind == "row":
        w = whole.shape[1] // tp
        return whole[:, m * w:(m + 1) * w]
    if kind == "column":
        h = whole.shape[0] // tp
        return whole[m * h:(m + 1) * h]
    half = whole.shape[0] // 2  # two fused sub-parameters: each halved on its own, then stacked
    h = half // tp
    return np.concatenate((whole[m * h:(m + 1) * h], whole[half + m * h:half + (m + 1) * h]))


def columns_of(layers, params, group_of, stages: int, tp: int):
    """Per column (stage * tp + model rank): its (params at local shapes, groups), as CheckpointSpec.columns."""
    numels = {name: int(np.prod(local_shape(kind, shape, tp))) for name, (kind, shape) in params.items()}
    assignment = assign_stages("parameters", layers, numels, stages)
    columns = []
    for names in assignment.names:
        index = {name: i for i, name in enumerate(names)}
        groups = tuple(tuple(index[name] for name in group) for group in split_by_group(names, group_of, 2))
        local = tuple(ParamSpec(name, local_shape(*params[name], tp)) for name in names)
        columns.extend([(local, groups)] * tp)
    return columns


def flats(columns, topology: Topology, values, params) -> dict:
    """{(global rank, buffer): flat} of every column's ZeRO-1 partitions of each parameter's slice."""
    out = {}
    for column, (local, groups) in enumerate(columns):
        stage, model = divmod(column, topology.tp)
        pieces = zero12_layout(local, groups, topology.dp).pieces
        flat_params = np.concatenate([cut(params[p.name][0], values[p.name], topology.tp, model).reshape(-1)
                                      for p in local] + [np.zeros(0)])
        for start, length, rank, buffer, offset in zip(pieces.start, pieces.length, pieces.rank, pieces.buffer,
                                                       pieces.offset):
            key = (topology.rank_of(int(rank), model, stage), int(buffer))
            flat = out.setdefault(key, np.zeros(0))
            if len(flat) < offset + length:
                flat = out[key] = np.concatenate((flat, np.zeros(offset + length - len(flat))))
            flat[offset:offset + length] = flat_params[start:start + length]
    return out


def element_offsets(segments, i: int, side: str) -> np.ndarray:
    offset = getattr(segments, f"{side}_offset")[i]
    n = np.arange(int(segments.length[i]))
    if not segments.strided or segments.width[i] == CONTIGUOUS:
        return offset + n
    stride = getattr(segments, f"{side}_stride")[i]
    return advance(np.full(len(n), offset), np.full(len(n), segments.col[i]), np.full(len(n), segments.width[i]),
                   np.full(len(n), stride), n)[0]


def splits_and_shapes(params):
    return ({name: rule(kind).split(shape) for name, (kind, shape) in params.items()},
            {name: shape for name, (_, shape) in params.items()})


@settings(max_examples=150, deadline=None)
@given(pipeline_models(), st.integers(1, 3), st.integers(1, 3), st.integers(1, 3), st.integers(1, 3),
       st.sampled_from([1, 2, 4]), st.sampled_from([1, 2, 4]))
def test_a_tp_change_moves_every_slice_to_the_target_columns_flats(model, source_pp, target_pp, source_dp, target_dp,
                                                                   source_tp, target_tp):
    layers, params, group_of = model
    if not params:
        return
    source = Topology(dp=source_dp, tp=source_tp, pp=source_pp)
    target = Topology(dp=target_dp, tp=target_tp, pp=target_pp)
    old_columns = columns_of(layers, params, group_of, source_pp, source_tp)
    new_columns = columns_of(layers, params, group_of, target_pp, target_tp)
    values, next_value = {}, 1.0
    for name, (_, shape) in params.items():
        values[name] = (next_value + np.arange(int(np.prod(shape)))).reshape(shape)
        next_value += values[name].size
    old, new = pipeline_model_axis_pieces(old_columns, new_columns, *splits_and_shapes(params), source, target)
    segments = intersect(old, new)
    held = flats(old_columns, source, values, params)
    moved = {key: np.full_like(flat, np.nan) for key, flat in flats(new_columns, target, values, params).items()}
    reads = {key: np.zeros(len(flat), dtype=np.int64) for key, flat in held.items()}
    for i in range(len(segments)):
        src = held[int(segments.src_rank[i]), int(segments.src_buffer[i])]
        dst = moved[int(segments.dst_rank[i]), int(segments.dst_buffer[i])]
        s, d = element_offsets(segments, i, "src"), element_offsets(segments, i, "dst")
        dst[d] = src[s]
        np.add.at(reads[int(segments.src_rank[i]), int(segments.src_buffer[i])], s, 1)
    expected = flats(new_columns, target, values, params)
    assert moved.keys() == expected.keys()
    for key, flat in expected.items():
        # ZeRO's padding at a flat's end is no parameter's: nothing writes it
        written = ~np.isnan(moved[key])
        np.testing.assert_array_equal(moved[key][written], flat[written], err_msg=f"target (rank, buffer) {key}")
    total = {key: int((~np.isnan(m)).sum()) for key, m in moved.items()}
    wanted = sum(sum(p.numel for p in local) for local, _ in new_columns)
    assert sum(total.values()) == wanted  # every target element written
    # reads per source element
    stage_sets = [{p.name for p in local} for local, _ in new_columns[::target_tp]]
    copies = {name: sum(name in names for names in stage_sets) for name in params}
    first = {}
    for column, (local, _) in enumerate(old_columns):
        for p in local:
            first.setdefault(p.name, column // source_tp)
    for column, (local, groups) in enumerate(old_columns):
        stage, m = divmod(column, source_tp)
        pieces = zero12_layout(local, groups, source_dp).pieces
        local_reads = np.zeros(sum(p.numel for p in local), dtype=np.int64)
        for start, length, rank, buffer, offset in zip(pieces.start, pieces.length, pieces.rank, pieces.buffer,
                                                       pieces.offset):
            local_reads[start:start + length] = reads[source.rank_of(int(rank), m, stage), int(buffer)][
                offset:offset + length]
        base = 0
        for p in local:
            kind = params[p.name][0]
            want = 0 if first[p.name] != stage else \
                (copies[p.name] * target_tp if m == 0 else 0) if kind == "replicated" else copies[p.name]
            assert (local_reads[base:base + p.numel] == want).all(), (p.name, kind, stage, m, want)
            base += p.numel


def test_a_local_shape_other_than_the_split_or_a_missing_parameter_is_refused():
    layers = PipelineLayers(2)
    params = {"0.w": ("column", (8, 2)), "1.w": ("row", (8, 8))}
    group_of = dict.fromkeys(params, 0)
    old = columns_of(layers, params, group_of, 2, 2)
    new = columns_of(layers, params, group_of, 1, 1)
    splits, shapes = splits_and_shapes(params)
    wrong = [((ParamSpec("0.w", (8, 2)),), ((0,),))] + old[1:]
    with pytest.raises(ValueError, match="its split at tp 2"):
        pipeline_model_axis_pieces(wrong, new, splits, shapes, Topology(dp=1, tp=2, pp=2), Topology(dp=1, tp=1))
    fewer = columns_of(PipelineLayers(1), {"0.w": params["0.w"]}, group_of, 1, 1)
    with pytest.raises(ValueError, match="which no target stage holds"):
        pipeline_model_axis_pieces(old, fewer, splits, shapes, Topology(dp=1, tp=2, pp=2), Topology(dp=1, tp=1))
    more = columns_of(PipelineLayers(3), {**params, "2.w": ("column", (8, 1))}, {**group_of, "2.w": 0}, 1, 1)
    with pytest.raises(ValueError, match="no source stage holds"):
        pipeline_model_axis_pieces(old, more, {**splits, "2.w": rule("column").split((8, 1))},
                                   {**shapes, "2.w": (8, 1)}, Topology(dp=1, tp=2, pp=2), Topology(dp=1, tp=1))
