"""Node-local checkpoints (`--node-local`): each node reads what it holds and receives its target ranks' files.

    python -m pytest -q tests/test_node_local.py              # pure planning + two-node runs (~3-4 min)
    python -m pytest -q tests/test_node_local.py -m "not e2e" # planning only, seconds

On one machine, two torchrun agents play two nodes (`reshard_proof.launch.launch_torchrun_nodes`:
c10d rendezvous on a free localhost port); each node has its own directories, as on real nodes.
DeepSpeed trains with `"checkpoint": {"use_node_local_storage": true}` on 2 nodes x 2 ranks, reshard
runs on the same two nodes for 2 x 3 and 2 x 1 ranks, and each target rank loads from its own
node's directory with plain `engine.load_checkpoint`, every element compared with the truth.
"""
from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_plan import STREAMS, expected_targets, simulate
from trained import reshard_in_threads, tree_state

from reshard.planning.chunked_plan import ChunkedSide, plan_chunked_space
from reshard.errors import CheckpointError, OptionError
from reshard.layouts.zero import ParamSpec, buffer_numels, logical_bases, zero3_layout, zero12_layout
from reshard.jobs.node_local import WorkerView, agreed_tag, model_states_ranks, node_leaders, node_local_ownership
from reshard.planning.plan import Ownership, ReshardPlan, plan_space, round_cap
from reshard_proof.launch import check_checkpoint, launch_torchrun_nodes, run_torchrun_nodes, train_checkpoint

VARIANT = "z2_node_local"
NODES = 2


# ---- planning (pure) ----

def optim(rank: int) -> str:
    return f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


def test_each_source_rank_is_read_once_by_a_worker_that_sees_it():
    seen = [frozenset({optim(0), optim(1)}), frozenset({optim(0), optim(1)}),
            frozenset({optim(2), optim(3), optim(0)}), frozenset({optim(2), optim(3)})]  # rank 0's file on both nodes
    own = node_local_ownership([[optim(r)] for r in range(4)], seen, [0, 0, 1, 1], 6, 3, "/ckpt/tag")
    assert own.reader_table == (0, 1, 2, 3)  # the copy of rank 0's file on node 1 is not read again
    assert own.writer_table == (0, 0, 1, 2, 2, 3)  # target rank r on node r // 3, blocks within the node
    assert [own.source_ranks_of(w) for w in range(4)] == [[0], [1], [2], [3]]
    assert own.max_target_ranks_per_worker == 2


def test_a_file_no_worker_sees_is_refused_by_name():
    seen = [frozenset({optim(0), optim(1)}), frozenset({optim(2)})]
    with pytest.raises(CheckpointError, match=r"/ckpt/tag/zero_pp_rank_3_mp_rank_00_optim_states\.pt: is on no node"):
        node_local_ownership([[optim(r)] for r in range(4)], seen, [0, 1], 2, 1, "/ckpt/tag")


def test_a_target_node_without_workers_is_refused():
    seen = [frozenset({optim(0)})]
    with pytest.raises(OptionError, match="target rank 2 runs on node 1"):
        node_local_ownership([[optim(0)]], seen, [0], 4, 2, "/ckpt/tag")


def test_the_model_states_file_goes_where_the_placement_says(tmp_path):
    """Node-local storage writes the ZeRO-1/2 model-states file on local rank 0 of every node: the
    placement (with_model_states_on) moves it from DeepSpeed's dp rank 0 to those ranks, with the
    tree rank 0's would have; the target-file builders (formats/) are not asked."""
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
    from synthetic_checkpoint import MODELS, write_checkpoint

    from reshard.formats.deepspeed_files.deepspeed_inspect import inspect_checkpoint, resolve_tag
    from reshard.formats.deepspeed_files.deepspeed_target import target_files
    from reshard.jobs.node_local import with_model_states_on
    from reshard.topology import Topology

    write_checkpoint(str(tmp_path), MODELS["tiny"], 2, 2)
    source = inspect_checkpoint(str(tmp_path), resolve_tag(str(tmp_path), None))
    target, model = Topology(dp=6), "mp_rank_00_model_states.pt"
    placed = with_model_states_on(target_files, model_states_ranks(6, 3))
    names = {rank: [f.name for f in placed(source, target, rank)] for rank in range(6)}
    assert names == {rank: [optim(rank)] + ([model] if rank in (0, 3) else []) for rank in range(6)}
    own = {rank: {f.name: f for f in target_files(source, target, rank)} for rank in range(6)}
    assert [model in own[rank] for rank in range(6)] == [True] + [False] * 5  # DeepSpeed's own: dp rank 0 only
    assert placed(source, target, 3)[1] == own[0][model]
    assert [f.name for f in with_model_states_on(target_files, {1})(source, target, 0)] == [optim(0)]


