"""AutoEP's `ds_autoep_layers` metadata: read from a source, recomputed for a target. Pure, no torch.

    from reshard.formats.deepspeed_files.deepspeed_autoep import read_autoep_layers, target_autoep_layers
    layers = read_autoep_layers(model_tree["ds_autoep_layers"], model_path)   # refuses what is not supported
    layers.num_experts, layers.prefixes, layers.ep
    tree["ds_autoep_layers"] = target_autoep_layers(model_tree["ds_autoep_layers"], Topology(dp=4, ep=2))

DeepSpeed 0.19.8 writes one entry per AutoEP layer into the ZeRO-1/2 model-states file
(runtime/engine.py `_save_moe_checkpoint`), as seen by the writing rank (dp rank 0, so EP rank 0
and expert-data-parallel rank 0), and the same list under `universal_checkpoint_info`. What
depends on the topology is recomputed here, mirroring:
- checkpoint/autoep_affine.py `legacy_uniform_autoep_placement_descriptor`: the placement
  `{version, num_experts, ep_size, ranks: [{rank, experts}]}`, EP rank e holding experts
  e*n .. e*n+n-1 (module_inject/auto_ep_layer.py builds exactly this one);
- `autoep_placement_to_affine_map` + checkpoint/affine.py `ParamAffineMap.to_dict`: per fused
  weight one piece per EP rank, the rank's block of the logical [E, ...] tensor;
- `num_local_experts`, `ep_size`, `ep_group_name` (`ep_size_{ep}`), `ep_rank`, expert data-parallel
  rank and size, `global_expert_start/end` of the writing rank.
Everything else (module paths, key prefixes, layer ids, checkpoint_format) is carried over.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass

from reshard.errors import CheckpointError, UnsupportedCheckpoint
from reshard.topology import Topology

AUTOEP_LAYERS_KEY = "ds_autoep_layers"
PER_EXPERT_FILES = "per_expert_files"
"""checkpoint_format of ZeRO-1/2 AutoEP: experts in layer_{L}_expert_{G}_... files."""
ZERO3_PARTITIONED = "zero3_partitioned"
"""checkpoint_format of ZeRO-3 AutoEP: experts only in the ZeRO-3 partitions, no expert files."""
_PLACEMENT_VERSION = 1
_AFFINE_MAP_VERSION = 1
_WEIGHTS = ("w1", "w2", "w3")


@dataclass(frozen=True)
class AutoEPLayers:
    """What reshard needs of a source's AutoEP layers."""

    num_experts: tuple[int, ...]
    prefixes: tuple[str, ...]
    """Per layer, the expert key prefix through `experts.` (`model.layers.0.mlp.experts.`)."""
    ep: int
    zero3: bool
    """`zero3_partitioned`: every rank's model states hold its own entries (its EP rank)."""


def uniform_placement(num_experts: int, ep: int) -> dict:
    """checkpoint/autoep_affine.py `legacy_uniform_autoep_placement_descriptor`, key order included."""
    n = num_experts // ep
    return {"version": _PLACEMENT_VERSION, "num_experts": num_experts, "ep_size": ep,
            "ranks": [{"rank": r, "experts": list(range(r * n, (r + 1) * n))} for r in range(ep)]}


def _row_major_strides(shape: tuple[int, ...]) -> list[int]:
    return [math.prod(shape[axis + 1:]) for axis in range(len(shape))]


def uniform_affine_map(logical_shape: tuple[int, ...], ep: int) -> dict:
    """`autoep_placement_to_affine_map(uniform_placement(...), logical_shape).to_dict()`: each
    EP rank's contiguous block of experts is one piece held by that rank alone."""
    num_experts, expert_shape = logical_shape[0], tuple(logical_shape[1:])
    n = num_experts // ep
    shard = (n, *expert_shape)
    return {"logical_shape": list(logical_shape),
            "ranks": {r: {"shard_shape": list(shard),
                          "pieces": [{"shape": list(shard),
                                      "source": [r * n * math.prod(expert_shape), _row_major_strides(logical_shape)],
                                      "dest": [0, _row_major_strides(shard)],
                                      "locations": [r]}]}
                      for r in range(ep)}}


