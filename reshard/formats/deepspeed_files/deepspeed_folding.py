"""AutoEP folded with AutoTP: the `folding` metadata and the expert file names DeepSpeed 0.19.8 writes. Pure.

    from reshard.formats.deepspeed_files.deepspeed_folding import expert_file_names, optim_folding
    expert_file_names((4, 4), Topology(dp=2, tp=2, ep=2))   # layer_0_expert_0_mp_rank_00_..., expert_2 mp_rank_01 ...
    optim_folding(Topology(dp=2, tp=2, ep=2), rank=3, param_shapes=[...], expert_groups=(False, False, True))

Which rank belongs to which TP, dense-DP, EP and expert-DP group is `reshard.topology`'s business
(DeepSpeed's module_inject/auto_ep_folding.py `expected_folding_group_tables`). This module says
what a folded save writes about it, by DeepSpeed file and function:
- every file has a top-level `folding` dict (checkpoint/autoep_universal.py
  `make_folding_metadata`, called through engine.py `_make_autoep_folding_metadata`): version 1,
  tp_size, tp_rank, ep_size, ep_rank, etp_size 1, etp_rank 0, the ZeRO partition group, rank and
  count of the file's family, dispatch strategy, shared-expert placement, family;
- the model states of TP rank t (engine.py `_save_moe_checkpoint`, written by dense dp rank 0,
  i.e. global rank t): family `dense` over `dense_dp`, rank 0 of dp, EP rank t % ep, and
  `param_families` naming each module key `router_gate_replicated` (`.router.`), `shared_expert`
  (`.shared_experts`) or `dense` (`_autoep_non_expert_param_families`);
- the optim states of global rank r (engine.py `_save_zero_checkpoint`): family
  `zero_optimizer_state`, group `per_family`, rank and count of the optimizer's dp group (the
  dense dp rank and dp), EP rank r % ep, and `param_families` over the LOCAL names of
  `param_shapes` (fused expert names): `routed_expert` over `edp` (rank r // ep of S // ep) or the
  dense families over `dense_dp` (`_autoep_zero_optimizer_param_families`). The load compares
  this per-parameter table with its own (`_get_all_zero_checkpoint_state_dicts`), so it is
  recomputed per target rank;
- expert files: every rank of dense dp rank < ep writes its EP rank's experts under its own TP
  rank (`autoep_expert_writer`, `_get_expert_ckpt_name` with `checkpoint_mp_rank`), so the files
  are one per (expert, TP rank of a rank of that EP rank), which is exactly what every rank
  loads (`load_moe_state_dict`); family `routed_expert` over `edp`. Several ranks write the same
  file; their `zero_partition_rank` (not validated on load) differs, reshard writes the lowest
  writer's.
The loader validates tp_size, ep_size and etp_size always, and the ranks, group, count and
family of each file it reads; a `folding` dict in a checkpoint loaded by an unfolded engine is
refused (`_validate_autoep_folding_checkpoint_metadata`), so an unfolded target has none.
"""
from __future__ import annotations

from typing import Sequence

from reshard.errors import CheckpointError
from reshard.layouts.expert_placement import ExpertPlacement
from reshard.formats.deepspeed_files import deepspeed_schema as schema
from reshard.topology import Topology

FOLDING_KEY = "folding"
"""checkpoint/constants.py FOLDING_METADATA_KEY."""


def family_of(name: str) -> str:
    """engine.py `_autoep_param_family`."""
    if ".experts." in name:
        return "routed_expert"
    if ".router." in name:
        return "router_gate_replicated"
    if ".shared_experts" in name:
        return "shared_expert"
    return "dense"


def _non_expert_family(name: str) -> str:
    """engine.py `_autoep_non_expert_param_families` (no `routed_expert`: the module states hold no experts)."""
    if ".router." in name:
        return "router_gate_replicated"
    if ".shared_experts" in name:
        return "shared_expert"
    return "dense"


def folding_metadata(topology: Topology, *, tp_rank: int, ep_rank: int, group: str, partition_rank: int,
                     partition_count: int, family: str, param_families: dict | None = None) -> dict:
    """checkpoint/autoep_universal.py `make_folding_metadata`, key for key in its order."""
    metadata = {"version": 1, "tp_size": topology.tp, "tp_rank": tp_rank, "ep_size": topology.ep, "ep_rank": ep_rank,
                "etp_size": 1, "etp_rank": 0, "zero_partition_group": group, "zero_partition_rank": partition_rank,
                "zero_partition_count": partition_count, "dispatch_strategy": "route_full_partition_dispatch",
                "shared_expert_placement": "tp_sharded", "family": family}
    if param_families is not None:
        metadata["param_families"] = dict(param_families)
    return metadata


