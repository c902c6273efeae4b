"""Read a DeepSpeed save directory into a `SourceCheckpoint`: what it is, where its tensors are.

    from reshard.formats.deepspeed_files.deepspeed_inspect import inspect_checkpoint
    source = inspect_checkpoint("/ckpt/run1")            # tag from /ckpt/run1/latest
    print(source.spec.describe())                        # ZeRO-2 fp32, 4 dp ranks, ...
    refs = source_rank_tensors(source, rank=3, target=None)   # where rank 3's partitions sit

Only pickles are read here (map_location="meta"); tensor bytes stay on disk. The spec is
derived from the rank-0 files and checked against DeepSpeed's own metadata (paddings,
partition counts, slice mappings), so a layout reshard does not understand is refused
instead of silently misread. Every other rank's files are checked the same way by the
worker that reads them (`source_rank_tensors`).
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

from reshard.files.byte_io import pread_exact
from reshard.errors import CheckpointError, ReshardError, UnsupportedCheckpoint
from reshard.formats.deepspeed_files import deepspeed_schema as schema
from reshard.formats.deepspeed_files import deepspeed_tensor
from reshard.formats.deepspeed_files.deepspeed_folding import FOLDING_KEY
from reshard.formats.deepspeed_files.deepspeed_metadata import rank_metadata
from reshard.formats.deepspeed_files.deepspeed_rank_values import (
    MODEL_VALUES,
    compare,
    describe,
    model_rank_values,
    optim_rank_values,
    refuse,
)
from reshard.formats.deepspeed_files.deepspeed_spec import (
    CheckpointSpec,
    SourceCheckpoint,
    itemsize,
)
from reshard.layouts.experts import ExpertParams
from reshard.layouts.expert_placement import expert_name_parts
from reshard.formats.deepspeed_files.deepspeed_autoep import AUTOEP_LAYERS_KEY, read_autoep_layers
from reshard.formats.torch_bytes.torch_archive import (
    TensorRef,
    load_portable,
    refs_in,
)
from reshard.layouts.zero import (
    DEFAULT_SUB_GROUP_SIZE,
    ParamSpec,
    buffer_numels,
    param_alignment_elements,
    undo_round_robin,
    zero3_chunk,
    zero12_layout,
)
from reshard.files.paths import check_tag
from reshard.planning.plan import Stream
from reshard.topology import Topology

OPT = schema.OPTIM


def resolve_tag(save_dir: str, tag: str | None) -> str:
    if not os.path.isdir(save_dir):
        raise CheckpointError(save_dir, "is not a directory (expected a DeepSpeed save_dir)")
    if tag is None:
        latest = os.path.join(save_dir, schema.LATEST)
        if not os.path.isfile(latest):
            tags = sorted(d for d in os.listdir(save_dir) if os.path.isdir(os.path.join(save_dir, d)))
            hint = f"; tag directories here: {', '.join(tags)}" if tags else ""
            raise CheckpointError(latest, f"does not exist, so the tag is unknown: pass --tag TAG{hint}")
        with open(latest) as fd:
            tag = fd.read().strip()
        if not tag:
            raise CheckpointError(latest, "is empty: it should hold the tag of the checkpoint")
        check_tag(tag, "latest", latest)
        if not os.path.isdir(os.path.join(save_dir, tag)):
            raise CheckpointError(os.path.join(save_dir, tag), f"does not exist, but {latest} names tag {tag!r}")
    elif check_tag(tag, "--tag") and not os.path.isdir(os.path.join(save_dir, tag)):
        raise CheckpointError(os.path.join(save_dir, tag), f"does not exist: no tag {tag!r} in {save_dir}")
    return tag


def pipeline_tag_of(save_dir: str, tag: str | None) -> str | None:
    """The tag (given, or `latest`'s) when it is a PipelineModule save, else None (a source whose tag
    cannot be found is left to the caller's own inspection, which reports it)."""
    from reshard.formats.deepspeed_files.deepspeed_pipeline import is_pipeline
    try:
        tag = resolve_tag(save_dir, tag)
    except ReshardError:
        return None
    return tag if is_pipeline(os.path.join(save_dir, tag)) else None


def inspect_checkpoint(save_dir: str | os.PathLike, tag: str | None = None, *, trust_pickle: bool = False,
                       carry_model_bytes: bool | None = None, read_tensors: bool = True,
                       node_local: bool = False) -> SourceCheckpoint:
    """Read the rank-0 pickles of a save directory into a SourceCheckpoint.

    `carry_model_bytes`: read the unpartitioned tensors of the model-states template into
    memory (default: only under ZeRO-3, where every target rank needs them; the ZeRO-1/2
    model file is copied file to file by one worker instead). `read_tensors=False` reads
    no tensor bytes at all (a dry run): `carried` stays empty. `node_local`: this directory is
    one node's part of the checkpoint (reshard.jobs.node_local), so other ranks' files may be missing
    here; the job checks that every file is on some node.
    """
    save_dir = os.path.abspath(os.fspath(save_dir))
    tag = resolve_tag(save_dir, tag)
    tag_dir = os.path.join(save_dir, tag)
    if os.path.isdir(os.path.join(tag_dir, "offloaded_tensors")):
        raise UnsupportedCheckpoint(os.path.join(tag_dir, "offloaded_tensors"),
                                    "holds NVMe-offloaded optimizer state (zero_optimization.offload_optimizer "
                                    "to nvme); resharding it is not supported yet")
    roles = {name: schema.classify(name) for name in sorted(os.listdir(tag_dir))
             if os.path.isfile(os.path.join(tag_dir, name))}
    _refuse_unsupported_files(tag_dir, roles, node_local)
    optim = {n: r for n, r in roles.items() if r.kind == "optim"}
    if not optim:
        raise UnsupportedCheckpoint(tag_dir, "holds no *_optim_states.pt files, so it is not a ZeRO checkpoint "
                                              "(a ZeRO-0/DDP checkpoint loads at any data-parallel size as it is)")
    mp_ranks = {r.mp_rank for r in roles.values() if r.mp_rank is not None}
    prefixes = {r.bf16 for r in optim.values()}
    if len(prefixes) > 1:
        raise CheckpointError(tag_dir, "mixes bf16_zero_pp_rank_* and zero_pp_rank_* optim files: "
                                       "two different saves in one tag directory")
    bf16_prefix = prefixes.pop()
    stage3 = any(r.kind == "zero3_model" for r in roles.values())

    model_name = schema.model_file_name(3 if stage3 else 1)
    model_path = os.path.join(tag_dir, model_name)
    if not os.path.isfile(model_path):
        raise CheckpointError(model_path, "is missing: every ZeRO checkpoint has this model-states file")
    model_meta = load_portable(model_path, schema.safe_globals(), trust_pickle)
    if not isinstance(model_meta, dict) or "dp_world_size" not in model_meta:
        raise CheckpointError(model_path, "is not a DeepSpeed model-states file (no dp_world_size)")
    n = model_meta["dp_world_size"]
    if not isinstance(n, int) or n < 1:
        raise CheckpointError(model_path, f"has dp_world_size {n!r}, expected a positive integer")
    _refuse_tensor_and_expert_parallel(model_meta, model_path, tag_dir, roles)
    tp = _tensor_parallel_size(model_meta, model_path, tag_dir, mp_ranks)
    for t in range(tp):
        _check_rank_files(tag_dir, n, {k: v for k, v in optim.items() if v.mp_rank == t}, "optim",
                          lambda r: schema.optim_file_name(r, bf16_prefix, t), not node_local)
        if stage3:
            _check_rank_files(tag_dir, n, {k: v for k, v in roles.items() if v.kind == "zero3_model" and v.mp_rank == t},
                              "model", lambda r: schema.model_file_name(3, r, t), not node_local)
        elif not os.path.isfile(os.path.join(tag_dir, schema.model_file_name(1, 0, t))):
            raise CheckpointError(os.path.join(tag_dir, schema.model_file_name(1, 0, t)),
                                  f"is missing: mp_world_size is {tp}, every TP rank has a model-states file")

    optim_path = os.path.join(tag_dir, schema.optim_file_name(0, bf16_prefix))
    optim_tree = load_portable(optim_path, schema.safe_globals(), trust_pickle)
    model_tree = model_meta
    expert_files = {name: schema.expert_file_index(name) or schema.expert_file_index_any_mp(name)
                    for name, role in roles.items() if role.kind == "expert"}
    layers = _expert_layers(tag_dir, expert_files, model_tree, model_path, trust_pickle, stage3)
    spec = _spec_from_templates(optim_tree, model_tree, optim_path, model_path, bf16_prefix, stage3, n, layers,
                                tp=tp if layers else 1)
    if tp > 1 or deepspeed_tensor.is_autotp(model_tree):
        if spec.experts is not None:
            spec = _with_folded_tensor_parallelism(spec, model_tree, model_path, tp, tag_dir, expert_files)
        else:
            spec = _with_tensor_parallelism(spec, model_tree, model_path, tp)
    if spec.stage < 3:
        check_param_shapes_against_module(model_tree, model_path, experts=spec.experts is not None)
    optim_parts = validate_optim_tree(optim_tree, optim_path, spec, spec.layout(spec.topology), 0)
    model_parts = validate_model_tree(model_tree, model_path, spec, 0) if spec.stage == 3 else {}

    # Storage keys are byte offsets, so they only mean something within their own file.
    carried = {}
    if read_tensors:
        carried[schema.optim_file_name(0, bf16_prefix)] = read_carried(optim_path, optim_tree, optim_parts.values())
    if read_tensors and (carry_model_bytes if carry_model_bytes is not None else stage3):
        carried[model_name] = read_carried(model_path, model_tree, model_parts.values())
    others, other_dirs = _other_contents(tag_dir, roles)
    # Expert model-states files are named and keyed by GLOBAL expert id: the same at any (dp, ep),
    # so they travel whole and unchanged (engine.py `load_moe_state_dict` picks its own).
    # AutoEP with AutoTP: the expert files carry the TP rank and `folding` metadata of their
    # writer, so they are rewritten for the target (reshard.formats.deepspeed_files.deepspeed_folding), not copied.
    if spec.tensor is None:
        others = tuple(sorted(others + tuple(expert_files)))
    return SourceCheckpoint(save_dir, tag, spec, optim_tree, model_tree, carried, others, other_dirs)


def _other_contents(tag_dir: str, roles: dict) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Files and sub-directories of the tag directory that are not DeepSpeed's, by relative path.

    They are carried over unchanged, whole sub-trees included. What cannot be copied as a plain
    file (a link to a directory, a device, a socket) is refused by name, never dropped."""
    files = [name for name, role in roles.items() if role.kind == "other"]
    directories = []
    for name in sorted(os.listdir(tag_dir)):
        path = os.path.join(tag_dir, name)
        if name in roles:
            continue
        if os.path.islink(path) and os.path.isdir(path):
            raise UnsupportedCheckpoint(path, "is a symbolic link to a directory; reshard carries over regular "
                                              "files and real sub-directories only (replace it by a copy)")
        if not os.path.isdir(path):
            raise UnsupportedCheckpoint(path, "is neither a regular file nor a directory; cannot carry it over")
        for root, dirs, names in os.walk(path):
            relative = os.path.relpath(root, tag_dir)
            directories.append(relative)
            for sub in sorted(dirs):
                if os.path.islink(os.path.join(root, sub)):
                    raise UnsupportedCheckpoint(os.path.join(root, sub), "is a symbolic link to a directory; reshard "
                                                                         "carries over regular files and real "
                                                                         "sub-directories only")
            dirs.sort()
            for leaf in sorted(names):
                if not os.path.isfile(os.path.join(root, leaf)):
                    raise UnsupportedCheckpoint(os.path.join(root, leaf), "is neither a regular file nor a "
                                                                          "directory; cannot carry it over")
                files.append(os.path.join(relative, leaf))
    return tuple(files), tuple(directories)


TP_WITH_EP = "resharding tensor and expert parallelism together is supported for AutoEP folded with AutoTP only"


def _refuse_tensor_and_expert_parallel(model_meta: dict, model_path: str, tag_dir: str, roles: dict) -> None:
    """Refuse a checkpoint whose experts were trained under tensor parallelism in a way reshard
    does not read.

    DeepSpeed 0.19.8 trains and saves AutoEP folded with AutoTP (`expert_parallel` with
    `tensor_parallel.autotp_size` > 1) at ZeRO-1, 2 and 3: every file then carries `folding`
    metadata (engine.py `_make_autoep_folding_metadata`; checkpoint/autoep_universal.py
    `make_folding_metadata`) that its loader validates against the engine's sizes, and the expert
    files are named after the saving rank's TP rank (engine.py `_get_expert_ckpt_name`:
    `layer_{L}_expert_{G}_mp_rank_{tp:02d}`). reshard reads those (`_with_folded_tensor_parallelism`);
    refused here: a folding version or expert-tensor-parallel size it does not know, and expert files of a TP rank above 0 without
    that metadata (experts saved under some other model-parallel mpu)."""
    folding = model_meta.get("folding") if isinstance(model_meta, dict) else None
    if folding is not None:
        sizes = (f"tp_size {folding.get('tp_size')!r}, ep_size {folding.get('ep_size')!r}"
                 if isinstance(folding, dict) else "unreadable")
        problem = None
        if not isinstance(folding, dict):
            problem = "its folding metadata is not a dict"
        elif folding.get("version") != 1 or folding.get("etp_size", 1) != 1:
            problem = (f"folding version {folding.get('version')!r} with etp_size {folding.get('etp_size')!r} "
                       "(reshard knows version 1 with etp_size 1)")
        if problem:
            raise UnsupportedCheckpoint(model_path, f"is an AutoEP checkpoint folded with AutoTP (folding metadata: "
                                                    f"{sizes}; expert_parallel with tensor_parallel.autotp_size > 1) "
                                                    f"and {problem}; " + TP_WITH_EP)
        return
    for name in sorted(roles):
        mp_rank = schema.expert_file_mp_rank(name)
        if mp_rank:
            raise UnsupportedCheckpoint(os.path.join(tag_dir, name),
                                        f"is an expert file of tensor-parallel rank {mp_rank} but the model states "
                                        "carry no folding metadata: the experts were saved with tensor parallelism "
                                        "outside AutoEP folding; " + TP_WITH_EP)


def _with_folded_tensor_parallelism(spec: CheckpointSpec, model_tree: dict, model_path: str, tp: int, tag_dir: str,
                                    expert_files: dict) -> CheckpointSpec:
    """The spec of an AutoEP checkpoint with AutoTP layers: folded (tp > 1, `reshard.topology`) or
    AutoTP-ready at tp 1 (layer specs in ds_config). The TP spec covers the dense parameters
    (experts are never TP-split); the folding metadata must agree with the file's sizes, and the
    expert files must be the ones DeepSpeed writes and loads (`deepspeed_folding`)."""
    from reshard.formats.deepspeed_files.deepspeed_folding import check_folding_metadata, expert_file_names
    experts = spec.experts
    if not experts.autoep:
        raise UnsupportedCheckpoint(model_path, "combines tensor parallelism with native DeepSpeed MoE experts; "
                                                + TP_WITH_EP)
    topology = spec.topology
    if tp > 1:
        check_folding_metadata(model_tree, model_path, topology, tp_rank=0)
    # ZeRO-3 (`zero3_partitioned`) keeps the experts in the ZeRO partitions only
    wanted = set(expert_file_names(experts.num_experts, topology)) if spec.stage < 3 else set()
    for name in sorted(set(expert_files) ^ wanted):
        raise CheckpointError(os.path.join(tag_dir, name),
                              f"is {'missing' if name in wanted else 'unexpected'}: a save at {topology.describe()} "
                              "(AutoEP with AutoTP) writes each expert under the TP rank of every rank that loads it")
    dense = [i for i, e in enumerate(experts.expert_of) if e is None]
    tensor, dense_global = deepspeed_tensor.tensor_parallel_spec(model_tree, model_path, tp,
                                                                 tuple(spec.params[i] for i in dense),
                                                                 module_weights=spec.stage < 3)
    dtype = deepspeed_tensor.module_dtype(model_tree, model_path, tensor.module)
    if dtype not in (None, spec.lp_dtype):
        raise UnsupportedCheckpoint(model_path, f"split module tensors are {dtype}, the model is {spec.lp_dtype}")
    params = list(spec.params)
    for i, p in zip(dense, dense_global):
        params[i] = p
    return dataclasses.replace(spec, params=tuple(params), tensor=tensor)


def _tensor_parallel_size(model_meta: dict, model_path: str, tag_dir: str, mp_ranks: set) -> int:
    """`mp_world_size` of the checkpoint, checked against the mp_rank_XX files present."""
    tp = model_meta.get("mp_world_size", 1)
    if not isinstance(tp, int) or tp < 1:
        raise CheckpointError(model_path, f"has mp_world_size {tp!r}, expected a positive integer")
    if mp_ranks != set(range(tp)):
        raise CheckpointError(tag_dir, f"has files of tensor-parallel ranks {sorted(mp_ranks)}, but mp_world_size "
                                       f"is {tp} (files of another save mixed in?)")
    return tp


def _with_tensor_parallelism(spec: CheckpointSpec, model_tree: dict, model_path: str, tp: int) -> CheckpointSpec:
    """The spec of an AutoTP checkpoint: global parameter shapes, each parameter's split.

    Under ZeRO-3 each TP rank's local parameters are ZeRO-3-partitioned over its dp group
    (`zero_pp_rank_{dp}_mp_rank_{tp:02d}_*` files, engine.py `_get_ckpt_name`, `_get_zero_ckpt_name`),
    `param_shapes` list TP-local shapes per sub-group, and `module` holds empty placeholders
    (stage3.py: the partitioned parameters' `.data`), so there are no module weights to reslice."""
    if spec.round_robin:
        raise UnsupportedCheckpoint(model_path, "uses round_robin_gradients with tensor parallelism; not "
                                                "supported yet")
    tensor, params = deepspeed_tensor.tensor_parallel_spec(model_tree, model_path, tp, spec.params,
                                                           module_weights=spec.stage < 3)
    dtype = deepspeed_tensor.module_dtype(model_tree, model_path, tensor.module)
    if dtype not in (None, spec.lp_dtype):
        raise UnsupportedCheckpoint(model_path, f"split module tensors are {dtype}, the model is {spec.lp_dtype}")
    return dataclasses.replace(spec, topology=Topology(dp=spec.topology.dp, tp=tp), params=params, tensor=tensor)


def _refuse_unsupported_files(tag_dir: str, roles: dict, node_local: bool = False) -> None:
    for name, role in roles.items():
        if role.kind == "expert" and (schema.expert_file_mp_rank(name) or 0) > 0:
            continue  # refused by _refuse_tensor_and_expert_parallel, which reads the model file first
        if role.kind == "expert" and not schema.expert_file_index(name):
            if name.startswith("expp_rank_"):  # deepspeed_zero0_moe's own inspection takes them (collective job)
                raise UnsupportedCheckpoint(os.path.join(tag_dir, name), "is the expert optimizer file of a ZeRO-0 "
                                                                         "MoE checkpoint; the offline job and "
                                                                         "reshard.deepspeed.load_checkpoint reshard it, "
                                                                         "but not node-local, verify --against or exports")
            raise UnsupportedCheckpoint(os.path.join(tag_dir, name), "is a mixture-of-experts file of DeepSpeed's "
                                                                     "old layout (no layer index); reshard reshards "
                                                                     "native MoE checkpoints of ZeRO-0/1/2 only")
        if role.kind == "pipeline":  # the columns inspection takes them (inspect_pipeline_columns)
            raise UnsupportedCheckpoint(os.path.join(tag_dir, name), "is a pipeline-parallel layer file; node-local "
                                        "pipeline saves are resharded by python -m reshard --node-local "
                                        "(reshard.jobs.node_local_columns), not by this path" if node_local else
                                        "is a pipeline-parallel layer file; pipeline checkpoints are resharded by "
                                        "python -m reshard (torchrun, --workers, SLURM array mode), not by this path")


def _check_rank_files(tag_dir: str, n: int, present: dict, what: str, name_of, complete: bool = True) -> None:
    ranks = {role.dp_rank for role in present.values()}
    missing = [r for r in range(n) if r not in ranks]
    if missing and complete:
        raise CheckpointError(os.path.join(tag_dir, name_of(missing[0])),
                              f"is missing: dp_world_size is {n}, so {n} {what} files are expected "
                              f"(missing ranks {_ranks_text(missing)})")
    extra = sorted(r for r in ranks if r >= n)
    if extra:
        raise CheckpointError(os.path.join(tag_dir, name_of(extra[0])),
                              f"should not exist: dp_world_size is {n}, but {what} files for ranks "
                              f"{_ranks_text(extra)} are present (left over from another save?)")


def _ranks_text(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks[:8])) + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")


