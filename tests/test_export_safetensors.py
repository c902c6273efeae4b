"""`python -m reshard export --format safetensors`: Hugging Face shards equal to the truth.

    python -m pytest tests/test_export_safetensors.py -q

The proof model ties its output head to the embedding (head.weight -> embed.weight), which is
exactly where DeepSpeed's `zero_to_fp32.py --safe_serialization` stops (safetensors refuses two
names for one storage): reshard stores the weight once, as embed.weight. Every tensor is compared
with the source engine's own full tensors; an untied checkpoint is compared with zero_to_fp32's
own safetensors output; W = 1, 2, 3 workers must give byte-identical files.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from threaded_transport import run_workers
from trained import reshard_in_process

from reshard.export import export_safetensors
from reshard.export.hf_layout import INDEX_NAME
from reshard.export.safetensors_job import parse_shard_size
from reshard_proof.launch import run_torchrun

pytestmark = [pytest.mark.e2e, pytest.mark.trains(("z3_bf16", 2), ("z2_fp32", 2))]


def _read_dir(directory: Path) -> dict:
    tensors = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():
                assert name not in tensors, f"{name} stored twice"
                tensors[name] = handle.get_tensor(name)
    return tensors


def _expected(truth_path, dtype: torch.dtype) -> dict:
    engine = torch.load(truth_path, weights_only=True)["engine"]
    expected = {name: entry["fp32"].to(dtype) for name, entry in engine["master"].items()}
    expected.update({name: t.to(dtype) for name, t in engine["frozen"].items()})
    expected.update({name: t.to(dtype) if t.is_floating_point() else t for name, t in engine["buffers"].items()})
    return expected


def _assert_index_valid(directory: Path, max_shard_bytes: int) -> dict:
    index = json.loads((directory / INDEX_NAME).read_text())
    files = sorted(p.name for p in directory.glob("*.safetensors"))
    assert sorted(set(index["weight_map"].values())) == files
    n = len(files)
    assert files == [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]
    total = 0
    for name in files:
        with safe_open(str(directory / name), framework="pt") as handle:
            keys = list(handle.keys())
            assert handle.metadata() == {"format": "pt"}
            assert sorted(keys) == sorted(k for k, f in index["weight_map"].items() if f == name)
            sizes = [handle.get_slice(k).get_shape() for k in keys]
            nbytes = sum(handle.get_tensor(k).nbytes for k in keys)
        assert nbytes <= max_shard_bytes or len(keys) == 1, (name, nbytes, sizes)
        total += nbytes
    assert index["metadata"]["total_size"] == total
    return index


@pytest.mark.parametrize("variant,n,dtype", [("z3_bf16", 2, "bf16"), ("z2_fp32", 2, "fp32"),
                                             ("bf16_optimizer", 2, "fp16")])
def test_export_equals_the_truth_and_workers_agree(trained, tmp_path, variant, n, dtype):
    source, truth = trained(variant, n)
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    outputs = []
    for workers in (1, 2, 3):
        out = tmp_path / f"w{workers}"
        results = run_workers(workers, lambda t: export_safetensors(str(source), str(out), dtype=dtype,
                                                                    max_shard_size="300B", memory_budget=4 << 10,
                                                                    transport=t))
        assert results[0].kept_for_tied == {"head.weight": "embed.weight"}
        outputs.append(out)
    _assert_index_valid(outputs[0], 300)
    got = _read_dir(outputs[0])
    expected = _expected(truth, torch_dtype)
    assert "head.weight" not in got and "embed.weight" in got
    assert sorted(got) == sorted(expected)
    for name, value in expected.items():
        assert got[name].dtype == value.dtype and torch.equal(got[name], value), name
    names = sorted(p.name for p in outputs[0].iterdir())
    assert len(names) > 3  # really sharded
    for other in outputs[1:]:
        assert sorted(p.name for p in other.iterdir()) == names
        for name in names:
            assert (other / name).read_bytes() == (outputs[0] / name).read_bytes(), (other, name)


def test_zero_to_fp32_safe_serialization_fails_on_the_tied_model(trained, tmp_path):
    """Why this exists: DeepSpeed's own safetensors path refuses the tied checkpoint."""
    from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict
    source, _ = trained("z2_fp32", 2)
    with pytest.raises(RuntimeError, match="share memory"):
        convert_zero_checkpoint_to_fp32_state_dict(str(source), str(tmp_path / "ds"), safe_serialization=True)


def _untie(original: Path, copy: Path) -> None:
    """The checkpoint a model that reuses embed.weight in forward (no head module) would save:
    no head.weight entry and no shared_params; every other byte as trained."""
    shutil.copytree(original, copy)
    model = copy / (copy / "latest").read_text() / "mp_rank_00_model_states.pt"
    state = torch.load(model, weights_only=False)
    del state["module"]["head.weight"]
    state["shared_params"] = {}
    torch.save(state, model)


def test_untied_export_equals_zero_to_fp32_safetensors(trained, tmp_path):
    from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict
    original, _ = trained("z2_fp32", 2)
    untied = tmp_path / "untied"
    _untie(original, untied)
    convert_zero_checkpoint_to_fp32_state_dict(str(untied), str(tmp_path / "ds"), safe_serialization=True,
                                               max_shard_size="1KB")
    result = reshard_in_process("export", untied, tmp_path / "ours", "--format", "safetensors", "--max-shard-size", "1KB")
    assert result.returncode == 0, result.stderr
    ours, theirs = _read_dir(tmp_path / "ours"), _read_dir(tmp_path / "ds")
    assert len(theirs) > 5 and sorted(ours) == sorted(theirs)
    for name in theirs:
        assert ours[name].dtype == theirs[name].dtype and torch.equal(ours[name], theirs[name]), name
    _assert_index_valid(tmp_path / "ours", 1000)