def zero0_save_files(ep: int, experts: int = 4, layers: int = 2) -> dict[int, set[str]]:
    """Global rank -> the files DeepSpeed 0.19.8 writes there for a ZeRO-0 MoE save (engine.py
    `_save_moe_checkpoint`: expert-data-parallel rank 0 of each EP rank, i.e. global rank e, writes
    expp_rank_e and its experts' files; dp rank 0 the model-states file), whatever the node-local flag."""
    local = experts // ep
    files = {e: {f"expp_rank_{e}_mp_rank_00_optim_states.pt"}
             | {f"layer_{L}_expert_{g}_mp_rank_00_model_states.pt" for L in range(layers)
                for g in range(e * local, (e + 1) * local)} for e in range(ep)}
    files[0].add("mp_rank_00_model_states.pt")
    return files


def test_a_zero0_moe_save_is_inspected_where_all_its_files_are_or_refused_by_name():
    """Saved on one node of 2 ranks (ep 2), every file is on node 0, and node 0's first worker
    inspects; saved on 2 nodes of 1 rank, EP rank 1's files are on node 1 only: refused, naming the tag
    directory and a file, before anything is read (no worker sees all of them together)."""
    from reshard.errors import UnsupportedCheckpoint
    from reshard.jobs.node_local_zero0 import zero0_inspector
    files = zero0_save_files(2)
    on_one_node = files[0] | files[1]
    assert zero0_inspector([frozenset(), on_one_node, on_one_node, frozenset()], "/ckpt/tag") == 1
    with pytest.raises(UnsupportedCheckpoint, match=r"^/ckpt/tag: is a ZeRO-0 MoE checkpoint whose files lie on "
                                                    r"several nodes \(expp_rank_1_mp_rank_00_optim_states\.pt"):
        zero0_inspector([frozenset(files[0]), frozenset(files[0]), frozenset(files[1]), frozenset(files[1])],
                        "/ckpt/tag")


def test_each_node_gets_the_zero0_moe_files_its_ranks_load():
    """Target rank r loads expp_rank_{r % ep}, the model-states file and its EP rank's experts
    (engine.py `_load_checkpoint`, `load_moe_state_dict`): the plan's target ranks are those files once
    per node, written by that node's workers; the expert files a node lacks are sent from a worker
    that sees them to the node's leader."""
    from reshard.jobs.node_local_zero0 import expert_files_of_node, zero0_copies, zero0_ships
    from reshard.topology import Topology
    target = Topology(dp=4, ep=4)
    copies, nodes = zero0_copies(target, 2)  # node 0: ranks 0, 1 (EP 0, 1); node 1: ranks 2, 3 (EP 2, 3)
    assert (copies, nodes) == ((0, 1, 4, 2, 3, 4), (0, 0, 0, 1, 1, 1))
    assert zero0_copies(Topology(dp=2, ep=1), 1) == ((0, 1, 0, 1), (0, 0, 1, 1))
    needs = {node: expert_files_of_node((4, 4), target, node, 2) for node in (0, 1)}
    assert needs[1] == {f"layer_{L}_expert_{g}_mp_rank_00_model_states.pt" for L in (0, 1) for g in (2, 3)}
    saved = zero0_save_files(2)
    seen = [frozenset(saved[0] | saved[1])] * 2 + [frozenset()] * 2  # saved on node 0's 2 ranks
    own = node_local_ownership([[f"expp_rank_{e}_mp_rank_00_optim_states.pt"] for e in range(2)], seen,
                               [0, 0, 1, 1], len(copies), 2, "/ckpt/tag", target_nodes=nodes)
    assert own.reader_table == (0, 1) and own.writer_table == (0, 0, 1, 2, 2, 3)
    experts = sorted(n for n in seen[0] if n.startswith("layer_"))
    ships = zero0_ships(experts, seen, [0, 0, 1, 1], {0: 0, 1: 2}, needs, "/ckpt/tag")
    assert sorted(name for name, _, _ in ships) == sorted(needs[1]) and {r for _, _, r in ships} == {2}
    assert {s for _, s, _ in ships} == {0, 1}  # spread over the workers that see them
    with pytest.raises(CheckpointError, match="layer_0_expert_2_mp_rank_00_model_states.pt: is on no node"):
        zero0_ships(experts, [frozenset(saved[0])] * 4, [0, 0, 1, 1], {0: 0, 1: 2}, needs, "/ckpt/tag")


