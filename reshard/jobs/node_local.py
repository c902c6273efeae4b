"""Node-local checkpoints: every node holds part of the source, and must receive its part of the target.

    # on each of 2 nodes (SRC and DST are the same local paths on every node):
    torchrun --nnodes=2 --node_rank=$NODE --nproc_per_node=2 --master_addr=$HEAD --master_port=29500 \
        -m reshard /nvme/ckpt /nvme/ckpt-dp6 --target-dp 6 --node-local --target-ranks-per-node 3

DeepSpeed 0.19.8 with `"checkpoint": {"use_node_local_storage": true}` saves into a directory
that only its node sees (runtime/engine.py):
- each rank writes its own optim-states file (`_save_zero_checkpoint`), on its node;
- the model-states writer is chosen by LOCAL rank (`_configure_checkpointing`: `rank =
  self.local_rank if self.use_node_local_storage() else dp_rank`, then the checkpoint engine's
  `is_data_parallel_writer(rank)`, i.e. rank 0): under ZeRO-1/2 local rank 0 of every node writes
  `mp_rank_00_model_states.pt`, so every node has one; under ZeRO-3 every rank writes its own
  `zero_pp_rank_{r}_..._model_states.pt` anyway;
- `latest` and the recovery scripts are written by global rank 0 only (`save_checkpoint`,
  `_save_zero_checkpoint`), so only the first node has them.
Loading (`load_checkpoint`) reads, on each rank: `latest` (unless given a tag), the model-states
file (`_get_all_ckpt_names`: ZeRO-1/2 the mp_rank file, ZeRO-3 the rank's own) and only its own
optim file (`_get_all_zero_checkpoint_state_dicts` opens rank i's file on dp rank i alone). So a
target node needs its ranks' optim files, the model-states file(s) and `latest`: reshard writes
exactly DeepSpeed's files on each node, plus `latest` on every node (DeepSpeed's own save leaves
the other nodes without it, and their loads then need an explicit tag).

A job here: every worker lists what it sees of SRC (`survey_source`, one all-gather); the tag
comes from `--tag` or whichever `latest` the workers see; each source rank is read by one worker
that sees all of its files (`node_local_ownership`, pure: the table of what each worker sees is an
input), and a file no worker sees is refused before anything is read or written. Target rank r
runs on node r // G (`--target-ranks-per-node G`) and is written by a worker of that node. The
node of a worker is the launcher's node rank (torchrun's GROUP_RANK, or SLURM_NODEID; RESHARD_NODE_RANK
overrides both). Each target node's first worker (its leader) runs what worker 0 runs for a
shared destination: lock, staging, journal, manifest, publish, for its own DST.

A PipelineModule save (some worker sees its layer files) takes the plan too, inspected column by
column where its files are, its layer files tensors of the plan, a tp change included
(reshard.jobs.node_local_columns, handed in by the caller as `pipeline_columns`). A ZeRO-0 MoE save
takes the plan with each node's copies of the files its ranks load (`inspect_zero0_on_nodes`,
reshard.jobs.node_local_zero0, which says where DeepSpeed puts those files).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Sequence

from reshard.errors import CheckpointError, OptionError, ReshardError, UnsupportedCheckpoint
from reshard.formats.deepspeed_files import deepspeed_schema as schema
from reshard.formats.deepspeed_files.deepspeed_inspect import inspect_checkpoint
from reshard.formats.deepspeed_files.deepspeed_pipeline import LAYER_RE
from reshard.formats.deepspeed_files.deepspeed_target import zero12_model_file
from reshard.formats.deepspeed_files.deepspeed_zero0_moe import is_expp_file
from reshard.formats.deepspeed_files.folded_expert_files import rewrites_expert_files
from reshard.files.paths import check_tag
from reshard.jobs.destination import check_paths
from reshard.jobs.preflight import checkpoint_target, preflight
from reshard.jobs.runs import Unit
from reshard.planning.plan import Ownership
from reshard.transport.collective import check_peers
from reshard.transport.nodes import NODE_RANK_VARIABLES



def is_layer_file(name: str) -> bool:
    """A PipelineModule layer file (`layer_XX[-model_XX]-model_states.pt`)."""
    return bool(LAYER_RE.match(name))


def node_rank_from_environment() -> int:
    for name in NODE_RANK_VARIABLES:
        value = os.environ.get(name)
        if value is not None:
            try:
                return int(value)
            except ValueError:
                raise OptionError(f"--node-local: {name}={value!r} is not a node index") from None
    raise OptionError("--node-local needs each worker's node index: run under torchrun (GROUP_RANK), in a SLURM "
                      f"job (SLURM_NODEID), or set RESHARD_NODE_RANK ({', '.join(NODE_RANK_VARIABLES)} are unset)")


@dataclass(frozen=True)
class WorkerView:
    """What one worker sees of the source: its node, SRC/latest, and the files of SRC/TAG."""

    node: int
    latest: str | None
    """The tag SRC/latest names where this worker runs (DeepSpeed writes it on the first node only)."""
    files: frozenset[str] = frozenset()
    """Names of the regular files in SRC/TAG here."""
    identity: tuple = ()
    """(name, bytes, mtime_ns) of those files: the source's identity, per node."""


