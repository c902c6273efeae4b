"""Node-local PipelineModule saves through the plan: each column inspected where its files are.

    # on each of 2 nodes (SRC and DST are the same local paths on every node):
    torchrun --nnodes=2 --node_rank=$NODE --nproc_per_node=2 --master_addr=$HEAD --master_port=29500 \
        -m reshard /nvme/ckpt /nvme/ckpt-pp1 --node-local --target-ranks-per-node 2 \
        --target-dp 4 --target-pp 1 --pipeline-layers 7 --pipeline-tied embed:0,6

Every node-local pipeline reshard with tp kept (dp changed, pp changed or kept); a tp change is refused
by name (`refuse_tp_change`: it re-cuts the layer files, which travel whole here). DeepSpeed 0.19.8 with
use_node_local_storage writes a stage's layer files and optimizer files where the stage's ranks ran and
its model-states file where a node's LOCAL rank 0 runs that stage (runtime/engine.py
`_configure_checkpointing`, runtime/pipe/module.py `save_state_dict`), so no worker sees every column,
and a column's model-states file need not be on the node of its dp rank 0 optimizer file (pp 2, dp 3
on 3 nodes x 2 ranks). So:

1. from the names every worker sees (node_local.survey_source): the save's file facts
   (deepspeed_pipeline.pipeline_files), each column's inspector, each layer file's reader;
2. each layer file's small entry table read once where it is (layer_entries), gathered;
3. each column's model-states tree read where that file is and gathered, when its inspector (a worker
   that sees its dp rank 0 optimizer file, `column_inspectors`) does not see it (`model_readers`);
   each column checked by its inspector (inspect_pipeline_column), every other dp rank's optimizer
   file by a worker that sees it, the facts gathered into one PipelineSource (gathered_pipeline) on
   every worker, and each column's templates (inspect_pipeline_column_trees) into the
   SourceCheckpoint (pipeline_columns_source): what the collective job inspects on one worker;
4. the target from it by the function the collective job uses (`columns_target`, handed in);
5. who reads and writes (node_local.node_local_ownership): a source rank where its optimizer file is, target
   rank r on node r // G; each node's first target rank writes every target stage's model-states
   file (DeepSpeed's pipeline load counts them: runtime/state_dict_factory.py `SDLoaderBase.check_ckpt_list`
   checks that the mp_rank files in the directory number mp_world_size); the
   layer files a node's target stages load (node_layer_files) and it lacks, sent whole
   (reshard.jobs.whole_file_moves) when the rounds are done, their bytes added to the plan's bytes
   between nodes; the layer files it holds copied by its leader.
Rounds under --memory-budget, and a resume by round, as for every save on the plan.
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence

from reshard.files.byte_io import hash_file
from reshard.files.paths import confined
from reshard.formats.torch_archive import load_portable
from reshard.formats import deepspeed_schema as schema
from reshard.formats.deepspeed_inspect import inspect_pipeline_column_trees, pipeline_columns_source
from reshard.formats.deepspeed_pipeline import (
    LAYER_RE,
    STAGE_MODEL_RE,
    PipelineSource,
    check_layers_reproduce_source,
    check_stage_model_files,
    check_stage_optim_file,
    frozen_numels,
    gathered_pipeline,
    inspect_pipeline_column,
    layer_entries,
    load_whole,
    pipeline_files,
    pipeline_topology_of,
    source_buffers,
    source_groups,
    source_numels,
)
from reshard.jobs.node_local import (
    NodeSite,
    WorkerView,
    merged_identity,
    model_states_ranks,
    node_leaders,
    node_local_ownership,
    target_node,
)
from reshard.jobs.preflight import preflight
from reshard.jobs.results import WorkerReport
from reshard.jobs.whole_file_moves import MAX_PIECE, Transfer, bytes_between_nodes, fetch, fetch_plan
from reshard.layouts.pipeline import assign_stages, split_by_group
from reshard.topology import Topology
from reshard.errors import CheckpointError, PeerFailure, ReshardError, UnsupportedCheckpoint


def seen_names(views: Sequence[WorkerView]) -> set[str]:
    return set().union(*(view.files for view in views))


def first_seeing(views: Sequence[WorkerView], names: Sequence[str]) -> int | None:
    """The first worker that sees every one of `names`, else None. Pure."""
    return next((w for w, view in enumerate(views) if all(name in view.files for name in names)), None)


def column_inspectors(views: Sequence[WorkerView]) -> list[int] | None:
    """Per column (mp index stage * tp + model rank), the worker that inspects it: the first that sees its
    dp rank 0 optimizer file and its model-states file, else the first that sees that optimizer file (the
    model-states tree then handed to it, `model_readers`); None when some column's dp rank 0 optimizer
    file is on no node, or the names are no pipeline's. Pure."""
    names = seen_names(views)
    pp, _, tp = pipeline_topology_of(names)
    bf16 = any(schema.classify(n).bf16 for n in names if schema.classify(n).kind == "optim")
    found = []
    for c in range(pp * tp):
        optim = schema.optim_file_name(0, bf16, c)
        together = first_seeing(views, [f"mp_rank_{c:02d}_model_states.pt", optim])
        found.append(together if together is not None else first_seeing(views, [optim]))
    return None if not found or None in found else found


