"""What a DeepSpeed checkpoint holds and what reshard can make of it, without reading tensors.

    python -m reshard inspect /ckpt/run1 [--tag TAG] [--json]

    from reshard.inspect_report import inspect_report
    report = inspect_report("/ckpt/run1")
    print(report.text())            # or json.dumps(report.as_dict())
    report.problems                 # what the pre-flight checks found; the CLI exits 2 when any

Reads the pickles of every rank file (`map_location="meta"`) and the few bytes of the
optimizer step counters, which the consistency check compares between ranks; no partition,
weight or buffer bytes. Every rank's files are validated exactly as a reshard job validates
them before moving a byte (`formats.deepspeed_files.deepspeed_inspect.source_rank_tensors`), so a report with
no problems means the job's pre-flight checks pass.

The `--json` document (`as_dict()`), schema "reshard.inspect/1":
    schema, save_dir, tag, latest (tag in SAVE_DIR/latest or null), latest_universal (or null),
    tags: [tag directories holding ZeRO files],
    files: {name: bytes} of the tag directory,       total_bytes,
    topology: {stage, dp, tp, ep, pp, sp}   (dp: the ranks ZeRO partitions over, sp x dp under Ulysses),
    precision: {module_dtype, master_dtype, bf16_file_prefix},
    optimizer: {zero_optimizer, base_optimizer, state_keys: [partitioned state], scalar_state_keys},
    groups: [{index, params, elements, hyperparameters: {key: value}}],
    frozen: {stored: how they are saved, params: [{name, shape}]},
    tied: {alias: owner},  buffers: [names],  counters: {global_steps, global_samples, skipped_steps},
    client_state_keys: [top-level keys of the model-states file that are not DeepSpeed's],
    targets: {reshard_dp: "any", "any multiple of SP" or [sizes] (at the save's sp), batch_config: text,
              export_formats: [...], notes: [...]},
    problems: [messages]
Keys whose facts could not be read (a checkpoint too broken to inspect) hold null.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from reshard.jobs.batch_config import working_data_parallel_sizes
from reshard.errors import ReshardError
from reshard.formats.deepspeed_files import deepspeed_schema as schema
from reshard.formats.deepspeed_files.deepspeed_client_state import client_state_keys
from reshard.formats.deepspeed_files.deepspeed_inspect import inspect_checkpoint, resolve_tag, source_rank_tensors
from reshard.formats.deepspeed_files.deepspeed_sequence_parallel import saved_sequence_parallel_size
from reshard.formats.deepspeed_files.deepspeed_spec import SourceCheckpoint
from reshard.formats.torch_bytes.torch_archive import TensorRef

SCHEMA = "reshard.inspect/1"

# Formats `python -m reshard export` writes; every ZeRO checkpoint reshard reads can be exported, to
# "dcp" only when its optimizer keeps Adam's state (reshard.export.dcp_optimizer refuses the others).
EXPORT_FORMATS: tuple[str, ...] = ("safetensors", "universal", "dcp")

# Largest data-parallel size listed when a fixed train_batch_size restricts the choice.
_LISTED_DP_LIMIT = 4096


@dataclass
class InspectReport:
    """The facts of one checkpoint tag; see the module docstring for each key."""

    save_dir: str
    tag: str | None
    latest: str | None = None
    latest_universal: str | None = None
    tags: list = field(default_factory=list)
    files: dict = field(default_factory=dict)
    topology: dict | None = None
    precision: dict | None = None
    optimizer: dict | None = None
    groups: list | None = None
    frozen: dict | None = None
    tied: dict | None = None
    buffers: list | None = None
    counters: dict | None = None
    client_state_keys: list | None = None
    targets: dict | None = None
    problems: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def as_dict(self) -> dict:
        return {"schema": SCHEMA, "save_dir": self.save_dir, "tag": self.tag, "latest": self.latest,
                "latest_universal": self.latest_universal, "tags": self.tags, "files": self.files,
                "total_bytes": sum(self.files.values()), "topology": self.topology, "precision": self.precision,
                "optimizer": self.optimizer, "groups": self.groups, "frozen": self.frozen, "tied": self.tied,
                "buffers": self.buffers, "counters": self.counters, "client_state_keys": self.client_state_keys,
                "targets": self.targets, "problems": self.problems}

    def text(self) -> str:
        lines = [f"checkpoint {self.save_dir} tag {self.tag} (latest: {self.latest}"
                 + (f", latest_universal: {self.latest_universal}" if self.latest_universal else "") + ")",
                 f"tags: {', '.join(self.tags) or 'none'}"]
        if self.topology:
            t = self.topology
            sp = t.get("sp", 1)
            dp = f"dp {t['dp']}" + (f" (sequence parallel: sp {sp} x dp {t['dp'] // sp})" if sp > 1 else "")
            lines.append(f"topology: ZeRO-{t['stage']}, {dp}, tp {t['tp']}, ep {t['ep']}, pp {t['pp']}")
        if self.precision:
            p = self.precision
            lines.append(f"precision: module {p['module_dtype']}, masters {p['master_dtype']}"
                         + (" (bf16_ file prefix)" if p["bf16_file_prefix"] else ""))
        if self.optimizer:
            o = self.optimizer
            lines.append(f"optimizer: {o['zero_optimizer']} over {o['base_optimizer']}; partitioned state "
                         f"{', '.join(o['state_keys']) or 'none'}; scalar state {', '.join(o['scalar_state_keys']) or 'none'}")
        for group in self.groups or []:
            hyper = ", ".join(f"{k}={v}" for k, v in group["hyperparameters"].items())
            lines.append(f"  group {group['index']}: {group['params']} params, {group['elements']:,} elements; {hyper}")
        if self.frozen is not None:
            names = ", ".join(f"{p['name']} {p['shape']}" for p in self.frozen["params"]) or "none"
            lines.append(f"frozen parameters ({self.frozen['stored']}): {names}")
        if self.tied is not None:
            lines.append(f"tied: {', '.join(f'{a} -> {o}' for a, o in self.tied.items()) or 'none'}")
        if self.buffers is not None:
            lines.append(f"buffers: {', '.join(self.buffers) or 'none'}")
        if self.counters:
            lines.append("counters: " + ", ".join(f"{k} {v}" for k, v in self.counters.items()))
        if self.client_state_keys is not None:
            lines.append(f"client_state keys: {', '.join(self.client_state_keys) or 'none'}")
        lines.append(f"files ({_size(sum(self.files.values()))}):")
        lines += [f"  {name:56s} {_size(nbytes):>10s}" for name, nbytes in self.files.items()]
        if self.targets:
            t = self.targets
            lines.append(f"reshard can write it {_target_sizes(t['reshard_dp'])}, as ZeRO-{self.topology['stage']}"
                         + (f" ({t['batch_config']})" if t["batch_config"] else ""))
            if t["export_formats"]:
                lines.append(f"export formats: {', '.join(t['export_formats'])}")
            lines += [f"note: {note}" for note in t["notes"]]
        lines += [f"PROBLEM: {problem}" for problem in self.problems] or ["no problems found"]
        return "\n".join(lines)


def _target_sizes(sizes) -> str:
    """"any" -> "at any --target-dp"; [1, 2, 4] -> "at --target-dp 1, 2 or 4"."""
    if isinstance(sizes, str):
        return f"at {sizes} --target-dp"
    words = [str(size) for size in sizes]
    if not words:
        return "at no --target-dp"
    return "at --target-dp " + (", ".join(words[:-1]) + " or " + words[-1] if len(words) > 1 else words[0])


def inspect_report(save_dir: str | os.PathLike, tag: str | None = None, *, trust_pickle: bool = False) -> InspectReport:
    """Inspect `save_dir` (tag: `tag`, else the one `latest` names); problems go into the report."""
    save_dir = os.path.abspath(os.fspath(save_dir))
    report = InspectReport(save_dir, tag, latest=_read_pointer(save_dir, schema.LATEST),
                           latest_universal=_read_pointer(save_dir, "latest_universal"))
    if os.path.isdir(save_dir):
        report.tags = sorted(d for d in os.listdir(save_dir) if _holds_zero_files(os.path.join(save_dir, d)))
    try:
        report.tag = resolve_tag(save_dir, tag)
    except ReshardError as error:
        report.problems.append(str(error))
        return report
    tag_dir = os.path.join(save_dir, report.tag)
    report.files = {name: os.path.getsize(os.path.join(tag_dir, name)) for name in sorted(os.listdir(tag_dir))
                    if os.path.isfile(os.path.join(tag_dir, name))}
    try:
        source = inspect_checkpoint(save_dir, report.tag, trust_pickle=trust_pickle, carry_model_bytes=False)
    except ReshardError as error:
        report.problems.append(str(error))
        return report
    _describe(report, source)
    for rank in range(source.spec.dp_world_size):
        try:
            source_rank_tensors(source, rank, target=None, trust_pickle=trust_pickle)
        except ReshardError as error:
            report.problems.append(str(error))
    return report


def _read_pointer(save_dir: str, name: str) -> str | None:
    path = os.path.join(save_dir, name)
    if not os.path.isfile(path):
        return None
    with open(path) as fd:
        return fd.read().strip() or None


def _holds_zero_files(path: str) -> bool:
    return os.path.isdir(path) and any(schema.classify(n).kind == "optim" for n in os.listdir(path))


def _describe(report: InspectReport, source: SourceCheckpoint) -> None:
    spec, model = source.spec, source.model_template
    osd = source.optim_template[schema.OPTIM]
    base = osd[schema.OPTIM] if spec.stage == 3 else osd["base_optimizer_state"]
    dims = model.get("checkpoint_parallel_dimensions") or {}
    report.topology = {"stage": spec.stage, "dp": spec.dp_world_size, "tp": int(model.get("mp_world_size", 1)),
                       "ep": spec.topology.ep, "pp": int(dims.get("pp_degree", 1)),
                       "sp": saved_sequence_parallel_size(model)}
    master = next(s for s in spec.streams if s.name == "fp32")
    report.precision = {"module_dtype": spec.lp_dtype, "master_dtype": master.dtype, "bf16_file_prefix": spec.bf16_prefix}
    scalar_keys = sorted({k for entry in base["state"].values() for k in entry} - {s.name for s in spec.streams})
    config = model.get("ds_config") if isinstance(model.get("ds_config"), dict) else {}
    configured = configured_optimizer_class(config)
    zero_optimizer = {"bf16_optimizer": "BF16_Optimizer"}.get(
        spec.optimizer, "DeepSpeedZeroOptimizer_Stage3" if spec.stage == 3 else "DeepSpeedZeroOptimizer")
    report.optimizer = {"zero_optimizer": zero_optimizer,
                        "base_optimizer": configured or client_optimizer_family(base["param_groups"]),
                        "state_keys": [s.name for s in spec.streams if s.name != "fp32"],
                        "scalar_state_keys": scalar_keys}
    report.groups = [{"index": index, "params": len(ids), "elements": sum(spec.params[p].numel for p in ids),
                      "hyperparameters": {k: _plain(v) for k, v in group.items() if k != "params"}}
                     for index, (ids, group) in enumerate(zip(spec.groups, base["param_groups"]))]
    report.frozen = _frozen(source)
    report.tied = dict(model.get("shared_params") or {})
    report.buffers = list(model.get("buffer_names") or [])
    report.counters = {k: model.get(k) for k in ("global_steps", "global_samples", "skipped_steps")}
    report.client_state_keys = client_state_keys(model)
    report.targets = _targets(source, config)


def configured_optimizer_class(config: dict) -> str | None:
    """The optimizer class DeepSpeed built from ds_config's `optimizer` block, None without one
    (engine.py `_configure_basic_optimizer`, `get_optimizer_configuration`, `zero_use_cpu_optimizer`):
    Adam and AdamW become DeepSpeedCPUAdam under offload_optimizer to cpu or nvme (ZenFlowCPUAdam with
    zenflow), torch's own with `torch_adam`, else FusedAdam; Adagrad and Lion have CPU twins too."""
    block = config.get("optimizer")
    kind = block.get("type") if isinstance(block, dict) else None
    if not isinstance(kind, str):
        return None
    params = block.get("params") if isinstance(block.get("params"), dict) else {}
    zero = config.get("zero_optimization") if isinstance(config.get("zero_optimization"), dict) else {}
    offload = zero.get("offload_optimizer") if isinstance(zero.get("offload_optimizer"), dict) else {}
    on_cpu = offload.get("device") in ("cpu", "nvme")
    where = f" (ds_config {kind}, offload_optimizer {offload.get('device')})" if on_cpu else f" (ds_config {kind})"
    name = kind.lower()
    if name in ("adam", "adamw"):
        if params.get("torch_adam"):
            adam_w = name == "adamw" or params.get("adam_w_mode", True)
            return ("torch.optim.AdamW" if adam_w else "torch.optim.Adam") + where
        if on_cpu:
            return ("ZenFlowCPUAdam" if zero.get("zenflow") else "DeepSpeedCPUAdam") + where
        return "FusedAdam" + where
    if name in ("adagrad", "lion") and on_cpu:
        return ("DeepSpeedCPUAdagrad" if name == "adagrad" else "DeepSpeedCPULion") + where
    return kind


