"""Read what a DeepSpeed AutoTP checkpoint says about its tensor parallelism.

    from reshard.formats.deepspeed_files.deepspeed_tensor import tensor_parallel_spec
    tensor, global_params = tensor_parallel_spec(model_tree, model_path, tp=2, local_params=spec.params)
    tensor.params.splits[0]          # TensorSplit("column", 0)

DeepSpeed 0.19.8 writes, in every `mp_rank_XX_model_states.pt`, `universal_checkpoint_info`
(module_inject/layers.py `collect_autotp_universal_checkpoint_info`): pattern lists
(`parameter_with_row_parallelism_patterns`, `tp_replicated_parameter_patterns`,
`vocabulary_parameter_patterns` with `original_vocab_size`, `parameter_with_sub_params`,
`autotp_unsupported_parameter_patterns`) and an `affine_map` with each parameter's logical
(global) shape and per-rank shard shapes. Each parameter's split is read from the pattern
lists (row-parallel weights on dim 1, replicated whole, vocabulary-parallel on dim 0, every other
mapped parameter column-parallel on dim 0, as `LinearLayer` cuts it; a parameter of fused
sub-parameters over its affine map's logical view, each sub-parameter cut on its own, its
`sub_param_shard_widths`), and its shard shapes at the source TP size are checked against the
rule reshard writes targets with (`reshard.layouts.tensor_parallel.shard_sizes`), so a split sized some
other way is refused rather than misread. A tied alias of a trainable module tensor
(`shared_params`, e.g. a vocabulary-parallel `lm_head.weight` tied to `embed.weight`) is the
same view of the same storage in every TP rank's file; the target writes it as its owner's tensor.
"""
from __future__ import annotations

import math
import re

from reshard.errors import CheckpointError, UnsupportedCheckpoint
from reshard.formats.torch_bytes.torch_archive import TensorRef, refs_in
from reshard.layouts.zero import ParamSpec
from reshard.layouts.tensor_parallel import (
    REPLICATED,
    TensorParallelParams,
    TensorParallelSpec,
    TensorSplit,
    affine_map,
)

INFO = "universal_checkpoint_info"
ROW = "parameter_with_row_parallelism_patterns"
REPLICATED_PATTERNS = "tp_replicated_parameter_patterns"
VOCABULARY = "vocabulary_parameter_patterns"
ORIGINAL_VOCAB_SIZE = "original_vocab_size"
SUB_PARAMS = "parameter_with_sub_params"
SUB_PARAM_WIDTHS = "sub_param_shard_widths"
UNSUPPORTED = "autotp_unsupported_parameter_patterns"


def _name_of(pattern: str) -> str | None:
    """The parameter name of an exact-name pattern `^<re.escape(name)>$`, else None."""
    if not (pattern.startswith("^") and pattern.endswith("$")):
        return None
    name = re.sub(r"\\(.)", r"\1", pattern[1:-1])
    return name if re.fullmatch(pattern, name) else None


def _sub_param_dims(info: dict, model_path: str) -> dict[str, int]:
    """{pattern: partition dim} of `parameter_with_sub_params` (layers.py
    `collect_autotp_universal_checkpoint_info`: one entry per parameter, its view `shape` with the
    sub-parameter sizes at `partition_dim`)."""
    found = {}
    for entry in info.get(SUB_PARAMS) or ():
        if not isinstance(entry, dict) or not isinstance(entry.get("partition_dim"), int):
            raise UnsupportedCheckpoint(model_path, f"{SUB_PARAMS} entry {entry!r} has no partition_dim")
        for pattern in entry.get("patterns") or ():
            found[pattern] = entry["partition_dim"]
    return found


