"""Differential fuzzing of reshard's torch-free reader against torch.load(weights_only=True).

    from reader_fuzz import base_files, Mutator, judge
    for base in base_files(tmp_dir):
        mutator = Mutator(base, seed=0)
        for i in range(100):
            mutant, kind = mutator.mutant(tmp_dir / f"m{i}.pt")
            verdict = judge(mutant)       # "refused", "torch", "agree"; AssertionError on a disagreement

Used by tests/test_reader_fuzz.py (a few hundred mutants) and bench/fuzz_reader.py (thousands).
Two readers are judged: the torch-free one (`judge`) and the memory-mapped torch load every whole-file
road uses (`judge_mapped`: torch_archive.load_checked against a plain, unmapped torch.load). Structure-
aware mutants (STRUCTURE_KINDS) rewrite data.pkl at the opcode level (pickletools): storage keys
swapped or aliased, storage dtypes and sizes, storage offsets, shapes and strides (stride 0,
overlapping), memo references pointed at other objects, dictionary keys repeated.
A mutant is a real torch.save file with one change: bytes of data.pkl flipped or its integers
or opcodes changed, fields of the central directory, end records or local headers edited,
records duplicated, reordered, dropped, compressed (deflate) or given other contents, the file
truncated or padded. For each, reshard.formats.torch_bytes.torch_pickle.read_portable must refuse
(CheckpointError), hand the file to torch (NeedsTorch), or return exactly what torch.load gives:
every tensor's dtype, shape, stride, storage offset, requires_grad, storage bytes and storage
sharing, and every scalar, string and container.
"""
from __future__ import annotations

import io
import os
import pickletools
import random
import struct
import warnings
import zipfile
from collections import OrderedDict
from enum import Enum
from pathlib import Path

from reshard.errors import CheckpointError
from reshard.formats.deepspeed_files import deepspeed_classes as classes
from reshard.formats.torch_bytes import torch_archive, torch_pickle
from reshard.formats.torch_bytes.torch_archive import TensorRef
from reshard.formats.torch_bytes.torch_classes import NeedsTorch, TorchGlobal, TorchSize

SAFE = classes.safe_globals()
GLOBALS = torch_pickle.globals_by_name(SAFE)


def base_files(directory: Path) -> list[Path]:
    """Real torch.save files of the kinds DeepSpeed writes, and a few it does not."""
    import torch

    directory.mkdir(parents=True, exist_ok=True)
    base = torch.arange(24, dtype=torch.float32)
    state = OrderedDict(w=torch.ones(2, 3, dtype=torch.bfloat16), b=torch.full((3,), 2.5, dtype=torch.float16))
    state._metadata = {"": {"version": 1}}
    scaler = classes.DynamicLossScaler()
    scaler.__dict__.update(cur_scale=65536.0, dtype=torch.float16, cur_iter=3)
    mixed = {
        "base": base, "slice": base[2:8], "strided": base.view(4, 6)[:, 1:3], "again": [base, base],
        "scalar": torch.tensor(3.5, dtype=torch.float64), "empty": torch.empty(0, 3),
        "int64": torch.arange(5), "bool": torch.tensor([True, False]), "int8": torch.arange(-3, 3, dtype=torch.int8),
        "uint8": torch.arange(7, dtype=torch.uint8), "int16": torch.arange(4, dtype=torch.int16),
        "int32": torch.arange(3, dtype=torch.int32), "complex": torch.ones(2, dtype=torch.complex64),
        "nested": [1, 2.5, -0.0, float("nan"), "x", "", None, True, (1, "s", b"\x00\xff"), {"k": [base, state], 3: ()}],
        "state_dict": state, "shape": torch.Size([4, 6]), "dtype": torch.bfloat16,
        "loss_scaler": scaler, "zero_stage": classes.ZeroStageEnum(2),
        "fragments": OrderedDict(a=classes.fragment_address(numel=3, start=4)),
        "parameter": torch.nn.Parameter(torch.ones(3)), "leaf": torch.ones(2, requires_grad=True),
        "big": 1 << 40, "negative": -7, "text": "ünïcode",
    }
    optim_like = {"optimizer_state_dict": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(40),
                                                         "exp_avg_sq": torch.rand(40)}},
                                           "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": [0]}]},
                  "fp32_flat_groups": [torch.randn(40)], "partition_count": [2], "zero_stage": 2,
                  "ds_version": "0.19.8"}
    model_like = OrderedDict((f"layer{i}.weight", torch.randn(3, 4)) for i in range(4))
    files = []
    for name, obj, module in [("mixed.pt", mixed, classes), ("optim_like.pt", optim_like, None),
                              ("model_like.pt", {"module": model_like, "global_steps": 3}, None),
                              *pipeline_like_files()]:
        path = directory / name
        torch.save(obj, path, **({"pickle_module": module} if module else {}))
        files.append(path)
    return files