def model_readers(views: Sequence[WorkerView], inspectors: Sequence[int]) -> dict[int, int]:
    """{column: the first worker that sees its model-states file} for each column whose inspector does
    not see it: DeepSpeed writes a stage's model-states file where a node's local rank 0 runs that stage
    (reshard.jobs.node_local's docstring), which need not be the node of its dp rank 0 optimizer file
    (pp 2, dp 3 on 3 nodes x 2 ranks). A file on no node is left out (check_stage_model_files names it). Pure."""
    readers = {}
    for c, w in enumerate(inspectors):
        name = f"mp_rank_{c:02d}_model_states.pt"
        if name not in views[w].files and (reader := first_seeing(views, [name])) is not None:
            readers[c] = reader
    return readers


def everywhere(transport, work: Callable[[], object]) -> list:
    """Every worker runs `work()`; every worker gets all results, or raises the first worker's error."""
    try:
        outcome = ("ok", work())
    except ReshardError as error:
        outcome = ("error", error)
    except Exception as error:  # a bug: this worker keeps its traceback, the others stop too
        transport.all_gather_object(("error", PeerFailure(f"worker {transport.rank} failed: "
                                                          f"{type(error).__name__}: {error}")))
        raise
    outcomes = transport.all_gather_object(outcome)
    for kind, value in outcomes:
        if kind == "error":
            raise value
    return [value for _, value in outcomes]


def saved_mp_world_size(path: str, trust_pickle: bool = False) -> int:
    """The mp_world_size a stage model-states file says (0 when it says none: its column's check names it)."""
    state = load_whole(path, trust_pickle)
    value = state.get("mp_world_size") if isinstance(state, dict) else None
    return value if isinstance(value, int) else 0


