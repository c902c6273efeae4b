"""Pinned content of small tensor-parallel plans: every segment and round, as a digest.

    python -m pytest -q tests/test_plan_pinned.py

The planner's constant factors get tuned (bench/plan_cost.py --suite topology); its output must
not move. The digests were computed with the code before that tuning (commit 8c4c844). A
deliberate change of the plan (new segment order, other round windows) updates them, and says
so in its commit.
"""
from __future__ import annotations

import dataclasses
import hashlib

import numpy as np
import pytest

from reshard.planning.checkpoint_plan import plan_reshard
from reshard.formats.deepspeed_files.deepspeed_spec import CheckpointSpec
from reshard.layouts.zero import ParamSpec
from reshard.layouts.tensor_parallel import REPLICATED, TensorParallelParams, TensorParallelSpec, TensorSplit
from reshard.planning.plan import Stream
from reshard.topology import Topology

STREAMS = (Stream("fp32", "float32", 4), Stream("exp_avg", "float32", 4), Stream("exp_avg_sq", "float32", 4))


def _spec(layers: int, source: Topology) -> CheckpointSpec:
    """Megatron-like layers with uneven sizes (shards of unequal length, several distinct local
    layouts): qkv (column), o (row), fc1 (column) and its bias, fc2 (row), a norm (replicated)."""
    params, splits = [], []
    column, row = TensorSplit("column", 0), TensorSplit("row", 1)
    for layer in range(layers):
        h, f = 40 + 8 * layer, 100 + 12 * layer
        for name, shape, split in (("qkv", (3 * h, h), column), ("o", (h, h), row), ("fc1", (f, h), column),
                                   ("fc1_bias", (f,), column), ("fc2", (h, f), row), ("norm", (h,), REPLICATED)):
            params.append(ParamSpec(f"l{layer}.{name}", shape))
            splits.append(split)
    groups = (tuple(i for i, p in enumerate(params) if len(p.shape) == 2),
              tuple(i for i, p in enumerate(params) if len(p.shape) == 1))
    split = TensorParallelParams(tuple(p.name for p in params), tuple(p.shape for p in params), tuple(splits))
    return CheckpointSpec(stage=2, optimizer="zero", bf16_prefix=False, topology=source, params=tuple(params),
                          groups=groups, round_robin=False, param_alignment=1, sub_group_size=10**9,
                          lp_dtype="bfloat16", streams=STREAMS, tensor=TensorParallelSpec(split, split, {}, ()))


def _update(h, segments) -> None:
    for field in dataclasses.fields(segments):
        column = getattr(segments, field.name)
        h.update(field.name.encode())
        if column is not None:
            h.update(np.ascontiguousarray(column, dtype=np.int64).tobytes())


def _blocks_digest(plan) -> str:
    """What every worker sends and receives, round by round and peer by peer, and its buffer sizes."""
    h = hashlib.sha256()
    for worker in range(plan.ownership.workers):
        view = plan.worker_view(worker)
        h.update(repr(view.buffer_bytes()).encode())
        for r in range(plan.rounds):
            _, sends, receives = view.round(r)
            for kind, blocks in (("s", sends), ("r", receives)):
                for block in blocks:
                    h.update(f"{r}{kind}{block.peer};".encode())
                    _update(h, block.segments)
    return h.hexdigest()


def _digest(plan) -> str:
    """Every space's name, rounds and segment columns (values as int64, dtype-free)."""
    h = hashlib.sha256()
    for space in plan.spaces:
        h.update(f"{space.name} {space.rounds} {space.round_offset};".encode())
        _update(h, space.segments)
    return h.hexdigest()


CASES = {
    # (layers, source dp, tp, target dp, tp, workers, budget): (plan digest, every worker's
    # blocks digest), both computed before the tuning
    (6, 3, 4, 5, 2, 3, 1 << 16): (
        "1f83c2e7c626838ab7b53c1fafb1ed7f7b445c842fb7360de15920538e6f1f41",
        "d3da27587b48faa0afd88179f0a5bc16743117fc91ce3976be4eb0e47507fecd"),
    (6, 2, 2, 3, 2, 2, 1 << 15): (
        "9f5664e0676d5c7b5d880268a25f00ae13c2f6f2f428e8dde546f367d2b62dd2",
        "b1bb2834cb3f60392c24f0ecc47e315f7e33950ebecc7500a447077d384b3a15"),
    (4, 4, 2, 2, 4, 4, 1 << 20): (
        "1877d3ff836bdeec51074c6a6f213cd107169a62d8c5cb8049e5941f2d9e3dfa",
        "347e57828d69713e44104459f6f1f1972e01e6b14aa565120c0a822571ef0cf3"),
    (5, 3, 1, 2, 3, 5, 1 << 14): (
        "b210f86bef6652ef26c8bda5e146b6c59e69ffc5d291a15c8430fc93c060db85",
        "86b61b4860df2f43576fa230a3ed80013b5d60015e639557fd03a9e93a10da71"),
}


@pytest.mark.parametrize("case", list(CASES), ids=lambda c: "dp{1}tp{2}-dp{3}tp{4}-W{5}".format(*c))
def test_tensor_parallel_plan_content_is_pinned(case):
    layers, sdp, stp, tdp, ttp, workers, budget = case
    plan = plan_reshard(_spec(layers, Topology(dp=sdp, tp=stp)), Topology(dp=tdp, tp=ttp), workers, budget)
    assert all(len(space.segments) for space in plan.spaces)
    assert (_digest(plan), _blocks_digest(plan)) == CASES[case]
