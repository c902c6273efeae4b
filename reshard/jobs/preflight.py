"""What every kind of job checks and finds before it writes: the target (topology and ZeRO stage), the
batch config and tensor-parallel target it refuses, the notes it prints, and earlier outputs in DST.

    from reshard.jobs.preflight import checkpoint_target, outputs_of, preflight, target_topology
    target = checkpoint_target(opts, source)           # CheckpointTarget(topology, zero): the collective job's
    target = target_topology(opts, source)             # OptionError naming the file where DeepSpeed could not load it
    notes = preflight(opts, source, target, carried)   # refusals, or notes for the summary
    earlier = outputs_of(dst, source.save_dir, target_dp=3)   # tag -> Manifest reshard wrote there from this source

Shared by the collective job (reshard.jobs.collective_job) and the array tasks (reshard.jobs.array_job).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from reshard.jobs import save_dir_files
from reshard.jobs.batch_config import batch_config_problem, batch_size_warning
from reshard.errors import OptionError, ReshardError
from reshard.formats.deepspeed_files.deepspeed_client_state import differing_client_state
from reshard.formats.deepspeed_files.deepspeed_sequence_parallel import saved_sequence_parallel_size, sequence_parallel_problem
from reshard.formats.deepspeed_files.deepspeed_spec import SourceCheckpoint
from reshard.formats.deepspeed_files.deepspeed_zero0_moe import Zero0Moe, Zero0MoeCheckpoint
from reshard.formats.deepspeed_files.stage_change import ZeroStageTarget, check_stage_change, is_stage_change, zero_stage_target
from reshard.jobs.manifest import Manifest
from reshard.jobs.options import ReshardOptions
from reshard.topology import Topology

ZERO3_RANK_IDENTITY_NOTE = (
    "ZeRO-3 rank files carry nothing that identifies their rank (DeepSpeed names them, nothing inside "
    "says which partition they hold), so renamed or swapped rank files cannot be detected here; "
    "compare with the training job's own state if in doubt")


def preflight(opts: ReshardOptions, source: SourceCheckpoint, target: Topology, carried: list[str],
              ranks=None) -> list[str]:
    """Refuse a TP size or batch config the target cannot run (a warning for launchers that
    recompute it); notes on what a new world size changes: per-rank RNG files, per-rank ZeRO-3
    client_state. `target`: the job's one target value (`target_topology`), derived by the caller."""
    check_tensor_parallel_target(source, target)
    ds_config = source.model_template.get("ds_config")
    source_sp = saved_sequence_parallel_size(source.model_template)
    sp = target_sequence_parallel(opts, source)
    warning = batch_size_warning(ds_config, source.spec.dp_world_size, opts.target_dp, carried,
                                 source_sp=source_sp, sp=sp)
    problem = batch_config_problem(ds_config, opts.target_dp, sp)
    if problem and not warning and not opts.ignore_batch_config:
        raise OptionError(f"{source.model_path(0)}: {problem}")
    notes = ([warning] if warning else []) + save_dir_files.per_rank_rng_notes(carried, opts.target_dp)
    differing = differing_client_state(source, trust_pickle=opts.trust_pickle, read_tensors=not opts.dry_run,
                                       ranks=ranks)
    if differing:
        notes.append(f"client_state differs between source ranks in {', '.join(differing)} (ZeRO-3 saves each "
                     f"rank's own); every target rank (0-{opts.target_dp - 1}) received source rank 0's values"
                     + (" (dry run: tensor values not compared)" if opts.dry_run else ""))
    return notes


def target_sequence_parallel(opts: ReshardOptions, source: SourceCheckpoint) -> int:
    """The Ulysses sp size of the job that loads the output: --target-sp, else the save's; refused
    (naming the file) where --target-dp, which counts sp x dp ranks, is not a multiple of it."""
    sp = opts.target_sp or saved_sequence_parallel_size(source.model_template)
    problem = sequence_parallel_problem(opts.target_dp, sp)
    if problem:
        saved = saved_sequence_parallel_size(source.model_template)
        raise OptionError(f"{source.model_path(0)}: {problem}"
                          + ("" if opts.target_sp else f" (this save was trained at sp {saved})"))
    return sp


