"""The CRC-32 fields of a torch archive, read with Python's zipfile, for tests that look at them.

    from zip_records import as_skeleton_recorded
    as_skeleton_recorded(path)   # the file's bytes with every storage CRC as a skeleton records it (0)

reshard fills a skeleton's storage records after writing it and then gives them their real
CRC-32s (reshard.formats.torch_bytes.torch_zip.seal_crcs); bytes recorded before that step carried CRC 0
there, and a `.data/serialization_id` computed from those zeros. `as_skeleton_recorded` undoes
exactly those fields and nothing else, so a hash pinned on the earlier bytes still judges the
rest of the file, and the fields it rewrites are the only ones sealing may change.
"""
from __future__ import annotations

import struct
import zipfile

from reshard.formats.torch_bytes.torch_zip import serialization_id


def _data_offset(raw: bytes, info: zipfile.ZipInfo) -> int:
    name_len, extra_len = struct.unpack_from("<HH", raw, info.header_offset + 26)
    return info.header_offset + 30 + name_len + extra_len


def _central_crc_offsets(raw: bytes, archive: zipfile.ZipFile) -> dict[str, int]:
    at, out = archive.start_dir, {}
    for _ in archive.infolist():
        assert raw[at:at + 4] == b"PK\x01\x02"
        name_len, extra_len, comment_len = struct.unpack_from("<HHH", raw, at + 28)
        out[raw[at + 46:at + 46 + name_len].decode()] = at + 16
        at += 46 + name_len + extra_len + comment_len
    return out


def as_skeleton_recorded(path) -> bytes:
    """The bytes of `path` with each storage record's CRC-32 (data descriptor and central
    directory) set to 0, `.data/serialization_id` recomputed from those CRCs, and that record's
    own CRC-32 made to match: what reshard wrote before it sealed its files."""
    raw = bytearray(open(path, "rb").read())
    with zipfile.ZipFile(path) as archive:
        infos = sorted(archive.infolist(), key=lambda i: i.header_offset)
        central = _central_crc_offsets(bytes(raw), archive)
        prefix = infos[0].filename.split("/", 1)[0] + "/"
        names, crcs = [], []
        for info in infos:
            name = info.filename[len(prefix):]
            data_at = _data_offset(bytes(raw), info)
            if name == ".data/serialization_id":
                value = serialization_id(names, crcs).encode()
                raw[data_at:data_at + len(value)] = value
                crc = zipfile.crc32(value)
            else:
                crc = 0 if name.startswith("data/") else info.CRC
            names.append(name)
            if info.file_size:
                crcs.append(crc)
                for field in (data_at + info.file_size + 4, central[info.filename]):
                    raw[field:field + 4] = struct.pack("<I", crc)
    return bytes(raw)


def rewritten_by_torch(path, out) -> bytes:
    """The records of `path`, in their order, written again by torch's own zip writer
    (`torch._C.PyTorchFileWriter`, the PyTorchStreamWriter torch.save drives; it adds `version`
    and `.data/serialization_id` itself at the end), to `out`; returns those bytes. A file equal to
    them is what torch.save writes for its records: CRC-32s, serialization id, padding, directory."""
    import torch

    with zipfile.ZipFile(path) as archive:
        infos = sorted(archive.infolist(), key=lambda i: i.header_offset)
        prefix = infos[0].filename.split("/", 1)[0] + "/"
        writer = torch._C.PyTorchFileWriter(str(out))
        for info in infos:
            name = info.filename[len(prefix):]
            if name not in ("version", ".data/serialization_id"):
                data = archive.read(info.filename)
                writer.write_record(name, data, len(data))
        writer.write_end_of_file()
        del writer
    with open(out, "rb") as file:
        return file.read()
