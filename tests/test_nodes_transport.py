"""Workers on several nodes: `python -m pytest -q tests/test_nodes_transport.py`.

Fast tier (no process): the node layout read from torchrun's environment or forced by
RESHARD_RANKS_PER_NODE, the choice of the two-level transport, the two-level all-to-all and object
collectives with every worker a thread (shared memory inside each node, the leaders over the
threaded transport the job tests use), and the plan's bytes between nodes against a count made
segment by segment.

e2e: two torchrun agents on this host (`--nnodes 2`), each one node of one worker, then of two,
reshard a trained checkpoint; the output is byte-identical to a one-node run, and the bytes the
leaders sent between nodes equal the plan's figure (both read from `--result-json`).
"""
from __future__ import annotations

import json
import threading
import uuid

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_chunked_plan import chunked_optim, zero3_cases
from test_plan import STREAMS, cases

from reshard.layouts.zero import buffer_numels
from reshard.jobs.options import parse_size
from reshard.planning.plan import ReshardPlan, plan_space, round_cap
from reshard.transport import _choose
from reshard.transport.nodes import NodeLayout, NodesTransport, staging_window
from reshard.transport.same_host import join_workers_on_this_host
from threaded_transport import in_threads

# the checkpoints its tests ask `trained` for, trained with the session's others (conftest.py)
pytestmark = pytest.mark.trains(("z2_fp32", 2))

LAUNCH_VARIABLES = ("TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                    "GROUP_WORLD_SIZE", "RESHARD_NODE_RANK", "SLURM_NODEID", "SLURM_NNODES", "RESHARD_RANKS_PER_NODE",
                    "PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK")


@pytest.fixture
def environment(monkeypatch):
    for name in LAUNCH_VARIABLES:
        monkeypatch.delenv(name, raising=False)

    def set_to(values: dict):
        for name, value in values.items():
            monkeypatch.setenv(name, str(value))
    return set_to


def test_torchrun_node_layout_is_read_from_its_environment(environment):
    environment({"RANK": 5, "WORLD_SIZE": 8, "LOCAL_RANK": 1, "LOCAL_WORLD_SIZE": 4, "GROUP_RANK": 1,
                 "GROUP_WORLD_SIZE": 2})
    assert NodeLayout.from_environment() == NodeLayout(rank=5, size=8, node=1, nodes=2, local_rank=1, local_size=4)


def test_forced_ranks_per_node_split_one_host_into_nodes(environment):
    environment({"RANK": 4, "WORLD_SIZE": 5, "LOCAL_RANK": 4, "LOCAL_WORLD_SIZE": 5, "GROUP_RANK": 0,
                 "RESHARD_RANKS_PER_NODE": 2})
    assert NodeLayout.from_environment() == NodeLayout(rank=4, size=5, node=2, nodes=3, local_rank=0, local_size=1)


def test_no_node_index_means_no_layout(environment):
    environment({"RANK": 0, "WORLD_SIZE": 4, "LOCAL_RANK": 0, "LOCAL_WORLD_SIZE": 2})
    assert NodeLayout.from_environment() is None


@pytest.mark.parametrize("values,backend,expected", [
    ({"WORLD_SIZE": 4, "LOCAL_WORLD_SIZE": 2, "GROUP_RANK": 1, "LOCAL_RANK": 0}, "auto", "nodes"),
    ({"WORLD_SIZE": 4, "LOCAL_WORLD_SIZE": 2, "GROUP_RANK": 1, "LOCAL_RANK": 0}, "gloo", "torch"),
    ({"WORLD_SIZE": 4, "LOCAL_WORLD_SIZE": 2, "LOCAL_RANK": 0}, "auto", "torch"),  # node index unknown
    ({"WORLD_SIZE": 2, "LOCAL_WORLD_SIZE": 2, "GROUP_RANK": 0, "LOCAL_RANK": 0}, "auto", "shared"),
    ({"WORLD_SIZE": 2, "LOCAL_WORLD_SIZE": 2, "GROUP_RANK": 0, "LOCAL_RANK": 0, "RESHARD_RANKS_PER_NODE": 1},
     "auto", "nodes"),
])
def test_the_two_level_transport_is_chosen_when_torchrun_workers_span_nodes(environment, values, backend, expected):
    environment({"TORCHELASTIC_RUN_ID": "x", "RANK": 0, **values})
    assert _choose("auto", backend) == expected


class _LeaderBoard:
    """The leaders' group as threads: reshard's threaded test transport (tests/threaded_transport.py)."""

    def __init__(self, nodes: int):
        from threaded_transport import ThreadTransport, _Board
        board = _Board(nodes, timeout=60)
        self.transports = [ThreadTransport(board, node) for node in range(nodes)]


