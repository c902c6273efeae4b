"""Fitting into the user's environment: their DeepSpeed left alone, the source's metadata carried.

    python -m pytest tests/test_compat.py -q -m "not e2e"    # the version range, in one process
    python -m pytest tests/test_compat.py -q                  # with real checkpoints

The 0.16.9 end-to-end case (train and load with 0.16.9, reshard with this environment) is in
tests/test_older_deepspeed.py.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest
from trained import REPO, reshard_cli

from reshard.deepspeed_version import release_of, version_problem

# the checkpoints its tests ask `trained` for, trained with the session's others (conftest.py)
pytestmark = pytest.mark.trains(("z2_fp32", 2))

RECOVERY_SCRIPTS = ("zero_to_fp32.py", "zero_to_torch.py")


@pytest.mark.parametrize("version", ["0.14.0", "0.14.5", "0.16.9", "0.17.0rc1", "0.19.8", "0.19.8+cpu"])
def test_the_tested_range_is_supported(version):
    assert version_problem(version) is None


@pytest.mark.parametrize("version", ["0.13.5", "0.20.0", "0.20.0.dev0", "1.0.0"])
def test_outside_the_range_is_named(version):
    problem = version_problem(version)
    assert problem is not None and f"DeepSpeed {version} is installed" in problem and ">=0.14,<0.20" in problem


def test_release_parts():
    assert release_of("0.16.9") == (0, 16, 9) and release_of("0.17.0rc1") == (0, 17, 0) and release_of("1.2") == (1, 2, 0)


def test_pyproject_extra_states_the_same_range():
    """The `deepspeed` extra and the run-time check name one range; the base install has no DeepSpeed."""
    import tomllib
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert not any(dep.startswith("deepspeed") for dep in project["dependencies"])
    assert project["optional-dependencies"]["deepspeed"] == ["deepspeed>=0.14,<0.20"]
    assert any(dep.startswith("deepspeed==") for dep in project["optional-dependencies"]["test"])
    assert not any(re.match(r"torch\s*==", dep) for dep in project["dependencies"])


@pytest.mark.e2e  # a fresh interpreter imports reshard.deepspeed beside a fake dist-info
def test_in_job_api_warns_outside_the_range(tmp_path):
    """The import of reshard.deepspeed checks the installed DeepSpeed's metadata (a real
    distribution record of an unsupported release, on sys.path ahead of the installed one)."""
    record = tmp_path / "deepspeed-0.13.5.dist-info"
    record.mkdir()
    (record / "METADATA").write_text("Metadata-Version: 2.1\nName: deepspeed\nVersion: 0.13.5\n")
    code = ("import warnings, sys; warnings.simplefilter('always');\n"
            "with warnings.catch_warnings(record=True) as seen:\n"
            "    import reshard.deepspeed\n"
            "print([str(w.message) for w in seen if w.category.__name__ == 'UnsupportedDeepSpeedWarning'])")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(REPO)]), DS_ACCELERATOR="cpu")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert "DeepSpeed 0.13.5 is installed" in result.stdout


def _deepspeed_imports(importtime_stderr: str) -> list[str]:
    """Modules named deepspeed or deepspeed.* in `python -X importtime` output."""
    return re.findall(r"\|\s*(deepspeed(?:\.\S+)?)\s*$", importtime_stderr, flags=re.MULTILINE)


@pytest.mark.e2e
def test_offline_command_never_imports_deepspeed(trained, tmp_path):
    """`python -m reshard SRC DST --target-dp 3`, `verify` and `export` on a real checkpoint import
    no DeepSpeed module (`-X importtime` lists every import, lazy ones included)."""
    source, _ = trained("z2_fp32", 2)
    commands = {"reshard": [str(source), str(tmp_path / "dst"), "--target-dp", "3", "--quiet"],
                "verify": ["verify", str(tmp_path / "dst")],
                "export": ["export", str(source), str(tmp_path / "hf"), "--format", "safetensors"]}
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH=str(REPO))
    for name, args in commands.items():
        result = subprocess.run([sys.executable, "-X", "importtime", "-m", "reshard", *args], capture_output=True,
                                text=True, env=env, cwd=REPO, timeout=300)
        assert result.returncode == 0, (name, result.stdout, result.stderr[-3000:])
        assert "| reshard.cli" in result.stderr  # importtime did list the imports
        assert _deepspeed_imports(result.stderr) == [], name
    # the check can fail: the in-job API does import DeepSpeed's modules when it runs
    probe = subprocess.run([sys.executable, "-X", "importtime", "-c", "import deepspeed"], capture_output=True,
                           text=True, env=env, cwd=REPO, timeout=300)
    assert "deepspeed" in _deepspeed_imports(probe.stderr)


@pytest.mark.e2e
def test_output_carries_the_sources_recovery_scripts(trained, tmp_path):
    """The output holds the source's zero_to_fp32.py byte for byte (here: an older release's, as a
    checkpoint from another DeepSpeed has) and no script the source did not have."""
    trained_dir, _ = trained("z2_fp32", 2)
    source = tmp_path / "src"
    shutil.copytree(trained_dir, source)
    assert {p.name for p in source.iterdir()} >= set(RECOVERY_SCRIPTS)  # DeepSpeed 0.19.8 writes both
    older = b"#!/usr/bin/env python\n# zero_to_fp32.py as an older DeepSpeed wrote it\n"
    (source / "zero_to_fp32.py").write_bytes(older)
    (source / "zero_to_torch.py").unlink()
    result = reshard_cli(source, tmp_path / "dst", "--target-dp", "3", "--quiet")
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "dst" / "zero_to_fp32.py").read_bytes() == older
    assert os.access(tmp_path / "dst" / "zero_to_fp32.py", os.X_OK)
    assert not (tmp_path / "dst" / "zero_to_torch.py").exists()
    # a source without any script: the output has none either
    for name in ("zero_to_fp32.py",):
        (source / name).unlink()
    result = reshard_cli(source, tmp_path / "dst2", "--target-dp", "1", "--quiet")
    assert result.returncode == 0, result.stderr
    assert not any((tmp_path / "dst2" / name).exists() for name in RECOVERY_SCRIPTS)
    # over an earlier output (--overwrite), the scripts the source lacks do not survive either
    result = reshard_cli(source, tmp_path / "dst", "--target-dp", "1", "--quiet", "--overwrite")
    assert result.returncode == 0, result.stderr
    assert not any((tmp_path / "dst" / name).exists() for name in RECOVERY_SCRIPTS)


def _save_tiny_tokenizer(directory) -> None:
    """A real fast tokenizer (word level, 67 ids as the tiny Llama's vocabulary) saved as transformers saves one."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, 67)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(directory)


@pytest.mark.e2e
def test_trainer_checkpoint_export_loads_with_from_pretrained(hf_trained, tmp_path):
    """A Trainer's checkpoint-3 exported: from_pretrained(OUT) with nothing copied by hand gives the
    Trainer's own model.safetensors, tensor for tensor; its tokenizer comes along too."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    checkpoint = hf_trained("z2") / "checkpoint-3"
    out = tmp_path / "hf"
    result = reshard_cli("export", checkpoint, out, "--format", "safetensors")
    assert result.returncode == 0, result.stderr
    assert "copied from the save directory: config.json, generation_config.json" in result.stdout
    assert "AutoTokenizer.from_pretrained(OUT) needs them" in result.stdout  # this Trainer had no tokenizer
    for name in ("config.json", "generation_config.json"):
        assert (out / name).read_bytes() == (checkpoint / name).read_bytes()
    model = AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32)
    loaded = model.state_dict()
    trainers = load_file(checkpoint / "model.safetensors")
    assert trainers and set(trainers) <= set(loaded)
    for name, tensor in trainers.items():
        assert torch.equal(loaded[name], tensor), name

    # with a tokenizer saved beside the model (Trainer(processing_class=...)), it is exported too
    with_tokenizer = tmp_path / "checkpoint-3"
    shutil.copytree(checkpoint, with_tokenizer)
    _save_tiny_tokenizer(with_tokenizer)
    result = reshard_cli("export", with_tokenizer, tmp_path / "hf2", "--format", "safetensors")
    assert result.returncode == 0, result.stderr
    assert "note:" not in result.stdout and "tokenizer.json" in result.stdout
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf2")
    assert tokenizer("w5 w9 w66")["input_ids"] == AutoTokenizer.from_pretrained(with_tokenizer)("w5 w9 w66")["input_ids"]

    # without a config, the summary says what from_pretrained needs
    (with_tokenizer / "config.json").unlink()
    result = reshard_cli("export", with_tokenizer, tmp_path / "hf3", "--format", "safetensors")
    assert result.returncode == 0, result.stderr
    assert "no config.json in the save directory" in result.stdout


@pytest.mark.e2e
def test_summary_names_each_file_that_needed_torch_and_why(trained, tmp_path):
    """A client_state holding a torch.device (torch's allowlist has it, the torch-free reader does
    not): the summary says torch read that file, and why; the other files stay torch-free."""
    import torch
    trained_dir, _ = trained("z2_fp32", 2)
    source = tmp_path / "src"
    shutil.copytree(trained_dir, source)
    model = source / (source / "latest").read_text() / "mp_rank_00_model_states.pt"
    tree = torch.load(model, weights_only=False)
    tree["where"] = torch.device("cpu")  # client_state is merged into the top level
    torch.save(tree, model)
    result = reshard_cli(source, tmp_path / "dst", "--target-dp", "3")
    assert result.returncode == 0, result.stderr
    torch_lines = [line.strip() for line in result.stdout.splitlines() if line.startswith("  torch  :")]
    assert torch_lines == [f"torch  : {model}: NeedsTorch: pickled global torch.device"], result.stdout
    assert "io     : torch (imported by worker(s) 0)" in result.stdout
    # untouched, the same checkpoint needs no torch and the summary has no such line
    plain = reshard_cli(trained_dir, tmp_path / "dst2", "--target-dp", "3")
    assert plain.returncode == 0 and "torch  :" not in plain.stdout and "io     : torch-free" in plain.stdout


def test_model_files_are_copied_as_they_are_and_stale_ones_removed(tmp_path):
    """export.model_files: the save directory's config and tokenizer files, byte for byte; what the
    source lacks is not left behind by an earlier export; the notes name what is missing."""
    from reshard.export.model_files import (
        copy_model_files,
        missing_notes,
        model_files_in,
    )
    save_dir, out = tmp_path / "checkpoint-3", tmp_path / "hf"
    save_dir.mkdir()
    out.mkdir()
    (save_dir / "config.json").write_text('{"model_type": "llama"}')
    (save_dir / "merges.txt").write_text("#version: 0.2\n")
    (save_dir / "trainer_state.json").write_text("{}")  # the Trainer's, not the model's
    (save_dir / "tokenizer.json").symlink_to(save_dir / "config.json")  # links are not followed
    (out / "generation_config.json").write_text("{}")  # an earlier export's
    names = model_files_in(str(save_dir))
    assert names == ["config.json", "merges.txt"]
    copy_model_files(str(save_dir), str(out), names)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "merges.txt"]
    assert (out / "config.json").read_bytes() == (save_dir / "config.json").read_bytes()
    assert missing_notes(names) == []
    notes = missing_notes(["generation_config.json"])
    assert len(notes) == 2 and "config.json" in notes[0] and "AutoTokenizer" in notes[1]
