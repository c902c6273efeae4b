"""Crafted variants of a real pipeline save are refused by name on every road (issue 36, the read side).

    python -m pytest -q tests/test_pipeline_trust.py        # the shared (pp 2, dp 1) fp32 save; ~25 s after it

Each case copies the session's PipelineModule save (conftest `pipeline_runs("fp32", 2, 1)`: no
training of its own), changes one file as a hostile or careless user might, and runs reshard in
this process (tests/trained.py `reshard_in_process`; tests/test_cli.py proves a real `python -m
reshard` refusal exits 2): exit 2, a message naming the file and the problem, no output, the source
untouched. Before this change each of these exited 0 with wrong output:

- deflated records (Python's zipfile, level 0): a memory-mapped torch.load took the raw bytes as
  tensor data, NaN masters (now torch_archive.load_checked runs check_archive first, everywhere);
- an optimizer tensor one element longer or shorter than its partition: copied whole to every
  target rank, or truncated (now deepspeed_schema's partition checks, shared with the ZeRO road);
- partitions saved as expanded views (stride 0) with `param_shapes` lying to match: a 4 KB file
  made a worker allocate what the pickle claims (now refused as an overlapping view, and the lie
  is seen against the layer files);
- `param_shapes` lying alone, with partitions of the size it claims;
- storage keys swapped between records of different sizes (found by the opcode-level fuzz): the
  mapped load read another tensor's bytes and past a record's end, where a plain torch.load refuses.
"""
from __future__ import annotations

import collections
import hashlib
import shutil
import zipfile
from pathlib import Path

import pytest
import torch

from reshard.formats.deepspeed_files import deepspeed_classes as classes
from reshard.formats.torch_bytes.torch_allowlist import allowed_globals

OPTIM0 = "zero_pp_rank_0_mp_rank_00_optim_states.pt"
STAGE0 = "mp_rank_00_model_states.pt"


def _load(path: Path):
    with allowed_globals(classes.safe_globals()):
        return torch.load(path, map_location="cpu", weights_only=True)


def _save(tree, path: Path) -> None:
    torch.save(tree, path, pickle_module=classes)


def _deflate_records(path: Path) -> None:
    """Re-store every tensor record of `path` deflated at level 0 (sizes nearly unchanged); torch.load
    itself still reads the right values."""
    with zipfile.ZipFile(path) as archive:
        records = [(info.filename, archive.read(info.filename)) for info in archive.infolist()]
    with zipfile.ZipFile(path, "w") as archive:
        for name, content in records:
            info = zipfile.ZipInfo(name)
            info.compress_type = zipfile.ZIP_DEFLATED if "/data/" in name else zipfile.ZIP_STORED
            archive.writestr(info, content, compresslevel=0)


def _group0(tree) -> dict:
    return tree["optimizer_state_dict"]["base_optimizer_state"]["state"][0]


def _edit_optimizer(tag: Path, change) -> None:
    tree = _load(tag / OPTIM0)
    change(tree["optimizer_state_dict"])
    _save(tree, tag / OPTIM0)


def _exp_avg_sq(tag: Path, delta: int) -> None:
    def change(osd):
        state = osd["base_optimizer_state"]["state"][0]
        sq = state["exp_avg_sq"]
        state["exp_avg_sq"] = torch.cat([sq, torch.ones(delta)]) if delta > 0 else sq[:delta].clone()
    _edit_optimizer(tag, change)


def _fp32_longer(tag: Path) -> None:
    _edit_optimizer(tag, lambda osd: osd["single_partition_of_fp32_groups"].__setitem__(
        0, torch.cat([osd["single_partition_of_fp32_groups"][0], torch.ones(1)])))


def _lie_about_param_shapes(tag: Path, numel: int) -> str:
    """Stage 0's param_shapes: its last parameter claimed to be `numel` longer; returns its name."""
    model = _load(tag / STAGE0)
    shapes = model["param_shapes"][0]
    name = list(shapes)[-1]
    shapes[name] = torch.Size([shapes[name].numel() + numel])
    _save(model, tag / STAGE0)
    return name


def _stride_zero(tag: Path) -> str:
    """The issue's 4 KB file: every partition an expanded view of one element, param_shapes to match."""
    claimed = 50_000_000
    name = _lie_about_param_shapes(tag, claimed)

    def change(osd):
        lean = osd["single_partition_of_fp32_groups"][0].numel() + claimed
        osd["single_partition_of_fp32_groups"][0] = torch.ones(1).expand(lean)
        state = osd["base_optimizer_state"]["state"][0]
        for key in ("exp_avg", "exp_avg_sq"):
            state[key] = torch.ones(1).expand(lean + 1)
    _edit_optimizer(tag, change)
    assert (tag / OPTIM0).stat().st_size < 64 * 1024
    return name


