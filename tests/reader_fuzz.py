"""Differential fuzzing of reshard's torch-free reader against torch.load(weights_only=True).

    from reader_fuzz import base_files, Mutator, judge
    for base in base_files(tmp_dir):
        mutator = Mutator(base, seed=0)
        for i in range(100):
            mutant, kind = mutator.mutant(tmp_dir / f"m{i}.pt")
            verdict = judge(mutant)       # "refused", "torch", "agree"; AssertionError on a disagreement

Used by tests/test_reader_fuzz.py (a few hundred mutants) and bench/fuzz_reader.py (thousands).
A mutant is a real torch.save file with one change: bytes of data.pkl flipped or its integers
or opcodes changed, fields of the central directory, end records or local headers edited,
records duplicated, reordered, dropped, compressed (deflate) or given other contents, the file
truncated or padded. For each, reshard.formats.torch_pickle.read_portable must refuse
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
from reshard.formats import deepspeed_classes as classes
from reshard.formats import torch_pickle
from reshard.formats.torch_archive import TensorRef
from reshard.formats.torch_classes import NeedsTorch, TorchGlobal, TorchSize

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
                              ("model_like.pt", {"module": model_like, "global_steps": 3}, None)]:
        path = directory / name
        torch.save(obj, path, **({"pickle_module": module} if module else {}))
        files.append(path)
    return files


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
