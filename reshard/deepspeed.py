"""In-job resharding: resume a DeepSpeed engine from a checkpoint saved at another world size.

    import reshard.deepspeed
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    load_path, client_state = reshard.deepspeed.load_checkpoint(engine, "/ckpt/run1")

A drop-in for `engine.load_checkpoint(load_dir, tag, **kwargs)`, with the same return value.
If the checkpoint was saved at the engine's data-parallel and tensor-parallel sizes it simply
delegates. Otherwise the job's own ranks reshard it over the job's process group: each rank reads a
disjoint subset of the source rank files, slices move with all-to-all within the memory
budget, and each rank builds its new partition in memory; DeepSpeed's own
`load_checkpoint` then loads those objects, so the engine ends in exactly the state a
native load of the offline-resharded checkpoint gives. No resharded copy is written.

Tensor parallelism (AutoTP, ZeRO-1/2 and ZeRO-3): the engine's TP size is its model-parallel size
(engine.py `_configure_distributed_model`: `mp_world_size`, `checkpoint_mp_rank`, the numbers
in the file names DeepSpeed loads), its DP size `dp_world_size`; the job must hold exactly
tp x dp ranks, numbered as reshard numbers them (tp fastest, utils/groups.py). The module
weights of each TP rank's model-states file are resliced in the same plan (never the source
file served); the rank owning (dp 0, tp t) builds that object and sends it to the other dp ranks
of TP rank t alone (`share_file`: point to point, pickled; no other rank receives it).
Under ZeRO-3 every (dp, tp) rank builds its own model-states and optim objects.

Pipeline parallelism (PipelineModule, ZeRO-1): a save at the PipelineEngine's own (pp, dp, tp) goes
to DeepSpeed's load as it is; at another dp, pp or tp, the plan and `execute()` as the collective job
runs them (`_load_pipeline_columns`): the target is the engine's grid and, with another pp or tp, the
engine's own stages; each rank fills its own stage's optimizer file in memory within `memory_budget` by
rounds. The layer files are read from the source at the save's tp; at another tp of the model axis (a
save carrying universal_checkpoint_info patterns) they are re-cut in the same plan, by rounds too.

ZeRO-0 MoE (no ZeRO, one whole optimizer state_dict per EP rank): at another ep the plan and `execute()`
as the collective job runs them (`_load_zero0_moe`): each target `expp_rank_{e}` file, and the model
states holding EP rank 0's optimizer, is filled in memory within `memory_budget` by rounds on one rank
and sent to the ranks that load it alone (`share_file`, as above).

What does touch disk: DeepSpeed's loader checks that the files it loads exist, so each rank
creates empty placeholder files with the target names in a private temporary directory
(removed afterwards) and DeepSpeed's checkpoint engine is pointed, for the duration of the
call, at the in-memory objects. One case cannot be served from memory: ZeRO-3 with
`load_optimizer_states=False` makes DeepSpeed run zero_to_fp32 on the directory itself;
there the checkpoint is resharded into a temporary staging directory, loaded, and removed.
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
import time

import numpy as np
import torch

from reshard.planning.checkpoint_plan import plan_reshard
from reshard.planning.plan import Ownership
from reshard.transport.collective import on_rank0
from reshard.deepspeed_version import check_installed_deepspeed
from reshard.errors import ReshardError, UnsupportedCheckpoint
from reshard.formats.deepspeed_files.folded_expert_files import expert_file_state, rewrites_expert_files, target_expert_files
from reshard.jobs.execute import execute
from reshard.formats.deepspeed_files import deepspeed_classes as classes
from reshard.formats.deepspeed_files import deepspeed_schema as schema
from reshard.formats.deepspeed_files.deepspeed_client_state import differing_client_state
from reshard.formats.deepspeed_files.deepspeed_inspect import inspect_checkpoint, read_storages
from reshard.formats.deepspeed_files.deepspeed_spec import SourceCheckpoint
from reshard.formats.deepspeed_files.deepspeed_target import carried_bytes, is_copy_role, target_files
from reshard.formats.torch_bytes.torch_archive import TensorRef, leaves_in_order, load_checked, materialize, refs_in
from reshard.formats.deepspeed_files.source_reader import SourceReader
from reshard.topology import Topology
from reshard.transport import TorchDistributedTransport

DEEPSPEED_VERSION = check_installed_deepspeed()  # the user's own DeepSpeed: warns outside the tested range

DEFAULT_BUDGET = 1 << 30


class MemoryTargetWriter:
    """Builds the target files of some ranks as in-memory objects (what torch.load would return).
    `files`: what a target rank writes (a ZeroStageTarget's `files`, as the collective job's
    TargetWriter takes it); by default deepspeed_target.target_files, less the ZeRO-1/2 model states."""

    def __init__(self, source: SourceCheckpoint, target_topology: Topology, ranks, files=None):
        self.objects: dict[tuple[int, str], object] = {}
        self.locations: dict[tuple, np.ndarray] = {}
        self.bytes_written = 0
        for rank in ranks:
            for target in (files or target_files)(source, target_topology, rank):
                if files is None and source.spec.stage < 3 and source.spec.tensor is None and \
                        source.spec.columns is None and target.name == schema.model_file_name(source.spec.stage):
                    continue  # ZeRO-1/2 model states: every rank reads the source file, as DeepSpeed does
                self.objects[(rank, target.name)] = self.build(source, rank, target)

    def build(self, source: SourceCheckpoint, rank: int, target) -> object:
        """`target` (a TargetFile of rank `rank`) as the object torch.load would return: carried values
        copied in, the slots the exchange writes zeroed and recorded in `locations`."""
        obj, roles = materialize(target.tree)
        carried = source.carried.get(target.template)
        if carried is None:  # the AutoTP model states: frozen weights and buffers from the template file
            carried = read_storages(os.path.join(source.tag_dir, target.template),
                                    [ref for ref in refs_in(target.tree) if isinstance(ref, TensorRef)])
        for tensor in leaves_in_order(obj):
            role = roles.get(tensor.untyped_storage()._cdata)
            raw = torch.empty(0, dtype=torch.uint8).set_(tensor.untyped_storage())
            if isinstance(role, tuple) and not is_copy_role(role):
                raw.zero_()  # padding reads as zeros, as in a written file
                self.locations[(rank, role)] = raw.numpy()
            elif role is not None and len(raw):
                raw.copy_(torch.frombuffer(bytearray(carried_bytes(carried, role)), dtype=torch.uint8))
        return obj

    def write(self, rank: int, slot: tuple, element: int, itemsize: int, data: memoryview) -> None:
        start = element * itemsize
        self.locations[(rank, slot)][start:start + len(data)] = np.frombuffer(data, dtype=np.uint8)
        self.bytes_written += len(data)

    def sync(self) -> None:
        pass  # nothing on disk

    def close(self) -> None:
        pass  # the objects are the result: they stay until the load has used them


def _load_with_served_files(engine, root: str, tag: str, served: dict, redirected: dict, kwargs: dict):
    """engine.load_checkpoint(root, tag) with `served` paths answered from memory and `redirected`
    paths read from elsewhere (`_ServedCheckpointEngine`); the engine's own checkpoint engine is
    put back afterwards. Placeholders are created first: DeepSpeed checks the files exist."""
    for path in [*served, *redirected]:
        open(path, "wb").close()
    inner = engine.checkpoint_engine
    engine.checkpoint_engine = _ServedCheckpointEngine(inner, served, redirected)
    try:
        return engine.load_checkpoint(root, tag, **kwargs)
    finally:
        engine.checkpoint_engine = inner


class _ServedCheckpointEngine:
    """Wraps DeepSpeed's checkpoint engine: named paths come from memory, the rest from disk."""

    def __init__(self, inner, served: dict, redirected: dict | None = None):
        self.inner, self.served, self.redirected = inner, served, redirected or {}

    def load(self, path, map_location=None):
        key = os.path.abspath(path)
        if key in self.served:
            return self.served[key]
        return self.inner.load(self.redirected.get(key, path), map_location=map_location)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _engine_ep(engine) -> int:
    """The expert-parallel size of the engine's native MoE or AutoEP layers (1 without any)."""
    from deepspeed.moe.layer import MoE
    try:
        from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer
    except ImportError:  # a DeepSpeed without AutoEP
        AutoEPMoELayer = MoE
    sizes = {module.ep_size for module in engine.module.modules() if isinstance(module, (MoE, AutoEPMoELayer))}
    return max(sizes) if sizes else 1


