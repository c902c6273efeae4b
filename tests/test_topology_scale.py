"""The planner with tensor- and expert-parallel layouts at thousands of ranks: metadata only, seconds.

    python -m pytest -q tests/test_topology_scale.py

Correctness element by element is the business of tests/test_strided.py and
tests/test_expert_parallel.py on small layouts; here the same code runs at sizes where a
per-row or per-(parameter x rank) step would show: every element is planned once, what one
worker sends and receives matches the plan's traffic, and a row-parallel weight costs
O(ZeRO ranges) segments, not O(rows). Times are measured in bench/plan_cost.py, not asserted
(beyond a bound that only a runaway would break).
"""
from __future__ import annotations

import time

import numpy as np

from reshard.planning.checkpoint_plan import plan_reshard
from reshard.layouts.experts import ExpertParams
from reshard.layouts.zero import ParamSpec, zero12_layout
from reshard.layouts.tensor_parallel import REPLICATED, TensorParallelParams, TensorParallelSpec, TensorSplit
from reshard.planning.plan import Stream
from reshard.topology import Topology

STREAMS = (Stream("fp32", "float32", 4), Stream("exp_avg", "float32", 4), Stream("exp_avg_sq", "float32", 4))


class _TensorParallelSpec:
    """The parts of an AutoTP ZeRO-2 CheckpointSpec the planner reads."""

    stage, experts, frozen = 2, None, ()
    streams = STREAMS
    module_streams = (Stream("module", "bfloat16", 2),)

    def __init__(self, params, splits, groups, topology):
        self.params, self.groups, self.topology = params, groups, topology
        split = TensorParallelParams(tuple(p.name for p in params), tuple(p.shape for p in params), splits)
        self.tensor = TensorParallelSpec(split, split, {}, ())

    def layout(self, world, tp=None, tp_rank=0):
        shapes = self.tensor.params.local_shapes(self.topology.tp if tp is None else tp, tp_rank)
        return zero12_layout([ParamSpec(p.name, s) for p, s in zip(self.params, shapes)], self.groups, world)


def _megatron(layers: int):
    """Per layer: qkv (column), o (row), fc1 (column) with its bias, fc2 (row), two norms (replicated)."""
    params, splits = [], []
    column, row = TensorSplit("column", 0), TensorSplit("row", 1)
    for layer in range(layers):
        for name, shape, split in (("qkv", (3 * 2048, 2048), column), ("o", (2048, 2048), row),
                                   ("fc1", (8192, 2048), column), ("fc1_bias", (8192,), column),
                                   ("fc2", (2048, 8192), row), ("norm1", (2048,), REPLICATED),
                                   ("norm2", (2048,), REPLICATED)):
            params.append(ParamSpec(f"l{layer}.{name}", shape))
            splits.append(split)
    groups = [tuple(i for i, p in enumerate(params) if len(p.shape) == 2),
              tuple(i for i, p in enumerate(params) if len(p.shape) == 1)]
    return tuple(params), tuple(splits), groups


def _one_worker(plan, worker: int) -> dict[int, tuple[int, int]]:
    """Space index -> (elements `worker` sends, elements it receives), round by round."""
    view = plan.worker_view(worker)
    moved = {index: [0, 0] for index in range(len(plan.spaces))}
    for r in range(plan.rounds):
        index, sends, receives = view.round(r)
        moved[index][0] += sum(b.elements for b in sends)
        moved[index][1] += sum(b.elements for b in receives)
    return {index: tuple(v) for index, v in moved.items()}


def test_tensor_parallel_plan_at_thousands_of_ranks_is_o_ranges():
    """700 parameters (100 Megatron layers, 1.5e10 elements), TP 8 x dp 256 (2,048 ranks) ->
    TP 4 x dp 1,024 (4,096 ranks), W = 256: shards recut on both sides, row-parallel strided."""
    params, splits, groups = _megatron(100)
    spec = _TensorParallelSpec(params, splits, groups, Topology(dp=256, tp=8))
    started = time.perf_counter()
    plan = plan_reshard(spec, Topology(dp=1024, tp=4), workers=256, budget_bytes=256 << 20)
    optim, module = plan.spaces
    seg = optim.segments
    replicated_extra = sum(p.numel for p, s in zip(params, splits) if s.dim is None) * (4 - 1)
    assert int(seg.length.sum()) == sum(p.numel for p in params) + replicated_extra
    assert int(module.segments.length.sum()) == sum(p.numel for p in params) + replicated_extra
    assert seg.strided
    rows = sum(p.shape[0] for p, s in zip(params, splits) if s.kind == "row")
    strided = int((seg.width < seg.width.max()).sum())
    assert 0 < strided < rows // 10     # per ZeRO range and strip: 409,600 rows would be >= 409,600 segments
    for worker in (0, 255):
        moved = _one_worker(plan, worker)
        for index, space in enumerate(plan.spaces):
            read, _, _, written = space.traffic(plan.ownership)[worker]
            assert moved[index][0] * space.bytes_per_element == read
            assert moved[index][1] * space.bytes_per_element == written
        assert moved[0][1] > 0
    assert time.perf_counter() - started < 120