def test_tag_model_writers_and_leaders():
    views = [WorkerView(0, "global_step3"), WorkerView(1, None)]
    assert agreed_tag(views, None, "/ckpt") == "global_step3"
    assert agreed_tag(views, "other", "/ckpt") == "other"
    with pytest.raises(CheckpointError, match="exists on no node"):
        agreed_tag([WorkerView(0, None)], None, "/ckpt")
    with pytest.raises(CheckpointError, match="different tags"):
        agreed_tag([WorkerView(0, "a"), WorkerView(1, "b")], None, "/ckpt")
    assert model_states_ranks(6, 3) == {0, 3}  # local rank 0 of every node (engine.py _configure_checkpointing)
    assert node_leaders([0, 0, 1, 1, 2], 6, 3) == {0: 0, 1: 2}  # node 2 hosts no target rank


@pytest.mark.parametrize("options,problem", [
    (dict(target_ranks_per_node=2), "goes with --node-local"),
    (dict(node_local=True), "needs --target-ranks-per-node"),
    (dict(node_local=True, target_ranks_per_node=0), "needs --target-ranks-per-node"),
    (dict(node_local=True, target_ranks_per_node=2, workers=2), "does not combine"),
    (dict(node_local=True, target_ranks_per_node=2, all_tags=True), "does not combine"),
])
def test_node_local_options_are_checked(options, problem):
    from reshard.jobs.options import ReshardOptions
    with pytest.raises(OptionError, match=problem):
        ReshardOptions(source="/a", destination="/b", target_dp=4, **options).validate()


@st.composite
def tabled_cases(draw):
    sizes = draw(st.lists(st.integers(0, 90), min_size=1, max_size=8))
    params = tuple(ParamSpec(f"p{i}", (n,)) for i, n in enumerate(sizes))
    n, m, w = draw(st.integers(1, 7)), draw(st.integers(1, 7)), draw(st.integers(1, 5))
    readers = draw(st.lists(st.integers(0, w - 1), min_size=n, max_size=n))
    writers = draw(st.lists(st.integers(0, w - 1), min_size=m, max_size=m))
    return params, n, m, Ownership.from_tables(readers, writers, w), draw(st.sampled_from([24, 300, 1 << 20]))


def limit(plan: ReshardPlan, space) -> int:
    """The bytes a worker may send or receive in one round: the cap for table plans, the window
    rule's bound (with the busiest worker's rank counts) for chunked ones."""
    own = plan.ownership
    if not hasattr(space, "sender_fanout"):
        return max(round_cap(plan.budget_bytes), space.bytes_per_element)
    fanout = space.sender_fanout
    per_worker = max(own.max_target_ranks_per_worker, min(own.max_source_ranks_per_worker * fanout, own.target_ranks))
    return max(round_cap(plan.budget_bytes), space.bytes_per_element * per_worker)


@given(tabled_cases(), st.booleans())
@settings(max_examples=80, deadline=None)
def test_any_ownership_table_moves_every_element_once(case, zero3):
    """Readers and writers in any order (as visibility and nodes make them): ZeRO-3's per-worker
    arithmetic plan and the ZeRO-1/2 table plan still deliver every element to its place."""
    params, n, m, own, budget = case
    groups = [tuple(range(len(params)))]
    if zero3:
        src, dst = zero3_layout(params, groups, n, 50), zero3_layout(params, groups, m, 50)
        bases = logical_bases([p.numel for p in params])
        space = plan_chunked_space("optim", ChunkedSide.of_zero3(src), ChunkedSide.of_zero3(dst), STREAMS[:2],
                                   bases, own, budget)
        table = plan_space("optim", src.pieces, dst.pieces, STREAMS[:2], buffer_numels(dst), own, budget)
        assert np.array_equal(space.traffic(own), table.traffic(own))
    else:
        src, dst = zero12_layout(params, groups, n), zero12_layout(params, groups, m)
        space = plan_space("optim", src.pieces, dst.pieces, STREAMS[:2], buffer_numels(dst), own, budget)
    plan = ReshardPlan(own, (space,), budget)
    got = simulate(plan, [src.pieces], [dst.pieces], [buffer_numels(src)], [buffer_numels(dst)],
                   round_limit=lambda s: limit(plan, s))
    want = expected_targets([dst.pieces], plan.spaces, [buffer_numels(dst)], own.target_ranks)
    assert got.keys() == want.keys()
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=str(key))