def _data_parallel_size(engine) -> int:
    return int(getattr(engine, "seq_dp_world_size", None) or engine.dp_world_size)


def _engine_topology(engine) -> Topology:
    """(dp, tp, ep) of the engine: tp is its model-parallel size, the mp index of the files it loads
    (engine.py `_configure_distributed_model`; AutoTP sets the mpu to its TP groups); ep that of its
    native MoE or AutoEP layers."""
    return Topology(dp=_data_parallel_size(engine), tp=int(getattr(engine, "mp_world_size", 1) or 1),
                    ep=_engine_ep(engine))


def _check_rank_numbering(engine, target: Topology, rank: int) -> None:
    """reshard numbers ranks tp fastest (reshard.topology); the engine must load the files of
    the same coordinates (engine.py `_get_ckpt_name`, `_get_zero_ckpt_name`)."""
    import deepspeed.comm as dist
    at = target.coordinates(rank)
    tp_rank = int(engine.checkpoint_mp_rank) if target.tp > 1 else 0
    group = getattr(engine.optimizer, "dp_process_group", None) or engine.data_parallel_group
    dp_rank = dist.get_rank(group=group)
    if (at.dp, at.tp) != (dp_rank, tp_rank):
        raise ReshardError(f"in-job resharding: rank {rank} loads the files of dp rank {dp_rank}, tp rank {tp_rank}, "
                           f"but reshard numbers it dp {at.dp}, tp {at.tp} (tp fastest, as DeepSpeed's default "
                           "groups); a job with another rank order must reshard offline")


