"""The per-rank metadata DeepSpeed writes beside the partitions, derived from a layout. Pure, no torch.

    from reshard.formats.deepspeed_files.deepspeed_metadata import rank_metadata
    meta = rank_metadata(spec, spec.layout(4), rank=1)
    meta.partition_count, meta.group_paddings, meta.slice_mappings, meta.fp32_numels

One function serves both directions: `deepspeed_inspect` checks a source rank's file against
it (a file from another world size or an unknown layout is refused), and `deepspeed_target`
writes a target rank's file from it. Rules, by DeepSpeed 0.19.8 file and function:
- ZeRO-1/2 (runtime/zero/stage_1_and_2.py `state_dict`): `partition_count` per group,
  `group_paddings` (`groups_padding`: tail padding inside this rank's partition),
  `param_alignment_paddings`, `param_slice_mappings` (`_create_param_mapping`), and the saved
  fp32 partition without its tail padding.
- BF16_Optimizer (runtime/bf16_optimizer.py `state_dict`): the whole tail padding as
  `group_paddings` of the last rank, the padded fp32 partition.
- ZeRO-3 (runtime/zero/stage3.py `_rigid_state_dict`): `partition_count` is an int; the
  sub-groups (`_create_fp16_sub_groups`) name the flat buffers and each param group lists its
  sub-group ids.
"""
from __future__ import annotations

from dataclasses import dataclass

from reshard.layouts.zero import buffer_numels


@dataclass(frozen=True)
class RankMetadata:
    """What one rank's optim-states file says about its partitions at one world size."""

    partition_count: int | list[int]
    """ZeRO-3: the world size; ZeRO-1/2 and BF16_Optimizer: the ranks each param group is
    partitioned over (the world size, or dp // ep for an MoE expert group)."""
    buffer_numels: tuple[int, ...]
    """Padded size of each flat buffer (optimizer states have this size)."""
    fp32_numels: tuple[int, ...]
    """Saved size of each fp32 partition (ZeRO-1/2 cut the tail padding off)."""
    group_paddings: list[int] | None = None
    param_alignment_paddings: list[list[int]] | None = None
    slice_mappings: list[list[tuple[str, int, int]]] | None = None
    """Per param group: (parameter name, numel, start in this rank's partition), DeepSpeed's order."""
    sub_group_ids: list[list[int]] | None = None
    """ZeRO-3: the sub-group ids of each param group (its torch param_group's `params`)."""
    partition_groups: list[dict] | None = None
    """AutoEP ZeRO-3: `ds_zero_partition_groups` (stage3.py `_zero3_partition_group_metadata`),
    which differs per rank and which DeepSpeed's load compares with its own."""


def _merged(mappings: list[tuple[str, int, int]]) -> list[tuple[str, int, int]]:
    """Adjacent fragments of one local parameter as one: AutoEP's fused expert tensor is several
    logical parameters (reshard.layouts.experts) that DeepSpeed maps as one. Names are otherwise
    unique, so this changes nothing else."""
    out: list[tuple[str, int, int]] = []
    for name, numel, start in mappings:
        if out and out[-1][0] == name and out[-1][2] + out[-1][1] == start:
            out[-1] = (name, out[-1][1] + numel, out[-1][2])
        else:
            out.append((name, numel, start))
    return out


def _local_paddings(layout, rank: int, group) -> list[int]:
    """One alignment padding per LOCAL parameter: the padding after the last logical parameter of
    each run of one name (AutoEP's fused experts; elsewhere names are unique)."""
    names = [layout.name_on_rank(p, rank) for p in group.flat_order]
    return [pad for i, pad in enumerate(group.alignment_paddings) if i + 1 == len(names) or names[i + 1] != names[i]]


def rank_metadata(spec, layout, rank: int) -> RankMetadata:
    """The metadata of rank `rank` of `layout` (a ZeRO layout of `spec` at some world size)."""
    sizes = buffer_numels(layout)
    if hasattr(layout, "sub_groups"):  # ZeRO-3, AutoEP's too (reshard.layouts.experts.ExpertZero3Layout)
        ids = [[i for i, sg in enumerate(layout.sub_groups) if sg.group == g] for g in range(len(spec.groups))]
        groups = (layout.partition_groups(rank, f"ep_size_{layout.topology.ep}")
                  if hasattr(layout, "partition_groups") else None)
        return RankMetadata(layout.world_size, sizes, sizes, sub_group_ids=ids, partition_groups=groups)
    held = layout.rank_groups(rank)
    numels = [p.numel for p in layout.params]  # TP-local shapes under tensor parallelism
    mappings = [_merged([(layout.name_on_rank(p, rank), numel, start) for p, numel, start in g.slice_mappings(index, numels)])
                for g, index in held]
    counts = [g.world_size for g, _ in held]
    if spec.optimizer == "zero":
        return RankMetadata(counts, sizes, tuple(g.lean_numel(index) for g, index in held),
                            group_paddings=[g.tail_padding(index) for g, index in held],
                            param_alignment_paddings=[_local_paddings(layout, rank, g) for g, _ in held],
                            slice_mappings=mappings)
    return RankMetadata(counts, sizes, sizes,
                        group_paddings=[g.bf16_optimizer_padding(index) for g, index in held], slice_mappings=mappings)
