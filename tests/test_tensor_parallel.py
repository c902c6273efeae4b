"""Tensor-parallel (AutoTP) resharding: pure planner properties, then real checkpoints end to end.

    python -m pytest -q tests/test_tensor_parallel.py -m "not e2e"     # planner, seconds
    python -m pytest -q tests/test_tensor_parallel.py                  # + AutoTP runs, ~4-5 min idle

End to end, (tp, dp) notation: ZeRO-2 fp32 (2,2) -> (1,3) and (4,1), offline and in-job
(`reshard.deepspeed.load_checkpoint` in the same check launches), with DeepSpeed's universal
path (ds_to_universal.py + load_universal) loaded in the same launches as the oracle; ZeRO-1 bf16 (2,1) -> (1,2)
and (1,2) -> (2,1), (2,2) -> (1,3), (4,1) -> (1,3) and (2,2) (offline and in-job);
BF16_Optimizer (2,1) -> (1,2); ZeRO-2 fp16 with a vocabulary-parallel tied lm_head/embedding
and fused gate/up sub-parameters (2,1) -> (1,2), (3,1) (offline and in-job) and (1,2) -> (3,1);
ZeRO-3 fp32 (2,2) -> (1,3) and (4,1), offline and in-job; ZeRO-3 bf16 (2,1) -> (1,2), offline
and in-job; W differs from both world sizes in each.
Every output is loaded with plain `engine.load_checkpoint` in an AutoTP engine at the target,
from another seed, and every element of every rank's fp32 masters, Adam moments and module
weights is compared with the truth resliced for that rank (tests/reshard_proof/tensor_parallel.py),
then training continues. Launches are what cost: the sources are trained with one launch per
(tp, dp) (`autotp`), and every test's loads at one (tp, dp) are judged in one launch, each in a
fresh engine (`tp_cases`); each test asserts on its own verdicts.
"""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reshard.layouts.boxes import Box
from reshard.layouts.zero import ParamSpec, zero3_layout, zero12_layout
from reshard.layouts.tensor_parallel import REPLICATED, TensorParallelParams, TensorSplit, affine_map, shard_sizes
from reshard.layouts.local_to_global import box_runs
from reshard.planning.plan import intersect
from reshard.layouts.tensor_pieces import GlobalSpace, module_pieces, replicated, zero3_frozen_pieces, zero12_pieces
from reshard.topology import Topology
from strided_check import segment_elements

# --- pure: DeepSpeed's rules ------------------------------------------------------------------


def test_shard_sizes_match_deepspeed():
    from deepspeed.module_inject.tp_shard import AutoTPMeta, get_shard_size_list
    for grain in (1, 4, 8):
        for total in range(1, 40):
            for tp in range(1, 6):
                try:
                    theirs = get_shard_size_list(total, tp, AutoTPMeta(tp_grain_size=grain), "x")
                except AssertionError:
                    continue
                assert shard_sizes(total, tp, grain) == tuple(theirs), (total, tp, grain)


def test_affine_map_matches_deepspeed():
    from deepspeed.checkpoint.affine import contiguous_split_map, replicated_map
    assert affine_map(TensorSplit("row", 1), (8, 9), 2) == contiguous_split_map((8, 9), shard_sizes(9, 2), 1).to_dict()
    assert affine_map(TensorSplit("column", 0), (9,), 4) == contiguous_split_map((9,), shard_sizes(9, 4), 0).to_dict()
    assert affine_map(REPLICATED, (11, 8), 3) == replicated_map((11, 8), 3).to_dict()


def test_sub_parameter_split_matches_deepspeed():
    """Shards, shard shapes and affine maps of fused sub-parameter splits as DeepSpeed cuts and
    describes them (layers.py `_partition_logical_tensor`, checkpoint/affine.py `sub_param_map`)."""
    import torch
    from deepspeed.checkpoint.affine import sub_param_map
    from deepspeed.module_inject.layers import _partition_logical_tensor
    cases = [((10, 8), (10, 8), 0, (5, 5)), ((10,), (10,), 0, (5, 5)), ((9, 4), (3, 3, 4), 1, (1, 2)),
             ((8, 7), (8, 7), 1, (3, 4)), ((12, 3), (12, 3), 0, (2, 4, 6))]
    for shape, view, dim, parts in cases:
        split = TensorSplit("sub-parameter", dim, view, parts)
        full = torch.arange(int(np.prod(shape))).reshape(shape)
        for tp in (1, 2, 3, 4):
            widths = split.widths(tp)
            assert affine_map(split, shape, tp) == sub_param_map(view, list(parts), [list(w) for w in widths],
                                                                 dim).to_dict(), (shape, tp)
            for rank in range(tp):
                theirs = _partition_logical_tensor(full.reshape(view), dim, tp, rank, widths, parts)
                local = theirs.reshape(-1) if len(shape) == 1 else theirs.reshape(-1, theirs.shape[-1])
                assert split.local_shape(shape, tp, rank) == tuple(local.shape)
                ids = _element_ids(TensorParallelParams(("w",), (shape,), (split,)), 0, tp, rank)
                assert np.array_equal(ids, theirs.reshape(-1).numpy()), (shape, tp, rank)


@given(rows=st.integers(1, 6), cols=st.integers(1, 6), data=st.data())
@settings(max_examples=60, deadline=None)
def test_box_runs_agree_with_numpy(rows, cols, data):
    r0 = data.draw(st.integers(0, rows - 1))
    c0 = data.draw(st.integers(0, cols - 1))
    box = Box(0, (r0, c0), (data.draw(st.integers(1, rows - r0)), data.draw(st.integers(1, cols - c0))))
    global_index = np.arange(rows * cols).reshape(rows, cols)[r0:r0 + box.sizes[0], c0:c0 + box.sizes[1]].ravel()
    start = data.draw(st.integers(0, box.numel - 1))
    length = data.draw(st.integers(1, box.numel - start))
    item, local, glob, run = box_runs(box, (rows, cols), [start], [length])
    assert np.all(item == 0) and run.sum() == length and local[0] == start
    for lo, g, n in zip(local, glob, run):
        assert np.array_equal(global_index[lo:lo + n], np.arange(g, g + n))


# --- pure: the planner moves every element to where the target layout wants it ------------------

@st.composite
def tp_models(draw):
    tp_src, tp_dst = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    low = max(tp_src, tp_dst)
    count = draw(st.integers(1, 5))
    names, shapes, splits = [], [], []
    for i in range(count):
        ndim = draw(st.integers(1, 2))
        shape = tuple(draw(st.integers(low, low + 5)) for _ in range(ndim))
        kinds = ["column", "replicated", "sub-parameter"] + (["row"] if ndim == 2 else [])
        kind = draw(st.sampled_from(kinds))
        names.append(f"p{i}")
        if kind == "sub-parameter":  # fused parts along dim of a view: (P,), (P, c), (r, P) or (a, P, c)
            parts = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
            form = draw(st.integers(0, 3))
            a, c = draw(st.integers(1, 3)), draw(st.integers(1, 3))
            view, dim = [((sum(parts),), 0), ((sum(parts), c), 0), ((a, sum(parts)), 1),
                         ((a, sum(parts), c), 1)][form]
            shape = (sum(parts),) if len(view) == 1 else (int(np.prod(view[:-1])), view[-1])
            splits.append(TensorSplit("sub-parameter", dim, view, parts))
        else:
            splits.append(REPLICATED if kind == "replicated" else TensorSplit(kind, 0 if kind == "column" else 1))
        shapes.append(shape)
    cut = draw(st.integers(0, count))
    groups = tuple(g for g in (tuple(range(cut)), tuple(range(cut, count))) if g)
    params = TensorParallelParams(tuple(names), tuple(shapes), tuple(splits))
    source = Topology(dp=draw(st.integers(1, 4)), tp=tp_src)
    target = Topology(dp=draw(st.integers(1, 4)), tp=tp_dst)
    return params, groups, source, target


