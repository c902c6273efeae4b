"""PyTorch Distributed Checkpoint (DCP) files, as torch's FileSystemWriter writes them, from torch's own classes.

    from reshard.export.dcp_format import blob_template, place_blobs, build_metadata, write_metadata
    template = blob_template((6, 7), "float32")   # a torch.save blob of that tensor, data not yet written
    template.data_offset, len(template.data)      # where the tensor's bytes go inside the blob

Format (torch 2.13, torch/distributed/checkpoint/filesystem.py and metadata.py; read by `dcp.load`):

    OUT/.metadata          pickle of `metadata.Metadata`: `state_dict_metadata` (key ->
                           `TensorStorageMetadata(properties, size, chunks=[ChunkStorageMetadata(
                           offsets, sizes)])` or `BytesStorageMetadata()`), `storage_data`
                           (`MetadataIndex(key, chunk offsets, chunk index)` ->
                           `filesystem._StorageInfo(relative_path, offset, length)`), `planner_data`
                           (key -> its path in the nested state dict), `storage_meta`, `version`
    OUT/__{w}_{i}.distcp   blobs back to back: each chunk of a tensor is one `torch.save` of a
                           tensor of the chunk's shape (`_write_item`), each non-tensor value one
                           `torch.save` of the value (`DefaultSavePlanner.transform_object`)

A blob is written here as torch.save writes it under `torch.serialization.skip_data` (the structure,
with the storage's bytes reserved, at a fixed place in the blob; only its head and tail are kept), then the chunk's values are written
into it as the exchange delivers them, and its CRC-32 fields are filled once they are all there
(`fill_crc`): the blob then equals `torch.save` of the chunk byte for byte but for its random
`serialization_id`. The blob's layout follows the installed torch, so nothing of torch's zip format is
restated here but where the CRC fields are (the ZIP format's own, PKWARE APPNOTE 4.3.7, 4.3.9, 4.3.12).
"""
from __future__ import annotations

import functools
import io
import os
import pickle
import struct
import uuid
import zipfile
import zlib
from dataclasses import dataclass

import torch

from reshard.errors import UnsupportedTorch
from reshard.formats.torch_bytes.torch_archive import dtype_of

METADATA_NAME = ".metadata"
"""torch/distributed/checkpoint/filesystem.py `_metadata_fn`."""
DISTCP_SUFFIX = ".distcp"
DCP_VERSION = "1.0.0"
"""filesystem.py `CURRENT_DCP_VERSION` of torch 2.13: Metadata.version when the installed torch names none."""


def _dcp_classes():
    """torch's DCP classes, or a clear refusal where the installed torch lacks one of them.
    `_StorageInfo` is internal to filesystem.py: its fields are checked, not assumed."""
    try:
        from torch.distributed.checkpoint import filesystem, metadata
        from torch.serialization import skip_data  # noqa: F401  (torch >= 2.5)
    except ImportError as error:
        raise UnsupportedTorch(f"the DCP export needs torch.distributed.checkpoint and torch.serialization.skip_data "
                           f"(torch >= 2.5); this torch {torch.__version__} lacks them: {error}") from None
    fields = getattr(filesystem._StorageInfo, "__dataclass_fields__", {})
    if not {"relative_path", "offset", "length"} <= set(fields):
        raise UnsupportedTorch(f"torch {torch.__version__}: filesystem._StorageInfo has fields {sorted(fields)}, not "
                           "relative_path/offset/length: the DCP export was checked against torch 2.13")
    return filesystem, metadata


@dataclass(frozen=True)
class BlobTemplate:
    """`torch.save` of one tensor, its data reserved: the bytes before and after the data, where the
    data goes and where its CRC-32 is recorded (offsets in the blob). Only head and tail are kept,
    so a template of a large chunk costs its few kB of structure, not its data."""

    head: bytes
    tail: bytes
    data_offset: int
    data_bytes: int
    crc_offsets: tuple[int, ...]

    @property
    def size(self) -> int:
        return len(self.head) + self.data_bytes + len(self.tail)


@functools.lru_cache(maxsize=4096)
def blob_template(shape: tuple[int, ...], dtype: str) -> BlobTemplate:
    """Saved into an anonymous temporary file, where skip_data seeks over the data (a hole: neither
    memory nor disk for a large chunk), then only its head and tail are read back."""
    import tempfile

    from torch.serialization import skip_data
    _dcp_classes()
    with tempfile.TemporaryFile() as blob:
        with skip_data():
            torch.save(torch.empty(shape, dtype=dtype_of(dtype)), blob)
        size = blob.tell()
        offset, crcs = _record_place(blob, size)
        nbytes = int(torch.Size(shape).numel()) * dtype_of(dtype).itemsize
        blob.seek(0)
        head = blob.read(offset)
        blob.seek(offset + nbytes)
        tail = blob.read(size - offset - nbytes)
    return BlobTemplate(head, tail, offset, nbytes, crcs)