def check_tensor_parallel_target(source: SourceCheckpoint, target: Topology) -> None:
    """Refuse a target TP size the checkpoint cannot be resharded to."""
    spec = source.spec
    if spec.tensor is None and target.layer_files is None and target.tp != spec.topology.tp:  # a pipeline's: checked
        raise OptionError(f"{source.model_path(0)}: --target-tp {target.tp}: this checkpoint has no AutoTP "
                          "tensor-parallel metadata (universal_checkpoint_info), so how its parameters split "
                          "across TP ranks is unknown; only DeepSpeed AutoTP checkpoints change TP size")
    if spec.tensor is not None and spec.experts is not None and target.tp > 1 and target.ep == 1:
        raise OptionError(f"{source.model_path(0)}: --target-tp {target.tp} --target-ep 1: DeepSpeed folds AutoEP "
                          "with AutoTP only for autoep_size > 1 (module_inject/auto_ep_folding.py "
                          "`validate_folding_global`), so no engine could load that target")
    if spec.tensor is not None:
        problem = spec.tensor.params.check_target(target.tp, f"--target-tp {target.tp}")
        if problem:
            raise OptionError(f"{source.model_path(0)}: {problem} (DeepSpeed AutoTP could not build it either)")


def outputs_of(destination: str, source_save_dir: str, target_dp: int, target_tp: int = 1,
                target_stage: int | None = None, target_ep: int | None = None) -> dict:
    """Tag directories under `destination` that reshard wrote from `source_save_dir` for `target_dp`
    ranks at ZeRO `target_stage` (other tags of this same job, or this tag from an earlier run):
    tag -> Manifest."""
    found = {}
    if os.path.isdir(destination):
        for name in os.listdir(destination):
            if not os.path.isdir(os.path.join(destination, name)):
                continue
            try:
                manifest = Manifest.read(os.path.join(destination, name))
            except ReshardError:
                continue
            if (manifest.source.get("save_dir") == source_save_dir and manifest.target.get("dp_world_size") == target_dp
                    and manifest.target.get("tp_world_size", 1) == target_tp
                    and (target_stage is None or manifest.target.get("stage", target_stage) == target_stage)
                    and manifest.target.get("ep") == target_ep):
                found[name] = manifest
    return found


def target_topology(opts: ReshardOptions, source: SourceCheckpoint) -> Topology:
    """The target topology for `source`, refused (naming the file) where DeepSpeed could not build it."""
    return opts.checked_target(source.spec.topology, source.expert_problem, source.model_path(0))


@dataclass(frozen=True)
class CheckpointTarget:
    """What the collective job writes for one checkpoint: worked out once, on the worker that inspects
    it, and received by every worker with the source (reshard.jobs.collective_job.Placement.inspect)."""

    topology: Topology
    """dp, tp, ep, pp (`target_topology`)."""
    zero: ZeroStageTarget
    """The ZeRO stage form (reshard.formats.deepspeed_files.stage_change): it plans, names the target files and the
    extra source slots."""


def checkpoint_target(opts: ReshardOptions, source: SourceCheckpoint) -> CheckpointTarget:
    """The stage change refused where it does not apply (naming the tag directory), then the topology."""
    if isinstance(source, Zero0MoeCheckpoint):
        return CheckpointTarget(zero0_target_topology(opts, source), Zero0Moe(trust_pickle=opts.trust_pickle))
    if is_stage_change(source.spec, opts.target_stage):
        check_stage_change(source.spec, opts.target_stage, source.tag_dir)
    return CheckpointTarget(target_topology(opts, source), zero_stage_target(source.spec, opts.target_stage))