def _zero_config(model_tree: dict) -> dict:
    config = model_tree.get("ds_config") or {}
    zero = config.get("zero_optimization", {}) if isinstance(config, dict) else {}
    return zero if isinstance(zero, dict) else {}


def _expert_layers(tag_dir: str, expert_files: dict, model_tree: dict, model_path: str,
                   trust_pickle: bool, stage3: bool = False) -> tuple[tuple[int, ...], tuple[str, ...], int | None] | None:
    """(num_experts, name prefix of each MoE layer, AutoEP's ep or None for native MoE) from
    `num_experts` and the expert files, or None without experts. engine.py `_save_moe_checkpoint` numbers MoE layers in module order and
    writes layer_{L}_expert_{G}_mp_rank_00_model_states.pt per global expert G."""
    num_experts = model_tree.get("num_experts") if isinstance(model_tree, dict) else None
    if isinstance(model_tree, dict) and model_tree.get(AUTOEP_LAYERS_KEY) is not None:
        return _autoep_expert_layers(tag_dir, expert_files, model_tree, model_path, num_experts, trust_pickle, stage3)
    if not expert_files:
        if num_experts and any(n != 1 for n in num_experts):
            raise CheckpointError(model_path, f"says num_experts {num_experts}, but the tag directory holds no "
                                              "layer_*_expert_*_model_states.pt files")
        return None
    if not isinstance(num_experts, list) or not all(isinstance(n, int) and n >= 1 for n in num_experts):
        raise CheckpointError(model_path, f"has num_experts {num_experts!r}, expected a list of expert counts per "
                                          "MoE layer (the tag directory holds expert files)")
    wanted = {(layer, expert) for layer, count in enumerate(num_experts) for expert in range(count)}
    found = set(expert_files.values())
    for layer, expert in sorted(wanted - found):
        raise CheckpointError(os.path.join(tag_dir, schema.expert_file_name(layer, expert)),
                              f"is missing: num_experts is {num_experts}")
    for layer, expert in sorted(found - wanted):
        raise CheckpointError(os.path.join(tag_dir, schema.expert_file_name(layer, expert)),
                              f"should not exist: num_experts is {num_experts} (left over from another save?)")
    prefixes = []
    for layer in range(len(num_experts)):
        path = os.path.join(tag_dir, schema.expert_file_name(layer, 0))
        keys = load_portable(path, schema.safe_globals(), trust_pickle)
        parts = {expert_name_parts(key)[:2] if expert_name_parts(key) else None for key in (keys or {})}
        if len(parts) != 1 or None in parts or next(iter(parts))[1] != 0:
            raise UnsupportedCheckpoint(path, "does not hold the parameters of exactly global expert 0 of one "
                                              "native DeepSpeed MoE layer (keys ...deepspeed_experts.0....)")
        prefixes.append(next(iter(parts))[0])
    return tuple(num_experts), tuple(prefixes), None


