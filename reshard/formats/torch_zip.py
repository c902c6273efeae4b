"""The zip container of torch.save files, written and read without torch (torch 2.13 rules).

    from reshard.formats.torch_zip import ArchiveWriter, record_offsets
    writer = ArchiveWriter("out.pt")                  # archive name "out", as torch derives it
    writer.add("data.pkl", pickled)                   # a record with its bytes
    offset = writer.reserve("data/0", 4096)           # a record whose bytes are left as a hole
    writer.finish()                                   # version, serialization id, central directory
    record_offsets("out.pt")   # {"data/0": byte offset of its data, ...}, names without the prefix

torch.save (torch/serialization.py `_save`, `_open_zipfile_writer_file`) hands every record
to `PyTorchStreamWriter` (caffe2/serialize/inline_container.cc), which drives miniz
(third_party/miniz-3.0.2/miniz.c). The rules mirrored here, each from that code:

- Record names are `<archive>/<name>`; `<archive>` is the file's base name without its last
  extension (inline_container.cc `basename`), or "archive" when torch writes through a Python
  file object: a path that is not ASCII (serialization.py `_open_zipfile_writer_file`).
- Each record: a 30-byte local header (version needed 0, flags 0x0808 = data descriptor +
  UTF-8 names, or 0x0800 for an empty record, method 0, DOS time and date 0, CRC and sizes 0),
  the name, a zip64 extra field when the record's offset or size reaches 0xFFFFFFFF
  (miniz `mz_zip_writer_add_mem_ex_v2`, `mz_zip_writer_create_zip64_extra_data`: uncompressed
  size and compressed size 0 when the size does, then the header offset when it does), then
  torch's "FB" extra field padding the data to a multiple of 64 bytes (inline_container.cc
  `getPadding`; 64 is `torch.utils.serialization.config.save.storage_alignment`), the data,
  and a data descriptor `PK\\x07\\x08` crc, sizes (32-bit, or 64-bit after a zip64 extra), none
  for an empty record. A record written under `skip_data` (`writeRecordMetadata`) leaves its
  data as a hole (zeros) and records CRC 0.
- `writeEndOfFile`: "version" = "3\\n" (kProducedFileFormatVersion, no `.data/version` below
  6), then `.data/serialization_id` = 20 decimal digits of a hash of the record names combined
  in the iteration order of a libstdc++ `std::unordered_set<std::string>` (`files_written_`),
  then 20 of the CRCs combined in write order (`writeSerializationId`, `ostream_write_func`:
  every write that starts with a data-descriptor signature), c10::hash_combine both.
- Central directory entries (version made by 0, needed 0, attributes 0, zip64 extra as
  above with the real compressed size), then always a zip64 end-of-central-directory record
  (made by 0x031E, needed 0x2D), its locator, and the end record (miniz
  `mz_zip_writer_finalize_archive`; the writer is opened with MZ_ZIP_FLAG_WRITE_ZIP64).

Files from other torch versions differ (older ones have no `.format_version`, or another
alignment); reading them only needs the zip structure, which `zipfile` parses.
"""
from __future__ import annotations

import os
import struct
import zlib

ALIGNMENT = 64
"""torch.utils.serialization.config.save.storage_alignment (default)."""
FORMAT_VERSION = 3
"""caffe2/serialize/versions.h kProducedFileFormatVersion, written as the `version` record."""
U32 = 0xFFFFFFFF
_M64 = (1 << 64) - 1
_DESCRIPTOR = b"PK\x07\x08"


def archive_name(path: str) -> str:
    """The record prefix torch.save uses for `path` (inline_container.cc `basename`)."""
    try:
        path.encode("ascii")
    except UnicodeEncodeError:
        return "archive"  # torch writes through a Python file object: PyTorchStreamWriter(writer_func)
    start = max(path.rfind("/"), path.rfind("\\")) + 1
    dot = path.rfind(".", start + 1)
    name = path[start:dot] if dot > start else path[start:]
    if not name:
        raise ValueError(f"invalid file name for a torch archive: {path!r}")
    return name


# -- the serialization id (inline_container.cc writeSerializationId) ---------------------------

def _shift_mix(v: int) -> int:
    return v ^ (v >> 47)


def std_hash(data: bytes) -> int:
    """std::hash<std::string> of libstdc++ on 64-bit: `_Hash_bytes(ptr, len, 0xc70f6907)`."""
    mul = (0xC6A4A793 << 32) + 0x5BD1E995
    n = len(data)
    aligned = n & ~7
    h = (0xC70F6907 ^ (n * mul)) & _M64
    for i in range(0, aligned, 8):
        word = int.from_bytes(data[i:i + 8], "little")
        h ^= (_shift_mix((word * mul) & _M64) * mul) & _M64
        h = (h * mul) & _M64
    if n & 7:
        h ^= int.from_bytes(data[aligned:], "little")
        h = (h * mul) & _M64
    h = (_shift_mix(h) * mul) & _M64
    return _shift_mix(h)


