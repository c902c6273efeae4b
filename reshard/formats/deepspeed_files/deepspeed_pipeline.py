"""DeepSpeed PipelineModule checkpoints (ZeRO-1), with or without a model axis: what a tag holds, checked.

    from reshard.formats.deepspeed_files.deepspeed_pipeline import is_pipeline, inspect_pipeline
    if is_pipeline(tag_dir):
        source = inspect_pipeline(save_dir, tag)           # PipelineSource: pp, dp, stages, layer files

The files are resharded on the main road (docs/architecture.md "One road"): each (stage, model rank)
column lowered to pieces (reshard.formats.deepspeed_files.deepspeed_inspect.inspect_pipeline_columns,
reshard.jobs.collective_job.pipeline_stage_change); this module keeps the verified file facts.

Files of a pipeline save (DeepSpeed 0.19.8, runtime/pipe/module.py `ckpt_layer_path`,
`save_state_dict`; runtime/engine.py `_get_ckpt_name`, `_save_checkpoint`):

    layer_{idx:02d}-model_states.pt          one per layer object with a state_dict, idx GLOBAL;
                                             a `-model_{tp:02d}` suffix only with a model axis
    mp_rank_{s:02d}_model_states.pt          one per stage s (the grid's model-parallel rank is the
                                             stage when there is no model axis): `module` None,
                                             `param_shapes` of the stage, dp/mp_world_size,
                                             checkpoint_parallel_dimensions {pp_degree, tp_degree}
    [bf16_]zero_pp_rank_{d}_mp_rank_{s:02d}_optim_states.pt
                                             ZeRO-1 partition of dp rank d over stage s's parameters

With a model (tensor-slicing) axis, `PipelineModule(..., topology=PipeModelDataParallelTopology(
num_pp, num_mp, num_dp))` (runtime/pipe/topology.py; axes (pipe, data, model), model fastest), checked
on a real (pp, tp, dp) = (2, 2, 1) save of DeepSpeed 0.19.8 on CPU:

    layer_{idx:02d}-model_{m:02d}-model_states.pt
                                             layer idx of model rank m (module.py `ckpt_layer_path`:
                                             `topology.get_rank_repr`, which omits data and pipe, so
                                             at tp 1 too: `-model_00`, `PipelineSource.model_axis`);
                                             written by dp rank 0 of the rank holding (stage, m)
                                             (`save_state_dict`), a replicated layer once per m
    mp_rank_{s * tp + m:02d}_model_states.pt one per (stage s, model rank m): the grid's
                                             model-parallel rank (topology.py `PipelineParallelGrid`
                                             `get_model_parallel_rank`, reshard.layouts.pipeline.
                                             `stage_model_rank`), written by dp rank 0 (engine.py
                                             `save_non_zero_checkpoint`); mp_world_size = pp * tp,
                                             checkpoint_parallel_dimensions {pp_degree: pp,
                                             tp_degree: tp} (engine.py `_checkpoint_parallel_metadata`)
    [bf16_]zero_pp_rank_{d}_mp_rank_{s * tp + m:02d}_optim_states.pt
                                             ZeRO-1 partition of dp rank d over (s, m)'s parameters
                                             (engine.py `_get_zero_ckpt_name`)

Each model rank's stages hold the same parameter names and, for Megatron-style even slices, the same
shapes; the values differ. DeepSpeed loads layer files by position, not name: module.py
`load_state_dir` globs `layer_{idx:02d}-*model_states.pt`, sorts them and takes the model rank's
entry (state_dict_factory.py `SDLoaderBase.load` with is_pipe_parallel) when their count equals the
model-parallel size. So each model rank's column of stages is a pipeline of its own: changing pp or
dp with tp kept is that change applied per column, the layer files keeping their names.

Changing tp (reslicing): which dim each parameter is sliced on is not in the files but in the
`universal_checkpoint_info` patterns a script saves as client state (Megatron-DeepSpeed does), the
same in every stage file; reshard.layouts.model_axis reads them as ds_to_universal.py
`merge_tp_slices` does (replicated, row on dim 1, vocabulary, two fused sub-parameters, the rest on
dim 0) and refuses what it cannot serve by name: no patterns at all (without them ds_to_universal
joins every parameter on dim 0: on the (2, 2, 1) "-mp2" test save, whose info is empty, a
row-parallel [24, 21] weight came out [48, 21], the replicated [37, 24] embedding [74, 24]), averaged
parameters whose ranks differ, a padded vocabulary, fused sub-parameter views, an affine map, and a
target tp that does not cut a sliced dim evenly. The main road lowers every model rank's slice onto
the whole parameter (reshard.layouts.tensor_pieces.pipeline_model_axis_pieces) and writes each target
(stage, model rank) at the target's local shapes (`param_shapes`, mp_world_size pp * tp,
checkpoint_parallel_dimensions tp_degree; universal_checkpoint_info and the rest of client_state
carried). Since DeepSpeed's `parameters` partition weighs local (sliced) parameter counts, the stages
are re-assigned with the target's (reshard.formats.deepspeed_files.pipeline_target). Every layer file's tensors
(weights in the training dtype, buffers, frozen parameters; by their stage names) are re-cut by the
same rule in the same plan (`pipeline_model_axis`, reshard.layouts.model_axis.LayerFileSpace) under
the target's `-model_XX` names; a replicated one is read from model rank 0.

Each stage is its own data-parallel group: its optimizer files are an ordinary ZeRO-1 save over
the stage's parameters (a tied module's parameters sit in every stage holding it, named
`tied_modules.<key>.<param>`). With the number of stages unchanged, a new dp is therefore a
ZeRO-1 re-cut per stage, with the layer files unchanged.

Changing the number of stages needs what the checkpoint does not record: the layer count
(trailing layers without a state_dict, and a TiedLayerSpec with a `forward_fn`, leave no file) and
the positions of the tied layers; the caller gives them (reshard.layouts.pipeline.PipelineLayers),
they are checked against the source's own stage assignment, and each target stage is one ZeRO-1
flat per optimizer param group (a parameter keeps its group; the group's hyperparameters
and scalar state come from the source), and the stage's `buffer_names` recomputed for its layers
(the buffers themselves travel in the layer files). Shared parameters (`shared_params`, one
tensor under two names inside the model, not a TiedLayerSpec) are refused with a pp change.
"""
from __future__ import annotations

import bisect
import os
import re
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass, field

from reshard.errors import CheckpointError, UnsupportedCheckpoint
from reshard.files.paths import write_named_file
from reshard.formats.deepspeed_files import deepspeed_classes as classes
from reshard.formats.deepspeed_files import deepspeed_schema as schema
from reshard.formats.torch_bytes.torch_archive import load_checked, load_portable
from reshard.layouts.pipeline import assign_stages, split_by_group, stage_model_rank
from reshard.layouts.zero import Zero12Group, zero12_group

LAYER_RE = re.compile(r"^layer_(\d+)(-model_(\d+))?-model_states\.pt$")
STAGE_MODEL_RE = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")
OPTIM = schema.OPTIM
BASE = "base_optimizer_state"
FP32 = "single_partition_of_fp32_groups"


def is_pipeline(tag_dir: str) -> bool:
    """Whether the tag directory holds pipeline layer files (`layer_XX-...model_states.pt`)."""
    return os.path.isdir(tag_dir) and any(LAYER_RE.match(name) for name in os.listdir(tag_dir))


def saved_pipeline_topology(tag_dir: str) -> tuple[int, int, int]:
    """(pp, dp, tp) of a pipeline save from its file names alone: the model ranks of the layer files'
    `-model_XX` suffixes, the stage model-states files (one per stage and model rank), and the
    optimizer files of the first (stage 0, model rank 0) (no pickle is read)."""
    return pipeline_topology_of(os.listdir(tag_dir))