def load_checkpoint(engine, load_dir: str, tag: str | None = None, *, memory_budget: int = DEFAULT_BUDGET,
                    trust_pickle: bool = False, staging_dir: str | None = None, **load_checkpoint_kwargs):
    """`engine.load_checkpoint(load_dir, tag, **kwargs)`, resharding in the job when the sizes differ.

    Collective: every rank of the job calls it, as with DeepSpeed's own method.
    `staging_dir`: a directory every rank can see, needed only for the one case that goes
    through disk (ZeRO-3 with load_optimizer_states=False) on more than one host.
    """
    import torch.distributed as dist
    if not dist.is_initialized():
        raise ReshardError("reshard.deepspeed.load_checkpoint needs the job's torch.distributed process group "
                           "(call it after deepspeed.initialize)")
    transport = TorchDistributedTransport()
    pipeline = on_rank0(transport, lambda: pipeline_to_load(load_dir, tag, _engine_pipeline(engine), trust_pickle))
    if isinstance(pipeline, str):  # saved by a PipelineModule at this engine's (pp, dp): DeepSpeed's own load
        return engine.load_checkpoint(load_dir, pipeline, **load_checkpoint_kwargs)
    if pipeline is not None:
        return _load_pipeline_columns(engine, pipeline, transport, memory_budget, trust_pickle, load_checkpoint_kwargs)
    zero0 = on_rank0(transport, lambda: _zero0_moe_source(load_dir, tag, trust_pickle))
    if zero0 is not None:
        return _load_zero0_moe(engine, zero0, transport, memory_budget, trust_pickle, load_checkpoint_kwargs)
    source: SourceCheckpoint = on_rank0(transport, lambda: inspect_checkpoint(load_dir, tag, trust_pickle=trust_pickle))
    target = _engine_topology(engine)
    target_dp = target.dp
    problem = source.expert_problem(target)
    if problem:
        raise UnsupportedCheckpoint(source.model_path(0), f"cannot be loaded by this engine ({target}): {problem}")
    if source.spec.topology == target:
        return engine.load_checkpoint(load_dir, source.tag, **load_checkpoint_kwargs)
    if source.spec.tensor is None and target.tp > 1:
        raise UnsupportedCheckpoint(source.tag_dir, f"was saved without AutoTP metadata (tp={source.spec.topology.tp});"
                                    f" the engine has tp={target.tp}, and in-job resharding changes the TP size "
                                    "only of AutoTP checkpoints")
    if transport.size != target.world_size:
        raise ReshardError(f"in-job resharding needs data and tensor parallelism only: the job has {transport.size} "
                           f"ranks but the engine's topology is {target.describe()} ({target.world_size} ranks)")
    if source.spec.tensor is not None:
        _check_rank_numbering(engine, target, transport.rank)
    started = time.perf_counter()
    differing = on_rank0(transport, lambda: differing_client_state(source, trust_pickle=trust_pickle))
    if differing and transport.rank == 0:
        print(f"reshard: client_state differs between source ranks in {', '.join(differing)} (ZeRO-3 saves each "
              f"rank's own); every rank received source rank 0's values", flush=True)
    if source.spec.stage == 3 and not load_checkpoint_kwargs.get("load_optimizer_states", True):
        return _load_through_staging(engine, source, transport, memory_budget, trust_pickle, staging_dir,
                                     load_checkpoint_kwargs)
    plan = plan_reshard(source.spec, target, transport.size, memory_budget)
    objects = _reshard_in_memory(source, target, plan, transport, trust_pickle)
    if source.spec.tensor is not None and source.spec.stage < 3:  # ZeRO-3: every rank writes its own
        _share_model_states(source, target, plan.ownership, objects, transport)
    result = _load_served(engine, source, target, objects, transport.rank, load_checkpoint_kwargs)
    if transport.rank == 0:
        sizes = (f"{source.spec.topology.describe()} to {target.describe()}"
                 if source.spec.experts is not None or source.spec.tensor is not None
                 else f"{source.spec.dp_world_size} to {target_dp} data-parallel ranks")
        print(f"reshard: resharded {source.tag_dir} from {sizes} in-job in {time.perf_counter() - started:.2f} s",
              flush=True)
    return result


def _engine_pipeline(engine) -> tuple[int, int, int] | None:
    """(pp, dp, tp) of a PipelineEngine (runtime/pipe/engine.py: `num_stages`, `dp_world_size`; tp its
    grid's model (tensor-slicing) axis, topology.py PipelineParallelGrid `get_slice_parallel_world_size`,
    1 without one), else None."""
    if not getattr(engine, "pipeline_parallelism", False):
        return None
    return int(engine.num_stages), int(engine.dp_world_size), int(engine.grid.get_slice_parallel_world_size())


