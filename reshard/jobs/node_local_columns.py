"""Node-local PipelineModule saves through the plan: each column inspected where its files are.

    # on each of 2 nodes (SRC and DST are the same local paths on every node):
    torchrun --nnodes=2 --node_rank=$NODE --nproc_per_node=2 --master_addr=$HEAD --master_port=29500 \
        -m reshard /nvme/ckpt /nvme/ckpt-pp1 --node-local --target-ranks-per-node 2 \
        --target-dp 4 --target-pp 1 --pipeline-layers 7 --pipeline-tied embed:0,6

Every node-local pipeline reshard (dp, pp and a model axis's tp changed or kept) on the plan. DeepSpeed 0.19.8 with
use_node_local_storage writes a stage's layer files and optimizer files where the stage's ranks ran and
its model-states file where a node's LOCAL rank 0 runs that stage (runtime/engine.py
`_configure_checkpointing`, runtime/pipe/module.py `save_state_dict`), so no worker sees every column,
and a column's model-states file need not be on the node of its dp rank 0 optimizer file (pp 2, dp 3
on 3 nodes x 2 ranks). So:

1. from the names every worker sees (node_local.survey_source): the save's file facts
   (deepspeed_pipeline.pipeline_files), each column's inspector, each layer file's reader;
2. each layer file's small entry table read once where it is (layer_entries), gathered, and the trees of
   every stage model-states file and of model rank 0's layer files (PipelineSource.trees);
3. each column's model-states tree read where that file is and gathered, when its inspector (a worker
   that sees its dp rank 0 optimizer file, `column_inspectors`) does not see it (`model_readers`);
   each column checked by its inspector (inspect_pipeline_column), every other dp rank's optimizer
   file by a worker that sees it, the facts gathered into one PipelineSource (gathered_pipeline) on
   every worker, and each column's templates (inspect_pipeline_column_trees) into the
   SourceCheckpoint (pipeline_columns_source): what the collective job inspects on one worker;
4. the target from it by the function the collective job uses (`columns_target`, handed in): with tp
   changed, the model axis, whose layer-file tensors are re-cut in the plan as the collective job re-cuts
   them; with tp kept, the layer files' tensors whole in the plan (deepspeed_pipeline.kept_layer_files,
   each layer's stages `kept_layer_stages`). Either way each layer file is read by the source stage whose
   ranks see it (`layer_reading_stages`);
5. who reads and writes (node_local.node_local_ownership): a source rank where its optimizer file and the
   layer files it reads are, target rank r on node r // G; each node's first target rank writes every
   target stage's model-states file (DeepSpeed's pipeline load counts them: runtime/state_dict_factory.py
   `SDLoaderBase.check_ckpt_list` checks that the mp_rank files in the directory number mp_world_size);
   a column's layer files are written by its dp rank 0 and by its first rank on every other node that runs
   it (`layer_file_copies`), each copy pieces of the plan, so only what a node's ranks load crosses to it
   and the plan's bytes between nodes are what crosses.
Rounds under --memory-budget, and a resume by round, as for every save on the plan.
"""
from __future__ import annotations

import bisect
import dataclasses
import os
from collections.abc import Callable, Sequence