def _autoep_expert_layers(tag_dir: str, expert_files: dict, model_tree: dict, model_path: str, num_experts,
                          trust_pickle: bool, stage3: bool):
    """(num_experts, prefixes, ep) of an AutoEP checkpoint, from `ds_autoep_layers`. ZeRO-1/2:
    expert files key global expert G's slices `{prefix}w1.{G}`, w2, w3 (engine.py
    `_save_moe_checkpoint`); ZeRO-3 (`zero3_partitioned`) writes no expert files."""
    layers = read_autoep_layers(model_tree[AUTOEP_LAYERS_KEY], model_path)
    if not isinstance(num_experts, list) or list(layers.num_experts) != list(num_experts):
        raise CheckpointError(model_path, f"says num_experts {num_experts!r} but {AUTOEP_LAYERS_KEY} has "
                                          f"{list(layers.num_experts)}")
    if layers.zero3 != stage3:
        raise CheckpointError(model_path, f"is a ZeRO-{'3' if stage3 else '1/2'} checkpoint whose AutoEP layers are "
                                          f"in the {'zero3_partitioned' if layers.zero3 else 'per_expert_files'} format")
    if stage3:
        if expert_files:
            raise CheckpointError(os.path.join(tag_dir, sorted(expert_files)[0]),
                                  "should not exist: ZeRO-3 AutoEP keeps experts in the ZeRO partitions only")
        return layers.num_experts, layers.prefixes, layers.ep
    wanted = {(layer, expert) for layer, count in enumerate(num_experts) for expert in range(count)}
    found = set(expert_files.values())
    for layer, expert in sorted(wanted ^ found):
        raise CheckpointError(os.path.join(tag_dir, schema.expert_file_name(layer, expert)),
                              f"is {'missing' if (layer, expert) in wanted else 'unexpected'}: num_experts is "
                              f"{num_experts}")
    for layer, prefix in enumerate(layers.prefixes):
        path = os.path.join(tag_dir, schema.expert_file_name(layer, 0))
        keys = load_portable(path, schema.safe_globals(), trust_pickle)
        names = sorted(k for k in keys if k != FOLDING_KEY) if isinstance(keys, dict) else None  # folded: + metadata
        if names != [f"{prefix}{w}.0" for w in ("w1", "w2", "w3")]:
            raise UnsupportedCheckpoint(path, f"does not hold exactly {prefix}w1.0, w2.0 and w3.0 (AutoEP global "
                                              "expert 0)")
    return layers.num_experts, layers.prefixes, layers.ep