def inspect_columns_on_nodes(transport, views: Sequence[WorkerView], save_dir: str, tag: str, trust_pickle: bool,
                             read_tensors: bool) -> tuple:
    """Steps 1-3 of the module docstring: (SourceCheckpoint as inspect_pipeline_columns gives it,
    PipelineSource with the gathered layer table), on every worker. Collective."""
    me, tag_dir = transport.rank, os.path.join(save_dir, tag)
    names = seen_names(views)
    stage_files = sorted(n for n in names if STAGE_MODEL_RE.match(n))
    # the stage count a stage file says, read where each is: a stage whose file is on no node, refused by
    # name (a node-local save writes a stage's file only where a node's local rank 0 runs that stage)
    saved = max(everywhere(transport, lambda: max([saved_mp_world_size(os.path.join(tag_dir, n), trust_pickle)
                                                    for n in stage_files if first_seeing(views, [n]) == me],
                                                   default=0)), default=0)
    check_stage_model_files(tag_dir, {int(STAGE_MODEL_RE.match(n)[1]) for n in stage_files},
                            {schema.classify(n).mp_rank for n in names if schema.classify(n).kind == "optim"}, saved)
    files = pipeline_files(tag_dir, names, pipeline_topology_of(names)[2])
    inspectors = column_inspectors(views)
    if inspectors is None:  # a column's dp rank 0 optimizer file on no node (its model-states file is, above)
        unseen = [name for c in range(files.pp * files.tp)
                  if (name := schema.optim_file_name(0, files.bf16, c)) not in names] or [""]
        raise CheckpointError(os.path.join(tag_dir, unseen[0]), "is on no node: no worker sees it; start the job on "
                                                                "every node that saved the checkpoint, or copy the file there")
    # a column's model-states file on another node than its dp rank 0 optimizer file: read where it is,
    # its tree gathered, then inspected with that optimizer file (and its templates built) from the tree
    readers = model_readers(views, inspectors)
    handed = {}
    for part in everywhere(transport, lambda: {c: load_portable(os.path.join(tag_dir, f"mp_rank_{c:02d}_model_states.pt"),
                                                                schema.safe_globals(), trust_pickle)
                                                for c, w in readers.items() if w == me}):
        handed.update(part)
    layer_readers = {name: first_seeing(views, [name]) for name in files.layer_files}
    table = {}
    for part in everywhere(transport, lambda: {name: layer_entries(os.path.join(tag_dir, name), trust_pickle)
                                                for name, w in layer_readers.items() if w == me}):
        table.update(part)

    def optim_ranks_here(column: int) -> set[int]:
        return {role.dp_rank for n in views[me].files
                if (role := schema.classify(n)).kind == "optim" and role.mp_rank == column}

    def columns_here() -> dict:
        return {c: (inspect_pipeline_column(files, *divmod(c, files.tp), trust_pickle, handed.get(c), table.get,
                                            optim_ranks_here(c)), optim_ranks_here(c))
                for c, w in enumerate(inspectors) if w == me}
    found = {}
    for part in everywhere(transport, columns_here):
        found.update(part)
    pipe = gathered_pipeline(save_dir, tag, files, [found[c][0] for c in range(len(inspectors))], table)

    def rest_here() -> dict:
        for c, (column, checked) in sorted(found.items()):  # the optimizer files its inspector did not see
            for rank in range(1, column.dp):
                name = schema.optim_file_name(rank, files.bf16, c)
                if rank not in checked and first_seeing(views, [name]) == me:
                    check_stage_optim_file(files, column.stage, c, column.dp, rank, column.keys, trust_pickle)
        return {c: inspect_pipeline_column_trees(pipe, c, trust_pickle, read_tensors, handed.get(c))
                for c, w in enumerate(inspectors) if w == me}
    trees = {}
    for part in everywhere(transport, rest_here):
        trees.update(part)
    return pipeline_columns_source(pipe, [trees[c] for c in range(len(inspectors))]), pipe


def layer_stage_bounds(opts, source: PipelineSource, stages) -> tuple[int, ...] | None:
    """The target's layer-to-stage bounds (DeepSpeed's `parts`): the new assignment's (`stages`) when the
    stages change; with the stages kept, the source's, worked out from --pipeline-layers when given (the
    assignment that reproduces every source stage's parameters, reshard.formats.deepspeed_pipeline.
    check_layers_reproduce_source); None when unknown (then every node gets every layer file)."""
    from reshard.formats.pipeline_target import pipeline_layers
    if stages is not None:
        return stages.bounds
    if not opts.pipeline_layers:
        return None
    layers = pipeline_layers(opts, source.model_path(0))
    numels, groups = source_numels(source), source_groups(source)
    found = set()
    for counted in check_layers_reproduce_source(source, layers, opts.pipeline_partition,
                                                 frozen_numels(source, layers)):
        for method in dict.fromkeys((opts.pipeline_partition, "parameters", "uniform")):
            try:
                assignment = assign_stages(method, layers, numels, source.pp, counted, source_buffers(source))
            except ValueError:
                continue
            if all(split_by_group(assignment.names[s], groups[1], groups[0]) == spec.names
                   for s, spec in enumerate(source.stages)):
                found.add(assignment.bounds)
                break
    return found.pop() if len(found) == 1 else None