class _ExpertSpec:
    """The parts of a native-MoE ZeRO-2 CheckpointSpec the planner reads."""

    stage, tensor, frozen = 2, None, ()
    streams = STREAMS

    def __init__(self, params, groups, experts, topology):
        self.params, self.groups, self.experts, self.topology = params, groups, experts, topology

    def layout(self, topology):
        from reshard.layouts.experts import expert_zero12_layout
        return expert_zero12_layout(self.params, self.groups, self.experts, topology)


def test_expert_parallel_plan_at_thousands_of_ranks():
    """64 experts x 48 layers (9,216 expert tensors), ep 64 over dp 2,048 -> ep 32 over dp 4,096, W = 512."""
    slot = ".deepspeed_moe.experts.deepspeed_experts."
    prefixes = [f"moe.{layer}{slot}" for layer in range(48)]
    params = [ParamSpec("embed", (32000, 1024)), ParamSpec("norm", (1024,))]
    groups = [(0,), (1,)]
    ids = []
    for prefix in prefixes:
        for expert in range(64):
            for k, shape in enumerate(((2048, 1024), (1024, 2048), (2048, 1024))):
                ids.append(len(params))
                params.append(ParamSpec(f"{prefix}{expert}.w{k}", shape))
    groups.append(tuple(ids))
    experts = ExpertParams.of(params, (False, False, True), [64] * 48, prefixes)
    spec = _ExpertSpec(tuple(params), groups, experts, Topology(dp=2048, ep=64))
    started = time.perf_counter()
    plan = plan_reshard(spec, Topology(dp=4096, ep=32), workers=512, budget_bytes=256 << 20)
    (space,) = plan.spaces
    assert int(space.segments.length.sum()) == sum(p.numel for p in params)
    traffic = space.traffic(plan.ownership)
    for worker in (0, 511):
        sent, received = _one_worker(plan, worker)[0]
        assert sent * 12 == traffic[worker][0] and received * 12 == traffic[worker][3] and received > 0
    expert_sources = np.unique(space.segments.src_rank[space.segments.logical >= params[0].numel + params[1].numel])
    assert len(expert_sources) == 2048     # every source rank holds a share of some EP rank's experts
    assert time.perf_counter() - started < 120


class _DataParallelSpec:
    """The parts of a plain ZeRO-2 CheckpointSpec the planner reads."""

    stage, tensor, experts, frozen = 2, None, None, ()
    streams = STREAMS

    def __init__(self, params, topology):
        self.params, self.groups, self.topology = params, [tuple(range(len(params)))], topology

    def layout(self, topology):
        return zero12_layout(self.params, self.groups, topology.dp)


def test_table_rounds_are_cut_per_worker_and_round_not_up_front(monkeypatch):
    """16 parameters of 2^26 elements, 4,096 -> 8,192 ranks, W = 8, a budget that gives 64-element
    windows: ~2,000 rounds of 8,192 window parts each (1.7e7 segments) if cut up front. Planning
    cuts nothing (`cut_at_windows` is never called); a worker cuts its own rounds one by one and
    they add up to its traffic."""
    import reshard.planning.plan

    def cut_up_front(*args):
        raise AssertionError("the whole plan was cut")
    monkeypatch.setattr(reshard.planning.plan, "cut_at_windows", cut_up_front)
    params = tuple(ParamSpec(f"w{i}", (1 << 13, 1 << 13)) for i in range(16))
    spec = _DataParallelSpec(params, Topology(dp=4096))
    budget = 3 * 12 * 1024 * 64
    plan = plan_reshard(spec, Topology(dp=8192), workers=8, budget_bytes=budget)
    (space,) = plan.spaces
    assert space.windows.window == 64 and plan.rounds >= 2000 and not space.windows.packed
    total = sum(p.numel for p in params)
    assert sum(plan.round_bytes()) == total * 12 and len(space.table) < 20_000
    traffic = space.traffic(plan.ownership)
    view = plan.worker_view(5)
    largest = view.buffer_bytes()
    sent = received = 0
    for r in range(plan.rounds):
        _, sends, receives = view.round(r)
        s, g = sum(b.elements for b in sends) * 12, sum(b.elements for b in receives) * 12
        assert s <= budget // 3 and g <= budget // 3
        sent, received = sent + s, received + g
    assert (sent, received) == (traffic[5][0], traffic[5][3])
    assert largest == (budget // 3, budget // 3)
