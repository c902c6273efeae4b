"""Expert parallelism (issue 10): native DeepSpeed MoE and AutoEP checkpoints resharded for another (dp, ep).

    python -m pytest -q tests/test_expert_parallel.py -m "not e2e"   # planner and refusals, seconds
    python -m pytest -q tests/test_expert_parallel.py                # + real DeepSpeed, ~4 min idle

Planner tests need no torch: DeepSpeed's rank arithmetic for expert groups, the global-expert
layout tiling its space, and a simulated move of every element through a plan between two
(dp, ep) layouts. End to end: `deepspeed.moe.layer.MoE` (4 experts x 2 layers, top-2, four param
groups) is trained on CPU ranks (reshard_proof.moe_run), resharded with W workers (W differs
from both world sizes where it can), and loaded with plain `engine.load_checkpoint` at the
target (dp, ep); every element of the fp32 masters and optimizer states, named by GLOBAL expert
id and merged over ranks, must equal the truth, the eval loss must be close, one more step finite.
Some sources are also loaded in-job by `reshard.deepspeed.load_checkpoint` at another (dp, ep).
AutoEP (reshard_proof.moe_model.AutoEPProofModel, experts fused per EP rank) runs through the
same matrix, with DeepSpeed's own plain and universal loads judged in the same job.
Launches are what cost: the sources are trained with one launch per (ep, world) (`moe_trained`),
and every test's loads at one (ep, world) are judged in one launch, each in a fresh engine of
its own variant (`moe_cases`); the folded TP+EP tests likewise (`folded_cases`).
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from reshard.errors import CheckpointError, OptionError, TopologyError, UnsupportedCheckpoint
from reshard.layouts.experts import ExpertParams, expert_placement_lines, expert_zero12_layout
from reshard.layouts.expert_placement import ExpertPlacement, expert_name_parts, with_expert_index
from reshard.layouts.zero import ParamSpec, buffer_numels
from reshard.planning.plan import Ownership, Stream, plan_space
from reshard.topology import Topology
from trained import JudgedCase, judge_cases

SLOT = ".deepspeed_moe.experts.deepspeed_experts."


# --- placement and DeepSpeed's rank arithmetic -------------------------------------------------

def deepspeed_expert_groups(world: int, ep: int) -> tuple[list[list[int]], list[list[int]]]:
    """EP groups and expert-data-parallel groups as utils/groups.py `_create_expert_and_data_parallel`
    builds them without model parallelism (its legacy E+D path), restated from its loops."""
    expert_dp = [list(range(j, world, ep)) for j in range(ep)]
    expert_parallel = [list(range(i * ep, (i + 1) * ep)) for i in range(world // ep)]
    return expert_parallel, expert_dp


@pytest.mark.parametrize("world,ep", [(1, 1), (2, 1), (2, 2), (4, 2), (4, 4), (8, 2), (8, 4), (6, 3)])
def test_topology_expert_ranks_match_deepspeed_groups(world, ep):
    topology = Topology(dp=world, ep=ep)
    expert_parallel, expert_dp = deepspeed_expert_groups(world, ep)
    for group in expert_parallel:
        assert [topology.expert_parallel_rank(r) for r in group] == list(range(ep))
    for group in expert_dp:
        assert [topology.expert_data_parallel_rank(r) for r in group] == list(range(world // ep))
        assert len({topology.expert_parallel_rank(r) for r in group}) == 1
    for rank in range(world):
        assert topology.expert_dp_rank_of(topology.expert_parallel_rank(rank),
                                          topology.expert_data_parallel_rank(rank)) == rank


def test_measured_groups_at_world_4_ep_2():
    # Printed by DeepSpeed 0.19.8 on 4 CPU ranks: EP groups [0,1],[2,3], expert-DP groups [0,2],[1,3].
    topology = Topology(dp=4, ep=2)
    assert [topology.expert_parallel_rank(r) for r in range(4)] == [0, 1, 0, 1]
    assert [topology.expert_data_parallel_rank(r) for r in range(4)] == [0, 0, 1, 1]


@given(st.integers(1, 8), st.integers(1, 6))
def test_placement_local_global_round_trip(ep, local_count):
    placement = ExpertPlacement(ep * local_count, ep)
    seen = set()
    for e in range(ep):
        for j in range(local_count):
            g = placement.global_expert(e, j)
            assert (placement.ep_rank_of(g), placement.local_of(g)) == (e, j)
            seen.add(g)
    assert seen == set(range(ep * local_count))


def test_expert_names():
    name = f"blocks.3.moe{SLOT}12.fc1.weight"
    assert expert_name_parts(name) == (f"blocks.3.moe{SLOT}", 12, ".fc1.weight")
    assert with_expert_index(name, 2) == f"blocks.3.moe{SLOT}2.fc1.weight"
    assert expert_name_parts("blocks.3.moe.deepspeed_moe.gate.wg.weight") is None


def test_placement_refuses_what_deepspeed_cannot_build():
    with pytest.raises(ValueError):
        ExpertPlacement(4, 3)


# --- the layout over global experts, and plans between layouts ---------------------------------

def synthetic_moe(layers: int, experts: int, dense_shapes, expert_shapes):
    """A spec-like model: dense groups (decay, no_decay), then expert groups (decay, no_decay),
    expert params in layer, global expert, param order, as reshard's inspect lays them out."""
    prefixes = [f"moe.{layer}{SLOT}" for layer in range(layers)]
    params = [ParamSpec(f"dense{i}", shape) for i, shape in enumerate(dense_shapes)]
    groups = [tuple(i for i, p in enumerate(params) if len(p.shape) >= 2),
              tuple(i for i, p in enumerate(params) if len(p.shape) < 2)]
    for want_matrix in (True, False):
        ids = []
        for prefix in prefixes:
            for g in range(experts):
                for k, shape in enumerate(expert_shapes):
                    if (len(shape) >= 2) == want_matrix:
                        ids.append(len(params))
                        params.append(ParamSpec(f"{prefix}{g}.p{k}", shape))
        groups.append(tuple(ids))
    expert = ExpertParams.of(params, (False, False, True, True), [experts] * layers, prefixes)
    return params, groups, expert


def _held_values(layout, numels_total):
    """Per (rank, buffer): an int array of the logical element at each position (-1: padding)."""
    sizes = buffer_numels(layout)
    held = {(r, b): np.full(size, -1, np.int64) for r in range(layout.world_size) for b, size in enumerate(sizes)}
    pieces = layout.pieces
    for start, rank, buffer, offset, length in zip(pieces.start, pieces.rank, pieces.buffer, pieces.offset,
                                                   pieces.length):
        held[(int(rank), int(buffer))][offset:offset + length] = np.arange(start, start + length)
    return held


moe_models = st.builds(
    synthetic_moe, layers=st.integers(1, 3), experts=st.sampled_from([2, 4, 8]),
    dense_shapes=st.lists(st.sampled_from([(3, 5), (7,), (11, 2), (1,)]), min_size=1, max_size=4),
    expert_shapes=st.lists(st.sampled_from([(5, 3), (3,), (2, 7), (9,)]), min_size=1, max_size=3))
topologies = st.sampled_from([(1, 1), (2, 1), (2, 2), (3, 1), (4, 2), (4, 4), (6, 2), (8, 4), (8, 8)])


@settings(max_examples=60, deadline=None)
@given(moe_models, topologies)
def test_layout_holds_each_element_once_on_its_experts_rank(model, sizes):
    params, groups, experts = model
    dp, ep = sizes
    if experts.ep_problem(ep):
        return
    topology = Topology(dp=dp, ep=ep)
    layout = expert_zero12_layout(params, groups, experts, topology)
    total = sum(p.numel for p in params)
    held = _held_values(layout, total)
    values = np.concatenate([v[v >= 0] for v in held.values()])
    assert np.array_equal(np.sort(values), np.arange(total))  # every element exactly once
    bases = np.concatenate(([0], np.cumsum([p.numel for p in params])))
    for (rank, _), positions in held.items():
        for element in positions[positions >= 0]:
            pid = int(np.searchsorted(bases, element, side="right") - 1)
            if experts.expert_of[pid] is not None:  # an expert sits on the EP rank of its block
                assert experts.ep_rank_of(pid, ep) == topology.expert_parallel_rank(rank)
    for rank in range(dp):  # partition_count per group: dp for dense, dp // ep for experts
        assert [g.world_size for g, _ in layout.rank_groups(rank)] == [dp, dp, dp // ep, dp // ep]


@settings(max_examples=40, deadline=None)
@given(moe_models, topologies, topologies, st.integers(1, 5), st.sampled_from([64, 512, 1 << 20]))
def test_plan_moves_every_element_to_its_target_place(model, old_sizes, new_sizes, workers, budget):
    params, groups, experts = model
    if experts.ep_problem(old_sizes[1]) or experts.ep_problem(new_sizes[1]):
        return
    old = expert_zero12_layout(params, groups, experts, Topology(*old_sizes[:1], ep=old_sizes[1]))
    new = expert_zero12_layout(params, groups, experts, Topology(*new_sizes[:1], ep=new_sizes[1]))
    total = sum(p.numel for p in params)
    source, wanted = _held_values(old, total), _held_values(new, total)
    got = {key: np.full(len(v), -1, np.int64) for key, v in wanted.items()}
    ownership = Ownership.between(old.topology, new.topology, workers)
    space = plan_space("optim", old.pieces, new.pieces, (Stream("fp32", "float32", 4),), buffer_numels(new),
                       ownership, budget)
    s = space.segments
    for i in range(len(s)):
        n = int(s.length[i])
        src = source[(int(s.src_rank[i]), int(s.src_buffer[i]))][s.src_offset[i]:s.src_offset[i] + n]
        dst = got[(int(s.dst_rank[i]), int(s.dst_buffer[i]))]
        assert np.all(dst[s.dst_offset[i]:s.dst_offset[i] + n] == -1), "an element written twice"
        dst[s.dst_offset[i]:s.dst_offset[i] + n] = src
    for key in wanted:
        assert np.array_equal(got[key], wanted[key]), key


def test_plan_at_scale_64_experts_48_layers_hundreds_of_ranks():
    """About 10^4 expert tensors (issue 10), dp 256 ep 64 -> dp 512 ep 32: metadata only, well
    under a second here (timed in the planner benchmark, not asserted)."""
    params, groups, experts = synthetic_moe(48, 64, [(4096, 1024), (1024,), (32000, 1024)],
                                            [(2048, 1024), (1024, 2048), (1024, 2048)])
    old = expert_zero12_layout(params, groups, experts, Topology(dp=256, ep=64))
    new = expert_zero12_layout(params, groups, experts, Topology(dp=512, ep=32))
    space = plan_space("optim", old.pieces, new.pieces, (Stream("fp32", "float32", 4),), buffer_numels(new),
                       Ownership.between(old.topology, new.topology, 64), 1 << 30)
    assert len(params) > 9000
    assert int(space.segments.length.sum()) == sum(p.numel for p in params)
    expert_sources = space.segments.src_rank[space.segments.logical >= sum(p.numel for p in params[:3])]
    assert len(set(expert_sources.tolist())) == 256  # every source rank holds some experts


def test_slice_mappings_use_local_names_and_expert_partition_counts():
    from reshard.formats.deepspeed_files.deepspeed_metadata import rank_metadata
    from reshard.formats.deepspeed_files.deepspeed_spec import CheckpointSpec
    params, groups, experts = synthetic_moe(2, 4, [(3, 5)], [(5, 3), (3,)])
    spec = CheckpointSpec(2, "zero", False, Topology(dp=4, ep=2), tuple(params), tuple(groups), False, 1,
                          10 ** 9, "float32", (), experts=experts)
    layout = spec.layout(Topology(dp=4, ep=2))
    meta = rank_metadata(spec, layout, 3)  # EP rank 1 (global experts 2, 3), expert-DP rank 1
    assert meta.partition_count == [4, 4, 2, 2]
    names = [name for name, _, _ in meta.slice_mappings[2]]
    assert names and all(expert_name_parts(n)[1] in (0, 1) for n in names)  # local ids, never 2 or 3
    lines = expert_placement_lines(experts, Topology(dp=4, ep=2))
    assert "EP rank 1: experts 2-3" in lines[0] and "[0,2] [1,3]" in lines[-1]


# --- ZeRO-0: whole tensors per parameter, placed by their position in the group -------------------

EXPERT_SHAPES = [(9, 7), (9,), (7, 9), (7,)]  # fc1.weight, fc1.bias, fc2.weight, fc2.bias (moe_model.Expert)


def test_zero0_counts_from_shapes_and_holes():
    from reshard.layouts.zero0_expert_groups import solve_per_expert_counts
    decay = [(9, 7), (7, 9)] * 4  # 2 layers x 2 local experts, the matrices of each
    assert solve_per_expert_counts(decay, [EXPERT_SHAPES] * 2, [2, 2]) == (2, 2)
    holes = list(decay)
    holes[2] = holes[5] = None  # parameters that never got a gradient have no optimizer state
    assert solve_per_expert_counts(holes, [EXPERT_SHAPES] * 2, [2, 2]) == (2, 2)
    # one layer in the group only: the other contributes nothing
    assert solve_per_expert_counts([(9,), (7,)] * 2, [[(3, 3)], EXPERT_SHAPES], [2, 2]) == (0, 2)
    with pytest.raises(ValueError, match="do not split"):
        solve_per_expert_counts([(9, 7), (5, 5)] * 4, [EXPERT_SHAPES] * 2, [2, 2])
    with pytest.raises(ValueError, match="more than one way"):  # nothing known: (2, 2), (4, 0), (0, 4) all fit
        solve_per_expert_counts([None] * 8, [EXPERT_SHAPES] * 2, [2, 2])


@given(st.lists(st.integers(0, 3), min_size=1, max_size=3), st.sampled_from([1, 2, 4]), st.sampled_from([1, 2, 4]))
def test_zero0_group_order_moves_each_parameter_to_its_experts_place(counts, source_ep, target_ep):
    from reshard.layouts.zero0_expert_groups import GroupOrder
    order = GroupOrder(tuple(counts), (4,) * len(counts))
    source = {(e, p): entry for e in range(source_ep) for p, entry in enumerate(order.entries(source_ep, e))}
    assert all(len(order.entries(source_ep, e)) == order.length(source_ep) for e in range(source_ep))
    seen = set()
    for rank in range(target_ep):
        for entry, place in zip(order.entries(target_ep, rank), order.sources(source_ep, target_ep, rank)):
            assert source[place] == entry  # same (layer, global expert, k) at both ends
            layer, expert, _ = entry
            assert ExpertPlacement(4, target_ep).ep_rank_of(expert) == rank
            seen.add(place)
    assert seen == set(source)  # every source parameter lands exactly once


@pytest.mark.parametrize("source_ep, dp, ep", [(2, 2, 1), (1, 2, 2), (2, 4, 2), (2, 4, 4), (4, 4, 1)])
def test_zero0_in_job_ownership_writes_each_file_on_a_rank_that_loads_it(source_ep, dp, ep):
    """The in-job ZeRO-0 MoE load (reshard.deepspeed._load_zero0_moe): target EP rank e's file is written
    by a job rank of EP rank e, the model-states file by a rank writing nothing else where there is one,
    and every source EP rank has a reader."""
    from reshard.deepspeed import zero0_in_job_ownership
    target = Topology(dp=dp, ep=ep)
    own = zero0_in_job_ownership(source_ep, target, dp)
    assert (own.source_ranks, own.target_ranks) == (source_ep, ep + 1)
    assert all(target.expert_parallel_rank(own.writer(e)) == e for e in range(ep))
    assert sorted(r for w in range(dp) for r in own.source_ranks_of(w)) == list(range(source_ep))
    model_writer = own.writer(ep)
    assert (model_writer not in [own.writer(e) for e in range(ep)]) == (dp > ep)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=2), st.integers(0, 3), st.sampled_from([1, 2, 4]),
       st.sampled_from([1, 2, 4]), st.integers(1, 3), st.data())