def pipeline_topology_of(names) -> tuple[int, int, int]:
    """saved_pipeline_topology from a tag directory's file names (a node-local job's union of what
    every node sees)."""
    tp = len({match[3] for name in names if (match := LAYER_RE.match(name))} - {None}) or 1
    files = sum(1 for name in names if STAGE_MODEL_RE.match(name))
    dp = sum(1 for name in names if (role := schema.classify(name)).kind == "optim" and role.mp_rank == 0)
    return files // tp, dp, tp


@dataclass(frozen=True)
class PipelineStage:
    """One pipeline stage's ZeRO-1 layout, from its model-states file."""

    index: int
    names: tuple[tuple[str, ...], ...]
    """Per optimizer param group, the stage's trainable parameter names in flat order."""
    numels: tuple[tuple[int, ...], ...]
    """Per group, the element count of each named parameter."""
    shapes: tuple[tuple[tuple[int, ...], ...], ...] = ()
    """Per group, each named parameter's shape (`param_shapes`)."""
    buffer_names: tuple[str, ...] = ()
    shared_params: tuple[str, ...] = ()


@dataclass(frozen=True)
class PipelineSource:
    """What a pipeline tag directory holds."""

    save_dir: str
    tag: str
    pp: int
    dp: int
    bf16: bool
    bf16_optimizer: bool
    """BF16_Optimizer files (no `zero_stage`; fp32 partitions saved with their padding)."""
    stages: tuple[PipelineStage, ...]
    """Per stage, its layout; with a model axis, model rank 0's (every model rank's is the same)."""
    layer_files: tuple[str, ...]
    other_files: tuple[str, ...]
    """Files copied as they are besides the layer files (none known today; kept for safety)."""
    tp: int = 1
    """Model (tensor-slicing) ranks of PipeModelDataParallelTopology; 1 without a model axis."""
    model_axis: bool = False
    """The layer files carry a `-model_XX` suffix: saved with PipeModelDataParallelTopology, which
    DeepSpeed names so at tp 1 too (topology.py `get_rank_repr` keeps the model axis: `model_00`)."""
    ds_config: dict | None = field(default=None, compare=False)
    """Stage 0's saved `ds_config` (the training job's batch settings, which the target must fit)."""
    layer_table: dict | None = field(default=None, compare=False, repr=False)
    """Every layer file's layer_entries, gathered from the nodes that hold them (a node-local job, where
    no worker sees every layer file); None: read from `tag_dir` when asked."""
    trees: dict | None = field(default=None, compare=False, repr=False)
    """{file name: portable tree} of every stage model-states file and model rank 0's layer files, gathered
    from the nodes that hold them (a node-local tp change: `saved_model_axis_info`, `check_layer_files_cut`
    and `pipeline_model_axis` read them); None: read from `tag_dir` when asked."""

    def tree(self, name: str, trust_pickle: bool = False, whole: bool = False):
        """The tree of file `name` of the tag directory: the gathered one (`trees`), else read here, as
        torch loads it (`whole`: load_whole) or portable (torch_archive.load_portable)."""
        if self.trees is not None:
            if name not in self.trees:
                raise CheckpointError(os.path.join(self.tag_dir, name), "was not gathered from the nodes")
            return self.trees[name]
        path = os.path.join(self.tag_dir, name)
        if whole:
            return load_whole(path, trust_pickle)
        return load_portable(path, schema.safe_globals(), trust_pickle)

    @property
    def tag_dir(self) -> str:
        return os.path.join(self.save_dir, self.tag)

    @property
    def has_model_axis(self) -> bool:
        """Saved with PipeModelDataParallelTopology: tp > 1, or `-model_00` layer files at tp 1."""
        return self.tp > 1 or self.model_axis

    def model_path(self, stage: int = 0, model: int = 0) -> str:
        return os.path.join(self.tag_dir, stage_model_name(stage, model, self.tp))

    def optim_path(self, stage: int, dp_rank: int, model: int = 0) -> str:
        return os.path.join(self.tag_dir, schema.optim_file_name(dp_rank, self.bf16,
                                                                 stage_model_rank(stage, model, self.tp)))

    def describe(self) -> str:
        optimizer = "BF16_Optimizer" if self.bf16_optimizer else "ZeRO-1"
        params = sum(len(group) for stage in self.stages for group in stage.names)
        axis = f" tp={self.tp} (model axis)" if self.has_model_axis else ""
        return (f"pipeline pp={self.pp} dp={self.dp}{axis}, {optimizer}{' bf16' if self.bf16 else ''}, "
                f"{len(self.layer_files)} layer files, {params} stage parameters" + (" per model rank" if axis else ""))


def stage_model_name(stage: int, model: int = 0, tp: int = 1) -> str:
    """The model-states file of (stage, model rank) with `tp` model ranks (stage_model_rank)."""
    return f"mp_rank_{stage_model_rank(stage, model, tp):02d}_model_states.pt"


def load_whole(path: str, trust_pickle: bool = False):
    """A DeepSpeed file as torch loads it (memory-mapped), with reshard's stand-ins for DeepSpeed's
    classes, through the checked reader (torch_archive.load_checked: the archive as torch.save writes
    it, no overlapping views), the process's allowlist left as it was."""
    return load_checked(path, schema.safe_globals(), trust_pickle)


def inspect_pipeline(save_dir: str, tag: str, trust_pickle: bool = False, layer_shapes: bool = True) -> PipelineSource:
    """Read the model-states file of every (stage, model rank) and its optimizer files; refuse by
    name what the per-stage ZeRO-1 re-cut does not handle, and any optimizer file whose partitions
    are not those the stage's `param_shapes` give (check_stage_partitions), and, with `layer_shapes`
    (all but `reshard verify`'s look at an output, which compares its layer files with the source's),
    `param_shapes` that the layer files do not hold. The same checks as a node-local job makes column
    by column where each column's files are (pipeline_files, inspect_pipeline_column, gathered_pipeline)."""
    tag_dir = os.path.join(save_dir, tag)
    names = sorted(name for name in os.listdir(tag_dir)
                   if not name.startswith(".") and not os.path.isdir(os.path.join(tag_dir, name)))
    stage_models = {int(m[1]) for name in names if (m := STAGE_MODEL_RE.match(name))}
    optim_mp_ranks = {role.mp_rank for name in names if (role := schema.classify(name)).kind == "optim"}
    check_stage_model_files(tag_dir, stage_models, optim_mp_ranks)
    first = load_whole(os.path.join(tag_dir, stage_model_name(0)), trust_pickle)
    files = pipeline_files(tag_dir, names, int((first.get("checkpoint_parallel_dimensions") or {}).get("tp_degree", 1)))
    cache: dict[str, dict | None] = {}

    def layer(name: str) -> dict | None:
        if name not in cache:
            path = os.path.join(tag_dir, name)
            cache[name] = layer_entries(path, trust_pickle) if os.path.isfile(path) else None
        return cache[name]

    columns = [inspect_pipeline_column(files, stage, model_rank, trust_pickle, first if stage == model_rank == 0 else None,
                                       layer if layer_shapes else None)
               for stage in range(files.pp) for model_rank in range(files.tp)]
    return gathered_pipeline(save_dir, tag, files, columns)


@dataclass(frozen=True)
class PipelineFiles:
    """What a pipeline tag directory's file names say (a node-local job: the union of what every node sees)."""

    tag_dir: str
    layer_files: tuple[str, ...]
    stage_models: frozenset[int]
    optims: frozenset[tuple[int, int]]
    """(mp rank, dp rank) of every optimizer file."""
    other_files: tuple[str, ...]
    tp: int
    pp: int
    model_axis: bool
    bf16: bool