def _padded_lie(tag: Path) -> str:
    """param_shapes claims one more element of the last parameter, and the partitions have it: every
    size agrees but the layer file's."""
    name = _lie_about_param_shapes(tag, 1)

    def change(osd):
        osd["single_partition_of_fp32_groups"][0] = torch.cat([osd["single_partition_of_fp32_groups"][0],
                                                               torch.zeros(1)])
        # stage 0's 1913 elements are padded to 1914 (a multiple of 2 * dp): one more fills the padding,
        # so the moments keep their size
        assert osd["group_paddings"] == [1] and _group0({"optimizer_state_dict": osd})["exp_avg"].numel() == 1914
        osd["group_paddings"] = [0]
    _edit_optimizer(tag, change)
    return name


def _keys_swapped_across_sizes(tag: Path) -> None:
    """The storage keys of the step counter (one float) and exp_avg (1914 floats) swapped (data.pkl
    rewritten op by op, tests/reader_fuzz.py): a plain torch.load refuses the size mismatches, a
    mapped one (torch 2.13) takes exp_avg's first element as the step and reads exp_avg from the
    step's 4-byte record on, through the records and headers after it."""
    from reader_fuzz import StructureMutator
    mutator = StructureMutator(tag / OPTIM0, seed=0)
    ops = [list(op) for op in mutator.ops]
    sizes = [ops[ref.numel_at][1] for ref in mutator.refs]
    step, exp_avg = mutator.refs[0], mutator.refs[1]
    assert sizes == [1, 1914, 1914, 1914] and [mutator.string_at(r.key_at) for r in (step, exp_avg)] == ["0", "1"]
    ops[step.key_at], ops[exp_avg.key_at] = ["BINUNICODE", "1"], ["BINUNICODE", "0"]
    mutator.write(tag / OPTIM0, ops)


def _hashes(root: Path) -> dict:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in root.rglob("*") if p.is_file()}


CASES = {
    "deflated-optimizer": (lambda tag: _deflate_records(tag / OPTIM0), OPTIM0, "has compressed record"),
    "deflated-layer-file": (lambda tag: _deflate_records(tag / "layer_03-model_states.pt"), "layer_03-model_states.pt",
                            "has compressed record"),
    "exp-avg-sq-longer": (lambda tag: _exp_avg_sq(tag, 1), OPTIM0,
                          "optimizer state 'exp_avg_sq' of param group 0 has 1915 elements (shape [1915]), but its "
                          "partition has 1914"),
    "exp-avg-sq-shorter": (lambda tag: _exp_avg_sq(tag, -1), OPTIM0,
                           "optimizer state 'exp_avg_sq' of param group 0 has 1913 elements (shape [1913]), but its "
                           "partition has 1914"),
    "fp32-longer": (_fp32_longer, OPTIM0, "single_partition_of_fp32_groups[0] has 1914 elements (shape [1914]), but "
                                          "its partition has 1913"),
    "stride-zero": (_stride_zero, OPTIM0, "holds a view whose elements overlap (shape [50001914], stride [0]"),
    "storage-keys-swapped-across-sizes": (_keys_swapped_across_sizes, OPTIM0, "is not a complete torch archive"),
    "param-shapes-lie": (_padded_lie, STAGE0, "param_shapes says 1.bias has shape [42], but layer_01-model_states.pt "
                                              "holds shape [41] under 'bias'"),
}


@pytest.fixture
def crafted(pipeline_runs, tmp_path, request):
    """(save_dir, the changed file, the expected words) of one case, on a copy of the shared save."""
    save_dir, _ = pipeline_runs("fp32", 2, 1)
    copy = tmp_path / "src"
    shutil.copytree(save_dir, copy)
    tag = copy / (copy / "latest").read_text().strip()
    change, name, words = CASES[request.param]
    change(tag)
    return copy, tag / name, words


@pytest.mark.e2e
@pytest.mark.parametrize("crafted", list(CASES), indirect=True)
def test_a_crafted_pipeline_save_is_refused_by_name_on_every_road(crafted, tmp_path):
    from trained import reshard_in_process
    save_dir, changed, words = crafted
    before = _hashes(save_dir)
    roads = {
        "reshard": ("--target-dp", "2", "--memory-budget", "16M"),
        "array task": ("--target-dp", "2", "--array-task", "0", "--array-tasks", "1"),
        "export": ("--format", "safetensors"),
        "inspect": (),
    }
    for road, flags in roads.items():
        out = tmp_path / road.replace(" ", "-")
        args = {"export": ("export", save_dir, out), "inspect": ("inspect", save_dir)}.get(road, (save_dir, out))
        run = reshard_in_process(*args, *flags)
        assert run.returncode == 2, (road, run.stdout, run.stderr)
        command = {"export": "reshard export", "inspect": "reshard inspect"}.get(road, "reshard")
        assert run.stderr.startswith(f"{command}: error: {changed}: "), (road, run.stderr)
        assert words in run.stderr and "Traceback" not in run.stderr, (road, run.stderr)
        assert not (out / "latest").exists() and not list(out.glob("*.safetensors")), road
    assert _hashes(save_dir) == before  # the source is never modified