def test_zero0_pieces_move_each_parameter_to_its_place_in_every_target_file(counts, dense, source_ep, target_ep,
                                                                          workers, data):
    """The lowering of a ZeRO-0 MoE save (layouts/zero0_expert_groups.zero0_pieces, one buffer per
    parameter): a dense group and an expert group of random per-expert counts, each parameter of random
    size (0: no optimizer state), every source buffer filled with its own values, `plan.intersect`'s
    segments run as copies. Each target EP rank's buffer b holds the source parameter `GroupOrder`
    places there (the model-states file's rank, EP rank 0's), dense parameters from source EP rank 0;
    each element is read once per target copy (dense: every target rank and the model file; an
    expert: its one rank, and the model file's when that is rank 0). plan_zero0_moe keeps its budget."""
    from types import SimpleNamespace

    from reshard.layouts.zero0_expert_groups import GroupOrder, Zero0Space, target_places, zero0_pieces
    from reshard.planning.checkpoint_plan import plan_zero0_moe
    from reshard.planning.plan import intersect
    order = GroupOrder(tuple(counts), (4,) * len(counts))
    orders, lengths = (None, order), (dense, order.length(source_ep))
    numels = tuple(tuple(tuple(data.draw(st.integers(0, 5)) for _ in range(length)) for length in lengths)
                   for _ in range(source_ep))
    held = {(e, g * lengths[0] + p if g else p): 1000.0 * (e + 1) + 100 * g + 10 * p + np.arange(n) / 10
            for e in range(source_ep) for g in range(2) for p, n in enumerate(numels[e][g])}
    old, new, sizes = zero0_pieces(numels, orders, lengths, source_ep, target_ep)
    segments = intersect(old, new)
    moved, reads = {}, {key: np.zeros(len(v), dtype=np.int64) for key, v in held.items()}
    for src_rank, src_buffer, src_offset, dst_rank, dst_buffer, dst_offset, length in zip(
            segments.src_rank, segments.src_buffer, segments.src_offset, segments.dst_rank, segments.dst_buffer,
            segments.dst_offset, segments.length):
        source = held[int(src_rank), int(src_buffer)]
        target = moved.setdefault((int(dst_rank), int(dst_buffer)), np.full(sizes[dst_buffer], np.nan))
        target[dst_offset:dst_offset + length] = source[src_offset:src_offset + length]
        reads[int(src_rank), int(src_buffer)][src_offset:src_offset + length] += 1
    wanted_reads = {key: 0 for key in held}
    for rank in range(target_ep + 1):
        for buffer, (g, e, p) in enumerate(target_places(orders, lengths, source_ep, target_ep,
                                                         rank if rank < target_ep else 0)):
            key = (e, g * lengths[0] + p if g else p)
            if numels[e][g][p] == 0:
                assert (rank, buffer) not in moved
                continue
            np.testing.assert_array_equal(moved[rank, buffer][:numels[e][g][p]], held[key])
            wanted_reads[key] += 1
            if g:
                assert ExpertPlacement(4, target_ep).ep_rank_of(order.entries(source_ep, e)[p][1]) == \
                    (rank if rank < target_ep else 0)
    for (e, buffer), count in wanted_reads.items():
        if buffer < lengths[0]:  # dense: from EP rank 0 into every target rank and the model file
            expected = target_ep + 1 if e == 0 else 0
        else:  # an expert: into its target rank, and the model file too when that is rank 0
            expert = order.entries(source_ep, e)[buffer - lengths[0]][1]
            expected = 2 if ExpertPlacement(4, target_ep).ep_rank_of(expert) == 0 else 1
        if len(held[e, buffer]):
            assert count == expected, (e, buffer)
        assert (reads[e, buffer] == expected).all(), (e, buffer)
    spec = SimpleNamespace(topology=Topology(dp=4, ep=source_ep), orders=orders, group_lengths=lengths,
                           spaces=(Zero0Space("optim", (Stream("exp_avg", "float32", 4),), numels),))
    plan = plan_zero0_moe(spec, Topology(dp=4, ep=target_ep), workers, budget_bytes=256)
    assert plan.ownership.target_ranks == target_ep + 1 and max(plan.round_bytes(), default=0) <= 256


def test_file_shares_split_whole_files_over_workers():
    from reshard.planning.file_shares import file_shares
    sizes = {f"layer_{layer}_expert_{e}_mp_rank_00_model_states.pt": 1000 + e for layer in range(2) for e in range(8)}
    sizes["metrics.json"] = 5
    for workers in (1, 2, 3, 5, 40):
        shares = file_shares(sizes, workers)
        assert len(shares) == workers and file_shares(dict(reversed(sizes.items())), workers) == shares
        names = [name for share in shares for name in share]
        assert sorted(names) == sorted(sizes)  # each exactly once
        loads = [sum(sizes[n] for n in share) for share in shares]
        assert max(loads) - min(loads) <= max(sizes.values())  # balanced by bytes
    assert file_shares(sizes, 3)[0] != file_shares(sizes, 3)[1]


# --- end to end with real DeepSpeed ------------------------------------------------------------

class MoeSources:
    """(variant, ep, world) -> (save_dir, truth), trained once per session; `train_many` trains
    several at one (ep, world) in one launch."""

    def __init__(self, root):
        self.root, self.cache, self.failed = root, {}, {}

    def _paths(self, key):
        base = self.root / "{}-ep{}-w{}".format(*key)
        base.mkdir(parents=True, exist_ok=True)
        return base / "ckpt", base / "truth.pt"

    def train_many(self, keys) -> None:
        """Train every key not trained yet, one launch per (ep, world) whatever the variant
        (reshard_proof.moe_run train --save: a fresh engine each), since the launch is what costs.
        Should a shared launch fail, each of its keys is trained alone when first asked for; a
        launch of one key that failed is raised by each later call for it."""
        from reshard_proof.launch import train_moe_checkpoints
        by_size: dict[tuple[int, int], list[tuple]] = {}
        for key in keys:
            if key not in self.cache and key not in self.failed and key not in by_size.get(key[1:], []):
                by_size.setdefault(key[1:], []).append(key)
        for (ep, world), group in by_size.items():
            try:
                train_moe_checkpoints(ep, world, [(key[0], *self._paths(key)) for key in group])
            except Exception as error:  # noqa: BLE001 (raised for each key by __call__)
                if len(group) == 1:
                    self.failed[group[0]] = error
                continue
            self.cache.update({key: self._paths(key) for key in group})

    def __call__(self, variant: str, ep: int, world: int):
        key = (variant, ep, world)
        if key in self.failed:
            raise self.failed[key]
        if key not in self.cache:
            self.train_many([key])
            if key in self.failed:
                raise self.failed[key]
        return self.cache[key]


# the MoE sources each end-to-end test uses (its `source_key` parameter where it has one)
MOE_NEEDS = {
    "test_moe_reshard_loads_exactly": (), "test_zero0_moe_reshard_loads_exactly": (),
    "test_autoep_round_trip_is_byte_identical": (),
    "test_moe_identity_and_round_trip_reproduce_the_source": (("moe_z2_fp32", 2, 2),),
    "test_moe_refusals_name_the_file": (("moe_z2_fp32", 2, 2),),
    "test_zero0_moe_round_trip_and_dry_run": (("moe_z0_fp32", 2, 2),),
    "test_moe_universal_oracle_at_another_dp": (("moe_z1_fp32", 1, 2),),
    "test_zero0_moe_output_bytes_are_pinned": (("moe_z0_fp32", 2, 2), ("moe_z0_bf16", 1, 2)),
    "test_zero0_moe_by_rounds_within_a_budget_reads_each_source_byte_once": (("moe_z0_fp32", 2, 2),
                                                                             ("moe_z0_bf16", 1, 2)),
    "test_zero0_moe_killed_mid_rounds_under_torchrun_resumes_to_the_pinned_bytes": (("moe_z0_fp32", 2, 2),),
    "test_zero0_moe_parameters_with_other_states_are_refused_naming_the_file": (("moe_z0_fp32", 2, 2),),
    "test_moe_array_tasks_publish_the_collective_output": (),
    "test_zero0_moe_node_local_writes_each_node_what_its_ranks_load": (("moe_z0_fp32", 2, 2),),
    "test_zero0_moe_exports_are_refused_by_name": (("moe_z0_fp32", 2, 2),),
}


@pytest.fixture(scope="module")
def moe_trained(request, moe_sources):
    """The session's MoeSources (conftest `moe_sources`), with the sources of this session's tests in this
    module trained first, in one launch per (ep, world)."""
    from trained import selected_tests
    sources = moe_sources
    keys = []
    for test, source_key in selected_tests(request, MOE_NEEDS):
        keys += [source_key] if source_key is not None else list(MOE_NEEDS[test])
    sources.train_many(keys)
    return sources


def _reshard(source, destination, dp: int, ep: int, workers: int):
    from trained import reshard_in_threads
    return reshard_in_threads(source, destination, dp, workers, target_ep=ep)


class Load(NamedTuple):
    """One checkpoint to load at (ep, world) in a fresh engine of `variant`, judged against `truth`;
    `how`: native, in_job (reshard.deepspeed.load_checkpoint) or universal (load_universal);
    `role` says what its test expects of the verdict."""
    ep: int
    world: int
    variant: str
    truth: Path
    how: str
    load_dir: Path
    verdict: Path
    role: str = "exact"