def _sub_param_split(info: dict, pattern: str, entry: dict, dim: int, ndim: int | None, model_path: str, tp: int,
                     grain: int) -> tuple[TensorSplit, tuple[int, ...]]:
    """The split of a parameter of fused sub-parameters, and its global shape. The affine map's
    logical shape is the view the layer spec's `shape` gives (layers.py `_infer_subparam_logical_shapes`);
    the parameter itself is that view as (leading, last) for a weight, flat for a bias. The
    saved map must be the one reshard writes for these sub-parameter sizes (checkpoint/affine.py
    `sub_param_map` over `get_shard_size` widths), else the split is refused, not misread."""
    name = _name_of(pattern)
    view = tuple(int(d) for d in entry.get("logical_shape", ()))
    widths = (info.get(SUB_PARAM_WIDTHS) or {}).get(pattern)
    if not widths or not 0 <= dim < len(view) or ndim not in (1, 2):
        raise UnsupportedCheckpoint(model_path, f"{name}: fused sub-parameters without {SUB_PARAM_WIDTHS}, or a "
                                                f"partition dim {dim} its logical shape {list(view)} does not have")
    split = TensorSplit("sub-parameter", dim, view, tuple(sum(int(w) for w in per_rank) for per_rank in widths))
    shape = (math.prod(view),) if ndim == 1 else (math.prod(view[:-1]), view[-1])
    if sum(split.parts) != view[dim] or _plain(entry) != affine_map(split, shape, tp, grain):
        raise UnsupportedCheckpoint(model_path, f"{name}: fused sub-parameter shards {widths} at {tp} TP ranks are "
                                                "not the per-sub-parameter split reshard applies; splits sized by "
                                                "attention heads are not supported yet")
    return split, shape


