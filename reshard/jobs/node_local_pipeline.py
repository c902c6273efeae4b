"""Node-local PipelineModule saves off the plan: fetch what each node lacks, then reshard there as on shared storage.

What `collective_job.keeps_pipeline_columns` accepts (dp changed; pp changed with tp kept) takes the plan
instead (reshard.jobs.node_local_columns); this job serves the rest (a tp change), and a save no worker
can inspect column by column (`node_local_columns.column_inspectors`), chosen in one place
(`NodeLocal.whole_file_job`).

    # on each of 2 nodes (SRC and DST are the same local paths on every node):
    torchrun --nnodes=2 --node_rank=$NODE --nproc_per_node=2 --master_addr=$HEAD --master_port=29500 \
        -m reshard /nvme/ckpt /nvme/ckpt-pp1 --node-local --target-ranks-per-node 2 \
        --target-dp 4 --target-pp 1 --pipeline-layers 7 --pipeline-tied embed:0,6

What DeepSpeed 0.19.8 writes with `"checkpoint": {"use_node_local_storage": true}` under the pipeline
engine (checked on 2 nodes x 2 ranks): each rank's optimizer file on its node (engine.py
`_save_zero_checkpoint`); the layer files of a stage on the node of that stage's dp rank 0
(runtime/pipe/module.py `save_state_dict`); `latest` on global rank 0's node only; and a stage's
`mp_rank_XX_model_states.pt` only on a node whose LOCAL rank 0 runs that stage (engine.py
`_configure_checkpointing`: `rank = self.local_rank if self.use_node_local_storage() else dp_rank`).
DeepSpeed cannot load such a save: its pipeline load globs every `mp_rank_*_model_states.pt` of
the load directory and asserts their count equals the saved mp_world_size (engine.py
`_get_all_ckpt_names`, state_dict_factory.py `check_ckpt_list`: "checkpoint count 1 is different from
saved mp_world_size 2"), and a node holds only the stages its local rank 0 ran.

This job makes such a save loadable at any (pp, dp), every node loading from its own directory:

1. every worker lists what it sees (reshard.jobs.node_local.survey_source, run by NodeLocal.units);
   from the names alone, a stage whose model-states file is on no node is refused by name
   (deepspeed_pipeline.check_stage_model_files), as are the options not served here, before
   anything is written;
2. each node's leader runs the lifecycle for its own DST (`Lifecycle.begin_per_node`: lock,
   staging, journal); the staging holds `.reshard-source/TAG`, the complete source as this node
   sees it: links to the files it holds, and the pipeline files it lacks, sent whole over the job's
   transport by a worker that sees them (`fetch_plan`, `fetch`: pieces of at most a chunk, one
   piece per sender per round, written at their offsets, never a whole file in memory);
3. every worker of a node that hosts target ranks inspects that complete view and works out the
   target exactly as the shared-storage pipeline job does (reshard.jobs.pipeline_job
   `checked_target`), and builds with its builders: the node's workers share out every target
   (stage, model rank) unit, since each node needs EVERY stage's model-states file (DeepSpeed's load
   counts them), writing the optimizer files of the target ranks on this node only (target rank r
   on node r // G; PipeDataParallelTopology numbers ranks stage * dp + dp_rank, with a model axis
   (stage * dp + dp_rank) * tp + model: runtime/pipe/topology.py, axes pipe, data[, model]);
   the layer files of the stages its ranks run (all of them when the layer-to-stage assignment is
   unknown: the stages kept and no --pipeline-layers given) are moved out of the fetch area, or
   copied from SRC where the node held them;
4. each node's leader removes the fetch area, writes the manifest (with the node's placement) and
   publishes, `latest` on every node (each node's load reads it), DeepSpeed's recovery scripts on
   node 0. A failure anywhere removes every node's staging, fetch area included; SRC is only read.
Whole files, no rounds: a failed run starts over (no resume).
"""
from __future__ import annotations

import os
import shutil
import time
from collections.abc import Sequence


