"""An export of a PipelineModule save as pieces: one whole tensor per parameter from the stages' ZeRO-1 flats.

    python -m pytest -q tests/test_pipeline_export_pieces.py

`checkpoint_plan.pipeline_export_pieces` lowers a pipeline save (any pp, dp, and a model axis of any tp
with ds_to_universal's rules) onto its parameters, each once and whole, end to end (what the
safetensors, universal and DCP exports read; reshard.export.pipeline_layout). Checked here without a
process, on random layer lists (a tied module among them), 1-D and 2-D parameters under every rule
that cuts (column: dim 0; row: dim 1; two fused sub-parameters on dim 0; replicated), stage counts, dp,
tp and two param groups: each global tensor is cut into every model rank's local slice the way
`merge_tp_slices` joins them (written here from the rule, not from the code under test), each column's
ZeRO-1 flats are filled from them, `plan.intersect`'s segments are run as copies into one buffer per
parameter, and every buffer must equal its global tensor; every source element is read at most once,
a tied parameter only from its first stage and a replicated one only from model rank 0.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_pipeline_stage_change_plan import flats

from reshard.layouts.model_axis import ModelAxisRule
from reshard.layouts.pipeline import PipelineLayers, assign_stages, split_by_group
from reshard.layouts.zero import ParamSpec, PieceTable
from reshard.planning.checkpoint_plan import pipeline_export_pieces
from reshard.planning.plan import intersect
from reshard.topology import Topology

RULES = {"column": ModelAxisRule("column", 0), "row": ModelAxisRule("row", 1),
         "two-sub-params": ModelAxisRule("two-sub-params", 0), "replicated": ModelAxisRule("replicated", None)}


@st.composite
def pipeline_models(draw):
    """(layers, {name: local shape}, {name: rule kind}, {name: group}) of a small model-axis PipelineModule."""
    count = draw(st.integers(2, 7))
    tied_at = draw(st.sets(st.integers(0, count - 1), max_size=3))
    shapes, kinds = {}, {}
    for index in range(count):
        names = ["tied_modules.embed.weight"] if index in tied_at else \
            [f"{index}.p{p}" for p in range(draw(st.integers(0, 3)))]
        for name in names:
            if name in shapes:
                continue
            kind = draw(st.sampled_from(sorted(RULES)))
            rows = draw(st.integers(1, 3)) * (2 if kind == "two-sub-params" else 1)
            two_d = kind == "row" or draw(st.booleans())
            shapes[name] = (rows, draw(st.integers(1, 4))) if two_d else (rows,)
            kinds[name] = kind
    groups = {name: draw(st.integers(0, 1)) for name in shapes}
    return PipelineLayers(count, {"embed": tuple(sorted(tied_at))} if tied_at else {}), shapes, kinds, groups


def local_slice(whole: np.ndarray, kind: str, tp: int, m: int) -> np.ndarray:
    """Model rank m's slice of `whole`, as ds_to_universal.py `merge_tp_slices` would join it back."""
    if kind == "replicated":
        return whole
    if kind == "column":
        return np.split(whole, tp, axis=0)[m]
    if kind == "row":
        return np.split(whole, tp, axis=1)[m]
    first, second = np.split(whole, 2, axis=0)  # two fused sub-parameters: each cut on its own
    return np.concatenate((np.split(first, tp, axis=0)[m], np.split(second, tp, axis=0)[m]))


@settings(max_examples=150, deadline=None)
@given(pipeline_models(), st.integers(1, 3), st.integers(1, 3), st.integers(1, 3))
def test_every_parameter_is_joined_whole_from_its_first_stage_reading_each_source_element_once(model, pp, dp, tp):
    layers, local_shapes, kinds, group_of = model
    topology = Topology(dp=dp, tp=tp, pp=pp)
    numels = {name: int(np.prod(shape)) for name, shape in local_shapes.items()}
    assignment = assign_stages("parameters", layers, numels, pp)
    whole_shapes = {name: RULES[kinds[name]].joined_shape(shape, tp) for name, shape in local_shapes.items()}
    rng = np.random.default_rng(len(numels) * 7 + tp)
    wholes = {name: rng.standard_normal(shape) for name, shape in whole_shapes.items()}
    values = {(m, name): local_slice(wholes[name], kinds[name], tp, m).reshape(-1)
              for m in range(tp) for name in wholes}
    columns = []
    for names in assignment.names:
        params = tuple(ParamSpec(name, local_shapes[name]) for name in names)
        index = {name: i for i, name in enumerate(names)}
        groups = tuple(tuple(index[n] for n in group) for group in split_by_group(names, group_of, 2))
        columns.extend([(params, groups)] * tp)
    order = list(dict.fromkeys(name for names in assignment.names for name in names))[::-1]  # any export order
    params = tuple(ParamSpec(name, whole_shapes[name]) for name in order)
    old = pipeline_export_pieces(columns, params, topology, lambda name: RULES[kinds[name]])
    numel = [p.numel for p in params]
    starts = np.concatenate(([0], np.cumsum(numel)))[:-1].astype(np.int64)
    keep = np.asarray(numel) > 0
    new = PieceTable.from_unsorted(starts[keep], np.zeros(int(keep.sum()), np.int64), np.flatnonzero(keep),
                                   np.zeros(int(keep.sum()), np.int64), int(sum(numel)))
    held = flats(columns, topology, values)
    reads = {key: np.zeros(len(flat), dtype=np.int64) for key, flat in held.items()}
    moved = {i: np.full(p.numel, np.nan) for i, p in enumerate(params)}
    segments = intersect(old, new)
    for src_rank, src_buffer, src_offset, dst_buffer, dst_offset, length in zip(
            segments.src_rank, segments.src_buffer, segments.src_offset, segments.dst_buffer, segments.dst_offset,
            segments.length):
        moved[int(dst_buffer)][dst_offset:dst_offset + length] = held[int(src_rank), int(src_buffer)][
            src_offset:src_offset + length]
        reads[int(src_rank), int(src_buffer)][src_offset:src_offset + length] += 1
    for i, p in enumerate(params):
        np.testing.assert_array_equal(moved[i], wholes[p.name].reshape(-1), err_msg=p.name)
    assert all((r <= 1).all() for r in reads.values())
    assert sum(int(r.sum()) for r in reads.values()) == sum(numel)  # each whole element read exactly once


def test_a_parameter_the_stages_do_not_hold_or_a_wrong_whole_shape_is_refused():
    columns = [((ParamSpec("0.w", (2, 3)),), ((0,),)), ((ParamSpec("1.w", (4,)),), ((0,),))]
    with pytest.raises(ValueError, match="no stage holds"):
        pipeline_export_pieces(columns, (ParamSpec("0.w", (2, 3)), ParamSpec("1.w", (4,)), ParamSpec("2.w", (1,))),
                               Topology(dp=1, pp=2))
    with pytest.raises(ValueError, match="which the export does not name"):
        pipeline_export_pieces(columns, (ParamSpec("0.w", (2, 3)),), Topology(dp=1, pp=2))
    with pytest.raises(ValueError, match=r"'0.w': shape \(2, 3\) on model rank 0 of stage 0, \(2, 4\) whole"):
        pipeline_export_pieces(columns, (ParamSpec("0.w", (2, 4)), ParamSpec("1.w", (4,))), Topology(dp=1, pp=2))
