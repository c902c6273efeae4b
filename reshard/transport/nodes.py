"""Workers on several nodes: shared memory inside a node, torch.distributed only between nodes.

    # on each node (chosen by transport_from_environment when torchrun's workers span nodes):
    torchrun --nnodes=2 --node_rank=$NODE --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=$HEAD:29500 \
        -m reshard SRC DST --target-dp 32
    # one host playing two nodes (tests, bench): two agents --nnodes=2, or one agent told the node size
    RESHARD_RANKS_PER_NODE=2 torchrun --standalone --nproc_per_node=4 -m reshard SRC DST --target-dp 3
    # MPI: ranks spanning nodes (or told the node size) get the same two levels, MPI between leaders
    RESHARD_RANKS_PER_NODE=2 mpiexec -n 4 python -m reshard SRC DST --target-dp 3

    layout = NodeLayout.from_environment()                  # node, local rank, node size, number of nodes
    transport = join_nodes(layout, backend="auto", timeout_seconds=600)

The workers of a node meet as torchrun workers on one host do (reshard.transport.same_host:
abstract Unix sockets, one memfd send segment each, `ForkedTransport`), under a name that also
holds the node index, so two simulated nodes on one host stay apart. Each node's local rank 0
is its leader; the leaders, one per node, form a torch.distributed group of their own (gloo, or
NCCL with CUDA), rank = node index, through torchrun's store (MASTER_ADDR, MASTER_PORT). Only
the leaders import torch; the other workers never do. Under an MPI launcher the leaders talk over an
MPI communicator of their own instead (`join_mpi_nodes`), and nobody imports torch.

A round (`all_to_all`), for worker s on node n sending to worker d:
1. every worker packs its round into its shared segment (the exchange's `send_buffers`) and tells
   its node's workers where (offset, send and receive counts);
2. blocks between two workers of one node are copied out of the sender's segment by the
   receiver, as in `ForkedTransport`;
3. the leader packs everything that leaves the node once, one block per destination node: for
   each destination worker d of node m in node order, each sender s of this node in node order,
   the block s -> d, copied from s's segment. One `all_to_all_single` between the leaders moves
   these node blocks; each leader receives the blocks for its node straight into its own shared
   segment, laid out the same way (d, then s);
4. the leader tells each of its workers where its blocks from each other node lie there; the
   worker copies them out; the round ends when every worker of the node has its copy.
Steps 3 and 4 go in pieces: a leader holds at most `staging_window` bytes of the round's
cross-node traffic each way at a time (half the round's share of `--memory-budget`, which the
exchange hands over through `bound_staging`). Each leader cuts every node block into the same
number of near-equal pieces, the number the busiest leader needs (the leaders agree on it with one
small all-gather per round); piece k of every block goes in the k-th `all_to_all_single`, lands in
the same window of the leader's segment, and the workers copy their parts of it out and say so
before piece k + 1 arrives there. So a leader holds at most one round cap (a third of the budget)
beyond what every worker holds, whatever the node size; the summary's `nodes` line and the
report's `staging_peak_bytes` say how much it held at most.
So each byte crossing nodes is packed by its worker once (into shared memory), gathered by its
leader once, sent once, and copied once by its receiver; `bytes_between_nodes` counts what this
node's leader sent, which over all leaders is exactly what the plan says must cross
(`ReshardPlan.bytes_between_nodes`).

Why leaders and not every worker with its counterparts on other nodes: the other workers need no
torch and no process group (start-up is most of a small job's time), the network sees one message
per pair of nodes and piece instead of one per pair of workers, and with NCCL one GPU per node
stages the traffic. The cost: a leader holds a staging window each way beyond its own buffers,
and a round whose cross-node bytes exceed the window takes several collectives.

Objects (agreement, reports) go the same two levels: inside the node over the worker sockets,
between nodes over the leaders' group. A worker that dies makes its node's workers fail at once
(WorkerLost); another node's leader fails when its group sees the connection close, or after the
timeout, and its workers with it, each with one line (WorkerLost, exit status 1).
"""
from __future__ import annotations