from reshard.errors import CheckpointError, OptionError, UnsupportedCheckpoint
from reshard.files.byte_io import hash_file
from reshard.files.paths import confined, open_new_file
from reshard.files.resources import anonymous_rss_bytes, human, peak_resident_bytes
from reshard.formats import deepspeed_schema as schema
from reshard.formats.deepspeed_pipeline import (
    LAYER_RE,
    STAGE_MODEL_RE,
    PipelineSource,
    check_stage_model_files,
    inspect_pipeline,
    load_whole,
    pipeline_topology_of,
    stage_model_name,
)
from reshard.jobs.destination import SAVE_DIR_NAMES
from reshard.jobs.lifecycle import JobOutput, Lifecycle, publish_tag_dir
from reshard.jobs.progress import Progress, progress_enabled
from reshard.jobs.manifest import Manifest, output_fingerprint
from reshard.jobs.node_local import WorkerView, merged_identity, node_leaders, target_node
from reshard.jobs.options import ReshardOptions
from reshard.jobs.pipeline_job import (
    PP_CHANGE_MISSING,
    build_stages,
    checked_target,
    describe_target,
    stage_files_written_by,
)
from reshard.jobs.results import CheckpointResult, PhaseClock, WorkerReport
from reshard.jobs.node_local_columns import layer_stage_bounds, node_layer_files
from reshard.jobs.runs import Unit
from reshard.jobs.whole_file_moves import MAX_PIECE, bytes_between_nodes, fetch, fetch_plan
from reshard.topology import Topology
from reshard.transport import Transport
from reshard.transport.collective import check_peers
from reshard.version import __version__

FETCH_DIR = ".reshard-source"
"""The fetch area inside a node's staging tag directory (inspect_pipeline passes over dot-names);
removed before the tag directory is published."""



def pipeline_file(name: str) -> bool:
    """A file of DeepSpeed's pipeline save (layer, stage model-states or optimizer file): what a node
    fetches when it lacks it. Any other file of the tag directory stays on the nodes that hold it."""
    return bool(LAYER_RE.match(name) or STAGE_MODEL_RE.match(name)) or schema.classify(name).kind == "optim"


def target_rank(stage: int, dp_rank: int, model: int, dp: int, tp: int) -> int:
    """The global rank of (stage, dp rank, model rank) in DeepSpeed's pipeline topology
    (runtime/pipe/topology.py: PipeDataParallelTopology axes [pipe, data], PipeModelDataParallelTopology
    [pipe, data, model]; the last axis varies fastest, ProcessTopology)."""
    return (stage * dp + dp_rank) * tp + model


def node_dp_ranks(target: Topology, ranks_per_node: int, node: int) -> dict[tuple[int, int], tuple[int, ...]]:
    """(stage, model rank) -> the dp ranks of that unit whose ranks run on `node`. Pure."""
    return {(s, m): tuple(d for d in range(target.dp)
                          if target_node(target_rank(s, d, m, target.dp, target.tp), ranks_per_node) == node)
            for s in range(target.pp) for m in range(target.tp)}


def unseen_pipeline_files(names: set[str], saved: tuple[int, int] = (0, 0)) -> list[str]:
    """The optimizer and layer files a pipeline save with these file names must also hold, from the
    names and `saved` (mp_world_size, dp_world_size) as a stage model-states file says them
    (`saved_world_sizes`; (0, 0): unknown): every (stage, model rank)'s optimizer file of every dp
    rank, and with a model axis each layer's file of every model rank. Pure. (A whole layer missing
    is not visible here: DeepSpeed's load names it.)"""
    stage_files = {int(m[1]) for name in names if (m := STAGE_MODEL_RE.match(name))}
    optims = [schema.classify(name) for name in names if schema.classify(name).kind == "optim"]
    if not optims:
        return []
    bf16 = optims[0].bf16
    dp = max(saved[1], max(role.dp_rank for role in optims) + 1)
    mp_ranks = stage_files | {role.mp_rank for role in optims} | set(range(saved[0]))
    expected = {schema.optim_file_name(d, bf16, m) for m in mp_ranks for d in range(dp)}
    layers: dict[int, set] = {}
    for name in names:
        if match := LAYER_RE.match(name):
            layers.setdefault(int(match[1]), set()).add(match[3])
    models = set().union(*layers.values()) - {None} if layers else set()
    if models:
        tp = max(int(m) for m in models) + 1
        expected |= {f"layer_{index:02d}-model_{m:02d}-model_states.pt" for index in layers for m in range(tp)}
    return sorted(expected - names)


