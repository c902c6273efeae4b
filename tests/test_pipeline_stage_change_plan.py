"""Issue 37's pp change as pieces of global parameters: the source and target piece tables of a stage change.

    python -m pytest -q tests/test_pipeline_stage_change_plan.py

`checkpoint_plan.pipeline_stage_change_pieces` lowers a PipelineModule save whose stage count changes
(tp kept) onto the target columns' space (docs/architecture.md, "One road"). Checked here without a
process, on random layer lists (tied modules among them), stage counts, dp sizes, tp sizes and two
param groups: every source column's ZeRO-1 flats are filled with each parameter's own values (a tied
parameter's the same in every stage holding it, as DeepSpeed's tied-gradient all-reduce keeps them),
`plan.intersect`'s segments are run as copies, and each target column's flats must equal the ZeRO-1
flats built directly from the target stages' parameters; an untied source element is read exactly
once, a tied one once per target copy from its first source stage and never from the others.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reshard.layouts.pipeline import PipelineLayers, assign_stages, split_by_group
from reshard.layouts.zero import ParamSpec, zero12_layout
from reshard.planning.checkpoint_plan import pipeline_stage_change_pieces
from reshard.planning.plan import intersect
from reshard.topology import Topology


@st.composite
def pipeline_models(draw):
    """(layers, {name: numel}, {name: group}) of a small PipelineModule, a tied module at some layers."""
    count = draw(st.integers(3, 10))
    tied_at = draw(st.sets(st.integers(0, count - 1), max_size=3))
    numels = {}
    for index in range(count):
        if index in tied_at:
            for param in ("weight", "bias"):
                numels.setdefault(f"tied_modules.embed.{param}", draw(st.integers(1, 40)))
            continue
        for param in range(draw(st.integers(0, 3))):
            numels[f"{index}.p{param}"] = draw(st.integers(1, 40))
    groups = {name: draw(st.integers(0, 1)) for name in numels}
    return PipelineLayers(count, {"embed": tuple(sorted(tied_at))} if tied_at else {}), numels, groups


def columns_of(layers, numels, group_of, stages: int, tp: int):
    """Per column (stage * tp + model rank): its (params, groups), as CheckpointSpec.columns holds them."""
    assignment = assign_stages("parameters", layers, numels, stages)
    columns = []
    for names in assignment.names:
        params = tuple(ParamSpec(name, (numels[name],)) for name in names)
        index = {name: i for i, name in enumerate(names)}
        groups = tuple(tuple(index[name] for name in group) for group in split_by_group(names, group_of, 2))
        columns.extend([(params, groups)] * tp)
    return columns


def flats(columns, topology: Topology, values) -> dict:
    """{(global rank, buffer): flat} of every column's ZeRO-1 partitions, each parameter's `values`."""
    out = {}
    for column, (params, groups) in enumerate(columns):
        stage, model = divmod(column, topology.tp)
        pieces = zero12_layout(params, groups, topology.dp).pieces
        local = np.concatenate([values[model, p.name] for p in params] + [np.zeros(0)])
        for start, length, rank, buffer, offset in zip(pieces.start, pieces.length, pieces.rank, pieces.buffer,
                                                       pieces.offset):
            key = (topology.rank_of(int(rank), model, stage), int(buffer))
            flat = out.setdefault(key, np.zeros(0))
            if len(flat) < offset + length:
                flat = out[key] = np.concatenate((flat, np.zeros(offset + length - len(flat))))
            flat[offset:offset + length] = local[start:start + length]
    return out


@settings(max_examples=150, deadline=None)
@given(pipeline_models(), st.integers(1, 4), st.integers(1, 4), st.integers(1, 3), st.integers(1, 3),
       st.integers(1, 2))
def test_a_stage_change_moves_every_parameter_to_the_target_stages_flats(model, source_pp, target_pp, source_dp,
                                                                         target_dp, tp):
    layers, numels, group_of = model
    source, target = Topology(dp=source_dp, tp=tp, pp=source_pp), Topology(dp=target_dp, tp=tp, pp=target_pp)
    old_columns = columns_of(layers, numels, group_of, source_pp, tp)
    new_columns = columns_of(layers, numels, group_of, target_pp, tp)
    values, next_value = {}, 1.0
    for m in range(tp):
        for name, n in numels.items():
            values[m, name] = next_value + np.arange(n)
            next_value += n
    old, new = pipeline_stage_change_pieces(old_columns, new_columns, source, target)
    segments = intersect(old, new)
    held = flats(old_columns, source, values)
    moved = {key: np.zeros_like(flat) for key, flat in flats(new_columns, target, values).items()}
    reads = {key: np.zeros(len(flat), dtype=np.int64) for key, flat in held.items()}
    for src_rank, src_buffer, src_offset, dst_rank, dst_buffer, dst_offset, length in zip(
            segments.src_rank, segments.src_buffer, segments.src_offset, segments.dst_rank, segments.dst_buffer,
            segments.dst_offset, segments.length):
        source_flat = held[int(src_rank), int(src_buffer)]
        moved[int(dst_rank), int(dst_buffer)][dst_offset:dst_offset + length] = \
            source_flat[src_offset:src_offset + length]
        reads[int(src_rank), int(src_buffer)][src_offset:src_offset + length] += 1
    expected = flats(new_columns, target, values)
    assert moved.keys() == expected.keys()
    for key in expected:
        np.testing.assert_array_equal(moved[key], expected[key], err_msg=f"target (rank, buffer) {key}")
    # reads: each untied element once; a tied one once per target stage holding it, from its first source stage
    tied = [name for name in numels if name.startswith("tied_modules.")]
    target_copies = {name: sum(name in {p.name for p in params} for params, _ in new_columns[::tp]) for name in tied}
    first_stage = {name: min(s for s in range(source_pp) if name in {p.name for p in old_columns[s * tp][0]})
                   for name in tied if target_copies[name]}
    for column, (params, groups) in enumerate(old_columns):
        stage, m = divmod(column, tp)
        layout = zero12_layout(params, groups, source_dp)
        local_reads = np.zeros(sum(p.numel for p in params), dtype=np.int64)
        pieces = layout.pieces
        for start, length, rank, buffer, offset in zip(pieces.start, pieces.length, pieces.rank, pieces.buffer,
                                                       pieces.offset):
            local_reads[start:start + length] = reads[source.rank_of(int(rank), m, stage), int(buffer)][
                offset:offset + length]
        base = 0
        for p in params:
            want = (target_copies[p.name] if first_stage[p.name] == stage else 0) if p.name in tied else 1
            assert (local_reads[base:base + p.numel] == want).all(), (p.name, stage, m)
            base += p.numel


def test_a_layer_list_the_source_does_not_match_is_refused():
    layers = PipelineLayers(4)
    numels = {"0.w": 3, "1.w": 5, "2.w": 2, "3.w": 4}
    old = columns_of(layers, numels, dict.fromkeys(numels, 0), 2, 1)
    new = columns_of(PipelineLayers(5), {**numels, "4.w": 1}, dict.fromkeys([*numels, "4.w"], 0), 1, 1)
    with pytest.raises(ValueError, match="no source stage holds"):
        pipeline_stage_change_pieces(old, new, Topology(dp=1, pp=2), Topology(dp=1, pp=1))
    shorter = columns_of(layers, {k: v for k, v in numels.items() if k != "3.w"}, dict.fromkeys(numels, 0), 1, 1)
    with pytest.raises(ValueError, match="which no target stage holds"):
        pipeline_stage_change_pieces(old, shorter, Topology(dp=1, pp=2), Topology(dp=1, pp=1))
    with pytest.raises(ValueError, match="keeps tp"):
        pipeline_stage_change_pieces(old, new, Topology(dp=1, pp=2), Topology(dp=1, tp=2, pp=1))
