"""The torch-free writer's record layouts against files that older torch releases wrote.

    python -m pytest -q tests/test_torch_save_layouts.py          # single process, a few seconds

tests/data/torch_saves/<release>/ holds what torch.save of that release wrote for 35 trees
(`bench/torch_save_layouts.py` run under it: three synthetic trees and the target files reshard
writes for five real DeepSpeed 0.19.8 saves, ZeRO-1 fp16, ZeRO-2 fp32, ZeRO-3 bf16, BF16_Optimizer
and native MoE, at 1 and 3 ranks). Each file is read back without torch and written again by
`torch_pickle.write_skeleton_tree` in the layout `torch_archive.PINNED_WRITER_LAYOUTS` gives that
release. torch 2.5.1 wrote under `skip_data()`, as reshard's torch path does: equal byte for byte.
torch 2.4.1 has no skip_data, so it wrote zero-filled storages and its records carry the CRCs of
those zeros, where a skeleton records none (as 2.5.1 and later do under skip_data): equal byte for
byte outside the CRC fields and the CRC half of the serialization id. The other layout must not
reproduce them, so each check can fail.
"""
from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from torch_trees import comparable_tree

from reshard.formats.deepspeed_files import deepspeed_classes as classes
from reshard.formats.torch_bytes import torch_pickle, torch_zip
from reshard.formats.torch_bytes.torch_archive import load_structure, pinned_writer_layout, portable
from reshard.formats.torch_bytes.torch_pickle import TORCH_2_4_LAYOUT, TORCH_2_11_LAYOUT

SAVES = Path(__file__).parent / "data" / "torch_saves"
RELEASES = ["2.4.1", "2.5.1"]
NAMES = torch_pickle.globals_by_name(classes.safe_globals())


def _saved(release: str) -> list[tuple[Path, str]]:
    index = json.loads((SAVES / release / "index.json").read_text())
    assert index["torch"].split("+")[0] == release
    return [(SAVES / release / name, entry["how"]) for name, entry in sorted(index["files"].items())]


def _without_crcs(path: Path) -> bytes:
    """The file's bytes with every CRC zeroed: data descriptors, central directory entries, and the
    CRC half of .data/serialization_id (torch_zip.serialization_id: 20 digits of names, 20 of CRCs)."""
    data = bytearray(path.read_bytes())
    with torch_zip.ArchiveReader(str(path)) as archive:
        for name, info in archive.infos.items():
            if info.file_size:
                descriptor = info.data_offset + info.file_size
                assert data[descriptor:descriptor + 4] == b"PK\x07\x08", (path, name)
                data[descriptor + 4:descriptor + 8] = bytes(4)
        ident = archive.offset(".data/serialization_id")
        data[ident + 20:ident + 40] = b"0" * 20
    central = struct.unpack_from("<I", data, len(data) - 22 + 16)[0]
    while data[central:central + 4] == b"PK\x01\x02":
        data[central + 16:central + 20] = bytes(4)
        name_len, extra_len, comment_len = struct.unpack_from("<HHH", data, central + 28)
        central += 46 + name_len + extra_len + comment_len
    return bytes(data)


def _rewritten(path: Path, layout, tmp_path: Path) -> Path:
    out = tmp_path / layout.releases.replace(", ", "_") / path.name  # the same name: it is the archive prefix
    out.parent.mkdir(parents=True, exist_ok=True)
    tree = torch_pickle.read_portable(path, NAMES)
    torch_pickle.write_skeleton_tree(out, tree, NAMES, layout)
    return out


@pytest.mark.parametrize("release", RELEASES)
def test_the_writer_repeats_what_an_older_torch_wrote(tmp_path, release):
    layout, why_not = pinned_writer_layout(f"{release}+cu121")
    assert why_not is None and layout is TORCH_2_4_LAYOUT
    saved = _saved(release)
    assert len(saved) == 35
    for path, how in saved:
        mine = _rewritten(path, layout, tmp_path)
        if how == "skip_data":
            assert mine.read_bytes() == path.read_bytes(), path.name
        else:
            assert how == "zero-filled" and release == "2.4.1"
            assert mine.stat().st_size == path.stat().st_size, path.name
            assert _without_crcs(mine) == _without_crcs(path), path.name
        other = _rewritten(path, TORCH_2_11_LAYOUT, tmp_path)
        assert other.read_bytes() != mine.read_bytes(), path.name


def test_storage_records_follow_the_text_order_of_their_keys_in_the_older_layout(tmp_path):
    """torch 2.4/2.5 `_save`: `for key in sorted(serialized_storages.keys())`, so data/10 comes
    before data/2; 2.11 and later write them in order of first use."""
    path = SAVES / "2.5.1" / "many_storages.pt"
    with torch_zip.ArchiveReader(str(path)) as archive:
        theirs = [name for name in archive.infos if name.startswith("data/")]
    assert theirs == sorted(theirs) != sorted(theirs, key=lambda name: int(name[5:]))
    with torch_zip.ArchiveReader(str(_rewritten(path, TORCH_2_11_LAYOUT, tmp_path))) as archive:
        newer = [name for name in archive.infos if name.startswith("data/")]
        assert ".format_version" in archive.infos and ".storage_alignment" in archive.infos
    assert newer == sorted(theirs, key=lambda name: int(name[5:]))


def test_files_in_the_older_layout_read_in_the_installed_torch_as_written(tmp_path):
    for path, _ in _saved("2.5.1"):
        mine = _rewritten(path, TORCH_2_4_LAYOUT, tmp_path)
        by_torch = portable(load_structure(mine, classes.safe_globals()))
        assert comparable_tree(by_torch) == comparable_tree(torch_pickle.read_portable(path, NAMES)), path.name


def test_only_releases_with_saved_bytes_get_the_torch_free_writer():
    assert pinned_writer_layout("2.13.0+cpu") == (TORCH_2_11_LAYOUT, None)
    assert pinned_writer_layout("2.11.0+cu130") == (TORCH_2_11_LAYOUT, None)
    assert pinned_writer_layout("2.5.1") == (TORCH_2_4_LAYOUT, None)
    for release in ("2.4.0", "2.6.0", "2.12.1", "2.14.0"):
        layout, why_not = pinned_writer_layout(release)
        assert layout is None and f"torch {release} is installed" in why_not
