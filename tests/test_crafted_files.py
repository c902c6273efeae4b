"""Crafted torch files (issue 22's probes): reshard's reader agrees with torch.load or refuses by name.

    python -m pytest -q tests/test_crafted_files.py -m "not e2e"   # in-process, a few seconds
    python -m pytest -q tests/test_crafted_files.py                # + the CLI on a real 2-rank checkpoint

Each probe is a small real torch.save file changed the way issue 22 found reshard reading
otherwise than torch: compressed records, two data.pkl records, a view past its storage, sizes
beyond the file, a zip bomb, a "billion laughs" pickle, 100,000 nested lists, a big-endian file.
Both of reshard's ways of reading (torch_pickle.read_portable without torch, load_structure
with it) must refuse each with a CheckpointError naming the file, before allocating more than
the file holds; the CLI exits 2 with that message.
"""
from __future__ import annotations

import os
import pickletools
import shutil
import signal
import struct
import tracemalloc
import zlib
from collections import OrderedDict

import pytest
import torch
from reader_fuzz import GLOBALS, SAFE, raw_zip, records_of, zip_bytes

from reshard.errors import CheckpointError
from reshard.formats.torch_bytes import torch_archive, torch_pickle
from reshard.formats.deepspeed_files.deepspeed_inspect import read_storages
from reshard.formats.torch_bytes.torch_archive import load_portable, load_structure, refs_in
from reshard.formats.torch_bytes.torch_zip import ArchiveWriter

# the checkpoints its tests ask `trained` for, trained with the session's others (conftest.py)
pytestmark = pytest.mark.trains(("z2_fp32", 2))


def _optim_like(tmp_path, name="optim.pt"):
    """A small file shaped like a DeepSpeed optimizer state (flat fp32 buffers, scalars)."""
    path = tmp_path / name
    torch.save({"fp32_flat_groups": [torch.arange(40, dtype=torch.float32)],
                "state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.linspace(0, 1, 40)}},
                "clip_grad": 1.0, "cur_scale": 65536.0}, path)
    return path


def _refused_both_ways(path, *fragments, archive_level: bool = True) -> str:
    """The torch-free reader, the torch path, and the check before reshard's own torch.load calls
    (mmap loads of whole files; `archive_level` problems only, the pickle is torch's there)
    all refuse `path`, naming it and each fragment."""
    before = list(torch_archive.torch_fallbacks)
    messages = []
    reads = [lambda: torch_pickle.read_portable(path, GLOBALS), lambda: load_structure(path, SAFE),
             lambda: load_portable(path, SAFE)]
    for read in reads + ([lambda: torch_archive.check_archive(path)] if archive_level else []):
        with pytest.raises(CheckpointError) as refused:
            read()
        message = str(refused.value)
        assert message.startswith(str(path)), message
        for fragment in fragments:
            assert fragment in message, (fragment, message)
        messages.append(message)
    assert torch_archive.torch_fallbacks == before  # refused, not handed to torch
    return messages[0]


def _torch_layout(path, prefix: str, records: list[tuple[str, bytes]]) -> None:
    """An archive laid out as torch.save lays one out, with these records (names without prefix)."""
    writer = ArchiveWriter(str(path), prefix=prefix.rstrip("/"))
    for name, content in records:
        if name not in ("version", ".data/serialization_id"):
            writer.add(name, content)
    writer.finish()


# -- 1. compressed records --------------------------------------------------------------------------

@pytest.mark.parametrize("which", ["storages", "every record"])
def test_compressed_records_are_refused_by_name(tmp_path, which):
    """torch reads deflated records correctly; reshard reads stored records only and refuses the
    rest by name (it used to read the deflated bytes as raw data)."""
    source = _optim_like(tmp_path)
    prefix, records = records_of(source)
    chosen = {i for i, (name, _) in enumerate(records) if which == "every record" or name.startswith("data/")}
    crafted = tmp_path / "deflated.pt"
    crafted.write_bytes(zip_bytes([(prefix + name, content) for name, content in records], chosen))
    expected = torch.load(source, weights_only=True)
    assert torch.equal(torch.load(crafted, weights_only=True)["state"][0]["exp_avg"], expected["state"][0]["exp_avg"])
    _refused_both_ways(crafted, "compressed record")


