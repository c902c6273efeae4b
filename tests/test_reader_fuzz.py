"""Differential fuzz: reshard's readers return exactly what torch.load returns, or refuse.

    python -m pytest -q tests/test_reader_fuzz.py -m "not e2e"   # 672 mutants of 8 files, both readers, ~12 s
    python bench/fuzz_reader.py --mutants 20000                   # many more, with figures per file kind

Each mutant is a real torch.save file changed once (tests/reader_fuzz.py): byte-level mutants
(flipped pickle bytes, integers and opcodes; edited directory, end-record and local-header fields;
duplicated, reordered, dropped, deflated records; other record contents; truncation, padding) and
structure-aware ones (data.pkl rewritten op by op with pickletools: storage keys swapped or aliased,
storage dtypes, sizes and offsets, shapes and strides, memo references, repeated dictionary keys).
The files are of every kind a road reads: the ZeRO kinds, and a pipeline layer file, stage
model-states file and stage optimizer file, a model-axis layer file, a native MoE expert file (the
e2e tests take real ones). Two readers are judged on each: the torch-free one
(torch_pickle.read_portable: refuse with a CheckpointError naming the file, hand the file to torch,
or give torch.load(weights_only=True)'s tree: every tensor's dtype, shape, stride, storage offset,
requires_grad, storage bytes and storage sharing, every scalar and container), and the memory-mapped
load of the whole-file roads (torch_archive.load_checked: refuse, or give a plain torch.load's tree).
Every mutation kind must also produce some mutants that are read and agree, so the test cannot pass
by refusing everything.
"""
from __future__ import annotations

import collections

import pytest
from reader_fuzz import KINDS, STRUCTURE_KINDS, Mutator, StructureMutator, base_files, judge, judge_mapped

# the checkpoints its tests ask `trained` for, trained with the session's others (conftest.py)
pytestmark = pytest.mark.trains(("z2_fp32", 2), ("moe_z2_fp32", 2, 2))


def _both(path) -> tuple[str, str]:
    """(the torch-free reader's verdict, the mapped load's); AssertionError on a disagreement."""
    return judge(path)[0], judge_mapped(path)[0]


def test_mutants_of_torch_files_are_read_as_torch_reads_them_or_refused(tmp_path):
    bases = base_files(tmp_path / "bases")
    assert len(bases) == 8
    verdicts: collections.Counter = collections.Counter()
    for number, base in enumerate(bases):
        mutator = Mutator(base, seed=1000 + number)
        for i in range(60):
            kind = KINDS[i % len(KINDS)]
            path, _ = mutator.mutant(tmp_path / "mutant.pt", kind)
            ours, mapped = _both(path)  # AssertionError on any disagreement
            verdicts[kind, ours] += 1
            verdicts[kind, "mapped " + mapped] += 1
    assert sum(n for (_, v), n in verdicts.items() if not v.startswith("mapped")) == 480
    read_somewhere = {kind for kind, verdict in verdicts if verdict == "agree"}
    # kinds that leave torch's reading unchanged often: each must be read, not only refused
    assert {"pickle_int", "reorder", "local_header", "directory_field", "content"} <= read_somewhere, verdicts
    assert {"pickle_int", "local_header", "directory_field", "content"} <= \
        {kind for kind, verdict in verdicts if verdict == "mapped agree"}, verdicts
    refused_somewhere = {kind for kind, verdict in verdicts if verdict == "refused"}
    assert {"compress", "duplicate", "truncate", "pad", "pickle_byte"} <= refused_somewhere, verdicts
    assert {"compress", "duplicate", "truncate", "pad"} <= \
        {kind for kind, verdict in verdicts if verdict == "mapped refused"}, verdicts