def pipeline_like_files() -> list[tuple[str, object, object]]:
    """(name, tree, pickle module) of the other file kinds the whole-file roads read, as DeepSpeed 0.19.8
    lays them out (reshard.formats.deepspeed_files.deepspeed_pipeline, deepspeed_schema): a pipeline layer file (a
    module's state_dict), a stage model-states file (no module, param_shapes), a ZeRO-1 stage
    optimizer file (fp32 partition, moments, fragment addresses, the loss scaler), a model-axis layer
    file, and a native MoE expert file. Real ones are fuzzed by test_reader_fuzz's e2e tests."""
    import torch

    layer = OrderedDict([("weight", torch.randn(5, 7)), ("bias", torch.randn(5)), ("scale", torch.ones(5))])
    layer._metadata = OrderedDict([("", {"version": 1})])
    shapes = [OrderedDict([("1.weight", torch.Size([5, 7])), ("1.bias", torch.Size([5]))])]
    stage = {"module": None, "buffer_names": ["1.scale"], "optimizer": None, "param_shapes": shapes,
             "frozen_param_shapes": None, "shared_params": {}, "frozen_param_fragments": None,
             "lr_scheduler": {}, "global_steps": 3, "global_samples": 24, "skipped_steps": 0,
             "dp_world_size": 2, "mp_world_size": 2,
             "checkpoint_parallel_dimensions": {"pp_degree": 2, "tp_degree": 1},
             "ds_config": {"train_batch_size": 8, "zero_optimization": {"stage": 1}}, "ds_version": "0.19.8"}
    scaler = classes.LossScaler()
    scaler.__dict__.update(cur_scale=1.0, cur_iter=3, dynamic=False)
    fp32 = torch.randn(20)
    optimizer = {"optimizer_state_dict": {
        "loss_scaler": scaler, "dynamic_loss_scale": False, "overflow": False, "clip_grad": 1.0,
        "base_optimizer_state": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(20),
                                               "exp_avg_sq": torch.rand(20)}},
                                 "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8,
                                                   "weight_decay": 0.0, "amsgrad": False, "params": [0]}]},
        "single_partition_of_fp32_groups": [fp32[:20]], "zero_stage": classes.ZeroStageEnum(1),
        "group_paddings": [0], "param_alignment_paddings": [[0, 0]], "partition_count": [2],
        "ds_version": "0.19.8",
        "param_slice_mappings": [OrderedDict([("1.weight", classes.fragment_address(numel=20, start=0))])]},
        "ds_config": {"train_batch_size": 8}, "ds_version": "0.19.8"}
    axis = OrderedDict([("weight", torch.randn(3, 7)), ("bias", torch.randn(3))])
    axis._metadata = OrderedDict([("", {"version": 1})])
    experts = OrderedDict((f"layer.moe.experts.deepspeed_experts.{e}.{name}", torch.randn(*shape, dtype=torch.bfloat16))
                          for e in (0,) for name, shape in (("w1.weight", (6, 4)), ("w2.weight", (4, 6))))
    return [("layer_01-model_states.pt", layer, None), ("mp_rank_01_model_states.pt", stage, classes),
            ("zero_pp_rank_1_mp_rank_01_optim_states.pt", optimizer, classes),
            ("layer_01-model_01-model_states.pt", axis, None),
            ("layer_0_expert_3_mp_rank_00_model_states.pt", experts, None)]


# -- reading both ways into one comparable form --------------------------------------------------