def saved_world_sizes(transport: Transport, tag_dir: str, view: WorkerView, trust_pickle: bool) -> tuple[int, int]:
    """(mp_world_size, dp_world_size) as the stage model-states files say them (each worker reads the
    first it sees; a small pickle, `module` None), all alike, else refused naming the file. Collective."""
    found, failure = None, None
    names = sorted(name for name in view.files if STAGE_MODEL_RE.match(name))
    if names:
        path = os.path.join(tag_dir, names[0])
        try:
            state = load_whole(path, trust_pickle)
            found = (path, int(state["mp_world_size"]), int(state["dp_world_size"]))
        except (KeyError, TypeError, ValueError):
            failure = CheckpointError(path, "has no mp_world_size and dp_world_size: not a pipeline stage file")
        except CheckpointError as error:
            failure = error
    check_peers(transport, failure, "reading a stage model-states file")
    seen = [f for f in transport.all_gather_object(found) if f is not None]
    if any(f[1:] != seen[0][1:] for f in seen):
        other = next(f for f in seen if f[1:] != seen[0][1:])
        raise CheckpointError(other[0], f"says mp_world_size {other[1]} and dp_world_size {other[2]}, {seen[0][0]} "
                                        f"{seen[0][1]} and {seen[0][2]}: the nodes hold different saves")
    return seen[0][1:] if seen else (0, 0)


def refuse_unserved(opts: ReshardOptions, first_layer_file: str, source_pp: int, source_tp: int) -> None:
    """What this job does not serve, and a pp change without the layer list it needs
    (pipeline_job.pipeline_target's rule, which runs once the source is fetched), refused by name
    before anything is written."""
    if opts.target_pp not in (None, source_pp) and not opts.pipeline_layers:
        raise UnsupportedCheckpoint(os.path.join(os.path.dirname(first_layer_file), stage_model_name(0)),
                                    f"--target-pp {opts.target_pp} (the save has {source_pp} stages): "
                                    + PP_CHANGE_MISSING)
    refused = [(opts.target_tp not in (None, source_tp), f"--target-tp {opts.target_tp} (the save has tp {source_tp})"),
               (opts.target_stage not in (None, 1), f"--target-stage {opts.target_stage}"),
               (opts.target_ep not in (None, 1), f"--target-ep {opts.target_ep}")]
    for applies, option in refused:
        if applies:
            raise OptionError(f"{first_layer_file}: {option} with --node-local is not supported for pipeline "
                              "checkpoints (dp and pp change only); gather the files into one directory every "
                              "worker sees and run without --node-local")
    if opts.target_dp < 1:
        raise OptionError(f"{first_layer_file}: --target-dp must be at least 1")