import os
import pickle
from dataclasses import dataclass

import numpy as np

from reshard.errors import OptionError
from reshard.transport.forked import ForkedTransport, WorkerLost

NODE_RANK_VARIABLES = ("RESHARD_NODE_RANK", "GROUP_RANK", "SLURM_NODEID")
"""Where a worker learns its node's index, first found wins: an explicit override, torchrun's
node rank (--node_rank under static rendezvous, the rendezvous' order under c10d), SLURM's node
index within the allocation."""
NODE_COUNT_VARIABLES = ("GROUP_WORLD_SIZE", "SLURM_NNODES")
"""The number of nodes: torchrun's number of agents, SLURM's nodes in the allocation."""
RANKS_PER_NODE_VARIABLE = "RESHARD_RANKS_PER_NODE"
"""Treat each run of this many consecutive ranks as one node (one host simulating several)."""
ALIGN = 64


@dataclass(frozen=True)
class NodeLayout:
    """Where this worker sits: its global rank among `size`, its node among `nodes`, its rank among
    the `local_size` workers of that node. Which global ranks share a node is learnt when they meet."""

    rank: int
    size: int
    node: int
    nodes: int
    local_rank: int
    local_size: int

    @classmethod
    def from_environment(cls) -> "NodeLayout | None":
        """The layout torchrun (or SLURM) describes, or RESHARD_RANKS_PER_NODE forces; None when the
        environment does not say (not started by a launcher, or no node index)."""
        env = os.environ
        if "RANK" not in env or "WORLD_SIZE" not in env:
            return None
        rank, size = _integer("RANK"), _integer("WORLD_SIZE")
        forced = env.get(RANKS_PER_NODE_VARIABLE)
        if forced is not None:
            per_node = _integer(RANKS_PER_NODE_VARIABLE)
            if per_node < 1:
                raise OptionError(f"{RANKS_PER_NODE_VARIABLE} must be >= 1, got {per_node}")
            node = rank // per_node
            return cls(rank, size, node, -(-size // per_node), rank % per_node,
                       min(per_node, size - node * per_node))
        node = next((_integer(name) for name in NODE_RANK_VARIABLES if name in env), None)
        if node is None or "LOCAL_RANK" not in env or "LOCAL_WORLD_SIZE" not in env:
            return None
        local_rank, local_size = _integer("LOCAL_RANK"), _integer("LOCAL_WORLD_SIZE")
        nodes = next((_integer(name) for name in NODE_COUNT_VARIABLES if name in env), None)
        if nodes is None:
            if size % local_size:
                return None
            nodes = size // local_size
        return cls(rank, size, node, nodes, local_rank, local_size)

    @property
    def leader(self) -> bool:
        return self.local_rank == 0


def _integer(name: str) -> int:
    value = os.environ[name]
    try:
        return int(value)
    except ValueError:
        raise OptionError(f"{name}={value!r} is not an integer") from None


def spans_nodes(layout: NodeLayout | None) -> bool:
    return layout is not None and layout.nodes > 1


def join_nodes(layout: NodeLayout, backend: str = "auto", timeout_seconds: float = 600) -> "NodesTransport":
    """Meet this node's workers over shared memory and, on the leader, the other nodes' leaders over
    torch.distributed (module docstring); returns this worker's transport."""
    from reshard.transport.same_host import job_identity, join_workers_on_this_host
    local = join_workers_on_this_host(layout.local_rank, layout.local_size,
                                      f"{job_identity()}\nnode={layout.node}", timeout_seconds)

    def join_leaders():
        try:
            return _join_leaders(layout, backend, timeout_seconds)
        except RuntimeError as error:  # another node's leader never came (the store or the group timed out)
            first = (str(error).strip().splitlines() or [type(error).__name__])[0]
            raise WorkerLost(f"worker {layout.rank} (leader of node {layout.node}): the node leaders did not "
                             f"all meet within {timeout_seconds:g}s: {first}") from None
    return _two_levels(layout, local, join_leaders)


def join_mpi_nodes(timeout_seconds: float = 600) -> "NodesTransport | None":
    """Under an MPI launcher (mpiexec, srun --mpi): the two-level transport when the job's ranks span
    several nodes, with MPI between the node leaders; None when they all share one node (the plain
    MPI transport then serves, as before).

    The nodes are MPI's own: the ranks that share memory (`Split_type(COMM_TYPE_SHARED)`), or each run
    of RESHARD_RANKS_PER_NODE consecutive ranks (one host playing several nodes). Local rank 0 of each
    node leads; the leaders' communicator (`Split`) numbers the nodes. The workers of a node meet over
    shared memory as torchrun's do, under a name made of a token world rank 0 draws and broadcasts,
    so two MPI jobs on one host stay apart. Every call here is collective over COMM_WORLD."""
    from reshard.transport.mpi import MPITransport, import_mpi
    from reshard.transport.same_host import join_workers_on_this_host
    MPI = import_mpi()
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    if RANKS_PER_NODE_VARIABLE in os.environ:
        per_node = _integer(RANKS_PER_NODE_VARIABLE)
        if per_node < 1:
            raise OptionError(f"{RANKS_PER_NODE_VARIABLE} must be >= 1, got {per_node}")
        node_comm = world.Split(rank // per_node, rank)
    else:
        node_comm = world.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    local_rank, local_size = node_comm.Get_rank(), node_comm.Get_size()
    leaders_comm = world.Split(0 if local_rank == 0 else MPI.UNDEFINED, rank)
    leader = leaders_comm != MPI.COMM_NULL
    nodes = world.allreduce(1 if leader else 0)
    if nodes < 2:
        node_comm.Free()
        if leader:
            leaders_comm.Free()
        return None
    node = node_comm.bcast(leaders_comm.Get_rank() if leader else None, root=0)
    token = world.bcast(os.urandom(16).hex() if rank == 0 else None, root=0)
    node_comm.Free()
    layout = NodeLayout(rank, size, node, nodes, local_rank, local_size)
    local = join_workers_on_this_host(local_rank, local_size, f"mpi job {token}\nnode={node}", timeout_seconds)
    return _two_levels(layout, local, lambda: MPITransport(comm=leaders_comm, timeout_seconds=timeout_seconds,
                                                           owns_process=True))


def _two_levels(layout: NodeLayout, local, join_leaders) -> "NodesTransport":
    """The NodesTransport over this node's shared memory `local` and, on the node's leader, the
    transport `join_leaders()` gives; should either fail, what was opened is closed."""
    leaders = None
    try:
        if layout.leader:
            leaders = join_leaders()
        return NodesTransport(layout, local, leaders)
    except BaseException:
        local.close()
        if leaders is not None:
            leaders.close()
        raise


def _join_leaders(layout: NodeLayout, backend: str, timeout_seconds: float):
    """A process group of the node leaders (rank = node index) in torchrun's store, under a prefix
    of its own: the workers of the job never form a group of their own."""
    import datetime

    import torch
    import torch.distributed as dist

    from reshard.transport.torch_backend import torch_backend_for
    from reshard.transport.torch_distributed import TorchDistributedTransport
    # one process per node joins: the leader alone needs a GPU for NCCL
    backend = torch_backend_for(backend, torch.cuda.device_count() if torch.cuda.is_available() else 0, 1)
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    timeout = datetime.timedelta(seconds=timeout_seconds)
    # torchrun's agent hosts the store at MASTER_ADDR:MASTER_PORT (TORCHELASTIC_USE_AGENT_STORE, see
    # torch/distributed/rendezvous.py:_create_c10d_store); without it node 0's leader hosts one there.
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", "29500")),
                          world_size=layout.nodes, is_master=not agent_store and layout.node == 0, timeout=timeout)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group(backend, store=dist.PrefixStore(f"reshard-node-leaders/{attempt}", store),
                            rank=layout.node, world_size=layout.nodes, timeout=timeout)
    return TorchDistributedTransport(owns_group=True)


def _starts(counts) -> list[int]:
    starts = [0]
    for count in counts:
        starts.append(starts[-1] + count)
    return starts


def staging_window(round_cap_bytes: int) -> int:
    """Bytes of a round's cross-node traffic a leader holds at a time each way: half a round's share of
    the budget, so that leaving and arriving pieces together add at most one round cap (a third of
    the budget) to what every worker holds."""
    return max(1, round_cap_bytes // 2)


def _piece(total: int, piece: int, pieces: int) -> tuple[int, int]:
    """[start, stop) of piece `piece` of `pieces` near-equal pieces of `total` bytes."""
    size = -(-total // pieces)
    return min(total, piece * size), min(total, (piece + 1) * size)


def _cut(blocks: list, start: int, stop: int):
    """(key, offset inside the block, bytes) of each part of `blocks` ([(key, bytes)], laid end to end)
    that lies in [start, stop)."""
    at = 0
    for key, count in blocks:
        lo, hi = max(start, at), min(stop, at + count)
        if lo < hi:
            yield key, lo - at, hi - lo
        at += count
        if at >= stop:
            return


class NodesTransport:
    """The Transport of workers spread over nodes (module docstring): a ForkedTransport inside each
    node, a torch.distributed group of the node leaders between nodes."""

    def __init__(self, layout: NodeLayout, local: ForkedTransport, leaders):
        self.layout, self.local, self.leaders = layout, local, leaders
        self.rank, self.size = layout.rank, layout.size
        self.bytes_between_nodes = 0
        """Bytes this node's leader sent to other nodes (0 on the other workers)."""
        self.window: int | None = None
        """Most bytes of a round's cross-node traffic a leader holds at a time each way (`bound_staging`)."""
        self.staging_peak_bytes = 0
        """Most cross-node bytes this leader held at once, leaving and arriving together (0 elsewhere)."""
        self.staging = np.empty(0, dtype=np.uint8)
        here = local.all_gather_object(layout.rank)  # the global ranks of this node, in local order
        found = None
        if leaders is not None:
            found = (leaders.all_gather_object(here), leaders.name)
        table, between = local.broadcast_object(found, src=0)
        self.ranks_of_node: list[list[int]] = [list(ranks) for ranks in table]
        """Global ranks of each node's workers, in local-rank order (node = leaders' group rank)."""
        listed = sorted(r for ranks in self.ranks_of_node for r in ranks)
        if listed != list(range(self.size)) or self.ranks_of_node[layout.node][layout.local_rank] != layout.rank:
            raise OptionError(f"worker {self.rank}: the launcher's node layout does not add up (nodes hold ranks "
                              f"{self.ranks_of_node}, for {self.size} workers): every node must start its "
                              "LOCAL_WORLD_SIZE workers with ranks that cover 0..WORLD_SIZE-1 once")
        self.node_of_worker: tuple[int, ...] = tuple(
            node for _, node in sorted((r, node) for node, ranks in enumerate(self.ranks_of_node) for r in ranks))
        """The node of each global rank: what `ReshardPlan.bytes_between_nodes` is computed from."""
        self.nodes = len(self.ranks_of_node)
        self.name = f"shared memory inside {self.nodes} nodes, {between} between their leaders"

    def _leaders(self, what: str, call, *args, **kwargs):
        """A collective of the leaders' group; its failure (another node's leader died or hangs, and
        gloo or NCCL says so) ends this worker as a lost peer does, with one line naming the step."""
        try:
            return call(*args, **kwargs)
        except RuntimeError as error:
            first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise WorkerLost(f"worker {self.rank} (leader of node {self.layout.node}): {what} between the node "
                             f"leaders failed: {first}") from None

    # -- the rounds ------------------------------------------------------------------------
    def send_buffers(self, count: int, size: int) -> list[np.ndarray]:
        """Send buffers in this worker's shared segment, where its node's workers and leader read them."""
        return self.local.send_buffers(count, size)

    def all_to_all(self, send, send_counts, recv_counts, out=None):
        local, me = self.local, self.rank
        send = np.asarray(send).view(np.uint8)
        send_counts, recv_counts = [int(c) for c in send_counts], [int(c) for c in recv_counts]
        result = out if out is not None else np.empty(sum(recv_counts), dtype=np.uint8)
        send_at, recv_at = _starts(send_counts), _starts(recv_counts)
        base = local.place(send, send_at[-1])
        note = pickle.dumps((base, len(local.own_segment(0)), send_counts, recv_counts))
        here = self.ranks_of_node[self.layout.node]
        notes = {peer: pickle.loads(data) for peer, data in
                 local.messages({peer: note for peer in local.peers}, local.peers, "a round's all-to-all").items()}
        result[recv_at[me]:recv_at[me + 1]] = send[send_at[me]:send_at[me + 1]]
        for peer, (peer_base, peer_size, peer_sends, _) in notes.items():
            sender = here[peer]
            if peer_sends[me] != recv_counts[sender]:
                raise AssertionError(f"worker {sender} sends {peer_sends[me]} bytes to worker {me}, which expects "
                                     f"{recv_counts[sender]}")
            at = peer_base + sum(peer_sends[:me])
            result[recv_at[sender]:recv_at[sender + 1]] = local.peer_segment(peer, peer_size)[at:at + peer_sends[me]]
        notes[self.layout.local_rank] = (base, None, send_counts, recv_counts)
        if self.leaders is not None:
            self._between_nodes(notes, base + send_at[-1], result, recv_at)
        else:
            self._receive_from_other_nodes(result, recv_at)
        local.messages({peer: b"" for peer in local.peers}, local.peers, "the end of a round")  # segments reusable
        return result

    def bound_staging(self, round_cap_bytes: int) -> None:
        """Hold at most `staging_window(round_cap_bytes)` bytes of a round's cross-node traffic at a time
        each way on a leader (the exchange calls this with the plan's round cap): the leaders then
        move a round in pieces. Without a bound, a round moves in one piece."""
        self.window = staging_window(round_cap_bytes)

    def _receive_from_other_nodes(self, result: np.ndarray, recv_at: list[int]) -> None:
        """(Not a leader) copy this worker's blocks from other nodes out of the leader's segment, piece
        by piece as the leader says where they lie; acknowledge every piece but the last (the end of
        the round acknowledges that one), so that the leader may receive the next piece there."""
        local = self.local
        while True:
            size, copies, last = pickle.loads(local.messages({}, (0,), "waiting for what came from other nodes")[0])
            leader_segment = local.peer_segment(0, size)
            for sender, offset, at, count in copies:
                result[recv_at[sender] + offset:recv_at[sender] + offset + count] = leader_segment[at:at + count]
            if last:
                return
            local.messages({0: b""}, (), "a piece from other nodes copied")

    def _between_nodes(self, notes: dict, used: int, result: np.ndarray, recv_at: list[int]) -> None:
        """(Leader) move what leaves and what reaches this node, in pieces of at most `self.window`
        bytes each way: pack a piece of every block leaving for each other node into the staging
        buffer, run the leaders' all-to-all into this segment after `used` bytes, tell each local
        worker where its share of the piece lies there, wait until they copied it, next piece."""
        local, node, me = self.local, self.layout.node, self.layout.local_rank
        here = self.ranks_of_node[node]
        others = [other for other in range(self.nodes) if other != node]
        sender_at = [_starts(notes[i][2]) for i in range(len(here))]
        # Each other node's block, in the order both ends lay it out: destination worker, then sender.
        leaving = {other: [((i, notes[i][0] + sender_at[i][d]), notes[i][2][d]) for d in self.ranks_of_node[other]
                           for i in range(len(here)) if notes[i][2][d]] for other in others}
        arriving = {other: [((j, s), notes[j][3][s]) for j in range(len(here)) for s in self.ranks_of_node[other]
                            if notes[j][3][s]] for other in others}
        out_total = {other: sum(count for _, count in blocks) for other, blocks in leaving.items()}
        in_total = {other: sum(count for _, count in blocks) for other, blocks in arriving.items()}
        most = max(sum(out_total.values()), sum(in_total.values()))
        if self.window is None:
            pieces = 1
        else:  # every leader runs as many all-to-alls as the busiest one needs
            mine = -(-most // max(1, self.window - self.nodes))  # rounding each node's share up adds < 1 per node
            pieces = max(self._leaders("agreeing on the pieces of a round", self.leaders.all_gather_object, mine))
        start = -(-max(used, local.reserved) // ALIGN) * ALIGN
        segments = {i: local.own_segment(0) if i == me else local.peer_segment(i, notes[i][1]) for i in range(len(here))}
        for piece in range(pieces):
            node_sends, node_recvs = [0] * self.nodes, [0] * self.nodes
            out_span, in_span = {}, {}
            for other in others:
                out_span[other] = _piece(out_total[other], piece, pieces)
                in_span[other] = _piece(in_total[other], piece, pieces)
                node_sends[other] = out_span[other][1] - out_span[other][0]
                node_recvs[other] = in_span[other][1] - in_span[other][0]
            outgoing = self._outgoing(sum(node_sends))
            position = 0
            for other in others:
                for (i, at), skip, count in _cut(leaving[other], *out_span[other]):
                    outgoing[position:position + count] = segments[i][at + skip:at + skip + count]
                    position += count
            incoming_total = sum(node_recvs)
            segment = local.own_segment(start + incoming_total)
            segments[me] = local.own_segment(0)
            self._leaders("a round's all-to-all", self.leaders.all_to_all, outgoing, node_sends, node_recvs,
                          out=segment[start:start + incoming_total])
            self.bytes_between_nodes += sum(node_sends)
            self.staging_peak_bytes = max(self.staging_peak_bytes, sum(node_sends) + incoming_total)
            copies: dict[int, list] = {j: [] for j in range(len(here))}
            at = start
            for other in others:
                for (j, s), skip, count in _cut(arriving[other], *in_span[other]):
                    copies[j].append((s, skip, at, count))
                    at += count
            for s, skip, at, count in copies[me]:
                result[recv_at[s] + skip:recv_at[s] + skip + count] = segment[at:at + count]
            last = piece == pieces - 1
            told = {j: pickle.dumps((len(segment), copies[j], last)) for j in local.peers if copies[j] or last}
            local.messages(told, () if last else list(told), "handing out what came from other nodes")
        if pieces == 0:  # nothing crossed anywhere: release the workers all the same
            local.messages({j: pickle.dumps((len(local.own_segment(0)), [], True)) for j in local.peers}, (),
                           "handing out what came from other nodes")

    def _outgoing(self, size: int) -> np.ndarray:
        """The staging buffer for a piece leaving this node: one buffer of the window's size kept for the
        job (its pages stay resident, so the anonymous-memory samples see them), or, unbounded, a new one."""
        if self.window is None:
            return np.empty(size, dtype=np.uint8)
        if len(self.staging) < size:
            self.staging = np.empty(max(size, self.window), dtype=np.uint8)
        return self.staging[:size]

    # -- agreement --------------------------------------------------------------------------
    def broadcast_object(self, obj, src=0):
        source_node = self.node_of_worker[src]
        here = self.layout.node == source_node
        if here:
            obj = self.local.broadcast_object(obj, src=self.ranks_of_node[source_node].index(src))
        if self.leaders is not None:
            obj = self._leaders("a broadcast", self.leaders.broadcast_object, obj, src=source_node)
        if not here:
            obj = self.local.broadcast_object(obj, src=0)
        return obj

    def all_gather_object(self, obj):
        parts = self.local.all_gather_object(obj)
        gathered = None
        if self.leaders is not None:
            by_node = self._leaders("an all-gather", self.leaders.all_gather_object, parts)
            gathered = [None] * self.size
            for node, ranks in enumerate(self.ranks_of_node):
                for i, r in enumerate(ranks):
                    gathered[r] = by_node[node][i]
        return self.local.broadcast_object(gathered, src=0)

    def barrier(self):
        self.local.barrier()
        if self.leaders is not None:
            self._leaders("a barrier", self.leaders.barrier)
        self.local.barrier()

    def close(self):
        self.local.close()
        if self.leaders is not None:
            self.leaders.close()