def pipeline_to_load(load_dir: str, tag: str | None, engine_pipeline: tuple[int, int, int] | None,
                     trust_pickle: bool = False):
    """None when `load_dir` holds no PipelineModule save; its tag when the save is at the engine's
    (pp, dp, tp) (DeepSpeed loads it as it is); else its PipelineSource, to be rebuilt in the job
    (another tp at the same (pp, dp) too: DeepSpeed's own load would hand each model rank a file of
    the save's slicing). A pipeline save offered to an engine that is not a pipeline engine is
    refused by name."""
    from reshard.formats.deepspeed_files.deepspeed_inspect import resolve_tag
    from reshard.formats.deepspeed_files.deepspeed_pipeline import inspect_pipeline, is_pipeline, saved_pipeline_topology
    load_dir = os.path.abspath(load_dir)  # the PipelineSource's paths, as inspect_pipeline_columns makes them
    tag = resolve_tag(load_dir, tag)
    tag_dir = os.path.join(load_dir, tag)
    if not is_pipeline(tag_dir):
        return None
    saved = saved_pipeline_topology(tag_dir)  # (pp, dp, tp)
    if engine_pipeline is None:
        raise UnsupportedCheckpoint(os.path.join(tag_dir, "mp_rank_00_model_states.pt"),
                                    f"is a pipeline checkpoint (pp, dp) = {saved[:2]}, saved by a PipelineModule; "
                                    "this engine is not a pipeline engine, and reshard does not turn pipeline saves "
                                    "into plain ones")
    if (saved[0], saved[1], saved[2]) == tuple(engine_pipeline):
        return tag
    return inspect_pipeline(load_dir, tag, trust_pickle=trust_pickle)  # refuses what the offline job refuses


def _engine_layers(engine):
    """The engine's layer list as reshard.layouts.pipeline.PipelineLayers: the PipelineModule's specs
    (module.py `_layer_specs`), each TiedLayerSpec's key at the global indices where it occurs (what
    the offline job takes from --pipeline-layers and --pipeline-tied)."""
    from deepspeed.pipe import TiedLayerSpec

    from reshard.layouts.pipeline import PipelineLayers
    specs, tied = engine.module._layer_specs, {}
    for index, spec in enumerate(specs):
        if isinstance(spec, TiedLayerSpec):
            tied.setdefault(spec.key, []).append(index)
    return PipelineLayers(len(specs), {key: tuple(indices) for key, indices in tied.items()})


def _engine_stage(engine) -> tuple:
    """This rank's (stage, model rank, dp rank, param names per optimizer group, each parameter's shape,
    buffer names): stage_1_and_2.py `bit16_groups` (each group's flat order) named by the engine's
    `param_names`, engine.py `_get_buffer_names` (what DeepSpeed would save for this stage)."""
    groups = getattr(engine.optimizer, "bit16_groups", None)
    names = None if groups is None else [[engine.param_names[p] for p in group] for group in groups]
    shapes = {} if groups is None else {engine.param_names[p]: tuple(p.shape) for group in groups for p in group}
    buffers = tuple(engine._get_buffer_names()) if hasattr(engine, "_get_buffer_names") else ()
    return (int(engine.stage_id), int(engine.grid.get_slice_parallel_rank()),
            int(engine.grid.get_data_parallel_rank()), names, shapes, buffers)