def test_export_under_torchrun_and_help(trained, tmp_path):
    source, truth = trained("z3_bf16", 2)
    out = tmp_path / "out"
    run_torchrun("reshard", 2, ["export", str(source), str(out), "--format", "safetensors", "--dtype", "bf16",
                                "--max-shard-size", "200B", "--memory-budget", "4K"],
                 expect_files=[out / INDEX_NAME])
    got = _read_dir(out)
    for name, value in _expected(truth, torch.bfloat16).items():
        assert torch.equal(got[name], value), name
    # help and a refusal: what reshard says, through reshard.cli.main in this process; the torchrun launch
    # above is the real `-m reshard export` process
    helped = reshard_in_process("export", "--help")
    assert helped.returncode == 0
    for fragment in ("Not exported", "optimizer state", "tied", "persistent buffers", "frozen parameters"):
        assert fragment in helped.stdout, fragment
    refused = reshard_in_process("export", source, out, "--format", "safetensors")  # out is not empty
    assert refused.returncode == 2 and "not empty" in refused.stderr


@pytest.mark.parametrize("text,expected", [("5GB", 5 * 10**9), ("500MB", 500 * 10**6), ("2GiB", 2 << 30),
                                           ("1KB", 1000), ("4096", 4096)])
def test_shard_sizes_read_like_huggingface(text, expected):
    assert parse_shard_size(text) == expected


@pytest.mark.parametrize("key,dtype", [(("moe_z2_fp32", 2, 2), "fp32"), (("moe_bf16_optimizer", 2, 2), "bf16")])
def test_a_native_moe_export_loads_strictly_into_the_model_at_ep_1(moe_sources, tmp_path, key, dtype):
    # issue 38: a native DeepSpeed MoE save at ep 2 exported as the same model at ep 1: every global expert once,
    # under the name MoEProofModel(ep=1).state_dict() gives it, each layer's experts after its gate; the shards
    # load with load_state_dict(strict=True) into that module and every tensor equals the engine's truth;
    # 1, 2 and 3 workers write the same bytes. On main: refused, exit 2 ("is a mixture-of-experts checkpoint").
    from reshard_proof.moe_model import MoEProofModel
    source, truth = moe_sources(*key)
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    outputs = []
    for workers in (1, 2, 3):
        out = tmp_path / f"w{workers}"
        run_workers(workers, lambda t: export_safetensors(str(source), str(out), dtype=dtype, max_shard_size="1KB",
                                                          memory_budget=4 << 10, transport=t))
        outputs.append(out)
    index = _assert_index_valid(outputs[0], 1000)
    got = _read_dir(outputs[0])
    expected = _expected(truth, torch_dtype)
    assert sorted(got) == sorted(expected) and len(got) == 40  # 39 parameters and the buffer
    for name, value in expected.items():
        assert got[name].dtype == value.dtype and torch.equal(got[name], value), name
    torch.manual_seed(5)
    model = MoEProofModel(ep=1).to(torch_dtype)
    model.load_state_dict(got, strict=True)
    order = list(index["weight_map"])
    assert {n.split(".")[5] for n in order if ".deepspeed_experts." in n} == {"0", "1", "2", "3"}
    names = sorted(p.name for p in outputs[0].iterdir())
    for other in outputs[1:]:
        assert sorted(p.name for p in other.iterdir()) == names
        for name in names:
            assert (other / name).read_bytes() == (outputs[0] / name).read_bytes(), (other, name)


@pytest.mark.parametrize("key", [("autoep_z2_fp32", 2, 2), ("autoep_z3_fp32", 2, 4)], ids=["z2", "z3"])
def test_an_autoep_export_loads_into_the_autoep_model_at_ep_1(moe_sources, tmp_path, key):
    # each weight's expert slices joined as the AutoEPMoELayer built at autoep_size 1 holds them, experts.w1
    # [4, 16, 8]; the router's gate is stored once, under the trainable name (mlp.gate.gate.weight is the same
    # parameter). At ZeRO-3 (ep 2 at world 4) the experts lie in the ZeRO-3 partitions of their expert-DP groups;
    # refused until moedcp3 ("is a ZeRO-3 mixture-of-experts checkpoint").
    from reshard_proof.moe_model import autoep_model_at_ep_1, fused_autoep_truth
    source, truth = moe_sources(*key)
    out = tmp_path / "autoep"
    run_workers(2, lambda t: export_safetensors(str(source), str(out), max_shard_size="2KB", memory_budget=4 << 10,
                                                transport=t))
    _assert_index_valid(out, 2000)
    got = _read_dir(out)
    engine = fused_autoep_truth(torch.load(truth, weights_only=True)["engine"])
    assert tuple(got["model.layers.0.mlp.experts.w1"].shape) == (4, 16, 8)
    torch.manual_seed(5)
    model = autoep_model_at_ep_1()
    missing, unexpected = model.load_state_dict(got, strict=False)
    # the alias is not stored (as save_pretrained keeps one name of a tied weight); its parameter is loaded
    assert sorted(missing) == [f"model.layers.{i}.mlp.gate.gate.weight" for i in (0, 1)] and unexpected == []
    assert model.model.layers[0].mlp.gate.gate.weight is model.model.layers[0].mlp.router.gate.weight
    for name, param in model.named_parameters():
        assert torch.equal(param.detach(), engine["master"][name]["fp32"]), name
    assert sorted(dict(model.named_parameters())) == sorted(engine["master"])