def _layout(params, groups, topology, t):
    local = [ParamSpec(n, params.local_shape(i, topology.tp, t)) for i, n in enumerate(params.names)]
    return zero12_layout(local, groups, topology.dp)


def _element_ids(params, p, tp, t):
    """Global identity (param, row-major global index) of every element of TP rank t's tensor p."""
    found = []
    for local, box, shape in params.local_pieces(p, tp, t):
        assert local == sum(len(f) for f in found)  # pieces tile the local tensor in order
        coords = np.unravel_index(np.arange(box.numel), box.sizes)
        found.append(np.ravel_multi_index(tuple(c + o for c, o in zip(coords, box.offsets)), shape))
    glob = np.concatenate(found) if found else np.zeros(0, np.int64)
    assert len(glob) == int(np.prod(params.local_shape(p, tp, t)))
    return p * 10_000 + glob


def _zero_buffers(params, groups, topology):
    """(global rank, buffer) -> array of element identities; -1 where ZeRO pads."""
    buffers = {}
    for t in range(topology.tp):
        layout = _layout(params, groups, topology, t)
        for g, group in enumerate(layout.groups):
            flat = np.full(group.flat_numel, -1, dtype=np.int64)
            for p, offset in zip(group.flat_order, group.flat_offsets):
                ids = _element_ids(params, p, topology.tp, t)
                flat[offset:offset + len(ids)] = ids
            for d in range(topology.dp):
                buffers[(topology.rank_of(d, t), g)] = flat[d * group.partition_numel:(d + 1) * group.partition_numel]
    return buffers


def _run(segments, sources, targets_like):
    written = {key: np.full(len(v), -1, dtype=np.int64) for key, v in targets_like.items()}
    count = {key: np.zeros(len(v), dtype=np.int64) for key, v in targets_like.items()}
    for s, src_index, dst_index in segment_elements(segments):
        src = sources[(int(segments.src_rank[s]), int(segments.src_buffer[s]))]
        key = (int(segments.dst_rank[s]), int(segments.dst_buffer[s]))
        written[key][dst_index] = src[src_index]
        np.add.at(count[key], dst_index, 1)
    return written, count


@given(tp_models())
@settings(max_examples=120, deadline=None)
def test_optimizer_space_moves_every_element_once_to_its_place(model):
    params, groups, source, target = model
    space = GlobalSpace.of(params, source_tp=source.tp, target_tp=target.tp)
    old = zero12_pieces(params, space, source, lambda t: _layout(params, groups, source, t), "source")
    new = zero12_pieces(params, space, target, lambda t: _layout(params, groups, target, t), "target")
    assert old.total == new.total == space.total
    segments = intersect(old, new)
    sources, expected = _zero_buffers(params, groups, source), _zero_buffers(params, groups, target)
    written, count = _run(segments, sources, expected)
    for key, want in expected.items():
        assert np.array_equal(written[key], want), key
        assert np.array_equal(count[key], (want >= 0).astype(np.int64)), key   # once each; padding never
    # replicated parameters are read from source TP rank 0 only
    replicated = [p for p, s in enumerate(params.splits) if s.dim is None]
    for s in range(len(segments)):
        ids = sources[(int(segments.src_rank[s]), int(segments.src_buffer[s]))]
        if int(ids[int(segments.src_offset[s])]) // 10_000 in replicated:
            assert source.coordinates(int(segments.src_rank[s])).tp == 0


def _zero3_buffers(params, groups, topology, sub_group_size):
    """(global rank, sub-group) -> element identities of that rank's ZeRO-3 flat buffer; -1 where
    the chunk of a parameter is padded (stage3.py: p = ceil(n / dp), chunks end to end)."""
    buffers = {}
    for t in range(topology.tp):
        local = [ParamSpec(n, params.local_shape(i, topology.tp, t)) for i, n in enumerate(params.names)]
        layout = zero3_layout(local, groups, topology.dp, sub_group_size)
        for sg_id, sg in enumerate(layout.sub_groups):
            for d in range(topology.dp):
                parts = []
                for p, chunk in zip(sg.params, sg.chunk_numels):
                    ids = _element_ids(params, p, topology.tp, t)[d * chunk:(d + 1) * chunk]
                    parts.append(np.concatenate((ids, np.full(chunk - len(ids), -1, np.int64))))
                buffers[(topology.rank_of(d, t), sg_id)] = np.concatenate(parts) if parts else np.zeros(0, np.int64)
    return buffers


@given(tp_models(), st.integers(1, 40))
@settings(max_examples=80, deadline=None)
def test_zero3_optimizer_space_moves_every_element_once_to_its_place(model, sub_group_size):
    """ZeRO-3 under AutoTP: each TP rank's local parameters chunked over dp, sub-groups cut by
    sub_group_size over the TP-LOCAL chunk sizes (so they can differ between TP ranks)."""
    params, groups, source, target = model
    space = GlobalSpace.of(params, source_tp=source.tp, target_tp=target.tp)

    def layout_of(topology):
        return lambda t: zero3_layout([ParamSpec(n, params.local_shape(i, topology.tp, t))
                                       for i, n in enumerate(params.names)], groups, topology.dp, sub_group_size)
    segments = intersect(zero12_pieces(params, space, source, layout_of(source), "source"),
                         zero12_pieces(params, space, target, layout_of(target), "target"))
    sources = _zero3_buffers(params, groups, source, sub_group_size)
    expected = _zero3_buffers(params, groups, target, sub_group_size)
    written, count = _run(segments, sources, expected)
    for key, want in expected.items():
        assert np.array_equal(written[key], want), key
        assert np.array_equal(count[key], (want >= 0).astype(np.int64)), key


@given(st.lists(st.tuples(st.integers(1, 5), st.integers(1, 4)), min_size=1, max_size=3),
       st.integers(1, 3), st.integers(1, 4), st.integers(1, 3), st.integers(1, 4))
