"""torch.save files read and written without torch: the same trees and the same bytes as torch.

    python -m pytest -q tests/test_torch_free_archive.py -m "not e2e"   # synthetic, a few seconds
    python -m pytest -q tests/test_torch_free_archive.py                # + real DeepSpeed checkpoints

Every check compares reshard.formats.torch_bytes.torch_pickle / torch_zip with torch 2.13 itself: the tree
`read_portable` gives against `portable(load_structure(...))` (a meta load), and the file
`write_skeleton_tree` writes against `torch.save` under `skip_data()` of `materialize(tree)`,
byte for byte, storage offsets included.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections import OrderedDict

import pytest
import torch
from torch_trees import comparable_tree

from reshard.formats.deepspeed_files import deepspeed_classes as classes
from reshard.formats.torch_bytes import torch_pickle, torch_zip
from reshard.formats.torch_bytes.torch_archive import (
    NewTensor,
    load_portable,
    load_structure,
    materialize,
    portable,
    write_skeleton,
    write_tree_skeleton,
)
from reshard.formats.torch_bytes.torch_classes import NeedsTorch, TorchSize

SAFE = classes.safe_globals()


def _same_tree_as_torch(path) -> None:
    by_torch = portable(load_structure(path, SAFE))
    without = torch_pickle.read_portable(path, torch_pickle.globals_by_name(SAFE))
    assert comparable_tree(without) == comparable_tree(by_torch), path


def _same_skeleton_as_torch(tree, tmp_path, name="target.pt") -> None:
    (tmp_path / "torch").mkdir(parents=True, exist_ok=True)
    (tmp_path / "pure").mkdir(exist_ok=True)
    by_torch, pure = tmp_path / "torch" / name, tmp_path / "pure" / name
    obj, roles = materialize(tree)
    expected = write_skeleton(str(by_torch), obj, roles, classes, SAFE)
    assert torch_pickle.write_skeleton_tree(str(pure), tree, torch_pickle.globals_by_name(SAFE)) == expected
    assert pure.read_bytes() == by_torch.read_bytes(), name
    assert torch_pickle.storage_offsets_of(str(pure), tree, torch_pickle.globals_by_name(SAFE)) == expected


def _mixed_object():
    base = torch.arange(24, dtype=torch.float32)
    state = OrderedDict(w=torch.ones(2, 3, dtype=torch.bfloat16), b=torch.zeros(3, dtype=torch.float16))
    state._metadata = {"": {"version": 1}}
    scaler = classes.DynamicLossScaler()
    scaler.__dict__.update(cur_scale=65536.0, dtype=torch.float16, cur_iter=3)
    with_attribute = torch.ones(4)
    with_attribute.ds_id = "1_6"  # ZeRO-3 fp32_flat_groups carry one: pickled by _rebuild_from_type_v2
    return {
        "base": base, "slice": base[2:8], "strided": base.view(4, 6)[:, 1:3], "again": [base, base],
        "scalar": torch.tensor(3.5, dtype=torch.float64), "empty": torch.empty(0, 3), "empty2": torch.empty(0),
        "int64": torch.arange(5), "bool": torch.tensor([True, False]), "int8": torch.zeros(3, dtype=torch.int8),
        "uint8": torch.ones(2, dtype=torch.uint8), "int16": torch.zeros(2, dtype=torch.int16),
        "int32": torch.ones(2, dtype=torch.int32), "complex": torch.zeros(2, dtype=torch.complex64),
        "pk": torch.frombuffer(bytearray(b"PK\x07\x08" + bytes(12)), dtype=torch.uint8),
        "nested": [1, 2.5, -0.0, float("nan"), "x", "0", "1", "", None, True, (1, "s", b"\x00\xff"),
                   {"k": [base, state], 3: ()}],
        "state_dict": state, "shape": torch.Size([4, 6]), "shapes": [torch.Size([]), torch.Size([0, 2])],
        "loss_scaler": scaler, "static": classes.LossScaler(), "zero_stage": classes.ZeroStageEnum(2),
        "fragments": OrderedDict(a=classes.fragment_address(numel=3, start=4)),
        "parameter": torch.nn.Parameter(torch.ones(3)), "leaf": torch.ones(2, requires_grad=True),
        "attribute": with_attribute,
    }


@pytest.mark.parametrize("case", ["mixed", "empty", "list", "scalar", "no_tensors"])
def test_synthetic_files_are_read_and_rewritten_like_torch(tmp_path, case):
    obj = {"mixed": _mixed_object, "empty": dict, "list": lambda: [torch.ones(2), torch.ones(2)[1:]],
           "scalar": lambda: torch.tensor(1.0), "no_tensors": lambda: {"a": [1, "b"], "c": None}}[case]()
    source = tmp_path / "source.pt"
    torch.save(obj, source, pickle_module=classes)
    _same_tree_as_torch(source)
    tree = torch_pickle.read_portable(source, torch_pickle.globals_by_name(SAFE))
    _same_skeleton_as_torch(tree, tmp_path)
    _same_skeleton_as_torch(portable(load_structure(source, SAFE)), tmp_path, "from_torch_tree.pt")
    if case == "mixed":  # stand-ins and the real torch objects they stand for, in one tree
        real = portable(load_structure(source, SAFE))
        tree["mixed"] = [torch.Size([2]), TorchSize((2,)), torch.float16, tree["loss_scaler"].dtype, TorchSize((3,))]
        real["mixed"] = [torch.Size([2]), torch.Size([2]), torch.float16, torch.float16, torch.Size([3])]
        (tmp_path / "real").mkdir()
        obj, roles = materialize(real)
        write_skeleton(str(tmp_path / "real" / "m.pt"), obj, roles, classes, SAFE)
        torch_pickle.write_skeleton_tree(str(tmp_path / "m.pt"), tree, torch_pickle.globals_by_name(SAFE))
        assert (tmp_path / "m.pt").read_bytes() == (tmp_path / "real" / "m.pt").read_bytes()
    if isinstance(tree, dict):  # and with tensors the writer creates: flat, shaped, tied, empty
        tree.update(new=NewTensor(("m", 1), 7, "float32"), tied=NewTensor(("m", 1), 7, "float32"),
                    shaped=NewTensor(("m", 2), 6, "bfloat16", shape=(2, 3)), none=NewTensor(("m", 3), 0, "float32"),
                    grad=NewTensor(("m", 4), 2, "float64", requires_grad=True),
                    zero_dims=NewTensor(("m", 5), 0, "int64", shape=(2, 0, 3)))
        _same_skeleton_as_torch(tree, tmp_path, "with_new.pt")


@pytest.mark.parametrize("count", [0, 1, 6, 7, 40, 122, 251, 535])
def test_zip_container_is_torchs_for_any_record_count(tmp_path, count):
    """The serialization id walks libstdc++'s unordered_set, which rehashes at 13, 29, 59, 127,
    257 and 541 records; normal saves (data, CRCs) and skip_data saves (holes, CRC 0) alike."""
    obj = {f"t{i}": torch.full((i % 4,), float(i)) for i in range(count)}
    obj["pk"] = torch.frombuffer(bytearray(b"PK\x07\x08" + bytes(8)), dtype=torch.uint8)  # counted as a CRC
    for skip in (False, True):
        path = tmp_path / f"{'skip' if skip else 'full'}.pt"
        if skip:
            with torch.serialization.skip_data():
                torch.save(obj, path)
        else:
            torch.save(obj, path)
        with torch_zip.ArchiveReader(str(path)) as archive:
            records = [(name, os.pread(archive.file.fileno(), archive.size(name), archive.offset(name)))
                       for name in archive.infos]
        mine = tmp_path / "mine" / path.name
        mine.parent.mkdir(exist_ok=True)
        writer = torch_zip.ArchiveWriter(str(mine))
        for name, data in records:
            if name in ("version", ".data/serialization_id"):
                continue
            if skip and name.startswith("data/"):
                writer.reserve(name, len(data))
            else:
                writer.add(name, data)
        writer.finish()
        assert mine.read_bytes() == path.read_bytes(), (count, skip)


def test_archive_names_follow_torch(tmp_path):
    for name in ["plain.pt", "two.dots.pt", "noext", "ünï.pt"]:
        path = tmp_path / name
        torch.save({"a": 1}, str(path))
        with torch_zip.ArchiveReader(str(path)) as archive:
            assert archive.prefix == torch_zip.archive_name(str(path)) + "/", name


def test_zip64_sizes_and_offsets_are_torchs(tmp_path):
    """Records of 4 GiB and more, and records after them: zip64 extra fields and descriptors.
    The storages are holes (skip_data), so the files are sparse; only their metadata is compared."""
    tree = {"small": NewTensor(("a",), 10, "float32"), "big": NewTensor(("b",), (1 << 32) + 5, "uint8"),
            "exact": NewTensor(("c",), 0xFFFFFFFF, "uint8"), "below": NewTensor(("d",), 0xFFFFFFFE, "uint8"),
            "after": NewTensor(("e",), 3, "float32")}
    sizes = {("a",): 40, ("b",): (1 << 32) + 5, ("c",): 0xFFFFFFFF, ("d",): 0xFFFFFFFE, ("e",): 12}
    (tmp_path / "t").mkdir()
    (tmp_path / "p").mkdir()
    obj, roles = materialize(tree)
    by_torch, pure = tmp_path / "t" / "f.pt", tmp_path / "p" / "f.pt"
    try:
        expected = write_skeleton(str(by_torch), obj, roles, classes)
        if os.stat(by_torch).st_blocks * 512 > (1 << 30):
            pytest.skip("this file system does not keep holes: a 12 GiB file would be written")
        assert torch_pickle.write_skeleton_tree(str(pure), tree) == expected
        assert os.path.getsize(pure) == os.path.getsize(by_torch) > 3 * (1 << 32)
        position = 0
        with open(by_torch, "rb") as a, open(pure, "rb") as b:
            for start, end in sorted((expected[role], expected[role] + n) for role, n in sizes.items()) + \
                    [(os.path.getsize(pure),) * 2]:
                a.seek(position)
                b.seek(position)
                assert a.read(start - position) == b.read(start - position), position
                position = end
        assert comparable_tree(torch_pickle.read_portable(str(pure))) == comparable_tree(portable(load_structure(pure)))
    finally:
        for path in (by_torch, pure):
            if path.exists():
                path.unlink()


def test_stand_ins_are_written_under_the_names_the_caller_allows(tmp_path):
    """The DeepSpeed stand-ins are a parameter of the torch-byte writer, never its default: with
    the allowlist both writers give DeepSpeed's names, byte for byte; without it neither writes
    reshard's own module name into the file (torch_pickle hands the tree to torch, torch.save
    refuses)."""
    import pickle
    tree = {"zero_stage": classes.ZeroStageEnum.gradients, "mapping": classes.fragment_address(numel=3, start=1),
            "w": NewTensor(("w",), 5, "float32")}
    (tmp_path / "torch").mkdir()
    obj, roles = materialize(tree)
    expected = write_skeleton(str(tmp_path / "torch" / "f.pt"), obj, roles, classes, SAFE)
    assert write_tree_skeleton(str(tmp_path / "f.pt"), tree, SAFE) == expected
    assert (tmp_path / "f.pt").read_bytes() == (tmp_path / "torch" / "f.pt").read_bytes()
    assert b"deepspeed.runtime.zero.config" in (tmp_path / "f.pt").read_bytes()
    with pytest.raises(NeedsTorch, match="allowlist does not name"):
        torch_pickle.write_skeleton_tree(str(tmp_path / "bare.pt"), tree)
    with pytest.raises(pickle.PicklingError, match="reshard.formats.deepspeed_files.deepspeed_classes.ZeroStageEnum"):
        write_tree_skeleton(str(tmp_path / "bare.pt"), tree)


def test_content_outside_the_subset_needs_torch(tmp_path):
    path = tmp_path / "namespace.pt"
    torch.save({"args": argparse.Namespace(lr=0.1), "w": torch.ones(2)}, path)
    with pytest.raises(NeedsTorch, match="argparse.Namespace"):
        torch_pickle.read_portable(path)
    for name, obj, problem in [("bare.pt", {"s": torch.ones(3).untyped_storage()}, "UntypedStorage"),
                               ("typed.pt", {"s": torch.ones(3).storage(), "t": torch.ones(1)}, "outside any tensor"),
                               ("conj.pt", {"c": torch.ones(2, dtype=torch.complex64).conj()}, "metadata")]:
        torch.save(obj, tmp_path / name)
        with pytest.raises(NeedsTorch, match=problem):
            torch_pickle.read_portable(tmp_path / name)
    # torch decides instead: refused under the allowlist, read when trusted
    from reshard.errors import CheckpointError
    with pytest.raises(CheckpointError, match="allowlist"):
        load_portable(path, SAFE)
    assert load_portable(path, SAFE, trust_pickle=True)["args"].lr == 0.1
    from reshard.formats.torch_bytes import torch_archive
    assert (str(path), "NeedsTorch: pickled global argparse.Namespace") in torch_archive.torch_fallbacks
    # a dtype without a legacy storage class: torch writes it
    tree = {"f8": NewTensor(("x",), 4, "float8_e4m3fn")}
    with pytest.raises(NeedsTorch):
        torch_pickle.write_skeleton_tree(str(tmp_path / "f8.pt"), tree)
    assert not (tmp_path / "f8.pt").exists()
    offsets = write_tree_skeleton(str(tmp_path / "f8.pt"), tree)
    assert load_structure(tmp_path / "f8.pt")["f8"].dtype == torch.float8_e4m3fn and ("x",) in offsets
    # a damaged file is judged by torch, with today's message
    broken = tmp_path / "broken.pt"
    broken.write_bytes(path.read_bytes()[:200])
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        load_portable(broken, SAFE)


@pytest.mark.e2e  # a fresh interpreter: this one has imported torch already
def test_modules_do_not_import_torch():
    code = ("import sys; import reshard.formats.torch_bytes.torch_pickle, reshard.formats.torch_bytes.torch_archive; "
            "assert 'torch' not in sys.modules")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


VARIANTS = [("z1_fp16", 2), ("z2_fp32", 2), ("z3_bf16", 3), ("bf16_optimizer", 2), ("moe_z2_fp32", 2)]


@pytest.mark.e2e
@pytest.mark.trains(*VARIANTS)
@pytest.mark.parametrize("variant,n", VARIANTS)
def test_real_checkpoints_are_read_and_rewritten_like_torch(trained, tmp_path, variant, n):
    """Every file of a real save (model and optim states, client_state, MoE expert files) reads
    to torch's tree; every target file reshard writes for it, to 1 and 3 ranks, is torch's skeleton."""
    from reshard.formats.deepspeed_files.deepspeed_inspect import inspect_checkpoint
    from reshard.formats.deepspeed_files.deepspeed_target import target_files
    from reshard.topology import Topology

    save_dir, _ = trained(variant, n)
    tag_dir = save_dir / (save_dir / "latest").read_text()
    files = sorted(tag_dir.glob("*.pt"))
    assert files
    for path in files:
        _same_tree_as_torch(path)
    from reshard.formats.torch_bytes.torch_archive import torch_fallbacks
    before = len(torch_fallbacks)
    source = inspect_checkpoint(save_dir)
    assert torch_fallbacks[before:] == []  # inspection read every file without torch
    for m in (1, 3):
        for rank in range(m):
            for target in target_files(source, Topology(dp=m), rank):
                _same_skeleton_as_torch(target.tree, tmp_path / f"m{m}", target.name)


@pytest.mark.e2e
def test_tensor_parallel_checkpoint_is_read_and_rewritten_like_torch(autotp_trained, tmp_path):
    """AutoTP files (universal_checkpoint_info, per-TP-rank model and optim states), to TP 1 and
    to TP 2 at two DP ranks. The source is the session's ZeRO-1 bf16 tp 2 dp 1 checkpoint, the one
    tests/test_tensor_parallel.py reshards too."""
    from reshard.formats.deepspeed_files.deepspeed_inspect import inspect_checkpoint
    from reshard.formats.deepspeed_files.deepspeed_target import target_files
    from reshard.topology import Topology

    save_dir, _ = autotp_trained(2, 1, 1, "bf16")
    tag_dir = save_dir / (save_dir / "latest").read_text()
    for path in sorted(tag_dir.glob("*.pt")):
        _same_tree_as_torch(path)
    from reshard.formats.torch_bytes.torch_archive import torch_fallbacks
    before = len(torch_fallbacks)
    source = inspect_checkpoint(save_dir)
    assert torch_fallbacks[before:] == []
    for topology in (Topology(dp=2, tp=1), Topology(dp=2, tp=2)):
        for rank in range(topology.dp * topology.tp):
            for target in target_files(source, topology, rank):
                _same_skeleton_as_torch(target.tree, tmp_path / f"dp{topology.dp}tp{topology.tp}", target.name)