def run_node_local_pipeline_unit(opts: ReshardOptions, unit: Unit, transport: Transport, clock: PhaseClock,
                                 views: Sequence[WorkerView]) -> CheckpointResult:
    """Steps 1-4 of the module docstring, on every worker."""
    started = time.perf_counter()
    tag_dir = os.path.join(unit.source, unit.tag)
    union = sorted(set().union(*(view.files for view in views)))
    pipeline_names = {name for name in union if pipeline_file(name)}
    layer_names = sorted(name for name in union if LAYER_RE.match(name))
    saved = saved_world_sizes(transport, tag_dir, views[transport.rank], opts.trust_pickle)
    check_stage_model_files(tag_dir, {int(m[1]) for n in union if (m := STAGE_MODEL_RE.match(n))},
                            {schema.classify(n).mp_rank for n in union if schema.classify(n).kind == "optim"}, saved[0])
    source_pp, source_dp, source_tp = pipeline_topology_of(union)
    refuse_unserved(opts, os.path.join(tag_dir, layer_names[0]), source_pp, source_tp)
    if unseen := unseen_pipeline_files(set(union), saved):
        raise CheckpointError(os.path.join(tag_dir, unseen[0]), "is on no node: no worker sees it; start the job on "
                                                                "every node that saved the checkpoint, or copy the "
                                                                "file to one of them")
    target = Topology(dp=opts.target_dp, tp=source_tp, pp=opts.target_pp or source_pp)
    ranks_per_node = opts.target_ranks_per_node
    target_ranks = target.pp * target.dp * target.tp
    nodes = [view.node for view in views]
    hosting = range(target_node(target_ranks - 1, ranks_per_node) + 1)
    if missing := [n for n in hosting if n not in nodes]:
        raise OptionError(f"--node-local: target ranks {missing[0] * ranks_per_node}.. run on node {missing[0]} "
                          f"(--target-ranks-per-node {ranks_per_node}), but no worker runs there (workers run on "
                          f"nodes {sorted(set(nodes))}); start the job on nodes 0..{len(hosting) - 1}")
    identity = merged_identity(views, set(union))
    sizes = {name: entry["bytes"] for name, entry in identity.items()}
    transfers = fetch_plan({n: pipeline_names for n in hosting}, views, sizes, tag_dir)
    node = nodes[transport.rank]
    peers = tuple(w for w, n in enumerate(nodes) if n == node)
    hosts = node in hosting
    leader = node_leaders(nodes, target_ranks, ranks_per_node).get(node) == transport.rank
    result = CheckpointResult(unit.source, unit.destination, unit.tag,
                              f"pipeline pp={source_pp} dp={source_dp}" + (f" tp={source_tp}" if source_tp > 1 else "")
                              + f", node-local on {len(set(nodes))} nodes", Topology(dp=source_dp, tp=source_tp,
                                                                                      pp=source_pp),
                              target, transport.size, transport.name, 0, 0.0, opts.dry_run)
    result.nodes = len(set(nodes))
    result.plan_bytes_between_nodes = bytes_between_nodes(transfers, nodes)
    for n in hosting:
        fetched = [t for t in transfers if nodes[t.receiver] == n]
        ranks = [r for r in range(target_ranks) if target_node(r, ranks_per_node) == n]
        result.notes.append(f"node {n}: target ranks {ranks[0]}..{ranks[-1]}; fetches {len(fetched)} source files "
                            f"({human(sum(t.size for t in fetched))}) it lacks, links the {len(pipeline_names) - len(fetched)} "
                            "it holds; writes every stage's model-states file, its ranks' optimizer "
                            "files and the layer files of its stages")
    if opts.dry_run:
        result.notes.append("dry run: the source is inspected (and the target's stages worked out) once each node "
                            "holds every file, which only the run itself fetches")
        result.seconds = time.perf_counter() - started
        return result

    placement = {"node": node, "ranks_per_node": ranks_per_node, "pp": target.pp, "layers": opts.pipeline_layers,
                 "tied": opts.pipeline_tied, "partition": opts.pipeline_partition}
    fingerprint = output_fingerprint(unit.source, unit.tag, identity, target.dp, placement=placement)
    fetched_here = sum(t.size for t in transfers if nodes[t.receiver] == node)
    needed_bytes = fetched_here + sum(sizes[name] for name in pipeline_names)  # the fetch, and at most the source again
    life = Lifecycle(unit.destination, unit.tag, leader=leader, overwrite=opts.overwrite, peers=peers)
    start = life.begin_per_node(transport, node, lambda: JobOutput(fingerprint, set(SAVE_DIR_NAMES), identity=identity,
                                                                   needed_bytes=needed_bytes))
    result.notes += start.notes
    clock.lap("plan")
    report = WorkerReport(transport.rank, (), ())
    if start.mode == "complete":
        result.seconds = time.perf_counter() - started
        return result
    staging = life.staging
    fetch_save_dir = os.path.join(staging.tag_dir, FETCH_DIR)
    fetch_tag_dir = os.path.join(fetch_save_dir, unit.tag)
    piece = max(1 << 20, min(MAX_PIECE, opts.memory_budget // max(4, 2 * transport.size)))

    def work() -> None:
        failure = None
        if leader:
            try:  # the files this node holds, linked: read through, never written
                os.makedirs(confined(unit.destination, fetch_tag_dir))
                held = set().union(*(views[w].files for w in peers))
                for name in sorted(pipeline_names & held):
                    os.symlink(os.path.join(tag_dir, name), confined(unit.destination, os.path.join(fetch_tag_dir, name)))
            except OSError as error:
                failure = error
        check_peers(transport, failure, "linking the source files this node holds")
        fetch(transport, transfers, tag_dir, fetch_tag_dir, unit.destination, piece, report)
        clock.lap("exchange+write")  # the fetch is this job's exchange

        failure, built = None, None
        if hosts:
            try:
                source = inspect_pipeline(fetch_save_dir, unit.tag, trust_pickle=opts.trust_pickle)
                planned, needed = checked_target(opts, source, len(peers))
                built = source, planned, needed, layer_stage_bounds(opts, source, planned.stages)
            except Exception as error:  # a refusal here is every hosting node's alike
                failure = error
        check_peers(transport, failure, "inspecting the fetched source")
        clock.lap("inspect")

        hashes, failure = {}, None
        if hosts:
            source, planned, needed, bounds = built
            result.description = source.describe() + f", node-local on {len(set(nodes))} nodes"
            if leader:
                result.notes.append(f"node {node}: pipeline: {describe_target(opts, source, planned)}; whole tensors "
                                    f"(largest worker here about {human(max(needed))})")
            try:
                hashes = build_node(opts, source, planned, bounds, node, peers, transport.rank, ranks_per_node,
                                    unit.destination, staging.tag_dir, fetch_tag_dir, tag_dir, views, report)
            except Exception as error:
                failure = error
        clock.lap("exchange+write")
        check_peers(transport, failure, "writing the target files")

        def place(all_hashes: list) -> None:
            shutil.rmtree(confined(unit.destination, fetch_save_dir))  # links and fetched copies; SRC untouched
            files = {}
            for worker_hashes in all_hashes:
                files.update(worker_hashes)
            source = built[0]
            publish_tag_dir(staging, Manifest(
                start.output_fingerprint,
                source={"save_dir": unit.source, "tag": unit.tag, "dp_world_size": source.dp, "pp": source.pp,
                        "tp": source.tp, "stage": 1, "description": source.describe(), "files": identity},
                target={"dp_world_size": target.dp, "pp": target.pp, "tp": target.tp, "stage": 1, **placement},
                files=files, reshard_version=__version__),
                unit.latest, scripts_from=unit.source if node == 0 else None)

        life.publish(transport, hashes if hosts else {}, place)

    # whole files fetched and written per node, no rounds to count: the seconds, on worker 0
    with Progress(f"reshard {unit.tag}, node-local pipeline", progress_enabled(opts.quiet, transport.rank == 0)) as bar:
        bar.start(None)
        life.run(work)
    report.peak_rss_bytes = peak_resident_bytes()
    report.peak_anonymous_bytes = anonymous_rss_bytes()
    clock.lap("publish")
    report.phases = clock.seconds
    result.reports = transport.all_gather_object(report)
    result.seconds = time.perf_counter() - started
    return result


def build_node(opts: ReshardOptions, source: PipelineSource, planned, bounds, node: int, peers: tuple[int, ...],
               me: int, ranks_per_node: int, destination: str, staging_tag_dir: str, fetch_tag_dir: str,
               source_tag_dir: str,
               views: Sequence[WorkerView], report: WorkerReport) -> dict:
    """This worker's share of its node's output, written into staging: {name: manifest entry}.

    Every (stage, model rank) unit's model-states file (DeepSpeed's load counts them all) with the
    optimizer files of this node's ranks, the units shared out among the node's workers as the
    shared-storage job shares them among all (stage_files_written_by); the node's layer files, the
    k-th by the node's k-th worker (mod their count), moved out of the fetch area when fetched,
    else copied from SRC; the leader copies the other files of the tag directory this node holds."""
    topology = planned.topology
    dp_ranks = node_dp_ranks(topology, ranks_per_node, node)
    position = peers.index(me)
    units = stage_files_written_by(topology.pp, topology.tp, len(peers))[position]
    paths = [path for _, written in build_stages(source, planned, units, staging_tag_dir, opts.trust_pickle, report,
                                                  lambda s, m: dp_ranks[(s, m)]) for path in written]
    hashes = {os.path.basename(path): {"bytes": os.path.getsize(path), "blake3": hash_file(path)} for path in paths}
    report.bytes_written = sum(entry["bytes"] for entry in hashes.values())
    stages = {s for (s, _), ranks in dp_ranks.items() if ranks}
    layer_files = node_layer_files(source, bounds, stages)[position::len(peers)]
    others = [name for name in sorted(set().union(*(views[w].files for w in peers)))
              if not pipeline_file(name) and os.path.isfile(os.path.join(source_tag_dir, name))] \
        if position == 0 else []
    for name in [*layer_files, *others]:
        fetched, target = os.path.join(fetch_tag_dir, name), os.path.join(staging_tag_dir, name)
        if os.path.isfile(fetched) and not os.path.islink(fetched):
            os.rename(fetched, target)  # fetched for this node: the same file system, no second copy
        else:
            with open(os.path.join(source_tag_dir, name), "rb") as src, \
                    os.fdopen(open_new_file(destination, target), "wb") as out:
                shutil.copyfileobj(src, out, 1 << 20)
            report.bytes_read += os.path.getsize(target)
        hashes[name] = {"bytes": os.path.getsize(target), "blake3": hash_file(target)}
        report.bytes_carried += hashes[name]["bytes"]
    return hashes