# -- 2. duplicate record names ----------------------------------------------------------------------

@pytest.mark.parametrize("duplicate", ["data.pkl", "data/0"])
def test_duplicate_records_are_refused(tmp_path, duplicate):
    """torch reads one of two records of one name (which one, miniz's binary search over sorted
    names decides: here the last); reshard used to read the last, whatever torch read."""
    prefix, records = records_of(_optim_like(tmp_path))
    replacement = dict(records)[duplicate]
    if duplicate == "data.pkl":
        replacement = replacement.replace(struct.pack(">d", 1.0), struct.pack(">d", 5.0))  # clip_grad 5.0
    else:
        replacement = replacement[::-1]
    entries = [(prefix + name, content) for name, content in records] + [(prefix + duplicate, replacement)]
    crafted = tmp_path / "twice.pt"
    crafted.write_bytes(zip_bytes(entries))
    torch.load(crafted, weights_only=True)  # torch reads it
    _refused_both_ways(crafted, "two records named")


def test_records_differing_only_in_case_are_duplicates(tmp_path):
    """miniz finds records regardless of case: DATA.PKL and data.pkl are one name to torch."""
    prefix, records = records_of(_optim_like(tmp_path))
    entries = [(prefix + name, content) for name, content in records] + [(prefix + "DATA.PKL", records[0][1])]
    crafted = tmp_path / "case.pt"
    crafted.write_bytes(zip_bytes(entries))
    _refused_both_ways(crafted, "two records named")


# -- 3. views, storages and records out of bounds ---------------------------------------------------

def _patched_first_storage_offset(path, out, value: int) -> None:
    """`path` with the storage offset of its first tensor (the int after the first BINPERSID) set to `value`."""
    prefix, records = records_of(path)
    pickled = records[0][1]
    ops = list(pickletools.genops(pickled))
    index = next(i for i, (op, _, _) in enumerate(ops) if op.name == "BINPERSID") + 1
    op, _, position = ops[index]
    assert op.name == "BININT1", op.name
    patched = pickled[:position] + b"J" + struct.pack("<i", value) + pickled[position + 2:]
    _torch_layout(out, prefix, [("data.pkl", patched)] + records[1:])


def test_a_view_past_its_storage_is_refused(tmp_path):
    source = tmp_path / "view.pt"
    base = torch.arange(8, dtype=torch.float32)
    torch.save({"slice": base[2:], "other": torch.ones(3)}, source)
    crafted = tmp_path / "past.pt"
    _patched_first_storage_offset(source, crafted, 5)  # 6 elements from 5: past the 8 of the storage
    with pytest.raises(RuntimeError, match="storage"):  # torch refuses it too
        torch.load(crafted, weights_only=True)
    message = _refused_both_ways(crafted, "a view past its storage", archive_level=False)
    assert "offset 5, shape [6], stride [1] end at byte 44 of a storage of 32 bytes" in message


def test_overlapping_records_are_refused(tmp_path):
    """A record whose declared size runs into the next record's header."""
    prefix, records = records_of(_optim_like(tmp_path))
    entries = []
    for name, content in records:
        declared = len(content) + 100 if name == "data/0" else len(content)
        entries.append((prefix + name, content, 0, declared, zlib.crc32(content)))
    crafted = tmp_path / "overlap.pt"
    crafted.write_bytes(raw_zip(entries))
    _refused_both_ways(crafted, "data/0")


# -- 4. sizes beyond the file, zip bombs: refused before anything is allocated ----------------------

def _peak_while(action) -> tuple[int, CheckpointError | None]:
    """The most memory Python allocated while `action` ran, and the refusal it raised, if any."""
    tracemalloc.start()
    try:
        action()
        refusal = None
    except CheckpointError as error:
        refusal = error
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak, refusal


