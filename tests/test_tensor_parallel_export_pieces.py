"""`checkpoint_plan.tensor_parallel_export_pieces`: an AutoTP save joined whole for an export, pure, no files.

    python -m pytest -q tests/test_tensor_parallel_export_pieces.py        # seconds, fast tier

Hypothesis draws small AutoTP models: column-parallel (dim 0), row-parallel (dim 1), fused
sub-parameters (a view cut per part) and replicated parameters, two parameter groups, a `tp_grain_size`,
a source (dp, tp) and an export cut into random chunks spread over random writer files. Every element of
every source (dp, tp) rank's ZeRO-1/2 flat buffer is labelled with its identity (parameter, row-major
index in the whole parameter), worked out with DeepSpeed's own slicing functions on an `arange` tensor:
  - column-parallel: `LinearLayer.uneven_partition` (module_inject/layers.py), `weight.split(sizes, dim=0)`;
  - row-parallel: `LinearAllreduce.uneven_partition`, `weight.split(sizes, dim=1)`;
  - sizes: `module_inject/tp_shard.py:get_shard_size_list` with `AutoTPMeta(tp_grain_size=g)`;
  - fused sub-parameters: `SubParamLinearLayer._tp_partition`, which cuts the logical view with
    `layers.py:_partition_logical_tensor` and widths `_subparam_shard_widths`;
  - replicated (everything AutoTP leaves whole): the whole tensor on every TP rank.
The source pieces and the export's pieces are intersected (`reshard.planning.plan.intersect`, what
`plan_space` cuts into rounds) and every segment is run element by element (tests/strided_check.py, from
the strided definition). Then: every element of every export chunk is written exactly once, with the
identity the chunk's place in its whole parameter says; every element of a split parameter is read once
from the rank DeepSpeed put it on; a replicated parameter is read from TP rank 0 only, once; ZeRO's
padding is never read.
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from reshard.layouts.tensor_parallel import REPLICATED, TensorParallelParams, TensorSplit
from reshard.layouts.zero import ParamSpec, PieceTable, logical_bases, zero12_layout
from reshard.planning.checkpoint_plan import tensor_parallel_export_pieces
from reshard.planning.plan import intersect
from reshard.topology import Topology
from strided_check import segment_elements

deepspeed_layers = pytest.importorskip("deepspeed.module_inject.layers")
from deepspeed.module_inject.tp_shard import AutoTPMeta, get_shard_size_list  # noqa: E402

IDENTITY = 1 << 20  # identity = parameter * IDENTITY + row-major index in the whole parameter
PADDING = -1


def deepspeed_shard(whole: torch.Tensor, split: TensorSplit, tp: int, rank: int, grain: int) -> torch.Tensor:
    """TP rank `rank`'s tensor of `whole`, cut as DeepSpeed 0.19.8's AutoTP layers cut it (module docstring)."""
    meta = AutoTPMeta(tp_grain_size=grain)
    if split.dim is None:
        return whole
    if split.view is not None:  # SubParamLinearLayer._tp_partition: the view cut part by part, kept row-major
        widths = deepspeed_layers._subparam_shard_widths(split.parts, tp, meta)
        return deepspeed_layers._partition_logical_tensor(whole.reshape(split.view), split.dim, tp, rank, widths,
                                                          subparam_sizes=split.parts)
    sizes = get_shard_size_list(whole.shape[split.dim], tp, meta)  # LinearLayer / LinearAllreduce.uneven_partition
    return whole.split(sizes, dim=split.dim)[rank]


@st.composite
def autotp_exports(draw):
    """(params, groups, source topology, grain, export PieceTable over the whole parameters, writers)."""
    tp, dp = draw(st.integers(1, 4)), draw(st.integers(1, 3))
    grain = draw(st.sampled_from([1, 1, 2]))
    count = draw(st.integers(1, 5))
    names, shapes, splits = [], [], []
    for i in range(count):
        kind = draw(st.sampled_from(["column", "row", "sub-parameter", "replicated"]))
        if kind == "sub-parameter":  # fused parts along dim of a view: (P,), (P, c) or (a, P, c) as (a * P, c)
            parts = tuple(draw(st.lists(st.integers(1, 2 * tp + 1), min_size=1, max_size=3)))
            form = draw(st.integers(0, 2))
            a, c = draw(st.integers(1, 3)), draw(st.integers(1, 3))
            view, dim = [((sum(parts),), 0), ((sum(parts), c), 0), ((a, sum(parts), c), 1)][form]
            shape = (sum(parts),) if len(view) == 1 else (int(np.prod(view[:-1])), view[-1])
            split = TensorSplit("sub-parameter", dim, view, parts)
        else:
            ndim = 1 if kind == "column" and draw(st.booleans()) else 2  # a column-parallel bias is 1-D
            shape = tuple(draw(st.integers(tp, tp * grain + 5)) for _ in range(ndim))
            split = REPLICATED if kind == "replicated" else TensorSplit(kind, 0 if kind == "column" else 1)
        names.append(f"p{i}")
        shapes.append(shape)
        splits.append(split)
    params = TensorParallelParams(tuple(names), tuple(shapes), tuple(splits), grain)
    for shape, split in zip(shapes, splits):  # what DeepSpeed itself refuses is not a save
        extents = () if split.dim is None else split.parts if split.view is not None else (shape[split.dim],)
        for extent in extents:
            try:
                get_shard_size_list(extent, tp, AutoTPMeta(tp_grain_size=grain))
            except AssertionError:
                assume(False)
    cut = draw(st.integers(0, count))
    groups = tuple(g for g in (tuple(range(cut)), tuple(range(cut, count))) if g)
    writers = draw(st.integers(1, 3))
    numels = [int(np.prod(s)) for s in shapes]
    bases = logical_bases(numels)
    start, rank, buffer, chunks_in = [], [], [], [0] * writers
    for p, n in enumerate(numels):  # each whole parameter cut into chunks, each chunk in some writer's file
        inner = sorted(draw(st.sets(st.integers(1, n - 1), max_size=3))) if n > 1 else []
        for lo in (0, *inner):
            file = draw(st.integers(0, writers - 1))
            start.append(int(bases[p]) + lo)
            rank.append(file)
            buffer.append(chunks_in[file])
            chunks_in[file] += 1
    export = PieceTable.from_unsorted(start, rank, buffer, np.zeros(len(start), np.int64), int(sum(numels)))
    return params, groups, Topology(dp=dp, tp=tp), grain, export, writers


def _local_ids(params, grain, tp, t) -> list[torch.Tensor]:
    return [deepspeed_shard(torch.arange(int(np.prod(shape))).reshape(shape) + p * IDENTITY, split, tp, t, grain)
            for p, (shape, split) in enumerate(zip(params.shapes, params.splits))]


def _spec(params, groups, topology, grain):
    """The part of a CheckpointSpec the function reads; each TP rank's ZeRO-1/2 layout over the local
    shapes DeepSpeed's slicing gives (what inspect reads from the files)."""
    local_shapes = [[tuple(t.shape) for t in _local_ids(params, grain, topology.tp, t)] for t in range(topology.tp)]

    def layout(dp, tp, t):
        return zero12_layout([ParamSpec(n, s) for n, s in zip(params.names, local_shapes[t])], groups, dp)
    whole = tuple(ParamSpec(n, s) for n, s in zip(params.names, params.shapes))
    return SimpleNamespace(topology=topology, tensor=SimpleNamespace(params=params), params=whole, layout=layout,
                           frozen=())


