"""Pure layout tests: our partition arithmetic against DeepSpeed's own functions, many random cases.

    python -m pytest tests/test_layout.py -q
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from reshard.layouts.zero import (
    ParamSpec,
    frozen_pieces,
    logical_bases,
    param_alignment_elements,
    round_robin_order,
    undo_round_robin,
    zero3_chunk,
    zero3_layout,
    zero12_layout,
)

numels = st.lists(st.integers(1, 97), min_size=1, max_size=12)
worlds = st.integers(1, 9)


@st.composite
def models(draw):
    """Random parameters split into 1-3 optimizer groups."""
    sizes = draw(numels)
    params = tuple(ParamSpec(f"p{i}", (n,)) for i, n in enumerate(sizes))
    cuts = sorted(draw(st.sets(st.integers(1, len(sizes) - 1), max_size=2))) if len(sizes) > 1 else []
    bounds = [0, *cuts, len(sizes)]
    groups = [tuple(range(a, b)) for a, b in zip(bounds, bounds[1:])]
    return params, groups


def _deepspeed():
    from deepspeed.runtime.utils import align_dense_tensors
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    from deepspeed.utils.mixed_precision_linkage import _init_lp_to_hp_mapping
    return SimpleNamespace(align=align_dense_tensors, rr=DeepSpeedZeroOptimizer._round_robin_reorder,
                           sub_groups=DeepSpeedZeroOptimizer_Stage3._create_fp16_sub_groups,
                           lp_to_hp=_init_lp_to_hp_mapping)


DS = _deepspeed()


@given(st.integers(0, 30), worlds)
def test_round_robin_order_is_deepspeeds(count, world):
    items = list(range(count))
    reordered, _ = DS.rr(None, items, world)
    assert [items[i] for i in round_robin_order(count, world)] == reordered
    assert undo_round_robin(reordered, world) == items


@given(models(), worlds, st.booleans(), st.booleans(), st.sampled_from([2, 4]))
@settings(max_examples=200, deadline=None)
def test_zero12_partitions_match_deepspeed(model, world, round_robin, aligned, itemsize):
    params, groups = model
    alignment = param_alignment_elements(itemsize, aligned)
    layout = zero12_layout(params, groups, world, round_robin=round_robin, param_alignment=alignment)
    for group_ids, group in zip(groups, layout.groups):
        if round_robin:
            assert list(group.flat_order) == DS.rr(None, list(group_ids), world)[0]
        # DeepSpeed pads between parameters, then `align_dense_tensors` pads the tail to 2 * world.
        pieces = []
        for pid, pad in zip(group.flat_order, group.alignment_paddings):
            pieces.append(torch.empty(params[pid].numel, device="meta"))
            if pad:
                pieces.append(torch.empty(pad, device="meta"))
        flat = sum(t.numel() for t in DS.align(pieces, 2 * world))
        assert group.flat_numel == flat and group.partition_numel * world == flat
        assert all((o % alignment == 0) for o in group.flat_offsets)
        # Every element of the flat group is either in a lean partition or tail padding.
        assert sum(group.lean_numel(r) for r in range(world)) == group.padded_numel
        assert sum(group.bf16_optimizer_padding(r) for r in range(world)) == flat - group.padded_numel
        assert all(0 <= group.tail_padding(r) <= group.partition_numel for r in range(world))


@given(models(), worlds, st.booleans(), st.booleans())
@settings(max_examples=200, deadline=None)
def test_slice_mappings_follow_deepspeeds_linkage(model, world, round_robin, aligned):
    params, groups = model
    layout = zero12_layout(params, groups, world, round_robin=round_robin,
                           param_alignment=param_alignment_elements(4, aligned))
    numels = [p.numel for p in params]
    for group_ids, group in zip(groups, layout.groups):
        lp = [torch.empty(numels[p], device="meta") for p in group_ids]
        offsets = None
        if any(group.alignment_paddings):
            by_param = dict(zip(group.flat_order, group.flat_offsets))
            offsets = [by_param[p] for p in group_ids]
        ps = group.partition_numel
        for rank in range(world):
            linked = DS.lp_to_hp(lp, rank * ps, ps, None, param_offsets=offsets)
            index = {id(t): p for t, p in zip(lp, group_ids)}
            expected = []
            for tensor, lp_start in linked:
                lo, hi = max(lp_start, rank * ps), min(lp_start + tensor.numel(), rank * ps + ps)
                expected.append((index[id(tensor)], hi - lo, lo - rank * ps))
            assert group.slice_mappings(rank, numels) == expected


@given(models(), worlds, st.booleans(), st.booleans())
@settings(max_examples=200, deadline=None)
def test_zero12_pieces_tile_the_flat_groups(model, world, round_robin, aligned):
    params, groups = model
    layout = zero12_layout(params, groups, world, round_robin=round_robin,
                           param_alignment=param_alignment_elements(2, aligned))
    table = layout.pieces
    bases = logical_bases([p.numel for p in params])
    assert table.length.sum() == sum(p.numel for p in params)
    owner = np.searchsorted(bases, table.start, side="right") - 1
    for start, rank, buffer, offset, length, pid in zip(table.start, table.rank, table.buffer, table.offset,
                                                       table.length, owner):
        group = layout.groups[buffer]
        flat = dict(zip(group.flat_order, group.flat_offsets))[pid] + start - bases[pid]
        assert rank * group.partition_numel + offset == flat
        assert offset + length <= group.lean_numel(rank)  # never inside tail padding
        assert start - bases[pid] + length <= params[pid].numel  # never across parameters


@given(models(), worlds, st.integers(0, 200))
@settings(max_examples=200, deadline=None)
def test_zero3_sub_groups_match_deepspeed(model, world, sub_group_size):
    params, groups = model
    layout = zero3_layout(params, groups, world, sub_group_size)
    expected = []
    for g, ids in enumerate(groups):
        fake = [SimpleNamespace(pid=p, partition_numel=lambda n=params[p].numel: zero3_chunk(n, world)) for p in ids]
        for sg in DS.sub_groups(SimpleNamespace(sub_group_size=sub_group_size), fake):
            expected.append((g, tuple(p.pid for p in sg)))
    assert [(sg.group, sg.params) for sg in layout.sub_groups] == expected


@given(st.integers(0, 1000), worlds)
def test_zero3_chunk_is_deepspeeds(numel, world):
    from deepspeed.utils.zero_to_fp32 import zero3_partitioned_param_info
    partitioned, padding = zero3_partitioned_param_info(numel, world)
    assert zero3_chunk(numel, world) == partitioned
    assert partitioned * world == numel + padding


@given(models(), worlds, st.integers(1, 200))
@settings(max_examples=100, deadline=None)
def test_zero3_pieces_put_chunk_r_on_rank_r(model, world, sub_group_size):
    params, groups = model
    layout = zero3_layout(params, groups, world, sub_group_size)
    table = layout.pieces
    bases = logical_bases([p.numel for p in params])
    assert table.length.sum() == sum(p.numel for p in params)
    owner = np.searchsorted(bases, table.start, side="right") - 1
    for start, rank, buffer, offset, pid in zip(table.start, table.rank, table.buffer, table.offset, owner):
        chunk = zero3_chunk(params[pid].numel, world)
        sg = layout.sub_groups[buffer]
        assert pid in sg.params and start - bases[pid] == rank * chunk
        assert offset == sg.chunk_offsets[sg.params.index(pid)]


def test_frozen_pieces():
    table = frozen_pieces((ParamSpec("a", (13, 13)), ParamSpec("b", (13,))), 2)
    assert table.start.tolist() == [0, 85, 169, 176]
    assert table.rank.tolist() == [0, 1, 0, 1] and table.buffer.tolist() == [0, 0, 1, 1]


def test_known_deepspeed_checkpoint_numbers():
    """Figures read off a real 2-rank ZeRO-2 fp32 save (see DESIGN.md): 259 elements -> 130 per rank."""
    params = (ParamSpec("emb", (11, 7)), ParamSpec("l1.weight", (13, 7)), ParamSpec("l2.weight", (7, 13)),
              ParamSpec("l1.bias", (13,)), ParamSpec("l2.bias", (7,)))
    layout = zero12_layout(params, [(0, 1, 2), (3, 4)], 2)
    assert [g.partition_numel for g in layout.groups] == [130, 10]
    assert [layout.groups[0].tail_padding(r) for r in (0, 1)] == [0, 1]
    assert layout.groups[0].slice_mappings(1, [p.numel for p in params]) == [(1, 38, 0), (2, 91, 38)]
    # W=8, 21 elements: lean lengths 4,4,4,4,4,1,0,0 (DESIGN.md section 2)
    eight = zero12_layout((ParamSpec("x", (21,)),), [(0,)], 8)
    assert [eight.groups[0].lean_numel(r) for r in range(8)] == [4, 4, 4, 4, 4, 1, 0, 0]


def test_world_size_must_be_positive():
    with pytest.raises(ValueError):
        zero12_layout((ParamSpec("x", (3,)),), [(0,)], 0)