def pipeline_columns_for_engine(pipe, target: Topology, stages: list, trust_pickle: bool, layers=None,
                                bounds=None) -> tuple[SourceCheckpoint, Topology]:
    """(source, target) of the save as the main road takes it (inspect_pipeline_columns), `target` with the
    engine's own stages when pp or tp changes (`Topology.stages`, collective_job.target_stages; at another tp at
    the engine's local
    shapes, with the model axis the offline job plans, collective_job.with_model_axis, by the save's rules,
    formats/deepspeed_files/pipeline_target.model_axis_plan, for the engine's `layers` (`_engine_layers`) and stage `bounds`
    (module.py `parts`)), each checked against what the engine's ranks train (`stages`: every rank's
    `_engine_stage`): the same parameters in the same param groups, of the same shapes. On worker 0."""
    from reshard.formats.deepspeed_files.deepspeed_inspect import inspect_pipeline_columns
    from reshard.formats.deepspeed_files.deepspeed_pipeline import source_groups
    from reshard.formats.deepspeed_files.pipeline_target import model_axis_plan
    from reshard.jobs.collective_job import target_stages, with_model_axis
    source = inspect_pipeline_columns(pipe.save_dir, pipe.tag, trust_pickle=trust_pickle, pipe=pipe)
    by_stage = {stage: (names, shapes, buffers) for stage, model, dp, names, shapes, buffers in stages
                if model == 0 and dp == 0}
    model_path = pipe.model_path(0)
    saved_groups, group_of = source_groups(pipe)
    for stage in range(target.pp):
        names, _, _ = by_stage[stage]
        if names is None or len(names) != saved_groups:
            raise UnsupportedCheckpoint(model_path, f"has {saved_groups} optimizer param group(s); in-job resharding "
                                                    "of pipeline checkpoints serves a ZeRO-1 engine with as many, "
                                                    f"stage {stage} of this engine has "
                                                    f"{'no ZeRO-1 optimizer' if names is None else len(names)}")
    for stage, _, _, names, _, _ in stages:
        found = next((name for group in names for name in group if name not in group_of), None)
        if found is not None:
            raise UnsupportedCheckpoint(model_path, f"holds no parameter {found}, which stage {stage} of this engine "
                                                    f"({target.pp} stages) trains: the engine's model differs from "
                                                    "the saved one")
    tp_changed = target.tp != pipe.tp
    if tp_changed and not pipe.has_model_axis:
        raise UnsupportedCheckpoint(model_path, f"was saved without a pipeline model axis (its layer files have no "
                                                f"-model_XX suffix), this engine has tp {target.tp}: there is no "
                                                "tensor slicing to change")
    rules, shapes = model_axis_plan(pipe, layers, target.tp, f"this engine's tp {target.tp}") if tp_changed \
        else (None, None)
    if target.pp != pipe.pp or tp_changed:
        target = dataclasses.replace(target, stages=target_stages(
            pipe, [[n for group in by_stage[s][0] for n in group] for s in range(target.pp)],
            [by_stage[s][2] for s in range(target.pp)], shapes=shapes, tp=target.tp))
    if tp_changed:  # the layer files re-cut in the plan, as the offline job's (collective_job.pipeline_stage_change)
        source, layer_files = with_model_axis(source, pipe, rules, layers, bounds, target.tp, trust_pickle)
        target = dataclasses.replace(target, layer_files=layer_files)
    columns = target.stages.columns if target.stages is not None else source.spec.columns
    for stage, model, _, names, shapes_here, _ in stages:
        params, groups = columns[stage * target.tp + model]
        saved = [[params[i].name for i in group] for group in groups]
        if saved != names:
            raise UnsupportedCheckpoint(model_path, f"puts stage {stage}'s parameters in param groups {saved}, this "
                                                    f"engine in {names}: the engine's model or its param groups "
                                                    "differ from the saved ones")
        for param in params:
            if tuple(param.shape) != shapes_here[param.name]:
                raise UnsupportedCheckpoint(model_path, f"holds {param.name} of shape {list(param.shape)}"
                                                        f"{f' at tp {target.tp}' if tp_changed else ''}, this "
                                                        f"engine of shape {list(shapes_here[param.name])}: the "
                                                        "engine's model differs from the saved one")
    return source, target