def model_folding(topology: Topology, rank: int, module_keys: Sequence[str]) -> dict:
    """The `folding` of the model-states file global rank `rank` writes (ZeRO-1/2: rank t, dp 0,
    writes TP rank t's file; ZeRO-3: every rank its own)."""
    at = topology.coordinates(rank)
    return folding_metadata(topology, tp_rank=at.tp, ep_rank=topology.expert_parallel_rank(rank),
                            group="dense_dp", partition_rank=at.dp, partition_count=topology.dp, family="dense",
                            param_families={key: _non_expert_family(key) for key in module_keys})


def optim_folding(topology: Topology, rank: int, param_shapes: Sequence[Sequence[str]] | None,
                  expert_groups: Sequence[bool]) -> dict:
    """The `folding` of global rank `rank`'s optim-states file; `param_shapes`: the local names of
    each param group, as its model states list them (None at ZeRO-3, where DeepSpeed records the
    partitions in `ds_zero_partition_groups` instead: `_autoep_zero_optimizer_param_families`)."""
    at = topology.coordinates(rank)
    expert_dp_rank = topology.expert_data_parallel_rank(rank)
    families = None if param_shapes is None else {}
    for names, is_expert in zip(param_shapes or (), expert_groups):
        for name in names:
            family = family_of(name)
            routed = family == "routed_expert"
            families[name] = {"family": family, "zero_partition_group": "edp" if routed else "dense_dp",
                              "zero_partition_rank": expert_dp_rank if is_expert else at.dp,
                              "zero_partition_count": topology.expert_dp if is_expert else topology.dp}
    return folding_metadata(topology, tp_rank=at.tp, ep_rank=topology.expert_parallel_rank(rank), group="per_family",
                            partition_rank=at.dp, partition_count=topology.dp, family="zero_optimizer_state",
                            param_families=families)


def expert_writers(topology: Topology) -> dict[tuple[int, int], int]:
    """(EP rank, TP rank) -> the lowest global rank that writes that EP rank's experts under that
    TP rank (plain AutoEP: EP rank e's experts under TP rank 0, written by expert-DP rank 0)."""
    if not topology.folded:
        return {(e, 0): topology.expert_dp_rank_of(e, 0) for e in range(topology.ep)}
    writers: dict[tuple[int, int], int] = {}
    for rank in range(topology.dp * topology.tp):
        writers.setdefault((topology.expert_parallel_rank(rank), topology.coordinates(rank).tp), rank)
    return writers


def expert_files(num_experts: Sequence[int], topology: Topology) -> dict[str, tuple[int, int, int, int]]:
    """name -> (MoE layer, global expert, TP rank, writer rank) of every expert file a save at `topology` holds."""
    out = {}
    for layer, count in enumerate(num_experts):
        placement = ExpertPlacement(count, topology.ep)
        for (ep_rank, tp_rank), writer in sorted(expert_writers(topology).items()):
            for local in range(placement.local_count):
                expert = placement.global_expert(ep_rank, local)
                out[schema.expert_file_name(layer, expert, tp_rank)] = (layer, expert, tp_rank, writer)
    return dict(sorted(out.items()))


def expert_file_names(num_experts: Sequence[int], topology: Topology) -> list[str]:
    return list(expert_files(num_experts, topology))


def expert_folding(topology: Topology, tp_rank: int, writer: int) -> dict | None:
    """The `folding` of an expert file of TP rank `tp_rank` written by global rank `writer` (None unfolded)."""
    if not topology.folded:
        return None
    return folding_metadata(topology, tp_rank=tp_rank, ep_rank=topology.expert_parallel_rank(writer), group="edp",
                            partition_rank=topology.expert_data_parallel_rank(writer),
                            partition_count=topology.expert_dp, family="routed_expert")


def check_folding_metadata(tree: dict, path: str, topology: Topology, tp_rank: int) -> None:
    """The model states of TP rank `tp_rank` must say the sizes the files do (DeepSpeed would refuse
    to load them otherwise; reshard will not guess which is right)."""
    folding = tree.get(FOLDING_KEY) if isinstance(tree, dict) else None
    if not isinstance(folding, dict):
        raise CheckpointError(path, f"has {topology.tp} TP ranks and AutoEP experts (ep={topology.ep}) but no "
                                    "folding metadata (DeepSpeed writes it for AutoEP folded with AutoTP)")
    want = {"tp_size": topology.tp, "ep_size": topology.ep, "tp_rank": tp_rank, "zero_partition_count": topology.dp}
    wrong = {key: folding.get(key) for key, value in want.items() if folding.get(key) != value}
    if wrong:
        raise CheckpointError(path, f"folding metadata says {wrong}, but the files say {want} "
                                    f"({topology.describe()})")