# ---- two nodes on this machine ----

@pytest.fixture(scope="module")
def node_local_checkpoint(tmp_path_factory):
    """A ZeRO-2 checkpoint saved with use_node_local_storage on 2 nodes x 2 ranks: root/node{k}/src."""
    root = tmp_path_factory.mktemp("node-local")
    train_checkpoint(VARIANT, 4, root / "node{node}" / "src", root / "truth.pt", nodes=NODES)
    return root, root / "truth.pt"


def node_dir(root, node: int, name: str):
    return root / f"node{node}" / name


def tag_files(save_dir) -> set[str]:
    tag = (save_dir / "latest").read_text() if (save_dir / "latest").exists() else "global_step3"
    return {p.name for p in (save_dir / tag).iterdir()}


def merged_source(root, merged):
    """The same checkpoint on one shared file system (node 0's directory plus node 1's optim files):
    what a job without --node-local reshards, the reference for the node-local outputs."""
    shutil.copytree(node_dir(root, 0, "src"), merged)
    for rank in (2, 3):
        shutil.copy2(node_dir(root, 1, "src") / "global_step3" / optim(rank), merged / "global_step3")
    return merged


def reshard_on_nodes(root, dst: str, m: int, per_node: int, *extra, env: dict | None = None, timeout: float = 300):
    return run_torchrun_nodes("reshard", NODES, 2, lambda k: [
        node_dir(root, k, "src"), node_dir(root, k, dst), "--target-dp", m, "--node-local",
        "--target-ranks-per-node", per_node, *(extra or ("--memory-budget", "16K", "--quiet"))], env=env,
        timeout=timeout, expect_files=[node_dir(root, k, dst) / "latest" for k in range(NODES)])


@pytest.mark.e2e
def test_each_node_gets_what_deepspeed_would_have_saved_there(node_local_checkpoint, tmp_path):
    root, truth = node_local_checkpoint
    # DeepSpeed's own node-local save: each rank's optim file on its node, the model-states file on
    # every node (local rank 0 writes it), `latest` and the recovery scripts on node 0 only.
    assert tag_files(node_dir(root, 0, "src")) == {"mp_rank_00_model_states.pt", optim(0), optim(1)}
    assert tag_files(node_dir(root, 1, "src")) == {"mp_rank_00_model_states.pt", optim(2), optim(3)}
    assert not (node_dir(root, 1, "src") / "latest").exists()
    before = {k: tree_state(node_dir(root, k, "src")) for k in range(NODES)}

    merged = merged_source(root, tmp_path / "merged")

    for m, per_node in ((6, 3), (2, 1)):
        dst = f"dst{m}"
        reshard_on_nodes(root, dst, m, per_node)
        reference = tmp_path / f"reference{m}"
        reshard_in_threads(merged, reference, m, 2)
        for node in range(NODES):
            out = node_dir(root, node, dst)
            ranks = range(node * per_node, (node + 1) * per_node)
            manifest = {"reshard_manifest.json"}
            assert tag_files(out) == {"mp_rank_00_model_states.pt", *map(optim, ranks)} | manifest
            assert (out / "latest").read_text() == "global_step3"  # on every node: each rank's load reads it
            assert (out / "zero_to_fp32.py").exists() == (node == 0)
            for rank in ranks:  # partitions and metadata: byte for byte what the shared-storage job writes
                assert (out / "global_step3" / optim(rank)).read_bytes() == \
                    (reference / "global_step3" / optim(rank)).read_bytes(), (node, rank)
            model = torch.load(out / "global_step3" / "mp_rank_00_model_states.pt", weights_only=False)
            want = torch.load(reference / "global_step3" / "mp_rank_00_model_states.pt", weights_only=False)
            # DeepSpeed fills the tied-weight table on global rank 0 only (engine.py _get_shared_params)
            assert model.pop("shared_params") == (want.pop("shared_params") if node == 0 else {})
            want.pop("shared_params", None)
            assert model.keys() == want.keys()
            for key in model:
                if key == "module":
                    assert all(torch.equal(model[key][n], want[key][n]) for n in want[key]), node
                else:
                    assert repr(model[key]) == repr(want[key]), (node, key)
        verdict = check_checkpoint(VARIANT, m, root / "node{node}" / dst, truth, tmp_path / f"verdict{m}.json",
                                   nodes=NODES)
        assert verdict["ok"], verdict.get("mismatches", [])[:10]
        assert verdict["checked_elements"] > 0 and verdict["world_size"] == m
    assert {k: tree_state(node_dir(root, k, "src")) for k in range(NODES)} == before  # the source is never modified