def _describe(value, tensor, seen_storages: dict) -> object:
    """A comparable form of a tree; `tensor(leaf)` describes a tensor or returns None."""
    import torch

    found = tensor(value, seen_storages)
    if found is not None:
        return found
    if isinstance(value, (torch.Size, TorchSize)):
        return ("Size", tuple(value))
    if isinstance(value, torch.dtype):
        return ("global", str(value))
    if isinstance(value, TorchGlobal):
        return ("global", value.name)
    if isinstance(value, type):
        return ("global", f"{value.__module__}.{value.__qualname__}")
    if isinstance(value, Enum):
        return (type(value).__name__, value.value)
    if isinstance(value, float):
        return ("float", struct.pack(">d", value))
    if isinstance(value, dict):
        extra = getattr(value, "__dict__", None)
        return (type(value).__name__, [(_describe(k, tensor, seen_storages), _describe(v, tensor, seen_storages))
                                       for k, v in value.items()],
                _describe(extra, tensor, seen_storages) if extra else None)
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, [_describe(v, tensor, seen_storages) for v in value])
    if isinstance(value, (set, frozenset)):
        return (type(value).__name__, sorted(repr(_describe(v, tensor, seen_storages)) for v in value))
    if isinstance(value, (str, bytes, int, bool, type(None), complex)):
        return (type(value).__name__, value)
    if hasattr(value, "__dict__"):
        return (type(value).__name__, _describe(vars(value), tensor, seen_storages))
    return ("other", type(value).__name__, repr(value)[:100])


def describe_torch(obj) -> object:
    import torch

    def tensor(value, seen):
        if not isinstance(value, torch.Tensor):
            return None
        storage = value.untyped_storage()
        nbytes = storage.nbytes()
        identity = seen.setdefault(storage.data_ptr(), len(seen)) if nbytes else None
        return ("tensor", str(value.dtype).removeprefix("torch."), tuple(value.shape), tuple(value.stride()),
                value.storage_offset(), value.requires_grad, bytes(storage) if nbytes else b"", identity)
    return _describe(obj, tensor, {})


def describe_ours(tree, path) -> object:
    fd = os.open(path, os.O_RDONLY)
    try:
        def tensor(value, seen):
            if not isinstance(value, TensorRef):
                return None
            identity = seen.setdefault(value.storage_key, len(seen)) if value.storage_nbytes else None
            data = os.pread(fd, value.storage_nbytes, value.storage_key) if value.storage_nbytes else b""
            return ("tensor", value.dtype, value.shape, value.stride, value.storage_offset, value.requires_grad,
                    data, identity)
        return _describe(tree, tensor, {})
    finally:
        os.close(fd)


def torch_load(path) -> object:
    """torch.load(weights_only=True) with the DeepSpeed stand-ins allowed, described; the location
    of each storage is ignored as reshard's reader ignores it (map_location="cpu")."""
    import torch

    with torch.serialization.safe_globals(SAFE), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return describe_torch(torch.load(path, map_location="cpu", weights_only=True))


def read_ours(path) -> tuple[str, object]:
    """("tree", description) | ("refused", message) | ("torch", why) from reshard's reader."""
    try:
        tree = torch_pickle.read_portable(path, GLOBALS)
    except CheckpointError as error:
        assert str(error).startswith(str(path)), error  # the message names the file
        return "refused", error.problem
    except NeedsTorch as error:
        return "torch", str(error)
    return "tree", describe_ours(tree, path)


def judge(path, torch_reader=torch_load) -> tuple[str, str]:
    """(verdict, detail): "refused", "torch" (handed to torch) or "agree"; raises AssertionError
    when reshard's reader returns a tree that torch.load does not return exactly."""
    verdict, ours = read_ours(path)
    if verdict != "tree":
        return verdict, str(ours)
    try:
        theirs = torch_reader(path)
    except Exception as error:  # torch refuses what reshard read: a disagreement
        raise AssertionError(f"{path}: reshard read a tree, torch.load refused it: {type(error).__name__}: "
                             f"{str(error)[:300]}") from None
    if ours != theirs:
        raise AssertionError(f"{path}: reshard's tree differs from torch.load's\n ours:  {str(ours)[:600]}\n "
                             f"torch: {str(theirs)[:600]}")
    return "agree", ""


