"""`reshard export --format dcp --layout accelerate`: a Hugging Face Trainer run saved under DeepSpeed resumes under FSDP2.

    python -m pytest -q tests/test_export_accelerate.py -s      # -s prints wall times

Real parts end to end: the session's HF Trainer run (tests/entry/hf_trainer.py: a tiny Llama, DeepSpeed
ZeRO-2 fp32, 2 CPU ranks, `checkpoint-3` with the Trainer's own files) is exported by
`python -m reshard export checkpoint-3 OUT --format dcp --layout accelerate --workers 2` in chunks of
a few rows under a 4 kB budget. Then the Trainer with FSDP2 (Accelerate's plugin, SHARDED_STATE_DICT)
on 2 CPU ranks runs `trainer.train(resume_from_checkpoint=OUT)` from another seed
(tests/entry/hf_fsdp2.py): before its first step every parameter, exp_avg and exp_avg_sq equals the
DeepSpeed engine's truth element by element, every Adam step is 3, the global step and learning
rate continue, and the run reaches step 6 and saves, logging at steps 4-6 the losses the DeepSpeed run
logged. That run's own FSDP2 save is then the format's reference: the export's two `.metadata` name
the same keys, sizes and dtypes as Accelerate's.
One launch (the resume) and one export process; refusals run in this process.
"""
from __future__ import annotations

import json
import pickle
import shutil
import subprocess
import sys
import time

import pytest
import torch
from hf_runs import read_report, run_entry
from trained import reshard_in_process, tree_files

from reshard_proof.launch import REPO_ROOT, child_env

pytestmark = pytest.mark.e2e
CHUNK_BYTES, BUDGET = 256, 4 << 10
DIRECTORIES = ("pytorch_model_fsdp_0", "optimizer_0")


