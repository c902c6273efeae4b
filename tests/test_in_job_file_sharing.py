"""The in-job loads' one way of sharing an in-memory file (reshard.deepspeed.share_file), over real gloo ranks.

    python -m pytest -q tests/test_in_job_file_sharing.py      # one 4-rank torchrun launch, ~20 s on 2 cores

The in-job loads (AutoTP ZeRO-1/2 model states, a pipeline tp change's layer files, ZeRO-0 MoE's expp files
and model states) each build a file on one rank that other ranks' DeepSpeed load reads. Judged on files: each
loader gets the owner's object whole, a rank that does not load it gets nothing, and the owner sends it only to
the loaders other than itself (no broadcast to the whole group). The loads themselves are judged end to end
in tests/test_tensor_parallel.py, test_pipeline_tp_change.py and test_expert_parallel.py (in-job cases).
"""
import json
from pathlib import Path

import pytest

from reshard_proof.launch import run_torchrun

ENTRY = Path(__file__).parent / "entry" / "share_file.py"
CASES = (("model_states", 0, (0, 2)), ("expp_rank_1", 3, (1, 2)), ("model", 1, (0, 1, 2, 3)))
"""(key, owner, loaders): the owner one of its loaders (model states to a TP rank's dp ranks), the owner not
among them (ZeRO-0 MoE: a file written on a rank of another EP rank), every rank a loader (the MoE model states)."""


@pytest.mark.e2e
def test_each_file_reaches_its_loaders_and_no_other_rank(tmp_path):
    ranks = 4
    run_torchrun(ENTRY, ranks, [tmp_path, json.dumps(CASES)], expect_files=[tmp_path / f"rank-{r}.json" for r in range(ranks)],
                 timeout=300)
    records = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(ranks)]
    for key, owner, loaders in CASES:
        for rank, record in enumerate(records):
            got, sent = record[key]["got"], record[key]["sent_to"]
            if rank == owner or rank in loaders:
                assert got == {"rank": owner, "values": [10.0 * owner + i for i in range(6)]}, (key, rank, got)
            else:
                assert got is None, (key, rank, got)
            assert sent == ([r for r in loaders if r != owner] if rank == owner else []), (key, rank, sent)