@settings(max_examples=60, deadline=None)
def test_zero3_frozen_fragments_fill_every_tp_rank(shapes, tp_src, dp_src, tp_dst, dp_dst):
    """Frozen ZeRO-3 parameters (AutoTP leaves them whole): every target (dp, tp) rank gets its dp
    chunk, read from source TP rank 0 only."""
    frozen = tuple(ParamSpec(f"f{i}", s) for i, s in enumerate(shapes))
    source, target = Topology(dp=dp_src, tp=tp_src), Topology(dp=dp_dst, tp=tp_dst)
    space = GlobalSpace.of(replicated(frozen), source_tp=source.tp, target_tp=target.tp)
    segments = intersect(zero3_frozen_pieces(frozen, space, source, "source"),
                         zero3_frozen_pieces(frozen, space, target, "target"))

    def chunks(topology):
        out = {}
        for j, p in enumerate(frozen):
            c = -(-p.numel // topology.dp)
            for d in range(topology.dp):
                for t in range(topology.tp):
                    ids = j * 10_000 + np.arange(p.numel)[d * c:(d + 1) * c]
                    out[(topology.rank_of(d, t), j)] = np.concatenate((ids, np.full(c - len(ids), -1, np.int64)))
        return out
    expected = chunks(target)
    written, count = _run(segments, chunks(source), expected)
    for key, want in expected.items():
        assert np.array_equal(written[key], want) and np.array_equal(count[key], (want >= 0).astype(np.int64)), key
    assert all(source.coordinates(int(r)).tp == 0 for r in segments.src_rank)


@given(tp_models())
@settings(max_examples=60, deadline=None)
def test_module_space_reslices_every_tensor(model):
    params, _, source, target = model
    space = GlobalSpace.of(params, source_tp=source.tp, target_tp=target.tp)
    segments = intersect(module_pieces(params, space, source, "source"), module_pieces(params, space, target, "target"))

    def tensors(topology):
        return {(topology.rank_of(0, t), p): _element_ids(params, p, topology.tp, t)
                for t in range(topology.tp) for p in range(len(params.names))}
    expected = tensors(target)
    written, count = _run(segments, tensors(source), expected)
    for key, want in expected.items():
        assert np.array_equal(written[key], want) and np.all(count[key] == 1), key


def test_row_parallel_shard_is_one_strided_piece_not_one_per_row():
    params = TensorParallelParams(("w",), ((8, 9),), (TensorSplit("row", 1),))
    pieces = module_pieces(params, GlobalSpace.of(params, source_tp=2, target_tp=1), Topology(dp=1, tp=2), "source")
    assert len(pieces) == 2 and pieces.length.tolist() == [40, 32] and pieces.total == 72
    assert pieces.width.tolist() == [5, 4] and pieces.stride.tolist() == [5, 4]   # each shard is its strip
    target = module_pieces(params, GlobalSpace.of(params, source_tp=2, target_tp=1), Topology(dp=1, tp=1), "target")
    assert len(target) == 2 and target.stride.tolist() == [9, 9]   # the whole weight, read strip by strip


# --- end to end -----------------------------------------------------------------------------

E2E_SOURCES = {  # name: (tp, dp, stage, precision[, harness model])
    "z2_fp32_tp2_dp2": (2, 2, 2, "fp32"),
    "z1_bf16_tp2_dp1": (2, 1, 1, "bf16"),
    "z1_bf16_tp1_dp2": (1, 2, 1, "bf16"),
    "z1_bf16_tp2_dp2": (2, 2, 1, "bf16"),
    "z1_bf16_tp4_dp1": (4, 1, 1, "bf16"),
    "bf16_optimizer_tp2_dp1": (2, 1, 1, "bf16_optimizer"),
    "z3_fp32_tp2_dp2": (2, 2, 3, "fp32"),
    "z3_bf16_tp2_dp1": (2, 1, 3, "bf16"),
    "fused_z2_fp16_tp2_dp1": (2, 1, 2, "fp16", "fused"),
}


class TPLoad(NamedTuple):
    """A checkpoint to load into a fresh AutoTP engine at (tp, dp) of that stage, precision and
    harness model (reshard_proof.tensor_parallel check), `via` native, in-job or universal."""
    tp: int
    dp: int
    stage: int
    precision: str
    model: str
    via: str
    load_dir: Path
    truth: Path
    verdict: Path


# the sources each end-to-end test uses (E2E_SOURCES names), trained up front in few launches
TP_NEEDS = {
    "test_zero2_fp32_tp2_dp2_to_tp1_dp3_and_tp4_dp1": ("z2_fp32_tp2_dp2",),
    "test_zero1_bf16_tp2_dp1_and_tp1_dp2_swap": ("z1_bf16_tp2_dp1", "z1_bf16_tp1_dp2"),
    "test_zero1_bf16_tp2_dp2_and_tp4_dp1_to_tp1_dp3_and_tp2_dp2": ("z1_bf16_tp2_dp2", "z1_bf16_tp4_dp1"),
    "test_vocabulary_parallel_and_fused_sub_parameters_fp16_tp2_dp1_to_tp1_dp2_and_tp3_dp1": ("fused_z2_fp16_tp2_dp1",),
    "test_bf16_optimizer_tp2_dp1_to_tp1_dp2": ("bf16_optimizer_tp2_dp1",),
    "test_zero3_fp32_tp2_dp2_to_tp1_dp3_and_tp4_dp1": ("z3_fp32_tp2_dp2",),
    "test_zero3_bf16_tp2_dp1_to_tp1_dp2": ("z3_bf16_tp2_dp1",),
    "test_dry_run_and_refusals": ("z1_bf16_tp2_dp1", "z1_bf16_tp1_dp2"),
}


@pytest.fixture(scope="module")
def autotp(request, autotp_trained):
    """name -> (save_dir, truth), trained once per session (tests/conftest.py autotp_trained); the
    sources of this session's tests trained first, one launch per (tp, dp) whatever the stage,
    precision and model."""
    from trained import selected_tests
    names = {name for test, _ in selected_tests(request, TP_NEEDS) for name in TP_NEEDS[test]}
    autotp_trained.train_many([E2E_SOURCES[name] for name in sorted(names)])  # a failure is raised below, per test
    return lambda name: autotp_trained(*E2E_SOURCES[name])


@pytest.fixture(scope="module")
def tp_cases(request, autotp, tmp_path_factory):
    """{test name: JudgedCase} of the selected end-to-end tests: each test's reshards made and
    checked by its `_prepare_*` function, then every load at one (tp, dp) judged in ONE launch,
    whatever its source, stage, precision and model (reshard_proof.tensor_parallel `check_together`),
    since the launch is what costs; every case's ds_to_universal.py conversions before that, in one
    process (`_convert_all`). What failed while preparing or judging a case fails its test only."""
    from trained import JudgedCase, judge_cases, selected_tests

    from reshard_proof.tensor_parallel import check_together
    cases: dict[str, JudgedCase] = {}
    for test, _ in selected_tests(request, TP_PREPARE):
        case = cases[test] = JudgedCase(tmp_path_factory.mktemp("tp-case"))
        try:
            TP_PREPARE[test](autotp, case)
        except Exception as error:  # noqa: BLE001 (raised by the test that owns the case)
            case.error = error
    _convert_all(cases)  # before judging: some loads read a conversion
    judge_cases(cases, check_together)
    return cases


def _load(case, name: str, tp: int, dp: int, load_dir, truth, via: str = "native") -> None:
    """Judge `load_dir` at (tp, dp) in an engine of the case's source (`case.values["source"]`)."""
    stage, precision, model = case.values["source"]
    case.loads.append(TPLoad(tp, dp, stage, precision, model, via, load_dir, truth, case.root / f"{name}.json"))


def _verdicts(cases, test: str) -> list[dict]:
    """The verdicts of `test`'s loads in order, each checked to be of the load asked for."""
    found = []
    for load, verdict in cases[test].verdicts_in_order():
        assert (verdict["tp"], verdict["dp"], verdict["stage"], verdict["precision"], verdict["model"], verdict["how"],
                verdict["load_dir"]) == (load.tp, load.dp, load.stage, load.precision, load.model, load.via,
                                         str(load.load_dir))
        found.append(verdict)
    return found


def _source(autotp, case, name: str):
    _, _, stage, precision, *model = E2E_SOURCES[name]
    case.values["source"] = (stage, precision, (model or ["base"])[0])
    return autotp(name)


def _reshard(source, destination, tp, dp, workers):
    from trained import reshard_in_threads
    result = reshard_in_threads(source, destination, dp, workers, target_tp=tp)
    assert result.checkpoints[0].target_topology == Topology(dp=dp, tp=tp)
    return destination


def _prepare_zero2_fp32(autotp, case) -> None:
    source, truth = _source(autotp, case, "z2_fp32_tp2_dp2")
    tmp_path = case.root
    _convert(case, source, tmp_path / "u-source")  # loaded below: converted before the loads are judged
    to_1x3 = _reshard(source, tmp_path / "tp1dp3", 1, 3, workers=2)
    # the command line with --target-tp, 3 local workers (W differs from 4 and 4)
    from trained import reshard_cli
    done = reshard_cli(source, tmp_path / "tp4dp1", "--target-dp", "1", "--target-tp", "4", "--workers", "3", "--quiet")
    assert done.returncode == 0, done.stderr
    names = sorted(p.name for p in (tmp_path / "tp4dp1" / "global_step3").iterdir())
    assert [n for n in names if n.startswith("mp_rank")] == [f"mp_rank_0{t}_model_states.pt" for t in range(4)]
    # every file's saved ds_config names the target TP size (the source's said 2)
    from trained import saved_parallel_sizes
    assert saved_parallel_sizes(source / "global_step3") == {(2, None)}
    assert saved_parallel_sizes(tmp_path / "tp4dp1" / "global_step3") == {(4, None)}
    assert saved_parallel_sizes(to_1x3 / "global_step3") == {(1, None)}
    _convert(case, tmp_path / "tp4dp1", tmp_path / "u-output")
    # each check resumes from the source itself in-job, in a fresh engine (reshard.deepspeed.load_checkpoint:
    # module weights resliced; at tp 1 x dp 3 one TP rank's model states shared by three dp ranks), loads
    # the offline output, then DeepSpeed's universal conversion of the source in a load_universal engine
    for (tp, dp), output in (((1, 3), to_1x3), ((4, 1), tmp_path / "tp4dp1")):
        _load(case, f"in-job-{tp}x{dp}", tp, dp, source, truth, "in-job")
        _load(case, f"native-{tp}x{dp}", tp, dp, output, truth)
        _load(case, f"universal-{tp}x{dp}", tp, dp, tmp_path / "u-source", truth, "universal")


@pytest.mark.e2e
def test_zero2_fp32_tp2_dp2_to_tp1_dp3_and_tp4_dp1(tp_cases):
    """(2, 2) -> (1, 3) in threads and (4, 1) through the CLI, offline and in-job (`_prepare_zero2_fp32`).
    Also the oracle: DeepSpeed's own universal path (ds_to_universal.py on the source, then
    `load_universal` in an engine at the target) loaded in the same launches as reshard's output,
    at TP 1 and TP 4, gives every rank the same fp32 masters and moments, all equal to the truth."""
    case = tp_cases["test_zero2_fp32_tp2_dp2_to_tp1_dp3_and_tp4_dp1"]
    verdicts = _verdicts(tp_cases, "test_zero2_fp32_tp2_dp2_to_tp1_dp3_and_tp4_dp1")
    for ranks, (in_job, native, universal) in ((3, verdicts[:3]), (4, verdicts[3:])):
        assert in_job["ok"], in_job["problems"]  # in-job (2, 2) -> (1, 3) and (4, 1), fresh engine
        assert native["ok"], native["problems"]
        _assert_universal_agrees(universal, native, ranks=ranks)
    assert len(set(verdicts[4]["digest_per_rank"])) == 4  # four different shards were compared
    # DeepSpeed's own converter reads the output (its affine maps) as it reads the source
    assert _universal(case, case.root / "u-source") == _universal(case, case.root / "u-output")


def _assert_universal_agrees(universal: dict, native: dict, ranks: int) -> None:
    """DeepSpeed's load_universal verdict is right, and every rank holds exactly the fp32 masters
    and moments that the native load of reshard's output gave it (same digest, rank by rank)."""
    assert universal["how"] == "universal" and native["how"] == "native"
    assert universal["ok"], universal["load_error"] or universal["problems"]
    # every rank compared fp32, exp_avg, exp_avg_sq and module weights of all 8 trainable parameters
    assert universal["checked_per_rank"] == native["checked_per_rank"] == [8 * 4] * ranks
    assert universal["digest_per_rank"] == native["digest_per_rank"]


def _convert(case, save_dir, out) -> None:
    """Have DeepSpeed's ds_to_universal.py convert the checkpoint at `save_dir` into
    out/global_step3 before the case's loads are judged: every case's conversions run in one
    process (`_convert_all`, called by tp_cases), since importing DeepSpeed is most of what one costs."""
    case.values.setdefault("conversions", []).append((save_dir, out))


def _convert_all(cases) -> None:
    """Run the conversions (`_convert`) of every case prepared without error in one process
    (reshard_proof.ds_universal `ds_to_universal_each`, `--no_strict`), each with its own outcome and
    printout, and name each output in out/latest_universal, so that an engine with
    `checkpoint.load_universal` loads `out` (ds_to_universal.py's `main` leaves `_create_latest_file`
    commented out). What a conversion gave is read, and checked, by its test (`_universal`)."""
    from reshard_proof.ds_universal import ds_to_universal_each
    jobs = [(case, save_dir, out) for case in cases.values() if case.error is None
            for save_dir, out in case.values.get("conversions", [])]
    try:
        outcomes = ds_to_universal_each([(save_dir / "global_step3", out / "global_step3")
                                         for _, save_dir, out in jobs], options=["--no_strict"]) if jobs else []
    except Exception as error:  # noqa: BLE001 (a timeout, say: each test reading a conversion raises it)
        outcomes = [(repr(error), "")] * len(jobs)
    for (case, save_dir, out), (why, printed) in zip(jobs, outcomes):
        case.values.setdefault("converted", {})[out] = (why, printed)
        if why is None:
            (out / "latest_universal").write_text("global_step3")


def _universal(case, out, trainable: int = 8, files_per_param: int = 4) -> dict:
    """{param/file: tensor bytes} of `ds_to_universal.py`'s conversion into `out` (`_convert`, run by
    tp_cases before the loads are judged), which must have succeeded.

    DeepSpeed 0.19.8's strict check fails its own AutoTP checkpoints with frozen parameters
    ("Unused patterns=[...frozen...] while merging tp slices": the replicated-pattern list names
    them, the optimizer never saw them) after merging every trainable parameter; `--no_strict`
    turns that into the warning checked here, and the conversion completes."""
    import torch
    why, printed = case.values["converted"][out]
    assert why is None, why[-3000:] + printed[-3000:]
    assert "Warning: Unused patterns=['^frozen" in printed, printed[-3000:]
    assert (out / "latest_universal").read_text() == "global_step3"
    zero = out / "global_step3" / "zero"
    # the parameters DeepSpeed merged (masters with moments); `fp32.pt` alone is its copy of the
    # module value of a parameter without optimizer state: frozen ones, and (vocabulary parallel)
    # the tied `lm_head.weight`, which 0.19.8 writes as TP rank 0's vocabulary shard, not whole
    merged = sorted(path.parent for path in zero.glob("*/exp_avg.pt"))
    found = {}
    for path in sorted(p for folder in merged for p in folder.glob("*.pt")):
        value = torch.load(path, weights_only=False)
        tensor = value["param"] if isinstance(value, dict) else value
        found[str(path.relative_to(out))] = (tuple(tensor.shape), tensor.detach().float().numpy().tobytes())
    # trainable parameters x (fp32, exp_avg, exp_avg_sq, step); under ZeRO-3 DeepSpeed writes no step file
    assert len(merged) == trainable and len(found) == trainable * files_per_param, sorted(found)
    return found


def _prepare_zero1_bf16_swap(autotp, case) -> None:
    wide, wide_truth = _source(autotp, case, "z1_bf16_tp2_dp1")
    flat, flat_truth = autotp("z1_bf16_tp1_dp2")
    to_1x2 = _reshard(wide, case.root / "tp1dp2", 1, 2, workers=3)
    to_2x1 = _reshard(flat, case.root / "tp2dp1", 2, 1, workers=3)
    _load(case, "to-1x2", 1, 2, to_1x2, wide_truth)
    # negative control: the (1, 2) source itself is a valid checkpoint at (1, 2), but not the
    # (2, 1) source's state, so judging it against that truth must fail
    _load(case, "negative", 1, 2, flat, wide_truth)
    _load(case, "to-2x1", 2, 1, to_2x1, flat_truth)


@pytest.mark.e2e
def test_zero1_bf16_tp2_dp1_and_tp1_dp2_swap(tp_cases):
    to_1x2, negative, to_2x1 = _verdicts(tp_cases, "test_zero1_bf16_tp2_dp1_and_tp1_dp2_swap")
    assert to_1x2["ok"], to_1x2["problems"]
    assert not negative["ok"] and any("fp32" in p for p in negative["problems"])
    assert to_2x1["ok"], to_2x1["problems"]


def _prepare_zero1_bf16_square_and_wide(autotp, case) -> None:
    square, square_truth = _source(autotp, case, "z1_bf16_tp2_dp2")
    wide, wide_truth = autotp("z1_bf16_tp4_dp1")
    square_1x3 = _reshard(square, case.root / "square-tp1dp3", 1, 3, workers=2)
    wide_1x3 = _reshard(wide, case.root / "wide-tp1dp3", 1, 3, workers=2)
    wide_2x2 = _reshard(wide, case.root / "wide-tp2dp2", 2, 2, workers=3)
    _load(case, "square-1x3", 1, 3, square_1x3, square_truth)
    _load(case, "wide-1x3", 1, 3, wide_1x3, wide_truth)
    _load(case, "wide-2x2", 2, 2, wide_2x2, wide_truth)
    # negative control: the (2, 2) source is a valid checkpoint at (2, 2), but not the (4, 1)
    # source's state; then the (4, 1) source resharded in the job
    _load(case, "negative", 2, 2, square, wide_truth)
    _load(case, "in-job-2x2", 2, 2, wide, wide_truth, "in-job")


@pytest.mark.e2e
def test_zero1_bf16_tp2_dp2_and_tp4_dp1_to_tp1_dp3_and_tp2_dp2(tp_cases):
    """Two real sources, three outputs: (2,2) -> (1,3); (4,1) -> (1,3) and (2,2), offline and
    in-job; W differs from both world sizes each time."""
    square_1x3, wide_1x3, wide_2x2, negative, in_job = _verdicts(
        tp_cases, "test_zero1_bf16_tp2_dp2_and_tp4_dp1_to_tp1_dp3_and_tp2_dp2")
    assert square_1x3["ok"], square_1x3["problems"]
    assert wide_1x3["ok"], wide_1x3["problems"]
    assert wide_2x2["ok"], wide_2x2["problems"]
    assert not negative["ok"] and any("fp32" in p for p in negative["problems"])
    assert in_job["ok"], in_job["problems"]


def _prepare_fused(autotp, case) -> None:
    import torch
    source, truth = _source(autotp, case, "fused_z2_fp16_tp2_dp1")
    tmp_path = case.root
    to_1x2 = _reshard(source, tmp_path / "tp1dp2", 1, 2, workers=3)
    to_3x1 = _reshard(source, tmp_path / "tp3dp1", 3, 1, workers=4)
    via_tp1 = _reshard(to_1x2, tmp_path / "via-tp1", 3, 1, workers=1)
    from trained import reshard_in_process  # what the dry run says, not the launcher
    shown = reshard_in_process(source, tmp_path / "dry", "--target-dp", "1", "--target-tp", "3", "--dry-run")
    assert shown.returncode == 0, shown.stderr
    text = shown.stdout + shown.stderr
    assert "vocabulary (1): embed.weight" in text and "sub-parameter (2): gate_up.weight, gate_up.bias" in text
    assert "row (2): down.weight, fused_down.weight" in text
    states = [torch.load(to_3x1 / "global_step3" / f"mp_rank_0{t}_model_states.pt", weights_only=False)
              for t in range(3)]
    for t, state in enumerate(states):
        module = state["module"]
        assert module["embed.weight"].shape == ((4, 8), (4, 8), (3, 8))[t]
        assert module["gate_up.weight"].shape == ((4, 8), (4, 8), (2, 8))[t]
        assert module["lm_head.weight"].data_ptr() == module["embed.weight"].data_ptr()  # still one tensor
        assert state["shared_params"] == ({"lm_head.weight": "embed.weight"} if t == 0 else {})
        info = state["universal_checkpoint_info"]
        assert info["vocabulary_parameter_patterns"] == [r"^embed\.weight$"] and info["original_vocab_size"] == 11
        assert info["sub_param_shard_widths"][r"^gate_up\.weight$"] == [[2, 2, 1], [2, 2, 1]]
    again = torch.load(via_tp1 / "global_step3" / "mp_rank_01_model_states.pt", weights_only=False)
    assert again["universal_checkpoint_info"] == states[1]["universal_checkpoint_info"]
    _convert(case, source, tmp_path / "u-source")
    _convert(case, to_3x1, tmp_path / "u-output")
    _load(case, "to-1x2", 1, 2, to_1x2, truth)
    _load(case, "to-3x1", 3, 1, to_3x1, truth)
    _load(case, "in-job-3x1", 3, 1, source, truth, "in-job")
    _load(case, "via-tp1", 3, 1, via_tp1, truth)


@pytest.mark.e2e
def test_vocabulary_parallel_and_fused_sub_parameters_fp16_tp2_dp1_to_tp1_dp2_and_tp3_dp1(tp_cases):
    """The harness's "fused" model, ZeRO-2 fp16: `vocab_parallel_lm_head` (lm_head tied to the
    embedding, split over a vocabulary of 11: 6 + 5 rows at TP 2, 4 + 4 + 3 at TP 3; AutoTP pads
    nothing) and a fused gate/up weight and bias (`shape: [2, -1]`, each half of 5 cut on its own:
    3 + 2 at TP 2, 2 + 2 + 1 at TP 3). To (1, 2), to (3, 1) offline and in-job, and from the
    (1, 2) output (no universal_checkpoint_info: the splits come from the saved
    `vocab_parallel_lm_head` and layer specs) on to (3, 1) (`_prepare_fused`)."""
    name = "test_vocabulary_parallel_and_fused_sub_parameters_fp16_tp2_dp1_to_tp1_dp2_and_tp3_dp1"
    verdicts = _verdicts(tp_cases, name)
    assert len(verdicts) == 4
    for verdict in verdicts:
        assert verdict["ok"], verdict["problems"]
    # DeepSpeed's converter merges the vocabulary and sub-parameter shards of the output as of the source
    case = tp_cases[name]
    assert _universal(case, case.root / "u-source", 11) == _universal(case, case.root / "u-output", 11)


def _prepare_bf16_optimizer(autotp, case) -> None:
    source, truth = _source(autotp, case, "bf16_optimizer_tp2_dp1")
    _load(case, "to-1x2", 1, 2, _reshard(source, case.root / "tp1dp2", 1, 2, workers=3), truth)


@pytest.mark.e2e
def test_bf16_optimizer_tp2_dp1_to_tp1_dp2(tp_cases):
    (verdict,) = _verdicts(tp_cases, "test_bf16_optimizer_tp2_dp1_to_tp1_dp2")
    assert verdict["ok"], verdict["problems"]


def _prepare_zero3_fp32(autotp, case) -> None:
    import torch
    from trained import reshard_cli
    source, truth = _source(autotp, case, "z3_fp32_tp2_dp2")
    tmp_path = case.root
    to_1x3 = _reshard(source, tmp_path / "tp1dp3", 1, 3, workers=2)
    done = reshard_cli(source, tmp_path / "tp4dp1", "--target-dp", "1", "--target-tp", "4", "--workers", "3", "--quiet")
    assert done.returncode == 0, done.stderr
    to_4x1 = tmp_path / "tp4dp1"
    names = sorted(p.name for p in (to_4x1 / "global_step3").iterdir() if p.name.endswith(".pt"))
    assert names == sorted(f"zero_pp_rank_0_mp_rank_0{t}_{kind}_states.pt" for t in range(4) for kind in ("model", "optim"))
    states = torch.load(to_4x1 / "global_step3" / "zero_pp_rank_0_mp_rank_03_model_states.pt", weights_only=False)
    assert states["mp_world_size"] == 4 and states["checkpoint_parallel_dimensions"]["tp_degree"] == 4
    up = states["universal_checkpoint_info"]["affine_map"]["params"][r"^up\.weight$"]["ranks"]
    assert [up[t]["shard_shape"] for t in range(4)] == [[3, 8], [2, 8], [2, 8], [2, 8]]
    assert {n: list(s) for group in states["param_shapes"] for n, s in group.items()}["down.weight"] == [8, 2]
    case.values["paths"] = (source, truth, to_1x3, to_4x1)
    _convert(case, source, tmp_path / "u-source")
    _convert(case, to_4x1, tmp_path / "u-output")
    # each (tp, dp): the offline output, then the source itself resharded in-job
    for (tp, dp), output in (((1, 3), to_1x3), ((4, 1), to_4x1)):
        _load(case, f"native-{tp}x{dp}", tp, dp, output, truth)
        _load(case, f"in-job-{tp}x{dp}", tp, dp, source, truth, "in-job")


@pytest.mark.e2e
def test_zero3_fp32_tp2_dp2_to_tp1_dp3_and_tp4_dp1(tp_cases):
    """ZeRO-3 under AutoTP: each TP rank's local parameters partitioned over its dp group, files
    zero_pp_rank_{dp}_mp_rank_{tp:02d}_{model,optim}_states.pt, frozen parameters partitioned too
    (`_prepare_zero3_fp32`)."""
    import torch
    name = "test_zero3_fp32_tp2_dp2_to_tp1_dp3_and_tp4_dp1"
    for verdict in _verdicts(tp_cases, name):
        assert verdict["ok"], (verdict["tp"], verdict["dp"], verdict["how"], verdict["problems"])
    case = tp_cases[name]
    source, truth, to_1x3, to_4x1 = case.values["paths"]
    tmp_path = case.root
    # DeepSpeed's zero_to_fp32 is not TP-aware (it expects one optim file per dp rank and reads
    # mp_rank_00 only): it refuses the TP 2 source, and reads the TP 1 output whole
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    with pytest.raises(ValueError, match=r"Expected 2 of .* but found 4 files"):
        get_fp32_state_dict_from_zero_checkpoint(str(source))
    consolidated = get_fp32_state_dict_from_zero_checkpoint(str(to_1x3))
    expected = torch.load(truth, weights_only=False)
    want = {**{n: e["fp32"] for n, e in expected["params"].items()}, **expected["frozen"]}
    assert sorted(consolidated) == sorted(want)
    assert all(torch.equal(consolidated[n].float(), want[n]) for n in want)
    # DeepSpeed's own converter reads the output's ZeRO-3 files and affine maps as it reads the source's
    assert _universal(case, tmp_path / "u-source", files_per_param=3) == \
        _universal(case, tmp_path / "u-output", files_per_param=3)


def _prepare_zero3_bf16(autotp, case) -> None:
    source, truth = _source(autotp, case, "z3_bf16_tp2_dp1")
    _load(case, "to-1x2", 1, 2, _reshard(source, case.root / "tp1dp2", 1, 2, workers=3), truth)
    _load(case, "in-job-1x2", 1, 2, source, truth, "in-job")


@pytest.mark.e2e
def test_zero3_bf16_tp2_dp1_to_tp1_dp2(tp_cases):
    to_1x2, in_job = _verdicts(tp_cases, "test_zero3_bf16_tp2_dp1_to_tp1_dp2")
    assert to_1x2["ok"], to_1x2["problems"]
    assert in_job["ok"], in_job["problems"]


TP_PREPARE = {
    "test_zero2_fp32_tp2_dp2_to_tp1_dp3_and_tp4_dp1": _prepare_zero2_fp32,
    "test_zero1_bf16_tp2_dp1_and_tp1_dp2_swap": _prepare_zero1_bf16_swap,
    "test_zero1_bf16_tp2_dp2_and_tp4_dp1_to_tp1_dp3_and_tp2_dp2": _prepare_zero1_bf16_square_and_wide,
    "test_vocabulary_parallel_and_fused_sub_parameters_fp16_tp2_dp1_to_tp1_dp2_and_tp3_dp1": _prepare_fused,
    "test_bf16_optimizer_tp2_dp1_to_tp1_dp2": _prepare_bf16_optimizer,
    "test_zero3_fp32_tp2_dp2_to_tp1_dp3_and_tp4_dp1": _prepare_zero3_fp32,
    "test_zero3_bf16_tp2_dp1_to_tp1_dp2": _prepare_zero3_bf16,
}


@pytest.mark.e2e
def test_dry_run_and_refusals(autotp, tmp_path):
    """What the command says (in this process: the message, not the launcher, is the subject)."""
    from trained import reshard_in_process as reshard_cli
    source, _ = autotp("z1_bf16_tp2_dp1")
    shown = reshard_cli(source, tmp_path / "dry", "--target-dp", "3", "--target-tp", "1", "--dry-run")
    assert shown.returncode == 0, shown.stderr
    text = shown.stdout + shown.stderr
    assert "source dp=1 tp=2" in text and "target dp=3 tp=1" in text
    assert "column (2): up.weight, up.bias" in text and "row (1): down.weight" in text and "replicated (5)" in text
    too_wide = reshard_cli(source, tmp_path / "wide", "--target-dp", "1", "--target-tp", "10")
    assert too_wide.returncode == 2 and "cannot give each of 10 TP ranks a shard" in too_wide.stderr
    # a checkpoint without AutoTP metadata cannot change TP size
    import torch
    plain = tmp_path / "plain"
    shutil.copytree(autotp("z1_bf16_tp1_dp2")[0], plain)
    model = plain / "global_step3" / "mp_rank_00_model_states.pt"
    state = torch.load(model, weights_only=False)
    del state["ds_config"]["tensor_parallel"]
    torch.save(state, model)
    refused = reshard_cli(plain, tmp_path / "out", "--target-dp", "1", "--target-tp", "2")
    assert refused.returncode == 2 and "no AutoTP" in refused.stderr, refused.stderr


def test_options_carry_target_tp(tmp_path):
    from reshard.cli import build_parser, options_from_args
    from reshard.errors import OptionError
    from reshard.jobs.options import ReshardOptions
    args = build_parser().parse_args(["a", "b", "--target-dp", "2", "--target-tp", "3"])
    opts = options_from_args(args)
    assert opts.target_tp == 3 and opts.target_for(Topology(dp=4, tp=2)) == Topology(dp=2, tp=3)
    assert ReshardOptions(source="a", destination="b", target_dp=2).validate().target_for(
        Topology(dp=1, tp=4)) == Topology(dp=2, tp=4)
    job = tmp_path / "job.yaml"
    job.write_text("source: a\ndestination: b\ntarget_dp: 2\ntarget_tp: 2\n")
    assert ReshardOptions.from_yaml(str(job)).validate().target_tp == 2
    with pytest.raises(OptionError, match="--target-tp"):
        ReshardOptions(source="a", destination="b", target_dp=2, target_tp=0).validate()


# --- refusals of what AutoTP wrote that reshard does not reslice yet (pure) ------------------

def _model_tree(info_overrides=None, up_shards=None):
    from reshard.formats.torch_bytes.torch_archive import TensorRef
    info = {"parameter_with_row_parallelism_patterns": [], "tp_replicated_parameter_patterns": [],
            "vocabulary_parameter_patterns": [], "parameter_with_sub_params": [],
            "autotp_unsupported_parameter_patterns": {},
            "affine_map": {"version": 1, "params": {r"^up\.weight$": affine_map(TensorSplit("column", 0), (9, 8), 2)}}}
    if up_shards is not None:
        for rank, rows in enumerate(up_shards):
            info["affine_map"]["params"][r"^up\.weight$"]["ranks"][rank]["shard_shape"] = [rows, 8]
    info.update(info_overrides or {})
    ref = TensorRef(0, 5 * 8 * 4, "float32", (5, 8), (8, 1), 0, False)
    return {"universal_checkpoint_info": info, "module": {"up.weight": ref}, "ds_config": {}}


@pytest.mark.parametrize("overrides, shards, message", [
    ({}, None, None),
    ({"vocabulary_parameter_patterns": [r"^lm_head\.weight$"]}, None, "have no affine_map entry"),
    ({"vocabulary_parameter_patterns": [r"^up\.weight$"], "original_vocab_size": 8}, None, "padded vocabulary"),
    ({"parameter_with_sub_params": [{"patterns": [r"^up\.weight$"]}]}, None, "has no partition_dim"),
    ({"parameter_with_sub_params": [{"patterns": [r"^up\.weight$"], "partition_dim": 0}]}, None,
     "without sub_param_shard_widths"),
    ({"parameter_with_sub_params": [{"patterns": [r"^up\.weight$"], "partition_dim": 0}],
      "sub_param_shard_widths": {r"^up\.weight$": [[3, 2], [2, 2]]}}, None, "not the per-sub-parameter split"),
    ({"autotp_unsupported_parameter_patterns": {r"^x$": "odd"}}, None, "marks unsupported"),
    ({}, (6, 3), "splits sized by attention heads"),
])
def test_autotp_metadata_is_read_or_refused(overrides, shards, message):
    from reshard.errors import UnsupportedCheckpoint
    from reshard.formats.deepspeed_files.deepspeed_tensor import tensor_parallel_spec
    tree, local = _model_tree(overrides, shards), (ParamSpec("up.weight", (5, 8)),)
    if message is None:
        tensor, params = tensor_parallel_spec(tree, "m.pt", 2, local)
        assert params == (ParamSpec("up.weight", (9, 8)),) and tensor.params.splits == (TensorSplit("column", 0),)
        assert tensor.universal_info(3)["affine_map"]["params"][r"^up\.weight$"]["ranks"][2]["shard_shape"] == [3, 8]
    else:
        with pytest.raises(UnsupportedCheckpoint, match=message):
            tensor_parallel_spec(tree, "m.pt", 2, local)


def test_tensor_parallel_size_checks_files():
    from reshard.errors import CheckpointError
    from reshard.formats.deepspeed_files.deepspeed_inspect import _tensor_parallel_size
    assert _tensor_parallel_size({"mp_world_size": 2}, "m.pt", "tag", {0, 1}) == 2
    with pytest.raises(CheckpointError, match=r"tensor-parallel ranks \[0, 1, 2\], but mp_world_size is 2"):
        _tensor_parallel_size({"mp_world_size": 2}, "m.pt", "tag", {0, 1, 2})


def test_zero3_tp1_split_comes_from_layer_specs_and_param_shapes():
    """At TP 1 DeepSpeed saves no universal_checkpoint_info, and under ZeRO-3 `module` holds empty
    placeholders: the split follows the saved layer_specs, the shapes param_shapes."""
    from reshard.formats.deepspeed_files.deepspeed_tensor import splits_from_layer_specs, tensor_parallel_spec
    from reshard.formats.torch_bytes.torch_archive import TensorRef
    empty = TensorRef(0, 0, "float32", (0,), (1,), 0, False)
    specs = [{"patterns": [r"^up\.weight$"], "partition_type": "column"},
             {"patterns": [r"^down\.weight$"], "partition_type": "row"}]
    tree = {"module": {n: empty for n in ("up.weight", "up.bias", "down.weight", "down.bias", "frozen.weight")},
            "param_shapes": [{"up.weight": (9, 8), "down.weight": (8, 9)}, {"up.bias": (9,), "down.bias": (8,)}],
            "frozen_param_shapes": {"frozen.weight": (8, 8)}, "buffer_names": [],
            "ds_config": {"tensor_parallel": {"partition_config": {"use_default_specs": False, "layer_specs": specs}}}}
    _, by_name, _ = splits_from_layer_specs(tree, "m.pt")
    assert by_name["up.weight"] == (TensorSplit("column", 0), (9, 8))
    assert by_name["down.weight"] == (TensorSplit("row", 1), (8, 9)) and by_name["down.bias"] == (REPLICATED, (8,))
    assert by_name["frozen.weight"] == (REPLICATED, (8, 8))
    local = tuple(ParamSpec(n, s) for group in tree["param_shapes"] for n, s in group.items())
    tensor, params = tensor_parallel_spec(tree, "m.pt", 1, local, module_weights=False)
    assert tensor.module.names == () and [p.shape for p in params] == [(9, 8), (8, 9), (9,), (8,)]
    assert tensor.params.local_shapes(2, 1) == ((4, 8), (8, 4), (4,), (8,))


def test_vocabulary_parallel_metadata_is_read_and_carried():
    """A vocabulary-parallel weight splits on dim 0 (uneven, unpadded); the pattern list and
    original_vocab_size do not depend on TP and are written unchanged for the target."""
    from reshard.formats.deepspeed_files.deepspeed_tensor import tensor_parallel_spec
    tree = _model_tree({"vocabulary_parameter_patterns": [r"^up\.weight$"], "original_vocab_size": 9})
    tensor, params = tensor_parallel_spec(tree, "m.pt", 2, (ParamSpec("up.weight", (5, 8)),))
    assert params == (ParamSpec("up.weight", (9, 8)),) and tensor.params.splits == (TensorSplit("vocabulary", 0),)
    info = tensor.universal_info(4)
    assert info["vocabulary_parameter_patterns"] == [r"^up\.weight$"] and info["original_vocab_size"] == 9
    assert [info["affine_map"]["params"][r"^up\.weight$"]["ranks"][r]["shard_shape"][0] for r in range(4)] == [3, 2, 2, 2]


def _tp1_tree(config_tp, alias_view=None):
    """TP 1 model states (no universal_checkpoint_info): embed.weight, its tied alias
    lm_head.weight, up (a column layer spec)."""
    from reshard.formats.torch_bytes.torch_archive import TensorRef
    embed = TensorRef(0, 400, "float32", (11, 8), (8, 1), 0, False)
    alias = alias_view or embed
    up_w = TensorRef(0, 400, "float32", (9, 8), (8, 1), 88, False)
    specs = {"use_default_specs": False, "layer_specs": [{"patterns": [r"^up\.weight$"], "partition_type": "column"}]}
    return {"module": {"embed.weight": embed, "up.weight": up_w, "lm_head.weight": alias},
            "shared_params": {"lm_head.weight": "embed.weight"},
            "ds_config": {"tensor_parallel": {"autotp_size": 1, "partition_config": specs, **config_tp}}}


def test_vocabulary_split_at_tp1_comes_from_vocab_parallel_lm_head():
    """At TP 1 DeepSpeed saves no universal_checkpoint_info: with `vocab_parallel_lm_head` the
    tied embedding (the owner of lm_head.weight) is vocabulary-parallel, named once, by its owner."""
    from reshard.formats.deepspeed_files.deepspeed_tensor import tensor_parallel_spec
    local = (ParamSpec("embed.weight", (11, 8)), ParamSpec("up.weight", (9, 8)))
    tensor, _ = tensor_parallel_spec(_tp1_tree({"vocab_parallel_lm_head": True}), "m.pt", 1, local)
    assert tensor.params.splits == (TensorSplit("vocabulary", 0), TensorSplit("column", 0))
    assert tensor.aliases == (("lm_head.weight", "embed.weight"),)
    info = tensor.universal_info(3)
    assert info["vocabulary_parameter_patterns"] == [r"^embed\.weight$"] and info["original_vocab_size"] == 11
    assert r"^lm_head\.weight$" not in info["affine_map"]["params"]
    assert info["affine_map"]["params"][r"^embed\.weight$"]["ranks"][2]["shard_shape"] == [3, 8]
    # without the flag the embedding stays whole
    tensor, _ = tensor_parallel_spec(_tp1_tree({}), "m.pt", 1, local)
    assert tensor.params.splits == (REPLICATED, TensorSplit("column", 0))


def test_tied_alias_must_be_its_owners_view():
    from reshard.errors import CheckpointError
    from reshard.formats.deepspeed_files.deepspeed_tensor import tensor_parallel_spec
    from reshard.formats.torch_bytes.torch_archive import TensorRef
    local = (ParamSpec("embed.weight", (11, 8)), ParamSpec("up.weight", (9, 8)))
    other = TensorRef(0, 400, "float32", (11, 8), (8, 1), 8, False)
    with pytest.raises(CheckpointError, match="tied to embed.weight"):
        tensor_parallel_spec(_tp1_tree({"vocab_parallel_lm_head": True}, other), "m.pt", 1, local)


def test_materialize_makes_one_tensor_of_a_tied_new_tensor():
    from reshard.formats.torch_bytes.torch_archive import NewTensor, materialize
    owner = NewTensor(("module", 0, "module"), 6, "float32", True, (3, 2))
    obj, roles = materialize({"embed.weight": owner, "lm_head.weight": owner, "up.weight": NewTensor(("m", 1), 4, "float32")})
    assert obj["embed.weight"] is obj["lm_head.weight"] and obj["up.weight"] is not obj["embed.weight"]
    assert sorted(roles.values()) == [("m", 1), ("module", 0, "module")]


def test_sub_parameter_metadata_is_read_and_recomputed():
    """A fused gate/up weight (two halves of 5 rows, each cut on its own) read from DeepSpeed's
    metadata; for another TP its affine map and sub_param_shard_widths are recomputed."""
    from deepspeed.checkpoint.affine import sub_param_map
    from reshard.formats.deepspeed_files.deepspeed_tensor import tensor_parallel_spec
    from reshard.formats.torch_bytes.torch_archive import TensorRef
    fused = TensorSplit("sub-parameter", 0, (10, 8), (5, 5))
    tree = _model_tree({"parameter_with_sub_params": [{"patterns": [r"^up\.weight$"], "shape": [(5, 5), -1],
                                                       "partition_dim": 0}],
                        "sub_param_shard_widths": {r"^up\.weight$": [[3, 2], [3, 2]]}})
    tree["universal_checkpoint_info"]["affine_map"]["params"][r"^up\.weight$"] = affine_map(fused, (10, 8), 2)
    tree["module"]["up.weight"] = TensorRef(0, 6 * 8 * 4, "float32", (6, 8), (8, 1), 0, False)
    tensor, params = tensor_parallel_spec(tree, "m.pt", 2, (ParamSpec("up.weight", (6, 8)),))
    assert params == (ParamSpec("up.weight", (10, 8)),) and tensor.params.splits == (fused,)
    info = tensor.universal_info(3)
    assert info["sub_param_shard_widths"] == {r"^up\.weight$": [[2, 2, 1], [2, 2, 1]]}
    assert info["affine_map"]["params"][r"^up\.weight$"] == sub_param_map((10, 8), [5, 5], [[2, 2, 1], [2, 2, 1]],
                                                                           0).to_dict()
    assert info["parameter_with_sub_params"] == tree["universal_checkpoint_info"]["parameter_with_sub_params"]


@pytest.mark.parametrize("weight, spec, dim", [((10, 8), [2, -1], 0), ((10, 8), [[4, 6], -1], 0), ((10, 8), [-1, 8], 0),
                                               ((12, 4), [3, -1, 4], 1), ((12, 4), [2, [2, 4], 4], 1),
                                               ((8, 6), [-1, [2, 4]], 1)])
def test_layer_spec_shape_resolves_as_deepspeed(weight, spec, dim):
    """At TP 1 the view and sub-parameter sizes come from the saved layer spec's `shape`
    (layers.py `_infer_subparam_logical_shapes`)."""
    from deepspeed.module_inject.layers import _infer_subparam_logical_shapes
    from reshard.formats.deepspeed_files.deepspeed_tensor import _shape_spec_view, _tuples
    logical, _, sizes, _ = _infer_subparam_logical_shapes(weight, _tuples(spec), dim)
    assert _shape_spec_view(weight, spec, dim, "m.pt") == (tuple(logical), tuple(sizes or (logical[dim],)))
