"""The zip container of torch.save files, written and read without torch (torch 2.13 rules).

    from reshard.formats.torch_bytes.torch_zip import ArchiveWriter, ArchiveReader
    writer = ArchiveWriter("out.pt")                  # archive name "out", as torch derives it
    writer.add("data.pkl", pickled)                   # a record with its bytes
    offset = writer.reserve("data/0", 4096)           # a record whose bytes are left as a hole
    writer.finish()                                   # version, serialization id, central directory
    ArchiveReader("out.pt").offset("data/0")          # byte offset of a record's data (strict reader)
    seal_crcs("out.pt")                               # once the holes are filled: real CRC-32s, as torch.save

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
  data as a hole (zeros) and records CRC 0; the local header records CRC 0 always (the CRC is in
  the data descriptor and the central directory, miniz `mz_zip_writer_add_mem_ex_v2`).
  `seal_crcs` turns a skeleton whose holes were filled into what torch.save of the data writes.
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
alignment, or no zip64 end record); the reader takes any of those, but only stored records,
one record per name (regardless of case, as miniz looks names up), records that neither
overlap each other nor the directory, and sizes inside the file: see `read_directory`.
"""
from __future__ import annotations

import functools
import mmap
import os
import struct
import zlib
from concurrent.futures import ThreadPoolExecutor

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


# -- CRC-32 of records filled after the skeleton -----------------------------------------------
#
# A skeleton's storage records are holes whose CRC fields say 0; their bytes arrive later, out of
# order, by pwrite and by kernel copies (copy_file_range) that never pass through this process,
# and a resumed job wrote some of them in an earlier run. So the CRCs are computed from the
# written bytes once a file is complete (`seal_crcs`): correct whatever wrote the bytes and
# whenever, with no CRC state to keep across a resume. The bytes are read back from the page
# cache, as the manifest's hash reads them anyway; large records are cut into windows whose
# CRCs are computed in threads (zlib.crc32 releases the GIL) and joined with `crc32_combine`.

CRC_WINDOW_BYTES = 16 << 20
"""How much of a record one CRC thread maps and checks at once."""
CRC_THREADS = min(8, os.cpu_count() or 1)


def _gf2_times(matrix: list[int], vector: int) -> int:
    total, row = 0, 0
    while vector:
        if vector & 1:
            total ^= matrix[row]
        vector >>= 1
        row += 1
    return total


def _gf2_square(matrix: list[int]) -> list[int]:
    return [_gf2_times(matrix, matrix[n]) for n in range(32)]


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """zlib.crc32(a + b) from crc1 = zlib.crc32(a), crc2 = zlib.crc32(b) and len2 = len(b): zlib's
    `crc32_combine` (crc32.c of zlib 1.2.x, `crc32_combine_`): crc1 carried through len2 zero
    bytes (`_zeros_operator`), then xor crc2."""
    if len2 <= 0:
        return crc1
    return (_gf2_times(_zeros_operator(len2), crc1) ^ crc2) & U32


@functools.lru_cache(maxsize=64)
def _zeros_operator(nbytes: int) -> tuple[int, ...]:
    """The GF(2) matrix (32 columns) that carries a CRC-32 register through `nbytes` zero bytes:
    the matrix of one zero bit (the reflected polynomial 0xEDB88320) squared until it stands for
    one byte, then for 2, 4, 8... bytes, composed for each set bit of `nbytes`, as zlib applies
    them. Cached: the windows of a record are all one size but the last."""
    result = [1 << n for n in range(32)]  # identity
    odd = [0xEDB88320] + [1 << n for n in range(31)]  # one zero bit
    even = _gf2_square(odd)  # two
    odd = _gf2_square(even)  # four
    while True:
        even = _gf2_square(odd)  # 8, 32, 128, ... zero bits
        if nbytes & 1:
            result = [_gf2_times(even, column) for column in result]
        nbytes >>= 1
        if not nbytes:
            break
        odd = _gf2_square(even)  # 16, 64, ... zero bits
        if nbytes & 1:
            result = [_gf2_times(odd, column) for column in result]
        nbytes >>= 1
        if not nbytes:
            break
    return tuple(result)


