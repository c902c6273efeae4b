"""A ZeRO-0 MoE save in a node-local job: which node holds which file, and which target files each node needs.

    # on each of 2 nodes, a ZeRO-0 MoE save made with use_node_local_storage:
    torchrun --nnodes=2 --node_rank=$NODE --nproc_per_node=2 ... -m reshard /nvme/ckpt /nvme/ckpt-ep1 \\
        --target-dp 2 --target-ep 1 --node-local --target-ranks-per-node 1

Where DeepSpeed 0.19.8 puts the files (runtime/engine.py): `save_checkpoint` sends an MoE model to
`_save_moe_checkpoint`, which never looks at `use_node_local_storage` (only `_configure_checkpointing`'s
`save_non_zero_checkpoint` does, and `save_checkpoint` sets that False for MoE):
- `expp_rank_{e}_mp_rank_00_optim_states.pt` and the `layer_{L}_expert_{G}` files of EP rank e are written by
  the rank whose expert-data-parallel rank is 0 (`checkpoint_engine.is_data_parallel_writer(exp_dp_rank)`);
  with DeepSpeed's default groups (utils/groups.py `_create_expert_and_data_parallel`: expert-parallel
  groups of consecutive ranks) that is global rank e;
- `mp_rank_00_model_states.pt` by data-parallel rank 0 (`groups._get_data_parallel_rank() == 0`), global rank 0;
- `latest` by global rank 0.
So every file of the save is on the nodes of global ranks 0 .. ep-1: on one node when a node ran at least
ep ranks, and the other nodes hold an empty tag directory. On load (`_load_checkpoint`,
`load_moe_state_dict`) every rank reads the model-states file, `expp_rank_{its EP rank}` (rank r: r % ep)
and the expert files of that EP rank's experts.

A job here therefore inspects the save on a worker that sees every file of it (`zero0_inspector`; a save
whose files lie on several nodes is refused by name), reads each source EP rank's file where it is, and
writes on each node that runs target ranks the files its ranks load: the plan's target ranks are those
files, once per node (`zero0_copies`, `Zero0Moe.copies`), so the optimizer states cross between nodes
as the plan says. The expert files a node needs and does not hold are sent whole, in chunks
(`ship_files`); the model-states file's module weights travel with the source as carried bytes, as a
ZeRO-1/2 node-local job ships its model-states template to a node without the file.
"""
from __future__ import annotations

import os
from typing import Sequence

import numpy as np

from reshard.errors import CheckpointError, UnsupportedCheckpoint
from reshard.files.byte_io import hash_file, pread_exact, pwrite_exact
from reshard.formats.deepspeed_files import deepspeed_schema as schema
from reshard.formats.deepspeed_files.deepspeed_zero0_moe import MODEL, expp_file_name
from reshard.topology import Topology


def zero0_inspector(seen: Sequence[frozenset[str]], tag_dir: str) -> int:
    """The first worker that sees every file any worker sees of the save (the EP ranks' optimizer files,
    the model-states file, the expert files): it inspects for everyone. Pure. Raises UnsupportedCheckpoint
    naming the tag directory and the files no one worker sees together."""
    every = frozenset().union(*seen)
    for worker, names in enumerate(seen):
        if names >= every:
            return worker
    best = max(seen, key=len)
    apart = sorted(every - best)
    raise UnsupportedCheckpoint(tag_dir, f"is a ZeRO-0 MoE checkpoint whose files lie on several nodes ({', '.join(apart[:3])}"
                                         f"{' ...' if len(apart) > 3 else ''} not beside the others); DeepSpeed writes "
                                         "them on global ranks 0 .. ep-1 (engine.py _save_moe_checkpoint), so on "
                                         "several nodes when a node ran fewer than ep ranks. Node-local resharding "
                                         "of such a save is not supported yet: copy its files onto one node")


def node_ranks(node: int, target_ranks: int, ranks_per_node: int) -> range:
    return range(node * ranks_per_node, min(target_ranks, (node + 1) * ranks_per_node))