@pytest.mark.e2e
def test_a_pipeline_save_read_whole_agrees_with_torch(pipeline_runs):
    """The checked reader changes nothing for a real save: every file the pipeline road loads gives
    torch.load's own values, element for element."""
    from reshard.formats.deepspeed_files.deepspeed_pipeline import load_whole
    save_dir, _ = pipeline_runs("fp32", 2, 1)
    tag = save_dir / (save_dir / "latest").read_text().strip()
    files = sorted(tag.glob("*.pt"))
    assert len(files) == 10
    for path in files:
        ours, theirs = load_whole(str(path)), _load(path)
        pairs = collections.deque([(ours, theirs)])
        while pairs:
            a, b = pairs.popleft()
            if isinstance(b, torch.Tensor):
                assert torch.equal(a, b) and a.dtype == b.dtype and a.shape == b.shape, path
            elif isinstance(b, dict):
                assert list(a) == list(b), path
                pairs.extend((a[k], b[k]) for k in b)
            elif isinstance(b, (list, tuple)):
                assert len(a) == len(b), path
                pairs.extend(zip(a, b))


def test_the_shared_partition_check_refuses_alike_on_both_readers_tensors():
    """deepspeed_schema's check, which the ZeRO road (TensorRefs) and the pipeline road (torch
    tensors) both call: the same verdict for the same layout, whichever reader gave it."""
    from reshard.errors import CheckpointError
    from reshard.formats.deepspeed_files import deepspeed_schema as schema
    from reshard.formats.torch_bytes.torch_archive import TensorRef

    def ref(shape, stride):
        return TensorRef(0, 4 * 64, "float32", shape, stride, 0, False)
    for tensor, (shape, stride) in [(torch.zeros(6), ((6,), (1,))), (torch.zeros(7), ((7,), (1,))),
                                    (torch.zeros(12)[::2], ((6,), (2,))), (torch.zeros(2, 3), ((2, 3), (3, 1)))]:
        assert schema.partition_problem(tensor, 6) == schema.partition_problem(ref(shape, stride), 6)
    assert schema.partition_problem(torch.zeros(6), 6) is None
    assert schema.partition_problem(torch.zeros(12)[::2], 6) == "is not stored contiguously"
    state = {"step": torch.tensor(3.0), "exp_avg": torch.zeros(6), "exp_avg_sq": torch.zeros(7)}
    with pytest.raises(CheckpointError, match=r"f.pt: optimizer state 'exp_avg_sq' of group 0 has 7 elements \(shape "
                                              r"\[7\]\), but its partition has 6"):
        schema.partitioned_state_keys("f.pt", "group 0", state, 6)
    state["exp_avg_sq"] = torch.zeros(6)
    assert schema.partitioned_state_keys("f.pt", "group 0", state, 6) == ["exp_avg", "exp_avg_sq"]
    with pytest.raises(CheckpointError, match="has no optimizer state 'momentum'"):
        schema.partitioned_state_keys("f.pt", "group 0", state, 6, ["exp_avg", "exp_avg_sq", "momentum"])


def test_zero0_moe_states_must_have_their_parameters_shape():
    """The ZeRO-0 MoE road (whole parameters, no partitions) checks each state against its parameter."""
    from reshard.errors import CheckpointError
    from reshard.formats.deepspeed_files.deepspeed_zero0_moe import _check_state_sizes as check  # noqa: PLC2701 (its own unit)
    inner = {"state": {0: {"step": torch.tensor(1.0), "exp_avg": torch.zeros(2, 3), "exp_avg_sq": torch.zeros(2, 3)}},
             "param_groups": [{"params": [0]}]}
    check({"optimizer_state_dict": inner, "fp32_groups": [[torch.zeros(2, 3)]]}, inner, "f.pt")
    inner["state"][0]["exp_avg_sq"] = torch.zeros(7)
    with pytest.raises(CheckpointError, match=r"'exp_avg_sq' of parameter 0 of param group 0 has shape \[7\], but "
                                              r"the parameter's is \[2, 3\]"):
        check({}, inner, "f.pt")
    inner["state"][0]["exp_avg_sq"] = torch.ones(1).expand(2, 3)
    with pytest.raises(CheckpointError, match="not stored contiguously"):
        check({}, inner, "f.pt")