def read_latest(save_dir: str) -> str | None:
    try:
        with open(os.path.join(save_dir, schema.LATEST)) as fd:
            return fd.read().strip() or None
    except OSError:
        return None


def list_tag_dir(tag_dir: str) -> tuple[frozenset[str], tuple]:
    """Regular files of a tag directory as seen here (nothing when it does not exist here)."""
    names, identity = [], []
    try:
        entries = sorted(os.listdir(tag_dir))
    except OSError:
        return frozenset(), ()
    for name in entries:
        path = os.path.join(tag_dir, name)
        if os.path.isfile(path):
            stat = os.stat(path)
            names.append(name)
            identity.append((name, stat.st_size, stat.st_mtime_ns))
    return frozenset(names), tuple(identity)


def agreed_tag(views: Sequence[WorkerView], tag: str | None, save_dir: str) -> str:
    """`--tag`, else the tag the workers' `latest` files name (they must agree). Pure."""
    if tag is not None:
        return check_tag(tag, "--tag")
    named = sorted({view.latest for view in views if view.latest is not None})
    if not named:
        raise CheckpointError(os.path.join(save_dir, schema.LATEST),
                              "exists on no node (DeepSpeed writes it on global rank 0's node only): pass --tag TAG")
    if len(named) > 1:
        raise CheckpointError(os.path.join(save_dir, schema.LATEST),
                              f"names different tags on different nodes ({', '.join(map(repr, named))}): pass --tag")
    return check_tag(named[0], "latest", os.path.join(save_dir, schema.LATEST))


def survey_source(transport, save_dir: str, tag: str | None) -> tuple[str, list[WorkerView]]:
    """Every worker's view of SRC (two all-gathers); the tag all agree on. Collective; every
    worker raises the same error, as each derives it from the same gathered views."""
    try:
        node, problem = node_rank_from_environment(), None
    except OptionError as error:
        node, problem = -1, error
    views = transport.all_gather_object(WorkerView(node, read_latest(save_dir)))
    if problem is not None or any(view.node < 0 for view in views):  # raised on every worker, not only here
        raise problem or OptionError("--node-local: a worker does not know its node index "
                                     f"({', '.join(NODE_RANK_VARIABLES)} unset there)")
    chosen = agreed_tag(views, tag, save_dir)
    files, identity = list_tag_dir(os.path.join(save_dir, chosen))
    views = transport.all_gather_object(WorkerView(node, read_latest(save_dir), files, identity))
    return chosen, views


def inspector(views: Sequence[WorkerView], tag_dir: str) -> int:
    """The first worker that sees source rank 0's optim file and a rank-0 model-states file:
    it inspects the checkpoint for everyone. Pure."""
    for worker, view in enumerate(views):
        roles = [schema.classify(name) for name in view.files]
        if (any(r.kind == "optim" and r.dp_rank == 0 for r in roles)
                and any(r.kind == "model" or (r.kind == "zero3_model" and r.dp_rank == 0) for r in roles)):
            return worker
    raise CheckpointError(tag_dir, "no worker sees source rank 0's optim-states file together with a model-states "
                                   "file on its node; is the job running on the nodes that saved the checkpoint?")