def _load_pipeline_columns(engine, pipe, transport, budget: int, trust_pickle: bool, kwargs: dict):
    """A PipelineModule save at another dp, pp or tp, into this PipelineEngine, through the plan and
    `execute()` as the collective job reshards it (docs/architecture.md, "One road"): the target is the
    engine's grid (pp, dp, tp) and, with another pp or tp, its own stages (every rank's optimizer groups
    gathered; with another tp the engine's layer list, `_engine_layers`, and stage bounds, module.py
    `parts`); each rank is the worker of its own target rank (reshard numbers ranks tp fastest, then
    dp, then pp, as PipeModelDataParallelTopology's axes ['pipe', 'data', 'model'] do), reads its share
    of the source ranks, and fills its stage's optimizer file in memory under `memory_budget` by rounds
    (MemoryTargetWriter). The stage's model-states file holds no tensors of the exchange (`module` None):
    each rank builds its column's from the source's as the job writes it (zero12_model_file). Layer files
    are per global layer index: at the save's tp the same at any pp and dp, so DeepSpeed reads them from
    the source; at another tp re-cut in the same plan (`Topology.layer_files`), filled on dp rank 0 of each
    (stage, model rank) and sent to its other dp ranks (`_share_layer_files`)."""
    from reshard.formats.deepspeed_files.deepspeed_target import zero12_model_file
    pp, dp, tp = _engine_pipeline(engine)
    target = Topology(dp=dp, tp=tp, pp=pp)
    here = _engine_stage(engine)
    stage, model_rank, dp_rank = here[:3]
    rank = target.rank_of(dp_rank, model_rank, stage)
    if transport.size != target.world_size or transport.rank != rank:
        raise ReshardError(f"in-job resharding of a pipeline checkpoint: rank {transport.rank} of {transport.size} is "
                           f"this engine's stage {stage}, model rank {model_rank}, dp rank {dp_rank}, which reshard "
                           f"numbers {rank} of {target.world_size} (tp fastest, then dp, then pp, as DeepSpeed's "
                           "pipeline grid); a job with another rank order must reshard offline")
    stages = transport.all_gather_object(here)
    started = time.perf_counter()
    layers, bounds = (_engine_layers(engine), tuple(int(b) for b in engine.module.parts)) if tp != pipe.tp \
        else (None, None)
    source, target = on_rank0(transport, lambda: pipeline_columns_for_engine(pipe, target, stages, trust_pickle,
                                                                             layers, bounds))
    plan = plan_reshard(source.spec, target, transport.size, budget)
    objects = _reshard_in_memory(source, target, plan, transport, trust_pickle)
    column = target.rank_of(0, model_rank, stage)
    model_file = zero12_model_file(source, target, column)
    model = objects.get((column, model_file.name))
    if model is None:  # dp rank > 0: the column's file, built here (it holds no exchanged tensors)
        model = MemoryTargetWriter(source, target, []).build(source, column, model_file)
    layer_files = _share_layer_files(target, objects, transport) if target.layer_files is not None else {}
    root = tempfile.mkdtemp(prefix="reshard-injob-")
    try:
        tag_dir = os.path.join(root, source.tag)
        os.makedirs(tag_dir)
        # engine.py `_get_all_ckpt_names` globs every stage's mp_rank_XX file and state_dict_factory.py
        # `check_ckpt_list` reads `mp_world_size` from the first: the other columns' names serve a stub
        served = {os.path.join(tag_dir, schema.model_file_name_of(target, target.rank_of(0, m, s), 1)):
                  {"mp_world_size": pp * tp} for s in range(pp) for m in range(tp)}
        served[os.path.join(tag_dir, model_file.name)] = classes.to_deepspeed(model)
        optim_name = schema.optim_file_name_of(target, rank, source.spec.bf16_prefix)
        served[os.path.join(tag_dir, optim_name)] = classes.to_deepspeed(objects[(rank, optim_name)])
        # module.py `load_state_dir` globs `layer_XX-*model_states.pt` and, with as many files as model ranks,
        # loads this model rank's entry of the sorted list (state_dict_factory.py `check_ckpt_list` reads only
        # whether the first holds `mp_world_size`): every model rank's name is served, the others' empty
        for index, obj in layer_files.items():
            for m in range(tp):
                served[os.path.join(tag_dir, schema.layer_file_name(index, m))] = \
                    classes.to_deepspeed(obj) if m == model_rank else {}
        redirected = {os.path.join(tag_dir, name): os.path.join(source.tag_dir, name) for name in source.other_files}
        load_path, client_state = _load_with_served_files(engine, root, source.tag, served, redirected, kwargs)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if transport.rank == 0:
        print(f"reshard: resharded {source.tag_dir} from {source.spec.topology.describe()} to {target.describe()} "
              f"in-job in {plan.rounds} round(s) in {time.perf_counter() - started:.2f} s", flush=True)
    return _as_source_path(source, load_path), client_state


def _share_layer_files(target: Topology, objects: dict, transport) -> dict:
    """This rank's stage's layer files at its model rank ({layer index: object}), under a pipeline tp change: the
    plan fills them on dp rank 0 of each (stage, model rank) (deepspeed_target.pipeline_layer_files, as
    DeepSpeed's save writes them there), every dp rank of that column loads them, so its dp rank 0 sends
    each to that column's other dp ranks (`share_file`)."""
    here = target.coordinates(transport.rank)
    mine = {}
    for s in range(target.pp):
        for m in range(target.tp):
            owner = target.rank_of(0, m, s)
            column = [target.rank_of(d, m, s) for d in range(target.dp)]
            for index, _, stage, _ in target.layer_files.templates:
                if stage == s:
                    obj = share_file(transport, objects, (owner, schema.layer_file_name(index, m)), owner, column)
                    if (here.pp, here.tp) == (s, m):
                        mine[index] = obj
    return mine


def _zero0_moe_source(load_dir: str, tag: str | None, trust_pickle: bool):
    """The ZeRO-0 MoE checkpoint in `load_dir` as the planner takes it
    (reshard.formats.deepspeed_files.deepspeed_zero0_moe.inspect_zero0_moe_checkpoint: pickles only), else None."""
    from reshard.formats.deepspeed_files.deepspeed_inspect import resolve_tag
    from reshard.formats.deepspeed_files.deepspeed_zero0_moe import inspect_zero0_moe_checkpoint, is_zero0_moe
    tag = resolve_tag(os.path.abspath(load_dir), tag)
    if not is_zero0_moe(os.path.join(load_dir, tag)):
        return None
    return inspect_zero0_moe_checkpoint(load_dir, tag, trust_pickle=trust_pickle)