def pipeline_files(tag_dir: str, names: Collection[str], tp: int) -> PipelineFiles:
    """The file-name facts of a pipeline save with `tp` model ranks (stage 0's tp_degree), refused by name
    where the names disagree with it. Pure. (check_stage_model_files first, by the caller.)"""
    layer_files, layer_models, stage_models, optims, others = [], {}, set(), set(), []
    for name in sorted(names):
        if match := LAYER_RE.match(name):
            layer_files.append(name)
            layer_models.setdefault(int(match[1]), {})[None if match[3] is None else int(match[3])] = name
        elif match := STAGE_MODEL_RE.match(name):
            stage_models.add(int(match[1]))
        elif (role := schema.classify(name)).kind == "optim":
            optims.add((role.mp_rank, role.dp_rank))
        else:
            others.append(name)
    model_axis = _check_layer_models(tag_dir, layer_models, tp)
    if len(stage_models) % tp:
        raise CheckpointError(tag_dir, f"has {len(stage_models)} stage model files, not a multiple of tp_degree {tp}")
    bf16_flags = {schema.classify(name).bf16 for name in names if schema.classify(name).kind == "optim"}
    if len(bf16_flags) > 1:
        raise CheckpointError(tag_dir, "holds optimizer files with and without the bf16_ prefix")
    return PipelineFiles(tag_dir, tuple(layer_files), frozenset(stage_models), frozenset(optims), tuple(others), tp,
                         len(stage_models) // tp, model_axis, bf16_flags.pop() if bf16_flags else False)


@dataclass(frozen=True)
class PipelineColumn:
    """One (stage, model rank)'s facts, from its model-states file and its optimizer files."""

    stage: PipelineStage
    model_rank: int
    dp: int
    bf16_optimizer: bool
    keys: tuple
    """Per param group, dp rank 0's partitioned state keys (every dp rank's must be these)."""
    ds_config: dict | None
    model_path: str


def inspect_pipeline_column(files: PipelineFiles, stage: int, model_rank: int, trust_pickle: bool = False,
                            model: dict | None = None, layer=None, optim_ranks: Collection[int] | None = None
                            ) -> PipelineColumn:
    """Read and check one (stage, model rank): its model-states file (`model`: already read), its dp rank 0
    optimizer file and those of `optim_ranks` (None: every dp rank), and, given `layer(name)` (a layer
    file's layer_entries, None when missing), its `param_shapes` against the layer files."""
    tag_dir, tp, pp = files.tag_dir, files.tp, files.pp
    index = stage_model_rank(stage, model_rank, tp)
    model_path = os.path.join(tag_dir, stage_model_name(stage, model_rank, tp))
    model = load_whole(model_path, trust_pickle) if model is None else model
    dims = model.get("checkpoint_parallel_dimensions") or {}
    if dims.get("tp_degree", 1) != tp:
        raise CheckpointError(model_path, f"has tp_degree {dims.get('tp_degree', 1)}, "
                                          f"{stage_model_name(0)} has {tp}")
    if dims.get("pp_degree", pp) != pp or model.get("mp_world_size") != pp * tp:
        raise CheckpointError(model_path, f"says pp_degree {dims.get('pp_degree')} and mp_world_size "
                                          f"{model.get('mp_world_size')}, but {len(files.stage_models)} stage files "
                                          f"of tp_degree {tp} are present")
    _check_stage_model(model, model_path)
    dp = model.get("dp_world_size")
    missing = [d for d in range(dp) if (index, d) not in files.optims]
    if missing:
        raise CheckpointError(os.path.join(tag_dir, schema.optim_file_name(missing[0], files.bf16, index)),
                              f"is missing: dp_world_size is {dp}, so each stage has {dp} optimizer files")
    optim_path = os.path.join(tag_dir, schema.optim_file_name(0, files.bf16, index))
    first_osd = _osd(load_whole(optim_path, trust_pickle), optim_path)
    bf16_optimizer = _check_optimizer(first_osd, optim_path, model, dp)
    groups = [list(shapes.items()) for shapes in model["param_shapes"]]
    spec = PipelineStage(stage, tuple(tuple(n for n, _ in g) for g in groups),
                         tuple(tuple(_numel(s) for _, s in g) for g in groups),
                         tuple(tuple(tuple(int(x) for x in s) for _, s in g) for g in groups),
                         tuple(model.get("buffer_names") or ()), tuple(model.get("shared_params") or ()))
    # every optimizer file's partitions against the stage's param_shapes, and those against the
    # layer files, before anything is built from them (the ZeRO road checks the same)
    keys = check_stage_partitions(first_osd, optim_path, spec, dp, 0)
    for rank in sorted(set(range(1, dp) if optim_ranks is None else optim_ranks) - {0}):
        check_stage_optim_file(files, spec, index, dp, rank, keys, trust_pickle)
    if layer is not None:
        _check_param_shapes_against_layers(files, spec, model_path, model_rank if files.model_axis else None, layer)
    return PipelineColumn(spec, model_rank, dp, bf16_optimizer, tuple(map(tuple, keys)), model.get("ds_config"),
                          model_path)


def check_stage_optim_file(files: PipelineFiles, spec: PipelineStage, index: int, dp: int, rank: int, keys,
                           trust_pickle: bool = False) -> None:
    """Dp rank `rank`'s optimizer file of mp index `index` against its stage (check_stage_partitions)."""
    path = os.path.join(files.tag_dir, schema.optim_file_name(rank, files.bf16, index))
    check_stage_partitions(_osd(load_whole(path, trust_pickle), path), path, spec, dp, rank, keys)


def gathered_pipeline(save_dir: str, tag: str, files: PipelineFiles, columns: Sequence[PipelineColumn],
                      layer_table: dict | None = None) -> PipelineSource:
    """The PipelineSource of the columns (stage-major, model rank fastest), checked against each other.
    `layer_table`: every layer file's layer_entries, when gathered from the nodes that hold them."""
    tag_dir, tp, pp = files.tag_dir, files.tp, files.pp
    stages, dp, bf16_optimizer = [], None, None
    for column in columns:
        dp = column.dp if dp is None else dp
        if column.dp != dp:
            raise CheckpointError(column.model_path, f"has dp_world_size {column.dp}, stage 0 has {dp}")
        if bf16_optimizer is not None and column.bf16_optimizer != bf16_optimizer:
            raise CheckpointError(column.model_path, "stages were saved by different optimizer wrappers")
        bf16_optimizer = column.bf16_optimizer
        spec = column.stage
        if column.model_rank == 0:
            stages.append(spec)
        elif (spec.names, spec.shapes, spec.buffer_names) != (stages[-1].names, stages[-1].shapes,
                                                              stages[-1].buffer_names):
            # the per-column path reuses model rank 0's layout (stage assignment, budget, groups)
            raise UnsupportedCheckpoint(column.model_path, f"holds other parameters, shapes or buffers than model "
                                                           f"rank 0 of stage {spec.index} "
                                                           f"({stage_model_name(spec.index, 0, tp)}); "
                                                           "only even (Megatron-style) slices are supported")
    extra = sorted(key for key in files.optims if key[0] >= pp * tp or key[1] >= dp)
    if extra:
        raise CheckpointError(os.path.join(tag_dir, schema.optim_file_name(extra[0][1], files.bf16, extra[0][0])),
                              f"should not exist: the save has {pp * tp} stage files of {dp} dp ranks")
    return PipelineSource(save_dir, tag, pp, dp, files.bf16, bool(bf16_optimizer), tuple(stages), files.layer_files,
                          files.other_files, tp, files.model_axis, columns[0].ds_config, layer_table)


def layer_entries(path: str, trust_pickle: bool = False) -> dict:
    """A layer file's state_dict as {key: (shape or None, element count or None)}: a tensor's shape
    (None for a value that is no tensor) and `numel` (None without one). What the layer checks and
    frozen_numels ask of a layer file; small, so a node-local job gathers it from the node that holds it."""
    state = load_whole(path, trust_pickle)
    if not isinstance(state, dict):
        raise CheckpointError(path, "does not hold a layer's state_dict")
    return {str(key): (tuple(int(d) for d in value.shape) if schema.tensor_layout(value) is not None else None,
                       int(value.numel()) if hasattr(value, "numel") else None)
            for key, value in state.items()}


def check_stage_model_files(tag_dir: str, stage_models: set[int], optim_mp_ranks: set[int],
                            saved_world: int = 0) -> None:
    """Refuse, naming the first missing one, a save without every stage's `mp_rank_XX_model_states.pt`
    (`stage_models`: the XX present; `optim_mp_ranks`: the mp ranks of the optimizer files present;
    `saved_world`: the mp_world_size a stage file says, when one was read). From names (and that
    number), so that a node-local job (reshard.jobs.node_local_columns) refuses before it reads anything else."""
    if not stage_models:
        raise CheckpointError(tag_dir, "has pipeline layer files but no mp_rank_XX_model_states.pt")
    seen = max(stage_models) + 1, max((mp_rank + 1 for mp_rank in optim_mp_ranks), default=0), saved_world
    if missing := [s for s in range(max(seen)) if s not in stage_models]:
        # runtime/engine.py `_configure_checkpointing`: with use_node_local_storage the model-states
        # writer is a node's local rank 0, so a stage none of them runs gets no file anywhere, and
        # DeepSpeed 0.19.8's own load of such a save fails ("checkpoint count 1 is different from
        # saved mp_world_size 4", state_dict_factory.py) on every rank
        raise CheckpointError(os.path.join(tag_dir, f"mp_rank_{missing[0]:02d}_model_states.pt"),
                              f"is missing: the save has stage model files {sorted(stage_models)} and optimizer "
                              f"files of stages 0..{seen[1] - 1}. A save with use_node_local_storage writes a "
                              "stage's model-states file only on a node whose local rank 0 runs that stage (and "
                              "DeepSpeed cannot load such a save either)")


def _check_layer_models(tag_dir: str, layer_models: dict[int, dict], tp: int) -> bool:
    """Refuse a layer file that disagrees with `tp`: with a model axis one file per model rank 00..tp-1
    of each layer, each with its `-model_XX` suffix; without one, no suffix (module.py
    `ckpt_layer_path`); at tp 1 either, every layer alike (PipeModelDataParallelTopology names
    `-model_00`). `layer_models`: layer index -> {model rank or None: file name}. Returns whether the
    files carry the suffix."""
    suffixed = tp > 1 or any(None not in models for models in layer_models.values())
    expected = set(range(tp)) if suffixed else {None}
    for index, models in sorted(layer_models.items()):
        stray = sorted(set(models) - expected, key=str)
        if stray:
            why = ("has no -model_XX suffix, but other layer files of this tp_degree 1 save have one" if stray == [None]
                   else f"has a -model_XX suffix (a model axis), but {stage_model_name(0)} says tp_degree 1" if tp == 1
                   else f"is a layer file of model rank {stray[0]}, but the save's tp_degree is {tp}")
            raise CheckpointError(os.path.join(tag_dir, models[stray[0]]), why)
        if missing := sorted(expected - set(models), key=str):
            raise CheckpointError(os.path.join(tag_dir, f"layer_{index:02d}-model_{missing[0]:02d}-model_states.pt"),
                                  f"is missing: the save's tp_degree is {tp}, and layer {index} has files of model "
                                  f"ranks {sorted(models, key=str)}")
    return suffixed


def _check_stage_model(model: dict, model_path: str) -> None:
    """What a ZeRO-1 pipeline stage file holds, refused by name otherwise."""
    if model.get("optimizer") is not None:  # engine.py `_save_checkpoint`: ZeRO-0 keeps it here
        raise UnsupportedCheckpoint(model_path, "holds the optimizer state (ZeRO stage 0); pipeline checkpoints "
                                                "are supported under ZeRO stage 1 only")
    if model.get("module") is not None:
        raise UnsupportedCheckpoint(model_path, "holds module weights; a pipeline stage file holds none")
    if model.get("frozen_param_fragments") or model.get("frozen_param_shapes"):
        # engine.py `_save_checkpoint` writes them only when gradients are partitioned (ZeRO-2/3, which
        # the pipeline engine refuses); under ZeRO-1 frozen parameters live in the layer files alone
        raise UnsupportedCheckpoint(model_path, "records frozen_param_shapes / frozen_param_fragments, which a "
                                                "ZeRO-1 pipeline save does not (its frozen parameters are in the "
                                                "layer files); not supported")


def _osd(file, path: str) -> dict:
    """The `optimizer_state_dict` of an optimizer file, refused by name when there is none."""
    osd = file.get(OPTIM) if isinstance(file, dict) else None
    if not isinstance(osd, dict):
        raise CheckpointError(path, f"is not a DeepSpeed optim-states file (no {OPTIM!r})")
    return osd


def check_stage_partitions(osd: dict, path: str, spec: PipelineStage, dp: int, rank: int,
                           expected: Sequence[Sequence[str]] | None = None) -> list[list[str]]:
    """Refuse (CheckpointError naming the file, the tensor and both sizes) an optimizer file of dp rank
    `rank` whose partitions are not those the stage's `param_shapes` give at `dp` ranks
    (stage_1_and_2.py: the fp32 partition without its tail padding, every per-element state the
    padded partition, each a contiguous 1-D tensor; `partition_count` and `group_paddings` as the
    layout says): the checks the ZeRO road makes (deepspeed_schema.partition_problem,
    partitioned_state_keys). Returns, per param group, the partitioned state keys (`expected`:
    dp rank 0's, which every rank must have)."""
    groups = len(spec.names)
    fp32 = osd.get(FP32)
    base = osd.get(BASE)
    if not isinstance(fp32, (list, tuple)) or len(fp32) != groups:
        raise CheckpointError(path, f"holds {len(fp32) if isinstance(fp32, (list, tuple)) else 'no'} fp32 partitions "
                                    f"({FP32}), the stage's param_shapes {groups} param groups")
    if not isinstance(base, dict) or not isinstance(base.get("state"), dict):
        raise UnsupportedCheckpoint(path, "base optimizer state is not a torch optimizer state_dict: not supported")
    layouts = [_group_layout(spec, g, dp) for g in range(groups)]
    if list(osd.get("partition_count") or []) != [dp] * groups:
        raise CheckpointError(path, f"has partition_count {osd.get('partition_count')}, dp_world_size is {dp}")
    paddings = [layout.tail_padding(rank) for layout in layouts]
    if "group_paddings" in osd and list(osd["group_paddings"]) != paddings:
        raise CheckpointError(path, f"has group_paddings {list(osd['group_paddings'])}, but dp rank {rank} of {dp} "
                                    f"with the stage's param_shapes pads {paddings}")
    keys = []
    for g, layout in enumerate(layouts):
        if problem := schema.partition_problem(fp32[g], layout.lean_numel(rank)):
            raise CheckpointError(path, f"{FP32}[{g}] {problem} (dp rank {rank} of {dp}, by the stage's "
                                        "param_shapes)")
        keys.append(schema.partitioned_state_keys(path, f"param group {g}", base["state"].get(g, {}),
                                                  layout.partition_numel, None if expected is None else expected[g]))
    return keys


def _check_param_shapes_against_layers(files: PipelineFiles, spec: PipelineStage, model_path: str,
                                       model: int | None, layer) -> None:
    """Refuse a stage whose `param_shapes` name a parameter its layer file does not hold at that shape
    (module.py `save_state_dict`: layer `idx`'s `state_dict()` in `layer_{idx:02d}...`, its stage
    names `<idx>.<key>`; a tied module's `tied_modules.<key>.<param>` is checked against every layer
    file of the model rank, since which layer holds it is not recorded). `layer(name)`: the file's
    layer_entries, None when it is missing."""
    suffix = "" if model is None else f"-model_{model:02d}"
    own = [name for name in files.layer_files if (LAYER_RE.match(name)[2] or "") == suffix]
    for names, shapes in zip(spec.names, spec.shapes):
        for name, shape in zip(names, shapes):
            head, _, key = name.partition(".")
            if head.isdigit():
                file = layer_file_name(int(head), model)
                state = layer(file)
                if state is None:
                    raise CheckpointError(model_path, f"param_shapes names {name}, but {file} is missing")
                found = state.get(key, (None, None))[0]
                if found != tuple(shape):
                    held = f"shape {list(found)}" if found is not None else "nothing"
                    raise CheckpointError(model_path, f"param_shapes says {name} has shape {list(shape)}, but "
                                                      f"{file} holds {held} under {key!r}")
            elif head == "tied_modules":
                param = key.partition(".")[2]
                if not any((layer(file) or {}).get(param, (None, None))[0] == tuple(shape) for file in own):
                    raise CheckpointError(model_path, f"param_shapes says {name} has shape {list(shape)}, but no "
                                                      f"layer file{' of model rank ' + str(model) if model is not None else ''} "
                                                      f"holds {param!r} at that shape")


def _numel(shape) -> int:
    count = 1
    for size in shape:
        count *= int(size)
    return count


def _check_optimizer(osd: dict, path: str, model: dict, dp: int) -> bool:
    """Whether the stage was saved by BF16_Optimizer; refuse what a plain re-cut would get wrong."""
    if FP32 not in osd or "partition_count" not in osd:
        raise UnsupportedCheckpoint(path, "is not a ZeRO-1 optimizer file (no single_partition_of_fp32_groups); "
                                          "pipeline checkpoints are supported under ZeRO stage 1 only")
    bf16_optimizer = "zero_stage" not in osd
    if bf16_optimizer:  # bf16 under ZeRO stage 0; with a tied layer DeepSpeed cannot load its own save
        raise UnsupportedCheckpoint(path, "was saved by BF16_Optimizer (bf16 with ZeRO stage 0); pipeline "
                                          "checkpoints are supported under ZeRO stage 1 only (DeepSpeed 0.19.8 "
                                          "itself fails to load such a save with a tied layer, "
                                          "bf16_optimizer.py _load_legacy_checkpoint)")
    if int(osd["zero_stage"]) != 1:
        raise UnsupportedCheckpoint(path, f"has ZeRO stage {int(osd['zero_stage'])}; the pipeline engine allows 0 or 1 "
                                          "and reshard supports 1")
    if any(any(group) for group in osd.get("param_alignment_paddings") or []):
        raise UnsupportedCheckpoint(path, "uses parameter_alignment paddings; not supported for pipelines yet")
    zero_config = (model.get("ds_config") or {}).get("zero_optimization") or {}
    if zero_config.get("round_robin_gradients"):
        raise UnsupportedCheckpoint(path, "uses round_robin_gradients; not supported for pipelines yet")
    if list(osd["partition_count"]) != [dp] * len(osd[FP32]):
        raise CheckpointError(path, f"has partition_count {list(osd['partition_count'])}, dp_world_size is {dp}")
    if len(model["param_shapes"]) != len(osd[FP32]):
        raise CheckpointError(path, f"has {len(osd[FP32])} param groups, the stage's param_shapes "
                                    f"{len(model['param_shapes'])}")
    return bf16_optimizer


def _group_layout(stage: PipelineStage, group: int, dp: int) -> Zero12Group:
    numels = stage.numels[group]
    return zero12_group(range(len(numels)), numels, dp)


def _joined(parts: list, layouts: list[Zero12Group], group: int, path_of):
    """The stage group's flat tensor without its tail padding, from every source rank's partition."""
    import torch
    layout = layouts[group]
    pieces = []
    for rank, part in enumerate(parts):
        lean = layout.lean_numel(rank)
        if part.numel() < lean:
            raise CheckpointError(path_of(rank), f"group {group} holds {part.numel()} elements, {lean} expected")
        pieces.append(part.reshape(-1)[:lean])
    return torch.cat(pieces)[:layout.padded_numel]


@dataclass(frozen=True)
class FlatPieces:
    """A group's unpadded flat held as the tensors it concatenates, not copied into one: `starts[i]`
    is where `tensors[i]` (1-D) begins in the flat; ranges no piece covers read as zeros. What a
    target stage's partitions are cut from (each parameter's own tensor), so that the flat is never
    built whole, and a worker writing some of the stage's ranks needs only their parameters."""

    starts: tuple[int, ...]
    tensors: tuple
    dtype: object

    @classmethod
    def of(cls, tensors: Sequence, numels: Sequence[int], dtype, present: Sequence[bool] | None = None) -> "FlatPieces":
        """The flat of tensors laid end to end by `numels`; with `present`, only those flagged are held."""
        starts, offset, held = [], 0, []
        for i, numel in enumerate(numels):
            if present is None or present[i]:
                starts.append(offset)
                held.append(tensors[len(held)])
            offset += numel
        return cls(tuple(starts), tuple(held), dtype)

    def copy_into(self, out, start: int) -> None:
        """out[:] = flat[start:start + len(out)] where pieces cover it."""
        end = start + out.numel()
        first = max(0, bisect.bisect_right(self.starts, start) - 1)
        for at, tensor in zip(self.starts[first:], self.tensors[first:]):
            if at >= end:
                break
            lo, hi = max(at, start), min(at + tensor.numel(), end)
            if lo < hi:
                out[lo - start:hi - start] = tensor[lo - at:hi - at]


def _cut(flat, layout: Zero12Group, rank: int, lean: bool):
    """Rank `rank`'s partition of `flat` (a tensor or FlatPieces) at `layout`: zero-padded to the
    partition size, or without its tail padding when `lean` (DeepSpeedZeroOptimizer's saved fp32 partition)."""
    import torch
    start = rank * layout.partition_numel
    size = layout.lean_numel(rank) if lean else layout.partition_numel
    out = torch.zeros(size, dtype=flat.dtype)
    if isinstance(flat, FlatPieces):
        flat.copy_into(out, start)
        return out
    piece = flat[start:start + size]
    out[:piece.numel()] = piece
    return out


def read_stage(source: PipelineSource, stage: int, trust_pickle: bool = False, model: int = 0):
    """The stage's optimizer files (one per dp rank, memory-mapped; of model rank `model`), and per
    group its fp32 master flat and its per-element optimizer states' flats, each without tail padding."""
    spec = source.stages[stage]
    paths, files, keys = _stage_optimizer_files(source, stage, trust_pickle, model)
    osds = [f[OPTIM] for f in files]
    old = [_group_layout(spec, g, source.dp) for g in range(len(spec.names))]
    masters, moments = [], []
    for g in range(len(spec.names)):
        masters.append(_joined([osd[FP32][g] for osd in osds], old, g, paths.__getitem__))
        states = [osd[BASE]["state"].get(g, {}) for osd in osds]
        moments.append({key: _joined([state[key] for state in states], old, g, paths.__getitem__) for key in keys[g]})
    return files, masters, moments


def _stage_optimizer_files(source: PipelineSource, stage: int, trust_pickle: bool, model: int):
    """(paths, files, per group the partitioned state keys) of (stage, model rank `model`)'s optimizer
    files, one per dp rank, memory-mapped, each checked against the stage's layout
    (check_stage_partitions) before a caller joins or cuts anything from them."""
    spec = source.stages[stage]
    paths = [source.optim_path(stage, rank, model) for rank in range(source.dp)]
    files = [load_whole(path, trust_pickle) for path in paths]
    keys = None
    for rank, (path, file) in enumerate(zip(paths, files)):
        found = check_stage_partitions(_osd(file, path), path, spec, source.dp, rank, keys)
        keys = keys or found
    return paths, files, keys


def _flat_range(parts: list, partition_numel: int, start: int, numel: int):
    """Elements [start, start + numel) of a group's flat from its partitions (`parts`, rank order, each
    holding [r * ps, (r + 1) * ps)): a view of the one partition holding them, or their concatenation
    when they span partitions."""
    import torch
    if numel == 0:
        return parts[0][:0]
    first, last = start // partition_numel, (start + numel - 1) // partition_numel
    if first == last:
        at = start - first * partition_numel
        return parts[first][at:at + numel]
    return torch.cat([parts[rank][max(start, rank * partition_numel) - rank * partition_numel:
                                  min(start + numel, (rank + 1) * partition_numel) - rank * partition_numel]
                      for rank in range(first, last + 1)])


def stage_states(source: PipelineSource, stage: int, trust_pickle: bool = False, model: int = 0,
                 names: frozenset[str] | set[str] | None = None) -> tuple[dict, dict[str, dict]]:
    """(the stage's dp rank 0 optimizer file, {name: {"fp32": flat, <state>: flat}}) of (stage, model
    rank `model`) for `names` (None: all): read_stage + states_by_name without building whole-group
    flats: each parameter a view of the memory-mapped partition holding it (joined only where it
    spans partitions), so a caller reads and holds the parameters it asks for, not the stage."""
    spec = source.stages[stage]
    paths, files, group_keys = _stage_optimizer_files(source, stage, trust_pickle, model)
    osds = [f[OPTIM] for f in files]
    found = {}
    for g, (group_names, numels) in enumerate(zip(spec.names, spec.numels)):
        if names is not None and names.isdisjoint(group_names):
            continue
        layout = _group_layout(spec, g, source.dp)
        states = [osd[BASE]["state"].get(g, {}) for osd in osds]
        flats = {"fp32": [osd[FP32][g] for osd in osds],
                 **{key: [state[key] for state in states] for key in group_keys[g]}}
        flats = {key: [part.reshape(-1) for part in parts] for key, parts in flats.items()}
        offset = 0
        for name, numel in zip(group_names, numels):
            if names is None or name in names:
                found[name] = {key: _flat_range(parts, layout.partition_numel, offset, numel)
                               for key, parts in flats.items()}
            offset += numel
    return files[0], found


def _stage_flats(source: PipelineSource, stage: int, trust_pickle: bool, model: int = 0):
    """read_stage, with rank 0's file alone (the template of the files written from it)."""
    files, masters, moments = read_stage(source, stage, trust_pickle, model)
    return files[0], masters, moments


def states_by_name(spec: PipelineStage, masters: list, moments: list[dict]) -> dict[str, dict]:
    """{name: {"fp32": flat, <state>: flat}} of one stage, every group, from read_stage's flats."""
    found = {}
    for group, (names, numels) in enumerate(zip(spec.names, spec.numels)):
        offset = 0
        for name, numel in zip(names, numels):
            states = {"fp32": masters[group][offset:offset + numel]}
            states.update({key: flat[offset:offset + numel] for key, flat in moments[group].items()})
            found[name] = states
            offset += numel
    return found


def build_optimizers(template: dict, names: list[tuple[str, ...]], numels: list[tuple[int, ...]], masters: list,
                     moments: list[dict], target_dp: int, ranks: Sequence[int] | None = None) -> Iterator[dict]:
    """Every target dp rank's optimizer file (of `ranks` only, when given) over one stage's groups
    (`names`, `numels` per group; `masters`, `moments` their unpadded flats, tensors or FlatPieces
    covering at least those ranks' elements), other keys from `template` (a source file); one
    at a time, so that a caller saving each before taking the next holds one rank's tensors.

    Mirrors runtime/zero/stage_1_and_2.py (`__init__`: flat group padded to a multiple of
    2 * dp, `partition_size`, `groups_padding`; `_create_param_mapping`) through
    reshard.layouts.zero's Zero12Group. Tensors of the base optimizer's state whose size equals the
    partition (Adam's moments, any other per-element state) are re-cut; scalars are copied."""
    groups = len(names)
    new = [zero12_group(range(len(numels[g])), numels[g], target_dp) for g in range(groups)]
    for rank in range(target_dp) if ranks is None else ranks:
        osd = dict(template[OPTIM])
        osd[FP32] = [_cut(masters[g], new[g], rank, lean=True) for g in range(groups)]
        base = dict(osd[BASE])
        base["state"] = {}
        for g in range(groups):
            state = dict(template[OPTIM][BASE]["state"].get(g, {}))
            state.update({key: _cut(flat, new[g], rank, lean=False) for key, flat in moments[g].items()})
            base["state"][g] = state
        osd[BASE] = base
        osd["partition_count"] = [target_dp] * groups
        osd["group_paddings"] = [new[g].tail_padding(rank) for g in range(groups)]
        osd["param_alignment_paddings"] = [[0] * len(names[g]) for g in range(groups)]
        osd["param_slice_mappings"] = [
            {names[g][pid]: classes.fragment_address(numel, start)
             for pid, numel, start in new[g].slice_mappings(rank, numels[g])} for g in range(groups)]
        yield {**template, OPTIM: osd}


def target_optimizers(source: PipelineSource, stage: int, target_dp: int, trust_pickle: bool = False,
                      model: int = 0, ranks: Sequence[int] | None = None) -> Iterator[dict]:
    """Every target dp rank's optimizer file for (`stage`, model rank `model`), the stages unchanged
    (of `ranks` only, when given)."""
    spec = source.stages[stage]
    template, masters, moments = _stage_flats(source, stage, trust_pickle, model)
    return build_optimizers(template, list(spec.names), list(spec.numels), masters, moments, target_dp, ranks)


def named_states(source: PipelineSource, trust_pickle: bool = False, model: int = 0,
                 names: frozenset[str] | set[str] | None = None):
    """(stage 0's optimizer file as a template, {name: {"fp32": flat, <state>: flat}}) over every
    stage of model rank `model`'s column, of `names` only when given (stage_states: each a view of
    the mapped partition holding it); a tied parameter, held by several stages, must be equal in each.
    Every stage's hyperparameters are checked, whatever `names`."""
    import torch
    template, found = None, {}
    for stage, spec in enumerate(source.stages):
        path = source.optim_path(stage, 0, model)
        if names is not None and all(names.isdisjoint(group) for group in spec.names):
            file, states = load_whole(path, trust_pickle), {}
        else:
            file, states = stage_states(source, stage, trust_pickle, model, names)
        template = template or file
        # a new stage takes each group's hyperparameters (the torch param_groups, which
        # Optimizer.load_state_dict restores) from stage 0's file: every stage must agree
        if (hyper := _hyperparameters(file)) != (first := _hyperparameters(template)):
            group = next(g for g, (a, b) in enumerate(zip(hyper, first)) if a != b) if len(hyper) == len(first) else 0
            raise UnsupportedCheckpoint(path, f"param group {group} has hyperparameters {hyper[group]}, stage 0's "
                                              f"{first[group]}; new stages take stage 0's, so every stage must agree")
        for name, states in states.items():
            if name in found:
                if found[name].keys() != states.keys() or not all(torch.equal(found[name][k], v)
                                                                   for k, v in states.items()):
                    raise CheckpointError(path, f"holds {name} (a tied parameter) with values other than an "
                                                "earlier stage's")
                continue
            found[name] = states
    return template, found


def _hyperparameters(file: dict) -> list[dict]:
    """Each torch param group of an optimizer file without its `params` indices."""
    return [{key: value for key, value in group.items() if key != "params"}
            for group in file[OPTIM][BASE]["param_groups"]]


def source_groups(source: PipelineSource) -> tuple[int, dict[str, int]]:
    """(the number of optimizer param groups, each parameter's group), the same on every stage:
    each stage's optimizer is built from the script's own param groups, so a tied parameter sits
    in one group on every stage holding it."""
    count, group_of = len(source.stages[0].names), {}
    for spec in source.stages:
        if len(spec.names) != count:
            raise UnsupportedCheckpoint(source.model_path(spec.index), f"has {len(spec.names)} optimizer param "
                                                                       f"groups, stage 0 has {count}")
        for group, names in enumerate(spec.names):
            for name in names:
                if group_of.setdefault(name, group) != group:
                    raise CheckpointError(source.model_path(spec.index), f"puts {name} in param group {group}, an "
                                                                         f"earlier stage in {group_of[name]}")
    return count, group_of


def source_buffers(source: PipelineSource) -> list[str]:
    """Every persistent buffer's name once (`buffer_names`), stage order; a tied module's once."""
    return list(dict.fromkeys(name for spec in source.stages for name in spec.buffer_names))


def frozen_numels(source: PipelineSource, layers) -> dict[str, int]:
    """Every frozen parameter's element count by its stage name (`<layer>.<param>`, or
    `tied_modules.<key>.<param>` for a tied layer of `layers`): under ZeRO-1 DeepSpeed records frozen
    parameters nowhere but in their layer files (engine.py saves `frozen_param_shapes` only when
    gradients are partitioned), so they are what a layer file holds besides the trainable
    parameters and the buffers. The layer files are mapped, not read; with a model axis, model rank
    0's (every model rank's stages hold the same names and sizes, inspect_pipeline)."""
    trainable = source_numels(source)
    buffers = {name for spec in source.stages for name in spec.buffer_names}
    frozen = {}
    for file in source.layer_files:
        match = LAYER_RE.match(file)
        if match[3] not in (None, "00"):
            continue
        index = int(match[1])
        key = layers.tied_key(index)
        prefix = f"tied_modules.{key}." if key is not None else f"{index}."
        entries = source.layer_table[file] if source.layer_table is not None else \
            layer_entries(os.path.join(source.tag_dir, file))
        for name, (_, numel) in entries.items():
            full = prefix + name
            if full not in trainable and full not in buffers and numel is not None:
                frozen[full] = numel
    return frozen


def check_layers_reproduce_source(source: PipelineSource, layers, method: str,
                                  frozen: dict[str, int] | None = None) -> list[dict[str, int]]:
    """The caller's layer list, partitioned at the source's pp by `method` (or, failing that, by
    `parameters` or `uniform`), must give every source stage exactly the parameters (and order)
    its files hold. Returns the weightings under which it does: {} (the frozen parameters weighed
    nothing: frozen in their layer's constructor) and/or `frozen` (frozen after the PipelineModule
    was built, so that `_count_layer_params` counted them)."""
    numels = source_numels(source)
    groups, group_of = source_groups(source)
    # The target's method may be explicit boundaries, or differ from the one the source was saved
    # with: the layer list passes if any DeepSpeed method reproduces every source stage. The
    # caller's own method is tried first, alone, so that a weighting is only taken on another
    # method's word when the caller's reproduces the source under none.
    own = [method] if method in ("parameters", "uniform") else []
    mismatch, reproducing = None, []
    for methods in (own, [m for m in ("parameters", "uniform") if m not in own]):
        for counted in [{}] + ([dict(frozen)] if frozen else []):
            for tried in methods:
                assignment = assign_stages(tried, layers, numels, source.pp, counted)
                bounds = list(assignment.bounds)
                for stage, spec in enumerate(source.stages):
                    expected = split_by_group(assignment.names[stage], group_of, groups)
                    if expected != spec.names:
                        mismatch = mismatch or (stage, spec, tried, bounds, expected)
                        break
                else:
                    reproducing.append(counted)
                    break
        if reproducing:
            break
    if not reproducing:
        stage, spec, tried, bounds, expected = mismatch
        held, expected = [list(g) for g in spec.names], [list(g) for g in expected]
        if groups == 1:
            held, expected = held[0], expected[0]
        counted_too = (f" (also with the frozen parameters {sorted(frozen)} counted, as when they are frozen after "
                       "the PipelineModule is built)") if frozen else ""
        raise CheckpointError(source.model_path(stage),
                              f"holds {held}, but {layers.count} layers (tied {dict(layers.tied)}) "
                              f"partitioned by {tried!r} into {source.pp} stages (bounds {bounds}) give "
                              f"{expected}{counted_too}: the layer count or tied positions differ from the model's "
                              "(or the source was partitioned by type: or by hand, which reshard cannot reproduce"
                              + (", or a param group does not list the stage's parameters in their order"
                                 if groups > 1 else "") + ")")
    for stage, spec in enumerate(source.stages):
        if spec.shared_params:
            # runtime/engine.py `_get_shared_params` fills the table on global rank 0 alone (stage 0's
            # file): what the other stages' layers share, and so a new stage's table, is not recorded
            raise UnsupportedCheckpoint(source.model_path(stage),
                                        f"lists shared parameters {sorted(spec.shared_params)} (one tensor under two "
                                        "names, not a TiedLayerSpec); DeepSpeed records them for stage 0 alone "
                                        "(engine.py _get_shared_params on global rank 0), so changing the number "
                                        "of pipeline stages does not support them")
    return reproducing


def source_numels(source: PipelineSource) -> dict[str, int]:
    """Every parameter's element count by name, stage order (each module's own order kept)."""
    numels = {}
    for spec in source.stages:
        for names, counts in zip(spec.names, spec.numels):
            for name, numel in zip(names, counts):
                numels.setdefault(name, numel)
    return numels


def source_shapes(source: PipelineSource) -> dict[str, tuple[int, ...]]:
    """Every trainable parameter's shape on one model rank (`param_shapes`), stage order."""
    return {name: shape for spec in source.stages for group_names, group_shapes in zip(spec.names, spec.shapes)
            for name, shape in zip(group_names, group_shapes)}


def saved_model_axis_info(source: PipelineSource, trust_pickle: bool = False):
    """The `universal_checkpoint_info` the training script saved as client state (None when absent):
    the same in every (stage, model rank) model-states file, since each rank saves the same client
    state (Megatron-DeepSpeed's `_universal_checkpoint_info`); read from stage 0's, and refused
    naming the first file that says otherwise, so that no rule is taken from one file when another
    disagrees."""
    first = source.model_path(0)
    info = source.tree(os.path.basename(first), trust_pickle, whole=True).get("universal_checkpoint_info")
    for stage in range(source.pp):
        for model in range(source.tp):
            path = source.model_path(stage, model)
            if path == first:
                continue
            other = source.tree(os.path.basename(path), trust_pickle, whole=True).get("universal_checkpoint_info")
            try:
                same = bool(other == info)
            except (RuntimeError, TypeError, ValueError):  # a tensor inside: not the pattern lists of a script
                same = False
            if not same:
                raise CheckpointError(path, f"has a universal_checkpoint_info other than {os.path.basename(first)}'s; "
                                            "how each parameter is sliced over the model axis must be one rule")
    return info


layer_file_name = schema.layer_file_name  # module.py `ckpt_layer_path`


def layer_indices(source: PipelineSource) -> list[int]:
    """The global layer indices that have layer files, ascending."""
    return sorted({int(LAYER_RE.match(name)[1]) for name in source.layer_files})


def layer_tensor_name(layers, index: int, key: str) -> str:
    """A layer file entry's stage name: `<index>.<key>`, or `tied_modules.<tied key>.<key>`."""
    tied = layers.tied_key(index)
    return f"tied_modules.{tied}.{key}" if tied is not None else f"{index}.{key}"


def check_layer_files_cut(source: PipelineSource, layers, rules, target_tp: int, asked: str | None = None) -> None:
    """Every tensor of model rank 0's layer files, by its rule, can be cut for `target_tp` (before
    anything is written); UnsupportedCheckpoint naming the file and what `asked` for it (default
    "--target-tp T") otherwise."""
    from reshard.layouts.model_axis import ModelAxisError, target_local_shapes
    for index in layer_indices(source):
        path = os.path.join(source.tag_dir, layer_file_name(index, 0 if source.has_model_axis else None))
        state = source.tree(os.path.basename(path), whole=True)
        if not isinstance(state, dict):
            raise CheckpointError(path, "does not hold a layer's state_dict")
        local = {layer_tensor_name(layers, index, key): tuple(value.shape) for key, value in state.items()
                 if hasattr(value, "shape")}
        try:
            target_local_shapes(rules, local, source.tp, target_tp)
        except ModelAxisError as error:
            raise UnsupportedCheckpoint(path, f"{asked or f'--target-tp {target_tp}'}: {error}") from None


def _save_stage(model: dict | None, optimizers: Iterator[dict], names: Sequence[str], tag_dir: str) -> list[str]:
    """Save a stage's model-states tree (None: not this caller's to write, and `names` has no entry
    for it), then each of its optimizer trees as it comes, under `names` (stage_file_names); return
    the paths written."""
    import torch
    paths = [os.path.join(tag_dir, name) for name in names]
    if model is not None:
        write_named_file(tag_dir, paths[0], lambda path: torch.save(model, path, pickle_module=classes))
    for path, tree in zip(paths[0 if model is None else 1:], optimizers, strict=True):
        write_named_file(tag_dir, path, lambda path, tree=tree: torch.save(tree, path, pickle_module=classes))
    return paths


def pipeline_summary(save_dir: str, tag: str | None, trust_pickle: bool = False) -> dict | None:
    """What `reshard inspect` prints for a pipeline save (None when the tag is not one)."""
    if tag is None:
        latest = os.path.join(save_dir, schema.LATEST)
        if not os.path.isfile(latest):
            return None
        with open(latest) as handle:
            tag = handle.read().strip()
    if not is_pipeline(os.path.join(save_dir, tag)):
        return None
    source = inspect_pipeline(save_dir, tag, trust_pickle)
    return {"kind": "pipeline", "save_dir": save_dir, "tag": tag, "description": source.describe(),
            "pp": source.pp, "dp": source.dp, "tp": source.tp, "model_axis": source.has_model_axis, "bf16": source.bf16,
            "layer_files": list(source.layer_files),
            "stages": [{"stage": spec.index, "params": sum(len(g) for g in spec.names),
                        "elements": sum(sum(g) for g in spec.numels), "groups": len(spec.names),
                        "tied": sorted({n.split(".")[1] for g in spec.names for n in g
                                        if n.startswith("tied_modules.")})} for spec in source.stages]}


def pipeline_summary_text(summary: dict) -> str:
    """`reshard inspect`'s lines for pipeline_summary's dict."""
    lines = [f"{summary['save_dir']} tag {summary['tag']}: {summary['description']}"]
    tp = summary.get("tp", 1)
    for stage in summary["stages"]:
        tied = f", tied {', '.join(stage['tied'])}" if stage["tied"] else ""
        files = " / ".join(stage_model_name(stage["stage"], m, tp) for m in range(tp))
        each = " per model rank" if tp > 1 else ""
        lines.append(f"  stage {stage['stage']}: {stage['params']} parameters, {stage['elements']} elements"
                     f"{each}, {stage['groups']} group(s){tied}; {files}, each + {summary['dp']} optimizer files")
    lines.append(f"  layer files: {', '.join(summary['layer_files'])}")
    axis = summary.get("model_axis", tp > 1)
    lines.append("  reshard: --target-dp D changes dp per stage; --target-pp P also needs --pipeline-layers "
                 "and --pipeline-tied (the checkpoint does not record them)"
                 + (f"; --target-tp T (the model axis has tp {tp}) needs them too, and universal_checkpoint_info "
                    "patterns in the client state saying how each parameter is sliced" if axis else ""))
    return "\n".join(lines)


def pipeline_model_axis(source: PipelineSource, rules, layers, bounds: Sequence[int], target_tp: int,
                        trust_pickle: bool = False):
    """(reshard.layouts.model_axis.PipelineModelAxis, layer templates) of a tp change of `source` to
    `target_tp` model ranks, the target stages holding layers `bounds[s]..bounds[s + 1] - 1`: each trainable
    parameter's split and whole shape by `rules` (the save's universal_checkpoint_info patterns), and every
    tensor of model rank 0's layer files (module.py `save_state_dict`: each layer's state_dict, weights,
    buffers and frozen parameters) in one plan space per dtype, each read by the source stage holding the
    layer's first trainable parameter (stage 0 for a layer with none) and written into the target stage
    holding its index; the templates are (index, source stage, target stage, model rank 0's tree) per layer
    file, which each target model rank's file is built from (`reshard.formats.deepspeed_files.deepspeed_target`). The rules
    were checked against every tensor before (formats/deepspeed_files/pipeline_target.model_axis_plan)."""
    from reshard.formats.deepspeed_files.deepspeed_spec import itemsize
    from reshard.formats.torch_bytes.torch_archive import TensorRef
    from reshard.layouts.model_axis import LayerFileSpace, PipelineModelAxis
    from reshard.layouts.tensor_parallel import TensorParallelParams
    from reshard.layouts.zero import Stream
    splits, shapes = {}, {}
    for name, local in source_shapes(source).items():
        rule = rules.rule(name)
        shapes[name] = rule.joined_shape(local, source.tp)
        splits[name] = rule.split(shapes[name])
    first_stage = {}
    for spec in source.stages:
        for group in spec.names:
            for name in group:
                first_stage.setdefault(name, spec.index)
    by_dtype: dict[str, list] = {}
    templates = []
    for index in layer_indices(source):
        path = os.path.join(source.tag_dir, layer_file_name(index, 0 if source.has_model_axis else None))
        tree = source.tree(os.path.basename(path), trust_pickle)
        if not isinstance(tree, dict):
            raise CheckpointError(path, "does not hold a layer's state_dict")
        entries = [(key, value, layer_tensor_name(layers, index, key)) for key, value in tree.items()
                   if isinstance(value, TensorRef)]
        held = [first_stage[name] for _, _, name in entries if name in first_stage]
        stage = held[0] if held else 0
        target_stage = bisect.bisect_right(list(bounds), index) - 1
        for key, ref, name in entries:
            rule = rules.rule(name)
            whole = rule.joined_shape(ref.shape, source.tp)
            by_dtype.setdefault(ref.dtype, []).append(((index, key), name, whole, rule.split(whole), stage,
                                                       target_stage))
        templates.append((index, stage, target_stage, tree))
    spaces = tuple(LayerFileSpace(f"layer_{dtype}", Stream("layer", dtype, itemsize(dtype)),
                                  TensorParallelParams(tuple(e[1] for e in entries), tuple(e[2] for e in entries),
                                                       tuple(e[3] for e in entries)),
                                  tuple(e[0] for e in entries), tuple(e[4] for e in entries),
                                  tuple(e[5] for e in entries))
                   for dtype, entries in by_dtype.items())
    return PipelineModelAxis(splits, shapes, spaces), tuple(templates)


def kept_layer_files(source: PipelineSource, stages: dict[int, tuple[int, int]], trust_pickle: bool = False):
    """(reshard.layouts.model_axis.PipelineModelAxis without splits, layer templates) of the layer files with tp
    kept, as tensors of the plan (a node-local job, which writes them on every node whose ranks load them):
    every tensor of model rank 0's layer files, each model rank's copy of it whole at model rank 0's shape
    (the source reader checks every other model rank's file against it), in one plan space per dtype as
    `pipeline_model_axis` lays them out; `stages`: per layer index (source stage whose ranks read its files,
    target stage whose ranks write them). The templates are (index, source stage, target stage, model rank
    0's tree), which every target model rank's layer file is built from (reshard.formats.deepspeed_files.deepspeed_target)."""
    from reshard.formats.deepspeed_files.deepspeed_spec import itemsize
    from reshard.formats.torch_bytes.torch_archive import TensorRef
    from reshard.layouts.model_axis import LayerFileSpace, PipelineModelAxis
    from reshard.layouts.tensor_parallel import TensorParallelParams, TensorSplit
    from reshard.layouts.zero import Stream
    whole = TensorSplit("replicated", None)
    by_dtype: dict[str, list] = {}
    templates = []
    for index in layer_indices(source):
        name = layer_file_name(index, 0 if source.has_model_axis else None)
        tree = source.tree(name, trust_pickle)
        if not isinstance(tree, dict):
            raise CheckpointError(os.path.join(source.tag_dir, name), "does not hold a layer's state_dict")
        stage, target_stage = stages[index]
        for key, ref in tree.items():
            if isinstance(ref, TensorRef):
                by_dtype.setdefault(ref.dtype, []).append(((index, key), f"layer {index} {key}", tuple(ref.shape),
                                                           stage, target_stage))
        templates.append((index, stage, target_stage, tree))
    spaces = tuple(LayerFileSpace(f"layer_{dtype}", Stream("layer", dtype, itemsize(dtype)),
                                  TensorParallelParams(tuple(e[1] for e in entries), tuple(e[2] for e in entries),
                                                       (whole,) * len(entries)),
                                  tuple(e[0] for e in entries), tuple(e[3] for e in entries),
                                  tuple(e[4] for e in entries))
                   for dtype, entries in by_dtype.items())
    return PipelineModelAxis({}, {}, spaces, model_suffix=source.has_model_axis), tuple(templates)