def _source_buffers(spec, params, grain) -> dict:
    """(global rank, flat buffer) -> identity of each element; PADDING where ZeRO pads."""
    topology, buffers = spec.topology, {}
    for t in range(topology.tp):
        ids = _local_ids(params, grain, topology.tp, t)
        for g, group in enumerate(spec.layout(topology.dp, topology.tp, t).groups):
            flat = np.full(group.flat_numel, PADDING, dtype=np.int64)
            for p, offset in zip(group.flat_order, group.flat_offsets):
                flat[offset:offset + ids[p].numel()] = ids[p].reshape(-1).numpy()
            for d in range(topology.dp):
                part = group.partition_numel
                buffers[(topology.rank_of(d, t), g)] = flat[d * part:(d + 1) * part]
    return buffers


def _export_chunks(export: PieceTable, params) -> dict:
    """(writer, chunk) -> the identities the chunk must hold: its run of its whole parameter."""
    bases = logical_bases([int(np.prod(s)) for s in params.shapes])
    chunks = {}
    for i, (lo, n) in enumerate(zip(export.start.tolist(), export.length.tolist())):
        p = int(np.searchsorted(bases, lo, side="right")) - 1
        index = lo - int(bases[p])
        chunks[(int(export.rank[i]), int(export.buffer[i]))] = p * IDENTITY + np.arange(index, index + n)
    return chunks


