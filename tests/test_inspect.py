"""`python -m reshard inspect`: every checkpoint kind the suite trains, described without reading tensors.

    python -m pytest tests/test_inspect.py -q

Facts are compared with the truth the training engine recorded (stage, optimizer class, dtype,
per-group hyperparameters, frozen parameters, tied weights, buffers, counters, client_state);
`--json` is checked against the documented schema; damaged checkpoints exit 2 naming the file.
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from test_e2e_reshard import MATRIX
from trained import reshard_cli

from reshard import cli
from reshard.inspect_report import SCHEMA, inspect_report

pytestmark = pytest.mark.e2e

# Every (variant, N) the end-to-end matrix trains: in a full run these are already cached.
KINDS = sorted({(variant, n) for variant, n, _, _ in MATRIX})

PRECISION_DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}

SCHEMA_TYPES = {
    "schema": str, "save_dir": str, "tag": str, "latest": str, "latest_universal": (str, type(None)), "tags": list,
    "files": dict, "total_bytes": int, "topology": dict, "precision": dict, "optimizer": dict, "groups": list,
    "frozen": dict, "tied": dict, "buffers": list, "counters": dict, "client_state_keys": list, "targets": dict,
    "problems": list,
}


def _check_schema(doc: dict) -> None:
    assert set(doc) == set(SCHEMA_TYPES), set(doc) ^ set(SCHEMA_TYPES)
    for key, kind in SCHEMA_TYPES.items():
        assert isinstance(doc[key], kind), (key, doc[key])
    assert doc["schema"] == SCHEMA
    assert set(doc["topology"]) == {"stage", "dp", "tp", "ep", "pp", "sp"}
    assert set(doc["precision"]) == {"module_dtype", "master_dtype", "bf16_file_prefix"}
    assert set(doc["optimizer"]) == {"zero_optimizer", "base_optimizer", "state_keys", "scalar_state_keys"}
    for group in doc["groups"]:
        assert set(group) == {"index", "params", "elements", "hyperparameters"}
    assert set(doc["frozen"]) == {"stored", "params"}
    assert set(doc["targets"]) == {"reshard_dp", "batch_config", "export_formats", "notes"}
    assert all(isinstance(v, int) and v > 0 for v in doc["files"].values())
    assert doc["total_bytes"] == sum(doc["files"].values())


@pytest.mark.parametrize("variant,n", [pytest.param(*kind, id=f"{kind[0]}-n{kind[1]}", marks=pytest.mark.trains(kind))
                                       for kind in KINDS])
def test_inspect_describes_every_kind(trained, variant, n, capsys):
    source, truth_path = trained(variant, n)
    truth = torch.load(truth_path, weights_only=True)
    meta, engine = truth["meta"], truth["engine"]

    assert cli.main(["inspect", str(source), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    _check_schema(doc)
    assert doc["problems"] == [] and doc["tag"] == meta["tag"] == doc["latest"] and doc["tags"] == [meta["tag"]]
    assert doc["topology"] == {"stage": meta["zero_stage"], "dp": n, "tp": 1, "ep": 1, "pp": 1, "sp": 1}
    assert doc["optimizer"]["zero_optimizer"] == meta["optimizer_class"]
    assert doc["precision"]["module_dtype"] == PRECISION_DTYPES[meta["precision"]]
    assert doc["precision"]["master_dtype"] == "float32"
    state_keys = {key for entry in engine["master"].values() for key in entry["state"]}
    assert set(doc["optimizer"]["state_keys"]) == state_keys
    assert len(doc["groups"]) == len(engine["param_groups"])
    for group, expected in zip(doc["groups"], engine["param_groups"]):
        assert group["hyperparameters"]["lr"] == expected["lr"]
        assert group["hyperparameters"]["weight_decay"] == expected["weight_decay"]
    assert sum(g["elements"] for g in doc["groups"]) == sum(e["fp32"].numel() for e in engine["master"].values())
    frozen = {p["name"]: tuple(p["shape"]) for p in doc["frozen"]["params"]}
    excluded = meta["exclude_frozen_parameters"]
    if not excluded:
        assert frozen == {name: tuple(t.shape) for name, t in engine["frozen"].items()}
    else:
        assert frozen == {} and "excluded" in doc["frozen"]["stored"]
    assert doc["tied"] == engine["tied"]
    assert doc["buffers"] == list(engine["buffers"])
    assert doc["counters"] == engine["counters"]
    assert doc["client_state_keys"] == list(truth["client_state"])
    assert doc["targets"]["reshard_dp"] == "any"

    assert cli.main(["inspect", str(source)]) == 0
    text = capsys.readouterr().out
    assert f"ZeRO-{meta['zero_stage']}, dp {n}" in text and "no problems found" in text


@pytest.mark.trains(("z3_bf16", 2))
def test_inspect_reads_no_tensor_bytes(trained, monkeypatch):
    """Only pickles and the step counters of the optimizer files (a few bytes each) are read."""
    source, _ = trained("z3_bf16", 2)
    import reshard.formats.deepspeed_files.deepspeed_inspect as inspect_module
    read = []
    original = inspect_module.pread_exact

    def counting(fd, view, offset, path):
        read.append(len(view))
        return original(fd, view, offset, path)
    monkeypatch.setattr(inspect_module, "pread_exact", counting)
    report = inspect_report(source)
    assert report.ok, report.problems
    assert read and max(read) <= 8, read  # step counters only


@pytest.mark.trains(("z2_fp32", 2))
def test_inspect_fixed_batch_lists_sizes(trained, tmp_path):
    original, _ = trained("z2_fp32", 2)
    copy = tmp_path / "src"
    shutil.copytree(original, copy)
    tag_dir = copy / (copy / "latest").read_text()
    model = tag_dir / "mp_rank_00_model_states.pt"
    state = torch.load(model, weights_only=False)
    state["ds_config"]["train_batch_size"] = 12  # micro batch 2 x some accumulation steps x dp
    del state["ds_config"]["gradient_accumulation_steps"]
    torch.save(state, model)
    report = inspect_report(copy)
    assert report.ok, report.problems
    assert report.targets["reshard_dp"] == [1, 2, 3, 6]
    assert "train_batch_size 12" in report.targets["batch_config"]


@pytest.mark.trains(("z2_fp32", 2), ("z2_fp32", 4))
def test_damaged_checkpoint_is_reported_with_exit_2(trained, tmp_path):
    original, _ = trained("z2_fp32", 2)
    other, _ = trained("z2_fp32", 4)
    copy = tmp_path / "src"
    shutil.copytree(original, copy)
    tag = (copy / "latest").read_text()
    # rank 1's optimizer file taken from a 4-rank save of the same model
    shutil.copy(other / tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt",
                copy / tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    result = reshard_cli("inspect", copy, "--json")
    assert result.returncode == 2, result.stdout + result.stderr
    doc = json.loads(result.stdout)
    _check_schema(doc)
    assert len(doc["problems"]) == 1
    assert "zero_pp_rank_1_mp_rank_00_optim_states.pt" in doc["problems"][0]
    assert "partition_count" in doc["problems"][0]

    # a missing rank file: the report still lists what it could read
    (copy / tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    result = reshard_cli("inspect", copy)
    assert result.returncode == 2
    assert "PROBLEM:" in result.stdout and "zero_pp_rank_1_mp_rank_00_optim_states.pt: is missing" in result.stdout

    # no latest and no --tag
    (copy / "latest").unlink()
    doc_missing = inspect_report(copy)
    assert not doc_missing.ok and "latest" in doc_missing.problems[0] and doc_missing.tags == [tag]