@pytest.fixture(scope="module")
def fsdp2_resume(hf_trained, tmp_path_factory):
    """{"source", "export", "resumed", "report", "source_files"}: the export of checkpoint-3 and the
    FSDP2 Trainer's resume from it."""
    root = tmp_path_factory.mktemp("fsdp2-accelerate")
    run = hf_trained("z2")
    source, export = run / "checkpoint-3", root / "checkpoint-3-fsdp2"
    source_files = tree_files(source)
    started = time.perf_counter()
    exported = subprocess.run([sys.executable, "-m", "reshard", "export", str(source), str(export), "--format", "dcp",
                               "--layout", "accelerate", "--workers", "2", "--chunk-size", str(CHUNK_BYTES),
                               "--memory-budget", str(BUDGET)],
                              env=child_env(), cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert exported.returncode == 0, exported.stdout + exported.stderr
    print(f"\nexport --layout accelerate (2 workers): {time.perf_counter() - started:.1f} s wall")
    report, resumed = root / "report.json", root / "resumed"
    started = time.perf_counter()
    run_entry("hf_fsdp2.py", 2, resumed, "--from", export, "--truth", run / "truth-3.pt", "--control",
              run / "truth-6.pt", "--report", report, expect=report)
    print(f"FSDP2 Trainer resume at 2 ranks (load, 3 steps, save): {time.perf_counter() - started:.1f} s wall")
    return {"source": source, "export": export, "resumed": resumed, "report": read_report(report),
            "source_files": source_files, "stdout": exported.stdout}


def test_trainer_under_fsdp2_resumes_the_deepspeed_run_with_its_adam_state(fsdp2_resume):
    data = fsdp2_resume["report"]
    assert data["fsdp_version"] == 2 and data["parameter_class"] == "DTensor" and data["world_size"] == 2
    assert data["mismatches"] == [], data["mismatches"]
    assert data["checked_tensors"] == 63  # 21 parameters x (fp32 master, exp_avg, exp_avg_sq)
    assert data["adam_step_count"] == 21 and data["adam_steps"] == [3.0]
    assert data["global_step_at_resume"] == data["truth_global_step"] == 3
    assert data["lr_at_resume"] == data["truth_lr"]
    assert data["final_global_step"] == 6
    assert {"pytorch_model_fsdp_0", "optimizer_0", "trainer_state.json", "scheduler.pt"} <= set(data["final_save"])
    # negative control: the same comparison against step 6's truth finds every tensor different
    assert len(data["control_mismatches"]) == 63


def _metadata(directory):
    with open(directory / ".metadata", "rb") as f:
        return pickle.load(f)


def _described(metadata) -> dict:
    """key -> (size, dtype) of a tensor entry, or "bytes"."""
    out = {}
    for key, entry in metadata.state_dict_metadata.items():
        out[key] = (tuple(entry.size), entry.properties.dtype) if hasattr(entry, "size") else "bytes"
    return out


def test_the_export_is_laid_out_as_accelerate_saves_fsdp2(fsdp2_resume):
    """The resumed run's own save at step 6 (Accelerate's save_fsdp_model / save_fsdp_optimizer) is
    the reference: the same directories, keys, shapes and dtypes; the Trainer's files carried byte
    for byte, nothing of DeepSpeed's, the source untouched."""
    export, own_save = fsdp2_resume["export"], fsdp2_resume["resumed"] / "checkpoint-6"
    for directory in DIRECTORIES:
        ours, theirs = _described(_metadata(export / directory)), _described(_metadata(own_save / directory))
        assert ours == theirs, (directory, set(ours) ^ set(theirs))
    assert any(key.startswith("optimizer.param_groups.1.") for key in _described(_metadata(export / "optimizer_0")))
    source_files = fsdp2_resume["source_files"]
    exported = tree_files(export)
    for name in ("trainer_state.json", "scheduler.pt", "rng_state_0.pth", "rng_state_1.pth", "training_args.bin",
                 "config.json", "generation_config.json"):
        assert exported[name] == source_files[name], name
    assert not any(name.startswith(("global_step", "latest", "zero_to_", ".reshard")) for name in exported), exported.keys()
    assert tree_files(fsdp2_resume["source"]) == source_files
    run = torch.load(export / "reshard_run_state.pt", weights_only=True)
    assert run["global_steps"] == 3 and run["loss_scaler"] is None  # an fp32 run has no loss scale to carry
    assert "2 workers" in fsdp2_resume["stdout"] and "files of the save directory carried" in fsdp2_resume["stdout"]


def test_two_array_tasks_publish_the_two_worker_exports_bytes(fsdp2_resume, tmp_path):
    """`--array-task I --array-tasks 2` (reshard.export.dcp_array, in this process, task 1 first): each task
    writes worker I's files in both directories, the last one carries the Trainer's files and publishes:
    every file byte for byte the `--workers 2` export the FSDP2 Trainer resumed from."""
    from reshard.export.dcp_array import export_dcp_array_task
    out = tmp_path / "array"
    tasks = [export_dcp_array_task(str(fsdp2_resume["source"]), str(out), task=i, tasks=2, layout="accelerate",
                                   chunk_bytes=CHUNK_BYTES, memory_budget=BUDGET, quiet=True) for i in (1, 0)]
    assert [t.files for t in tasks] == [[f"{d}/__1_0.distcp" for d in DIRECTORIES],
                                        [f"{d}/__0_0.distcp" for d in DIRECTORIES]]
    assert any(note.startswith("published ") for note in tasks[1].notes), tasks[1].notes
    assert tree_files(out) == tree_files(fsdp2_resume["export"])
    assert tree_files(fsdp2_resume["source"]) == fsdp2_resume["source_files"]


def _copy(hf_trained, tmp_path):
    copy = tmp_path / "checkpoint-3"
    shutil.copytree(hf_trained("z2") / "checkpoint-3", copy)
    return copy


def test_a_trainer_checkpoint_without_scheduler_pt_is_refused_by_name(hf_trained, tmp_path):
    """A DeepSpeed-config scheduler leaves no scheduler.pt, and the Trainer restores the optimizer only
    beside one: refused, exit 2, nothing written."""
    source = _copy(hf_trained, tmp_path)
    (source / "scheduler.pt").unlink()
    out = tmp_path / "out"
    result = reshard_in_process("export", source, out, "--format", "dcp", "--layout", "accelerate")
    assert result.returncode == 2, result.stdout + result.stderr
    assert f"{source / 'trainer_state.json'}: is a Trainer checkpoint without scheduler.pt" in result.stdout + result.stderr
    assert not out.exists()


def test_a_save_directory_file_where_the_layout_writes_is_refused_by_name(hf_trained, tmp_path):
    source = _copy(hf_trained, tmp_path)
    (source / "optimizer_0").mkdir()
    (source / "optimizer_0" / "notes.txt").write_text("mine")
    out = tmp_path / "out"
    result = reshard_in_process("export", source, out, "--format", "dcp", "--layout", "accelerate")
    assert result.returncode == 2, result.stdout + result.stderr
    assert f"{source / 'optimizer_0' / 'notes.txt'}: the accelerate layout writes optimizer_0 itself" in \
        result.stdout + result.stderr
    assert not out.exists()
    assert (source / "optimizer_0" / "notes.txt").read_text() == "mine"


def test_layout_is_refused_with_another_format(hf_trained, tmp_path):
    result = reshard_in_process("export", hf_trained("z2") / "checkpoint-3", tmp_path / "out", "--format",
                                "safetensors", "--layout", "accelerate")
    assert result.returncode == 2 and "--layout applies to --format dcp only" in result.stdout + result.stderr
    assert not (tmp_path / "out").exists()


def _logged_losses(checkpoint) -> dict:
    history = json.loads((checkpoint / "trainer_state.json").read_text())["log_history"]
    return {entry["step"]: entry["loss"] for entry in history if "loss" in entry}


def test_the_next_logged_losses_are_deepspeeds(hf_trained, fsdp2_resume):
    """Steps 4-6 of the FSDP2 run log the losses the DeepSpeed run logged, to the bit: the same parameters
    and Adam state (above), the same batches (the Trainer skips the 3 it saw, from data_seed), and a
    gradient mean over 2 ranks, which is the same sum however the reduction is scheduled."""
    deepspeed = _logged_losses(hf_trained("z2") / "checkpoint-6")
    fsdp2 = _logged_losses(fsdp2_resume["resumed"] / "checkpoint-6")
    print(f"\nlogged losses, DeepSpeed: {deepspeed}\n               FSDP2 resumed: {fsdp2}")
    assert sorted(deepspeed) == [1, 2, 3, 4, 5, 6] and sorted(fsdp2) == [1, 2, 3, 4, 5, 6]
    assert all(fsdp2[step] == deepspeed[step] for step in (1, 2, 3))  # carried in trainer_state.json
    assert [fsdp2[step] for step in (4, 5, 6)] == [deepspeed[step] for step in (4, 5, 6)]


@pytest.mark.e2e
def test_a_pipeline_save_is_refused_in_the_accelerate_layout_by_name(pipeline_runs, tmp_path):
    """The accelerate layout is a Hugging Face Trainer checkpoint directory; a PipelineModule save exports to
    DCP in the torch layout only (refused by name where the two exports met, reshard.export.dcp_job._run)."""
    from reshard.errors import UnsupportedCheckpoint
    from reshard.export.dcp_job import export_dcp
    save, _ = pipeline_runs("fp32", 2, 1)
    before = tree_files(save)
    with pytest.raises(UnsupportedCheckpoint, match=r"step3: is a PipelineModule save: the accelerate layout is for "
                                                    r"Hugging Face Trainer saves"):
        export_dcp(str(save), str(tmp_path / "out"), layout="accelerate")
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
    assert tree_files(save) == before