def _global_expert_groups(names_per_group: list, expert_groups: list[bool], layers, path: str, n: int, tp: int = 1):
    """The source ep and, per param group, its parameters under GLOBAL names in layer, expert order.

    Rank 0 is EP rank 0, whose local expert j is global expert j, so its LOCAL names in
    param_shapes are global names of experts 0..n_local-1; the other experts' parameters have
    the same shapes under their own index (moe/experts.py deep-copies one expert)."""
    num_experts, prefixes, autoep_ep = layers
    if autoep_ep is not None:
        return _global_autoep_groups(names_per_group, expert_groups, layers, path, n, tp)
    layer_of = {prefix: layer for layer, prefix in enumerate(prefixes)}
    local_counts = {}
    parsed = []
    for g, items in enumerate(names_per_group):
        rows = [(expert_name_parts(name), name, shape) for name, shape in items]
        if not expert_groups[g]:
            expert = next((name for parts, name, _ in rows if parts is not None), None)
            if expert is not None:
                raise UnsupportedCheckpoint(path, f"param group {g} is not an expert group (no moe flag) but holds "
                                                  f"expert parameter {expert}")
            parsed.append(None)
            continue
        for parts, name, _ in rows:
            if parts is None or parts[0] not in layer_of:
                raise UnsupportedCheckpoint(path, f"expert param group {g} holds {name}, which is not a parameter "
                                                  "of a native DeepSpeed MoE expert listed in the expert files")
            layer = layer_of[parts[0]]
            local_counts[layer] = max(local_counts.get(layer, 0), parts[1] + 1)
        parsed.append(rows)
    eps = {num_experts[layer] // count for layer, count in local_counts.items()}
    if len(eps) != 1 or any(num_experts[layer] % count for layer, count in local_counts.items()):
        raise UnsupportedCheckpoint(path, f"MoE layers hold {local_counts} local experts of {list(num_experts)}: not "
                                          "one expert-parallel size for all layers (not supported yet)")
    ep = eps.pop()
    if n % ep:
        raise CheckpointError(path, f"has ep={ep} experts groups that do not divide dp_world_size {n}")
    result = []
    for g, rows in enumerate(parsed):
        if rows is None:
            result.append(names_per_group[g])
            continue
        expanded, position = [], 0
        while position < len(rows):
            prefix, end = rows[position][0][0], position
            while end < len(rows) and rows[end][0][0] == prefix:
                end += 1
            block = rows[position:end]
            count = local_counts[layer_of[prefix]]
            per_expert = len(block) // count
            rests = [(parts[2], shape) for parts, _, shape in block[:per_expert]]
            expected = [(prefix, j, rest) for j in range(count) for rest, _ in rests]
            if len(block) % count or [parts for parts, _, _ in block] != expected:
                raise UnsupportedCheckpoint(path, f"expert param group {g} does not list layer {prefix} expert by "
                                                  "expert with the same parameters each (not a native MoE order)")
            expanded += [(f"{prefix}{expert}{rest}", shape) for expert in range(num_experts[layer_of[prefix]])
                         for rest, shape in rests]
            position = end
        if len({name for name, _ in expanded}) != len(expanded):
            raise UnsupportedCheckpoint(path, f"expert param group {g} lists an MoE layer in several runs "
                                              "(not a native MoE order)")
        result.append(expanded)
    return ep, result


def _global_autoep_groups(names_per_group: list, expert_groups: list[bool], layers, path: str, n: int, tp: int = 1):
    """The source ep and, per param group, its parameters under GLOBAL names: each fused AutoEP
    weight `{prefix}w1 [n_local, ...]` becomes its experts' slices `{prefix}w1.{G}`, G = 0..E-1,
    in place (reshard.layouts.experts)."""
    num_experts, prefixes, _ = layers
    layer_of = {prefix: layer for layer, prefix in enumerate(prefixes)}
    local_counts, result = set(), []
    for g, items in enumerate(names_per_group):
        fused = [(name, shape) for name, shape in items if name.rpartition(".")[0] + "." in layer_of]
        if not expert_groups[g]:
            if fused:
                raise UnsupportedCheckpoint(path, f"param group {g} is not an expert group (no moe flag) but holds "
                                                  f"AutoEP expert parameter {fused[0][0]}")
            result.append(items)
            continue
        expanded = []
        for name, shape in items:
            prefix = name.rpartition(".")[0] + "."
            if prefix not in layer_of or name.rpartition(".")[2] not in ("w1", "w2", "w3") or len(shape) < 2:
                raise UnsupportedCheckpoint(path, f"expert param group {g} holds {name} {tuple(shape)}, which is not "
                                                  "a fused AutoEP expert weight of a layer in ds_autoep_layers")
            local_counts.add((layer_of[prefix], int(shape[0])))
            expanded += [(f"{name}.{expert}", tuple(shape[1:])) for expert in range(num_experts[layer_of[prefix]])]
        if len({name for name, _ in expanded}) != len(expanded):
            raise UnsupportedCheckpoint(path, f"expert param group {g} lists an AutoEP weight twice")
        result.append(expanded)
    eps = {num_experts[layer] // count for layer, count in local_counts if count and num_experts[layer] % count == 0}
    if len(eps) != 1 or len({count for _, count in local_counts}) != 1:
        raise UnsupportedCheckpoint(path, f"AutoEP layers hold {sorted(local_counts)} (layer, local experts) of "
                                          f"{list(num_experts)}: not one expert-parallel size for all layers")
    ep = eps.pop()
    if ep != layers[2]:
        raise CheckpointError(path, f"holds {num_experts[0] // ep} local experts per layer (ep={ep}), but "
                                    f"ds_autoep_layers says ep_size {layers[2]}")
    if (n * tp) % ep:
        raise CheckpointError(path, f"has ep={ep} expert groups that do not divide dp_world_size {n}"
                                    + (f" x mp_world_size {tp}" if tp > 1 else ""))
    return ep, result


def _spec_from_templates(optim_tree, model_tree, optim_path, model_path, bf16_prefix, stage3, n,
                         expert_layers=None, tp: int = 1) -> CheckpointSpec:
    osd = optim_tree.get(OPT) if isinstance(optim_tree, dict) else None
    if not isinstance(osd, dict):
        raise CheckpointError(optim_path, f"is not a DeepSpeed optim-states file (no {OPT!r})")
    if "zero_stage" in osd:
        stage, optimizer = int(osd["zero_stage"]), "zero"
    elif "single_partition_of_fp32_groups" in osd:
        stage, optimizer = 1, "bf16_optimizer"
    else:
        raise CheckpointError(optim_path, "has neither zero_stage nor single_partition_of_fp32_groups: "
                                          "not a ZeRO optimizer state")
    if (stage == 3) != stage3:
        raise CheckpointError(optim_path, f"says ZeRO stage {stage}, but the model-states files are "
                                          f"{'per rank (stage 3)' if stage3 else 'for stage 1/2'}")
    zero = _zero_config(model_tree)
    if int(zero.get("mics_shard_size", -1) or -1) > 0:
        raise UnsupportedCheckpoint(model_path, f"was saved with MiCS (mics_shard_size {zero['mics_shard_size']}): "
                                                "parameters are partitioned within shard groups; not supported yet")
    shapes = model_tree.get("param_shapes")
    if not isinstance(shapes, list) or not all(isinstance(s, dict) for s in shapes):
        raise CheckpointError(model_path, "has no param_shapes list: cannot tell the flat parameter order")
    module = model_tree.get("module") or {}

    round_robin = bool(zero.get("round_robin_gradients", False)) and optimizer == "zero" and stage < 3
    if stage == 3:
        groups_of_sub_groups = [list(g["params"]) for g in osd[OPT]["param_groups"]]
        names_per_group = [[item for sg in ids for item in shapes[sg].items()] for ids in groups_of_sub_groups]
        if sorted(sg for ids in groups_of_sub_groups for sg in ids) != list(range(len(shapes))):
            raise CheckpointError(optim_path, "param_groups do not list every sub-group exactly once")
    else:
        names_per_group = [list(s.items()) for s in shapes]
        if round_robin and expert_layers:
            raise UnsupportedCheckpoint(model_path, "is an MoE checkpoint saved with round_robin_gradients; "
                                                    "not supported yet")
        if round_robin:
            names_per_group = [undo_round_robin(items, n) for items in names_per_group]
    ep, expert_groups = 1, None
    if expert_layers:
        if stage == 3 and expert_layers[2] is None:
            raise UnsupportedCheckpoint(model_path, "is a ZeRO-3 checkpoint with native MoE expert files; DeepSpeed "
                                                    "0.19.8 does not train native MoE at stage 3")
        if (model_tree.get("ds_config") or {}).get("use_data_before_expert_parallel_"):
            raise UnsupportedCheckpoint(model_path, "was saved with use_data_before_expert_parallel_ (D+E rank "
                                                    "order of expert groups); not supported yet")
        base_groups = ((osd.get(OPT) if stage == 3 else osd.get("base_optimizer_state")) or {}).get("param_groups") or []
        expert_groups = [bool(group.get("moe")) for group in base_groups]
        if len(expert_groups) != len(names_per_group) or not any(expert_groups):
            raise CheckpointError(optim_path, f"has {len(expert_groups)} optimizer param groups "
                                              f"({sum(expert_groups)} with moe=True) for {len(names_per_group)} "
                                              "param_shapes groups; an MoE checkpoint has expert groups")
        ep, names_per_group = _global_expert_groups(names_per_group, expert_groups, expert_layers, model_path, n, tp)
    params, groups = [], []
    for items in names_per_group:
        groups.append(tuple(range(len(params), len(params) + len(items))))
        params.extend(ParamSpec(name, tuple(int(d) for d in size)) for name, size in items)
    if not params:
        raise CheckpointError(model_path, "lists no trainable parameters in param_shapes")
    experts = (ExpertParams.of(params, expert_groups, expert_layers[0], expert_layers[1],
                               autoep=expert_layers[2] is not None) if expert_layers else None)
    if experts is not None and experts.autoep and zero.get("parameter_alignment") and optimizer == "zero":
        raise UnsupportedCheckpoint(model_path, "is an AutoEP checkpoint saved with parameter_alignment (padding "
                                                "inside fused expert tensors); not supported yet")
    first_dense = next((p for i, p in enumerate(params) if experts is None or experts.expert_of[i] is None), params[0])
    lp_ref = module.get(first_dense.name)
    if not isinstance(lp_ref, TensorRef):
        raise CheckpointError(model_path, f"module has no tensor for trainable parameter {first_dense.name!r}")
    lp_dtype = lp_ref.dtype
    param_alignment = param_alignment_elements(itemsize(lp_dtype), bool(zero.get("parameter_alignment", False))
                                               and optimizer == "zero" and stage < 3)
    sub_group_size = int(zero.get("sub_group_size", DEFAULT_SUB_GROUP_SIZE))

    frozen, frozen_dtype = (), None
    if stage == 3 and model_tree.get("frozen_param_fragments"):
        fragments = model_tree["frozen_param_fragments"]
        frozen_shapes = model_tree.get("frozen_param_shapes") or {}
        frozen = tuple(ParamSpec(name, tuple(int(d) for d in frozen_shapes[name])) for name in fragments)
        dtypes = {ref.dtype for ref in fragments.values()}
        frozen_dtype = dtypes.pop() if len(dtypes) == 1 else _refuse(model_path, "frozen fragments of mixed dtypes")

    spec = CheckpointSpec(stage, optimizer, bf16_prefix, Topology(dp=n, tp=tp, ep=ep), tuple(params), tuple(groups),
                          round_robin, param_alignment, sub_group_size, lp_dtype, (), frozen, frozen_dtype, experts=experts)
    layout = spec.layout(spec.topology)
    if stage == 3:
        expected = [[name for name, _ in layout.param_shapes_on_rank(sg.params, 0)] if experts is not None
                     else [params[p].name for p in sg.params] for sg in layout.sub_groups]
        found = [list(s.keys()) for s in shapes]
        if expected != found:
            raise CheckpointError(model_path, f"sub-groups in param_shapes ({len(found)}) do not follow from "
                                              f"sub_group_size={sub_group_size} at {n} ranks ({len(expected)}); "
                                              "was ds_config edited after the save?")
    streams = _discover_streams(osd, optim_path, spec, layout)
    return dataclasses.replace(spec, streams=streams)


def _refuse(path, problem):
    raise UnsupportedCheckpoint(path, problem)


def _optimizer_states(osd: dict, stage: int, path: str) -> dict:
    base = osd[OPT] if stage == 3 else osd.get("base_optimizer_state")
    if not isinstance(base, dict) or "state" not in base:
        raise UnsupportedCheckpoint(path, "base optimizer state is not a torch optimizer state_dict "
                                          "(elastic_checkpoint format?): not supported")
    return base["state"]


def _fp32_partitions(osd: dict, stage: int) -> list:
    return osd["fp32_flat_groups"] if stage == 3 else osd["single_partition_of_fp32_groups"]


def _discover_streams(osd, path, spec: CheckpointSpec, layout) -> tuple[Stream, ...]:
    """fp32 plus every optimizer-state tensor shaped like its partition, whatever its name."""
    sizes = buffer_numels(layout)
    fp32 = _fp32_partitions(osd, spec.stage)
    if len(fp32) != len(sizes) or not all(isinstance(t, TensorRef) for t in fp32):
        raise CheckpointError(path, f"holds {len(fp32)} fp32 partitions, the layout has {len(sizes)} flat buffers")
    dtypes = {t.dtype for t in fp32}
    if len(dtypes) != 1:
        raise UnsupportedCheckpoint(path, f"fp32 partitions of mixed dtypes {sorted(dtypes)}")
    streams = [Stream("fp32", dtypes.pop(), fp32[0].itemsize)]
    states = _optimizer_states(osd, spec.stage, path)
    keys_per_buffer = []
    for buffer, size in enumerate(sizes):
        entry = states.get(buffer, {})
        keys_per_buffer.append([(k, v.dtype) for k, v in entry.items()
                                if isinstance(v, TensorRef) and v.shape == (size,)])
    if any(keys != keys_per_buffer[0] for keys in keys_per_buffer):
        raise UnsupportedCheckpoint(path, f"optimizer state keys differ between flat buffers: {keys_per_buffer}")
    streams += [Stream(k, dtype, itemsize(dtype)) for k, dtype in keys_per_buffer[0] if k != "fp32"]
    return tuple(streams)


def validate_optim_tree(tree, path: str, spec: CheckpointSpec, layout, rank: int) -> dict:
    """Check one rank's optim file against the layout; return {slot: TensorRef} of its partitions.

    Slots are ("optim", buffer, stream name). Everything DeepSpeed derives from the layout is
    compared with what the rules give, so a file from another checkpoint, another world
    size or an unknown DeepSpeed layout is refused with the first difference.
    """
    osd = tree.get(OPT) if isinstance(tree, dict) else None
    if not isinstance(osd, dict):
        raise CheckpointError(path, f"is not a DeepSpeed optim-states file (no {OPT!r})")
    if spec.optimizer == "zero" and int(osd.get("zero_stage", -1)) != spec.stage:
        raise CheckpointError(path, f"says ZeRO stage {osd.get('zero_stage')}, rank 0 says {spec.stage}")
    meta = rank_metadata(spec, layout, rank)
    if spec.stage == 3:
        _expect(path, "partition_count", osd.get("partition_count"), meta.partition_count)
        if meta.partition_groups is not None or "ds_zero_partition_groups" in osd:
            _expect(path, "ds_zero_partition_groups", osd.get("ds_zero_partition_groups"), meta.partition_groups)
    else:
        _expect(path, "partition_count", list(osd.get("partition_count", [])), meta.partition_count)
        _check_rank_identity(osd, path, spec, layout, rank)
        _expect(path, "group_paddings", list(osd.get("group_paddings", [])), meta.group_paddings)
        if "param_alignment_paddings" in osd and meta.param_alignment_paddings is not None:
            _expect(path, "param_alignment_paddings", [list(p) for p in osd["param_alignment_paddings"]],
                    meta.param_alignment_paddings)
        if "param_slice_mappings" in osd:
            found = [[(name, int(a.numel), int(a.start)) for name, a in m.items()] for m in osd["param_slice_mappings"]]
            _expect(path, "param_slice_mappings", found, meta.slice_mappings)

    sizes = meta.buffer_numels
    refs = {}
    fp32 = _fp32_partitions(osd, spec.stage)
    states = _optimizer_states(osd, spec.stage, path)
    if len(fp32) != len(sizes):
        raise CheckpointError(path, f"holds {len(fp32)} fp32 partitions, expected {len(sizes)}")
    for buffer, size in enumerate(sizes):
        fp32_size = meta.fp32_numels[buffer]
        entry = states.get(buffer, {})
        for stream in spec.streams:
            ref = fp32[buffer] if stream.name == "fp32" else entry.get(stream.name)
            expected = fp32_size if stream.name == "fp32" else size
            where = f"{stream.name} of flat buffer {buffer}"
            if not isinstance(ref, TensorRef):
                raise CheckpointError(path, f"has no {where} (rank 0 has one)")
            if problem := schema.partition_problem(ref, expected):  # the check the pipeline road makes too
                raise CheckpointError(path, f"{where} {problem} ({spec.dp_world_size} ranks with these parameter "
                                            "shapes; shard from another checkpoint or world size?)")
            if ref.dtype != stream.dtype:
                raise CheckpointError(path, f"{where} is {ref.dtype}, rank 0 has {stream.dtype}")
            refs[("optim", buffer, stream.name)] = ref
        # any other tensor of the buffer's optimizer state is a scalar (step), or a partition rank 0 lacks
        schema.partitioned_state_keys(path, f"flat buffer {buffer}", entry, size,
                                      [s.name for s in spec.streams if s.name != "fp32"])
    return refs


def rank_signature(spec: CheckpointSpec, layout, rank: int) -> dict:
    """Everything in a ZeRO-1/2 optim file that depends on which dp rank wrote it.

    stage_1_and_2.py `state_dict` / bf16_optimizer.py `state_dict`: `group_paddings` (the tail
    padding a rank holds), `param_slice_mappings` (which parameter fragments sit where in its
    partition) and the length of `single_partition_of_fp32_groups` (the partition minus its tail
    padding, ZeRO-1/2 only). ZeRO-3 files carry nothing of the kind (stage3.py
    `_rigid_state_dict` writes `partition_rank` only for AutoEP sub-groups)."""
    meta = rank_metadata(spec, layout, rank)
    return {"group_paddings": meta.group_paddings, "param_slice_mappings": meta.slice_mappings,
            "fp32 partition sizes": list(meta.fp32_numels)}


def _found_signature(osd: dict, spec: CheckpointSpec) -> dict:
    found = {"group_paddings": list(osd.get("group_paddings", []))}
    if "param_slice_mappings" in osd:
        found["param_slice_mappings"] = [[(name, int(a.numel), int(a.start)) for name, a in m.items()]
                                         for m in osd["param_slice_mappings"]]
    found["fp32 partition sizes"] = [t.numel if isinstance(t, TensorRef) else None
                                     for t in _fp32_partitions(osd, spec.stage)]
    return found


def _check_rank_identity(osd: dict, path: str, spec: CheckpointSpec, layout, rank: int) -> None:
    """Refuse an optim file whose rank-dependent content belongs to another rank (renamed or
    swapped files), naming the rank it belongs to; other differences fall through to the
    detailed checks that follow."""
    found = _found_signature(osd, spec)

    def matches(r: int) -> bool:
        wanted = rank_signature(spec, layout, r)
        return all(found[key] == wanted[key] for key in found)

    if matches(rank):
        return
    owners = [r for r in range(layout.world_size) if r != rank and matches(r)]
    if owners:
        keys = ", ".join(k for k in found if found[k] != rank_signature(spec, layout, rank)[k])
        raise CheckpointError(path, f"holds the partition of dp rank {owners[0]} (its {keys} are those of rank "
                                    f"{owners[0]} at {layout.world_size} ranks), but its name says rank {rank}: "
                                    "rank files were renamed or swapped")


def validate_model_tree(tree, path: str, spec: CheckpointSpec, rank: int) -> dict:
    """Check a ZeRO-3 model-states file; return {slot: TensorRef} of its frozen fragments."""
    if not isinstance(tree, dict) or tree.get("dp_world_size") != spec.dp_world_size:
        raise CheckpointError(path, f"has dp_world_size {tree.get('dp_world_size') if isinstance(tree, dict) else None}, "
                                    f"rank 0 says {spec.dp_world_size}")
    refs = {}
    fragments = tree.get("frozen_param_fragments") or {}
    for index, param in enumerate(spec.frozen):
        ref = fragments.get(param.name)
        chunk = zero3_chunk(param.numel, spec.dp_world_size)
        if not isinstance(ref, TensorRef) or ref.numel != chunk or ref.dtype != spec.frozen_dtype:
            found = f"{list(ref.shape)} {ref.dtype}" if isinstance(ref, TensorRef) else "nothing"
            raise CheckpointError(path, f"frozen fragment of {param.name} is {found}, expected [{chunk}] "
                                        f"{spec.frozen_dtype} at {spec.dp_world_size} ranks")
        refs[("frozen", index, "frozen")] = ref
    return refs


def _expect(path: str, key: str, found, wanted) -> None:
    if found != wanted:
        raise CheckpointError(path, f"{key} is {_short(found)}, but the ZeRO layout rules give {_short(wanted)} "
                                    "(file from another world size or checkpoint, or a DeepSpeed layout reshard does not know)")


def _short(value, limit: int = 160) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def read_storages(path: str, refs) -> dict[int, bytes]:
    """The bytes of each distinct storage behind `refs` (TensorRefs of the file at `path`)."""
    wanted = {ref.storage_key: ref.storage_nbytes for ref in refs}
    data = {}
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        for key, nbytes in wanted.items():
            if key + nbytes > size:  # checked before allocating: a file never costs more than it holds
                raise CheckpointError(path, f"declares a storage of {nbytes:,} bytes at byte {key:,}, beyond the "
                                            f"end of the file ({size:,} bytes)")
            buf = bytearray(nbytes)
            pread_exact(fd, memoryview(buf), key, path)
            data[key] = bytes(buf)
    finally:
        os.close(fd)
    return data


def read_carried(path: str, tree, partitioned_refs) -> dict[int, bytes]:
    """Bytes of every storage in `tree` that is not a partition (step counters, buffers, ...)."""
    skip = {ref.storage_key for ref in partitioned_refs}
    return read_storages(path, [ref for ref in refs_in(tree) if isinstance(ref, TensorRef) and ref.storage_key not in skip])


def source_rank_tensors(source: SourceCheckpoint, rank: int, *, target: Topology | None,
                        trust_pickle: bool = False) -> dict:
    """{slot: (path, TensorRef)} for every partition of one source rank, after checking its files; with the
    tensors of the layer files it reads where `target`'s layer files move through the plan
    (`Topology.layer_files`; None: no target, as an export or `inspect`)."""
    spec = source.spec
    if spec.stage == 0:  # ZeRO-0 MoE: no partitions; its stage form's source_slots (deepspeed_zero0_moe) has them
        return {}
    at = spec.topology.coordinates(rank)
    layout = spec.layout(spec.topology, tp_rank=at.tp, pp_rank=at.pp)
    path = source.optim_path(rank)
    tree = load_portable(path, schema.safe_globals(), trust_pickle)
    found = {slot: (path, ref) for slot, ref in validate_optim_tree(tree, path, spec, layout, at.dp).items()}
    _check_same_counters(tree, source, path)
    # Checked here, by the worker that owns this rank's files and has just read their pickles for
    # the layout checks, against rank 0's trees, which inspect_checkpoint read once and every worker
    # holds in its SourceCheckpoint: no file of another rank is opened, and no tensor bytes are read
    # beyond this file's own small values (none at all in a checkpoint DeepSpeed wrote).
    _check_same_as_rank0(optim_rank_values(tree), path, optim_rank_values(source.optim_template),
                         source.optim_path(0), source.carried.get(source.optim_name(0), {}))
    if spec.tensor is not None and spec.stage < 3 and at.dp == 0:  # ZeRO-1/2: this TP rank's module weights
        mpath = source.model_path(rank)
        mtree = load_portable(mpath, schema.safe_globals(), trust_pickle)
        _check_local_param_shapes(mtree, mpath, layout)
        check_param_shapes_against_module(mtree, mpath, experts=spec.experts is not None)
        _check_same_model_values(mtree, mpath, source)
        found.update({slot: (mpath, ref) for slot, ref in deepspeed_tensor.check_module_tree(
            mtree, mpath, spec.tensor.module, spec.topology.tp, at.tp, spec.tensor.aliases).items()})
    if target is not None and target.layer_files is not None:  # a pipeline's layer files in the plan: this rank's
        found.update(_layer_file_tensors(source, target, rank, trust_pickle))
    if spec.stage == 3:
        mpath = source.model_path(rank)
        mtree = load_portable(mpath, schema.safe_globals(), trust_pickle)
        if spec.tensor is not None:
            _check_local_param_shapes(mtree, mpath, layout)
        _check_same_model_values(mtree, mpath, source, with_param_shapes=spec.tensor is None)
        found.update({slot: (mpath, ref) for slot, ref in validate_model_tree(mtree, mpath, spec, rank).items()})
    return found


def _layer_file_tensors(source: SourceCheckpoint, target: Topology, rank: int, trust_pickle: bool) -> dict:
    """{(layer space, tensor, "layer"): (path, TensorRef)} of the layer files source rank `rank` reads under a
    pipeline tp change (SourceCheckpoint.layer_file_names), each tensor checked to be the one the plan reads:
    its entry present, its model rank's slice of the shape and the dtype model rank 0's file gave, contiguous."""
    axis, at = target.layer_files.axis, source.spec.topology.coordinates(rank)
    found = {}
    for name in source.layer_file_names(rank, target):
        path = os.path.join(source.tag_dir, name)
        index = int(name[len("layer_"):].partition("-")[0])
        tree = load_portable(path, schema.safe_globals(), trust_pickle)
        template = next(t for i, _, _, t in target.layer_files.templates if i == index)
        if not isinstance(tree, dict) or list(tree) != list(template):
            raise CheckpointError(path, f"holds the entries {list(tree) if isinstance(tree, dict) else type(tree)}, "
                                        f"{schema.layer_file_name(index, axis.layer_file_model(0))} {list(template)}")
        for key, ref in tree.items():
            place = axis.tensor(index, key)
            if place is None:
                continue
            space, j = place
            shape = tuple(space.tensors.local_shape(j, source.spec.topology.tp, at.tp))
            if not isinstance(ref, TensorRef) or tuple(ref.shape) != shape or ref.dtype != space.stream.dtype \
                    or not ref.is_contiguous:
                what = (f"a {ref.dtype} tensor of shape {list(ref.shape)}{'' if ref.is_contiguous else ', strided'}"
                        if isinstance(ref, TensorRef) else type(ref).__name__)
                raise CheckpointError(path, f"{key} is {what}; model rank {at.tp}'s slice is a contiguous "
                                            f"{space.stream.dtype} tensor of shape {list(shape)}")
            found[(space.name, j, space.stream.name)] = (path, ref)
    return found


def check_param_shapes_against_module(tree: dict, path: str, experts: bool = False) -> None:
    """A ZeRO-1/2 model-states file: each shape in `param_shapes` and `frozen_param_shapes` is the
    shape of the module tensor of that name (engine.py `_get_zero_param_shapes` and
    `_get_zero_frozen_param_attributes` record the shapes of the very parameters whose weights
    `module` holds whole, or TP-local under AutoTP). A shape that only keeps the element count (a
    transposed [9, 13] -> [13, 9]) lays out the same partitions, but is what zero_to_fp32.py and
    ds_to_universal.py reshape the parameter by, and the targets would carry it. Names missing from
    `module` are left alone: expert weights sit in their own files (engine.py `_save_moe_checkpoint`),
    and exclude_frozen_parameters leaves frozen ones out."""
    module = tree.get("module") if isinstance(tree.get("module"), dict) else {}
    tables = [*(tree.get("param_shapes") or []), tree.get("frozen_param_shapes") or {}]
    for key, table in zip(["param_shapes"] * (len(tables) - 1) + ["frozen_param_shapes"], tables):
        for name, size in (table.items() if isinstance(table, dict) else ()):
            ref = module.get(name)
            if not isinstance(ref, TensorRef):
                if ref is None and (experts or key == "frozen_param_shapes"):
                    continue
                raise CheckpointError(path, f"{key} lists {name}, but module has no tensor of that name")
            shape = tuple(int(d) for d in size)
            if shape != tuple(ref.shape):
                raise CheckpointError(path, f"{key} says {name} has shape {list(shape)}, but its tensor in module "
                                            f"has shape {list(ref.shape)}: the checkpoint's record of the parameter "
                                            "disagrees with its weights (file edited or damaged?)")


def _check_same_model_values(tree, path: str, source: SourceCheckpoint, with_param_shapes: bool = False) -> None:
    """A ZeRO-3 or TP model-states file of another rank: the values every rank saves alike
    (deepspeed_rank_values) equal rank 0's; ZeRO-3 without TP: `param_shapes` too (engine.py
    `_get_zero_param_shapes` lists the same parameters and shapes on every rank, and they are the
    only record of a partitioned parameter's shape)."""
    keys = MODEL_VALUES + (("param_shapes",) if with_param_shapes else ())
    if path == source.model_path(0):
        return
    _check_same_as_rank0(model_rank_values(tree, keys), path, model_rank_values(source.model_template, keys),
                         source.model_path(0), source.carried.get(source.model_name(0), {}))


def _check_same_as_rank0(found: dict, path: str, wanted: dict, rank0_path: str, rank0_bytes: dict) -> None:
    """Refuse a file whose value of a key DeepSpeed saves alike on every rank differs from rank 0's
    (reshard.formats.deepspeed_files.deepspeed_rank_values): every target rank would get rank 0's."""
    difference, tensors = compare(found, wanted)
    if difference is not None:
        difference = (difference[0], describe(difference[1]), describe(difference[2]))
    elif tensors:
        # tensors among those values (a tensor lr, say): by bytes, where rank 0's bytes were carried
        stored = read_storages(path, [ref for _, ref, _ in tensors])
        for where, ref, ref0 in tensors:
            if ref0.storage_key in rank0_bytes and _tensor_bytes(stored[ref.storage_key], ref) != \
                    _tensor_bytes(rank0_bytes[ref0.storage_key], ref0):
                difference = (where, _tensor_text(stored[ref.storage_key], ref),
                              _tensor_text(rank0_bytes[ref0.storage_key], ref0))
                break
    if difference is not None:
        where, here, there = difference
        refuse(path, where, here, rank0_path, there)


def _tensor_bytes(storage: bytes, ref: TensorRef) -> bytes:
    if ref.is_contiguous:
        start = ref.storage_offset * ref.itemsize
        return bytes(storage[start:start + ref.numel * ref.itemsize])
    return bytes(storage)


def _tensor_text(storage: bytes, ref: TensorRef) -> str:
    import numpy as np
    data = _tensor_bytes(storage, ref)
    try:
        values = np.frombuffer(data, dtype=np.dtype(ref.dtype)).tolist()
    except TypeError:  # bfloat16 and other dtypes numpy does not name
        values = data.hex()
    text = f"tensor {ref.dtype} {list(ref.shape)} {values}"
    return text if len(text) <= 120 else text[:120] + "..."


def _check_local_param_shapes(tree, path: str, layout) -> None:
    shapes = [[(name, tuple(int(d) for d in size)) for name, size in group.items()]
              for group in (tree.get("param_shapes") or [])]
    order = [sg.params for sg in layout.sub_groups] if hasattr(layout, "sub_groups") else \
        [g.flat_order for g in layout.groups]  # ZeRO-3: per sub-group; ZeRO-1/2: per group, flat order
    if hasattr(layout, "param_shapes_on_rank"):  # AutoEP with AutoTP: fused local expert names
        wanted = [[(name, tuple(shape)) for name, shape in layout.param_shapes_on_rank(ids, 0)] for ids in order]
    else:
        wanted = [[(layout.params[p].name, tuple(layout.params[p].shape)) for p in ids] for ids in order]
    if shapes != wanted:
        raise CheckpointError(path, f"param_shapes {_short(shapes)} are not this TP rank's shards {_short(wanted)}")


def _check_same_counters(tree, source: SourceCheckpoint, path: str) -> None:
    """Every rank steps together: a different optimizer `step` means a shard of another checkpoint."""
    spec = source.spec
    template_bytes = source.carried.get(source.optim_name(0), {})

    def step_refs(t):
        states = _optimizer_states(t[OPT], spec.stage, path)
        return {b: v.get("step") for b, v in states.items()}

    mine, rank0 = step_refs(tree), step_refs(source.optim_template)
    stored = read_storages(path, [ref for ref in mine.values() if isinstance(ref, TensorRef)])
    for buffer, ref0 in rank0.items():
        ref = mine.get(buffer)
        if isinstance(ref0, TensorRef) and isinstance(ref, TensorRef) and ref0.storage_key in template_bytes:
            same = stored[ref.storage_key] == template_bytes[ref0.storage_key]
        else:
            same = ref == ref0
        if not same:
            raise CheckpointError(path, f"optimizer step counter of flat buffer {buffer} differs from rank 0's: "
                                        "shards of different checkpoints (or saves) mixed in one tag directory")


def inspect_pipeline_columns(save_dir: str | os.PathLike, tag: str | None = None, *, trust_pickle: bool = False,
                             read_tensors: bool = True, layer_shapes: bool = True, pipe=None) -> SourceCheckpoint:
    """A PipelineModule save as the main road takes it when its stages and model ranks are kept
    (docs/architecture.md, "One road"): each column (stage s, model rank m; mp index s * tp + m) is a
    ZeRO-1 save over its stage's own parameters, so the spec holds each column's (params, groups)
    (`CheckpointSpec.columns`), its topology (dp, tp, pp), and the source keeps each column's dp rank 0
    trees as templates; the layer files travel unchanged, as `other_files`. The save's structure is
    checked first as the pipeline job checks it (deepspeed_pipeline.inspect_pipeline, which refuses
    parameter alignment and round-robin gradients). `layer_shapes=False`: the layer files are not read
    (verify --against compares an output's layer files with the source's, and reports a damaged one).
    `pipe`: the save's inspect_pipeline, where the caller has read it already (a pp or tp change needs it
    again for the target's stages, collective_job.inspect_pipeline_target): the stage pickles read once."""
    from reshard.formats.deepspeed_files.deepspeed_pipeline import inspect_pipeline
    if pipe is None:
        save_dir = os.path.abspath(os.fspath(save_dir))
        pipe = inspect_pipeline(save_dir, resolve_tag(save_dir, tag), trust_pickle, layer_shapes=layer_shapes)
    found = [inspect_pipeline_column_trees(pipe, column, trust_pickle, read_tensors)
             for column in range(pipe.pp * pipe.tp)]
    return pipeline_columns_source(pipe, found)


def inspect_pipeline_column_trees(pipe, column: int, trust_pickle: bool = False, read_tensors: bool = True,
                                  model_tree: dict | None = None) -> tuple:
    """One column's part of inspect_pipeline_columns, on a worker that sees its dp rank 0 optimizer file
    (a node-local job runs each where it is): (its CheckpointSpec, optim file name, carried storages,
    (optim tree, model tree)). `model_tree`: its model-states file's portable tree, already read (a
    node-local job: where that file is, when another node holds the optimizer file)."""
    tag_dir = pipe.tag_dir
    topology = Topology(dp=pipe.dp, tp=pipe.tp, pp=pipe.pp)
    stage, model = divmod(column, pipe.tp)
    rank = topology.rank_of(0, model, stage)
    optim_name = schema.optim_file_name_of(topology, rank, pipe.bf16)
    model_path = os.path.join(tag_dir, schema.model_file_name_of(topology, rank, 1))
    optim_path = os.path.join(tag_dir, optim_name)
    if model_tree is None:
        model_tree = load_portable(model_path, schema.safe_globals(), trust_pickle)
    optim_tree = load_portable(optim_path, schema.safe_globals(), trust_pickle)
    params, groups = [], []
    for shapes in model_tree["param_shapes"]:
        groups.append(tuple(range(len(params), len(params) + len(shapes))))
        params.extend(ParamSpec(name, tuple(int(d) for d in shape)) for name, shape in shapes.items())
    osd = optim_tree[OPT]
    # a stage file holds no module tensors: the model's dtype is the master's under fp32, else named by
    # the save's flags; it only sets parameter alignment, which pipelines do not use (refused above)
    lp_dtype = "bfloat16" if pipe.bf16 else ("float16" if (model_tree.get("ds_config") or {}).get(
        "fp16", {}).get("enabled") else "float32")
    column_spec = CheckpointSpec(1, "bf16_optimizer" if pipe.bf16_optimizer else "zero", pipe.bf16, topology,
                                 tuple(params), tuple(groups), False, 1, DEFAULT_SUB_GROUP_SIZE, lp_dtype, ())
    layout = zero12_layout(column_spec.params, column_spec.groups, pipe.dp)
    column_spec = dataclasses.replace(column_spec, streams=_discover_streams(osd, optim_path, column_spec, layout))
    parts = validate_optim_tree(optim_tree, optim_path, column_spec, layout, 0)
    carried = read_carried(optim_path, optim_tree, parts.values()) if read_tensors else None
    return column_spec, optim_name, carried, (optim_tree, model_tree)


def pipeline_columns_source(pipe, found: Sequence[tuple]) -> SourceCheckpoint:
    """inspect_pipeline_columns's SourceCheckpoint from every column's inspect_pipeline_column_trees
    (column order), the columns' optimizer states checked alike."""
    save_dir, tag, tag_dir = pipe.save_dir, pipe.tag, pipe.tag_dir
    columns, templates, carried, everything, spec = [], [], {}, [], None
    for column_spec, optim_name, column_carried, trees in found:
        if spec is not None and column_spec.streams != spec.streams:
            raise UnsupportedCheckpoint(os.path.join(tag_dir, optim_name),
                                        f"holds optimizer states {[s.name for s in column_spec.streams]}, "
                                        f"column 0 {[s.name for s in spec.streams]}")
        spec = spec or column_spec
        if column_carried is not None:
            carried[optim_name] = column_carried
        columns.append((column_spec.params, column_spec.groups))
        templates.append(trees)
        everything.extend(column_spec.params)
    spec = dataclasses.replace(spec, params=tuple(everything), columns=tuple(columns))
    other_dirs = ()
    if os.path.isdir(tag_dir):
        _, other_dirs = _other_contents(tag_dir, {name: schema.classify(name) for name in sorted(os.listdir(tag_dir))
                                                  if os.path.isfile(os.path.join(tag_dir, name))})
    optim_tree, model_tree = templates[0]
    manifest_source = {"save_dir": save_dir, "tag": tag, "dp_world_size": pipe.dp, "pp": pipe.pp, "tp": pipe.tp,
                       "stage": 1, "description": pipe.describe()}  # as the deleted pipeline job wrote it (pinned)
    return SourceCheckpoint(save_dir, tag, spec, optim_tree, model_tree, carried,
                            tuple(sorted(pipe.layer_files + pipe.other_files)), other_dirs, tuple(templates),
                            manifest_source, pipeline=pipe)