@pytest.mark.e2e
def test_a_file_on_no_node_is_refused_before_any_data_moves(node_local_checkpoint, tmp_path):
    root, _ = node_local_checkpoint
    for node in range(NODES):
        shutil.copytree(node_dir(root, node, "src"), node_dir(tmp_path, node, "src"))
    os.unlink(node_dir(tmp_path, 1, "src") / "global_step3" / optim(3))
    # Judged by files and exit codes (DESIGN.md section 8), not by the agents' output: worker 0 writes
    # the refusal to --result-json. (The count of "exitcode : 2" lines in torchrun's summary was a race
    # too: an agent lists the workers that had exited when it polled and SIGTERMs the rest,
    # torch/distributed/elastic/multiprocessing/api.py `SubprocessContext._poll`.)
    codes, outputs = launch_torchrun_nodes("reshard", NODES, 2, lambda k: [
        node_dir(tmp_path, k, "src"), node_dir(tmp_path, k, "dst"), "--target-dp", 3, "--node-local",
        "--target-ranks-per-node", 2, "--quiet", "--result-json", node_dir(tmp_path, k, "result.json")], timeout=240)
    assert all(code not in (0, None) for code in codes), codes  # both agents: their workers failed
    record = json.loads(node_dir(tmp_path, 0, "result.json").read_text())  # global rank 0 runs on node 0
    assert record["refused"] and record["exit_status"] == 2, record
    assert f"global_step3/{optim(3)}: is on no node" in record["error"], record
    assert not node_dir(tmp_path, 1, "result.json").exists()  # one record, from worker 0 only
    for node in range(NODES):
        assert not node_dir(tmp_path, node, "dst").exists()  # nothing created, nothing read into


def test_a_refusal_is_recorded_in_the_result_json(tmp_path):
    """What the node-local refusal test reads: a refused job writes its record to --result-json and exits 2."""
    from trained import reshard_in_process
    (tmp_path / "src").mkdir()
    record = tmp_path / "result.json"
    result = reshard_in_process(tmp_path / "src", tmp_path / "dst", "--target-dp", 2, "--result-json", record)
    assert result.returncode == 2, result.stderr
    assert json.loads(record.read_text()) == {"refused": True, "exit_status": 2,
                                              "error": result.stderr.strip().removeprefix("reshard: error: ")}


@pytest.mark.e2e
def test_a_killed_worker_leaves_each_node_resumable(node_local_checkpoint, tmp_path):
    """SIGKILL node 1's first worker (its leader) in round 3: no node publishes; the same command
    resumes on both nodes and gives the uninterrupted job's files."""
    from reshard_proof.launch import TorchrunError
    root, _ = node_local_checkpoint
    for node in range(NODES):
        shutil.copytree(node_dir(root, node, "src"), node_dir(tmp_path, node, "src"))
    durable = ("--memory-budget", "1K", "--durable-every", "1K")  # several rounds, a resume point every round or so
    with pytest.raises(TorchrunError):
        reshard_on_nodes(tmp_path, "dst", 6, 3, *durable, "--timeout", "30",
                         env={"RESHARD_FAILPOINTS": "kill@round=3,worker=2"}, timeout=240)
    for node in range(NODES):
        out = node_dir(tmp_path, node, "dst")
        assert not (out / "latest").exists() and not (out / "global_step3").exists()
        assert (out / ".reshard-staging" / "global_step3" / ".reshard-journal.json").exists()
    outputs = reshard_on_nodes(tmp_path, "dst", 6, 3, *durable)
    assert "resuming an interrupted run" in outputs[0], outputs[0][-2000:]
    reference = tmp_path / "reference"
    reshard_in_threads(merged_source(root, tmp_path / "merged"), reference, 6, 2)
    for node in range(NODES):
        out = node_dir(tmp_path, node, "dst") / "global_step3"
        for rank in range(node * 3, node * 3 + 3):
            assert (out / optim(rank)).read_bytes() == (reference / "global_step3" / optim(rank)).read_bytes()
        assert not (node_dir(tmp_path, node, "dst") / ".reshard-staging").exists()