def _window_crc(fd: int, offset: int, size: int) -> int:
    """CRC-32 of `size` bytes of the file at `offset`, through one read-only map (no copy)."""
    if size == 0:
        return 0
    start = offset - offset % mmap.ALLOCATIONGRANULARITY
    window = mmap.mmap(fd, size + offset - start, prot=mmap.PROT_READ, offset=start)
    try:
        with memoryview(window) as view:
            return zlib.crc32(view[offset - start:]) & U32
    finally:
        window.close()


def crc32_of_range(fd: int, offset: int, size: int, pool: ThreadPoolExecutor | None = None,
                   window: int = CRC_WINDOW_BYTES) -> int:
    """CRC-32 of `size` bytes of the file at `offset`: windows of `window` bytes, in `pool`'s
    threads when given, combined in order."""
    starts = range(offset, offset + size, window)
    sizes = [min(window, offset + size - at) for at in starts]
    if pool is None or len(sizes) < 2:
        crcs = [_window_crc(fd, at, n) for at, n in zip(starts, sizes)]
    else:
        crcs = list(pool.map(lambda piece: _window_crc(fd, *piece), zip(starts, sizes)))
    total = 0
    for crc, n in zip(crcs, sizes):
        total = crc32_combine(total, crc, n)
    return total


def _central_crc_fields(fd: int, file_size: int) -> dict[bytes, int]:
    """{full record name: byte offset of its CRC field in the central directory} of an archive
    `read_directory` accepted."""
    end = _END.unpack(os.pread(fd, _END.size, file_size - _END.size))
    entries, cd_size, cd_offset = end[4], end[5], end[6]
    if file_size >= _END.size + _LOCATOR.size:
        locator = _LOCATOR.unpack(os.pread(fd, _LOCATOR.size, file_size - _END.size - _LOCATOR.size))
        if locator[0] == 0x07064B50:
            end64 = _END64.unpack(os.pread(fd, _END64.size, locator[2]))
            entries, cd_size, cd_offset = end64[7], end64[8], end64[9]
    directory = os.pread(fd, cd_size, cd_offset)
    fields, position = {}, 0
    for _ in range(entries):
        entry = _CENTRAL.unpack_from(directory, position)
        name_len, extra_len, comment_len = entry[10], entry[11], entry[12]
        name = directory[position + _CENTRAL.size:position + _CENTRAL.size + name_len]
        fields[name] = cd_offset + position + 16
        position += _CENTRAL.size + name_len + extra_len + comment_len
    return fields


def seal_crcs(path: str | os.PathLike, fd: int | None = None) -> int:
    """Give every record of a torch archive its real CRC-32, and `.data/serialization_id` the value
    torch derives from them (see `serialization_id`), in the data descriptors and the central
    directory: what torch.save writes for the same bytes. For a skeleton (`reserve`, or torch's
    skip_data) once its holes are filled. Fields already right are not written, so sealing again
    writes nothing. Returns the number of records whose CRC changed. `fd`: the file opened for
    writing, when the caller holds it."""
    own = fd is None
    if own:
        fd = os.open(os.fspath(path), os.O_RDWR | os.O_NOFOLLOW)
    try:
        file_size = os.fstat(fd).st_size
        prefix, records = read_directory(fd, file_size)
        central = _central_crc_fields(fd, file_size)
        ordered = sorted(records.values(), key=lambda r: r.header_offset)
        changed, names, crcs = 0, [], []
        large = CRC_THREADS > 1 and any(r.file_size > CRC_WINDOW_BYTES for r in ordered)
        pool = ThreadPoolExecutor(CRC_THREADS, thread_name_prefix="reshard-crc") if large else None
        try:
            for record in ordered:
                if record.name == ".data/serialization_id" and record.file_size == 40:
                    wanted = serialization_id(names, crcs).encode()
                    if os.pread(fd, 40, record.data_offset) != wanted:
                        _pwrite_all(fd, wanted, record.data_offset)
                crc = crc32_of_range(fd, record.data_offset, record.file_size, pool) if record.file_size else 0
                names.append(record.name)
                if record.file_size:  # an empty record has no descriptor (nor a CRC in the directory)
                    crcs.append(crc)
                    field = record.data_end + 4
                    if int.from_bytes(os.pread(fd, 4, field), "little") != crc:
                        changed += 1
                        packed = struct.pack("<I", crc)
                        _pwrite_all(fd, packed, field)
                        _pwrite_all(fd, packed, central[(prefix + record.name).encode()])
        finally:
            if pool is not None:
                pool.shutdown()
        return changed
    finally:
        if own:
            os.close(fd)