def hash_combine(seed: int, value: int) -> int:
    """c10/util/hash.h `hash_combine` on size_t."""
    return (seed ^ ((value + 0x9E3779B9 + (seed << 6) + (seed >> 2)) & _M64)) & _M64


_SMALL_BUCKETS = (2, 2, 2, 3, 5, 5, 7, 7, 11, 11, 11, 11, 13, 13)  # libstdc++ _Prime_rehash_policy::_M_next_bkt


_GROWN_BUCKETS = (13, 29, 59, 127, 257, 541, 1109, 2357, 5087, 10273, 20753, 42043, 85229, 172933, 351061,
                  712697, 1447153, 2938679, 5967347, 12114203, 24583313, 49885309)
"""The bucket counts a growing libstdc++ unordered_set passes through: each the first entry of
its `__prime_list` not below twice the one before (hashtable_c++0x.cc `_M_next_bkt`)."""


def unordered_set_order(names: list[str]) -> list[str]:
    """Iteration order of a libstdc++ std::unordered_set<std::string> after inserting `names`
    (all distinct) in order: hashtable.h `_M_insert_unique_node`, `_M_insert_bucket_begin`,
    `_M_rehash_aux`, and `_Prime_rehash_policy::_M_need_rehash` (max load factor 1, 13 buckets
    first, then at least double)."""
    table = _LinkedBuckets(1)
    next_resize = 0
    for name in names:
        count = len(table.code)
        if count + 1 > next_resize:
            wanted = max(count + 1, 11 if next_resize == 0 else 0)
            if wanted >= table.buckets:
                target = max(wanted + 1, table.buckets * 2)
                new = _SMALL_BUCKETS[target] if target < len(_SMALL_BUCKETS) else _grown(target)
                table = table.rehashed(new)
                next_resize = new
            else:
                next_resize = table.buckets
        table.insert(name, std_hash(name.encode()))
    return table.in_order()


def _grown(target: int) -> int:
    for count in _GROWN_BUCKETS:
        if count >= target:
            return count
    raise ValueError("more records than reshard knows torch's bucket counts for")


class _LinkedBuckets:
    """libstdc++'s hashtable layout: one singly linked list from a sentinel (None), and per
    bucket the node BEFORE that bucket's first node."""

    def __init__(self, buckets: int):
        self.buckets = buckets
        self.next: dict = {None: None}
        self.before: dict[int, object] = {}
        self.code: dict[str, int] = {}

    def insert(self, name: str, code: int) -> None:  # _M_insert_bucket_begin
        self.code[name] = code
        bucket = code % self.buckets
        if bucket in self.before:
            prev = self.before[bucket]
            self.next[name], self.next[prev] = self.next[prev], name
        else:
            first = self.next[None]
            self.next[name], self.next[None] = first, name
            if first is not None:
                self.before[self.code[first] % self.buckets] = name
            self.before[bucket] = None

    def rehashed(self, buckets: int) -> "_LinkedBuckets":  # _M_rehash_aux, unique keys
        out = _LinkedBuckets(buckets)
        for name in self.in_order():
            out.insert(name, self.code[name])
        return out

    def in_order(self) -> list[str]:
        out, node = [], self.next[None]
        while node is not None:
            out.append(node)
            node = self.next[node]
        return out


def serialization_id(names: list[str], crcs: list[int]) -> str:
    name_hash = 0
    for name in unordered_set_order(names):
        name_hash = hash_combine(name_hash, std_hash(name.encode()))
    crc = 0
    for value in crcs:
        crc = hash_combine(crc, value)
    return f"{name_hash:020d}{crc:020d}"


# -- writing -----------------------------------------------------------------------------------