def node_layer_files(source: PipelineSource, bounds: tuple[int, ...] | None, stages: set[int]) -> list[str]:
    """The layer files the ranks of `stages` load (runtime/pipe/module.py `load_state_dir`: the
    files of its own layers bounds[s] .. bounds[s + 1] - 1); all of them when `bounds` is None."""
    if bounds is None:
        return list(source.layer_files)
    return [name for name in source.layer_files
            if any(bounds[s] <= int(LAYER_RE.match(name)[1]) < bounds[s + 1] for s in stages)]


@dataclasses.dataclass(frozen=True)
class PipelineNodeSite(NodeSite):
    """A NodeSite of a pipeline save: its node's first target rank writes every target stage's
    model-states file; the layer files of its stages it lacks arrive whole (`moves`) when the rounds are
    done, those it holds (and the other files of the tag directory it holds) its leader copies."""

    moves: tuple[Transfer, ...] = ()
    node_of_worker: tuple[int, ...] = ()
    copies: tuple[str, ...] = ()
    """What this node's leader copies from its own SRC/TAG: layer files its stages load, other files."""
    piece: int = MAX_PIECE
    """The most bytes of a whole file one worker sends in one step (within --memory-budget)."""

    @property
    def whole_file_bytes_between_nodes(self) -> int:
        return bytes_between_nodes(self.moves, self.node_of_worker)

    def files_of(self, zero):
        ranks, base = self.model_states_ranks, zero.files

        def files(source, target: Topology, rank: int) -> list:
            kept = [f for f in base(source, target, rank) if schema.classify(f.name).kind != "model"]
            if rank not in ranks:
                return kept
            from reshard.formats.deepspeed_target import zero12_model_file
            return kept + [zero12_model_file(source, target, target.rank_of(0, m, s))
                           for s in range(target.pp) for m in range(target.tp)]
        return files

    def copy_share(self, source, start, staging, transport) -> dict:
        me = transport.rank
        into = staging.tag_dir if staging is not None else None
        mine = [t for t in self.moves if t.receiver == me]
        for transfer in mine:  # a resumed run fetches again what a killed one may have left half written
            path = confined(staging.destination, os.path.join(into, transfer.name))
            if os.path.lexists(path):
                os.unlink(path)
        report = WorkerReport(me, (), ())
        fetch(transport, self.moves, source.tag_dir, into, staging.destination if staging is not None else "",
              self.piece, report)
        return {t.name: {"bytes": t.size, "blake3": hash_file(os.path.join(into, t.name))} for t in mine}

    def leader_copies(self, source) -> tuple[str, ...]:
        return self.copies


