"""ZeRO-3 client_state: which keys hold different values on different source ranks.

    from reshard.formats.deepspeed_files.deepspeed_client_state import differing_client_state
    differing_client_state(source)            # ["data_position", "rng"]: per-rank values

`engine.save_checkpoint(dir, client_state=...)` merges client_state into the top level of the
model-states file (engine.py `_save_checkpoint`: `state.update(client_state)`). Under ZeRO-3
every rank writes its own model-states file, so each rank's own values are saved (per-rank RNG
states, data positions). A target rank of another world size has no source rank of its own:
reshard gives every target rank source rank 0's client_state, as DeepSpeed gives every rank
of a ZeRO-1/2 job the one rank-0 file. This module finds the keys where that loses something,
so the job can say so. Keys DeepSpeed itself writes (`_common_checkpoint_state`) are not
client_state and are recomputed per target rank anyway.
"""
from __future__ import annotations

from reshard.formats.deepspeed_files import deepspeed_schema as schema
from reshard.formats.deepspeed_files.deepspeed_inspect import read_storages
from reshard.formats.deepspeed_files.deepspeed_spec import SourceCheckpoint
from reshard.formats.torch_bytes.torch_archive import TensorRef, load_portable, map_leaves, refs_in

DEEPSPEED_MODEL_KEYS = frozenset({
    # engine.py `_common_checkpoint_state`, `_checkpoint_parallel_metadata`, `_save_checkpoint`
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
    "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "skipped_steps", "global_steps",
    "global_samples", "dp_world_size", "mp_world_size", "checkpoint_parallel_dimensions", "ds_config",
    "ds_version", "universal_checkpoint_info", "ds_autoep_layers", "num_experts",
    # `_save_checkpoint`'s reserved_keys (client_state may not use them): a folded TP+EP save's `folding`
    # metadata (checkpoint/constants.py FOLDING_METADATA_KEY) and `autoep_layers`
    "folding", "autoep_layers",
})


def client_state_keys(model_tree: dict) -> list[str]:
    return [key for key in model_tree if key not in DEEPSPEED_MODEL_KEYS]


def differing_client_state(source: SourceCheckpoint, *, trust_pickle: bool = False, read_tensors: bool = True,
                           ranks=None) -> list[str]:
    """client_state keys whose value differs between any source rank and rank 0 (ZeRO-3 only).

    Tensors are compared by their bytes; with `read_tensors=False` (a dry run) by dtype, shape
    and layout only, so a difference in tensor values alone is then not seen. `ranks`: the source
    ranks to compare (default all; a node-local job compares the ranks its inspecting node holds)."""
    spec = source.spec
    keys = client_state_keys(source.model_template)
    if spec.stage != 3 or spec.dp_world_size == 1 or not keys:
        return []
    rank0 = _comparable(source.model_template, keys, source.model_path(0), read_tensors)
    differing = set()
    for rank in (range(1, spec.dp_world_size) if ranks is None else sorted(set(ranks) - {0})):
        path = source.model_path(rank)
        tree = load_portable(path, schema.safe_globals(), trust_pickle)
        if not isinstance(tree, dict):
            continue
        mine = _comparable(tree, [k for k in tree if k not in DEEPSPEED_MODEL_KEYS], path, read_tensors)
        differing |= {k for k in set(rank0) | set(mine) if rank0.get(k, _MISSING) != mine.get(k, _MISSING)}
    return sorted(differing)


_MISSING = ("<missing>",)


def _comparable(tree: dict, keys, path: str, read_tensors: bool) -> dict:
    subtrees = {key: tree[key] for key in keys}
    refs = [ref for ref in refs_in(subtrees) if isinstance(ref, TensorRef)]
    data = read_storages(path, refs) if read_tensors else {}

    def describe(ref):
        if not isinstance(ref, TensorRef):
            return ref
        storage = data.get(ref.storage_key)
        return ("tensor", ref.dtype, ref.shape, ref.stride, ref.storage_offset, storage)
    return {key: repr(map_leaves(value, describe, lambda x: isinstance(x, TensorRef))) for key, value in subtrees.items()}
