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
fp16: the session's DeepSpeed ZeRO-2 fp16 Trainer run (dynamic loss scale 256 -> 512 by step 3) is
exported in this process, its loss scale saved as `scaler.pt` from `reshard_run_state.pt` as
docs/moving-to-fsdp2.md tells a user to, and resumed in the same launch by an fp16 FSDP2 Trainer
(fp16 MixedPrecisionPolicy over fp32 masters, autocast, GradScaler; tests/entry/hf_fsdp2.py says what
a CPU run needs that a GPU run gets from Accelerate): the masters and moments equal DeepSpeed's to the
bit, the scale goes on from 512 to DeepSpeed's 1024 at step 6, and the next losses are DeepSpeed's as
FSDP2 hands them back in fp16.
AutoTP: the session's DeepSpeed ZeRO-1 AutoTP Trainer run (tp 2, dp 1: transformers builds it with
`deepspeed.tp_model_init`; q/k/v/gate/up column-parallel, o/down row-parallel, the rest whole) is exported in
this process, each TP slice joined whole, and resumed in the same launch by the FSDP2 Trainer at dp 2, one row
per rank: the masters and moments equal DeepSpeed's joined whole, to the bit, and the next losses DeepSpeed's
to within the rounding of a different summation order.
One launch (the three resumes) and one export process; the fp16 and AutoTP exports and the refusals run in
this process. The AutoTP run is trained in a launch of its own (tests/hf_runs.py ALONE), the others in the
session's shared HF launch.
"""
from __future__ import annotations

import json
import math
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
    """{"source", "export", "resumed", "report", "source_files", "fp16": the same for the fp16 run}: the
    exports of checkpoint-3 and the FSDP2 Trainer's resumes from them (one launch)."""
    root = tmp_path_factory.mktemp("fsdp2-accelerate")
    run, run16, run_tp = hf_trained("z2"), hf_trained("z2_fp16"), hf_trained("z1_tp2")
    source, export = run / "checkpoint-3", root / "checkpoint-3-fsdp2"
    source_files = tree_files(source)
    started = time.perf_counter()
    exported = subprocess.run([sys.executable, "-m", "reshard", "export", str(source), str(export), "--format", "dcp",
                               "--layout", "accelerate", "--workers", "2", "--chunk-size", str(CHUNK_BYTES),
                               "--memory-budget", str(BUDGET)],
                              env=child_env(), cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert exported.returncode == 0, exported.stdout + exported.stderr
    print(f"\nexport --layout accelerate (2 workers): {time.perf_counter() - started:.1f} s wall")
    source16, export16 = run16 / "checkpoint-3", root / "checkpoint-3-fp16-fsdp2"
    started = time.perf_counter()
    exported16 = reshard_in_process("export", source16, export16, "--format", "dcp", "--layout", "accelerate",
                                    "--chunk-size", str(CHUNK_BYTES))
    assert exported16.returncode == 0, exported16.stdout + exported16.stderr
    print(f"export --layout accelerate of the fp16 run (in this process): {time.perf_counter() - started:.1f} s wall")
    run_state16 = torch.load(export16 / "reshard_run_state.pt", weights_only=True)
    torch.save(run_state16["loss_scaler"]["grad_scaler"], export16 / "scaler.pt")  # the user's step (docs)
    source_tp, export_tp = run_tp / "checkpoint-3", root / "checkpoint-3-autotp-fsdp2"
    source_tp_files = tree_files(source_tp)
    started = time.perf_counter()
    exported_tp = reshard_in_process("export", source_tp, export_tp, "--format", "dcp", "--layout", "accelerate",
                                     "--chunk-size", str(CHUNK_BYTES))
    assert exported_tp.returncode == 0, exported_tp.stdout + exported_tp.stderr
    print(f"export --layout accelerate of the AutoTP run (in this process): {time.perf_counter() - started:.1f} s wall")
    report, resumed = root / "report.json", root / "resumed"
    report16, resumed16 = root / "report-fp16.json", root / "resumed-fp16"
    report_tp, resumed_tp = root / "report-autotp.json", root / "resumed-autotp"
    jobs = root / "resume-jobs.json"
    jobs.write_text(json.dumps([
        {"out": str(resumed), "source": str(export), "truth": str(run / "truth-3.pt"),
         "control": str(run / "truth-6.pt"), "report": str(report)},
        {"out": str(resumed16), "source": str(export16), "truth": str(run16 / "truth-3.pt"),
         "control": str(run16 / "truth-6.pt"), "report": str(report16), "fp16": True},
        # one row per rank: the global batch of 2 rows the AutoTP run (dp 1) took, in the same order
        {"out": str(resumed_tp), "source": str(export_tp), "truth": str(run_tp / "truth-3.pt"),
         "control": str(run_tp / "truth-6.pt"), "report": str(report_tp), "kv_heads": 2, "batch": 1}]))
    started = time.perf_counter()
    run_entry("hf_fsdp2.py", 2, "--jobs", jobs, expect=report_tp)
    print(f"FSDP2 Trainer resumes at 2 ranks, fp32, fp16 and AutoTP (load, 3 steps, save; each): "
          f"{time.perf_counter() - started:.1f} s wall")
    return {"source": source, "export": export, "resumed": resumed, "report": read_report(report),
            "source_files": source_files, "stdout": exported.stdout,
            "fp16": {"run": run16, "export": export16, "resumed": resumed16, "report": read_report(report16),
                     "run_state": run_state16},
            "autotp": {"run": run_tp, "source": source_tp, "source_files": source_tp_files, "export": export_tp,
                       "resumed": resumed_tp, "report": read_report(report_tp), "stdout": exported_tp.stdout}}


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


def _fp16_ulp(value: float) -> float:
    """The spacing of fp16 numbers at `value` (10 mantissa bits)."""
    return 2.0 ** (math.floor(math.log2(abs(value))) - 10)


def test_an_fp16_trainer_resumes_under_fsdp2_in_fp16_with_deepspeeds_loss_scale(fsdp2_resume):
    """DeepSpeed ZeRO-2 fp16 -> export -> FSDP2 in fp16: fp32 masters and Adam moments equal to the bit, Adam
    step 3 (the run skipped no step), and the GradScaler goes on from DeepSpeed's scale."""
    fp16 = fsdp2_resume["fp16"]
    data = fp16["report"]
    truth3 = torch.load(fp16["run"] / "truth-3.pt", weights_only=True)
    truth6 = torch.load(fp16["run"] / "truth-6.pt", weights_only=True)
    assert truth3["skipped_steps"] == 0 and truth3["loss_scaler"]["cur_scale"] == 512.0  # moved from 2**8
    assert data["fsdp_version"] == 2 and data["parameter_class"] == "DTensor"
    assert data["param_dtype"] == "torch.float16" and data["master_dtype"] == "torch.float32"
    assert data["mismatches"] == [], data["mismatches"]
    assert data["checked_tensors"] == 63 and len(data["control_mismatches"]) == 63
    assert data["adam_step_count"] == 21 and data["adam_steps"] == [3.0]
    assert data["global_step_at_resume"] == 3 and data["lr_at_resume"] == data["truth_lr"]
    deepspeed = fp16["run_state"]["loss_scaler"]["deepspeed"]
    for key, value in truth3["loss_scaler"].items():
        assert deepspeed[key] == value, key
    assert data["grad_scaler"] == "GradScaler" and data["scale_at_resume"] == truth3["loss_scaler"]["cur_scale"]
    assert data["final_global_step"] == 6 and "scaler.pt" in data["final_save"]
    assert data["final_scale"] == truth6["loss_scaler"]["cur_scale"] == 1024.0  # grew at the step DeepSpeed's did


def _logged(checkpoint, key: str) -> dict:
    history = json.loads((checkpoint / "trainer_state.json").read_text())["log_history"]
    return {entry["step"]: entry[key] for entry in history if key in entry}


def test_the_fp16_runs_next_logged_losses_are_deepspeeds_in_fp16(fsdp2_resume):
    """FSDP2's MixedPrecisionPolicy casts the model's outputs to fp16 (Accelerate sets output_dtype to the
    param dtype), the loss among them, so the Trainer logs the loss rounded to fp16; DeepSpeed returns it
    as the model computed it (transformers' causal-LM loss upcasts to fp32). Step 4 runs on the loaded
    state: its loss is DeepSpeed's rounded to fp16 and its gradient norm DeepSpeed's to the bit (the same
    fp16 forward and backward, the same scale). Steps 5-6 follow an update whose arithmetic differs
    (DeepSpeed unscales and clips in one multiply, `torch.amp.GradScaler` and `clip_grad_norm_` in two):
    within one fp16 spacing of DeepSpeed's."""
    fp16 = fsdp2_resume["fp16"]
    deepspeed, resumed = _logged(fp16["run"] / "checkpoint-6", "loss"), _logged(fp16["resumed"] / "checkpoint-6", "loss")
    print(f"\nfp16 logged losses, DeepSpeed: {deepspeed}\n                    FSDP2 resumed: {resumed}")
    assert sorted(deepspeed) == [1, 2, 3, 4, 5, 6] and sorted(resumed) == [1, 2, 3, 4, 5, 6]
    assert resumed[4] == torch.tensor(deepspeed[4]).half().item()
    norms = _logged(fp16["run"] / "checkpoint-6", "grad_norm"), _logged(fp16["resumed"] / "checkpoint-6", "grad_norm")
    assert norms[1][4] == norms[0][4]
    for step in (5, 6):
        assert abs(resumed[step] - deepspeed[step]) <= _fp16_ulp(deepspeed[step]), (step, resumed[step], deepspeed[step])


def test_an_autotp_trainer_save_resumes_under_fsdp2_from_the_accelerate_export(fsdp2_resume):
    """DeepSpeed ZeRO-1 AutoTP (tp 2) Trainer checkpoint -> `--layout accelerate` -> FSDP2 at dp 2: every
    parameter, exp_avg and exp_avg_sq equals the AutoTP engine's, its TP slices joined whole as DeepSpeed cut
    them (the truth: reshard_proof.tensor_parallel.full_state), Adam step 3; Accelerate's layout; the
    Trainer's files carried, nothing of DeepSpeed's; the source untouched."""
    tp = fsdp2_resume["autotp"]
    data = tp["report"]
    assert data["fsdp_version"] == 2 and data["parameter_class"] == "DTensor" and data["world_size"] == 2
    assert data["mismatches"] == [], data["mismatches"]
    assert data["checked_tensors"] == 63 and len(data["control_mismatches"]) == 63
    assert data["adam_step_count"] == 21 and data["adam_steps"] == [3.0]
    assert data["global_step_at_resume"] == data["truth_global_step"] == 3 and data["lr_at_resume"] == data["truth_lr"]
    assert data["final_global_step"] == 6
    assert (tp["source"] / "global_step3" / "mp_rank_01_model_states.pt").is_file()  # a TP save: a file per TP rank
    for directory in DIRECTORIES:
        ours, theirs = _described(_metadata(tp["export"] / directory)), \
            _described(_metadata(tp["resumed"] / "checkpoint-6" / directory))
        assert ours == theirs, (directory, set(ours) ^ set(theirs))
    exported = tree_files(tp["export"])
    for name in ("trainer_state.json", "scheduler.pt", "rng_state_0.pth", "rng_state_1.pth", "config.json"):
        assert exported[name] == tp["source_files"][name], name
    assert not any(name.startswith(("global_step", "latest", "zero_to_", ".reshard")) for name in exported)
    assert tree_files(tp["source"]) == tp["source_files"]


def test_the_autotp_runs_next_logged_losses_are_deepspeeds_to_rounding(fsdp2_resume):
    """Steps 4-6 under FSDP2 log DeepSpeed's AutoTP losses to a relative 1e-6 (a few fp32 spacings), not to
    the bit: AutoTP sums each row-parallel product (o_proj, down_proj) as two half-sums all-reduced, where
    FSDP2 runs the whole matmul; and each AutoTP rank's loss is the mean over both rows, FSDP2's the mean of
    two one-row means (equal token counts, so the same value but another rounding). Same batches: the AutoTP
    run is dp 1 with 2 rows, the FSDP2 run dp 2 with one row each, the same 2 rows."""
    tp = fsdp2_resume["autotp"]
    deepspeed, resumed = _logged(tp["run"] / "checkpoint-6", "loss"), _logged(tp["resumed"] / "checkpoint-6", "loss")
    print(f"\nAutoTP logged losses, DeepSpeed: {deepspeed}\n                      FSDP2 resumed: {resumed}")
    assert sorted(deepspeed) == [1, 2, 3, 4, 5, 6] and sorted(resumed) == [1, 2, 3, 4, 5, 6]
    assert all(resumed[step] == deepspeed[step] for step in (1, 2, 3))  # carried in trainer_state.json
    for step in (4, 5, 6):
        assert resumed[step] == pytest.approx(deepspeed[step], rel=1e-6, abs=0), (step, resumed[step], deepspeed[step])