def client_optimizer_family(param_groups: list) -> str:
    """A client optimizer leaves no class name in the checkpoint; its hyperparameters say the family:
    DeepSpeed's Adams keep `bias_correction` in every group (ops/adam/cpu_adam.py `DeepSpeedCPUAdam`
    with `amsgrad`, ops/adam/fused_adam.py `FusedAdam` without), torch's do not."""
    keys = set(param_groups[0]) if param_groups else set()
    if {"bias_correction", "betas"} <= keys:
        return ("DeepSpeedCPUAdam" if "amsgrad" in keys else "FusedAdam") + " (client optimizer)"
    if "betas" in keys:
        return "AdamW (client optimizer)" if param_groups[0].get("decoupled_weight_decay") else "Adam-like (client optimizer)"
    if "momentum" in keys:
        return "SGD-like (client optimizer)"
    return "client optimizer (class not recorded)"


def _frozen(source: SourceCheckpoint) -> dict:
    spec, model = source.spec, source.model_template
    trainable = {p.name for p in spec.params}
    if spec.stage == 3:
        shapes = model.get("frozen_param_shapes")
        stored = "partitioned in frozen_param_fragments" if shapes is not None else "not saved (excluded at save: exclude_frozen_parameters)"
        params = [{"name": n, "shape": list(s)} for n, s in (shapes or {}).items()]
    else:
        module = model.get("module") or {}
        skip = trainable | set(model.get("buffer_names") or []) | set(model.get("shared_params") or {})
        params = [{"name": n, "shape": list(r.shape)} for n, r in module.items() if n not in skip and isinstance(r, TensorRef)]
        if model.get("frozen_param_shapes") is not None:
            stored = "whole, in module and frozen_param_fragments"
        elif params:
            stored = "whole, in module"
        else:
            stored = "none in module (none, or excluded at save)"
    return {"stored": stored, "params": params}