@given(autotp_exports())
@settings(max_examples=150, deadline=None)
def test_export_pieces_join_every_tp_shard_whole_once(model):
    params, groups, topology, grain, export, writers = model
    spec = _spec(params, groups, topology, grain)
    old, new = tensor_parallel_export_pieces(spec, export, writers)
    assert old.total == new.total
    segments = intersect(old, new)
    sources, expected = _source_buffers(spec, params, grain), _export_chunks(export, params)
    written = {key: np.full(len(v), PADDING, dtype=np.int64) for key, v in expected.items()}
    count = {key: np.zeros(len(v), dtype=np.int64) for key, v in expected.items()}
    reads = {key: np.zeros(len(v), dtype=np.int64) for key, v in sources.items()}
    for s, src_index, dst_index in segment_elements(segments):
        src_key = (int(segments.src_rank[s]), int(segments.src_buffer[s]))
        dst_key = (int(segments.dst_rank[s]), int(segments.dst_buffer[s]))
        assert dst_key in expected, f"segment {s} writes {dst_key}, which no export chunk is"
        written[dst_key][dst_index] = sources[src_key][src_index]
        np.add.at(count[dst_key], dst_index, 1)
        np.add.at(reads[src_key], src_index, 1)
    for key, want in expected.items():
        assert np.array_equal(written[key], want), (key, written[key], want)
        assert np.all(count[key] == 1), (key, count[key])  # each element of each chunk written exactly once
    replicated = {p for p, split in enumerate(params.splits) if split.dim is None}
    for (rank, b), ids in sources.items():
        parameter = np.where(ids == PADDING, -1, ids // IDENTITY)
        from_here = np.array([q in replicated for q in parameter.tolist()], dtype=bool)
        copy = from_here & (topology.coordinates(rank).tp != 0)
        want = np.where((ids == PADDING) | copy, 0, 1)  # padding and other TP ranks' replicated copies: never
        assert np.array_equal(reads[(rank, b)], want), ((rank, b), reads[(rank, b)], want)


def test_a_row_parallel_weight_at_tp2_is_read_column_block_by_column_block():
    """One fixed case written out: W (3, 4) split on dim 1 over 2 TP ranks, dp 1, one writer, one chunk.
    The export's chunk is W row-major; TP rank 0 holds columns 0-1, rank 1 columns 2-3 (LinearAllreduce)."""
    params = TensorParallelParams(("w",), ((3, 4),), (TensorSplit("row", 1),))
    export = PieceTable.from_unsorted([0], [0], [0], [0], 12)
    spec = _spec(params, ((0,),), Topology(dp=1, tp=2), 1)
    old, new = tensor_parallel_export_pieces(spec, export, 1)
    chunk = np.full(12, -1)
    sources = _source_buffers(spec, params, 1)
    assert np.array_equal(sources[(0, 0)], [0, 1, 4, 5, 8, 9]) and np.array_equal(sources[(1, 0)], [2, 3, 6, 7, 10, 11])
    segments = intersect(old, new)
    for s, src_index, dst_index in segment_elements(segments):
        chunk[dst_index] = sources[(int(segments.src_rank[s]), 0)][src_index]
    assert np.array_equal(chunk, np.arange(12))