class MoeCase(JudgedCase):
    """One end-to-end MoE test's reshards (made and checked by its `prepare` function in the
    shared fixture) and the loads it wants judged (tests/trained.py JudgedCase)."""

    def load(self, ep, world, variant, truth, load_dir, name, how="native", role="exact") -> Load:
        load = Load(ep, world, variant, truth, how, load_dir, self.root / f"{name}.json", role)
        self.loads.append(load)
        return load


def _convert(case: MoeCase, source, out, name_latest: bool = False) -> None:
    """Have DeepSpeed's ds_to_universal.py (`--inject_missing_state`) convert `source`'s latest tag
    into out/TAG before the case's loads are judged (`_convert_all`); `name_latest`: and write
    out/latest_universal naming TAG."""
    case.values.setdefault("conversions", []).append((source, out, name_latest))


def _convert_all(cases) -> None:
    """Every conversion (`_convert`) of every case prepared without error, in one process
    (reshard_proof.ds_universal `ds_to_universal_all`), since importing DeepSpeed is most of what
    one costs. A case whose conversion failed gets that as its error (its test raises it)."""
    from reshard_proof.ds_universal import ds_to_universal_all
    jobs = [(case, source, out, name_latest, (source / "latest").read_text()) for case in cases.values()
            if case.error is None for source, out, name_latest in case.values.get("conversions", [])]
    try:
        failures = ds_to_universal_all([(source / tag, out / tag) for _, source, out, _, tag in jobs]) if jobs else {}
    except Exception as error:  # noqa: BLE001 (a timeout, say: raised by each case's test)
        failures = {str(out / tag): repr(error) for _, _, out, _, tag in jobs}
    for case, source, out, name_latest, tag in jobs:
        why = failures.get(str(out / tag))
        if why is not None:
            case.error = case.error or AssertionError(f"ds_to_universal.py on {source / tag}: {why}")
        elif name_latest:
            (out / "latest_universal").write_text(tag)


@pytest.fixture(scope="module")
def moe_cases(request, moe_trained, tmp_path_factory):
    """{(test name, source_key): MoeCase} of the selected end-to-end MoE load tests, all judged
    together: every load at one (ep, world) in ONE launch, whatever its source and variant
    (reshard_proof.launch.check_moe_together), since the launch is what costs; every case's
    ds_to_universal.py conversions before that, in one process (`_convert_all`). Each test then
    asserts on its own verdicts; what failed while preparing or judging a case fails its test only."""
    from trained import selected_tests

    from reshard_proof.launch import check_moe_together
    cases: dict[tuple, MoeCase] = {}
    for key in selected_tests(request, PREPARE):
        case = cases[key] = MoeCase(tmp_path_factory.mktemp("moe-case"))
        try:
            PREPARE[key[0]](moe_trained, case, key[1])
        except Exception as error:  # noqa: BLE001 (raised by the test that owns the case)
            case.error = error
    _convert_all(cases)  # before judging: some loads read a conversion
    judge_cases(cases, lambda loads: check_moe_together(loads, timeout=1800))
    return cases


def _assert_ok(verdict):
    assert verdict["ok"], "\n".join([verdict.get("load_error") or ""] + verdict["mismatches"][:20])
    assert verdict["checked_tensors"] >= 150


def _load_tree(path):
    """A file's content, DeepSpeed's pickled objects (the loss scaler) as (class name, attributes)."""
    from reshard.formats.deepspeed_files import deepspeed_schema as schema

    def plain(obj):
        if isinstance(obj, dict):
            return type(obj)((k, plain(v)) for k, v in obj.items())
        if isinstance(obj, list):
            return [plain(v) for v in obj]
        if hasattr(obj, "__dict__") and not isinstance(obj, torch.Tensor):
            return type(obj).__name__, plain(vars(obj))
        return obj
    with torch.serialization.safe_globals(schema.safe_globals()):
        return plain(torch.load(path, map_location="cpu", weights_only=True))


# source (variant, ep, world) -> targets [(ep, world, workers)]: DP change with EP fixed, EP change
# with the world fixed, both; ZeRO-1 and ZeRO-2, fp32 and bf16, BF16_Optimizer.
E2E = {
    ("moe_z2_fp32", 2, 2): [(1, 2, 3), (2, 4, 3), (4, 4, 3)],
    ("moe_z1_fp32", 1, 2): [(2, 2, 3), (2, 4, 3)],
    ("moe_bf16_optimizer", 2, 2): [(1, 2, 3), (2, 4, 3)],
    ("moe_z2_bf16", 4, 4): [(2, 2, 3)],
    # AutoEP (fused experts, ds_autoep_layers recomputed): EP change, DP change, BF16_Optimizer.
    ("autoep_z2_fp32", 2, 2): [(1, 2, 3), (2, 4, 3)],
    ("autoep_bf16_optimizer", 2, 2): [(1, 2, 1)],
    # AutoEP ZeRO-3 (zero3_partitioned: no expert files, experts chunked over expert-DP groups).
    ("autoep_z3_fp32", 2, 4): [(1, 2, 3)],
}
# In the same check jobs: the source loaded by reshard.deepspeed.load_checkpoint, which reshards
# in the job to the engine's (dp, ep).
IN_JOB = {("moe_z2_fp32", 2, 2): [(1, 2), (2, 4)], ("moe_bf16_optimizer", 2, 2): [(2, 4)],
          ("autoep_z2_fp32", 2, 2): [(1, 2)], ("autoep_z3_fp32", 2, 4): [(1, 2)]}


def _prepare_moe_loads(moe_trained, case: MoeCase, source_key) -> None:
    """Reshard the source to each of its E2E targets (file names checked), add the negative
    controls and DeepSpeed's own loads, and say what to judge where."""
    variant, _, _ = source_key
    source, truth = moe_trained(*source_key)
    tmp_path = case.root
    for ep, world, workers in E2E[source_key]:
        destination = tmp_path / f"ep{ep}-w{world}"
        result = _reshard(source, destination, world, ep, workers)
        assert result.checkpoints[0].target_topology == Topology(dp=world, ep=ep)
        names = sorted(os.listdir(destination / "global_step3"))
        experts = 0 if variant.endswith("z3_fp32") else 8  # ZeRO-3 AutoEP keeps experts in its partitions
        assert sum(n.startswith("layer_") for n in names) == experts  # 2 layers x 4 global experts, never duplicated
        case.load(ep, world, variant, truth, destination, f"ep{ep}-w{world}")
    if source_key == ("moe_z2_fp32", 2, 2):
        # Negative control in the same job: the ep1 output with its two rank files swapped gives
        # each rank the other's expert partitions; DeepSpeed loads it without a word.
        swapped = tmp_path / "swapped"
        shutil.copytree(tmp_path / "ep1-w2", swapped)
        tag_dir = swapped / "global_step3"
        a, b = (tag_dir / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1))
        a.rename(tag_dir / "tmp.pt"), b.rename(a), (tag_dir / "tmp.pt").rename(b)
        case.load(1, 2, variant, truth, swapped, "swapped", role="negative")
    if source_key == ("autoep_z2_fp32", 2, 2):
        # Negative control: two expert files of layer 0 swapped (experts 1 and 2 trade weights);
        # DeepSpeed stacks whatever the files hold.
        swapped = tmp_path / "swapped"
        shutil.copytree(tmp_path / "ep1-w2", swapped)
        tag_dir = swapped / "global_step3"
        a, b = (tag_dir / f"layer_0_expert_{e}_mp_rank_00_model_states.pt" for e in (1, 2))
        one, two = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
        torch.save({k[:-1] + "2": v for k, v in one.items()}, b)
        torch.save({k[:-1] + "1": v for k, v in two.items()}, a)
        case.load(1, 2, variant, truth, swapped, "swapped", role="negative")
    for ep, world in IN_JOB.get(source_key, []):
        case.load(ep, world, variant, truth, source, f"in-job-ep{ep}-w{world}", how="in_job")
    if source_key == ("autoep_z3_fp32", 2, 4):
        # DeepSpeed's universal path at ZeRO-3 gives every master and moment right, but every
        # param group group 0's hyperparameters, and drops buffers.
        _convert(case, source, tmp_path / "universal")
        case.load(1, 2, variant, truth, tmp_path / "universal", "deepspeed-universal", how="universal",
                  role="z3_universal")
    if source_key == ("autoep_z2_fp32", 2, 2):
        # Against DeepSpeed, in the same job: its plain load of the ep2 source into the ep1 engine
        # reports success and gives experts 2 and 3 other experts' optimizer partitions; its
        # universal path (ds_to_universal + load_universal) gives every master and moment right.
        _convert(case, source, tmp_path / "universal")
        case.load(1, 2, variant, truth, source, "deepspeed-plain", role="deepspeed_plain")
        case.load(1, 2, variant, truth, tmp_path / "universal", "deepspeed-universal", how="universal",
                  role="deepspeed_universal")


@pytest.mark.e2e
@pytest.mark.parametrize("source_key", list(E2E), ids=[f"{v}-ep{e}w{w}" for v, e, w in E2E])
def test_moe_reshard_loads_exactly(moe_cases, source_key):
    """Resharded (and prepared) by `_prepare_moe_loads`, judged in the launches shared by all
    the MoE load tests (`moe_cases`)."""
    for load, verdict in moe_cases[("test_moe_reshard_loads_exactly", source_key)].verdicts_in_order():
        if load.role == "negative":
            assert not verdict["ok"] and verdict["mismatch_count"] > 0, "the check missed swapped expert partitions"
        elif load.role == "deepspeed_plain":
            assert verdict["load_error"] is None and not verdict["ok"]
            assert any("['master']['model.layers.0.mlp.experts.w1.2']" in m for m in verdict["mismatches"])
        elif load.role == "deepspeed_universal":
            # every master and moment right; load_universal drops buffers and keeps the source's
            # expert group name `ep_size_2`
            assert verdict["ok"] and verdict["checked_tensors"] >= 100, verdict["mismatches"]
            assert sorted(m.split(":")[0] for m in verdict["beyond_masters"]) == [
                "engine['buffers']['num_updates']", "engine['param_groups'][2]['name']"]
        elif load.role == "z3_universal":
            assert verdict["ok"] and verdict["checked_tensors"] >= 100, verdict["mismatches"]
            assert verdict["beyond_masters"] and all(
                m.startswith(("engine['buffers']", "engine['param_groups']")) for m in verdict["beyond_masters"])
        else:
            assert (verdict["world_size"], verdict["ep"], verdict["in_job"]) == (
                load.world, load.ep, load.how == "in_job")
            assert verdict["variant"] == load.variant and verdict["load_dir"] == str(load.load_dir)
            _assert_ok(verdict)


@pytest.mark.e2e
def test_moe_identity_and_round_trip_reproduce_the_source(moe_trained, tmp_path):
    """ep2 w2 -> ep2 w2 gives DeepSpeed's own files back (every key, name and element); going
    through ep1 w2 or ep4 w4 and back gives the same bytes: the EP renaming is exact both ways.
    `verify` (manifest hashes, and every element against the source) agrees on both outputs."""
    from reshard_proof.bitwise import compare_trees
    from trained import tree_files
    source, _ = moe_trained("moe_z2_fp32", 2, 2)
    identity = tmp_path / "identity"
    _reshard(source, identity, 2, 2, 1)
    for name in sorted(os.listdir(source / "global_step3")):
        mismatches = compare_trees(_load_tree(source / "global_step3" / name),
                                   _load_tree(identity / "global_step3" / name), name).mismatches
        assert not mismatches, mismatches[:10]
    expected = {k: v for k, v in tree_files(identity).items() if not k.endswith("reshard_manifest.json")}
    from threaded_transport import run_workers

    from reshard.formats.deepspeed_files.deepspeed_inspect import inspect_checkpoint
    from reshard.verify import verify_against, verify_hashes
    spec = inspect_checkpoint(source, read_tensors=False).spec
    for ep, world in ((1, 2), (4, 4)):
        there, back = tmp_path / f"ep{ep}w{world}", tmp_path / f"back-from-ep{ep}w{world}"
        _reshard(source, there, world, ep, 2)
        assert verify_hashes(str(there)).ok
        checked = run_workers(3, lambda t: verify_against(str(there), str(source), transport=t))[0]
        assert checked.ok, checked.summary()
        assert checked.checked_elements == 3 * spec.total_elements  # fp32, exp_avg, exp_avg_sq of every element
        _reshard(there, back, 2, 2, 3)
        files = {k: v for k, v in tree_files(back).items() if not k.endswith("reshard_manifest.json")}
        assert files.keys() == expected.keys()
        assert [k for k in files if files[k] != expected[k]] == []


