"""Write a real-format DeepSpeed 0.19.8 ZeRO-2/3 checkpoint of a bench model for N ranks, without training.

    python bench/synthetic_checkpoint.py OUT_DIR --stage 2 --ranks 256 --model tiny [--seed 0]
    python bench/synthetic_checkpoint.py OUT_DIR --stage 2 --ranks 2 --model 10G      # a ladder size
    python bench/synthetic_checkpoint.py OUT_DIR --check-truth CKPT_DIR              # zero_to_fp32 vs truth

DeepSpeed cannot train 256 CPU ranks or a 10 GB model on this machine, so the bench writes
such checkpoints directly, as `engine.save_checkpoint` would after one fp32 AdamW step of a
`bench_model.BenchModel` (`bench_model.build_engine`: two param groups, torch AdamW, the
position embedding frozen): the same files (`latest`, the tag directory, the recovery
scripts), the same pickle trees and metadata. Every element comes from a known state:
`known_values(seed, stream, param, start, count)` is a counter-based hash of (seed, stream,
parameter id, element index), so the truth of any element is recomputed on its own and
nothing is ever held whole. Files are written tensor by tensor in chunks of CHUNK elements;
the resident memory stays at a few chunks whatever N and the model size.

Little here restates DeepSpeed. The world-size dependent parts come from reshard itself:
the layout rules (`CheckpointSpec.layout`, reshard/layouts/zero.py), the per-rank trees with their
metadata (`deepspeed_target.target_files`: partition_count, group_paddings,
param_alignment_paddings, param_slice_mappings, param_shapes, ZeRO-3 sub-groups and frozen
fragments, dp_world_size) and the skeleton writer (`torch_archive.materialize`,
`write_skeleton`, DeepSpeed's class names via `deepspeed_classes`). This module only builds
the rank-0 "source" trees reshard derives targets from: the keys DeepSpeed writes
(runtime/engine.py `_save_checkpoint`, `_save_zero_checkpoint`; stage_1_and_2.py and
stage3.py `state_dict`), torch AdamW's own param_groups, and where each tensor's values come
from. tests/test_synthetic_checkpoint.py checks the result against a checkpoint DeepSpeed
really trains (same names, trees and metadata) and loads it with plain `load_checkpoint`.

Values: stream "fp32" (master weights; ZeRO-2's module weights are the same values, as after
an fp32 step), "exp_avg", "exp_avg_sq" (>= 0), "frozen" (the frozen position embedding);
padding is zero, every `step` is 1.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import importlib.util
import json
import os
import shutil
import sys
import time
from collections import OrderedDict
from importlib.metadata import version

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
if REPO not in sys.path:
    sys.path.insert(1, REPO)

from bench_model import LADDER, ModelConfig, ds_config  # noqa: E402

TAG = "global_step1"
CHUNK = 1 << 20
"""Elements generated and written at once (4 MiB of fp32: numpy's temporaries stay in cache)."""
STREAMS = {"fp32": 1, "exp_avg": 2, "exp_avg_sq": 3, "frozen": 4}
MODELS = {
    "tiny": ModelConfig(name="tiny", vocab_size=61, dim=9, layers=2, heads=3, seq_len=5),  # odd sizes: padding
    "small": ModelConfig(name="small", vocab_size=1000, dim=64, layers=4, heads=4, seq_len=16),
    **LADDER,
}
CLIENT_STATE = {"bench_note": "reshard benchmark", "loss": 0.0}
"""make_checkpoint.py saves this client state (with the step's real loss)."""

_M64 = (1 << 64) - 1


def _mix(value: int) -> int:
    """splitmix64's finaliser on a Python int (the per-stream key)."""
    value = (value + 0x9E3779B97F4A7C15) & _M64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _M64
    return value ^ (value >> 31)


def known_values(seed: int, stream: str, param: int, start: int, count: int) -> np.ndarray:
    """Elements [start, start + count) of `param`'s flattened `stream`, as float32.

    Counter-based: element i of (seed, stream, param) is murmur3's 32-bit finaliser of
    i * golden + key, reduced to 24 bits, so any range is computed alone and every caller gets
    the same bits (about 10 ns an element; parameters below 2**32 elements).
    """
    if start + count > 1 << 32:
        raise ValueError("known_values: parameters of 2**32 elements or more are not supported")
    key = np.uint32(_mix((seed << 40) ^ (STREAMS[stream] << 32) ^ param) & 0xFFFFFFFF)
    x = np.arange(start, start + count, dtype=np.uint32)
    x *= np.uint32(0x9E3779B1)
    x += key
    x ^= x >> np.uint32(16)
    x *= np.uint32(0x85EBCA6B)
    x ^= x >> np.uint32(13)
    x *= np.uint32(0xC2B2AE35)
    x ^= x >> np.uint32(16)
    unit = (x >> np.uint32(8)).astype(np.float32)
    unit *= np.float32(2.0 ** -24)  # [0, 1), exact
    if stream == "exp_avg_sq":
        unit *= np.float32(1e-6)
        return unit
    unit -= np.float32(0.5)
    unit *= np.float32({"fp32": 0.04, "exp_avg": 2e-3, "frozen": 0.04}[stream])
    return unit


def known_tensor(seed: int, stream: str, param: int, shape):  # -> torch.Tensor (torch imported inside)
    """The whole of one parameter's stream (for checks on small models)."""
    import torch
    count = int(np.prod(shape)) if len(shape) else 1
    return torch.from_numpy(known_values(seed, stream, param, 0, count)).reshape(tuple(shape))


@dataclasses.dataclass(frozen=True)
class ModelParams:
    """The bench model's parameters as DeepSpeed sees them, found on the meta device."""

    named: tuple[tuple[str, tuple[int, ...], bool], ...]
    """(name, shape, trainable) in `model.named_parameters()` order (the module state_dict's)."""
    groups: tuple[tuple[int, ...], ...]
    """Trainable ids (index among trainable params) of each optimizer group (bench_model.param_groups)."""
    param_groups: tuple[dict, ...]
    """torch AdamW's state_dict param_groups without "params"."""
    state_dict_metadata: tuple
    """`model.state_dict()._metadata` items (module versions), pickled with the module state_dict."""

    @property
    def trainable(self) -> list[tuple[str, tuple[int, ...]]]:
        return [(name, shape) for name, shape, grad in self.named if grad]

    @property
    def frozen(self) -> list[tuple[str, tuple[int, ...]]]:
        return [(name, shape) for name, shape, grad in self.named if not grad]


def model_params(cfg: ModelConfig) -> ModelParams:
    import torch
    from bench_model import BenchModel, param_groups
    with torch.device("meta"):
        model = BenchModel(cfg)
        groups = param_groups(model)
        optimizer = torch.optim.AdamW(groups, betas=(0.9, 0.95), eps=1e-8)  # as bench_model.build_engine
    named = tuple((name, tuple(p.shape), p.requires_grad) for name, p in model.named_parameters())
    trainable_ids = {id(p): i for i, p in enumerate(p for p in model.parameters() if p.requires_grad)}
    ids = tuple(tuple(trainable_ids[id(p)] for p in g["params"]) for g in groups)
    hyper = tuple({k: v for k, v in g.items() if k != "params"} for g in optimizer.state_dict()["param_groups"])
    return ModelParams(named, ids, hyper, tuple(model.state_dict()._metadata.items()))


def checkpoint_spec(params: ModelParams, stage: int, ranks: int):
    """The CheckpointSpec reshard's inspection finds in such a checkpoint (fp32 AdamW, no reorder)."""
    from reshard.formats.deepspeed_files.deepspeed_spec import CheckpointSpec
    from reshard.layouts.zero import DEFAULT_SUB_GROUP_SIZE, ParamSpec
    from reshard.planning.plan import Stream
    from reshard.topology import Topology
    streams = tuple(Stream(name, "float32", 4) for name in ("fp32", "exp_avg", "exp_avg_sq"))
    frozen = tuple(ParamSpec(n, s) for n, s in params.frozen) if stage == 3 else ()
    return CheckpointSpec(stage=stage, optimizer="zero", bf16_prefix=False, topology=Topology(dp=ranks),
                          params=tuple(ParamSpec(n, s) for n, s in params.trainable), groups=params.groups,
                          round_robin=False, param_alignment=1, sub_group_size=DEFAULT_SUB_GROUP_SIZE,
                          lp_dtype="float32", streams=streams, frozen=frozen,
                          frozen_dtype="float32" if frozen else None)


class Storages:
    """Storage keys of the template trees and what fills each storage."""

    def __init__(self):
        self.meaning: dict[int, tuple] = {}

    def ref(self, what: tuple, nbytes: int, shape=(), offset: int = 0, requires_grad: bool = False, key=None):
        from reshard.formats.torch_bytes.torch_archive import TensorRef
        if key is None:
            key = len(self.meaning) + 1
            self.meaning[key] = what
        stride = tuple(int(np.prod(shape[i + 1:])) for i in range(len(shape)))
        return TensorRef(key, nbytes, "float32", tuple(shape), stride, offset, requires_grad)


def source_templates(cfg: ModelConfig, params: ModelParams, spec, storages: Storages) -> tuple[dict, dict]:
    """Rank 0's optim-states and model-states trees at the spec's world size, tensors as TensorRefs."""
    import torch
    from reshard.formats.deepspeed_files import deepspeed_classes as classes
    stage, ranks = spec.stage, spec.dp_world_size
    layout = spec.layout(ranks)
    config = ds_config(stage, cfg.micro_batch)
    ds_version = version("deepspeed")
    scaler = classes.LossScaler()
    scaler.__dict__.update({"cur_scale": 1.0, "dynamic": False})  # loss_scaler.py LossScaler.__init__

    def adam_state(numel: int) -> dict:
        return {"step": storages.ref(("step",), 4),
                "exp_avg": storages.ref(("partition",), 4 * numel, (numel,)),
                "exp_avg_sq": storages.ref(("partition",), 4 * numel, (numel,))}

    def param_groups(params_of_group) -> list[dict]:
        return [{**hyper, "params": list(ids)} for hyper, ids in zip(params.param_groups, params_of_group)]

    if stage == 3:
        sub_groups = layout.sub_groups
        osd = {"zero_stage": classes.ZeroStageEnum(3), "loss_scaler": scaler, "dynamic_loss_scale": False,
               "overflow": False, "partition_count": ranks,
               "optimizer_state_dict": {
                   "state": {i: adam_state(sg.partition_numel) for i, sg in enumerate(sub_groups)},
                   "param_groups": param_groups([[i for i, sg in enumerate(sub_groups) if sg.group == g]
                                                 for g in range(len(spec.groups))])},
               "fp32_flat_groups": [storages.ref(("partition",), 4 * sg.partition_numel, (sg.partition_numel,),
                                                 requires_grad=True) for sg in sub_groups]}
    else:
        groups = layout.groups
        osd = {"loss_scaler": scaler, "dynamic_loss_scale": False, "overflow": False,
               "clip_grad": config["gradient_clipping"],
               "base_optimizer_state": {"state": {g: adam_state(group.partition_numel) for g, group in enumerate(groups)},
                                        "param_groups": param_groups([[g] for g in range(len(groups))])},
               "single_partition_of_fp32_groups": [storages.ref(("partition",), 4 * g.partition_numel,
                                                                (g.partition_numel,), requires_grad=True)
                                                   for g in groups],
               "zero_stage": classes.ZeroStageEnum(2), "group_paddings": [], "param_alignment_paddings": [],
               "partition_count": [], "ds_version": ds_version, "param_slice_mappings": []}
    optim = {"optimizer_state_dict": osd, "ds_config": config, "ds_version": ds_version}

    trainable_id = {name: i for i, (name, _) in enumerate(params.trainable)}
    frozen_id = {name: j for j, (name, _) in enumerate(params.frozen)}
    module, frozen_refs = OrderedDict(), OrderedDict()
    module._metadata = OrderedDict(copy.deepcopy(params.state_dict_metadata))  # as nn.Module.state_dict
    if stage == 3:  # every parameter is partitioned away: module holds empty tensors
        for name, _, _ in params.named:
            module[name] = storages.ref(("empty",), 0, (0,))
        for name, shape in params.frozen:
            numel = int(np.prod(shape))
            frozen_refs[name] = storages.ref(("partition",), 4 * numel, (numel,))
    else:  # module weights are views of the padded flat group (stage_1_and_2.py bit16_groups_flat)
        group_key = {}
        for g, group in enumerate(layout.groups):
            group_key[g] = storages.ref(("module_group", g), 4 * group.flat_numel).storage_key
        place = {pid: (g, off) for g, group in enumerate(layout.groups)
                 for pid, off in zip(group.flat_order, group.flat_offsets)}
        for name, shape, trainable in params.named:
            if trainable:
                g, offset = place[trainable_id[name]]
                module[name] = storages.ref(None, 4 * layout.groups[g].flat_numel, shape, offset, key=group_key[g])
            else:  # engine.py _get_zero_frozen_param_attributes saves a copy: a storage of its own
                for table in (module, frozen_refs):
                    table[name] = storages.ref(("frozen_full", frozen_id[name]), 4 * int(np.prod(shape)), shape)
    model = {"module": module, "buffer_names": [], "optimizer": None, "param_shapes": [],
             "frozen_param_shapes": OrderedDict((n, torch.Size(s)) for n, s in params.frozen),
             "shared_params": {}, "frozen_param_fragments": frozen_refs, "lr_scheduler": None,
             "data_sampler": None, "random_ltd": None, "skipped_steps": 0, "global_steps": 1,
             "global_samples": cfg.micro_batch * ranks, "dp_world_size": ranks, "mp_world_size": 1,
             "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1},
             "ds_config": config, "ds_version": ds_version, **CLIENT_STATE}
    return optim, model


class RankFiller:
    """Writes the values of one target rank's storages (known state, zero padding) at their offsets."""

    def __init__(self, spec, params: ModelParams, storages: Storages, seed: int):
        self.spec, self.params, self.storages, self.seed = spec, params, storages, seed
        self.layout = spec.layout(spec.dp_world_size)
        pieces = self.layout.pieces
        self.pieces = pieces
        self.lengths = pieces.length
        order = np.lexsort((pieces.start, pieces.buffer, pieces.rank))
        keys = pieces.rank[order] * (1 << 32) + pieces.buffer[order]
        self._order, self._keys = order, keys
        from reshard.layouts.zero import logical_bases
        self.bases = logical_bases([p.numel for p in spec.params])
        self.bytes_written = 0

    def _pieces_of(self, rank: int, buffer: int) -> np.ndarray:
        key = rank * (1 << 32) + buffer
        lo, hi = np.searchsorted(self._keys, key, "left"), np.searchsorted(self._keys, key, "right")
        return self._order[lo:hi]

    def _write(self, fd: int, offset: int, stream: str, param: int, start: int, count: int) -> None:
        from reshard.files.byte_io import pwrite_exact
        for first in range(0, count, CHUNK):
            n = min(CHUNK, count - first)
            data = known_values(self.seed, stream, param, start + first, n)
            pwrite_exact(fd, memoryview(data).cast("B"), offset + 4 * first)
            self.bytes_written += 4 * n

    def fill(self, fd: int, role, offset: int, rank: int) -> None:
        if isinstance(role, tuple):  # a NewTensor slot
            kind, buffer, stream = role
            if kind == "frozen":
                name, shape = self.params.frozen[buffer]
                numel = int(np.prod(shape))
                chunk = -(-numel // self.spec.dp_world_size)
                lo, hi = min(rank * chunk, numel), min((rank + 1) * chunk, numel)
                self._write(fd, offset, "frozen", buffer, lo, hi - lo)
                return
            for i in self._pieces_of(rank, buffer):
                start = int(self.pieces.start[i])
                pid = int(np.searchsorted(self.bases, start, "right") - 1)
                self._write(fd, offset + 4 * int(self.pieces.offset[i]), stream, pid, start - int(self.bases[pid]),
                            int(self.lengths[i]))
            return
        what = self.storages.meaning[role]
        if what[0] == "step":
            os.pwrite(fd, np.float32(1.0).tobytes(), offset)
        elif what[0] == "frozen_full":
            name, shape = self.params.frozen[what[1]]
            self._write(fd, offset, "frozen", what[1], 0, int(np.prod(shape)))
        elif what[0] == "module_group":
            group = self.layout.groups[what[1]]
            for pid, flat in zip(group.flat_order, group.flat_offsets):
                self._write(fd, offset + 4 * flat, "fp32", pid, 0, self.spec.params[pid].numel)
        else:
            raise AssertionError(f"no values for storage {what}")


def _keep_tail_padding_storage(osd: dict, roles: dict, meta) -> None:
    """ZeRO-1/2 save each fp32 partition as a view without its tail padding
    (stage_1_and_2.py `_get_groups_without_padding`: `group[:len(group) - padding]`), so
    torch.save writes the whole padded storage. reshard's own writer saves the lean tensor
    alone (same values, a storage 4 * padding bytes shorter); here the file is DeepSpeed's."""
    import torch
    groups = osd["single_partition_of_fp32_groups"]
    for g, lean in enumerate(groups):
        full = meta.buffer_numels[g]
        if full == lean.numel():
            continue
        role = roles.pop(lean.untyped_storage()._cdata)  # materialize keys roles by storage identity
        padded = torch.empty(full, dtype=lean.dtype, requires_grad=lean.requires_grad)
        groups[g] = padded[:lean.numel()]
        roles[groups[g].untyped_storage()._cdata] = role


def write_checkpoint(save_dir: str, cfg: ModelConfig, stage: int, ranks: int, seed: int = 0,
                     ranks_to_write=None, log=None) -> dict:
    """Write the checkpoint (all ranks, or `ranks_to_write`); returns what the truth needs (meta.json)."""
    from reshard.formats.deepspeed_files import deepspeed_classes as classes
    from reshard.formats.deepspeed_files.deepspeed_metadata import rank_metadata
    from reshard.formats.deepspeed_files.deepspeed_spec import SourceCheckpoint
    from reshard.formats.deepspeed_files.deepspeed_target import target_files
    from reshard.formats.torch_bytes.torch_archive import materialize, write_skeleton
    from reshard.formats.torch_bytes.torch_zip import seal_crcs
    from reshard.topology import Topology
    started = time.perf_counter()
    params = model_params(cfg)
    spec = checkpoint_spec(params, stage, ranks)
    storages = Storages()
    optim, model = source_templates(cfg, params, spec, storages)
    source = SourceCheckpoint(save_dir=save_dir, tag=TAG, spec=spec, optim_template=optim, model_template=model)
    filler = RankFiller(spec, params, storages, seed)
    layout = filler.layout
    tag_dir = os.path.join(save_dir, TAG)
    os.makedirs(tag_dir, exist_ok=True)
    topology = Topology(dp=ranks)
    names = []
    for rank in (range(ranks) if ranks_to_write is None else ranks_to_write):
        for file in target_files(source, topology, rank):
            path = os.path.join(tag_dir, file.name)
            obj, roles = materialize(file.tree)
            if spec.stage != 3 and "optimizer_state_dict" in obj:
                _keep_tail_padding_storage(obj["optimizer_state_dict"], roles, rank_metadata(spec, layout, rank))
            offsets = write_skeleton(path, obj, roles, classes, classes.safe_globals())
            del obj
            fd = os.open(path, os.O_RDWR)
            try:
                for role, offset in offsets.items():
                    filler.fill(fd, role, offset, rank)
                seal_crcs(path, fd)  # real CRC-32s, as DeepSpeed's torch.save writes them
            finally:
                os.close(fd)
            names.append(file.name)
        if log and (rank + 1) % max(1, ranks // 8) == 0:
            log(f"  rank {rank + 1}/{ranks} written ({filler.bytes_written / 1e9:.2f} GB of values)")
    with open(os.path.join(save_dir, "latest"), "w") as fd:
        fd.write(TAG)  # engine.py _save_checkpoint: the tag, no newline
    scripts = os.path.join(importlib.util.find_spec("deepspeed").submodule_search_locations[0], "utils")
    for script in ("zero_to_fp32.py", "zero_to_torch.py"):  # engine.py _copy_recovery_script
        shutil.copyfile(os.path.join(scripts, script), os.path.join(save_dir, script))
        os.chmod(os.path.join(save_dir, script), 0o744)
    meta = {"save_dir": save_dir, "tag": TAG, "stage": stage, "ranks": ranks, "seed": seed,
            "config": dataclasses.asdict(cfg), "params": sum(int(np.prod(s)) for _, s, _ in params.named),
            "files": len(names), "bytes": sum(os.path.getsize(os.path.join(tag_dir, n)) for n in names),
            "value_bytes_written": filler.bytes_written, "write_seconds": time.perf_counter() - started,
            "source": "bench/synthetic_checkpoint.py (not trained: known seeded state)"}
    return meta


def expected_fp32_state(cfg: ModelConfig, seed: int, stage: int) -> dict:
    """What DeepSpeed's zero_to_fp32 must return for such a checkpoint: masters and frozen weights."""
    params = model_params(cfg)
    expected = {name: known_tensor(seed, "fp32", i, shape) for i, (name, shape) in enumerate(params.trainable)}
    for j, (name, shape) in enumerate(params.frozen):
        expected[name] = known_tensor(seed, "frozen", j, shape)
    return expected


def check_with_zero_to_fp32(save_dir: str, cfg: ModelConfig, seed: int, stage: int) -> list[str]:
    """DeepSpeed's own deepspeed/utils/zero_to_fp32.py consolidation against the known state."""
    import contextlib
    import io

    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        got = get_fp32_state_dict_from_zero_checkpoint(save_dir)
    expected = expected_fp32_state(cfg, seed, stage)
    problems = [f"missing {n}" for n in expected if n not in got] + [f"extra {n}" for n in got if n not in expected]
    for name, want in expected.items():
        if name in got and not (got[name].shape == want.shape and got[name].dtype == want.dtype
                                and bool((got[name] == want).all())):
            problems.append(f"{name}: differs from the known state")
    return problems


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("save_dir")
    parser.add_argument("--stage", type=int, choices=(2, 3), default=2)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--model", default="tiny", choices=list(MODELS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--check", action="store_true", help="only run zero_to_fp32 on SAVE_DIR against the truth")
    args = parser.parse_args()
    cfg = MODELS[args.model]
    if args.check:
        problems = check_with_zero_to_fp32(args.save_dir, cfg, args.seed, args.stage)
        print(json.dumps({"zero_to_fp32_mismatches": problems}))
        sys.exit(1 if problems else 0)
    meta = write_checkpoint(args.save_dir, cfg, args.stage, args.ranks, args.seed,
                            log=lambda m: print(m, file=sys.stderr, flush=True))
    print(json.dumps(meta, indent=1))


if __name__ == "__main__":
    main()
