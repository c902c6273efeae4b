"""Save-directory files beside DeepSpeed's (HF Trainer, Accelerate), the launcher batch warning, per-rank
RNG notes, the HF integration's version guard, and errors printed once under torchrun. No training.

    python -m pytest -q tests/test_save_dir_files.py
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
from trained import REPO

from reshard.jobs.batch_config import batch_config_problem, batch_recomputing_launcher, batch_size_warning
from reshard.errors import ReshardError
from reshard.jobs.save_dir_files import list_save_dir_files, per_rank_rng_notes

# the checkpoints its tests ask `trained` for, trained with the session's others (conftest.py)
pytestmark = pytest.mark.trains(("z3_bf16", 2))

HF_CONFIG = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1}


def test_every_file_but_deepspeeds_own_is_listed(tmp_path):
    save_dir = tmp_path / "checkpoint-3"
    (save_dir / "global_step3").mkdir(parents=True)
    (save_dir / "global_step3" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"x")
    (save_dir / "global_step1").mkdir()  # another tag: not carried either
    (save_dir / "global_step1" / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"x")
    for name in ("latest", "zero_to_fp32.py", "zero_to_torch.py", "trainer_state.json", "rng_state_0.pth"):
        (save_dir / name).write_text(name)
    (save_dir / "tokenizer" / "deep").mkdir(parents=True)
    (save_dir / "tokenizer" / "vocab.json").write_text("{}")
    (save_dir / "tokenizer" / "deep" / "merges.txt").write_text("")
    assert list_save_dir_files(str(save_dir)) == ["rng_state_0.pth", "tokenizer/deep/merges.txt",
                                                  "tokenizer/vocab.json", "trainer_state.json"]


def test_batch_refusal_becomes_a_warning_for_launchers_that_recompute():
    assert batch_config_problem(HF_CONFIG, 3) is not None
    assert batch_recomputing_launcher(["trainer_state.json"]) == "the Hugging Face Trainer"
    assert batch_recomputing_launcher(["random_states_0.pkl"]) == "Accelerate"
    assert batch_recomputing_launcher(["metric.json", "rng_state.pth"]) is None
    warning = batch_size_warning(HF_CONFIG, 2, 3, ["trainer_state.json"])
    assert "global batch size is 4 at 2 ranks and becomes 6 at 3 ranks" in warning and "\n" not in warning
    assert "becomes 2 at 1 ranks" in batch_size_warning(HF_CONFIG, 2, 1, ["random_states_1.pkl"])
    assert batch_size_warning(HF_CONFIG, 2, 2, ["trainer_state.json"]) is None  # fits: nothing to say
    assert batch_size_warning(HF_CONFIG, 2, 3, ["metric.json"]) is None  # others keep the refusal


def test_per_rank_rng_notes_say_what_is_missing_and_invent_nothing():
    files = ["rng_state_0.pth", "rng_state_1.pth", "trainer_state.json"]
    assert per_rank_rng_notes(files, 2) == []
    [grow] = per_rank_rng_notes(files, 4)
    assert grow.startswith("rank(s) 2-3 of 4 have no rng_state_{rank}.pth")
    [one] = per_rank_rng_notes(files, 1)
    assert "reads rng_state.pth" in one
    [shrink] = per_rank_rng_notes(["random_states_0.pkl", "random_states_1.pkl", "random_states_2.pkl"], 2)
    assert "random_states_{rank}.pkl of rank(s) 2 are carried unchanged, but no rank reads them" in shrink


def test_untested_versions_are_refused_clearly(monkeypatch):
    import importlib.metadata

    from reshard.integrations import huggingface
    monkeypatch.delenv(huggingface.OVERRIDE_ENV, raising=False)
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda p: "4.40.1" if p == "transformers" else real(p))
    with pytest.raises(huggingface.UntestedVersion, match=r"tested with transformers 5\.24\.x, not 4\.40\.1"):
        huggingface.check_version("transformers")
    monkeypatch.setenv(huggingface.OVERRIDE_ENV, "1")
    assert huggingface.check_version("transformers") == "4.40.1"
    with pytest.raises(ReshardError, match="Trainer or an accelerate Accelerator"):
        huggingface.enable_resharding(object())


@pytest.mark.e2e
def test_an_error_every_worker_sees_is_printed_once(tmp_path):
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "reshard",
               str(tmp_path / "missing"), str(tmp_path / "dst"), "--target-dp", "3"]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, cwd=REPO)
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert output.count("reshard: error:") == 1, output
    assert "is not a directory" in output
    assert "exitcode  : 2" in output  # each worker's own status is unchanged


@pytest.mark.e2e
def test_per_rank_client_state_is_reported(trained, tmp_path):
    """ZeRO-3 saves client_state per rank: keys whose values differ are named (dry run and run), and
    every target rank holds source rank 0's values, as the report says."""
    import shutil

    import torch
    from trained import reshard_in_threads
    original, _ = trained("z3_bf16", 2)
    source = tmp_path / "src"
    shutil.copytree(original, source)
    rank1 = next(source.glob("*/zero_pp_rank_1_mp_rank_00_model_states.pt"))
    state = torch.load(rank1, map_location="cpu", weights_only=False)
    state["dataloader"]["index"] = 43                          # a plain value differs
    state["ppo"]["reward_stats"]["mean"] = torch.tensor([9.0, -1.25, 3.0])   # a tensor's values differ
    torch.save(state, rank1)

    plan = reshard_in_threads(source, tmp_path / "dst", 3, 2, dry_run=True).checkpoints[0]
    [note] = [n for n in plan.notes if n.startswith("client_state")]
    assert "differs between source ranks in dataloader (" in note and "tensor values not compared" in note
    assert "client_state differs" in plan.summary()
    result = reshard_in_threads(source, tmp_path / "dst", 3, 2).checkpoints[0]
    [note] = [n for n in result.notes if n.startswith("client_state")]
    assert "in dataloader, ppo (" in note and "every target rank (0-2) received source rank 0's values" in note
    targets = sorted((tmp_path / "dst").glob("*/zero_pp_rank_*_mp_rank_00_model_states.pt"))
    assert len(targets) == 3
    for path in targets:
        received = torch.load(path, map_location="cpu", weights_only=False)
        assert received["dataloader"]["index"] == 42 and received["ppo"]["reward_stats"]["mean"][0] == 0.5


def test_staged_files_are_published_inside_dst_only(tmp_path):
    from reshard.errors import OptionError
    from reshard.jobs.save_dir_files import publish, stage, staging_dir
    source, destination = tmp_path / "src", tmp_path / "dst"
    (source / "tokenizer").mkdir(parents=True)
    (source / "trainer_state.json").write_text("{}")
    (source / "tokenizer" / "vocab.json").write_text('{"a": 1}')
    files = list_save_dir_files(str(source))
    staged = staging_dir(str(destination / ".reshard-staging" / "global_step3"))
    entries = stage(str(source), files, staged, str(destination))
    assert sorted(entries) == ["../tokenizer/vocab.json", "../trainer_state.json"]
    publish(staged, files, str(destination))
    assert (destination / "tokenizer" / "vocab.json").read_text() == '{"a": 1}' and not os.path.exists(staged)
    # a link in DST leading outside it is never written through
    outside = tmp_path / "outside"
    outside.mkdir()
    (destination / "tokenizer" / "vocab.json").unlink()
    (destination / "tokenizer").rmdir()
    (destination / "tokenizer").symlink_to(outside)
    stage(str(source), files, staged, str(destination))
    with pytest.raises(OptionError, match="refusing to write outside the destination"):
        publish(staged, files, str(destination))
    assert not list(outside.iterdir())
