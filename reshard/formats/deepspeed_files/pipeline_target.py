"""The target of a PipelineModule reshard from the caller's layer list: its stages, and at another tp how each
tensor is sliced. One function for every job kind (reshard.jobs.collective_job.pipeline_stage_change, which
the collective job, array tasks, node-local and, with the engine's stages, the in-job load call).

    from reshard.formats.deepspeed_files.pipeline_target import pipeline_target
    planned = pipeline_target(opts, inspect_pipeline(save_dir, tag))   # OptionError / UnsupportedCheckpoint by name
    planned.topology, planned.stages.names, planned.tp_changed

The layer count and the tied layers' positions are not recorded in a checkpoint: the caller gives them
(--pipeline-layers, --pipeline-tied), and they must reproduce every source stage before the target's are
worked out (deepspeed_pipeline.check_layers_reproduce_source, reshard.layouts.pipeline). With tp changed,
the save's universal_checkpoint_info patterns must cut every tensor, layer files' too (`model_axis_plan`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from reshard.errors import OptionError, UnsupportedCheckpoint
from reshard.formats.deepspeed_files.deepspeed_pipeline import (
    PipelineSource,
    check_layer_files_cut,
    check_layers_reproduce_source,
    frozen_numels,
    saved_model_axis_info,
    source_buffers,
    source_groups,
    source_numels,
    source_shapes,
)
from reshard.layouts.model_axis import ModelAxisError, ModelAxisRules, model_axis_rules, target_local_shapes
from reshard.layouts.pipeline import PipelineLayers, StageAssignment, assign_stages, split_by_group
from reshard.topology import Topology


PP_CHANGE_MISSING = ("the new layer-to-stage assignment needs the model's layer count and the positions of its "
                     "TiedLayerSpec layers (layers without a state_dict and tied layers with a forward_fn leave "
                     "no file), which the checkpoint does not record: give --pipeline-layers N and, for tied "
                     "layers, --pipeline-tied KEY:I,J")


def pipeline_layers(opts, model: str) -> PipelineLayers:
    """The caller's layer list (--pipeline-layers, --pipeline-tied), checked for form."""
    tied = {}
    for item in filter(None, (opts.pipeline_tied or "").split(";")):
        key, _, indices = item.partition(":")
        try:
            tied[key.strip()] = tuple(int(i) for i in indices.split(","))
        except ValueError:
            raise OptionError(f"{model}: --pipeline-tied {opts.pipeline_tied!r}: use KEY:I,J[;KEY:I,J]") from None
        if not key.strip() or any(not 0 <= i < opts.pipeline_layers for i in tied[key.strip()]):
            raise OptionError(f"{model}: --pipeline-tied {opts.pipeline_tied!r}: indices must lie in "
                              f"0..{opts.pipeline_layers - 1}")
    return PipelineLayers(opts.pipeline_layers, tied)


@dataclass(frozen=True)
class PipelineTarget:
    """What a pipeline job writes, worked out once on worker 0 and received by every worker."""

    topology: Topology
    stages: StageAssignment | None
    """The new layer-to-stage assignment; None when the number of stages is kept."""
    model_axis: ModelAxisRules | None = None
    """With tp changed, how each tensor is sliced over the model axis (the save's
    universal_checkpoint_info); None when tp is kept."""
    shapes: dict | None = None
    """With tp changed, every trainable parameter's shape on one target model rank."""
    layers: PipelineLayers | None = None
    """With tp changed, the caller's layer list (names the layer files' tensors)."""

    @property
    def tp_changed(self) -> bool:
        return self.model_axis is not None