def _pwrite_all(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        done = os.pwrite(fd, view, offset)
        view, offset = view[done:], offset + done


# -- reading -----------------------------------------------------------------------------------
#
# A strict reader of exactly the layout above: what torch.save writes and nothing else. Python's
# zipfile (`_EndRecData`, `_RealGetContents`) and miniz (`mz_zip_reader_read_central_dir`,
# `mz_zip_reader_locate_file`) accept more, and accept it differently (zipfile tolerates bytes
# before the archive and keeps the LAST of two records of one name; miniz finds names without
# regard to case and trusts the entry count of the end record), so anything torch.save would not
# write is refused by name here rather than read one way while torch reads it another. Every size
# is checked against the file's real size before anything is read or allocated.

_END = struct.Struct("<IHHHHIIH")            # end of central directory record, 22 bytes
_LOCATOR = struct.Struct("<IIQI")            # zip64 end of central directory locator, 20 bytes
_END64 = struct.Struct("<IQHHIIQQQQ")        # zip64 end of central directory record, 56 bytes
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")  # central directory header, 46 bytes
_LOCAL = struct.Struct("<IHHHHHIIIHH")       # local file header, 30 bytes


class ArchiveFormatError(ValueError):
    """The file is not a zip archive as torch.save writes one; the message says what is off."""


class Record:
    """One record: its name without the archive prefix, where its header and its data are."""

    __slots__ = ("name", "header_offset", "data_offset", "file_size")

    def __init__(self, name: str, header_offset: int, data_offset: int, file_size: int):
        self.name, self.header_offset, self.data_offset, self.file_size = name, header_offset, data_offset, file_size

    @property
    def data_end(self) -> int:
        return self.data_offset + self.file_size


def _pread(fd: int, size: int, offset: int, file_size: int, what: str) -> bytes:
    if offset < 0 or offset + size > file_size:
        raise ArchiveFormatError(f"is not a complete torch archive (truncated or corrupt?): {what} lies beyond "
                                 f"the end of the file ({file_size} bytes)")
    data = os.pread(fd, size, offset)
    if len(data) != size:
        raise ArchiveFormatError(f"{what} could not be read in full: the file shrank while being read")
    return data


def _zip64_fields(extra: bytes, wanted: list[str], name: str) -> dict[str, int]:
    """The zip64 extra field (id 1) of a central header: the 8-byte values of the fields whose
    32-bit value was 0xFFFFFFFF, in the order uncompressed size, compressed size, header offset."""
    position, found = 0, None
    while position < len(extra):
        if position + 4 > len(extra):
            raise ArchiveFormatError(f"record {name!r} has a malformed extra field")
        kind, length = struct.unpack_from("<HH", extra, position)
        body = extra[position + 4:position + 4 + length]
        if len(body) != length:
            raise ArchiveFormatError(f"record {name!r} has a malformed extra field")
        if kind == 1:
            if found is not None:
                raise ArchiveFormatError(f"record {name!r} has two zip64 extra fields")
            found = body
        position += 4 + length
    if not wanted:
        return {}
    if found is None or len(found) < 8 * len(wanted):
        raise ArchiveFormatError(f"record {name!r} declares zip64 sizes or offsets but has no zip64 extra field for them")
    return {field: struct.unpack_from("<Q", found, 8 * i)[0] for i, field in enumerate(wanted)}


def read_directory(fd: int, file_size: int) -> tuple[str, dict[str, Record]]:
    """(archive prefix with its slash, {name without prefix: Record}) of a torch.save archive;
    ArchiveFormatError for anything torch.save would not have written."""
    if file_size < _END.size:
        raise ArchiveFormatError(f"is not a complete torch archive (truncated or corrupt?): {file_size} bytes")
    (signature, disk, cd_disk, disk_entries, entries, cd_size, cd_offset,
     comment) = _END.unpack(_pread(fd, _END.size, file_size - _END.size, file_size, "the end record"))
    if signature != 0x06054B50 or comment:
        raise ArchiveFormatError("is not a complete torch archive (truncated or corrupt?): it does not end with a "
                                 "zip end-of-central-directory record")
    if disk or cd_disk or disk_entries != entries:
        raise ArchiveFormatError("is a multi-disk zip archive; torch.save writes one disk")
    end_of_directory = file_size - _END.size
    if file_size >= _END.size + _LOCATOR.size:
        locator = _LOCATOR.unpack(_pread(fd, _LOCATOR.size, end_of_directory - _LOCATOR.size, file_size, "zip64 locator"))
        if locator[0] == 0x07064B50:
            _, locator_disk, end64_at, disks = locator
            if locator_disk or disks != 1 or end64_at + _END64.size != end_of_directory - _LOCATOR.size:
                raise ArchiveFormatError("has a zip64 locator that does not point at the record before it")
            (signature, record_size, _, _, disk, cd_disk, disk_entries64, entries64, cd_size64,
             cd_offset64) = _END64.unpack(_pread(fd, _END64.size, end64_at, file_size, "zip64 end record"))
            if signature != 0x06064B50 or record_size != _END64.size - 12 or disk or cd_disk \
                    or disk_entries64 != entries64:
                raise ArchiveFormatError("has a malformed zip64 end-of-central-directory record")
            if (entries, cd_size, cd_offset) != (min(entries64, 0xFFFF), min(cd_size64, U32), min(cd_offset64, U32)):
                raise ArchiveFormatError("has end records that disagree on the central directory (entries, size or offset)")
            entries, cd_size, cd_offset, end_of_directory = entries64, cd_size64, cd_offset64, end64_at
    if entries in (0xFFFF,) or U32 in (cd_size, cd_offset):
        raise ArchiveFormatError("declares zip64 values but has no zip64 end record")
    if cd_offset + cd_size != end_of_directory:
        raise ArchiveFormatError(f"declares a central directory of {cd_size} bytes at {cd_offset}, which does not end "
                                 f"where its end record starts ({end_of_directory})")
    if entries * _CENTRAL.size > cd_size:
        raise ArchiveFormatError(f"declares {entries} records in a central directory of only {cd_size} bytes")
    directory = _pread(fd, cd_size, cd_offset, file_size, "the central directory")

    headers: list[tuple[bytes, int, int]] = []  # (full name, header offset, size)
    position = 0
    for _ in range(entries):
        if position + _CENTRAL.size > cd_size:
            raise ArchiveFormatError("has a central directory shorter than its entry count says")
        (signature, _, _, flags, method, _, _, _, compressed, size, name_len, extra_len, comment_len,
         start_disk, _, attributes, header_at) = _CENTRAL.unpack_from(directory, position)
        end = position + _CENTRAL.size + name_len + extra_len + comment_len
        if signature != 0x02014B50 or end > cd_size:
            raise ArchiveFormatError("has a malformed central directory entry")
        raw_name = directory[position + _CENTRAL.size:position + _CENTRAL.size + name_len]
        try:
            name = raw_name.decode("ascii")
        except UnicodeDecodeError:
            name = None
        if name is None or "\0" in name or not name:
            raise ArchiveFormatError(f"has a record named {raw_name!r}: torch.save writes ASCII names only")
        if method != 0:
            raise ArchiveFormatError(f"has compressed record {name!r} (zip method {method}); torch.save stores "
                                     "every record uncompressed, and reshard reads stored records only")
        if flags & ~0x0808:  # torch.save sets only "data descriptor" and "UTF-8 name"; miniz refuses many others
            raise ArchiveFormatError(f"record {name!r} has zip flags {flags:#06x} (encrypted or patched data?)")
        if start_disk:
            raise ArchiveFormatError(f"record {name!r} starts on another disk")
        if attributes & 0x10 or name.endswith("/"):  # miniz `mz_zip_reader_is_file_a_directory`: reads no data
            raise ArchiveFormatError(f"record {name!r} is marked as a directory")
        extra = directory[position + _CENTRAL.size + name_len:position + _CENTRAL.size + name_len + extra_len]
        wide = [field for field, value in (("size", size), ("compressed", compressed), ("header", header_at))
                if value == U32]
        values = _zip64_fields(extra, wide, name)
        size, compressed = values.get("size", size), values.get("compressed", compressed)
        header_at = values.get("header", header_at)
        if compressed != size:
            raise ArchiveFormatError(f"record {name!r} is stored with {compressed} bytes but declares {size}")
        headers.append((raw_name, header_at, size))
        position = end
    if position != cd_size:
        raise ArchiveFormatError("has bytes in its central directory beyond its declared entries")
    if not headers:
        raise ArchiveFormatError("archive does not contain any files")

    first = headers[0][0].decode()
    if "/" not in first:
        raise ArchiveFormatError(f"file in archive is not in a subdirectory: {first}")
    prefix = first.split("/", 1)[0] + "/"
    records: dict[str, Record] = {}
    folded: set[str] = set()
    for raw_name, header_at, size in headers:
        full = raw_name.decode()
        if not full.startswith(prefix):
            raise ArchiveFormatError(f"has record {full!r} outside its archive directory {prefix!r}")
        if full.lower() in folded:  # miniz finds names regardless of case: two such names are one to torch
            raise ArchiveFormatError(f"holds two records named {full!r} (torch.save writes each name once; "
                                     "torch would read one of them, so reshard reads neither)")
        folded.add(full.lower())
        if header_at + _LOCAL.size + len(raw_name) > cd_offset:
            raise ArchiveFormatError(f"record {full!r} has its header beyond the records (at {header_at})")
        local = _pread(fd, _LOCAL.size + len(raw_name), header_at, file_size, f"record {full!r}")
        (signature, _, flags, method, _, _, _, _, _, name_len, extra_len) = _LOCAL.unpack_from(local)
        if signature != 0x04034B50 or name_len != len(raw_name) or local[_LOCAL.size:] != raw_name:
            raise ArchiveFormatError(f"record {full!r} has no matching local header at {header_at}")
        if method != 0 or flags & ~0x0808:
            raise ArchiveFormatError(f"record {full!r} is compressed or encrypted in its local header")
        data_at = header_at + _LOCAL.size + name_len + extra_len
        if data_at + size > cd_offset:
            raise ArchiveFormatError(f"record {full!r} declares {size} bytes at {data_at}, beyond the records "
                                     f"(the central directory starts at {cd_offset}; the file has {file_size} bytes)")
        records[full[len(prefix):]] = Record(full[len(prefix):], header_at, data_at, size)
    ordered = sorted(records.values(), key=lambda r: r.header_offset)
    if ordered[0].header_offset != 0:
        raise ArchiveFormatError("does not start with its first record (bytes before the archive)")
    for before, after in zip(ordered, ordered[1:]):
        if before.data_end > after.header_offset:
            raise ArchiveFormatError(f"has overlapping records {before.name!r} and {after.name!r}")
    return prefix, records


class ArchiveReader:
    """The records of a torch archive: names (without the archive prefix), sizes, data offsets.

    Raises ArchiveFormatError for a file torch.save would not have written (see read_directory)."""

    def __init__(self, path: str):
        self.path = os.fspath(path)
        self.file = open(self.path, "rb")
        try:
            self.file_size = os.fstat(self.file.fileno()).st_size
            self.prefix, self.infos = read_directory(self.file.fileno(), self.file_size)
        except BaseException:
            self.file.close()
            raise

    def size(self, name: str) -> int:
        return self.infos[name].file_size

    def offset(self, name: str) -> int:
        """Where the record's data starts (inline_container.cc `getRecordOffset`)."""
        return self.infos[name].data_offset

    def read(self, name: str) -> bytes:
        record = self.infos[name]
        return _pread(self.file.fileno(), record.file_size, record.data_offset, self.file_size, f"record {name!r}")

    def close(self) -> None:
        self.file.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