def _record_place(blob, size: int) -> tuple[int, tuple[int, ...]]:
    """Where the one storage record's data starts in a torch.save blob (a file object of `size`
    bytes), and the byte offsets of its CRC-32 in the local header, the data descriptor (when there
    is one) and the central directory."""
    def read(offset: int, count: int) -> bytes:
        blob.seek(offset)
        return blob.read(count)

    archive = zipfile.ZipFile(blob)
    records = [info for info in archive.infolist() if "/data/" in info.filename and "/.data/" not in info.filename]
    if len(records) != 1:
        raise AssertionError(f"a torch.save blob of one tensor holds {len(records)} storage records")
    info = records[0]
    header = info.header_offset
    name_length, extra_length = struct.unpack("<HH", read(header + 26, 4))
    start = header + 30 + name_length + extra_length
    crcs = [header + 14]
    if info.flag_bits & 0x08:  # a data descriptor follows the data, with or without its signature
        after = start + info.compress_size
        crcs.append(after + 4 if read(after, 4) == b"PK\x07\x08" else after)
    directory = read(archive.start_dir, size - archive.start_dir)
    position = 0
    while directory[position:position + 4] == b"PK\x01\x02":
        n, m, k = struct.unpack_from("<HHH", directory, position + 28)
        if directory[position + 46:position + 46 + n].decode() == info.filename:
            crcs.append(archive.start_dir + position + 16)
        position += 46 + n + m + k
    return start, tuple(crcs)


@dataclass(frozen=True)
class PlacedBlob:
    """One blob of a .distcp file: what it holds and where."""

    key: str
    """The flat DCP key (e.g. "optim.state.up.weight.exp_avg")."""
    chunk: int
    """The chunk's index in the key's chunk list (MetadataIndex.index)."""
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    dtype: str
    file_offset: int
    template: BlobTemplate

    @property
    def data_at(self) -> int:
        return self.file_offset + self.template.data_offset


def place_blobs(entries) -> tuple[list[PlacedBlob], int]:
    """`entries`: (key, chunk index, offsets, sizes, dtype) in file order -> the blobs back to back
    and the file's size."""
    placed, at = [], 0
    for key, chunk, offsets, sizes, dtype in entries:
        template = blob_template(tuple(sizes), dtype)
        placed.append(PlacedBlob(key, chunk, tuple(offsets), tuple(sizes), dtype, at, template))
        at += template.size
    return placed, at


def fill_crc(fd: int, blob: PlacedBlob, read, write, piece_bytes: int = 8 << 20) -> None:
    """Once every value of `blob` is written: its CRC-32, read back from the file in pieces of at most
    `piece_bytes` (`read(fd, nbytes, offset) -> bytes`), written into each of its CRC fields."""
    crc = 0
    for first in range(0, blob.template.data_bytes, piece_bytes):
        count = min(piece_bytes, blob.template.data_bytes - first)
        crc = zlib.crc32(read(fd, count, blob.data_at + first), crc)
    value = struct.pack("<I", crc)
    for offset in blob.template.crc_offsets:
        write(fd, value, blob.file_offset + offset)


def tensor_blob(value: torch.Tensor) -> bytes:
    """A whole small tensor (a buffer, an optimizer step), as `_write_item` writes it."""
    buffer = io.BytesIO()
    torch.save(value.detach().contiguous().clone(), buffer)
    return buffer.getvalue()


def bytes_blob(value) -> bytes:
    """A non-tensor value (a hyperparameter, a param group's FQN list), as DefaultSavePlanner writes it."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


@dataclass
class MetadataBuilder:
    """Collects what `.metadata` says, key by key, with torch's classes."""

    tensors: dict
    """key -> (shape, dtype, [(offsets, sizes, relative_path, offset, length)])"""
    values: dict
    """key -> (relative_path, offset, length) of a bytes entry"""
    paths: dict
    """key -> its path in the nested state dict (planner_data)"""

    @classmethod
    def empty(cls) -> "MetadataBuilder":
        return cls({}, {}, {})

    def add_chunk(self, key: str, path: tuple, shape, dtype: str, offsets, sizes, relative_path: str, offset: int,
                  length: int) -> None:
        entry = self.tensors.setdefault(key, (tuple(shape), dtype, []))
        entry[2].append((tuple(offsets), tuple(sizes), relative_path, offset, length))
        self.paths[key] = path

    def add_bytes(self, key: str, path: tuple, relative_path: str, offset: int, length: int) -> None:
        self.values[key] = (relative_path, offset, length)
        self.paths[key] = path

    def build(self, identity: str):
        """The Metadata; its `storage_meta.save_id` is derived from `identity` (the export's fingerprint),
        so the same export writes the same bytes; `checkpoint_id` (informational) is left out, so
        the output does not name the directory it was written in."""
        filesystem, md = _dcp_classes()
        state, storage = {}, {}
        for key, (shape, dtype, chunks) in self.tensors.items():
            chunks = sorted(chunks)
            state[key] = md.TensorStorageMetadata(
                md.TensorProperties(dtype=dtype_of(dtype)), torch.Size(shape),
                [md.ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s, *_ in chunks])
            for i, (offsets, _sizes, relative_path, offset, length) in enumerate(chunks):
                storage[md.MetadataIndex(key, torch.Size(offsets), i)] = filesystem._StorageInfo(
                    relative_path, offset, length)
        for key, (relative_path, offset, length) in self.values.items():
            state[key] = md.BytesStorageMetadata()
            storage[md.MetadataIndex(key)] = filesystem._StorageInfo(relative_path, offset, length)
        return md.Metadata(state_dict_metadata=state, planner_data=dict(self.paths), storage_data=storage,
                           storage_meta=md.StorageMeta(save_id=str(uuid.uuid5(uuid.NAMESPACE_OID, identity))),
                           version=getattr(filesystem, "CURRENT_DCP_VERSION", DCP_VERSION))


def write_metadata(path: str, metadata) -> None:
    """`.metadata` as FileSystemWriter.finish writes it: pickle.dump of the Metadata."""
    with open(path, "wb") as out:
        pickle.dump(metadata, out)
        out.flush()
        os.fsync(out.fileno())