def read_autoep_layers(entries, path: str) -> AutoEPLayers:
    """Check a source's `ds_autoep_layers` and say what reshard needs of it; refuse, naming
    `path`, what it cannot reshard."""
    if not isinstance(entries, list) or not entries or not all(isinstance(e, dict) for e in entries):
        raise CheckpointError(path, f"has {AUTOEP_LAYERS_KEY} {type(entries).__name__}, expected a list of "
                                    "per-layer dicts (engine.py `_save_moe_checkpoint`)")
    num_experts, prefixes, eps, formats = [], [], set(), set()
    for layer, entry in enumerate(entries):
        try:
            count, ep, prefix = int(entry["num_experts"]), int(entry["ep_size"]), str(entry["expert_key_prefix"])
            layer_id, fmt, placement = entry["moe_layer_id"], entry.get("checkpoint_format"), entry.get("expert_placement")
        except (KeyError, TypeError, ValueError) as error:
            raise CheckpointError(path, f"{AUTOEP_LAYERS_KEY}[{layer}] lacks {error}") from None
        if layer_id != layer:
            raise CheckpointError(path, f"{AUTOEP_LAYERS_KEY}[{layer}] has moe_layer_id {layer_id}; expected the "
                                        "layers in order")
        if fmt not in (PER_EXPERT_FILES, ZERO3_PARTITIONED):
            raise UnsupportedCheckpoint(path, f"is an AutoEP checkpoint in the {fmt!r} format; reshard knows "
                                              f"{PER_EXPERT_FILES!r} (ZeRO-1/2) and {ZERO3_PARTITIONED!r} (ZeRO-3)")
        if fmt == ZERO3_PARTITIONED and entry.get("checkpoint_format_version") != 1:
            raise UnsupportedCheckpoint(path, f"AutoEP layer {layer} is in {ZERO3_PARTITIONED!r} format version "
                                              f"{entry.get('checkpoint_format_version')!r}; reshard knows version 1")
        formats.add(fmt)
        if count % ep or placement is not None and placement != uniform_placement(count, ep):
            raise UnsupportedCheckpoint(path, f"AutoEP layer {layer} places its {count} experts over ep={ep} other "
                                              "than in contiguous equal blocks; not supported")
        if entry.get("ep_group_name") not in (None, f"ep_size_{ep}"):
            raise UnsupportedCheckpoint(path, f"AutoEP layer {layer} is folded with tensor parallelism "
                                              f"(group {entry.get('ep_group_name')!r}); not supported")
        num_experts.append(count)
        prefixes.append(prefix + ".")
        eps.add(ep)
    if len(eps) != 1:
        raise UnsupportedCheckpoint(path, f"AutoEP layers have different ep sizes {sorted(eps)}")
    if len(formats) != 1:
        raise CheckpointError(path, f"AutoEP layers are saved in several formats {sorted(formats)}")
    return AutoEPLayers(tuple(num_experts), tuple(prefixes), eps.pop(), formats.pop() == ZERO3_PARTITIONED)


def target_autoep_layers(entries: list[dict], target: Topology, rank: int = 0) -> list[dict]:
    """The source's entries as global rank `rank` of `target` would write them (see the module
    docstring; ZeRO-1/2 write rank 0's only, ZeRO-3 every rank its own)."""
    ep_rank, expert_dp_rank = target.expert_parallel_rank(rank), target.expert_data_parallel_rank(rank)
    out = []
    for entry in entries:
        new = copy.deepcopy(entry)
        count, ep = entry["num_experts"], target.ep
        n = count // ep
        new["num_local_experts"] = n
        new["ep_size"] = ep
        if "expert_placement" in new:
            new["expert_placement"] = uniform_placement(count, ep)
        maps = (new.get("affine_maps") or {}).get("params")
        if isinstance(maps, dict):
            for name, old in maps.items():
                maps[name] = uniform_affine_map(tuple(old["logical_shape"]), ep)
        new["ep_group_name"] = f"ep_size_{ep}"
        new["ep_rank"] = ep_rank
        new["expert_data_parallel_rank"] = expert_dp_rank
        new["expert_data_parallel_world_size"] = target.expert_dp
        new["global_expert_start"] = ep_rank * n
        new["global_expert_end"] = (ep_rank + 1) * n
        out.append(new)
    return out