class ArchiveWriter:
    """Writes one torch.save archive record by record, as PyTorchStreamWriter does."""

    def __init__(self, path: str, prefix: str | None = None):
        self.path = os.fspath(path)
        self.prefix = (archive_name(self.path) if prefix is None else prefix) + "/"
        self.pos = 0
        self.names: list[str] = []
        self.crcs: list[int] = []
        self.central = bytearray()
        self.count = 0
        self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)

    def _write(self, data: bytes) -> None:
        # ostream_write_func: a write that starts with a data-descriptor signature adds its CRC
        if len(data) >= 8 and data[:4] == _DESCRIPTOR:
            self.crcs.append(int.from_bytes(data[4:8], "little"))
        view = memoryview(data)
        while view:
            done = os.pwrite(self.fd, view, self.pos)
            if done <= 0:
                raise OSError(28, os.strerror(28), self.path)
            view = view[done:]
            self.pos += done

    def add(self, name: str, data: bytes) -> int:
        """A record with its bytes; returns the offset of its data."""
        return self._record(name, len(data), data)

    def reserve(self, name: str, size: int) -> int:
        """A record whose `size` bytes are reserved, not written (torch's skip_data)."""
        return self._record(name, size, None)

    def _record(self, name: str, size: int, data: bytes | None) -> int:
        full = (self.prefix + name).encode("utf-8")
        header_at = self.pos
        zip64 = size >= U32 or header_at >= U32
        start = header_at + 30 + len(full) + 4
        if zip64:
            start += 4 + (16 if size >= U32 else 0) + (8 if header_at >= U32 else 0)
        padding = (-start) % ALIGNMENT
        fb = b"FB" + struct.pack("<H", padding) + b"Z" * padding
        local64 = _zip64_extra(size, 0, header_at) if zip64 else b""
        flags = 0x0808 if size else 0x0800
        self._write(struct.pack("<IHHHHHIIIHH", 0x04034B50, 0, flags, 0, 0, 0, 0, 0, 0, len(full),
                                len(local64) + len(fb)))
        self._write(full)
        if local64:
            self._write(local64)
        self._write(fb)
        data_at = self.pos
        if data is None:
            crc = 0
            self.pos += size  # a hole: reads back as zeros
        else:
            crc = zlib.crc32(data) & U32 if size else 0
            if size:
                self._write(data)
        if size:
            if zip64:
                self._write(struct.pack("<IIQQ", 0x08074B50, crc, size, size))
            else:
                self._write(struct.pack("<IIII", 0x08074B50, crc, size, size))
        central64 = _zip64_extra(size, size, header_at) if zip64 else b""
        self.central += struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 0, 0, flags, 0, 0, 0, crc,
                                    min(size, U32), min(size, U32), len(full), len(central64), 0, 0, 0, 0,
                                    min(header_at, U32))
        self.central += full + central64
        self.count += 1
        self.names.append(name)
        return data_at

    def finish(self) -> int:
        """torch's writeEndOfFile; closes the file and returns its size."""
        try:
            if "version" not in self.names and ".data/version" not in self.names:
                self.add("version", f"{FORMAT_VERSION}\n".encode())
            if "byteorder" not in self.names:
                self.add("byteorder", b"little")
            self.add(".data/serialization_id", serialization_id(self.names, self.crcs).encode())
            cd_at, cd_size = self.pos, len(self.central)
            self._write(bytes(self.central))
            end64_at = self.pos
            self._write(struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 0x031E, 0x002D, 0, 0, self.count, self.count,
                                    cd_size, cd_at))
            self._write(struct.pack("<IIQI", 0x07064B50, 0, end64_at, 1))
            self._write(struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, min(self.count, 0xFFFF),
                                    min(self.count, 0xFFFF), min(cd_size, U32), min(cd_at, U32), 0))
            os.ftruncate(self.fd, self.pos)
            return self.pos
        finally:
            self.close()

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _zip64_extra(size: int, compressed: int, header_at: int) -> bytes:
    """miniz mz_zip_writer_create_zip64_extra_data: id 1, then the fields that overflow."""
    fields = b""
    if size >= U32:
        fields += struct.pack("<QQ", size, compressed)
    if header_at >= U32:
        fields += struct.pack("<Q", header_at)
    return struct.pack("<HH", 1, len(fields)) + fields


# -- reading -----------------------------------------------------------------------------------

class ArchiveReader:
    """The records of a torch archive: names (without the archive prefix), sizes, data offsets."""

    def __init__(self, path: str):
        import zipfile

        self.path = os.fspath(path)
        self.file = open(self.path, "rb")
        try:
            self.zip = zipfile.ZipFile(self.file)
            infos = self.zip.infolist()
            if not infos or "/" not in infos[0].filename:
                raise ValueError("archive does not contain any files in a subdirectory")
            self.prefix = infos[0].filename.split("/", 1)[0] + "/"
            self.infos = {info.filename[len(self.prefix):]: info for info in infos
                          if info.filename.startswith(self.prefix)}
        except BaseException:
            self.file.close()
            raise

    def size(self, name: str) -> int:
        return self.infos[name].file_size

    def offset(self, name: str) -> int:
        """Where the record's data starts (inline_container.cc `getRecordOffset`)."""
        info = self.infos[name]
        header = os.pread(self.file.fileno(), 30, info.header_offset)
        if len(header) != 30 or header[:4] != b"PK\x03\x04":
            raise ValueError(f"bad local header for {name}")
        name_len, extra_len = struct.unpack("<HH", header[26:30])
        return info.header_offset + 30 + name_len + extra_len

    def read(self, name: str) -> bytes:
        return self.zip.read(self.infos[name])

    def close(self) -> None:
        self.zip.close()
        self.file.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def record_offsets(path: str) -> dict[str, int]:
    with ArchiveReader(path) as archive:
        return {name: archive.offset(name) for name in archive.infos}