def test_structure_aware_mutants_are_read_as_torch_reads_them_or_refused(tmp_path):
    """data.pkl rewritten at the opcode level: keys, dtypes, sizes, offsets, shapes, strides (stride 0,
    overlap), memo reuse, repeated keys; both readers agree with torch.load or refuse."""
    verdicts: collections.Counter = collections.Counter()
    for number, base in enumerate(base_files(tmp_path / "bases")):
        mutator = StructureMutator(base, seed=2000 + number)
        for i in range(24):
            kind = STRUCTURE_KINDS[i % len(STRUCTURE_KINDS)]
            path, _ = mutator.mutant(tmp_path / "mutant.pt", kind)
            ours, mapped = _both(path)
            verdicts[kind, ours] += 1
            verdicts[kind, "mapped " + mapped] += 1
    assert sum(verdicts.values()) == 2 * 8 * 24
    for reader in ("", "mapped "):
        assert {k for k, v in verdicts if v == reader + "agree"} == set(STRUCTURE_KINDS), verdicts
        # every kind that can break a tensor is refused somewhere (memo and key mutants may stay valid)
        assert {"op_numel", "op_offset", "op_shape", "op_stride"} <= \
            {k for k, v in verdicts if v == reader + "refused" or (not reader and v == "torch")}, verdicts


@pytest.mark.e2e
def test_mutants_of_a_real_deepspeed_optimizer_file(trained, tmp_path):
    """The same on rank 0's optimizer states of a real 2-rank ZeRO-2 checkpoint (DeepSpeed's own
    classes: the loss scaler, ZeroStageEnum, fragment addresses)."""
    save_dir, _ = trained("z2_fp32", 2)
    optim = save_dir / (save_dir / "latest").read_text().strip() / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    assert judge(optim) == ("agree", "") and judge_mapped(optim) == ("agree", "")
    mutator = Mutator(optim, seed=7)
    verdicts: collections.Counter = collections.Counter()
    for i in range(200):
        path, _ = mutator.mutant(tmp_path / "mutant.pt", KINDS[i % len(KINDS)])
        verdicts.update(_both(path))
    assert verdicts["agree"] and verdicts["refused"], verdicts


def real_files_of_every_kind(pipeline_runs, trained) -> dict[str, object]:
    """{kind: path} of real files of each kind the whole-file roads read: a pipeline save's stage
    model-states file, optimizer file and layer file (the shared (pp 2, dp 1) save), a model-axis
    save's layer and stage files (`fp32-mp2`, tests/test_pipeline_model_axis.py's), and a native MoE
    expert file (`moe_z2_fp32`, tests/test_expert_parallel.py's)."""
    def tag_of(save):
        return save / (save / "latest").read_text().strip()
    pipeline = tag_of(pipeline_runs("fp32", 2, 1)[0])
    axis = tag_of(pipeline_runs("fp32-mp2", 2, 1)[0])
    moe = tag_of(trained("moe_z2_fp32", 2, 2)[0])
    return {"pipeline stage": pipeline / "mp_rank_01_model_states.pt",
            "pipeline optimizer": pipeline / "zero_pp_rank_0_mp_rank_01_optim_states.pt",
            "pipeline layer": pipeline / "layer_03-model_states.pt",
            "model-axis layer": axis / "layer_01-model_01-model_states.pt",
            "model-axis stage": axis / "mp_rank_03_model_states.pt",
            "moe expert": sorted(moe.glob("layer_*_expert_*_mp_rank_00_model_states.pt"))[-1]}


@pytest.mark.e2e
def test_mutants_of_real_pipeline_model_axis_and_moe_files(pipeline_runs, trained, tmp_path):
    """Byte and structure mutants of a real file of every kind the whole-file roads read, both readers."""
    verdicts: collections.Counter = collections.Counter()
    for number, (kind, path) in enumerate(real_files_of_every_kind(pipeline_runs, trained).items()):
        assert _both(path) == ("agree", "agree"), kind
        byte, structure = Mutator(path, seed=30 + number), StructureMutator(path, seed=40 + number)
        for i in range(26):
            mutant, _ = byte.mutant(tmp_path / "mutant.pt", KINDS[i % len(KINDS)])
            verdicts.update((kind, v) for v in _both(mutant))
            mutant, _ = structure.mutant(tmp_path / "mutant.pt", STRUCTURE_KINDS[i % len(STRUCTURE_KINDS)])
            verdicts.update((kind, v) for v in _both(mutant))
    for kind in ("pipeline stage", "pipeline optimizer", "pipeline layer", "model-axis layer", "moe expert"):
        assert verdicts[kind, "agree"] and verdicts[kind, "refused"], verdicts