from reshard.formats.torch_bytes.torch_archive import load_portable
from reshard.formats.deepspeed_files import deepspeed_schema as schema
from reshard.formats.deepspeed_files.deepspeed_inspect import inspect_pipeline_column_trees, pipeline_columns_source
from reshard.formats.deepspeed_files.deepspeed_pipeline import (
    LAYER_RE,
    STAGE_MODEL_RE,
    PipelineSource,
    check_layers_reproduce_source,
    check_stage_model_files,
    check_stage_optim_file,
    frozen_numels,
    gathered_pipeline,
    inspect_pipeline_column,
    kept_layer_files,
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
from reshard.layouts.pipeline import assign_stages, split_by_group
from reshard.topology import LayerFiles, Topology
from reshard.errors import CheckpointError, PeerFailure, ReshardError


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
    PipelineSource with the gathered layer table and the trees of every stage model-states file and of model
    rank 0's layer files, `PipelineSource.trees`, read where each is: the layer files' plan spaces and a tp
    change's model axis are worked out from them on every worker), on every worker. Collective."""
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
    wanted = [*stage_files, *(n for n in files.layer_files if LAYER_RE.match(n)[3] in (None, "00"))]
    tree_readers = {name: first_seeing(views, [name]) for name in wanted}
    trees = {}
    for part in everywhere(transport, lambda: {name: load_portable(os.path.join(tag_dir, name),
                                                                   schema.safe_globals(), trust_pickle)
                                                for name, w in tree_readers.items() if w == me}):
        trees.update(part)
    pipe = dataclasses.replace(pipe, trees=trees)

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
    assignment that reproduces every source stage's parameters, reshard.formats.deepspeed_files.deepspeed_pipeline.
    check_layers_reproduce_source); None when unknown (then every node gets every layer file)."""
    from reshard.formats.deepspeed_files.pipeline_target import pipeline_layers
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


@dataclasses.dataclass(frozen=True)
class PipelineNodeSite(NodeSite):
    """A NodeSite of a pipeline save: its node's first target rank writes every target stage's
    model-states file; the layer files are tensors of the plan (written by the ranks that hold them,
    `layer_file_copies`), and its leader copies the other files of the tag directory it holds."""

    copies: tuple[str, ...] = ()
    """What this node's leader copies from its own SRC/TAG: the files that are not DeepSpeed's it holds."""

    def files_of(self, zero):
        ranks, base = self.model_states_ranks, zero.files

        def files(source, target: Topology, rank: int) -> list:
            kept = [f for f in base(source, target, rank) if schema.classify(f.name).kind != "model"]
            if rank not in ranks:
                return kept
            from reshard.formats.deepspeed_files.deepspeed_target import zero12_model_file
            return kept + [zero12_model_file(source, target, target.rank_of(0, m, s))
                           for s in range(target.pp) for m in range(target.tp)]
        return files

    def leader_copies(self, source) -> tuple[str, ...]:
        return self.copies


def node_local_pipeline_unit(opts, unit, transport, views: Sequence[WorkerView], columns_target) -> tuple:
    """(source, target, carried, notes, PipelineNodeSite) of a node-local pipeline save on the plan, on
    every worker (NodeLocal.inspect's answer). `columns_target(opts, source, pipe)`: the collective
    job's (source, target, notes) of inspected columns. Collective."""
    from reshard.formats.deepspeed_files.pipeline_target import pipeline_target
    source, pipe = inspect_columns_on_nodes(transport, views, unit.source, unit.tag, opts.trust_pickle,
                                            not opts.dry_run)
    source, target, notes = columns_target(opts, source, pipe)
    notes = notes + preflight(opts, source, target.topology, [])
    topology, ranks_per_node = target.topology, opts.target_ranks_per_node
    if topology.layer_files is not None:  # a tp change: the layer files re-cut in the plan, read where they are
        layer_files = with_layer_readers(topology.layer_files, pipe, views)
    else:  # tp kept: the layer files whole, in the plan
        planned = pipeline_target(opts, pipe) if topology.pp != pipe.pp else None
        stages = kept_layer_stages(pipe, views, layer_stage_bounds(opts, pipe, None),
                                   planned.stages.bounds if planned is not None else None)
        axis, templates = kept_layer_files(pipe, stages, opts.trust_pickle)
        layer_files = LayerFiles(axis, recut=False, templates=templates)
    topology = dataclasses.replace(topology, layer_files=dataclasses.replace(
        layer_files, copies=layer_file_copies(topology, ranks_per_node)))
    target = dataclasses.replace(target, topology=topology)
    target_ranks = topology.world_size
    nodes = [view.node for view in views]
    tag_dir = os.path.join(unit.source, unit.tag)
    # a source rank is read from its optimizer file and the layer files it reads (SourceCheckpoint.source_files):
    # its stage's model-states tree was read where that file is (inspect_columns_on_nodes), and a pipeline's
    # source reader opens no model-states file
    needed = [[name for name in map(os.path.basename, source.source_files(r, topology))
               if not STAGE_MODEL_RE.match(name)]
              for r in range(source.spec.topology.world_size)]
    ownership = node_local_ownership(needed, [v.files for v in views], nodes, target_ranks, ranks_per_node, tag_dir)
    identity = merged_identity(views, seen_names(views))
    sizes = {name: entry["bytes"] for name, entry in identity.items()}
    me, node = transport.rank, nodes[transport.rank]
    peers = tuple(w for w, n in enumerate(nodes) if n == node)
    held = seen_names([views[w] for w in peers])
    copies = tuple(sorted(n for n in pipe.other_files if n in held and os.path.isfile(os.path.join(tag_dir, n))))
    source = dataclasses.replace(source, other_files=copies,
                                 other_dirs=tuple(d for d in source.other_dirs if os.path.isdir(os.path.join(tag_dir, d))))
    ranks_here = [r for r in range(target_ranks) if target_node(r, ranks_per_node) == node]
    optim = sum(size for name, size in sizes.items() if schema.classify(name).kind == "optim")
    stage_files = sum(size for name, size in sizes.items() if STAGE_MODEL_RE.match(name))
    layer_bytes = sum(size for name, size in sizes.items() if LAYER_RE.match(name))  # re-cut: about as big
    needed_bytes = (-(-optim * len(ranks_here) // max(target_ranks, 1)) + stage_files * 2 + layer_bytes
                    + (len(ranks_here) * 2 + 8) * 4096 + (1 << 20))
    for n in sorted({target_node(r, ranks_per_node) for r in range(target_ranks)}):
        ranks = [r for r in range(target_ranks) if target_node(r, ranks_per_node) == n]
        stages_here = sorted({topology.coordinates(r).pp for r in ranks})
        notes.append(f"node {n}: target ranks {min(ranks)}..{max(ranks)}; the layer files of stage(s) "
                     f"{', '.join(map(str, stages_here))} written there through the plan's rounds"
                     + (" (re-cut)" if topology.layer_files.recut else ""))
    site = PipelineNodeSite(node=node, leader=node_leaders(nodes, target_ranks, ranks_per_node).get(node) == me,
                            peers=peers, hosts_targets=bool(ranks_here), ownership=ownership, identity=identity,
                            model_states_ranks=model_states_ranks(target_ranks, ranks_per_node),
                            needed_bytes=needed_bytes, ranks_per_node=ranks_per_node, copies=copies)
    return source, target, [], notes, site


def kept_layer_stages(pipe: PipelineSource, views: Sequence[WorkerView], source_bounds: tuple[int, ...] | None,
                      target_bounds: tuple[int, ...] | None) -> dict[int, tuple[int, int]]:
    """{layer index: (the source stage whose ranks read its files, the target stage whose ranks write them)}
    with tp kept. Its source stage: by the source's layer-to-stage bounds when known (`layer_stage_bounds`),
    else the stage holding its parameters or buffers (`<index>.` names), else its predecessor's (a layer
    without any, or a tied one, whose weight every stage holding it names alike); read where a worker sees
    the file (`layer_reading_stages`). Its target stage: by `target_bounds` when the stages change, else its
    source stage. Pure."""
    owners = {}
    for spec in pipe.stages:
        for name in [n for group in spec.names for n in group] + list(spec.buffer_names):
            head = name.split(".", 1)[0]
            if head.isdigit():
                owners.setdefault(int(head), spec.index)
    stage_of, previous = {}, 0
    for index in sorted({int(LAYER_RE.match(n)[1]) for n in pipe.layer_files}):
        if source_bounds is not None:
            previous = bisect.bisect_right(list(source_bounds), index) - 1
        else:
            previous = owners.get(index, previous)
        stage_of[index] = previous
    read = layer_reading_stages(pipe, views, stage_of)
    return {index: (read[index], bisect.bisect_right(list(target_bounds), index) - 1 if target_bounds is not None
                    else stage) for index, stage in stage_of.items()}


@dataclasses.dataclass(frozen=True)
class ColumnsOnNodes:
    """What NodeLocal asks of a pipeline save (handed in by reshard.jobs.collective_job, above it): its
    inspection on the plan (`inspect`)."""

    columns_target: Callable
    """collective_job.columns_target(opts, source, pipe): the one target of inspected columns."""

    def inspect(self, opts, unit, transport, views: Sequence[WorkerView]) -> tuple:
        return node_local_pipeline_unit(opts, unit, transport, views, self.columns_target)


def layer_reading_stages(pipe: PipelineSource, views: Sequence[WorkerView], chosen: dict[int, int]) -> dict[int, int]:
    """{layer index: the source stage whose dp rank 0 ranks read its layer files} under a tp change: the
    stage `chosen` (the collective job's choice, deepspeed_pipeline.pipeline_model_axis: the first stage holding
    the layer's parameters) where, for every model rank, a worker sees that layer file with the stage's dp
    rank 0 optimizer file (the reader of that source rank, `node_local_ownership`), else the first stage where
    one does: a tied layer's file is where the stage that saved it ran (DeepSpeed writes a layer's files on
    its stage's dp rank 0, module.py `save_state_dict`), not where the first stage holding the tied weight ran.
    Every stage's copy of a layer file is that one file, so the bytes read are the same. CheckpointError naming
    a layer file no worker sees with such an optimizer file. Pure."""
    found = {}
    for index, first in chosen.items():
        def fits(stage: int) -> bool:
            return all(first_seeing(views, [schema.layer_file_name(index, model if pipe.has_model_axis else None),
                                            schema.optim_file_name(0, pipe.bf16, stage * pipe.tp + model)])
                       is not None for model in range(pipe.tp))
        stage = next((s for s in (first, *range(pipe.pp)) if fits(s)), None)
        if stage is None:
            name = schema.layer_file_name(index, 0 if pipe.has_model_axis else None)
            raise CheckpointError(os.path.join(pipe.tag_dir, name),
                                  "is on no node with a stage's dp rank 0 optimizer file (of every model rank): "
                                  "start the job on every node that saved the checkpoint, or copy the file there")
        found[index] = stage
    return found


def with_layer_readers(layer_files: LayerFiles, pipe: PipelineSource, views: Sequence[WorkerView]) -> LayerFiles:
    """A tp change's re-cut `layer_files` (the target's, `Topology.layer_files`) with each layer file read by
    the source stage whose ranks see it (`layer_reading_stages`). Pure."""
    stages = layer_reading_stages(pipe, views, {index: stage for index, stage, _, _ in layer_files.templates})
    axis = layer_files.axis
    spaces = tuple(dataclasses.replace(space, source_stages=tuple(stages[index] for index, _ in space.keys))
                   for space in axis.layer_spaces)
    return dataclasses.replace(layer_files, axis=dataclasses.replace(axis, layer_spaces=spaces), templates=tuple(
        (index, stages[index], target_stage, tree) for index, _, target_stage, tree in layer_files.templates))


def layer_file_copies(target: Topology, ranks_per_node: int) -> tuple[tuple[int, ...], ...]:
    """The extra copies of the layer files a node-local tp change writes (`LayerFiles.copies`): every
    rank of a (stage, model rank) column loads that column's layer files (runtime/pipe/module.py
    `load_state_dir`), so besides dp rank 0's node each other node running the column gets them, written by
    the column's first rank there. Per extra copy, per column (stage * tp + model rank), that rank, or -1.
    Pure."""
    extras = []
    for column in range(target.pp * target.tp):
        stage, model = divmod(column, target.tp)
        first_on: dict[int, int] = {}
        for dp in range(target.dp):  # ranks ascend with dp (runtime/pipe/topology.py): the first is the lowest
            rank = target.rank_of(dp, model, stage)
            first_on.setdefault(target_node(rank, ranks_per_node), rank)
        home = target_node(target.rank_of(0, model, stage), ranks_per_node)
        extras.append([rank for node, rank in sorted(first_on.items()) if node != home])
    count = max(map(len, extras), default=0)
    return tuple(tuple(e[c] if c < len(e) else -1 for e in extras) for c in range(count))