def merged_identity(views: Sequence[WorkerView], names) -> dict:
    """Name -> size and mtime, from the first worker that sees each file (as manifest.source_identity)."""
    found = {}
    for view in views:
        for name, size, mtime in view.identity:
            if name in names and name not in found:
                found[name] = {"bytes": size, "mtime_ns": mtime}
    return dict(sorted(found.items()))


def target_node(rank: int, ranks_per_node: int) -> int:
    return rank // ranks_per_node


def model_states_ranks(target_ranks: int, ranks_per_node: int) -> set[int]:
    """Target ranks that write the ZeRO-1/2 model-states file: local rank 0 of every node
    (engine.py `_configure_checkpointing` with use_node_local_storage)."""
    return set(range(0, target_ranks, ranks_per_node))


def with_model_states_on(files_of, ranks: set[int]):
    """`files_of(source, target, rank)` (DeepSpeed's files, where dp rank 0 writes the ZeRO-1/2
    model-states file) with that file written by `ranks` instead (`model_states_ranks`): node-local
    storage puts one on every node. The target-file builders know nothing of nodes."""
    def files(source, target, rank: int) -> list:
        found = files_of(source, target, rank)
        kept = [f for f in found if schema.classify(f.name).kind != "model"]
        if rank not in ranks:
            return kept
        return found if len(kept) < len(found) else [*found, zero12_model_file(source, target, rank)]
    return files