def pipeline_target(opts, source: PipelineSource) -> PipelineTarget:
    """(pp, dp) to write and, with another pp or tp, each new stage's parameters (the layer list's stages,
    reproduced at the source first; at another tp weighed at the target's local shapes, `model_axis_plan`);
    what no pipeline reshard serves refused by name. `opts`: the job's options (reshard.jobs.options.
    ReshardOptions: target_dp, target_pp, target_tp, target_stage, target_ep, pipeline_layers,
    pipeline_tied, pipeline_partition). The batch config is the caller's to check (preflight)."""
    model = source.model_path(0)
    if opts.target_pp not in (None, source.pp) and not opts.pipeline_layers:
        raise UnsupportedCheckpoint(model, f"--target-pp {opts.target_pp} (the save has {source.pp} stages): "
                                           + PP_CHANGE_MISSING)
    tp_changed = opts.target_tp not in (None, source.tp)
    if tp_changed and not source.has_model_axis:
        raise OptionError(f"{model}: --target-tp {opts.target_tp}: the save has no pipeline model axis (its layer "
                          "files have no -model_XX suffix: built without PipeModelDataParallelTopology), so there "
                          "is no tensor slicing to change: leave --target-tp out")
    if tp_changed and opts.target_tp < 1:
        raise OptionError(f"{model}: --target-tp must be at least 1")
    if tp_changed and not opts.pipeline_layers:
        raise UnsupportedCheckpoint(model, f"--target-tp {opts.target_tp} (the save has tp {source.tp}): DeepSpeed's "
                                           "`parameters` partition weighs each layer's parameters on one model rank, "
                                           "so the stages may differ at another tp, and " + PP_CHANGE_MISSING)
    refused = [(opts.target_stage not in (None, 1), f"--target-stage {opts.target_stage}"),
               (opts.target_ep not in (None, 1), f"--target-ep {opts.target_ep}")]
    for applies, option in refused:
        if applies:
            raise OptionError(f"{model}: {option} is not supported for pipeline checkpoints (only dp, pp and a model axis's tp change)")
    if opts.target_dp < 1:
        raise OptionError(f"{model}: --target-dp must be at least 1")
    topology = Topology(dp=opts.target_dp, tp=opts.target_tp if tp_changed else source.tp,
                        pp=opts.target_pp or source.pp)
    if topology.pp == source.pp and not tp_changed:
        return PipelineTarget(topology, None)
    layers = pipeline_layers(opts, model)
    frozen = frozen_numels(source, layers)
    weightings = check_layers_reproduce_source(source, layers, opts.pipeline_partition, frozen)
    numels, rules, shapes = source_numels(source), None, None
    if tp_changed:  # the target's partition weighs the parameters at the target's local shapes
        rules, shapes = model_axis_plan(source, layers, topology.tp)
        numels = {name: math.prod(shapes[name]) for name in numels}
        weightings = [{name: count * source.tp // topology.tp if not rules.rule(name).whole else count
                       for name, count in counted.items()} for counted in weightings]
    try:
        assignments = {assign_stages(opts.pipeline_partition, layers, numels, topology.pp,
                                     counted, source_buffers(source))
                       for counted in weightings}
    except ValueError as error:
        raise OptionError(f"{model}: {error}") from None
    if len(assignments) > 1:  # whether the frozen parameters weighed in DeepSpeed's partition decides the target's
        bounds = sorted(list(a.bounds) for a in assignments)
        raise UnsupportedCheckpoint(model, f"has frozen parameters {sorted(frozen)}; the source's stages are "
                                           "reproduced whether they were frozen in their layer's constructor or "
                                           "after the PipelineModule was built, and at --target-pp "
                                           f"{topology.pp} these give different stages (bounds {bounds[0]} or "
                                           f"{bounds[1]}): give the target's boundaries with --pipeline-partition")
    assignment = assignments.pop()
    check_no_empty_group(source, assignment)
    return PipelineTarget(topology, assignment, rules, shapes, layers if tp_changed else None)


def model_axis_plan(source: PipelineSource, layers: PipelineLayers, target_tp: int,
                    asked: str | None = None) -> tuple[ModelAxisRules, dict]:
    """(the save's model-axis rules, each trainable parameter's shape at `target_tp`), from the
    universal_checkpoint_info of stage 0's model-states file (client state, the same in every stage
    file), after checking every layer file's tensors can be cut too; UnsupportedCheckpoint naming
    the file saying what is missing or not served (reshard.layouts.model_axis), and what `asked` for
    the change (default "--target-tp T"; the in-job load names the engine's tp)."""
    path = source.model_path(0)
    asked = asked or f"--target-tp {target_tp}"
    try:
        rules = model_axis_rules(saved_model_axis_info(source))
        shapes = target_local_shapes(rules, source_shapes(source), source.tp, target_tp)
    except ModelAxisError as error:
        raise UnsupportedCheckpoint(path, f"{asked} (the save has tp {source.tp}): {error}") from None
    check_layer_files_cut(source, layers, rules, target_tp, asked)
    return rules, shapes


def check_no_empty_group(source: PipelineSource, assignment: StageAssignment) -> None:
    """Refuse target stages DeepSpeed could not build: runtime/zero/stage_1_and_2.py `__init__` reads
    each param group's first trainable parameter (`self.bit16_groups[i][0].dtype`), so a stage
    holding no parameter of some group (or none at all) fails there before it could load."""
    groups, group_of = source_groups(source)
    for stage, names in enumerate(assignment.names):
        for group, members in enumerate(split_by_group(names, group_of, groups)):
            if not members:
                layers = f"layers {assignment.bounds[stage]}..{assignment.bounds[stage + 1] - 1}"
                raise UnsupportedCheckpoint(
                    source.model_path(0), f"at --target-pp {len(assignment.names)}, stage {stage} ({layers}) would "
                                          f"hold no parameter of optimizer param group {group}" +
                                          (f" (of {groups})" if groups > 1 else "") + "; DeepSpeed's ZeRO-1 cannot "
                                          "build such a stage (stage_1_and_2.py __init__ reads each group's first "
                                          "parameter): give other boundaries with --pipeline-partition")