@pytest.mark.e2e
def test_moe_refusals_name_the_file(moe_trained, tmp_path):
    from reshard.jobs.collective_job import reshard_checkpoint
    source, _ = moe_trained("moe_z2_fp32", 2, 2)
    model = str(source / "global_step3" / "mp_rank_00_model_states.pt")
    with pytest.raises(OptionError, match="ep=3 does not divide") as error:  # 4 experts over 3 EP ranks
        reshard_checkpoint(str(source), str(tmp_path / "a"), 3, target_ep=3, quiet=True)
    assert model in str(error.value) and "num_experts % ep_size" in str(error.value)
    with pytest.raises(OptionError, match="ep=2 does not divide dp=3"):  # D not divisible by E
        reshard_checkpoint(str(source), str(tmp_path / "b"), 3, quiet=True)
    dry = reshard_checkpoint(str(source), str(tmp_path / "c"), 4, target_ep=4, dry_run=True, quiet=True)
    text = dry.summary()
    assert "dp=2 tp=1 ep=2 -> target dp=4 tp=1 ep=4" in text and "EP rank 3: experts 3-3" in text

    broken = tmp_path / "broken"
    shutil.copytree(source, broken)
    missing = broken / "global_step3" / "layer_1_expert_2_mp_rank_00_model_states.pt"
    missing.unlink()
    with pytest.raises(CheckpointError, match="is missing: num_experts") as error:
        reshard_checkpoint(str(broken), str(tmp_path / "d"), 2, quiet=True)
    assert str(missing) in str(error.value)
    shutil.copy(source / "global_step3" / "layer_1_expert_2_mp_rank_00_model_states.pt", missing)
    stage0 = broken / "global_step3" / "expp_rank_0_mp_rank_00_optim_states.pt"
    stage0.write_bytes(b"")
    with pytest.raises(UnsupportedCheckpoint, match="ZeRO-0 MoE") as error:
        reshard_checkpoint(str(broken), str(tmp_path / "e"), 2, quiet=True)
    assert str(stage0) in str(error.value)


@pytest.mark.e2e
def test_target_ep_needs_experts(trained, tmp_path):
    from reshard.jobs.collective_job import reshard_checkpoint
    source, _ = trained("z2_fp32", 2)
    with pytest.raises(OptionError, match="has no experts"):
        reshard_checkpoint(str(source), str(tmp_path / "x"), 2, target_ep=2, quiet=True)


# --- AutoEP: fused experts, ds_autoep_layers ---------------------------------------------------

def synthetic_autoep(layers: int, experts: int, expert_shapes=((16, 8), (8, 16), (16, 8))):
    """An AutoEP-like spec: dense decay / no_decay groups, then one expert group listing each
    layer's w1, w2, w3 as per-expert slices `...experts.w1.{G}`, as reshard's inspect expands them."""
    prefixes = [f"model.layers.{layer}.mlp.experts." for layer in range(layers)]
    params = [ParamSpec("embed.weight", (11, 8)), ParamSpec("head.bias", (11,))]
    groups = [(0,), (1,)]
    ids = []
    for prefix in prefixes:
        for w, shape in zip(("w1", "w2", "w3"), expert_shapes):
            for g in range(experts):
                ids.append(len(params))
                params.append(ParamSpec(f"{prefix}{w}.{g}", shape))
    groups.append(tuple(ids))
    return params, groups, ExpertParams.of(params, (False, False, True), [experts] * layers, prefixes, autoep=True)


