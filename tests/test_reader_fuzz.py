"""Differential fuzz: reshard's torch-free reader returns exactly what torch.load returns, or refuses.

    python -m pytest -q tests/test_reader_fuzz.py -m "not e2e"   # 480 mutants of 3 files, ~10 s
    python bench/fuzz_reader.py --mutants 20000                   # many more, with figures

Each mutant is a real torch.save file changed once (tests/reader_fuzz.py: flipped pickle bytes,
integers and opcodes; edited directory, end-record and local-header fields; duplicated,
reordered, dropped, deflated records; other record contents; truncation, padding). For each,
torch_pickle.read_portable must refuse with a CheckpointError naming the file, hand the file to
torch (NeedsTorch), or give torch.load(weights_only=True)'s tree: every tensor's dtype, shape,
stride, storage offset, requires_grad, storage bytes and storage sharing, every scalar and
container. Every mutation kind must also produce some mutants that are read and agree, so the
test cannot pass by refusing everything.
"""
from __future__ import annotations

import collections

import pytest
from reader_fuzz import KINDS, Mutator, base_files, judge

# the checkpoints its tests ask `trained` for, trained with the session's others (conftest.py)
pytestmark = pytest.mark.trains(("z2_fp32", 2))


def test_mutants_of_torch_files_are_read_as_torch_reads_them_or_refused(tmp_path):
    bases = base_files(tmp_path / "bases")
    verdicts: collections.Counter = collections.Counter()
    for number, base in enumerate(bases):
        mutator = Mutator(base, seed=1000 + number)
        for i in range(160):
            kind = KINDS[i % len(KINDS)]
            path, _ = mutator.mutant(tmp_path / "mutant.pt", kind)
            verdict, _ = judge(path)  # AssertionError on any disagreement
            verdicts[kind, verdict] += 1
    assert sum(verdicts.values()) == 480
    read_somewhere = {kind for kind, verdict in verdicts if verdict == "agree"}
    # kinds that leave torch's reading unchanged often: each must be read, not only refused
    assert {"pickle_int", "reorder", "local_header", "directory_field", "content"} <= read_somewhere, verdicts
    refused_somewhere = {kind for kind, verdict in verdicts if verdict == "refused"}
    assert {"compress", "duplicate", "truncate", "pad", "pickle_byte"} <= refused_somewhere, verdicts


@pytest.mark.e2e
def test_mutants_of_a_real_deepspeed_optimizer_file(trained, tmp_path):
    """The same on rank 0's optimizer states of a real 2-rank ZeRO-2 checkpoint (DeepSpeed's own
    classes: the loss scaler, ZeroStageEnum, fragment addresses)."""
    save_dir, _ = trained("z2_fp32", 2)
    optim = save_dir / (save_dir / "latest").read_text().strip() / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    assert judge(optim) == ("agree", "")
    mutator = Mutator(optim, seed=7)
    verdicts: collections.Counter = collections.Counter()
    for i in range(200):
        path, _ = mutator.mutant(tmp_path / "mutant.pt", KINDS[i % len(KINDS)])
        verdicts[judge(path)[0]] += 1
    assert verdicts["agree"] and verdicts["refused"], verdicts