def zero0_in_job_ownership(source_ep: int, target: Topology, workers: int) -> Ownership:
    """Who reads and writes what in an in-job ZeRO-0 MoE load (plan_zero0_moe's ranks): source EP rank e
    read in contiguous blocks; target EP rank e's `expp_rank_{e}` written by the first job rank of that
    EP rank (its other ranks receive it); the model-states file (target rank target.ep) by the last job
    rank that writes nothing else, else rank 0 (every rank receives it)."""
    readers = [e * workers // source_ep for e in range(source_ep)]
    writers = [next(r for r in range(workers) if target.expert_parallel_rank(r) == e) for e in range(target.ep)]
    spare = [r for r in range(workers) if r not in writers]
    return Ownership.from_tables(readers, writers + [spare[-1] if spare else 0], workers)


def _load_zero0_moe(engine, source, transport, budget: int, trust_pickle: bool, kwargs: dict):
    """A ZeRO-0 MoE checkpoint: DeepSpeed loads it at any dp as it is; at another ep through the plan and
    `execute()` as the collective job reshards it (formats/deepspeed_files/deepspeed_zero0_moe.Zero0Moe): each file the
    engine reads at the target ep (every EP rank's `expp_rank_{e}`, the model states holding EP rank 0's
    optimizer) is filled in memory under `memory_budget` by rounds on one rank (`zero0_in_job_ownership`)
    and sent to the ranks that load it alone (`share_file`); DeepSpeed's load reads them from there."""
    from reshard.formats.deepspeed_files.deepspeed_zero0_moe import MODEL, Zero0Moe, expp_file_name
    target = _engine_topology(engine)
    problem = source.expert_problem(target)
    if target.tp != 1 or problem:
        raise UnsupportedCheckpoint(source.model_path(), f"cannot be loaded by this engine ({target}): "
                                                         f"{problem or 'ZeRO-0 MoE with tensor parallelism'}")
    if target.ep == source.spec.topology.ep:
        return engine.load_checkpoint(source.save_dir, source.tag, **kwargs)
    started = time.perf_counter()
    zero0 = Zero0Moe(trust_pickle=trust_pickle)
    own = zero0_in_job_ownership(source.spec.topology.ep, target, transport.size)
    plan = zero0.plan(source, target, transport.size, budget, own)
    objects = execute(plan, transport,
                      open_source=lambda: SourceReader.open(source, own.source_ranks_of(transport.rank), target=target,
                                                            trust_pickle=trust_pickle, extra_slots=zero0.source_slots),
                      open_sink=lambda: MemoryTargetWriter(source, target, own.target_ranks_of(transport.rank),
                                                           files=zero0.files),
                      opening="opening source files", finish=lambda reader, writer: writer.objects)
    ep_rank = target.expert_parallel_rank(transport.rank)
    optimizer = None
    for e in range(target.ep):
        loaders = [r for r in range(transport.size) if target.expert_parallel_rank(r) == e]
        obj = share_file(transport, objects, (e, expp_file_name(e)), own.writer(e), loaders)
        if e == ep_rank:
            optimizer = obj
    model = share_file(transport, objects, (target.ep, MODEL), own.writer(target.ep), range(transport.size))
    del objects
    root = tempfile.mkdtemp(prefix="reshard-injob-")
    try:
        tag_dir = os.path.join(root, source.tag)
        os.makedirs(tag_dir)
        served = {os.path.join(tag_dir, MODEL): classes.to_deepspeed(model),
                  os.path.join(tag_dir, expp_file_name(ep_rank)): classes.to_deepspeed(optimizer)}
        # expert files are named by global expert id, the same at any ep: DeepSpeed reads its own from the source
        redirected = {os.path.join(tag_dir, name): os.path.join(source.tag_dir, name)
                      for name in source.other_files if schema.expert_file_index(name)}
        load_path, client_state = _load_with_served_files(engine, root, source.tag, served, redirected, kwargs)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if transport.rank == 0:
        print(f"reshard: resharded {source.tag_dir} from {source.spec.topology.describe()} to {target.describe()} "
              f"in-job in {plan.rounds} round(s) in {time.perf_counter() - started:.2f} s", flush=True)
    return _as_source_path(source, load_path), client_state


def _reshard_in_memory(source: SourceCheckpoint, target: Topology, plan, transport, trust_pickle: bool) -> dict:
    own = plan.ownership
    return execute(plan, transport,
                   open_source=lambda: SourceReader.open(source, own.source_ranks_of(transport.rank), target=target,
                                                         trust_pickle=trust_pickle),
                   open_sink=lambda: MemoryTargetWriter(source, target, own.target_ranks_of(transport.rank)),
                   opening="opening source files", finish=lambda reader, writer: writer.objects)


def _share_model_states(source: SourceCheckpoint, target: Topology, ownership, objects: dict, transport) -> None:
    """Under AutoTP ZeRO-1/2 the plan fills TP rank t's model states for target rank (dp 0, tp t),
    on the worker that writes that rank (in-job: worker r writes target rank r); every dp rank of
    TP rank t loads that file, which `share_file` sends to them alone."""
    here = target.coordinates(transport.rank)
    for t in range(target.tp):
        rank = target.rank_of(0, t)
        name = schema.model_file_name_of(target, rank, source.spec.stage)
        loaders = [target.rank_of(d, t) for d in range(target.dp)]
        obj = share_file(transport, objects, (rank, name), ownership.writer(rank), loaders)
        if here.tp == t and (transport.rank, name) not in objects:
            objects[(transport.rank, name)] = obj


def share_file(transport, objects: dict, key, owner: int, loaders) -> object | None:
    """The in-memory file `objects[key]`, built on worker `owner`, on each worker of `loaders` (the ranks
    whose DeepSpeed load reads it): sent point to point, pickled, to each loader but the owner, and to no
    other worker (TorchDistributedTransport.send_object; a broadcast would pickle it to the whole group).
    Returns the file on the owner and the loaders, None elsewhere. Every worker calls it for the same keys in
    the same order, so each send meets its receive and no two wait on each other."""
    if transport.rank == owner:
        obj = objects[key]
        for rank in loaders:
            if rank != owner:
                transport.send_object(obj, rank)
        return obj
    return transport.recv_object(owner) if transport.rank in loaders else None


def _load_served(engine, source: SourceCheckpoint, target: Topology, objects: dict, rank: int, kwargs: dict):
    spec = source.spec
    placeholder_root = tempfile.mkdtemp(prefix="reshard-injob-")
    try:
        tag_dir = os.path.join(placeholder_root, source.tag)
        os.makedirs(tag_dir)
        served = {}
        for (_, name), obj in objects.items():
            served[os.path.join(tag_dir, name)] = classes.to_deepspeed(obj)
        if spec.stage < 3 and spec.tensor is None:
            name = schema.model_file_name(spec.stage)
            served[os.path.join(tag_dir, name)] = _zero12_model_states(source, target)
        if spec.tensor is not None:
            # engine.py `_get_all_ckpt_names` globs mp_rank_* (ZeRO-3: zero_pp_rank_{dp}_mp_rank_*),
            # and state_dict_factory.py `check_ckpt_list` reads `mp_world_size` from the first: the
            # other TP ranks' names serve a stub holding only that (no `module`: loading one would
            # fail loudly)
            dp_rank = target.coordinates(rank).dp if spec.stage == 3 else 0
            for t in range(target.tp):
                path = os.path.join(tag_dir, schema.model_file_name_of(target, target.rank_of(dp_rank, t), spec.stage))
                served.setdefault(path, {"mp_world_size": target.tp})
        # MoE expert files are named by global expert id, the same at any (dp, ep): each rank
        # reads its own experts from the source, as DeepSpeed's `load_moe_state_dict` picks them.
        redirected = {os.path.join(tag_dir, name): os.path.join(source.tag_dir, name)
                      for name in source.other_files if schema.expert_file_index(name)}
        if rewrites_expert_files(source):  # AutoEP with AutoTP layers: TP rank and folding per file
            for name in target_expert_files(source, target):
                served[os.path.join(tag_dir, name)] = expert_file_state(source, target, name)
        load_path, client_state = _load_with_served_files(engine, placeholder_root, source.tag, served, redirected, kwargs)
        return _as_source_path(source, load_path), client_state
    finally:
        shutil.rmtree(placeholder_root, ignore_errors=True)


def _as_source_path(source: SourceCheckpoint, load_path: str | None) -> str | None:
    """The path DeepSpeed reports, named in the source directory the caller asked to load."""
    return None if load_path is None else os.path.join(source.tag_dir, os.path.basename(load_path))


def _zero12_model_states(source: SourceCheckpoint, target: Topology) -> dict:
    """The ZeRO-1/2 model-states file at the target size: the source file, metadata recomputed."""
    from reshard.formats.deepspeed_files.deepspeed_target import zero12_model_tree
    # the training process's allowlist stays as it was (load_checked scopes it)
    states = classes.to_deepspeed(load_checked(source.model_path(0), schema.safe_globals()))
    recomputed = zero12_model_tree(source, source.spec.layout(target))
    states["param_shapes"] = recomputed["param_shapes"]
    states["dp_world_size"] = recomputed["dp_world_size"]
    return states


def _load_through_staging(engine, source: SourceCheckpoint, transport, budget: int, trust_pickle: bool,
                          staging_dir: str | None, kwargs: dict):
    """Reshard into a temporary directory (never inside the source), load it, remove it."""
    import socket

    from reshard.jobs.collective_job import reshard_checkpoint
    hosts = set(transport.all_gather_object(socket.gethostname()))
    if staging_dir is None and len(hosts) > 1:
        raise ReshardError("ZeRO-3 with load_optimizer_states=False reshards through disk: pass staging_dir=, a "
                           f"directory all {len(hosts)} hosts can see")
    root = None
    if transport.rank == 0:
        root = tempfile.mkdtemp(prefix="reshard-injob-staging-", dir=staging_dir)
    root = transport.broadcast_object(root)
    try:
        destination = os.path.join(root, "checkpoint")
        reshard_checkpoint(source.save_dir, destination, _data_parallel_size(engine), tag=source.tag,
                           target_tp=_engine_topology(engine).tp if source.spec.tensor is not None else None,
                           memory_budget=budget, quiet=True, trust_pickle=trust_pickle, transport=transport)
        load_path, client_state = engine.load_checkpoint(destination, source.tag, **kwargs)
        transport.barrier()
        return _as_source_path(source, load_path), client_state
    finally:
        if transport.rank == 0:
            shutil.rmtree(root, ignore_errors=True)