@pytest.mark.parametrize("dp,ep", [(2, 2), (2, 1), (4, 2), (4, 4)])
def test_autoep_metadata_names_fused_local_tensors(dp, ep):
    """Slice mappings and param_shapes use DeepSpeed's fused local names and shapes
    ([E/ep, ...]), one contiguous fragment per fused tensor, and the flat group of every EP rank
    holds exactly its block of experts."""
    from reshard.formats.deepspeed_files.deepspeed_metadata import rank_metadata
    from reshard.formats.deepspeed_files.deepspeed_spec import CheckpointSpec
    params, groups, experts = synthetic_autoep(2, 4)
    topology = Topology(dp=dp, ep=ep)
    spec = CheckpointSpec(2, "zero", False, topology, tuple(params), tuple(groups), False, 1, 10 ** 9, "float32", (),
                          experts=experts)
    layout = spec.layout(topology)
    n_local = 4 // ep
    shapes = layout.param_shapes_on_rank(layout.groups[2].flat_order, 0)
    assert shapes == [(f"model.layers.{layer}.mlp.experts.{w}", (n_local, *s)) for layer in range(2)
                      for w, s in zip(("w1", "w2", "w3"), ((16, 8), (8, 16), (16, 8)))]
    expert_numel = 3 * 128
    for rank in range(dp):
        meta = rank_metadata(spec, layout, rank)
        assert meta.partition_count == [dp, dp, dp // ep]
        assert meta.param_alignment_paddings[2] == [0] * len(shapes)  # one per fused tensor
        mapped = meta.slice_mappings[2]
        assert len({name for name, _, _ in mapped}) == len(mapped)  # one fragment per fused tensor
        starts = [start for _, _, start in mapped]
        assert starts == sorted(starts) and sum(numel for _, numel, _ in mapped) == meta.fp32_numels[2]
    total = sum(numel for rank in range(dp // ep) for numel in [rank_metadata(spec, layout, rank * ep).fp32_numels[2]])
    assert total == 2 * n_local * expert_numel  # EP rank 0's experts, over its expert-DP ranks


@pytest.mark.parametrize("ep", [1, 2, 4])
def test_autoep_placement_and_affine_maps_equal_deepspeeds(ep):
    """The recomputed ds_autoep_layers pieces equal what DeepSpeed's own functions build."""
    from deepspeed.checkpoint.autoep_affine import (autoep_placement_to_affine_map,
                                                    legacy_uniform_autoep_placement_descriptor)

    from reshard.formats.deepspeed_files.deepspeed_autoep import uniform_affine_map, uniform_placement
    descriptor = legacy_uniform_autoep_placement_descriptor(8, 8 // ep, ep)
    assert uniform_placement(8, ep) == descriptor
    assert list(uniform_placement(8, ep)) == list(descriptor)  # key order too: pickled bytes
    for shape in ((8, 16, 8), (8, 8, 16)):
        assert uniform_affine_map(shape, ep) == autoep_placement_to_affine_map(descriptor, shape).to_dict()


def _autoep_entry(layer, ep, fmt="per_expert_files"):
    from reshard.formats.deepspeed_files.deepspeed_autoep import uniform_affine_map, uniform_placement
    prefix = f"model.layers.{layer}.mlp.experts"
    return {"moe_layer_id": layer, "module_path": f"model.layers.{layer}.mlp", "num_experts": 4,
            "num_local_experts": 4 // ep, "ep_size": ep, "expert_placement": uniform_placement(4, ep),
            "affine_maps": {"version": 1, "params": {f"{prefix}.w1": uniform_affine_map((4, 16, 8), ep)}},
            "expert_key_prefix": prefix, "checkpoint_format": fmt, "checkpoint_format_version": None,
            "ep_group_name": f"ep_size_{ep}", "ep_rank": 0, "expert_data_parallel_rank": 0,
            "expert_data_parallel_world_size": 1, "global_expert_start": 0, "global_expert_end": 4 // ep}


def test_autoep_layers_read_retarget_and_refuse():
    from reshard.formats.deepspeed_files.deepspeed_autoep import read_autoep_layers, target_autoep_layers
    entries = [_autoep_entry(0, 2), _autoep_entry(1, 2)]
    layers = read_autoep_layers(entries, "/x/mp_rank_00_model_states.pt")
    assert (layers.num_experts, layers.prefixes, layers.ep) == ((4, 4), ("model.layers.0.mlp.experts.",
                                                                         "model.layers.1.mlp.experts."), 2)
    retargeted = target_autoep_layers(entries, Topology(dp=4, ep=4))
    expected = [dict(_autoep_entry(layer, 4), expert_data_parallel_world_size=1) for layer in range(2)]
    assert retargeted == expected and entries == [_autoep_entry(0, 2), _autoep_entry(1, 2)]  # source untouched
    assert target_autoep_layers(entries, Topology(dp=4, ep=1))[0]["expert_data_parallel_world_size"] == 4
    zero3 = [dict(_autoep_entry(layer, 2, fmt="zero3_partitioned"), checkpoint_format_version=1) for layer in (0, 1)]
    assert read_autoep_layers(zero3, "/x/m.pt").zero3 and not layers.zero3
    rank3 = target_autoep_layers(zero3, Topology(dp=4, ep=2), rank=3)[1]  # ZeRO-3: every rank its own entries
    assert (rank3["ep_rank"], rank3["expert_data_parallel_rank"], rank3["global_expert_start"],
            rank3["global_expert_end"]) == (1, 1, 2, 4)
    with pytest.raises(UnsupportedCheckpoint, match="version 2") as error:
        read_autoep_layers([dict(zero3[0], checkpoint_format_version=2)], "/x/zero_pp_rank_0_mp_rank_00_model_states.pt")
    assert "/x/zero_pp_rank_0" in str(error.value)
    with pytest.raises(UnsupportedCheckpoint, match="'bogus' format"):
        read_autoep_layers([_autoep_entry(0, 2, fmt="bogus")], "/x/m.pt")
    shuffled = _autoep_entry(0, 2)
    shuffled["expert_placement"]["ranks"][0]["experts"] = [1, 0]
    with pytest.raises(UnsupportedCheckpoint, match="contiguous equal blocks"):
        read_autoep_layers([shuffled], "/x/m.pt")
    with pytest.raises(UnsupportedCheckpoint, match="different ep sizes"):
        read_autoep_layers([_autoep_entry(0, 2), _autoep_entry(1, 4)], "/x/m.pt")


@pytest.mark.parametrize("old,new", [((4, 2), (2, 1)), ((4, 2), (4, 4)), ((2, 2), (8, 2)), ((8, 4), (6, 2))])
@pytest.mark.parametrize("sub_group_size", [10 ** 9, 300])
def test_autoep_zero3_layout_and_plan(old, new, sub_group_size):
    """AutoEP ZeRO-3: each fused tensor is chunked over its EP rank's expert-data-parallel group,
    every element has one holder, and a plan between two topologies moves each to its place."""
    from reshard.layouts.experts import expert_zero3_layout
    params, groups, experts = synthetic_autoep(2, 8)
    layouts = [expert_zero3_layout(params, groups, experts, Topology(dp=dp, ep=ep), sub_group_size) for dp, ep in (old, new)]
    total = sum(p.numel for p in params)
    for layout in layouts:
        held = _held_values(layout, total)
        values = np.concatenate([v[v >= 0] for v in held.values()])
        assert np.array_equal(np.sort(values), np.arange(total))
        expert_sg = [i for i, sg in enumerate(layout.sub_groups) if sg.is_expert]
        chunk = -(-(8 // layout.topology.ep) * 128 // layout.topology.expert_dp)  # one fused [n_local, 16, 8]
        assert layout.sub_groups[expert_sg[0]].chunk_numels[0] == chunk
    source, wanted = _held_values(layouts[0], total), _held_values(layouts[1], total)
    got = {key: np.full(len(v), -1, np.int64) for key, v in wanted.items()}
    space = plan_space("optim", layouts[0].pieces, layouts[1].pieces, (Stream("fp32", "float32", 4),),
                       buffer_numels(layouts[1]), Ownership.between(layouts[0].topology, layouts[1].topology, 3), 4096)
    s = space.segments
    for i in range(len(s)):
        n = int(s.length[i])
        got[(int(s.dst_rank[i]), int(s.dst_buffer[i]))][s.dst_offset[i]:s.dst_offset[i] + n] = \
            source[(int(s.src_rank[i]), int(s.src_buffer[i]))][s.src_offset[i]:s.src_offset[i] + n]
    for key in wanted:
        assert np.array_equal(got[key][wanted[key] >= 0], wanted[key][wanted[key] >= 0]), key


def test_autoep_zero3_partition_groups_as_deepspeed_wrote_them():
    """ds_zero_partition_groups of rank 2 of a dp=4, ep=2 AutoEP ZeRO-3 save (DeepSpeed 0.19.8, CPU)."""
    from reshard.layouts.experts import expert_zero3_layout
    params, groups, experts = synthetic_autoep(2, 4)
    layout = expert_zero3_layout(params, groups, experts, Topology(dp=4, ep=2), 10 ** 9)
    assert layout.partition_groups(2, "ep_size_2") == [
        {"sub_group": 0, "partition_count": 4, "partition_rank": 2, "partition_ranks": [0, 1, 2, 3],
         "families": ["replicated"], "group_names": ["replicated"]},
        {"sub_group": 1, "partition_count": 4, "partition_rank": 2, "partition_ranks": [0, 1, 2, 3],
         "families": ["replicated"], "group_names": ["replicated"]},
        {"sub_group": 2, "partition_count": 2, "partition_rank": 1, "partition_ranks": [0, 2],
         "families": ["autoep_expert"], "group_names": ["ep_size_2"]}]


@pytest.mark.e2e
@pytest.mark.parametrize("source_key,via", [(("autoep_z2_fp32", 2, 2), (1, 2)), (("autoep_z3_fp32", 2, 4), (1, 2))],
                         ids=["z2-ep2w2-via-ep1w2", "z3-ep2w4-via-ep1w2"])
def test_autoep_round_trip_is_byte_identical(moe_trained, tmp_path, source_key, via):
    """Through another (ep, dp) and back gives the bytes of the identity reshard: fused tensors,
    slice mappings, param_shapes, ds_autoep_layers and (ZeRO-3) ds_zero_partition_groups are
    recomputed exactly. The ZeRO-2 identity also reproduces DeepSpeed's own files, every key and
    element (ZeRO-3 partitions hold uninitialised padding that reshard writes as zeros)."""
    from reshard_proof.bitwise import compare_trees
    from trained import tree_files
    variant, ep, world = source_key
    source, _ = moe_trained(*source_key)
    identity, there, back = tmp_path / "identity", tmp_path / "there", tmp_path / "back"
    _reshard(source, identity, world, ep, 1)
    _reshard(source, there, via[1], via[0], 3)
    _reshard(there, back, world, ep, 2)
    expected = {k: v for k, v in tree_files(identity).items() if not k.endswith("reshard_manifest.json")}
    files = {k: v for k, v in tree_files(back).items() if not k.endswith("reshard_manifest.json")}
    assert files.keys() == expected.keys() and [k for k in files if files[k] != expected[k]] == []
    if variant == "autoep_z2_fp32":
        for name in sorted(os.listdir(source / "global_step3")):
            mismatches = compare_trees(_load_tree(source / "global_step3" / name),
                                       _load_tree(identity / "global_step3" / name), name).mismatches
            assert not mismatches, mismatches[:10]


# ZeRO-0 (no ZeRO): DeepSpeed writes one whole optimizer state_dict per EP rank (expp_rank_*).
# Its own load already works at another dp (nothing checks it) and fails at another ep (torch's
# "parameter group that doesn't match the size"); reshard regroups the per-parameter tensors.
ZERO0 = {("moe_z0_fp32", 2, 2): [(1, 2, 3), (2, 4, 3)], ("moe_z0_bf16", 1, 2): [(2, 2, 3)]}
ZERO0_IN_JOB = {("moe_z0_fp32", 2, 2): [(1, 2)], ("moe_z0_bf16", 1, 2): [(2, 2)]}  # reshard.deepspeed, same launches
ZERO0_IN_JOB_BUDGET = 4096  # the in-job loads' memory_budget: far below one EP rank's optimizer file, so by rounds


def _prepare_zero0_loads(moe_trained, case: MoeCase, source_key) -> None:
    variant, source_ep, _ = source_key
    source, truth = moe_trained(*source_key)
    tmp_path = case.root
    for ep, world, workers in ZERO0[source_key]:
        destination = tmp_path / f"ep{ep}-w{world}"
        result = _reshard(source, destination, world, ep, workers)
        assert result.checkpoints[0].target_topology == Topology(dp=world, ep=ep)
        names = sorted(os.listdir(destination / "global_step3"))
        assert [n for n in names if n.startswith("expp_rank_")] == [f"expp_rank_{e}_mp_rank_00_optim_states.pt"
                                                                   for e in range(ep)]
        assert sum(n.startswith("layer_") for n in names) == 8
        case.load(ep, world, variant, truth, destination, f"ep{ep}-w{world}")
    if source_ep == 2:
        # Negative control: the ep2 output with its two EP ranks' optimizer files swapped gives each
        # rank the other's expert moments (same shapes); DeepSpeed loads it without a word.
        swapped = tmp_path / "swapped"
        shutil.copytree(tmp_path / "ep2-w4", swapped)
        a, b = (swapped / "global_step3" / f"expp_rank_{e}_mp_rank_00_optim_states.pt" for e in (0, 1))
        a.rename(a.with_suffix(".tmp")), b.rename(a), a.with_suffix(".tmp").rename(b)
        case.load(2, 4, variant, truth, swapped, "swapped", role="negative")
    for ep, world in ZERO0_IN_JOB[source_key]:
        case.load(ep, world, variant, truth, source, f"in-job-ep{ep}-w{world}", how=f"in_job:{ZERO0_IN_JOB_BUDGET}")


@pytest.mark.e2e
@pytest.mark.parametrize("source_key", list(ZERO0), ids=[f"{v}-ep{e}w{w}" for v, e, w in ZERO0])
def test_zero0_moe_reshard_loads_exactly(moe_cases, source_key):
    """Resharded by `_prepare_zero0_loads`, judged in the shared launches (`moe_cases`)."""
    for load, verdict in moe_cases[("test_zero0_moe_reshard_loads_exactly", source_key)].verdicts_in_order():
        if load.role == "negative":
            assert not verdict["ok"] and verdict["mismatch_count"] > 0, "the check missed swapped expert moments"
            continue
        in_job = load.how.startswith("in_job")
        assert (verdict["world_size"], verdict["ep"], verdict["in_job"]) == (load.world, load.ep, in_job)
        assert verdict["variant"] == load.variant and verdict["load_dir"] == str(load.load_dir)
        _assert_ok(verdict)
        if in_job:  # through the plan by rounds under the budget, not whole tensors built in memory
            optim_bytes = os.path.getsize(load.load_dir / "global_step3" / "expp_rank_0_mp_rank_00_optim_states.pt")
            assert verdict["memory_budget"] == ZERO0_IN_JOB_BUDGET < optim_bytes // 4, optim_bytes
            assert verdict["in_job_rounds"] is not None and verdict["in_job_rounds"] > 1, verdict


@pytest.mark.e2e
def test_zero0_moe_round_trip_and_dry_run(moe_trained, tmp_path):
    """ep2 -> ep1 -> ep2 and ep2 -> ep4 -> ep2 give back DeepSpeed's own optimizer files (every key,
    name and element; the model states too); `verify` by hashes and `--against` the source pass on the
    outputs and report a changed element; the dry run shows the placement and writes nothing."""
    from threaded_transport import run_workers

    from reshard.jobs.collective_job import reshard_checkpoint
    from reshard.jobs.manifest import Manifest
    from reshard.verify import verify_against, verify_hashes
    from reshard_proof.bitwise import compare_trees
    source, _ = moe_trained("moe_z0_fp32", 2, 2)
    for ep, world in ((1, 2), (4, 4)):
        there, back = tmp_path / f"ep{ep}", tmp_path / f"back{ep}"
        _reshard(source, there, world, ep, 2)
        # the manifest lists the output's files only (the source's tag directory was once carried as a
        # save-directory sub-directory beside it, listed as ../global_step3/..., and verify failed)
        checked, listed = verify_hashes(str(there)), Manifest.read(str(there / "global_step3")).files
        assert checked.ok and not any(name.startswith("..") for name in listed), checked.summary()
        # verify --against replays the plan (3 workers) and compares every element of every target file,
        # the model-states file's copy of EP rank 0's optimizer included (it refused ZeRO-0 MoE before)
        against = run_workers(3, lambda t: verify_against(str(there), str(source), transport=t))[0]
        assert against.ok and against.checked_elements == _zero0_output_elements(there), against.summary()
        _reshard(there, back, 2, 2, 3)
        names = sorted(n for n in os.listdir(back / "global_step3") if n != "reshard_manifest.json")
        assert names == sorted(os.listdir(source / "global_step3"))
        for name in names:
            mismatches = compare_trees(_load_tree(source / "global_step3" / name),
                                       _load_tree(back / "global_step3" / name), name).mismatches
            assert not mismatches, mismatches[:10]
    # a changed element of an output file is reported, naming the file
    bad = tmp_path / "bad"
    shutil.copytree(tmp_path / "ep4", bad)
    path = bad / "global_step3" / "expp_rank_3_mp_rank_00_optim_states.pt"
    tree = torch.load(path, weights_only=True)
    state = tree["optimizer"]["state"]
    state[next(iter(state))]["exp_avg"].view(-1)[0] += 1.0
    torch.save(tree, path)
    against = verify_against(str(bad), str(source))
    assert not against.ok and str(path) in against.summary() and "exp_avg" in against.summary(), against.summary()
    dry = reshard_checkpoint(str(source), str(tmp_path / "dry"), 4, target_ep=4, dry_run=True, quiet=True)
    text = dry.summary()
    assert "ZeRO-0 native MoE" in text and "EP rank 3: experts 3-3" in text and not (tmp_path / "dry").exists()
    with pytest.raises(OptionError, match="ep=3 does not divide"):
        reshard_checkpoint(str(source), str(tmp_path / "x"), 3, target_ep=3, quiet=True)
    broken = tmp_path / "broken"
    shutil.copytree(source, broken)
    missing = broken / "global_step3" / "expp_rank_1_mp_rank_00_optim_states.pt"
    missing.unlink()
    with pytest.raises(CheckpointError, match="is missing: the expert param groups are named ep_size_2") as error:
        reshard_checkpoint(str(broken), str(tmp_path / "y"), 2, quiet=True)
    assert str(missing) in str(error.value)


def _zero0_output_elements(out) -> int:
    """Elements of every optimizer tensor (states and fp32 masters) in a ZeRO-0 MoE output's expp_rank
    files and in the model-states file's copy of EP rank 0's optimizer: what verify --against compares.
    From the files by torch.load, not from reshard's lowering."""
    total = 0
    for path in sorted((out / "global_step3").glob("*.pt")):
        if not path.name.startswith(("expp_rank_", "mp_rank_")):
            continue
        optimizer = _load_tree(path)["optimizer"]
        inner = optimizer.get("optimizer_state_dict", optimizer)
        tensors = [v for state in inner["state"].values() for v in state.values() if torch.is_tensor(v)]
        tensors += [t for group in optimizer.get("fp32_groups", ()) for t in group]
        total += sum(t.numel() for t in tensors)
    return total


# The bytes of every ZeRO-0 MoE output the suite makes, recorded from the whole-file road
# (jobs/zero0_job.py, commit 311f53b) before issue 37 moved these saves onto the planner and
# execute(): name -> (source key, [(dp, ep, workers), ...] chained, each from the previous output).
ZERO0_PINNED_CASES = {
    "moe_z0_fp32-ep2w2-to-ep1-dp2": (("moe_z0_fp32", 2, 2), [(2, 1, 3)]),
    "moe_z0_fp32-ep2w2-to-ep2-dp4": (("moe_z0_fp32", 2, 2), [(4, 2, 3)]),
    "moe_z0_fp32-ep2w2-to-ep4-dp4": (("moe_z0_fp32", 2, 2), [(4, 4, 2)]),
    "moe_z0_fp32-ep2w2-to-ep1-dp2-back": (("moe_z0_fp32", 2, 2), [(2, 1, 2), (2, 2, 3)]),
    "moe_z0_fp32-ep2w2-to-ep4-dp4-back": (("moe_z0_fp32", 2, 2), [(4, 4, 2), (2, 2, 3)]),
    "moe_z0_bf16-ep1w2-to-ep2-dp2": (("moe_z0_bf16", 1, 2), [(2, 2, 3)]),
    "moe_z0_bf16-ep1w2-to-ep1-dp3": (("moe_z0_bf16", 1, 2), [(3, 1, 2)]),
}


def _zero0_pins() -> tuple[dict, dict]:
    """(truth digest by source key, hashes by case) from tests/data/zero0_moe_output_pins.json."""
    import json
    recorded = json.loads((Path(__file__).parent / "data" / "zero0_moe_output_pins.json").read_text())
    return recorded["truth_digests"], recorded["pinned"]


@pytest.mark.e2e
@pytest.mark.parametrize("name", list(ZERO0_PINNED_CASES))
def test_zero0_moe_output_bytes_are_pinned(moe_trained, tmp_path, name):
    """Every file of each ZeRO-0 MoE output (the manifest aside: it names paths and times) has the
    SHA-256 recorded from the whole-file road (tests/data/zero0_moe_output_pins.json), in threads
    from the module's saves: no launch of its own. Where the source trained to other values than
    where the pins were recorded (another CPU or torch build) the test fails saying so."""
    from test_output_pinned import truth_digest
    from test_pipeline_pinned import tree_hashes
    source_key, steps = ZERO0_PINNED_CASES[name]
    source, truth = moe_trained(*source_key)
    digest = truth_digest(truth)
    out = None
    for i, (dp, ep, workers) in enumerate(steps):
        previous = out or source
        out = tmp_path / f"out{i}"
        _reshard(previous, out, dp, ep, workers)
    key = "/".join(map(str, source_key))
    if os.environ.get("RESHARD_RECORD_ZERO0_PINS"):  # re-recording into that JSON file (the asserts still run)
        import json
        record = Path(os.environ["RESHARD_RECORD_ZERO0_PINS"])
        recorded = json.loads(record.read_text()) if record.exists() else {"truth_digests": {}, "pinned": {}}
        recorded["truth_digests"][key] = digest
        recorded["pinned"][name] = tree_hashes(out)
        record.write_text(json.dumps(recorded, indent=1, sort_keys=True) + "\n")
    truths, pinned = _zero0_pins()
    assert digest == truths[key], (
        f"{source_key} trained to other values here than where the pins were recorded (truth digest {digest}): "
        "the pins cannot judge this output")
    assert tree_hashes(out) == pinned[name]


ZERO0_BUDGET = 4096
# (pinned case, target dp, ep, workers): each pin resharded again with another worker count, in rounds
ZERO0_BUDGET_CASES = [("moe_z0_fp32-ep2w2-to-ep1-dp2", 2, 1, 2), ("moe_z0_fp32-ep2w2-to-ep4-dp4", 4, 4, 3),
                      ("moe_z0_bf16-ep1w2-to-ep2-dp2", 2, 2, 1)]


def _zero0_state_bytes(source, target_ep: int) -> int:
    """Bytes of the source's optimizer tensors the target draws on, each counted once: every tensor of
    EP rank 0's file (its dense groups serve every target EP rank), and the expert groups' tensors of the
    other EP ranks' files (each expert goes to one target EP rank), fp32 masters included. From the
    files by torch.load, not from reshard's lowering."""
    total = 0
    for path in sorted((source / "global_step3").glob("expp_rank_*_mp_rank_00_optim_states.pt")):
        rank = int(path.name.split("_")[2])
        optimizer = _load_tree(path)["optimizer"]
        inner = optimizer.get("optimizer_state_dict", optimizer)
        for g, group in enumerate(inner["param_groups"]):
            if rank and not group.get("moe"):
                continue  # a dense group: EP rank 0's copy is the one read
            for position, index in enumerate(group["params"]):
                tensors = [v for v in inner["state"].get(index, {}).values() if torch.is_tensor(v)]
                if "fp32_groups" in optimizer:
                    tensors.append(optimizer["fp32_groups"][g][position])
                total += sum(t.numel() * t.element_size() for t in tensors)
    return total


@pytest.mark.e2e
@pytest.mark.parametrize("name,dp,ep,workers", ZERO0_BUDGET_CASES, ids=[c[0] for c in ZERO0_BUDGET_CASES])
def test_zero0_moe_by_rounds_within_a_budget_reads_each_source_byte_once(moe_trained, tmp_path, name, dp, ep,
                                                                         workers):
    """A ZeRO-0 MoE reshard under a 4 KiB budget (the whole-file job it replaces took every tensor whole,
    budget unchecked): many rounds, none moving more than the budget, every source byte the target
    draws on read once (a dense parameter's states serve every target EP rank and the model-states
    file's copy of EP rank 0's optimizer, read once for all), and the pinned bytes."""
    from test_pipeline_pinned import tree_hashes
    from trained import reshard_in_threads
    _, pinned = _zero0_pins()
    source_key, [(_, _, _)] = ZERO0_PINNED_CASES[name]
    source, _ = moe_trained(*source_key)
    optim_files = list((source / "global_step3").glob("expp_rank_*"))
    assert min(p.stat().st_size for p in optim_files) > 4 * ZERO0_BUDGET
    out = tmp_path / "out"
    result = reshard_in_threads(source, out, dp, workers, target_ep=ep, memory_budget=ZERO0_BUDGET)
    [checkpoint] = result.checkpoints
    plan = checkpoint.plan
    assert plan is not None, "took a whole-file job, not the rounds"
    assert plan.rounds > 4 and max(plan.round_bytes()) <= ZERO0_BUDGET, (plan.rounds, max(plan.round_bytes()))
    carried = sum(p.stat().st_size for p in (source / "global_step3").glob("layer_*"))  # copied whole, read once
    assert checkpoint.bytes_read - carried == _zero0_state_bytes(source, ep)
    assert tree_hashes(out) == pinned[name]


@pytest.mark.e2e
def test_zero0_moe_killed_mid_rounds_under_torchrun_resumes_to_the_pinned_bytes(moe_trained, tmp_path):
    """ep 2 -> 1 by `torchrun -m reshard` (2 workers) under a 4 KiB budget, killed in round 3 (SIGKILL,
    the journal durable every 1 KiB), run again: it resumes and publishes the pinned bytes. The
    whole-file job it replaces had no resume: a run started over."""
    from reshard_proof.launch import TorchrunError
    from test_pipeline_pinned import tree_hashes
    from trained import reshard_with_torchrun

    from reshard.jobs.destination import STAGING
    from reshard.jobs.manifest import JOURNAL_NAME
    _, pinned = _zero0_pins()
    source, _ = moe_trained("moe_z0_fp32", 2, 2)
    out = tmp_path / "out"
    args = ("--target-ep", "1", "--memory-budget", "4K", "--durable-every", "1K")
    with pytest.raises(TorchrunError):
        reshard_with_torchrun(source, out, 2, 2, *args, env={"RESHARD_FAILPOINTS": "kill@round=3"})
    journals = list((out / STAGING).glob(f"*/{JOURNAL_NAME}"))
    assert len(journals) == 1 and not (out / "latest").exists()
    done = reshard_with_torchrun(source, out, 2, 2, *args)
    assert "resuming an interrupted" in done.stdout + done.stderr, done.stdout
    assert tree_hashes(out) == pinned["moe_z0_fp32-ep2w2-to-ep1-dp2"]
    assert not (out / STAGING).exists()


@pytest.mark.e2e
def test_zero0_moe_parameters_with_other_states_are_refused_naming_the_file(moe_trained, tmp_path):
    """One stream per state key carries every parameter's states: a parameter of EP rank 1 whose state
    lacks `exp_avg_sq` (crafted) is refused before anything is written, naming that file; the source is
    left as it was. (The whole-file job copied such a state dict into the target as it was.)"""
    from test_pipeline_pinned import tree_hashes

    from reshard.jobs.collective_job import reshard_checkpoint
    source, _ = moe_trained("moe_z0_fp32", 2, 2)
    broken = tmp_path / "broken"
    shutil.copytree(source, broken)
    path = broken / "global_step3" / "expp_rank_1_mp_rank_00_optim_states.pt"
    tree = torch.load(path, weights_only=True)
    state = tree["optimizer"]["state"]
    del state[next(iter(state))]["exp_avg_sq"]
    torch.save(tree, path)
    before = tree_hashes(broken)
    with pytest.raises(UnsupportedCheckpoint, match="needs the same states for every parameter") as error:
        reshard_checkpoint(str(broken), str(tmp_path / "out"), 2, target_ep=1, quiet=True)
    assert str(path) in str(error.value)
    assert not (tmp_path / "out").exists() and tree_hashes(broken) == before


# --- SLURM array mode: the collective job's plan, files and manifest, task by task --------------

ARRAY_BUDGET = "4K"
# source -> [(target dp, ep, array tasks)]: native MoE, AutoEP (ZeRO-2 and ZeRO-3) and ZeRO-0 MoE, each
# to targets whose collective outputs the load tests above judge (E2E, ZERO0) or that are pinned
# (ZERO0_PINNED_CASES); ep changed both ways, dp changed
ARRAY_CASES = {
    ("moe_z2_fp32", 2, 2): [(2, 1, 3), (4, 4, 2)],
    ("autoep_z2_fp32", 2, 2): [(2, 1, 3)],
    ("autoep_z3_fp32", 2, 4): [(2, 1, 3)],
    ("moe_z0_fp32", 2, 2): [(2, 1, 3), (4, 4, 2)],
    ("moe_z0_bf16", 1, 2): [(2, 2, 3)],
}


@pytest.mark.e2e
@pytest.mark.parametrize("source_key", list(ARRAY_CASES), ids=[f"{v}-ep{e}w{w}" for v, e, w in ARRAY_CASES])
def test_moe_array_tasks_publish_the_collective_output(moe_trained, tmp_path, source_key):
    """SLURM array mode serves every MoE layout the collective job does: K tasks, run in reverse order in
    this process under a 4 KiB --memory-budget (several rounds each), publish the collective job's output
    (2 workers, in threads) file for file, the manifest included; together the tasks read no more than
    the output's bytes. Before, array mode refused every MoE save by name."""
    from trained import tree_files

    from reshard.jobs.collective_job import run_job
    from reshard.jobs.options import ReshardOptions
    source, _ = moe_trained(*source_key)
    for dp, ep, tasks in ARRAY_CASES[source_key]:
        expected, destination = tmp_path / f"collective-ep{ep}-w{dp}", tmp_path / f"array-ep{ep}-w{dp}"
        _reshard(source, expected, dp, ep, 2)
        results = [run_job(ReshardOptions(source=str(source), destination=str(destination), target_dp=dp,
                                          target_ep=ep, array_task=task, array_tasks=tasks, quiet=True,
                                          memory_budget=ARRAY_BUDGET).validate())
                   for task in reversed(range(tasks))]
        assert "this task completed the set" in results[-1].summary(), results[-1].summary()
        assert tree_files(destination) == tree_files(expected), (dp, ep)  # every file, the manifest included
        reports = [r.checkpoints[0].reports[0] for r in results]
        # by rounds under the budget: every task whose files take slices (a model-states file alone takes
        # none) moved them in several
        rounds = [r.checkpoints[0].rounds for r in results if r.checkpoints[0].rounds]
        assert len(rounds) >= 2 and min(rounds) > 1, rounds
        # each task reads only the source bytes its files hold and copies its whole files (the expert files,
        # the save directory's): together no more than the output's bytes
        read = sum(r.bytes_read + r.bytes_carried for r in reports)
        output = sum(p.stat().st_size for p in destination.rglob("*") if p.is_file())
        assert 0 < read <= output, (read, output)


def _zero0_files_loaded_on(names, node: int, dp: int, ep: int, per_node: int, experts: int = 4) -> set[str]:
    """Of an output's `names`, those the target ranks of `node` load (engine.py `_load_checkpoint`,
    `load_moe_state_dict`: rank r reads the model-states file, expp_rank_{r % ep} and EP rank r % ep's
    experts), and `latest`."""
    import re
    eps = {rank % ep for rank in range(node * per_node, min(dp, (node + 1) * per_node))}
    local = experts // ep

    def loaded(name: str) -> bool:
        if name in ("latest", "global_step3/mp_rank_00_model_states.pt"):
            return True
        if m := re.fullmatch(r"global_step3/expp_rank_(\d+)_mp_rank_00_optim_states\.pt", name):
            return int(m[1]) in eps
        m = re.fullmatch(r"global_step3/layer_\d+_expert_(\d+)_mp_rank_00_model_states\.pt", name)
        return m is not None and int(m[1]) // local in eps
    return {name for name in names if loaded(name)}


@pytest.mark.e2e
def test_zero0_moe_node_local_writes_each_node_what_its_ranks_load(moe_trained, tmp_path):
    """A ZeRO-0 MoE save (dp 2, ep 2) made on node 0's 2 ranks, where DeepSpeed puts every file of it
    (engine.py `_save_moe_checkpoint`: the expp_rank and expert files by global ranks 0 .. ep-1, the
    model-states file by global rank 0; reshard.jobs.node_local_zero0), resharded node-local on 2 nodes x
    2 workers under a 4 KiB budget (several rounds), to ep 1 / dp 2 (one target rank per node) and to
    ep 4 / dp 4 (two per node): each node's output is exactly the files its ranks load, each byte for
    byte the collective job's pinned output (at ep 1 / dp 2 test_zero0_moe_reshard_loads_exactly judges
    DeepSpeed's load of it element for element; the ep 4 pin round-trips to DeepSpeed's own bytes,
    test_zero0_moe_output_bytes_are_pinned), `latest` on both; what crossed between the nodes is the plan's
    bytes plus the expert files node 1 lacked, sent whole. The ep 4 job is first killed in round 5 (node
    1's leader) and resumed by the same command, to the same bytes, the rounds done not sent again. The
    source is left as it was. (Before, main refused the job
    by name: UnsupportedCheckpoint "node-local resharding of it is not supported yet".)"""
    import json
    import shutil

    from reshard_proof.launch import launch_torchrun_nodes, run_torchrun_nodes
    from test_pipeline_pinned import tree_hashes

    from reshard.jobs.manifest import JOURNAL_NAME
    _, pinned = _zero0_pins()
    source, _ = moe_trained("moe_z0_fp32", 2, 2)
    root = tmp_path
    shutil.copytree(source, root / "node0" / "src")
    (root / "node1" / "src" / "global_step3").mkdir(parents=True)  # node 1 ran no rank of the save
    before = [tree_hashes(root / f"node{k}" / "src") for k in range(2)]
    sizes = {p.name: p.stat().st_size for p in (source / "global_step3").iterdir()}
    for dp, ep, per_node, pin in ((2, 1, 1, "moe_z0_fp32-ep2w2-to-ep1-dp2"), (4, 4, 2, "moe_z0_fp32-ep2w2-to-ep4-dp4")):
        result_path, dst = root / f"result-{dp}-{ep}.json", f"dst-{dp}-{ep}"
        resumed = ep == 4

        def args(k):
            return [root / f"node{k}" / "src", root / f"node{k}" / dst, "--target-dp", dp, "--target-ep", ep,
                    "--node-local", "--target-ranks-per-node", per_node, "--memory-budget", "4K", "--durable-every",
                    "1K", "--timeout", "30", "--quiet", "--result-json", result_path]
        if resumed:
            codes, _ = launch_torchrun_nodes("reshard", 2, 2, args, env={"RESHARD_FAILPOINTS": "kill@round=5,worker=2"},
                                             timeout=240)
            assert all(code not in (0, None) for code in codes), codes
            for k in range(2):
                assert not (root / f"node{k}" / dst / "latest").exists()
                assert list((root / f"node{k}" / dst).glob(f".reshard-staging/*/{JOURNAL_NAME}")), k
        run_torchrun_nodes("reshard", 2, 2, args, expect_files=[root / f"node{k}" / dst / "latest" for k in range(2)],
                           timeout=300)
        want = pinned[pin]
        for k in range(2):
            got = tree_hashes(root / f"node{k}" / dst)
            assert got == {name: want[name] for name in _zero0_files_loaded_on(want, k, dp, ep, per_node)}, (pin, k)
            assert (root / f"node{k}" / dst / "latest").read_text() == "global_step3"
        (result,) = json.loads(result_path.read_text())["checkpoints"]
        assert result["rounds"] > 2 and result["nodes"] == 2, result
        shipped = sum(sizes[name.removeprefix("global_step3/")]
                      for name in _zero0_files_loaded_on(want, 1, dp, ep, per_node) if "_expert_" in name)
        assert result["plan_bytes_between_nodes"] > 0, result  # node 1's optimizer files, from node 0's sources
        if resumed:  # the rounds done before the kill are not sent again; the expert files are, whole
            assert shipped <= result["bytes_between_nodes"] < result["plan_bytes_between_nodes"] + shipped, result
        else:
            assert result["bytes_between_nodes"] == result["plan_bytes_between_nodes"] + shipped, (result, shipped)
        print(f"\n[node-local ZeRO-0 MoE {pin}] bytes between nodes {result['bytes_between_nodes']}"
              f"{' (resumed)' if resumed else ''}; plan {result['plan_bytes_between_nodes']} + expert files {shipped}; "
              f"{result['rounds']} rounds")
    assert [tree_hashes(root / f"node{k}" / "src") for k in range(2)] == before



@pytest.mark.e2e
def test_zero0_moe_exports_are_refused_by_name(moe_trained, tmp_path):
    """What stays refused: the DCP and safetensors exports of a ZeRO-0 MoE save (its optimizer files carry no
    param_shapes, so no state is tied to a parameter's name), exit 2, naming EP rank 0's optimizer file, nothing
    written, the source as it was. In-process (reshard_in_process), on the save the ZeRO-0 tests train."""
    from test_pipeline_pinned import tree_hashes
    from trained import reshard_in_process
    source, _ = moe_trained("moe_z0_fp32", 2, 2)
    before = tree_hashes(source)
    for export in ("dcp", "safetensors"):
        refused = reshard_in_process("export", str(source), str(tmp_path / export), "--format", export)
        assert refused.returncode == 2 and not (tmp_path / export).exists(), refused.stderr
        assert f"{source / 'global_step3' / 'expp_rank_0_mp_rank_00_optim_states.pt'}: is the expert optimizer " \
            "file of a ZeRO-0 MoE checkpoint" in refused.stderr and "exports" in refused.stderr, refused.stderr
    assert tree_hashes(source) == before


def _prepare_universal_oracle(moe_trained, case: MoeCase, _=None) -> None:
    source, truth = moe_trained("moe_z1_fp32", 1, 2)
    ours, theirs = case.root / "ours", case.root / "theirs"
    _reshard(source, ours, 3, 1, 2)
    _convert(case, source, theirs, name_latest=True)
    case.values["truth"] = truth
    case.load(1, 3, "moe_z1_fp32", truth, ours, "native")
    case.load(1, 3, "moe_z1_fp32", truth, theirs, "universal", how="universal", role="universal")


@pytest.mark.e2e
def test_moe_universal_oracle_at_another_dp(moe_cases):
    """Where DeepSpeed's own path works for native MoE (ep 1 kept, dp 2 -> 3): ds_to_universal.py +
    load_universal gives the same fp32 masters and moments as the native load of reshard's output,
    both equal to the truth element for element, in one launch (`_prepare_universal_oracle`; the
    launch shared with the other MoE load tests). (ds_to_universal.py crashes on an ep > 1 source,
    and its ep1 output loaded at ep 2 gives EP rank 1 experts 0-1: not tested here, see the README.)"""
    case = moe_cases[("test_moe_universal_oracle_at_another_dp", None)]
    (_, native), (_, universal) = case.verdicts_in_order()
    _assert_ok(native)
    assert native["how"] == "native" and native["world_size"] == 3
    assert universal["how"] == "universal" and universal["ok"], universal["load_error"] or universal["mismatches"][:10]
    from reshard_proof.truth_file import read_truth
    masters = read_truth(case.values["truth"])["engine"]["master"]
    tensors = sum(torch.is_tensor(v) for entry in masters.values()
                  for v in (entry["fp32"], *entry["state"].values(), *entry["scalars"].values()))
    assert universal["checked_tensors"] == tensors > 100  # every master and moment of every (global) parameter


PREPARE = {"test_moe_reshard_loads_exactly": _prepare_moe_loads,
           "test_zero0_moe_reshard_loads_exactly": _prepare_zero0_loads,
           "test_moe_universal_oracle_at_another_dp": _prepare_universal_oracle}


# --- tensor and expert parallelism together: AutoEP folded with AutoTP (README "TP with EP") ----

def _folded_save_names(tp: int, ep: int, dp: int, experts: int = 4) -> list[str]:
    """The files DeepSpeed 0.19.8 writes for AutoEP folded with AutoTP at ZeRO-1/2 (seen on CPU
    ranks, reshard_proof.folded_tp_ep): expert files carry the writer's TP rank, which for EP
    groups of consecutive ranks is the EP rank modulo tp (auto_ep_folding.py)."""
    per_rank = experts // ep
    names = [f"mp_rank_{t:02d}_model_states.pt" for t in range(tp)]
    names += [f"zero_pp_rank_{d}_mp_rank_{t:02d}_optim_states.pt" for d in range(dp) for t in range(tp)]
    names += [f"layer_{layer}_expert_{g}_mp_rank_{(g // per_rank) % tp:02d}_model_states.pt"
              for layer in range(2) for g in range(experts)]
    return names


def test_folded_topology_and_expert_file_names():
    """reshard.topology lays EP groups over consecutive global ranks (crossing TP lanes) as
    auto_ep_folding.py `expected_folding_group_tables` does; the expert files a folded save holds
    are exactly the (expert, TP rank) pairs its ranks load."""
    from deepspeed.module_inject.auto_ep_folding import build_folding_spec, expected_folding_group_tables

    from reshard.formats.deepspeed_files.deepspeed_folding import expert_file_names
    from reshard.topology import Topology
    for world, tp, ep in [(4, 2, 2), (4, 2, 4), (4, 4, 2), (8, 2, 4), (8, 4, 8), (6, 2, 3)]:
        topology = Topology(dp=world // tp, tp=tp, ep=ep)
        tables = expected_folding_group_tables(build_folding_spec(world_size=world, pp_size=1, tp_size=tp, ep_size=ep))
        for group in tables.ep_groups:
            assert [topology.expert_parallel_rank(r) for r in group] == list(range(ep))
        for group in tables.edp_groups:
            assert [topology.expert_data_parallel_rank(r) for r in group] == list(range(topology.expert_dp))
            assert [topology.expert_dp_rank_of(topology.expert_parallel_rank(group[0]), d)
                    for d in range(topology.expert_dp)] == list(group)
        for group in tables.dense_dp_groups:
            assert [topology.coordinates(r).dp for r in group] == list(range(topology.dp))
        loaded = {f"layer_{layer}_expert_{g}_mp_rank_{r % tp:02d}_model_states.pt"
                  for r in range(world) for layer in range(2)
                  for g in range((r % ep) * (4 // ep if ep <= 4 else 0), (r % ep + 1) * (4 // ep if ep <= 4 else 0))}
        if ep <= 4 and 4 % ep == 0:
            assert set(expert_file_names((4, 4), topology)) == loaded
    assert sorted(n for n in _folded_save_names(2, 2, 2) if n.startswith("layer")) == \
        expert_file_names((4, 4), Topology(dp=2, tp=2, ep=2))
    with pytest.raises(TopologyError, match="does not divide the 6 ranks"):
        Topology(dp=3, tp=2, ep=4)


def test_unknown_folding_and_unmarked_tp_experts_are_refused_naming_the_file(tmp_path):
    """Folded AutoEP+AutoTP of a folding version reshard does not know (or with expert tensor
    parallelism) is refused from its `folding` metadata, naming the model file and the sizes;
    without that metadata, expert files of a TP rank above 0 are refused by name. Never the
    misleading "old layout" message that an mp_rank_01 expert file used to get."""
    from reshard.jobs.collective_job import reshard_checkpoint
    tag = tmp_path / "src" / "global_step2"
    tag.mkdir(parents=True)
    (tmp_path / "src" / "latest").write_text("global_step2")
    for name in _folded_save_names(tp=2, ep=4, dp=2):
        torch.save({}, tag / name)
    for t in range(2):
        torch.save({"dp_world_size": 2, "mp_world_size": 2, "num_experts": [4, 4],
                    "folding": {"version": 2, "tp_size": 2, "tp_rank": t, "ep_size": 4, "etp_size": 1}},
                   tag / f"mp_rank_{t:02d}_model_states.pt")
    before = {p.name: p.read_bytes() for p in tag.iterdir()}
    with pytest.raises(UnsupportedCheckpoint, match="folded with AutoTP") as error:
        reshard_checkpoint(str(tmp_path / "src"), str(tmp_path / "a"), 2, target_ep=2, dry_run=True, quiet=True)
    assert str(tag / "mp_rank_00_model_states.pt") in str(error.value)
    assert "tp_size 2, ep_size 4" in str(error.value) and "folding version 2" in str(error.value)

    for t in range(2):
        torch.save({"dp_world_size": 2, "mp_world_size": 2, "num_experts": [4, 4]},
                   tag / f"mp_rank_{t:02d}_model_states.pt")
    with pytest.raises(UnsupportedCheckpoint, match="expert file of tensor-parallel rank 1") as error:
        reshard_checkpoint(str(tmp_path / "src"), str(tmp_path / "b"), 2, target_ep=2, dry_run=True, quiet=True)
    assert str(tag / "layer_0_expert_1_mp_rank_01_model_states.pt") in str(error.value)
    assert "old layout" not in str(error.value)
    assert sorted(p.name for p in tag.iterdir()) == sorted(before) and not (tmp_path / "a").exists()


class FoldedLoad(NamedTuple):
    """A load of a folded test: `load_dir` into a fresh folded engine (ZeRO `stage`, tp, ep) on
    nproc ranks, judged against `truth` (reshard_proof.folded_tp_ep); how: native or in_job."""
    nproc: int
    tp: int
    ep: int
    stage: int
    how: str
    load_dir: Path
    truth: Path
    verdict: Path


FOLDED_SOURCES = {  # name: (nproc, tp, ep, stage), the saves the folded tests reshard
    "z2": (4, 2, 2, 2), "z3": (4, 2, 2, 3), "plain": (2, 1, 2, 2)}
FOLDED_NEEDS = {"test_folded_tp_ep_reshards_to_folded_and_unfolded_targets": ("z2",),
                "test_unfolded_autoep_with_layer_specs_reshards_to_folded": ("plain",),
                "test_folded_tp_ep_zero3_reshards": ("z3",)}


class FoldedSources:
    """name (FOLDED_SOURCES) -> (save_dir, truth), trained once per session (conftest `folded_sources`);
    `train_many` trains several in one launch per (nproc, tp, ep), whatever their stage. Beside each truth,
    `folded_tp_ep.judge_truth_path(truth)`: the truth an FSDP2 judge of an export reads (tests/test_export_dcp.py)."""

    def __init__(self, root):
        self.root, self.trained_with = root, {}

    def train_many(self, names) -> None:
        from reshard_proof.folded_tp_ep import train_folded
        by_launch: dict[tuple, list[str]] = {}
        for name in dict.fromkeys(names):
            if name not in self.trained_with:
                by_launch.setdefault(FOLDED_SOURCES[name][:3], []).append(name)
        for (nproc, tp, ep), group in by_launch.items():
            try:
                train_folded(nproc, tp, ep, [(FOLDED_SOURCES[n][3], *self._paths(n)) for n in group])
                error = None
            except Exception as failure:  # noqa: BLE001 (raised by each test that needs these saves)
                error = failure
            self.trained_with.update({n: error for n in group})

    def _paths(self, name):
        return self.root / name, self.root / f"{name}.truth.pt"

    def __call__(self, name: str):
        self.train_many([name])
        if self.trained_with[name] is not None:
            raise self.trained_with[name]
        return self._paths(name)


@pytest.fixture(scope="module")
def folded_cases(request, folded_sources, tmp_path_factory):
    """{test name: JudgedCase} of the selected folded TP+EP tests: their saves trained with one launch
    per (nproc, tp, ep) (ZeRO-2 and ZeRO-3 at tp2 ep2 world 4 together; conftest `folded_sources`), each
    test's reshards made and checked by its `prepare` function, then every load at one (nproc, tp, ep)
    judged in ONE launch, whatever its stage (reshard_proof.folded_tp_ep `judge_folded_together`)."""
    from reshard_proof.folded_tp_ep import judge_folded_together
    from trained import selected_tests
    wanted = [name for name, _ in selected_tests(request, FOLDED_NEEDS)]
    folded_sources.train_many([name for test in wanted for name in FOLDED_NEEDS[test]])
    cases: dict[str, JudgedCase] = {}
    for test in wanted:
        case = cases[test] = JudgedCase(tmp_path_factory.mktemp("folded-case"))
        try:
            FOLDED_PREPARE[test](case, *(folded_sources(name) for name in FOLDED_NEEDS[test]))
        except Exception as error:  # noqa: BLE001 (raised by the test that owns the case)
            case.error = error
    judge_cases(cases, judge_folded_together)
    return cases


def _assert_folded(load: FoldedLoad, verdict: dict) -> None:
    assert verdict["ok"], verdict
    assert (verdict["world_size"], verdict["tp"], verdict["ep"], verdict["stage"], verdict["how"], verdict["load_dir"]) \
        == (load.nproc, load.tp, load.ep, load.stage, load.how, str(load.load_dir))
    assert verdict["checked_tensors"] == 156  # 39 trainable parameters (experts by global id) x master, 2 moments, module


def _prepare_folded_z2(case: JudgedCase, saved) -> None:
    from trained import reshard_cli, reshard_in_process, saved_parallel_sizes

    from reshard.formats.deepspeed_files.deepspeed_folding import expert_file_names
    from reshard.jobs.collective_job import reshard_checkpoint
    from reshard.topology import Topology
    save, truth = saved
    tmp_path = case.root
    names = sorted(os.listdir(save / "global_step2"))
    assert names == sorted(_folded_save_names(tp=2, ep=2, dp=2))
    before = {name: (save / "global_step2" / name).read_bytes() for name in names}
    # SLURM array mode leaves AutoEP folded with AutoTP layers to the collective job (its expert files are
    # rewritten per TP rank beside the plan): refused by name, nothing written
    refused = reshard_in_process(str(save), str(tmp_path / "array"), "--target-dp", "2", "--array-task", "0",
                                 "--array-tasks", "2")
    assert refused.returncode == 2 and "is a tensor-parallel (AutoTP, tp=2) checkpoint; SLURM array mode" in \
        refused.stderr and not (tmp_path / "array").exists(), refused.stderr

    result = reshard_cli(str(save), str(tmp_path / "w2"), "--target-dp", "1", "--target-tp", "2", "--target-ep", "2")
    assert result.returncode == 0, result.stderr
    reshard_checkpoint(str(save), str(tmp_path / "tp1"), 2, target_tp=1, target_ep=2, quiet=True)
    reshard_checkpoint(str(save), str(tmp_path / "ep4"), 2, target_tp=2, target_ep=4, quiet=True)
    for out, topology in (("w2", Topology(dp=1, tp=2, ep=2)), ("tp1", Topology(dp=2, ep=2)),
                          ("ep4", Topology(dp=2, tp=2, ep=4))):
        experts = sorted(n for n in os.listdir(tmp_path / out / "global_step2") if n.startswith("layer_"))
        assert experts == expert_file_names((4, 4), topology)
        stamp = torch.load(tmp_path / out / "global_step2" / experts[-1], weights_only=False).get("folding")
        assert (stamp is None) if topology.tp == 1 else (stamp["ep_size"], stamp["tp_size"]) == (topology.ep, 2)
        # the saved ds_config names the target's sizes (an engine built from it runs at the target)
        assert saved_parallel_sizes(tmp_path / out / "global_step2") == {(topology.tp, topology.ep)}
    # the metadata reshard recomputes is DeepSpeed's own: an identity reshard writes every file's
    # `folding` and `ds_autoep_layers` as the save did (an expert file's zero_partition_rank is
    # whichever of its several writers saved last, unchecked on load: left out)
    reshard_checkpoint(str(save), str(tmp_path / "same"), 2, target_tp=2, target_ep=2, quiet=True)
    assert sorted(n for n in os.listdir(tmp_path / "same" / "global_step2") if n != "reshard_manifest.json") == names
    for name in names:
        ours = torch.load(tmp_path / "same" / "global_step2" / name, weights_only=False)
        theirs = torch.load(save / "global_step2" / name, weights_only=False)
        if name.startswith("layer_"):
            ours["folding"].pop("zero_partition_rank"), theirs["folding"].pop("zero_partition_rank")
        assert ours["folding"] == theirs["folding"], name
        assert ours.get("ds_autoep_layers") == theirs.get("ds_autoep_layers"), name
        assert ours.get("ds_config") == theirs.get("ds_config"), name
    refused = reshard_in_process(str(save), str(tmp_path / "ep1"), "--target-dp", "2", "--target-tp", "2",
                                 "--target-ep", "1")  # the refusal, not the launcher
    assert refused.returncode == 2 and "autoep_size > 1" in refused.stderr and not (tmp_path / "ep1").exists()
    # the DCP export serves it (tests/test_export_dcp.py); the safetensors export refuses its TP slices by name,
    # nothing written
    refused = reshard_in_process("export", str(save), str(tmp_path / "st"), "--format", "safetensors")
    assert refused.returncode == 2 and not (tmp_path / "st").exists(), refused.stderr
    assert "global_step2: is a tensor-parallel (AutoTP, tp=2) checkpoint; the safetensors export" in refused.stderr
    assert {name: (save / "global_step2" / name).read_bytes() for name in names} == before
    case.loads += [FoldedLoad(2, 2, 2, 2, "native", tmp_path / "w2", truth, tmp_path / "v_w2.json"),
                   FoldedLoad(2, 1, 2, 2, "native", tmp_path / "tp1", truth, tmp_path / "v_tp1.json"),
                   FoldedLoad(4, 2, 4, 2, "native", tmp_path / "ep4", truth, tmp_path / "v_ep4.json"),
                   # reshard.deepspeed.load_checkpoint
                   FoldedLoad(2, 2, 2, 2, "in_job", save, truth, tmp_path / "v_in_job.json")]


@pytest.mark.e2e
def test_folded_tp_ep_reshards_to_folded_and_unfolded_targets(folded_cases):
    """A real AutoEP+AutoTP save (ZeRO-2 fp32, tp 2, ep 2, world 4), resharded to targets DeepSpeed
    builds: folded at another world (tp2 ep2 world 2, through the CLI), unfolded (tp1 ep2 world 2)
    and folded with EP groups across TP lanes (tp2 ep4 world 4); each loaded with plain
    `engine.load_checkpoint`, every master, moment and module value equal to the truth (experts by
    global id), then one more step; and in-job (`reshard.deepspeed.load_checkpoint` at world 2).
    The source is untouched; the expert files are named and stamped as DeepSpeed writes them
    (`_prepare_folded_z2`; judged in the launches shared by the folded tests, `folded_cases`)."""
    verdicts = list(folded_cases["test_folded_tp_ep_reshards_to_folded_and_unfolded_targets"].verdicts_in_order())
    assert len(verdicts) == 4
    for load, verdict in verdicts:
        _assert_folded(load, verdict)


def _prepare_unfolded(case: JudgedCase, saved) -> None:
    from reshard.jobs.collective_job import reshard_checkpoint
    save, truth = saved
    reshard_checkpoint(str(save), str(case.root / "folded"), 2, target_tp=2, target_ep=2, quiet=True)
    case.loads.append(FoldedLoad(4, 2, 2, 2, "native", case.root / "folded", truth, case.root / "v.json"))


@pytest.mark.e2e
def test_unfolded_autoep_with_layer_specs_reshards_to_folded(folded_cases):
    """AutoEP at tp 1 whose ds_config carries AutoTP layer specs (world 2, ep 2) -> folded tp2 ep2
    world 4, loaded with plain `engine.load_checkpoint`, every value equal to the truth."""
    verdicts = list(folded_cases["test_unfolded_autoep_with_layer_specs_reshards_to_folded"].verdicts_in_order())
    assert len(verdicts) == 1
    _assert_folded(*verdicts[0])


def _prepare_folded_z3(case: JudgedCase, saved) -> None:
    from reshard.jobs.collective_job import reshard_checkpoint
    save, truth = saved
    tmp_path = case.root
    reshard_checkpoint(str(save), str(tmp_path / "tp1"), 2, target_tp=1, target_ep=2, quiet=True)
    reshard_checkpoint(str(save), str(tmp_path / "ep4"), 2, target_tp=2, target_ep=4, quiet=True)
    assert not [n for n in os.listdir(tmp_path / "ep4" / "global_step2") if n.startswith("layer_")]
    case.loads += [FoldedLoad(2, 1, 2, 3, "native", tmp_path / "tp1", truth, tmp_path / "v_tp1.json"),
                   FoldedLoad(4, 2, 4, 3, "native", tmp_path / "ep4", truth, tmp_path / "v_ep4.json"),
                   FoldedLoad(2, 2, 2, 3, "in_job", save, truth, tmp_path / "v_in_job.json")]


@pytest.mark.e2e
def test_folded_tp_ep_zero3_reshards(folded_cases):
    """A real AutoEP+AutoTP ZeRO-3 save (fp32, tp 2, ep 2, world 4; experts in the ZeRO partitions,
    `ds_zero_partition_groups` per rank over global ranks of a TP lane or an expert-DP group) ->
    unfolded (tp1 ep2 world 2) and across TP lanes (tp2 ep4 world 4), plain `engine.load_checkpoint`,
    every value equal to the truth; and in-job at tp2 ep2 world 2 (`_prepare_folded_z3`)."""
    verdicts = list(folded_cases["test_folded_tp_ep_zero3_reshards"].verdicts_in_order())
    assert len(verdicts) == 3
    for load, verdict in verdicts:
        _assert_folded(load, verdict)


FOLDED_PREPARE = {"test_folded_tp_ep_reshards_to_folded_and_unfolded_targets": _prepare_folded_z2,
                  "test_unfolded_autoep_with_layer_specs_reshards_to_folded": _prepare_unfolded,
                  "test_folded_tp_ep_zero3_reshards": _prepare_folded_z3}