def node_local_pipeline_unit(opts, unit, transport, views: Sequence[WorkerView], columns_target) -> tuple:
    """(source, target, carried, notes, PipelineNodeSite) of a node-local pipeline save on the plan, on
    every worker (NodeLocal.inspect's answer). `columns_target(opts, source, pipe)`: the collective
    job's (source, target, notes) of inspected columns. Collective."""
    from reshard.formats.pipeline_target import pipeline_target
    source, pipe = inspect_columns_on_nodes(transport, views, unit.source, unit.tag, opts.trust_pickle,
                                            not opts.dry_run)
    source, target, notes = columns_target(opts, source, pipe)
    notes = notes + preflight(opts, source, target.topology, [])
    topology, ranks_per_node = target.topology, opts.target_ranks_per_node
    target_ranks = topology.world_size
    nodes = [view.node for view in views]
    tag_dir = os.path.join(unit.source, unit.tag)
    # a source rank is read from its optimizer file: its stage's model-states tree was read where that file is
    # (inspect_columns_on_nodes), and a pipeline's source reader opens no model-states file
    needed = [[name for name in map(os.path.basename, source.source_files(r)) if not STAGE_MODEL_RE.match(name)]
              for r in range(source.spec.topology.world_size)]
    ownership = node_local_ownership(needed, [v.files for v in views], nodes, target_ranks, ranks_per_node, tag_dir)
    planned = pipeline_target(opts, pipe) if topology.pp != pipe.pp or opts.pipeline_layers else None
    bounds = layer_stage_bounds(opts, pipe, planned.stages if planned is not None else None)
    hosting = sorted({target_node(r, ranks_per_node) for r in range(target_ranks)})
    layers_of = {n: set(node_layer_files(pipe, bounds, {topology.coordinates(r).pp for r in range(target_ranks)
                                                          if target_node(r, ranks_per_node) == n}))
                 for n in hosting}
    identity = merged_identity(views, seen_names(views))
    sizes = {name: entry["bytes"] for name, entry in identity.items()}
    moves = tuple(fetch_plan(layers_of, views, sizes, tag_dir))
    me, node = transport.rank, nodes[transport.rank]
    peers = tuple(w for w, n in enumerate(nodes) if n == node)
    held = seen_names([views[w] for w in peers])
    copies = tuple(sorted((layers_of.get(node, set()) & held)
                          | {n for n in pipe.other_files if n in held and os.path.isfile(os.path.join(tag_dir, n))}))
    source = dataclasses.replace(source, other_files=copies,
                                 other_dirs=tuple(d for d in source.other_dirs if os.path.isdir(os.path.join(tag_dir, d))))
    ranks_here = [r for r in range(target_ranks) if target_node(r, ranks_per_node) == node]
    optim = sum(size for name, size in sizes.items() if schema.classify(name).kind == "optim")
    stage_files = sum(size for name, size in sizes.items() if STAGE_MODEL_RE.match(name))
    needed_bytes = (-(-optim * len(ranks_here) // max(target_ranks, 1)) + stage_files * 2
                    + sum(sizes[n] for n in layers_of.get(node, ())) + (len(ranks_here) * 2 + 8) * 4096 + (1 << 20))
    for n in hosting:
        arriving = [t for t in moves if nodes[t.receiver] == n]
        notes.append(f"node {n}: target ranks {min(r for r in range(target_ranks) if target_node(r, ranks_per_node) == n)}"
                     f"..{max(r for r in range(target_ranks) if target_node(r, ranks_per_node) == n)}; receives "
                     f"{len(arriving)} layer files ({sum(t.size for t in arriving)} bytes) it lacks, whole")
    site = PipelineNodeSite(node=node, leader=node_leaders(nodes, target_ranks, ranks_per_node).get(node) == me,
                            peers=peers, hosts_targets=bool(ranks_here), ownership=ownership, identity=identity,
                            model_states_ranks=model_states_ranks(target_ranks, ranks_per_node),
                            needed_bytes=needed_bytes, ranks_per_node=ranks_per_node, moves=moves,
                            node_of_worker=tuple(nodes), copies=copies,
                            piece=max(1 << 10, min(MAX_PIECE, opts.memory_budget // max(4, 2 * transport.size))))
    return source, target, [], notes, site


@dataclasses.dataclass(frozen=True)
class ColumnsOnNodes:
    """What NodeLocal asks of a pipeline save (handed in by reshard.jobs.collective_job, above it): its
    inspection on the plan (`inspect`)."""

    columns_target: Callable
    """collective_job.columns_target(opts, source, pipe): the one target of inspected columns."""

    def inspect(self, opts, unit, transport, views: Sequence[WorkerView]) -> tuple:
        refuse_tp_change(opts, unit, views)
        return node_local_pipeline_unit(opts, unit, transport, views, self.columns_target)


def refuse_tp_change(opts, unit, views: Sequence[WorkerView]) -> None:
    """A tp change of a node-local pipeline save, refused by name before anything is read: it re-cuts the
    layer files, which a node-local job moves whole between nodes (`PipelineNodeSite`). Pure; the same
    on every worker (the names every worker sees)."""
    tp = pipeline_topology_of(seen_names(views))[2]
    if opts.target_tp not in (None, tp):
        raise UnsupportedCheckpoint(os.path.join(unit.source, unit.tag),
                                    f"--target-tp {opts.target_tp} (the save has tp {tp}) with --node-local: a "
                                    "node-local tp change of a pipeline save is not served (its layer files are "
                                    "re-cut, and a node-local job moves them whole); run the reshard on shared "
                                    "storage (every file in one SRC, without --node-local)")
