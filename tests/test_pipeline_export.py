"""`reshard export` of DeepSpeed PipelineModule saves: safetensors under the module's own names, and universal.

    python -m pytest -q tests/test_pipeline_export.py -m "not e2e"   # naming rules, no DeepSpeed run
    python -m pytest -q tests/test_pipeline_export.py                # the session's pipeline saves, one judge launch

The e2e tests take the pipeline saves tests/test_pipeline.py trains (conftest `pipeline_runs`: fp32 at
(pp, dp) = (2, 1), bf16 and fp16 at (2, 2), and fp32 with layer 1's weight frozen after the build at
(2, 2); all with an embedding tied to the head), export each in threads both ways, convert each with
DeepSpeed's own ds_to_universal.py (one process for all), and judge in ONE torchrun launch at (1, 2):
the fp32 universal export loaded with `load_universal` (every master and Adam moment, the eval loss,
counters, LR and client state equal to the source engine's; one more train_batch), and every
safetensors export loaded with strict=True into a PipelineModule built afresh at pp=1, every tensor
equal to the source engine's fp32 master (frozen: its value). The universal exports are compared
with ds_to_universal's output file by file.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path

import pytest
import torch

from reshard.errors import CheckpointError, UnsupportedCheckpoint
from reshard.export.pipeline_layout import module_tensors
from reshard.formats.deepspeed_files.deepspeed_pipeline import PipelineSource, PipelineStage

HARNESS = "tests.pipeline_run"
SAVES = {"fp32": ("fp32", 2, 1), "bf16": ("bf16", 2, 2), "fp16": ("fp16", 2, 2), "frozen": ("fp32-frozen", 2, 2)}
# tests/pipeline_run.py's model: PipelineModule.state_dict() names
NAMES = ["tied_modules.embed.weight", "1.weight", "1.bias", "3.weight", "3.bias", "4.weight", "4.bias", "5.weight",
         "5.bias"]


# ---- naming rules, on crafted layer files --------------------------------------------------

def _source(tmp_path: Path, layers: dict, stages: list) -> PipelineSource:
    """A PipelineSource whose layer files hold `layers` ({index: {key: tensor}}) and whose stages list
    the trainable `stages` ([{name: shape}] per stage, one group)."""
    tag_dir = tmp_path / "t"
    tag_dir.mkdir()
    for index, state in layers.items():
        torch.save(state, tag_dir / f"layer_{index:02d}-model_states.pt")
    specs = tuple(PipelineStage(s, (tuple(names),), (tuple(torch.Size(v).numel() for v in names.values()),),
                                (tuple(tuple(v) for v in names.values()),)) for s, names in enumerate(stages))
    return PipelineSource(str(tmp_path), "t", len(stages), 1, False, False, specs,
                          tuple(f"layer_{i:02d}-model_states.pt" for i in layers), ())


def test_layer_files_are_named_as_pipeline_module_state_dict_names_them(tmp_path):
    # layer 0: the tied embedding (saved once, under its first index); layer 1: a Linear whose weight is
    # frozen (named by its index: its bias is trainable); layer 2: a function's empty file; layer 3: a
    # LayerNorm, all frozen, with the tied module's key names but other shapes (named by index)
    layers = {0: {"weight": torch.ones(5, 3)}, 1: {"weight": torch.zeros(3, 3, dtype=torch.bfloat16),
                                                   "bias": torch.zeros(3)},
              2: {}, 3: {"weight": torch.ones(3)}}
    source = _source(tmp_path, layers, [{"tied_modules.embed.weight": (5, 3), "1.bias": (3,)},
                                        {"tied_modules.embed.weight": (5, 3)}])
    model = module_tensors(source)
    assert [(t.name, t.stage, t.layer_file, t.dtype) for t in model.tensors] == [
        ("tied_modules.embed.weight", 0, "", "float32"),
        ("1.weight", -1, "layer_01-model_states.pt", "bfloat16"),
        ("1.bias", 0, "", "float32"),
        ("3.weight", -1, "layer_03-model_states.pt", "float32")]
    assert model.tied_files == {"layer_00-model_states.pt": "embed"}


def test_a_layer_file_that_two_tied_modules_could_own_is_refused(tmp_path):
    source = _source(tmp_path, {0: {"weight": torch.ones(2, 2)}},
                     [{"tied_modules.a.weight": (2, 2), "tied_modules.b.weight": (2, 2)}])
    with pytest.raises(UnsupportedCheckpoint, match=r"layer_00-model_states.pt: holds the trainable parameters of "
                                                    r"tied modules \['a', 'b'\]"):
        module_tensors(source)


def test_a_frozen_layer_that_looks_like_the_tied_module_is_refused_not_dropped(tmp_path):
    # layer 3: all frozen, the tied module's key and shape but other values: named like the tied module,
    # it would collide with layer 0's; refused rather than one of them silently dropped
    source = _source(tmp_path, {0: {"weight": torch.ones(2, 2)}, 3: {"weight": torch.zeros(2, 2)}},
                     [{"tied_modules.e.weight": (2, 2)}])
    with pytest.raises(UnsupportedCheckpoint, match=r"layer_03-model_states.pt: holds weight, named "
                                                    r"tied_modules.e.weight like layer_00-model_states.pt's weight"):
        module_tensors(source)


def test_a_layer_shape_other_than_param_shapes_is_refused(tmp_path):
    source = _source(tmp_path, {1: {"weight": torch.ones(2, 2)}}, [{"1.weight": (4,)}])
    with pytest.raises(CheckpointError, match=r"layer_01-model_states.pt: holds weight of shape \(2, 2\), but stage 0"):
        module_tensors(source)


# ---- end to end, on the session's pipeline saves -------------------------------------------

@pytest.fixture(scope="module")
def pipeline_exports(pipeline_runs, tmp_path_factory):
    """{save: {"save", "truth", "st", "ours", "theirs", "st_verdict"}} and "universal_verdict": every
    save exported both ways in threads (W = 2, safetensors in shards of 4 KB), converted by
    ds_to_universal.py, and judged in one check launch at (1, 2) (see the module docstring)."""
    from reshard_proof.ds_universal import ds_to_universal_all
    from reshard_proof.launch import run_torchrun
    from threaded_transport import run_workers

    from reshard.export import export_safetensors, export_universal
    root = tmp_path_factory.mktemp("pipeline-export")
    for variant, pp, dp in SAVES.values():  # trained (or found) first: the timings below are the exports' own
        pipeline_runs(variant, pp, dp)
    started, found = time.perf_counter(), {}
    for name, (variant, pp, dp) in SAVES.items():
        save, truth = pipeline_runs(variant, pp, dp)
        entry = {"save": save, "truth": truth, "st": root / name / "st", "ours": root / name / "ours",
                 "theirs": root / name / "theirs", "st_verdict": root / name / "st.json"}
        run_workers(2, lambda t, e=entry: export_safetensors(str(e["save"]), str(e["st"]), max_shard_size="4KB",
                                                             transport=t))
        run_workers(2, lambda t, e=entry: export_universal(str(e["save"]), str(e["ours"]), transport=t))
        found[name] = entry
    exported = time.perf_counter()
    failures = ds_to_universal_all([(e["save"] / "step3", e["theirs"] / "step3") for e in found.values()])
    # DeepSpeed 0.19.8's converter fails on the frozen save: with layer 1's weight out of stage 0's flat,
    # the tied embedding is split over stage 0's two dp ranks but whole on stage 1's dp rank 0, and
    # extract_zero_shards writes both stages' fragments to the same zero/<name>/0/fp32.<dp> files, so
    # stage 0's rank-1 piece is left over: 888 + 422 elements merged (no pipeline_replicated_params
    # entry in universal_checkpoint_info to skip stage 1's copy). reshard writes each tied
    # parameter from its first stage, whole: compared with the truth below.
    assert list(failures) == [str(found["frozen"]["theirs"] / "step3")], failures
    assert "shape '[37, 24]' is invalid for input of size 1310" in failures[str(found["frozen"]["theirs"] / "step3")]
    found["frozen"]["theirs"] = None
    converted = time.perf_counter()
    verdict = root / "universal.json"
    args = ["check", "--pp", 1, "--precision", "fp32", "--universal", "--load", found["fp32"]["ours"],
            "--truth", found["fp32"]["truth"], "--verdict", verdict]
    for entry in found.values():
        args += ["--safetensors", entry["st"], entry["truth"], entry["st_verdict"]]
    run_torchrun(HARNESS, 2, args, expect_files=[verdict, *(e["st_verdict"] for e in found.values())], timeout=500)
    found["universal_verdict"] = json.loads(verdict.read_text())
    print(f"[pipeline_exports] exports {exported - started:.1f} s, ds_to_universal {converted - exported:.1f} s, "
          f"judge launch {time.perf_counter() - converted:.1f} s", flush=True)
    return found


@pytest.mark.e2e
@pytest.mark.parametrize("save", list(SAVES))
def test_safetensors_export_loads_strictly_into_a_pipeline_module_at_pp1_equal_to_the_truth(pipeline_exports, save):
    entry = pipeline_exports[save]
    verdict = json.loads(entry["st_verdict"].read_text())
    assert verdict["ok"], verdict
    assert verdict["checked"] == len(NAMES) and sorted(verdict["names"]) == sorted(NAMES)
    index = json.loads((entry["st"] / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == sorted(NAMES)
    assert len(set(index["weight_map"].values())) > 1  # really sharded


@pytest.mark.e2e
def test_safetensors_export_is_byte_identical_for_any_worker_count(pipeline_exports, tmp_path):
    from threaded_transport import run_workers

    from reshard.export import export_safetensors
    entry = pipeline_exports["frozen"]
    out = tmp_path / "w3"
    run_workers(3, lambda t: export_safetensors(str(entry["save"]), str(out), max_shard_size="4KB", transport=t))
    names = sorted(p.name for p in entry["st"].iterdir())
    assert sorted(p.name for p in out.iterdir()) == names
    for name in names:
        assert (out / name).read_bytes() == (entry["st"] / name).read_bytes(), name


@pytest.mark.e2e
def test_safetensors_export_takes_relative_paths(pipeline_runs, tmp_path, monkeypatch):
    """`reshard export SRC out --format safetensors` of a pipeline save (the session's fp32 pp 2
    save) with SRC and OUT relative to the working directory: the same files as with absolute
    paths. On main it failed at publishing ("refusing to write outside the destination out")."""
    from trained import reshard_in_process

    save, _ = pipeline_runs("fp32", 2, 1)
    absolute = reshard_in_process("export", save, tmp_path / "absolute", "--format", "safetensors",
                                  "--max-shard-size", "4KB")
    assert absolute.returncode == 0, absolute.stdout + absolute.stderr
    monkeypatch.chdir(tmp_path)
    relative = reshard_in_process("export", os.path.relpath(save, tmp_path), "out", "--format", "safetensors",
                                  "--max-shard-size", "4KB")
    assert relative.returncode == 0, relative.stdout + relative.stderr
    names = sorted(p.name for p in (tmp_path / "absolute").iterdir())
    assert len(names) > 2 and sorted(p.name for p in (tmp_path / "out").iterdir()) == names
    for name in names:
        assert (tmp_path / "out" / name).read_bytes() == (tmp_path / "absolute" / name).read_bytes(), name


@pytest.mark.e2e
def test_universal_export_loads_with_load_universal_at_another_pp_and_dp(pipeline_exports):
    # (2, 1) -> (1, 2) through DeepSpeed's own load_universal: every master and moment, the eval loss,
    # counters, lr and client_state equal to the source engine's; one more train_batch ran
    verdict = pipeline_exports["universal_verdict"]
    assert verdict["ok"], verdict
    assert sum(rank["checked"] for rank in verdict["ranks"]) == 2 * len(NAMES)


def _truth(truth_dir: Path) -> dict:
    found = {}
    for path in sorted(truth_dir.iterdir()):
        found.update(torch.load(path, weights_only=True)["tensors"])
    return found


@pytest.mark.e2e
@pytest.mark.parametrize("save", list(SAVES))
def test_universal_export_holds_the_truth_and_equals_ds_to_universal_file_by_file(pipeline_exports, save):
    entry = pipeline_exports[save]
    ours, theirs, tag = entry["ours"], entry["theirs"], "step3"
    assert (ours / "latest_universal").read_text() == tag
    ours_files = {p.relative_to(ours) for p in ours.rglob("*") if p.is_file()}
    # every trainable parameter's master and Adam moments equal the source engine's; the frozen weight's
    # value (beyond ds_to_universal, which writes nothing for it) equals its layer file's
    truth = _truth(entry["truth"])
    assert sorted(truth) == sorted(NAMES)
    for name, states in truth.items():
        for key, want in states.items():
            got = torch.load(ours / tag / "zero" / name / f"{'fp32' if key == 'frozen' else key}.pt", weights_only=True)
            assert got.keys() == ({"param"} if key == "frozen" else {"cat_dim", "param"}), (name, key)
            assert got["param"].dtype == torch.float32 and torch.equal(got["param"], want.float()), (name, key)
        assert (ours / tag / "zero" / name / "step.pt").is_file() == ("frozen" not in states), name
    for stage in range(2):
        name = f"mp_rank_{stage:02d}_model_states.pt"
        assert (ours / tag / name).read_bytes() == (entry["save"] / tag / name).read_bytes()
    if theirs is None:  # DeepSpeed's converter fails on this save (see the fixture)
        return
    theirs_files = {p.relative_to(theirs) for p in theirs.rglob("*") if p.is_file()}
    assert ours_files == theirs_files, sorted(ours_files ^ theirs_files)
    checked = 0
    for relative in sorted(theirs_files):
        a, b = ours / relative, theirs / relative
        if relative.name.startswith("mp_rank_") or relative.name == "latest_universal":
            assert a.read_bytes() == b.read_bytes(), relative
        elif relative.name == "optimizer_state.pt":
            mine, deepspeeds = torch.load(a, weights_only=False), torch.load(b, weights_only=False)
            assert mine.keys() == deepspeeds.keys()
            assert mine["param_groups"] == deepspeeds["param_groups"]
        else:
            mine, deepspeeds = torch.load(a, weights_only=False), torch.load(b, weights_only=False)
            if isinstance(deepspeeds, dict):
                assert mine.keys() == deepspeeds.keys(), relative
                assert mine["param"].dtype == deepspeeds["param"].dtype, relative
                assert torch.equal(mine["param"], deepspeeds["param"]), relative
                checked += 1
            else:
                assert torch.equal(torch.as_tensor(mine), torch.as_tensor(deepspeeds)), relative
    assert checked == 3 * len(NAMES)  # fp32, exp_avg, exp_avg_sq of every parameter


@pytest.mark.e2e
def test_a_budget_far_below_a_stages_optimizer_bytes_exports_by_rounds_to_the_pinned_bytes(pipeline_runs, tp_saves,
                                                                                         tmp_path):
    # the whole-tensor road refused any budget below a stage's joined optimizer files ("the universal
    # export of a pipeline checkpoint joins each stage's optimizer files whole", exit 2); the main road
    # keeps 1 KiB (stage 0 alone holds 2.6 kB of fp32 masters, 7.7 kB with Adam's moments) by rounds, and
    # writes the pinned bytes (tests/test_pipeline_pinned.py), tp 2 joined over the model ranks too
    from test_pipeline_pinned import PINNED, tree_hashes
    from trained import reshard_in_process
    save, _ = pipeline_runs("fp32", 2, 1)
    universal = reshard_in_process("export", save, tmp_path / "u", "--format", "universal", "--memory-budget", "1K",
                                   "--workers", "2")
    assert universal.returncode == 0, universal.stderr
    rounds = int(re.search(r"(\d+) rounds", universal.stdout)[1])
    assert rounds > 100, universal.stdout
    assert tree_hashes(tmp_path / "u") == PINNED["fp32-pp2-dp1-universal"]
    mp2u, _ = tp_saves["fp32-mp2u"]
    st = reshard_in_process("export", mp2u, tmp_path / "st", "--format", "safetensors", "--memory-budget", "1K",
                            "--max-shard-size", "4KB", "--workers", "2")
    assert st.returncode == 0, st.stderr
    assert int(re.search(r"(\d+) rounds", st.stdout)[1]) > 10, st.stdout
    assert tree_hashes(tmp_path / "st") == PINNED["fp32-mp2u-safetensors"]


@pytest.mark.e2e
def test_pipeline_export_refusals_name_the_file(pipeline_runs, tmp_path):
    from trained import reshard_in_process  # the message, not the launcher
    save, _ = pipeline_runs("fp32", 2, 1)
    # a model axis suffix on one layer file of a save without one (tp_degree 1): inconsistent, refused
    # (at tp 1 either naming is DeepSpeed's, so the first file unlike the suffixed one is named)
    axis = tmp_path / "axis"
    shutil.copytree(save, axis)
    layer = axis / "step3" / "layer_01-model_states.pt"
    layer.rename(axis / "step3" / "layer_01-model_00-model_states.pt")
    refused = reshard_in_process("export", axis, tmp_path / "out", "--format", "safetensors")
    assert refused.returncode == 2, refused.stderr
    assert "layer_00-model_states.pt: has no -model_XX suffix, but other layer files of this tp_degree 1 save have " \
        "one" in refused.stderr
    # OUT holding something else: the lifecycle refuses before anything is written
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    refused = reshard_in_process("export", save, busy, "--format", "safetensors")
    assert refused.returncode == 2 and "not empty" in refused.stderr
    assert sorted(p.name for p in busy.iterdir()) == ["notes.txt"]


@pytest.mark.e2e
def test_a_failed_pipeline_export_leaves_nothing_and_the_same_command_then_succeeds(pipeline_runs, tmp_path,
                                                                                     monkeypatch):
    # the one lifecycle: worker 1 fails creating its files (a full disk), before any round; every worker
    # learns it, the staging, the lock and the OUT this run created are removed; the same command then publishes
    import errno

    from threaded_transport import run_workers

    from reshard.errors import ReshardError
    from reshard.export import export_universal, universal
    save, _ = pipeline_runs("fp32", 2, 1)
    real = universal.UniversalWriter.create

    def disk_full_on_worker_1(source, bundles, zero_dir, owned, *args, **kwargs):
        if 0 not in owned:
            raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "out"))
        return real(source, bundles, zero_dir, owned, *args, **kwargs)

    monkeypatch.setattr(universal.UniversalWriter, "create", disk_full_on_worker_1)
    out = tmp_path / "out"
    with pytest.raises(ReshardError, match="No space left on device"):
        run_workers(2, lambda t: export_universal(str(save), str(out), transport=t))
    assert not out.exists(), sorted(out.rglob("*"))
    monkeypatch.setattr(universal.UniversalWriter, "create", real)
    run_workers(2, lambda t: export_universal(str(save), str(out), transport=t))
    assert sorted(p.name for p in out.iterdir()) == ["latest_universal", "step3"]


@pytest.mark.e2e
@pytest.mark.parametrize("kind", ["universal", "safetensors", "dcp"])
def test_a_pipeline_export_that_fails_half_way_resumes_by_round_to_the_same_bytes(tp_saves, tmp_path, monkeypatch,
                                                                                  kind):
    # the main road's promise for a pipeline save with a model axis: a failure in the rounds keeps the
    # staging and its journal, publishes nothing, and the same command resumes from the last durable
    # round to the bytes of an uninterrupted export (the pinned ones for safetensors and universal); the
    # whole-tensor road started over
    import errno

    from test_pipeline_pinned import PINNED, tree_hashes
    from threaded_transport import run_workers

    from reshard.errors import ReshardError
    from reshard.export import export_dcp, export_safetensors, export_universal
    from reshard.export.dcp_job import DcpWriter
    from reshard.export.safetensors_writer import SafetensorsWriter
    from reshard.export.universal import UniversalWriter
    export, writer, extra = {"universal": (export_universal, UniversalWriter, {}),
                             "safetensors": (export_safetensors, SafetensorsWriter, {"max_shard_size": "4KB"}),
                             "dcp": (export_dcp, DcpWriter, {"chunk_bytes": 64})}[kind]
    save, _ = tp_saves["fp32-mp2u"]

    def run(out, **options):
        return run_workers(2, lambda t: export(str(save), str(out), memory_budget=2048, transport=t, **extra,
                                               **options))[0]

    real_write, calls = writer.write, {"n": 0, "fail_after": None}

    def disk_fills_up(self, *args):
        calls["n"] += 1
        if calls["fail_after"] is not None and calls["n"] > calls["fail_after"]:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(self, *args)

    monkeypatch.setattr(writer, "write", disk_fills_up)
    reference = tmp_path / "reference"
    run(reference)
    calls["n"], calls["fail_after"] = 0, calls["n"] // 2
    out = tmp_path / "out"
    with pytest.raises(ReshardError, match="re-run the same command to resume"):
        run(out, durable_every=1)
    monkeypatch.setattr(writer, "write", real_write)
    assert sorted(p.name for p in out.iterdir()) == [".reshard-staging"]
    result = run(out, durable_every=1)
    resumed = [note for note in result.notes if note.startswith("resuming an interrupted export")]
    assert resumed and not resumed[0].startswith("resuming an interrupted export: 0 of"), result.notes
    assert tree_hashes(out) == tree_hashes(reference)
    if kind != "dcp":
        assert tree_hashes(out) == PINNED[f"fp32-mp2u-{kind}"]


def test_an_averaged_tensor_of_a_model_axis_is_refused_by_name_not_read_from_one_rank():
    # ds_to_universal averages the model ranks' copies of a parameter_to_average_patterns tensor; the main
    # road reads model rank 0's alone, so at tp > 1 it refuses rather than take one copy unchecked
    from types import SimpleNamespace

    from reshard.export.pipeline_layout import ModuleTensor, PipelineModel, export_tensors
    from reshard.layouts.model_axis import model_axis_rules
    rules = model_axis_rules({"tp_replicated_parameter_patterns": [r"0\."],
                              "parameter_to_average_patterns": [r"1\.norm\."]})
    model = PipelineModel((ModuleTensor("0.weight", (4, 2), "float32", stage=0),
                           ModuleTensor("1.norm.weight", (2,), "float32", stage=1)), {}, rules)
    pipe = SimpleNamespace(tp=2, tag_dir="/ckpt/step3", model_path=lambda stage=0, model=0: "/ckpt/step3/mp_rank_00.pt")
    with pytest.raises(UnsupportedCheckpoint, match=r"^/ckpt/step3/mp_rank_00.pt: 1.norm.weight matches "
                                                    "parameter_to_average_patterns"):
        export_tensors(pipe, model, "float32")
    tensors, params = export_tensors(SimpleNamespace(**{**vars(pipe), "tp": 1}), model, "float32")  # tp 1: one copy
    assert [p.name for p in params] == ["0.weight", "1.norm.weight"]
