"""What kind of DeepSpeed save a tag directory holds, and the one inspection entry that reads it as such.

    from reshard.formats.deepspeed_files.deepspeed_save_kind import inspect_save
    source = inspect_save("/ckpt/run1", "global_step3")    # a SourceCheckpoint, whatever kind of save it is

A job inspects every save through `inspect_save`, which asks `SAVE_KINDS` in order which one the tag
directory's file names say it is, and reads it with that kind's inspector; the job never asks. A new kind
of save adds its (recognise, inspect) pair to `SAVE_KINDS`:
- a PipelineModule save (`layer_XX-...model_states.pt` files, deepspeed_pipeline.is_pipeline), inspected
  as columns, each (stage, model rank) a ZeRO-1 save over its stage's parameters
  (deepspeed_inspect.inspect_pipeline_columns);
- a ZeRO-0 MoE save (`expp_rank_{e}_mp_rank_00_optim_states.pt` files, deepspeed_zero0_moe.is_zero0_moe),
  every EP rank's whole optimizer (deepspeed_zero0_moe.inspect_zero0_moe_checkpoint);
- every other save: ZeRO-1/2/3, AutoTP, native MoE, AutoEP (deepspeed_inspect.inspect_checkpoint).
File names alone decide (no pickle is read to choose), so every worker that sees the tag directory
chooses alike.
"""
from __future__ import annotations

import os
from collections.abc import Callable

from reshard.formats.deepspeed_files.deepspeed_inspect import inspect_checkpoint, inspect_pipeline_columns, resolve_tag
from reshard.formats.deepspeed_files.deepspeed_pipeline import is_pipeline
from reshard.formats.deepspeed_files.deepspeed_spec import SourceCheckpoint
from reshard.formats.deepspeed_files.deepspeed_zero0_moe import inspect_zero0_moe_checkpoint, is_zero0_moe

SAVE_KINDS: tuple[tuple[Callable[[str], bool], Callable[..., SourceCheckpoint]], ...] = (
    (is_pipeline, inspect_pipeline_columns),
    (is_zero0_moe, inspect_zero0_moe_checkpoint),
)
"""(recognise(tag_dir), inspect(save_dir, tag, *, trust_pickle, read_tensors)) per kind of save with an
inspector of its own, asked in order; a save none recognises is inspected by `inspect_checkpoint`."""


def inspect_save(save_dir: str | os.PathLike, tag: str | None = None, *, trust_pickle: bool = False,
                 read_tensors: bool = True) -> SourceCheckpoint:
    """The save at `save_dir`/`tag` (`latest`'s when None) inspected as the kind of save its file names say
    it is (`SAVE_KINDS`), pickles only; a CheckpointError or UnsupportedCheckpoint naming the file where it
    cannot be resharded."""
    save_dir = os.fspath(save_dir)
    tag = resolve_tag(save_dir, tag)
    tag_dir = os.path.join(save_dir, tag)
    inspect = next((inspect for recognise, inspect in SAVE_KINDS if recognise(tag_dir)), inspect_checkpoint)
    return inspect(save_dir, tag, trust_pickle=trust_pickle, read_tensors=read_tensors)