def _targets(source: SourceCheckpoint, config: dict) -> dict:
    sp = saved_sequence_parallel_size(source.model_template)
    working = working_data_parallel_sizes(config, _LISTED_DP_LIMIT)
    if working is not None:
        sizes: Any = [sp * dp for dp in working]
        why = (f"train_batch_size {config['train_batch_size']} is fixed in ds_config; other sizes need "
               "--ignore-batch-config")
    else:
        sizes, why = ("any" if sp == 1 else f"any multiple of {sp}"), ""
    notes = []
    if sp > 1:
        other = (f"at --target-sp 1, dp sizes {', '.join(map(str, working)) or 'none'}" if working is not None
                 else "--target-sp 1 allows any size")
        notes.append(f"DeepSpeed Ulysses sequence parallelism, sp {sp} (checkpoint_parallel_dimensions' tp_degree is "
                     f"sp here, not tensor parallelism): ZeRO partitions over sp x dp = {source.spec.dp_world_size} "
                     f"ranks, and --target-dp counts them; the sizes above are for a job at sp {sp} (the default "
                     f"--target-sp); {other}")
    if source.spec.optimizer == "bf16_optimizer":
        notes.append("BF16_Optimizer checkpoint: DeepSpeed's zero_to_fp32.py cannot read it; reshard reads it")
    if source.spec.round_robin:
        notes.append("round_robin_gradients: the flat order depends on the dp size; reshard recomputes it")
    formats = list(EXPORT_FORMATS)
    if {s.name for s in source.spec.streams} != {"fp32", "exp_avg", "exp_avg_sq"}:
        formats.remove("dcp")
    if source.spec.tensor is not None:
        from reshard.layouts.tensor_parallel import describe_splits
        formats = [f for f in formats if f == "dcp"]  # the DCP export joins TP slices whole; the others refuse TP
        notes.append(f"tensor parallel (AutoTP, tp={source.spec.topology.tp}): --target-tp T reshards to any TP size "
                     "whose split dimensions give every rank a shard")
        notes += [f"{kind}: {', '.join(names)}" for kind, names in describe_splits(
            source.spec.tensor.params.names, source.spec.tensor.params.splits).items()]
    if source.spec.experts is not None:
        counts = sorted(set(source.spec.experts.num_experts))
        moe_kind = "AutoEP (fused experts)" if source.spec.experts.autoep else "native MoE"
        notes.append(f"{moe_kind}, {len(source.spec.experts.num_experts)} layers of {'/'.join(map(str, counts))} "
                     f"experts at ep={source.spec.topology.ep}: reshard writes any --target-ep that divides both the "
                     "target dp (dp x tp with AutoTP) and the experts of every layer")
        # the DCP and safetensors exports read MoE saves as the model at ep 1 (export/hf_layout.refuse_unnamed_experts:
        # folded with AutoTP: DCP only, not at ZeRO-3); the universal export does not read MoE saves yet
        served = source.spec.tensor is None or source.spec.stage != 3
        formats = [f for f in formats if f != "universal"] if served else []
    return {"reshard_dp": sizes, "batch_config": why, "export_formats": formats, "notes": notes}


def _plain(value):
    """A JSON-friendly copy of a hyperparameter value."""
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, TensorRef):
        return f"tensor({value.dtype}, {list(value.shape)})"
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def _size(nbytes: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return f"{nbytes} B"