def zero0_copies(target: Topology, ranks_per_node: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(file of each plan target rank, its node): every node that runs target ranks writes the
    `expp_rank_{e}` file of each EP rank e among its ranks (rank r: r % ep) and the model-states file
    (file target.ep), which every rank loads. Pure."""
    files, nodes = [], []
    for node in range(-(-target.dp // ranks_per_node)):
        for file in sorted({rank % target.ep for rank in node_ranks(node, target.dp, ranks_per_node)}) + [target.ep]:
            files.append(file)
            nodes.append(node)
    return tuple(files), tuple(nodes)


def expert_files_of_node(num_experts: Sequence[int], target: Topology, node: int, ranks_per_node: int) -> set[str]:
    """The `layer_{L}_expert_{G}` files the target ranks of `node` load (engine.py `load_moe_state_dict`:
    EP rank e's global experts e * local .. (e + 1) * local - 1 of each MoE layer). Pure."""
    names = set()
    for ep_rank in {rank % target.ep for rank in node_ranks(node, target.dp, ranks_per_node)}:
        for layer, count in enumerate(num_experts):
            local = count // target.ep
            names.update(schema.expert_file_name(layer, expert) for expert in range(ep_rank * local, (ep_rank + 1) * local))
    return names


def zero0_ships(expert_files: Sequence[str], seen: Sequence[frozenset[str]], worker_nodes: Sequence[int],
                leaders: dict[int, int], needs: dict[int, set[str]], tag_dir: str) -> tuple[tuple[str, int, int], ...]:
    """(file, sending worker, receiving worker) for each expert file a node needs and none of its workers
    sees: sent by a worker that sees it (the one with the fewest sends so far), to the node's leader. Pure."""
    ships, load = [], [0] * len(seen)
    for node, leader in sorted(leaders.items()):
        here = frozenset().union(*(s for s, n in zip(seen, worker_nodes) if n == node))
        for name in sorted(needs.get(node, set()) & set(expert_files)):
            if name in here:
                continue
            able = [w for w, s in enumerate(seen) if name in s]
            if not able:
                raise CheckpointError(os.path.join(tag_dir, name), f"is on no node: no worker sees it, and the "
                                                                   f"target ranks of node {node} load it")
            sender = min(able, key=lambda w: (load[w], w))
            load[sender] += 1
            ships.append((name, sender, leader))
    return tuple(ships)


def ship_files(transport, ships, sizes: dict[str, int], source_tag_dir: str, staging_tag_dir: str,
               chunk_bytes: int) -> dict:
    """Send each (file, sender, receiver) of `ships` whole, `chunk_bytes` at a time, through the
    transport's all-to-all (so its bytes count as bytes between nodes). Collective: every worker calls
    it with the same `ships`. Returns {name: {"bytes", "blake3"}} of the files this worker received."""
    me, received = transport.rank, {}
    chunk_bytes = max(1, int(chunk_bytes))
    for name, sender, receiver in ships:
        size = sizes[name]
        src = os.open(os.path.join(source_tag_dir, name), os.O_RDONLY) if me == sender else None
        path = os.path.join(staging_tag_dir, name)
        dst = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644) if me == receiver else None
        try:
            for offset in range(0, max(size, 1), chunk_bytes):
                n = min(chunk_bytes, size - offset)
                send_counts, recv_counts = [0] * transport.size, [0] * transport.size
                send = np.empty(0, dtype=np.uint8)
                if me == sender:
                    send = np.empty(n, dtype=np.uint8)
                    pread_exact(src, memoryview(send), offset, os.path.join(source_tag_dir, name))
                    send_counts[receiver] = n
                if me == receiver:
                    recv_counts[sender] = n
                got = transport.all_to_all(send, send_counts, recv_counts)
                if me == receiver and n:
                    pwrite_exact(dst, memoryview(got[:n]), offset)
            if dst is not None:
                os.fsync(dst)
        finally:
            for fd in (src, dst):
                if fd is not None:
                    os.close(fd)
        if me == receiver:
            received[name] = {"bytes": size, "blake3": hash_file(path)}
    return received


def zero0_output_bytes(identity: dict, copies: Sequence[int], copy_nodes: Sequence[int], node: int, source_ep: int,
                       target_ep: int, expert_names: set[str], block: int = 4096) -> int:
    """About what one node's output takes: its optimizer-file copies (a target EP rank's file about
    source_ep / target_ep source files), the model-states file, the expert files its ranks load."""
    optim = sum(identity.get(expp_file_name(e), {}).get("bytes", 0) for e in range(source_ep))
    model = identity.get(MODEL, {}).get("bytes", 0)
    total = sum(model if f == target_ep else -(-optim // target_ep) for f, n in zip(copies, copy_nodes) if n == node)
    total += sum(identity.get(name, {}).get("bytes", 0) for name in expert_names)
    return total + (len(copies) + 8) * block + (1 << 20)