def _two_level(ranks_of_node: list[list[int]]) -> list:
    """A NodesTransport per global rank, every worker a thread: `ranks_of_node` places the ranks."""
    size = sum(len(ranks) for ranks in ranks_of_node)
    leaders = _LeaderBoard(len(ranks_of_node))
    job = f"test-{uuid.uuid4()}"
    transports: list = [None] * size

    def worker(node: int, local_rank: int):
        rank = ranks_of_node[node][local_rank]
        layout = NodeLayout(rank, size, node, len(ranks_of_node), local_rank, len(ranks_of_node[node]))
        try:
            local = join_workers_on_this_host(local_rank, layout.local_size, f"{job}\nnode={node}", 30)
            transports[rank] = NodesTransport(layout, local, leaders.transports[node] if local_rank == 0 else None)
        except BaseException as error:  # noqa: BLE001  (handed to the test)
            transports[rank] = error

    threads = [threading.Thread(target=worker, args=(node, i)) for node, ranks in enumerate(ranks_of_node)
               for i in range(len(ranks))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return transports


def _count(sender: int, receiver: int, round_: int) -> int:
    """Bytes `sender` sends `receiver` in round `round_`: uneven, some zero."""
    return (sender * 7 + receiver * 3 + round_ * 5) % 11


@pytest.mark.parametrize("round_cap", [None, 16, 40], ids=["one-piece", "pieces-of-8", "pieces-of-20"])
def test_two_level_all_to_all_delivers_every_block_and_counts_what_crossed_nodes(round_cap):
    ranks_of_node = [[0, 3, 4], [2], [1, 5]]  # ranks interleaved over uneven nodes: nothing assumes blocks of ranks
    node_of = {r: node for node, ranks in enumerate(ranks_of_node) for r in ranks}
    transports = _two_level(ranks_of_node)
    assert all(isinstance(t, NodesTransport) for t in transports), transports
    size = len(transports)
    if round_cap is not None:  # what the exchange does: a leader holds a round's cross-node bytes in pieces
        for transport in transports:
            transport.bound_staging(round_cap)
    try:
        def exchange(transport):
            me, received = transport.rank, []
            buffers = transport.send_buffers(2, 64 * size)
            for round_ in range(3):  # the exchange alternates two send buffers in the shared segment
                counts = [_count(me, peer, round_) for peer in range(size)]
                send = buffers[round_ % 2]
                at = 0
                for peer, count in enumerate(counts):
                    send[at:at + count] = (me * 16 + peer + round_ * 100) % 256
                    at += count
                got = transport.all_to_all(send[:at], counts, [_count(peer, me, round_) for peer in range(size)])
                received.append(got.tolist())
            own_buffer = np.full(_count(me, me, 9) + sum(_count(me, p, 9) for p in range(size) if p != me), 7,
                                 dtype=np.uint8)  # a buffer outside the segment works too
            transport.all_to_all(own_buffer, [_count(me, p, 9) for p in range(size)],
                                 [_count(p, me, 9) for p in range(size)])
            gathered = transport.all_gather_object(("worker", me))
            told = transport.broadcast_object(f"from {me}" if me == 5 else None, src=5)
            transport.barrier()
            return received, gathered, told, transport.bytes_between_nodes

        results = in_threads(transports, exchange)
        crossed = 0
        for rank, result in enumerate(results):
            assert not isinstance(result, BaseException), result
            received, gathered, told, _ = result
            for round_ in range(3):
                expected = []
                for peer in range(size):
                    expected += [(peer * 16 + rank + round_ * 100) % 256] * _count(peer, rank, round_)
                assert received[round_] == expected, (rank, round_)
            assert gathered == [("worker", r) for r in range(size)] and told == "from 5"
        for node, ranks in enumerate(ranks_of_node):  # a leader counts what its node sent, the others nothing
            sent = sum(_count(s, d, round_) for round_ in (0, 1, 2, 9) for s in ranks for d in range(size)
                       if node_of[d] != node)
            assert [results[r][3] for r in ranks] == [sent] + [0] * (len(ranks) - 1)
            crossed += sent
            leader = transports[ranks[0]]
            whole_round = max(  # a round's cross-node bytes at this node, leaving and arriving
                sum(_count(s, d, round_) for s in ranks for d in range(size) if node_of[d] != node) +
                sum(_count(s, d, round_) for d in ranks for s in range(size) if node_of[s] != node)
                for round_ in (0, 1, 2, 9))
            if round_cap is None:  # one piece: a round's whole traffic at once
                assert leader.staging_peak_bytes == whole_round
            else:  # each way at most the window (or one byte per node, below a window that small)
                bound = 2 * max(staging_window(round_cap), len(ranks_of_node))
                assert leader.staging_peak_bytes <= bound < whole_round  # so the rounds did go in pieces
        assert crossed > 0
        assert transports[4].node_of_worker == (0, 2, 1, 0, 0, 2)
    finally:
        for transport in transports:
            if isinstance(transport, NodesTransport):
                transport.local.close()


def _sent_between_nodes(plan: ReshardPlan, node_of: list[int]) -> int:
    """What the exchange sends across nodes, block by block over every worker's rounds."""
    crossed = 0
    for worker in range(plan.ownership.workers):
        view = plan.worker_view(worker)
        for r in range(plan.rounds):
            index, sends, _ = view.round(r)
            bpe = plan.spaces[index].bytes_per_element
            crossed += sum(block.elements * bpe for block in sends if node_of[block.peer] != node_of[worker])
    return crossed


@given(cases(), st.data())
@settings(max_examples=30, deadline=None)
def test_plan_bytes_between_nodes_equal_the_blocks_sent_across_nodes(case, data):
    params, source, target, ownership, budget = case
    node_of = data.draw(st.lists(st.integers(0, 2), min_size=ownership.workers, max_size=ownership.workers))
    space = plan_space("optim", source.pieces, target.pieces, STREAMS, buffer_numels(target), ownership, budget)
    plan = ReshardPlan(ownership, (space,), budget)
    assert plan.bytes_between_nodes(node_of) == _sent_between_nodes(plan, node_of)
    assert plan.bytes_between_nodes([0] * ownership.workers) == 0


@given(zero3_cases(), st.data())
@settings(max_examples=30, deadline=None)
def test_chunked_plan_bytes_between_nodes_equal_the_blocks_sent_across_nodes(case, data):
    params, source, target, ownership, budget = case
    node_of = data.draw(st.lists(st.integers(0, 2), min_size=ownership.workers, max_size=ownership.workers))
    plan = ReshardPlan(ownership, (chunked_optim(source, target, ownership, budget, STREAMS[:2]),), budget[0])
    assert plan.bytes_between_nodes(node_of) == _sent_between_nodes(plan, node_of)


@pytest.mark.e2e
@pytest.mark.parametrize("per_node", [1, 2], ids=["1-worker-per-node", "2-workers-per-node"])
def test_two_torchrun_nodes_write_the_one_node_bytes_and_send_what_the_plan_says_across(torchrun_output, trained,
                                                                                          tmp_path, per_node):
    from trained import tree_files

    from reshard_proof.launch import launch_torchrun_nodes
    reference = torchrun_output("z2_fp32", 2, 3)  # one node: 2 torchrun workers over gloo, --memory-budget 16K
    source, _ = trained("z2_fp32", 2)
    destination, result_path = tmp_path / "dst", tmp_path / "result.json"
    codes, outputs = launch_torchrun_nodes(
        "reshard", 2, per_node, [source, destination, "--target-dp", "3", "--memory-budget", "1K", "--quiet",
                                 "--result-json", result_path], timeout=240)
    assert codes == [0, 0], "\n".join(output[-3000:] for output in outputs)
    assert tree_files(destination) == tree_files(reference)
    (result,) = json.loads(result_path.read_text())["checkpoints"]
    assert result["nodes"] == 2 and result["workers"] == 2 * per_node
    assert result["transport"].startswith("shared memory inside 2 nodes")
    assert result["bytes_between_nodes"] == result["plan_bytes_between_nodes"] > 0
    leaders = [0, per_node]  # global ranks of the node leaders: local rank 0 of each agent
    reports = result["workers_report"]
    assert all(r["bytes_between_nodes"] == 0 for r in reports if r["worker"] not in leaders)
    assert [r["torch_imported"] for r in reports] == [r["worker"] in leaders for r in reports]  # only leaders
    # A leader holds a round's cross-node bytes in pieces of the window the budget gives, each way (at
    # the smallest budget: the bytes above were moved in pieces, and still land where the 16K run put them).
    window = staging_window(round_cap(parse_size("1K")))
    assert all(0 < r["staging_peak_bytes"] <= 2 * window for r in reports if r["worker"] in leaders)
    assert all(r["staging_peak_bytes"] == 0 for r in reports if r["worker"] not in leaders)
    # and its anonymous memory (torch and gloo included, sampled after every round with the staging
    # buffer still held) within the budget + 300 MB the benchmarks allow a worker
    assert all(r["peak_anonymous_bytes"] <= parse_size("1K") + 300 * 10**6 for r in reports if r["worker"] in leaders)
