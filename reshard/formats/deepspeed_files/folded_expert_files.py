"""Write the per-expert model-states files of an AutoEP target when TP is involved (folded or not).

    from reshard.formats.deepspeed_files.folded_expert_files import target_expert_files, write_expert_files
    names = target_expert_files(source, target)                 # name -> source file it comes from
    hashes = write_expert_files(source, target, staging.tag_dir, sorted(names)[rank::workers])

A plain AutoEP save names every expert file `..._mp_rank_00_...` and holds only the expert's
weights, so those files are copied whole. With AutoTP layers the file of expert G is written
under the TP rank of every rank that loads it, with that writer's `folding` metadata
(`reshard.formats.deepspeed_files.deepspeed_folding`): each target file is read from one source file of the
same expert (any TP rank: experts are never split by TP, DeepSpeed writes the same weights), its
weights kept bit for bit and its `folding` recomputed for the target (dropped for an unfolded
one, whose engine refuses it). The files are a few weights each: loaded whole.
"""
from __future__ import annotations

import os

from reshard.files.byte_io import hash_file
from reshard.formats.deepspeed_files import deepspeed_schema as schema
from reshard.formats.deepspeed_files.deepspeed_folding import FOLDING_KEY, expert_files, expert_folding
from reshard.formats.deepspeed_files.deepspeed_spec import SourceCheckpoint
from reshard.formats.torch_bytes.torch_archive import load_checked
from reshard.topology import Topology


def rewrites_expert_files(source: SourceCheckpoint) -> bool:
    """AutoEP with AutoTP layers: expert files are rewritten, not copied (deepspeed_inspect keeps them out of other_files)."""
    return source.spec.experts is not None and source.spec.tensor is not None


def target_expert_files(source: SourceCheckpoint, target: Topology) -> dict[str, tuple[str, int, int]]:
    """Target expert file name -> (source file name, its TP rank in the target, writer rank)."""
    spec = source.spec
    if spec.stage == 3:  # `zero3_partitioned`: the experts live in the ZeRO partitions only
        return {}
    by_expert = {}
    for name, (layer, expert, _, _) in expert_files(spec.experts.num_experts, spec.topology).items():
        by_expert.setdefault((layer, expert), name)  # the lowest source TP rank's copy
    return {name: (by_expert[(layer, expert)], tp_rank, writer)
            for name, (layer, expert, tp_rank, writer) in expert_files(spec.experts.num_experts, target).items()}


def expert_file_state(source: SourceCheckpoint, target: Topology, name: str, *, trust_pickle: bool = False) -> dict:
    """The contents of target expert file `name`: the source weights, `folding` for the target."""
    source_name, tp_rank, writer = target_expert_files(source, target)[name]
    path = os.path.join(source.tag_dir, source_name)
    # only for the expert files of a TP-involved AutoEP target, loaded whole (read, not mapped)
    state = load_checked(path, schema.safe_globals(), trust_pickle, mmap=False)
    state.pop(FOLDING_KEY, None)
    folding = expert_folding(target, tp_rank, writer)
    if folding is not None:
        state[FOLDING_KEY] = folding  # engine.py `_save_moe_checkpoint`: after the weights
    return state


def write_expert_files(source: SourceCheckpoint, target: Topology, tag_dir: str, names, *,
                       trust_pickle: bool = False) -> dict:
    """Write target expert files `names` into `tag_dir`; {name: {"bytes", "blake3"}} of each."""
    import torch  # whole files, as DeepSpeed saves them

    out = {}
    for name in names:
        destination = os.path.join(tag_dir, name)
        torch.save(expert_file_state(source, target, name, trust_pickle=trust_pickle), destination)
        out[name] = {"bytes": os.path.getsize(destination), "blake3": hash_file(destination)}
    return out