@pytest.mark.parametrize("declared", [1 << 28, 1 << 32])
def test_a_size_beyond_the_file_is_refused_before_allocating(tmp_path, declared):
    """A record and its persistent id that declare `declared` bytes in a file of a few KB: reshard
    used to allocate them (`read_storages`: bytearray(nbytes)) before finding the file short."""
    source = tmp_path / "small.pt"
    numel = 70000
    torch.save({"w": torch.zeros(numel, dtype=torch.float32)}, source)  # numel pickled as BININT
    prefix, records = records_of(source)
    pickled = records[0][1]
    position = next(pos for op, arg, pos in pickletools.genops(pickled) if op.name == "BININT" and arg == numel)
    pickled = pickled[:position + 1] + struct.pack("<i", declared // 4) + pickled[position + 5:]  # the storage's numel
    entries = [(prefix + "data.pkl", pickled, 0, len(pickled), zlib.crc32(pickled))]
    entries += [(prefix + name, content[:64] if name == "data/0" else content, 0,
                 declared if name == "data/0" else len(content), zlib.crc32(content)) for name, content in records[1:]]
    crafted = tmp_path / "lie.pt"
    crafted.write_bytes(raw_zip(entries))
    assert os.path.getsize(crafted) < 8192

    def read():
        tree = torch_pickle.read_portable(crafted, GLOBALS)
        read_storages(str(crafted), refs_in(tree))
    peak, refusal = _peak_while(read)
    assert peak < 16 << 20, f"{peak:,} bytes allocated for a file of {os.path.getsize(crafted):,}"
    assert refusal is not None and str(refusal).startswith(str(crafted)) and "beyond" in str(refusal), refusal
    peak, refusal = _peak_while(lambda: load_structure(crafted, SAFE))
    assert peak < 16 << 20 and refusal is not None and "beyond" in str(refusal)


def test_a_zip_bomb_is_not_expanded(tmp_path):
    """data.pkl deflated from 64 MiB to about 64 KB: refused as compressed, never inflated."""
    size = 64 << 20
    header, tail = b"\x80\x02X" + struct.pack("<I", size), b"."
    squeeze, crc, parts = zlib.compressobj(9, zlib.DEFLATED, -15), zlib.crc32(header), []
    parts.append(squeeze.compress(header))
    chunk = b"a" * (1 << 20)
    for _ in range(size >> 20):
        parts.append(squeeze.compress(chunk))
        crc = zlib.crc32(chunk, crc)
    parts.append(squeeze.compress(tail) + squeeze.flush())
    crc = zlib.crc32(tail, crc)
    bomb = b"".join(parts)
    assert len(bomb) < 1 << 20
    crafted = tmp_path / "bomb.pt"
    crafted.write_bytes(raw_zip([("bomb/data.pkl", bomb, 8, size + len(header) + 1, crc),
                                 ("bomb/byteorder", b"little", 0, 6, zlib.crc32(b"little")),
                                 ("bomb/version", b"3\n", 0, 2, zlib.crc32(b"3\n"))]))
    messages = []
    peak, _ = _peak_while(lambda: messages.append(_refused_both_ways(crafted, "compressed record 'bomb/data.pkl'")))
    assert messages and peak < 16 << 20


# -- 5. pickles that expand or nest without end; byte order -----------------------------------------

def _pickle_file(tmp_path, name: str, pickled: bytes):
    path = tmp_path / name
    _torch_layout(path, "archive", [("data.pkl", pickled), ("byteorder", b"little")])
    return path


def _billion_laughs(levels: int = 60) -> bytes:
    """About 120 bytes: ((x, x), (x, x)) ... 60 deep over one shared tuple, 2^60 leaves."""
    out = b"\x80\x02N\x85q\x00"
    for level in range(levels):
        out += b"h" + bytes([level]) + b"h" + bytes([level]) + b"\x86q" + bytes([level + 1])
    return out + b"."


def test_a_billion_laughs_pickle_is_refused(tmp_path):
    path = _pickle_file(tmp_path, "laughs.pt", _billion_laughs())
    assert os.path.getsize(path) < 2048
    assert isinstance(torch.load(path, weights_only=True), tuple)  # torch builds it: shared, small
    _refused_both_ways(path, "expands to more than", "billion laughs", archive_level=False)


def test_deeply_nested_lists_are_refused_without_a_traceback(tmp_path):
    path = _pickle_file(tmp_path, "nested.pt", b"\x80\x02" + b"]" * 100_000 + b"a" * 99_999 + b".")
    _refused_both_ways(path, "nests containers more than 100 deep", archive_level=False)


def test_a_list_that_contains_itself_is_refused(tmp_path):
    path = _pickle_file(tmp_path, "cycle.pt", b"\x80\x02]q\x00h\x00a.")
    _refused_both_ways(path, "contains itself", archive_level=False)


def test_verify_compares_shared_trees_once(tmp_path):
    """verify's comparison walks each pair of shared objects once, without recursion."""
    from reshard.verify import _first_difference, _same

    def laughs(leaf):
        tree = (leaf,)
        for _ in range(60):
            tree = (tree, tree)
        return tree

    def expire(*_):
        raise TimeoutError("verify's comparison did not finish")
    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(10)
    try:
        assert _same(laughs(1.0), laughs(1.0)) and not _same(laughs(1.0), laughs(2.0))
        deep_a, deep_b = [], []
        for _ in range(50_000):
            deep_a, deep_b = [deep_a], [deep_b]
        assert _same(deep_a, deep_b)
        assert _first_difference({"a": laughs(1.0)}, {"a": laughs(2.0)}).startswith("['a'][0]")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def test_a_big_endian_file_is_refused_before_torch_sees_it(tmp_path):
    """torch byteswaps big-endian storages, and crashes (SIGSEGV) doing so on the meta device."""
    prefix, records = records_of(_optim_like(tmp_path))
    crafted = tmp_path / "big.pt"
    _torch_layout(crafted, prefix, [(name, b"big" if name == "byteorder" else content) for name, content in records])
    _refused_both_ways(crafted, "big-endian")


# -- the torch-free writer runs for pinned torch versions only --------------------------------------

@pytest.mark.parametrize("version,pinned", [("2.13.0+cpu", True), ("2.13.1", True), ("2.14.1", True),
                                            ("2.11.0+cu130", True), ("2.4.1+cu121", True), ("2.5.1", True),
                                            ("2.11.1", False), ("2.14.0", False), ("2.15.0", False),
                                            ("2.6.0", False), ("2.5.0", False)])
def test_the_torch_free_writer_runs_only_for_pinned_torch_versions(tmp_path, monkeypatch, version, pinned):
    from reshard.formats.torch_bytes.torch_archive import NewTensor, write_tree_skeleton

    monkeypatch.setattr(torch_archive, "installed_torch_version", lambda: version)
    tree = OrderedDict(w=NewTensor(("w",), 6, "float32"), step=3)
    before = len(torch_archive.torch_fallbacks)
    offsets = write_tree_skeleton(str(tmp_path / "out.pt"), tree, SAFE)
    fallbacks = torch_archive.torch_fallbacks[before:]
    if pinned:
        assert fallbacks == []
    else:
        why = (f"torch {version} is installed; the torch-free writer's bytes are pinned for torch 2.4.1, 2.5.1, "
               "2.11.0, 2.13.x, 2.14.1 only, so torch writes this file")
        assert fallbacks == [(str(tmp_path / "out.pt"), why)]
    assert set(offsets) == {("w",)} and torch.load(tmp_path / "out.pt", weights_only=True)["step"] == 3


# -- the CLI on a real checkpoint -------------------------------------------------------------------

@pytest.fixture
def real_source(trained, tmp_path):
    original, _ = trained("z2_fp32", 2)
    copy = tmp_path / "src"
    shutil.copytree(original, copy)
    tag = (copy / "latest").read_text().strip()
    return copy, copy / tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt"


@pytest.mark.e2e
@pytest.mark.parametrize("case", ["compressed", "view-past-storage"])
def test_the_cli_refuses_crafted_real_files(real_source, tmp_path, case):
    from trained import reshard_in_process

    save_dir, optim0 = real_source
    prefix, records = records_of(optim0)
    if case == "compressed":
        chosen = {i for i, (name, _) in enumerate(records) if name.startswith("data/")}
        optim0.write_bytes(zip_bytes([(prefix + name, content) for name, content in records], chosen))
        expected = "compressed record"
    else:
        patched = tmp_path / "patched.pt"
        _patched_first_storage_offset(optim0, patched, 1 << 20)
        shutil.copy(patched, optim0)
        expected = "a view past its storage: offset 1048576"
    done = reshard_in_process(save_dir, tmp_path / "dst", "--target-dp", "3")  # the message, not the launcher
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.startswith(f"reshard: error: {optim0}: "), done.stderr
    assert expected in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert not (tmp_path / "dst" / "latest").exists()