def zero0_target_topology(opts: ReshardOptions, source: Zero0MoeCheckpoint) -> Topology:
    """A ZeRO-0 MoE save's target: only its dp and ep change (refused by name otherwise)."""
    model = source.model_path()
    if opts.target_stage not in (None, 0):
        raise OptionError(f"{model}: --target-stage {opts.target_stage}: changing the ZeRO stage of a ZeRO-0 MoE "
                          "checkpoint is not supported")
    if opts.target_tp not in (None, 1):
        raise OptionError(f"{model}: --target-tp {opts.target_tp}: a ZeRO-0 MoE checkpoint has no tensor-parallel "
                          "metadata; only its dp and ep change")
    return target_topology(opts, source)


def output_bytes(source, target_dp: int, block: int = 4096, target_tp: int = 1, target_ep: int = 1,
                 target: Topology | None = None) -> int:
    """About how many bytes the target files of `source` resharded for `target_dp` (x `target_tp`)
    ranks take on disk (`target`: the job's target, whose layer files a pipeline tp change re-cuts,
    `Topology.layer_files`): partitioned bytes are conserved (replicated TP parameters aside), each
    target file adds one pickle structure, every file occupies whole blocks, and DeepSpeed's
    recovery scripts and the manifest come along."""
    spec, tag_dir = source.spec, source.tag_dir
    n = spec.topology.world_size
    columns = target_tp * spec.topology.pp  # a pipeline's stages and model ranks (kept), else the TP ranks
    if columns != 1 or spec.topology.tp != 1:
        target_dp *= columns  # every rank writes an optim file; each TP rank (column) a model file (below)

    def blocks(nbytes: int) -> int:
        return -(-nbytes // block) * block

    if spec.stage == 0:  # ZeRO-0 MoE: per target EP rank its dense and local experts' states, at most EP rank
        # 0's file times how many source ranks' experts it takes; the model-states file with them once more
        optim0 = os.path.getsize(source.optim_path(0)) * -(-spec.topology.ep // target_ep)
        n = len(source.other_files)
        return ((target_ep + 1) * blocks(optim0) + blocks(os.path.getsize(source.model_path(0)))
                + sum(blocks(os.path.getsize(os.path.join(tag_dir, name))) for name in source.other_files)
                + sum(blocks(size) for size in _recovery_script_sizes(source.save_dir))
                + blocks(1024 + 200 * (target_ep + 1 + n)) + 2 * block)
    optim = [os.path.getsize(source.optim_path(r)) for r in range(n)]
    structure = max(optim[0] - sum(optim) // n, 0)  # one optim file's pickle, counters, ...
    total = target_dp * blocks(sum(optim) // target_dp + structure)
    model0 = os.path.getsize(source.model_path(0))
    total += target_dp * blocks(model0) if spec.stage == 3 else columns * blocks(model0)
    total += sum(blocks(os.path.getsize(os.path.join(tag_dir, name))) for name in source.other_files)
    # a pipeline tp change re-cuts its layer files (no longer carried): about their bytes again, a replicated
    # tensor once per target model rank
    layers = sum(os.path.getsize(os.path.join(tag_dir, name)) for r in range(n) for name in source.layer_file_names(r, target))
    total += blocks(-(-layers * max(target_tp, spec.topology.tp) // spec.topology.tp)) if layers else 0
    total += sum(blocks(size) for size in _recovery_script_sizes(source.save_dir))
    files = target_dp * (2 if spec.stage == 3 else 1) + len(source.other_files)
    total += blocks(1024 + 200 * files) + 2 * block  # manifest, journal, latest
    return total


def _recovery_script_sizes(save_dir: str) -> list[int]:
    """Sizes of the source's recovery scripts, which the output carries (destination.copy_recovery_script)."""
    from reshard.formats.deepspeed_files.deepspeed_schema import RECOVERY_SCRIPTS
    return [os.path.getsize(os.path.join(save_dir, name)) for name in RECOVERY_SCRIPTS
            if os.path.isfile(os.path.join(save_dir, name))]