def _plain(value):
    """A saved affine map with its rank keys as ints and its tuples as lists, as reshard writes it."""
    if isinstance(value, dict):
        return {int(k) if isinstance(k, str) and k.isdigit() else k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _splits_from_info(info, model_path: str, tp: int, grain: int, ndims: dict) -> tuple[dict, list]:
    """{name: (split, global shape)} and [(pattern, split, shape)] from `universal_checkpoint_info`;
    `ndims`: {module tensor name: its number of dimensions}."""
    if not isinstance(info, dict) or not isinstance((info.get("affine_map") or {}).get("params"), dict):
        raise UnsupportedCheckpoint(model_path, f"has mp_world_size {tp} but no AutoTP {INFO} with an affine_map: "
                                                "only DeepSpeed AutoTP (tensor_parallel.autotp_size) checkpoints "
                                                "can be resharded across tensor parallelism")
    if info.get(UNSUPPORTED):
        raise UnsupportedCheckpoint(model_path, f"has parameters AutoTP marks unsupported for conversion "
                                                f"({UNSUPPORTED}: {dict(info[UNSUPPORTED])})")
    row = set(info.get(ROW) or ())
    replicated = set(info.get(REPLICATED_PATTERNS) or ())
    vocabulary = set(info.get(VOCABULARY) or ())
    mapped = info["affine_map"]["params"]
    _check_vocabulary(info, mapped, vocabulary - row - replicated, model_path)
    sub_params = _sub_param_dims(info, model_path)
    by_name, patterns = {}, []
    for pattern, entry in mapped.items():
        name = _name_of(pattern)
        if name is None:
            raise UnsupportedCheckpoint(model_path, f"affine_map pattern {pattern!r} does not name one parameter")
        shape = tuple(int(d) for d in entry.get("logical_shape", ()))
        if pattern in sub_params and pattern not in replicated:
            split, shape = _sub_param_split(info, pattern, entry, sub_params[pattern], ndims.get(name), model_path,
                                            tp, grain)
            by_name[name] = (split, shape)
            patterns.append((pattern, split, shape))
            continue
        split = REPLICATED if pattern in replicated else TensorSplit("row", 1) if pattern in row else \
            TensorSplit("vocabulary", 0) if pattern in vocabulary else TensorSplit("column", 0)
        if split.dim is not None and len(shape) <= split.dim:
            raise UnsupportedCheckpoint(model_path, f"{name} of shape {list(shape)} is {split.kind}-parallel on "
                                                    f"dimension {split.dim}, which it does not have")
        ranks = entry.get("ranks") or {}
        found = [tuple(int(d) for d in ranks.get(r, ranks.get(str(r), {})).get("shard_shape", ())) for r in range(tp)]
        expected = [split.local_shape(shape, tp, r, grain) for r in range(tp)]
        if found != expected:
            raise UnsupportedCheckpoint(model_path, f"{name}: AutoTP shard shapes {found} at {tp} TP ranks are not "
                                                    f"the even split reshard applies ({expected}); splits sized by "
                                                    "attention heads are not supported yet")
        by_name[name] = (split, shape)
        patterns.append((pattern, split, shape))
    return by_name, patterns


def _check_vocabulary(info: dict, mapped: dict, vocabulary: set, model_path: str) -> None:
    """Vocabulary-parallel parameters are mapped dim-0 splits, and `original_vocab_size` is the
    row count of one of them. AutoTP (module_inject/layers.py `collect_autotp_universal_checkpoint_info`)
    takes it from the first one's unsharded shape, so it never pads; `ds_to_universal.py`
    (`merge_tp_slices`) cuts every vocabulary parameter to it. A smaller value means padded rows,
    whose size for another TP reshard cannot know."""
    if not vocabulary:
        return
    missing = sorted(vocabulary - set(mapped))
    if missing:
        raise UnsupportedCheckpoint(model_path, f"vocabulary-parallel parameters {missing[:4]} have no affine_map entry")
    rows = {int((mapped[p].get("logical_shape") or [0])[0]) for p in vocabulary}
    original = info.get(ORIGINAL_VOCAB_SIZE)
    if original is not None and int(original) not in rows:
        raise UnsupportedCheckpoint(model_path, f"{ORIGINAL_VOCAB_SIZE} {original} is not the row count of a "
                                                f"vocabulary-parallel parameter ({sorted(rows)}): a padded "
                                                "vocabulary, which AutoTP does not write, is not supported")


def _vocabulary_head(config: dict, shapes: dict, aliases: dict, model_path: str) -> list[str]:
    """At TP 1, the module tensors a TP > 1 engine would split over the vocabulary with
    `tensor_parallel.vocab_parallel_lm_head`: the weight (and bias) of the `nn.Linear` whose
    last name segment is `lm_head` or `embed_out` (module_inject/auto_tp.py `_is_lm_head_name`),
    the weight under its owner's name when tied (`shared_params`: the embedding then becomes a
    `VocabParallelEmbedding` sharing the shard)."""
    tp_config = config.get("tensor_parallel") or {}
    if tp_config.get("vocab_parallel_lm_head") is not True:
        return []
    heads = [n for n in list(shapes) + list(aliases) if n.endswith(".weight")
             and n[:-len(".weight")].split(".")[-1] in ("lm_head", "embed_out")]
    if len(heads) != 1:
        raise UnsupportedCheckpoint(model_path, f"has vocab_parallel_lm_head but {len(heads)} lm_head/embed_out "
                                                f"weights ({heads[:4]}); DeepSpeed builds exactly one")
    weight = aliases.get(heads[0], heads[0])
    if len(shapes.get(weight, ())) != 2:
        raise UnsupportedCheckpoint(model_path, f"vocabulary-parallel head {heads[0]} is not a 2-D weight")
    bias = heads[0][:-len("weight")] + "bias"
    return [weight] + ([bias] if bias in shapes else [])


def _tuples(value):
    return tuple(_tuples(v) for v in value) if isinstance(value, (list, tuple)) else value


def _shape_spec_view(weight: tuple[int, ...], spec_shape, dim: int, where: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(logical view, sub-parameter sizes) of a weight under a layer spec's `shape`, as
    module_inject/layers.py `_infer_subparam_logical_shapes` resolves them: at `dim` a tuple of
    sizes, a sub-parameter count or -1 (one); elsewhere sizes or -1, one -1 inferred from the
    element count, several taken from the weight's own dimensions when the ranks agree."""
    shape = _tuples(spec_shape)
    if not isinstance(shape, tuple) or not 0 <= dim < len(shape):
        raise UnsupportedCheckpoint(where, f"layer spec shape {spec_shape} with partition_dim {dim} is not valid")
    at, count, sizes = shape[dim], None, None
    if isinstance(at, tuple):
        sizes = tuple(int(v) for v in at)
    elif isinstance(at, int) and at > 0:
        count = at
    dims = [None if i == dim or d == -1 else int(d) for i, d in enumerate(shape)]
    if sizes is not None:
        dims[dim] = sum(sizes)
    total, known = math.prod(weight), math.prod(d for d in dims if d is not None)
    unknown = [i for i, d in enumerate(dims) if d is None]
    if len(unknown) == 1 and known and total % known == 0:
        dims[unknown[0]] = total // known
    elif len(unknown) > 1 and len(shape) == len(weight):
        for i in unknown:
            dims[i] = weight[i]
    view = tuple(dims)
    if None in view or math.prod(view) != total or view[-1] != weight[-1] or \
            (count is not None and view[dim] % count):
        raise UnsupportedCheckpoint(where, f"layer spec shape {spec_shape} does not fit the weight {list(weight)}")
    parts = sizes or ((view[dim] // count,) * count if count else (view[dim],))
    return view, parts


def splits_from_layer_specs(model_tree: dict, model_path: str) -> tuple[dict, dict, list]:
    """At TP 1 DeepSpeed saves no `universal_checkpoint_info`, but the ds_config it saves holds the
    `tensor_parallel.partition_config.layer_specs` a TP > 1 engine applies. Mirrors
    module_inject/auto_tp.py `_replace` (a spec matches `<module>.weight` with re.match; column:
    weight and bias on dim 0; row: weight on dim 1, bias replicated; a spec with `shape`: the
    sub-parameter layers, `_shape_spec_view`) for modules with a 2-D weight (nn.Linear), and
    `vocab_parallel_lm_head` (`_vocabulary_head`); returns (info without an affine map, by_name,
    patterns)."""
    config = model_tree.get("ds_config") or {}
    tp_config = config.get("tensor_parallel") if isinstance(config, dict) else None
    partition = (tp_config or {}).get("partition_config") if isinstance(tp_config, dict) else None
    if not isinstance(partition, dict) or not partition.get("layer_specs"):
        raise UnsupportedCheckpoint(model_path, "has no AutoTP metadata (universal_checkpoint_info, or "
                                                "tensor_parallel.partition_config.layer_specs in its ds_config): "
                                                "how its parameters split across TP ranks is unknown")
    if partition.get("use_default_specs", True) or tp_config.get("preset_model"):
        raise UnsupportedCheckpoint(model_path, "was saved at TP 1 with AutoTP default specs or a preset_model; "
                                                "reshard follows only explicit layer_specs with use_default_specs false")
    specs = partition["layer_specs"]
    for spec in specs:
        if spec.get("model_types") or (spec.get("partition_dim") is not None and spec.get("shape") is None):
            raise UnsupportedCheckpoint(model_path, f"layer spec {spec} uses model_types, or partition_dim without "
                                                    "shape: at TP 1, where DeepSpeed saves no universal_checkpoint_info, "
                                                    "reshard does not derive such splits yet (from TP > 1 it does)")
    buffers = set(model_tree.get("buffer_names") or ())
    aliases = dict(model_tree.get("shared_params") or {})
    module = model_tree.get("module") or {}
    # DeepSpeed names each tensor once, by its owner (`collect_autotp_universal_checkpoint_info`)
    shapes = {name: tuple(ref.shape) for name, ref in module.items()
              if isinstance(ref, TensorRef) and name not in buffers and name not in aliases}
    # ZeRO-3 saves empty placeholders in `module`; the shapes are in param_shapes and frozen_param_shapes
    recorded = {name: tuple(int(d) for d in shape) for table in [*(model_tree.get("param_shapes") or []),
                                                                 model_tree.get("frozen_param_shapes") or {}]
                if isinstance(table, dict) for name, shape in table.items()}
    shapes = {name: recorded.get(name, shape) if math.prod(shape) == 0 else shape for name, shape in shapes.items()}
    kinds, rows, published = {}, set(), {}
    vocabulary = _vocabulary_head(config, shapes, aliases, model_path)
    for name in vocabulary:  # it supersedes a layer spec on the head (auto_tp.py `_warn_overridden_lm_head_spec`)
        kinds[name] = TensorSplit("column", 0)
    for name, shape in shapes.items():
        if not name.endswith(".weight") or name in kinds:
            continue
        spec = next((s for s in specs if any(re.match(p, name) for p in s.get("patterns", ()))), None)
        kind = str(spec.get("partition_type", "column")).lower() if spec else "skip"
        if kind == "skip":
            continue
        if len(shape) != 2:
            raise UnsupportedCheckpoint(model_path, f"{name} of shape {list(shape)} matches a {kind} layer spec; "
                                                    "only nn.Linear weights (2-D) are supported")
        bias = name[:-len("weight")] + "bias"
        if kind == "row":
            rows.add(name)
        if spec.get("shape") is not None:  # auto_tp.py: SubParamLinearLayer / SubParamLinearAllreduce
            dim = spec.get("partition_dim")
            dim = (0 if kind == "column" else 1) if dim is None else int(dim)  # TPLayerSpec.get_partition_dim
            view, parts = _shape_spec_view(shape, spec["shape"], dim, f"{model_path}: {name}")
            kinds[name] = TensorSplit("sub-parameter", dim, view, parts)
            published[name] = [_tuples(d) for d in spec["shape"]]
            published[name][dim] = parts
            if bias in shapes and kind == "column" and dim < len(view) - 1:  # layers.py `_bias_subparam_shape_spec`
                kinds[bias] = TensorSplit("sub-parameter", dim, view[:-1], parts)
                published[bias] = [*view[:dim], parts, *view[dim + 1:-1]]
            elif bias in shapes:
                kinds[bias] = REPLICATED
            continue
        kinds[name] = TensorSplit(kind, 0 if kind == "column" else 1)
        if bias in shapes:
            kinds[bias] = TensorSplit("column", 0) if kind == "column" else REPLICATED
    for name, split in kinds.items():
        # layers.py `collect_autotp_universal_checkpoint_info`: a 2-D dim-0 split named *embed* or *lm_head*
        if split.kind == "column" and len(shapes[name]) == 2 and ("embed" in name or "lm_head" in name):
            kinds[name] = TensorSplit("vocabulary", 0)
    vocabulary = [n for n, split in kinds.items() if split.dim == 0 and len(shapes[n]) == 2
                  and ("embed" in n or "lm_head" in n)]
    layer_owned = [n for n in shapes if n in kinds]
    untouched = [n for n in shapes if n not in kinds]
    patterns = [(rf"^{re.escape(n)}$", kinds.get(n, REPLICATED), shapes[n]) for n in layer_owned + untouched]
    info = {"universal_checkpoint_version": 0.4,
            ROW: sorted(rf"^{re.escape(n)}$" for n in rows),
            REPLICATED_PATTERNS: sorted(p for p, split, _ in patterns if split.dim is None),
            VOCABULARY: sorted(rf"^{re.escape(n)}$" for n in vocabulary),
            SUB_PARAMS: [{"patterns": [rf"^{re.escape(n)}$"], "shape": published[n], "partition_dim": kinds[n].dim}
                         for n in layer_owned if n in published],
            UNSUPPORTED: {}, "affine_map": {"version": 1, "params": {}}}
    if published:  # recomputed for each target TP (`TensorParallelSpec.universal_info`)
        info[SUB_PARAM_WIDTHS] = {rf"^{re.escape(n)}$": [] for n in layer_owned if n in published}
    first = next((n for n in shapes if n in vocabulary), None)  # the first in module order
    if first is not None:
        info[ORIGINAL_VOCAB_SIZE] = shapes[first][0]
    by_name = {_name_of(p): (split, shape) for p, split, shape in patterns}
    return info, by_name, patterns


_AUTOEP_ONLY_INFO = {"universal_checkpoint_version", "expert_parameter_patterns", "ds_autoep_layers"}


def is_autotp(model_tree: dict) -> bool:
    """The model states of an AutoTP engine: `universal_checkpoint_info`, or (TP 1) layer specs in ds_config.

    AutoEP alone writes `universal_checkpoint_info` too (engine.py `_save_moe_checkpoint`), with
    only its version, `expert_parameter_patterns` and `ds_autoep_layers`: that is not AutoTP."""
    info = model_tree.get(INFO)
    if info is not None and not (isinstance(info, dict) and set(info) <= _AUTOEP_ONLY_INFO):
        return True
    config = model_tree.get("ds_config") or {}
    tp_config = config.get("tensor_parallel") if isinstance(config, dict) else None
    partition = tp_config.get("partition_config") if isinstance(tp_config, dict) else None
    return isinstance(partition, dict) and bool(partition.get("layer_specs"))


def _grain(model_tree: dict) -> int:
    config = model_tree.get("ds_config") or {}
    tp_config = (config.get("tensor_parallel") or {}) if isinstance(config, dict) else {}
    nested = tp_config.get("tp") or tp_config.get("tensor_parallel") or {}
    return int(nested.get("tp_grain_size", 1) or 1) if isinstance(nested, dict) else 1


def tensor_parallel_spec(model_tree: dict, model_path: str, tp: int, local_params: tuple[ParamSpec, ...],
                         module_weights: bool = True) -> tuple[TensorParallelSpec, tuple[ParamSpec, ...]]:
    """The TP split of every parameter, and the trainable parameters with global shapes.

    `local_params`: the trainable parameters as TP rank 0's `param_shapes` list them. From the
    saved `universal_checkpoint_info`, or, at TP 1 where DeepSpeed writes none, from the
    `layer_specs` of the saved ds_config (`splits_from_layer_specs`). `module_weights`: the
    model states hold this TP rank's module weights (ZeRO-1/2); under ZeRO-3 `module` holds
    empty placeholders of the partitioned parameters, so no module tensor is resliced."""
    grain = _grain(model_tree)
    info = model_tree.get(INFO)
    if isinstance(info, dict) and set(info) <= _AUTOEP_ONLY_INFO and tp == 1:
        info = None  # AutoEP's own keys only (engine.py `_save_moe_checkpoint`): the split is in the layer specs
    if info is None and tp == 1:
        info, by_name, patterns = splits_from_layer_specs(model_tree, model_path)
    else:
        ndims = {name: len(ref.shape) for name, ref in (model_tree.get("module") or {}).items()
                 if isinstance(ref, TensorRef)}
        by_name, patterns = _splits_from_info(info, model_path, tp, grain, ndims)
    missing = [p.name for p in local_params if p.name not in by_name]
    if missing:
        raise UnsupportedCheckpoint(model_path, f"trainable parameters {missing[:4]} have no entry in the affine_map "
                                                f"of {INFO}: their tensor-parallel split is unknown")
    global_params = tuple(ParamSpec(p.name, by_name[p.name][1]) for p in local_params)
    params = TensorParallelParams(tuple(p.name for p in global_params), tuple(p.shape for p in global_params),
                                  tuple(by_name[p.name][0] for p in global_params), grain)
    wrong = [(p.name, p.shape, local) for p, local in zip(local_params, params.local_shapes(tp, 0))
             if tuple(p.shape) != tuple(local)]
    if wrong:
        raise CheckpointError(model_path, f"param_shapes {wrong[0][0]} {list(wrong[0][1])} is not TP rank 0's shard "
                                          f"{list(wrong[0][2])} of the affine_map's logical shape")

    module = model_tree.get("module") or {}
    trainable = {p.name for p in global_params}
    names = [name for name, ref in module.items() if isinstance(ref, TensorRef) and name in trainable] \
        if module_weights else []
    module_params = TensorParallelParams(tuple(names), tuple(by_name[n][1] for n in names),
                                         tuple(by_name[n][0] for n in names), grain)
    aliases = tuple((alias, owner) for alias, owner in (model_tree.get("shared_params") or {}).items()
                    if owner in names and alias in module)
    check_module_tree(model_tree, model_path, module_params, tp, 0, aliases)
    frozen = [name for name, ref in module.items() if isinstance(ref, TensorRef) and name in by_name
              and name not in trainable and by_name[name][0].dim is not None]
    if frozen:
        raise UnsupportedCheckpoint(model_path, f"frozen parameters {frozen[:4]} are tensor-parallel; resharding "
                                                "split frozen parameters is not supported yet")
    return TensorParallelSpec(params, module_params, info, tuple(patterns), aliases), global_params


def check_module_tree(model_tree: dict, model_path: str, module: TensorParallelParams, tp: int,
                      tp_rank: int, aliases: tuple[tuple[str, str], ...] = ()) -> dict:
    """Check the trainable module tensors of TP rank `tp_rank`'s model-states file; return
    {("module", j, "module"): TensorRef}. They are views of the flat lp buffers of the param
    groups; no other tensor of the file may share those buffers (they are not rewritten), except
    the tied `aliases` (alias, owner), each the very view its owner is."""
    tensors = model_tree.get("module") or {}
    for alias, owner in aliases:
        ref, mine = tensors.get(alias), tensors.get(owner)
        if not (isinstance(ref, TensorRef) and isinstance(mine, TensorRef) and
                (ref.storage_key, ref.storage_offset, tuple(ref.shape), tuple(ref.stride)) ==
                (mine.storage_key, mine.storage_offset, tuple(mine.shape), tuple(mine.stride))):
            raise CheckpointError(model_path, f"module tensor {alias} is tied to {owner} (shared_params) but is not "
                                              "the same tensor in this file")
    tied = {id(tensors[alias]) for alias, _ in aliases}
    refs = {}
    for j, name in enumerate(module.names):
        ref = tensors.get(name)
        want = module.local_shape(j, tp, tp_rank)
        if not isinstance(ref, TensorRef) or tuple(ref.shape) != tuple(want):
            found = list(ref.shape) if isinstance(ref, TensorRef) else "nothing"
            raise CheckpointError(model_path, f"module tensor {name} is {found}, TP rank {tp_rank} of {tp} holds "
                                              f"{list(want)} of it")
        if not ref.is_contiguous:
            raise UnsupportedCheckpoint(model_path, f"module tensor {name} is not contiguous")
        refs[("module", j, "module")] = ref
    storages = {ref.storage_key for ref in refs.values()}
    mine = {id(ref) for ref in refs.values()} | tied
    for ref in refs_in(model_tree):
        if isinstance(ref, TensorRef) and ref.storage_key in storages and id(ref) not in mine:
            raise UnsupportedCheckpoint(model_path, f"a tensor other than the trainable module weights shares their "
                                                    f"storage (at byte {ref.storage_key}); cannot reslice it")
    return refs


def module_dtype(model_tree: dict, model_path: str, module: TensorParallelParams) -> str | None:
    tensors = model_tree.get("module") or {}
    dtypes = {tensors[name].dtype for name in module.names}
    if len(dtypes) > 1:
        raise UnsupportedCheckpoint(model_path, f"trainable module tensors of mixed dtypes {sorted(dtypes)}")
    return dtypes.pop() if dtypes else None