def node_leaders(worker_nodes: Sequence[int], target_ranks: int, ranks_per_node: int) -> dict[int, int]:
    """Node -> the first worker there, for every node that hosts target ranks."""
    leaders: dict[int, int] = {}
    for worker, node in enumerate(worker_nodes):
        leaders.setdefault(node, worker)
    nodes = -(-target_ranks // ranks_per_node)
    return {node: leaders[node] for node in range(nodes) if node in leaders}


def node_local_ownership(needed: Sequence[Sequence[str]], seen: Sequence[frozenset[str]], worker_nodes: Sequence[int],
                         target_ranks: int, ranks_per_node: int, tag_dir: str,
                         target_nodes: Sequence[int] | None = None) -> Ownership:
    """Readers from what each worker sees, writers from the node of each target rank. Pure.

    `needed[r]`: the file names source rank r is read from; `seen[w]`: the names worker w sees.
    Each source rank goes to a worker that sees all of its files (the one with the fewest ranks so
    far, then the lowest), so a file seen on several nodes is read once. Target rank r goes to the
    workers of node r // G in contiguous blocks (`target_nodes[r]` instead, where the plan's target
    ranks are not DeepSpeed's: a ZeRO-0 MoE save's files, reshard.jobs.node_local_zero0). Raises
    CheckpointError naming a file no worker sees, OptionError when a node that hosts target ranks has
    no worker.
    """
    workers = len(seen)
    readers, load = [], [0] * workers
    for rank, names in enumerate(needed):
        able = [w for w in range(workers) if all(name in seen[w] for name in names)]
        if not able:
            unseen = [name for name in names if not any(name in s for s in seen)]
            if unseen:
                raise CheckpointError(os.path.join(tag_dir, unseen[0]),
                                      f"is on no node: no worker sees it (source rank {rank} of {len(needed)}); "
                                      "start the job on every node that saved the checkpoint, or copy the file there")
            raise CheckpointError(os.path.join(tag_dir, names[0]),
                                  f"and the other files of source rank {rank} ({', '.join(names[1:])}) are on "
                                  "different nodes; a rank's files must be read together: copy them to one node")
        chosen = min(able, key=lambda w: (load[w], w))
        readers.append(chosen)
        load[chosen] += 1
    on_node: dict[int, list[int]] = {}
    for worker, node in enumerate(worker_nodes):
        on_node.setdefault(node, []).append(worker)
    nodes_of = [target_node(rank, ranks_per_node) for rank in range(target_ranks)] if target_nodes is None \
        else list(target_nodes)
    count, placed, writers = {}, {}, []
    for node in nodes_of:
        count[node] = count.get(node, 0) + 1
    for rank, node in enumerate(nodes_of):
        local = on_node.get(node)
        if not local:
            nodes = max(nodes_of) + 1
            raise OptionError(f"--node-local: target rank {rank} runs on node {node} (--target-ranks-per-node "
                              f"{ranks_per_node}), but no worker runs there (workers run on nodes "
                              f"{sorted(on_node)}); start the job on nodes 0..{nodes - 1}")
        index = placed[node] = placed.get(node, -1) + 1  # this rank's place among its node's
        writers.append(local[index * len(local) // count[node]])
    return Ownership.from_tables(readers, writers, workers)


@dataclass(frozen=True)
class NodeSite:
    """One worker's place in a node-local job: its node, whether it manages that node's DST
    (a reshard.jobs.collective_job.Site: each node's output is its own, led by its first worker)."""

    node: int
    leader: bool
    """This worker runs the destination steps of its node (lock, staging, journal, publish)."""
    peers: tuple[int, ...]
    """Workers of this node: their files make up this node's output and manifest."""
    hosts_targets: bool
    """Some target rank runs on this node (else its workers only read)."""
    ownership: Ownership
    identity: dict
    """Source files (name -> bytes, mtime_ns), from whichever node holds each."""
    model_states_ranks: set[int] | None
    """Target ranks that write the ZeRO-1/2 model-states file (local rank 0 of each node)."""
    needed_bytes: int
    """About how many bytes this node's output takes (the free-space check)."""
    ranks_per_node: int
    ships: tuple = ()
    """(file, sending worker, receiving worker): whole files a node needs and does not hold, sent in
    chunks of `chunk_bytes` (a ZeRO-0 MoE save's expert files, reshard.jobs.node_local_zero0)."""
    chunk_bytes: int = 1 << 20

    @property
    def placement(self) -> dict:
        """Which part of the target this node's output is (its fingerprint and manifest say so)."""
        return {"node": self.node, "ranks_per_node": self.ranks_per_node}

    def source_identity(self, source, carried, target) -> dict:
        return self.identity  # from every node's survey: no one worker sees every file

    def output_bytes(self, source, target_dp: int, target) -> int:
        return self.needed_bytes

    def begin(self, life, transport, describe):
        return life.begin_per_node(transport, self.node, describe)  # each node's leader decides for its DST

    def files_of(self, zero):
        if self.model_states_ranks is None:  # ZeRO-3: every rank writes its own model-states file anyway
            return zero.files
        return with_model_states_on(zero.files, self.model_states_ranks)

    def copy_share(self, source, start, staging, transport) -> dict:
        # the leader copies its node's whole files (`leader_copies`); those it needs from another node come here
        if not self.ships:
            return {}
        from reshard.jobs.node_local_zero0 import ship_files
        sizes = {name: self.identity[name]["bytes"] for name, _, _ in self.ships}
        return ship_files(transport, self.ships, sizes, source.tag_dir, staging.tag_dir, self.chunk_bytes)

    def leader_copies(self, source) -> tuple[str, ...]:
        return source.other_files  # those this node holds (`prepare_unit`)

    def scripts_from(self, source) -> str | None:
        # DeepSpeed copies its recovery scripts on global rank 0 only: in a node-local save, node 0's directory
        return source.save_dir if self.node == 0 else None


def needed_files(spec, bf16_prefix: bool) -> list[list[str]]:
    """File names each source rank is read from: its optim file, and under ZeRO-3 its model file."""
    return [[schema.optim_file_name_of(spec.topology, r, bf16_prefix)]
            + ([schema.model_file_name_of(spec.topology, r, 3)] if spec.stage == 3 else [])
            for r in range(spec.dp_world_size)]


def node_output_bytes(spec, identity: dict, model_name: str, ranks_here: int, target_ranks: int,
                      writes_model: bool, block: int = 4096) -> int:
    """About what one node's output takes: its share of the partitioned bytes, a pickle structure
    per file, the model-states file(s), manifest, journal and `latest`."""
    optim = sum(entry["bytes"] for name, entry in identity.items() if schema.classify(name).kind == "optim")
    model = identity.get(model_name, {}).get("bytes", 0)
    share = -(-optim * ranks_here // max(target_ranks, 1))
    models = ranks_here * model if spec.stage == 3 else model * writes_model
    return share + models + (ranks_here * 2 + 8) * block + (1 << 20)


def prepare_unit(transport, unit, views: Sequence[WorkerView], target_ranks: int, ranks_per_node: int,
                 inspect) -> tuple:
    """Inspect on the worker that can, rebase the result on this worker's own SRC, and plan who
    reads and writes what. `inspect(carry_model_bytes)` -> (SourceCheckpoint, found), run on the
    inspecting worker with the source ranks it sees (`found`: what else it worked out there, which
    every worker receives). Collective. Returns (source, found, NodeSite)."""
    import dataclasses

    from reshard.transport.collective import on_worker
    tag_dir = os.path.join(unit.source, unit.tag)
    nodes = [view.node for view in views]
    first = inspector(views, tag_dir)
    model12 = schema.model_file_name(1)
    target_nodes = set(range(target_node(target_ranks - 1, ranks_per_node) + 1))
    lacking = any(not any(model12 in v.files for v in views if v.node == node) for node in target_nodes)
    zero3 = any(schema.classify(n).kind == "zero3_model" for v in views for n in v.files)
    source, found = on_worker(transport, first, lambda: inspect(True if lacking and not zero3 else None))
    spec = source.spec
    needed = needed_files(spec, spec.bf16_prefix)
    ownership = node_local_ownership(needed, [v.files for v in views], nodes, target_ranks, ranks_per_node, tag_dir)
    own_tag_dir = os.path.join(unit.source, unit.tag)
    source = dataclasses.replace(
        source, save_dir=unit.source,
        other_files=tuple(f for f in source.other_files if os.path.isfile(os.path.join(own_tag_dir, f))),
        other_dirs=tuple(d for d in source.other_dirs if os.path.isdir(os.path.join(own_tag_dir, d))))
    names = {n for rank in needed for n in rank} | {source.model_name(0)} | set(source.other_files)
    identity = merged_identity(views, names)
    me = transport.rank
    node = nodes[me]
    ranks_here = [r for r in range(target_ranks) if target_node(r, ranks_per_node) == node]
    model_ranks = model_states_ranks(target_ranks, ranks_per_node) if spec.stage < 3 else None
    site = NodeSite(node=node, leader=node_leaders(nodes, target_ranks, ranks_per_node).get(node) == me,
                    peers=tuple(w for w, n in enumerate(nodes) if n == node), hosts_targets=bool(ranks_here),
                    ownership=ownership, identity=identity, model_states_ranks=model_ranks,
                    needed_bytes=node_output_bytes(spec, identity, source.model_name(0), len(ranks_here),
                                                   target_ranks, bool(model_ranks)),
                    ranks_per_node=ranks_per_node)
    return source, found, site


def node_model_template(source, site: NodeSite, target_ranks: list[int], trust_pickle: bool = False):
    """`source` with the ZeRO-1/2 model-states template this worker writes its node's file from.

    DeepSpeed writes `mp_rank_00_model_states.pt` on every node, and fills `shared_params` (the
    tied-weight table) on global rank 0 only (engine.py `_get_shared_params`), so the nodes' files
    differ in their pickles, hence in where each tensor's bytes sit. A writer copies the module
    weights from its own node's file, so it builds from that file's structure; `shared_params` is
    rank 0's on node 0 and empty elsewhere, as DeepSpeed at the target would write it. When the
    template bytes were shipped (a node without the file), the shipped structure is kept.
    """
    import copy
    import dataclasses

    from reshard.formats.deepspeed_files.deepspeed_inspect import check_param_shapes_against_module
    from reshard.formats.deepspeed_files.deepspeed_rank_values import (
        MODEL_VALUES,
        compare,
        model_rank_values,
    )
    from reshard.formats.torch_bytes.torch_archive import load_portable
    name = source.model_name(0)
    writes = site.model_states_ranks is not None and any(r in site.model_states_ranks for r in target_ranks)
    if not writes:
        return source
    template = source.model_template
    if name not in source.carried:
        path = source.model_path(0)
        own = load_portable(path, schema.safe_globals(), trust_pickle)
        keys = ("dp_world_size", "param_shapes", *MODEL_VALUES)  # what every rank saves alike
        difference, _ = compare(model_rank_values(own, keys), model_rank_values(template, keys))
        if not isinstance(own, dict) or difference is not None:
            where = difference[0] if difference is not None else "its structure"
            raise CheckpointError(path, f"differs from the model-states file of the node that holds source "
                                        f"rank 0 in {where!r}: the nodes hold different saves")
        check_param_shapes_against_module(own, path, experts=source.spec.experts is not None)
        template = own
    template = copy.copy(template)
    if isinstance(template.get("shared_params"), dict):
        template["shared_params"] = dict(source.model_template["shared_params"]) if site.node == 0 else {}
    return dataclasses.replace(source, model_template=template)


class NodeLocal:
    """The target of a node-local job (a reshard.jobs.collective_job.Placement): one checkpoint,
    read where each node sees its files, each node's part written into that node's DST."""

    def __init__(self, pipeline_columns):
        self.views: list[WorkerView] = []
        """What every worker sees of SRC (`survey_source`), once `units` ran."""
        self.pipeline_columns = pipeline_columns
        """A PipelineModule save on the plan: `inspect(opts, unit, transport, views)`
        (reshard.jobs.node_local_columns.ColumnsOnNodes, given by the caller: it builds on this module)."""

    def is_pipeline(self) -> bool:
        return any(is_layer_file(n) for view in self.views for n in view.files)

    def units(self, opts, transport) -> tuple[list[Unit], list[str]]:
        """The one checkpoint of the job, from what every worker sees. Collective."""
        failure = None
        try:
            check_paths(opts.source, opts.destination)
        except ReshardError as error:
            failure = error
        check_peers(transport, failure, "checking SRC and DST")
        source, destination = os.path.abspath(opts.source), os.path.abspath(opts.destination)
        tag, self.views = survey_source(transport, source, opts.tag)
        return [Unit(source, tag, destination, tag)], []

    def inspect(self, opts, unit: Unit, transport) -> tuple:
        """(source, target, carried, notes, NodeSite): inspected, and the target worked out, by a worker
        that sees rank 0's files; no save-directory files are carried (each node's DST keeps its own)."""
        if any(is_expp_file(name) for view in self.views for name in view.files):  # every worker alike
            return inspect_zero0_on_nodes(opts, unit, transport, self.views)
        if self.is_pipeline():  # the same views on every worker: the same choice
            return self.pipeline_columns.inspect(opts, unit, transport, self.views)
        roles = [schema.classify(name) for name in self.views[transport.rank].files]
        seen = {role.dp_rank for role in roles if role.kind == "zero3_model"}  # ZeRO-3 client_state compared on these

        def inspect(carry_model_bytes):
            source = inspect_checkpoint(unit.source, unit.tag, trust_pickle=opts.trust_pickle,
                                        read_tensors=not opts.dry_run, carry_model_bytes=carry_model_bytes,
                                        node_local=True)
            if rewrites_expert_files(source):
                raise UnsupportedCheckpoint(source.model_path(0), "is an AutoEP checkpoint with AutoTP layers; "
                                                                  "node-local resharding of it is not supported yet")
            target = checkpoint_target(opts, source)
            return source, (target, preflight(opts, source, target.topology, [], ranks=seen))

        source, (target, notes), site = prepare_unit(transport, unit, self.views, opts.target_dp,
                                                     opts.target_ranks_per_node, inspect)
        failure = None
        try:
            source = node_model_template(source, site, site.ownership.target_ranks_of(transport.rank),
                                         opts.trust_pickle)
        except ReshardError as error:
            failure = error
        check_peers(transport, failure, "reading this node's model-states file")
        return source, target, [], notes, site


def inspect_zero0_on_nodes(opts, unit: Unit, transport, views: Sequence[WorkerView]) -> tuple:
    """(source, target, carried, notes, NodeSite) of a ZeRO-0 MoE save (reshard.jobs.node_local_zero0):
    inspected on a worker that sees every file of it, the plan's target ranks each node's copies of the
    files its ranks load, each source EP rank read where its file is, the expert files a node lacks
    sent to it whole, the model-states file's module weights carried where a node lacks that file."""
    import dataclasses

    from reshard.formats.deepspeed_files.deepspeed_inspect import read_carried
    from reshard.formats.deepspeed_files.deepspeed_zero0_moe import MODEL, expp_file_name, inspect_zero0_moe_checkpoint
    from reshard.formats.torch_bytes.torch_archive import TensorRef, refs_in
    from reshard.jobs import node_local_zero0 as z0
    from reshard.transport.collective import on_worker
    tag_dir = os.path.join(unit.source, unit.tag)
    seen, nodes = [v.files for v in views], [v.node for v in views]
    ranks_per_node = opts.target_ranks_per_node
    first = z0.zero0_inspector(seen, tag_dir)
    hosting = range(target_node(opts.target_dp - 1, ranks_per_node) + 1)
    lacking = any(not any(MODEL in v.files for v in views if v.node == node) for node in hosting)

    def inspect():
        source = inspect_zero0_moe_checkpoint(unit.source, unit.tag, trust_pickle=opts.trust_pickle)
        if lacking and not opts.dry_run:  # a node without the model-states file writes it from these bytes
            optimizer = [ref for ref in refs_in(source.model_template.get("optimizer")) if isinstance(ref, TensorRef)]
            source = dataclasses.replace(source, carried={MODEL: read_carried(source.model_path(), source.model_template,
                                                                              optimizer)})
        target = checkpoint_target(opts, source)
        return source, (target, preflight(opts, source, target.topology, []))

    source, (target, notes) = on_worker(transport, first, inspect)
    copies, copy_nodes = z0.zero0_copies(target.topology, ranks_per_node)
    target = dataclasses.replace(target, zero=dataclasses.replace(target.zero, copies=copies))
    source_ep = source.spec.topology.ep
    ownership = node_local_ownership([[expp_file_name(e)] for e in range(source_ep)], seen, nodes, len(copies),
                                     ranks_per_node, tag_dir, target_nodes=copy_nodes)
    leaders = node_leaders(nodes, target.topology.dp, ranks_per_node)
    needs = {node: z0.expert_files_of_node(source.num_experts, target.topology, node, ranks_per_node)
             for node in hosting}
    expert_files = [name for name in source.other_files if schema.expert_file_index(name) is not None]
    ships = z0.zero0_ships(expert_files, seen, nodes, leaders, needs, tag_dir)
    names = {expp_file_name(e) for e in range(source_ep)} | {MODEL} | set(source.other_files)
    me, node = transport.rank, nodes[transport.rank]
    own_tag_dir = os.path.join(unit.source, unit.tag)
    kept = tuple(f for f in source.other_files if os.path.isfile(os.path.join(own_tag_dir, f))
                 and (f not in expert_files or f in needs.get(node, set())))  # a node keeps what its ranks load
    source = dataclasses.replace(
        source, save_dir=unit.source, other_files=kept,
        other_dirs=tuple(d for d in source.other_dirs if os.path.isdir(os.path.join(own_tag_dir, d))))
    identity = merged_identity(views, names)
    site = NodeSite(node=node, leader=leaders.get(node) == me, peers=tuple(w for w, n in enumerate(nodes) if n == node),
                    hosts_targets=node in hosting, ownership=ownership, identity=identity, model_states_ranks=None,
                    needed_bytes=z0.zero0_output_bytes(identity, copies, copy_nodes, node, source_ep,
                                                       target.topology.ep, needs.get(node, set())),
                    ranks_per_node=ranks_per_node, ships=ships,
                    chunk_bytes=max(4096, opts.memory_budget // 4))
    return source, target, [], notes, site