def read_mapped(path) -> tuple[str, object]:
    """("tree", description) | ("refused", message) from the memory-mapped torch load every
    whole-file road uses (torch_archive.load_checked)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tree = torch_archive.load_checked(path, SAFE)
    except CheckpointError as error:
        assert str(error).startswith(str(path)), error  # the message names the file
        return "refused", error.problem
    return "tree", describe_torch(tree)


def judge_mapped(path, torch_reader=torch_load) -> tuple[str, str]:
    """(verdict, detail) of the mapped load: "refused" or "agree" with a plain (unmapped)
    torch.load(weights_only=True); AssertionError on a disagreement."""
    verdict, ours = read_mapped(path)
    if verdict != "tree":
        return verdict, str(ours)
    try:
        theirs = torch_reader(path)
    except Exception as error:
        raise AssertionError(f"{path}: the mapped load read a tree, a plain torch.load refused it: "
                             f"{type(error).__name__}: {str(error)[:300]}") from None
    if ours != theirs:
        raise AssertionError(f"{path}: the mapped load differs from a plain torch.load\n ours:  {str(ours)[:600]}\n "
                             f"torch: {str(theirs)[:600]}")
    return "agree", ""


# -- archives written by hand ------------------------------------------------------------------

def zip_bytes(entries: list[tuple[str, bytes]], compressed=frozenset()) -> bytes:
    """A zip archive of `entries` (full names) as Python's zipfile writes one (no alignment, no
    zip64 end record unless needed), duplicates included; the entries at the indices in
    `compressed` deflated."""
    buffer = io.BytesIO()
    with warnings.catch_warnings(), zipfile.ZipFile(buffer, "w") as archive:
        warnings.simplefilter("ignore")  # "Duplicate name"
        for i, (name, content) in enumerate(entries):
            info = zipfile.ZipInfo(name)
            info.compress_type = zipfile.ZIP_DEFLATED if i in compressed else zipfile.ZIP_STORED
            archive.writestr(info, content)
    return buffer.getvalue()


def raw_zip(entries: list[tuple]) -> bytes:
    """A zip archive that may lie: entries (full name, bytes as stored, method, declared size,
    crc), the declared size given as both sizes (with zip64 extras and end records when it or an
    offset needs them), whatever the stored bytes are."""
    out, central = bytearray(), bytearray()
    for name, stored, method, declared, crc in entries:
        name = name.encode()
        wide = declared >= 0xFFFFFFFF
        local_extra = struct.pack("<HHQQ", 1, 16, declared, declared) if wide else b""
        at = len(out)
        out += struct.pack("<IHHHHHIIIHH", 0x04034B50, 45, 0, method, 0, 0, crc,
                           0xFFFFFFFF if wide else declared, 0xFFFFFFFF if wide else declared, len(name),
                           len(local_extra)) + name + local_extra + stored
        central += struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 45, 45, 0, method, 0, 0, crc,
                               0xFFFFFFFF if wide else declared, 0xFFFFFFFF if wide else declared, len(name),
                               len(local_extra), 0, 0, 0, 0, at) + name + local_extra
    cd_at = len(out)
    out += central
    end64_at = len(out)
    out += struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 45, 45, 0, 0, len(entries), len(entries), len(central), cd_at)
    out += struct.pack("<IIQI", 0x07064B50, 0, end64_at, 1)
    out += struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, len(entries), len(entries), len(central), cd_at, 0)
    return bytes(out)


class _Record:
    def __init__(self, name, header_offset, data_offset, file_size):
        self.name, self.header_offset, self.data_offset, self.file_size = name, header_offset, data_offset, file_size
        self.data_end = data_offset + file_size


def layout_of(path) -> tuple[str, list[_Record]]:
    """(prefix, records in file order) of a well-formed torch.save file, read with Python's
    zipfile (not with the reader under test)."""
    data = Path(path).read_bytes()
    with zipfile.ZipFile(path) as archive:
        infos = sorted(archive.infolist(), key=lambda info: info.header_offset)
    prefix = infos[0].filename.split("/", 1)[0] + "/"
    records = []
    for info in infos:
        name_len, extra_len = struct.unpack_from("<HH", data, info.header_offset + 26)
        records.append(_Record(info.filename[len(prefix):], info.header_offset,
                               info.header_offset + 30 + name_len + extra_len, info.file_size))
    return prefix, records


def records_of(path) -> tuple[str, list[tuple[str, bytes]]]:
    """(prefix, [(name without prefix, content)]) of a well-formed torch.save file, in file order."""
    data = Path(path).read_bytes()
    prefix, records = layout_of(path)
    return prefix, [(r.name, data[r.data_offset:r.data_end]) for r in records]


# -- mutants ----------------------------------------------------------------------------------------

KINDS = ["pickle_byte", "pickle_int", "pickle_opcode", "directory_byte", "directory_field", "local_header",
         "duplicate", "reorder", "compress", "drop", "content", "truncate", "pad"]
_INTERESTING = [0, 1, 2, 3, 7, 8, 63, 64, 127, 128, 255, 256, 0x7FFF, 0xFFFF, 0x7FFFFFFF, 0xFFFFFFFF,
                1 << 32, (1 << 63) - 1, 1 << 63, (1 << 64) - 1]


class Mutator:
    """Mutants of one well-formed torch.save file, from a seeded generator."""

    def __init__(self, path: Path, seed: int):
        self.path, self.random = Path(path), random.Random(seed)
        self.data = self.path.read_bytes()
        self.prefix, self.records = layout_of(path)
        self.contents = {r.name: self.data[r.data_offset:r.data_end] for r in self.records}
        pickled = self.records[0]
        assert pickled.name == "data.pkl"
        self.pickle_at, self.pickle_size = pickled.data_offset, pickled.file_size
        self.ops = list(pickletools.genops(self.contents["data.pkl"]))
        self.directory_at = self.data.find(b"PK\x01\x02", self.records[-1].data_end)

    def mutant(self, out: Path, kind: str | None = None) -> tuple[Path, str]:
        kind = kind or self.random.choice(KINDS)
        data = getattr(self, "_" + kind)()
        out.write_bytes(data)
        return out, kind

    def _int(self, width: int) -> int:
        value = self.random.choice(_INTERESTING + [self.random.getrandbits(width * 8)])
        return value % (1 << (width * 8))

    def _pickle_byte(self) -> bytes:
        data = bytearray(self.data)
        for _ in range(self.random.choice([1, 1, 2, 3])):
            data[self.pickle_at + self.random.randrange(self.pickle_size)] = self.random.randrange(256)
        return bytes(data)

    def _pickle_int(self) -> bytes:
        """An integer argument of data.pkl (a size, stride, storage offset, numel, memo index) changed in place."""
        choices = [(op, pos) for op, arg, pos in self.ops
                   if op.name in ("BININT1", "BININT2", "BININT", "BINGET", "BINPUT", "LONG_BINPUT", "LONG_BINGET")]
        op, pos = self.random.choice(choices)
        width = {"BININT1": 1, "BINGET": 1, "BINPUT": 1, "BININT2": 2}.get(op.name, 4)
        data = bytearray(self.data)
        at = self.pickle_at + pos + 1
        data[at:at + width] = self._int(width).to_bytes(width, "little")
        return bytes(data)

    def _pickle_opcode(self) -> bytes:
        known = b"\x80.c\x81Rbaesu(t\x85\x86\x87N\x89\x88)]}\x8fJKMGXUQhjqr\x8a"
        data = bytearray(self.data)
        _, _, pos = self.random.choice(self.ops)
        data[self.pickle_at + pos] = self.random.choice(list(known) + [self.random.randrange(256)])
        return bytes(data)

    def _directory_byte(self) -> bytes:
        data = bytearray(self.data)
        data[self.random.randrange(self.directory_at, len(data))] = self.random.randrange(256)
        return bytes(data)

    def _directory_field(self) -> bytes:
        """A size, offset, method, flag or count field of a central header or end record set to another value."""
        data = bytearray(self.data)
        starts = [i for i in range(self.directory_at, len(data) - 4) if data[i:i + 4] in
                  (b"PK\x01\x02", b"PK\x05\x06", b"PK\x06\x06", b"PK\x06\x07")]
        at = self.random.choice(starts)
        fields = {b"PK\x01\x02": [(8, 2), (10, 2), (16, 4), (20, 4), (24, 4), (28, 2), (30, 2), (42, 4)],
                  b"PK\x05\x06": [(8, 2), (10, 2), (12, 4), (16, 4), (20, 2)],
                  b"PK\x06\x06": [(4, 8), (24, 8), (32, 8), (40, 8), (48, 8)],
                  b"PK\x06\x07": [(8, 8), (16, 4)]}[bytes(data[at:at + 4])]
        offset, width = self.random.choice(fields)
        if self.random.random() < 0.5:  # another record's offset or size: plausible, so more telling
            record = self.random.choice(self.records)
            value = self.random.choice([record.header_offset, record.data_offset, record.file_size, len(data)])
            value += self.random.choice([0, 0, -1, 1, 64])
            value %= 1 << (8 * width)
        else:
            value = self._int(width)
        data[at + offset:at + offset + width] = value.to_bytes(width, "little")
        return bytes(data)

    def _local_header(self) -> bytes:
        data = bytearray(self.data)
        record = self.random.choice(self.records)
        offset, width = self.random.choice([(6, 2), (8, 2), (18, 4), (22, 4), (26, 2), (28, 2), (30, 1)])
        data[record.header_offset + offset:record.header_offset + offset + width] = \
            self._int(width).to_bytes(width, "little")
        return bytes(data)

    def _entries(self) -> list[tuple[str, bytes]]:
        return [(self.prefix + r.name, self.contents[r.name]) for r in self.records]

    def _zip(self, entries: list[tuple[str, bytes]], compressed=frozenset()) -> bytes:
        return zip_bytes(entries, compressed)

    def _duplicate(self) -> bytes:
        entries = self._entries()
        name, content = self.random.choice(entries)
        if self.random.random() < 0.5 and name.endswith("data.pkl"):
            content = self.contents["data.pkl"].replace(b"K\x03", b"K\x04", 1)
        entries.insert(self.random.randrange(len(entries) + 1), (name, content))
        return self._zip(entries)

    def _reorder(self) -> bytes:
        entries = self._entries()
        self.random.shuffle(entries)
        return self._zip(entries)

    def _compress(self) -> bytes:
        entries = self._entries()
        chosen = {i for i in range(len(entries)) if self.random.random() < 0.4} or {0}
        return self._zip(entries, chosen)

    def _drop(self) -> bytes:
        entries = self._entries()
        del entries[self.random.randrange(len(entries))]
        return self._zip(entries)

    def _content(self) -> bytes:
        entries = self._entries()
        choices = {"byteorder": [b"big", b"little ", b"", b"LITTLE"], "version": [b"9\n", b"11\n", b"x\n", b"0\n", b"3"],
                   ".storage_alignment": [b"x", b"128", b""], ".format_version": [b"0", b"2", b"zz"]}
        i = self.random.choice([i for i, (name, _) in enumerate(entries) if name[len(self.prefix):] in choices])
        name = entries[i][0]
        entries[i] = (name, self.random.choice(choices[name[len(self.prefix):]]))
        return self._zip(entries)

    def _truncate(self) -> bytes:
        return self.data[:self.random.randrange(1, len(self.data))]

    def _pad(self) -> bytes:
        extra = bytes(self.random.randrange(256) for _ in range(self.random.choice([1, 22, 64])))
        return self.data + extra if self.random.random() < 0.5 else self.data[:4] + extra + self.data[4:]


# -- structure-aware mutants: data.pkl rewritten op by op ------------------------------------------

STRUCTURE_KINDS = ["op_key", "op_dtype", "op_numel", "op_offset", "op_shape", "op_stride", "op_memo", "op_dict_key"]
_CODES = {op.name: op.code.encode("latin-1") for op in pickletools.opcodes}
_STORAGES = ["FloatStorage", "DoubleStorage", "HalfStorage", "BFloat16Storage", "LongStorage", "IntStorage",
             "ShortStorage", "CharStorage", "ByteStorage", "BoolStorage", "ComplexFloatStorage"]


def encode_ops(ops: list[list]) -> bytes:
    """data.pkl from (opcode name, argument) pairs, as pickle writes each (an integer in the
    narrowest of BININT1, BININT2, BININT, LONG1; a memo index in 1 or 4 bytes as it needs)."""
    out = bytearray()
    for name, arg in ops:
        if name in ("BININT1", "BININT2", "BININT", "LONG1"):
            if 0 <= arg < 1 << 8:
                out += _CODES["BININT1"] + bytes([arg])
            elif 0 <= arg < 1 << 16:
                out += _CODES["BININT2"] + arg.to_bytes(2, "little")
            elif -(1 << 31) <= arg < 1 << 31:
                out += _CODES["BININT"] + arg.to_bytes(4, "little", signed=True)
            else:
                body = pickle_encode_long(arg)
                out += _CODES["LONG1"] + bytes([len(body)]) + body
        elif name in ("BINPUT", "BINGET", "LONG_BINPUT", "LONG_BINGET"):
            short = arg < 256
            out += _CODES[("" if short else "LONG_") + name.removeprefix("LONG_")]
            out += bytes([arg]) if short else arg.to_bytes(4, "little")
        elif name in ("BINUNICODE", "SHORT_BINUNICODE"):
            body = arg.encode("utf-8", "surrogatepass")
            out += _CODES["BINUNICODE"] + len(body).to_bytes(4, "little") + body
        elif name in ("BINBYTES", "SHORT_BINBYTES"):
            out += _CODES["BINBYTES"] + len(arg).to_bytes(4, "little") + arg
        elif name == "GLOBAL":
            module, _, qualname = arg.partition(" ")
            out += _CODES["GLOBAL"] + f"{module}\n{qualname}\n".encode()
        elif name == "PROTO":
            out += _CODES["PROTO"] + bytes([arg])
        elif name == "BINFLOAT":
            out += _CODES["BINFLOAT"] + struct.pack(">d", arg)
        elif arg is None:
            out += _CODES[name]
        else:
            raise ValueError(f"no encoding for {name} {arg!r}")
    return bytes(out)


def pickle_encode_long(value: int) -> bytes:
    import pickle
    return pickle.encode_long(value)


class _StorageRef:
    """Where one persistent-id tuple ('storage', type, key, location, numel) and the rebuild
    arguments after it (offset, shape, stride) sit in an op list."""

    def __init__(self, type_at, key_at, numel_at, offset_at, shape_ats, stride_ats):
        self.type_at, self.key_at, self.numel_at = type_at, key_at, numel_at
        self.offset_at, self.shape_ats, self.stride_ats = offset_at, shape_ats, stride_ats


def _value_ops(ops, start, end) -> list[int]:
    """The indices of the value-producing ops in ops[start:end] (a memo PUT belongs to the value before)."""
    return [i for i in range(start, end) if ops[i][0] not in ("BINPUT", "LONG_BINPUT", "MEMOIZE", "MARK")]


def _tuple_after(ops, at) -> tuple[list[int], int]:
    """(indices of the integer ops of the tuple starting at `at`, the index after it and its PUT)."""
    ints = []
    i = at
    if ops[i][0] == "EMPTY_TUPLE":
        i += 1
    elif ops[i][0] == "MARK":
        i += 1
        while ops[i][0] != "TUPLE":
            ints.append(i)
            i += 1
        i += 1
    else:
        while ops[i][0] not in ("TUPLE1", "TUPLE2", "TUPLE3"):
            ints.append(i)
            i += 1
        i += 1
    while i < len(ops) and ops[i][0] in ("BINPUT", "LONG_BINPUT", "MEMOIZE"):
        i += 1
    return ints, i


def storage_refs(ops) -> list[_StorageRef]:
    """Every tensor's storage reference in the op list whose rebuild arguments follow the pattern
    torch.save writes (_rebuild_tensor_v2: storage, offset, shape tuple, stride tuple)."""
    found = []
    for end, (name, _) in enumerate(ops):
        if name != "BINPERSID":
            continue
        close = end - 1
        while ops[close][0] in ("BINPUT", "LONG_BINPUT", "MEMOIZE"):
            close -= 1
        mark = close
        while ops[mark][0] != "MARK":
            mark -= 1
        values = _value_ops(ops, mark + 1, close)
        if len(values) != 5:
            continue
        try:
            offset_at = end + 1
            shape_ats, after = _tuple_after(ops, offset_at + 1)
            stride_ats, _ = _tuple_after(ops, after)
        except IndexError:
            continue
        if not all(ops[i][0].startswith(("BININT", "LONG")) for i in [offset_at, *shape_ats, *stride_ats]):
            continue
        found.append(_StorageRef(values[1], values[2], values[4], offset_at, shape_ats, stride_ats))
    return found


class StructureMutator:
    """Structure-aware mutants of one torch.save file: its data.pkl decoded with pickletools, one
    thing a crafted file could say otherwise changed, re-encoded, and the archive laid out as
    torch.save lays one out (reshard.formats.torch_bytes.torch_zip.ArchiveWriter, every other record as it was)."""

    def __init__(self, path: Path, seed: int):
        self.path, self.random = Path(path), random.Random(seed)
        self.prefix, self.records = records_of(path)
        pickled = dict(self.records)["data.pkl"]
        self.ops = [[op.name, arg] for op, arg, _ in pickletools.genops(pickled)]
        self.refs = storage_refs(self.ops)
        self.keys = sorted({self.string_at(r.key_at) for r in self.refs} - {None})
        self.memo = [arg for name, arg in self.ops if name in ("BINPUT", "LONG_BINPUT")]

    def string_at(self, i):
        """The string the op at `i` pushes (its own, or the memoised one a BINGET fetches), or None."""
        name, arg = self.ops[i]
        if name in ("BINUNICODE", "SHORT_BINUNICODE"):
            return arg
        if name in ("BINGET", "LONG_BINGET"):  # a repeated key: the string it was memoised from
            for j, (other, value) in enumerate(self.ops):
                if other in ("BINPUT", "LONG_BINPUT") and value == arg:
                    return self.ops[j - 1][1] if self.ops[j - 1][0].endswith("UNICODE") else None
        return None

    def mutant(self, out: Path, kind: str | None = None) -> tuple[Path, str]:
        kind = kind or self.random.choice(STRUCTURE_KINDS)
        ops = [list(op) for op in self.ops]
        if self.refs or kind in ("op_memo", "op_dict_key"):
            getattr(self, "_" + kind)(ops)
        self.write(out, ops)
        return out, kind

    def write(self, out: Path, ops: list[list]) -> Path:
        """The file with data.pkl re-encoded from `ops`, every other record as it was."""
        from reshard.formats.torch_bytes.torch_zip import ArchiveWriter
        writer = ArchiveWriter(str(out), prefix=self.prefix.rstrip("/"))
        for name, content in self.records:
            if name == "data.pkl":
                writer.add(name, encode_ops(ops))
            elif name not in ("version", ".data/serialization_id"):
                writer.add(name, content)
        writer.finish()
        return out

    def _number(self, near: int) -> int:
        return self.random.choice([0, 1, 2, near - 1, near + 1, near * 2, 1 << 31, 1 << 40, (1 << 63) - 1])

    def _ref(self):
        return self.random.choice(self.refs)

    def _op_key(self, ops) -> None:
        """A storage key swapped with another's, pointed at another storage (two tensors, maybe two
        dtypes, on one record) or at no record."""
        ref = self._ref()
        choice = self.random.random()
        if choice < 0.4 and len(self.refs) > 1:
            other = self._ref()
            ops[ref.key_at], ops[other.key_at] = list(self.ops[other.key_at]), list(self.ops[ref.key_at])
        else:
            key = self.random.choice(self.keys) if choice < 0.8 and self.keys else str(self.random.choice([99, -1, 10**6]))
            ops[ref.key_at] = ["BINUNICODE", key]

    def _op_dtype(self, ops) -> None:
        ops[self._ref().type_at] = ["GLOBAL", f"torch {self.random.choice(_STORAGES)}"]

    def _op_numel(self, ops) -> None:
        ref = self._ref()
        ops[ref.numel_at] = ["BININT", self._number(ops[ref.numel_at][1])]

    def _op_offset(self, ops) -> None:
        ref = self._ref()
        ops[ref.offset_at] = ["BININT", self._number(ops[ref.numel_at][1])]

    def _op_shape(self, ops) -> None:
        ref = self._ref()
        if ref.shape_ats:
            at = self.random.choice(ref.shape_ats)
            ops[at] = ["BININT", self._number(ops[at][1])]

    def _op_stride(self, ops) -> None:
        """A stride set to 0 (expand), to another dimension's (overlap), or to something else."""
        ref = self._ref()
        if ref.stride_ats:
            at = self.random.choice(ref.stride_ats)
            others = [ops[i][1] for i in ref.stride_ats]
            ops[at] = ["BININT", self.random.choice([0, 0, self.random.choice(others), self._number(ops[at][1])])]

    def _op_memo(self, ops) -> None:
        """A memo reference pointed at another memoised object (a storage tuple, a container, a
        string, a class reused where another belongs)."""
        gets = [i for i, (name, _) in enumerate(ops) if name in ("BINGET", "LONG_BINGET")]
        if gets and self.memo:
            ops[self.random.choice(gets)][1] = self.random.choice(self.memo)

    def _op_dict_key(self, ops) -> None:
        """A string (a dictionary key, mostly) set to another string of the pickle: repeated keys."""
        strings = [i for i, (name, _) in enumerate(ops) if name in ("BINUNICODE", "SHORT_BINUNICODE")]
        if len(strings) > 1:
            ops[self.random.choice(strings)][1] = ops[self.random.choice(strings)][1]
