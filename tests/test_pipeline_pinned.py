"""Pins the bytes reshard writes for every pipeline case the suite reshards, recorded before the one road.

    python -m pytest -q tests/test_pipeline_pinned.py      # the session's pipeline saves (4 training launches, shared)

Issue 37 moves PipelineModule saves from their own road (jobs/pipeline_job.py, whole tensors) onto
the planner and `execute()`; its outputs must stay byte for byte what they are today, or each
difference be explained and judged by a DeepSpeed load. This file holds today's bytes: for every
case of tests/test_pipeline.py, test_pipeline_model_axis.py and test_pipeline_tp_change.py (each
`reshard` run with its own target, options and worker count, imported from those files so the pins
follow their cases), test_pipeline_array.py's collective references, and every export of
test_pipeline_export.py and test_pipeline_tp_change.py (safetensors and universal), the SHA-256 of
each output file (the manifest aside: it names paths and times), kept in
tests/data/pipeline_output_pins.json. The cases reshard in threads from the session's saves
(`pipeline_runs`, `tp_saves`): no training or judging launch of its own, about 15 s for all.
tests/test_node_local_pipeline.py's outputs are not pinned here (their own two-node training): that
test asserts each node's files equal, byte for byte, the collective job's on the gathered save.

Training on CPU with fixed seeds is bit-deterministic for these saves: every save, trained twice
(the four launches each twice, on this machine), gave identical files, truths included, and the
outputs of every case below were identical from both. A different CPU or torch build may train
to other values: each save's truth (every fp32 master, moment, loss and counter the source engine
gave) is digested beside the hashes, and where a save's truth differs from the recorded one the
test cannot judge and fails naming the reason (a skip would pass without checking anything).
Recorded with the code at commit a71fda2 (main at df346a7 plus the transport cycle's removal).
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e


def _cases() -> dict:
    """name -> (save, job): save ("runs", variant, pp, dp) (conftest `pipeline_runs`) or ("tp", variant)
    (conftest `tp_saves`); job ("reshard", target (pp, tp or None, dp), workers, options) or
    ("safetensors" | "universal", workers)."""
    import test_pipeline
    import test_pipeline_model_axis as axis
    import test_pipeline_tp_change as tp_change
    from test_pipeline_export import SAVES
    cases = {}
    for variant, source, target, workers in [*test_pipeline.CASES, *axis.CASES]:
        options = {"target_pp": target[0], **tp_change.LAYERS} if target[0] != source[0] else {}
        cases[f"{variant}-pp{source[0]}-dp{source[1]}-to-pp{target[0]}-dp{target[1]}-w{workers}"] = (
            ("runs", variant, *source), ("reshard", (target[0], None, target[1]), workers, options))

    def tp_case(variant, target, workers):
        pp, tp, dp = target
        return ("tp", variant), ("reshard", target, workers, {"target_pp": pp, "target_tp": tp, **tp_change.LAYERS})
    for target, workers in tp_change.TARGETS.items():
        cases[f"{tp_change.VARIANT}-to-pp{target[0]}-tp{target[1]}-dp{target[2]}-w{workers}"] = tp_case(
            tp_change.VARIANT, target, workers)
    # the round trip: the (1, 1, 4) output back to (2, 2, 1) with 2 workers (tp_changes' ROUND_TRIP)
    cases[f"{tp_change.VARIANT}-round-trip"] = (("tp", tp_change.VARIANT), ("round trip",))
    cases[f"{tp_change.TP1_VARIANT}-to-pp2-tp2-dp1-w3"] = tp_case(tp_change.TP1_VARIANT, (2, 2, 1), 3)
    for (precision, target), (variant, workers) in tp_change.OTHER_VARIANTS.items():
        cases[f"{variant}-to-pp{target[0]}-tp{target[1]}-dp{target[2]}-w{workers}"] = tp_case(variant, target, workers)
    # test_pipeline_array's collective references (W = 2), which its array tasks' outputs equal file for file
    for variant, target in (("fp32", (2, 3)), ("fp32", (3, 2)), ("fp32-mp2", (1, 2))):
        options = {"target_pp": target[0], **tp_change.LAYERS} if target[0] != 2 else {}
        cases[f"{variant}-pp2-dp1-to-pp{target[0]}-dp{target[1]}-w2"] = (
            ("runs", variant, 2, 1), ("reshard", (target[0], None, target[1]), 2, options))
    cases[f"{tp_change.VARIANT}-to-pp2-tp1-dp2-w2"] = tp_case(tp_change.VARIANT, (2, 1, 2), 2)
    for variant, pp, dp in SAVES.values():  # pipeline_exports: W = 2 both ways
        for kind in ("safetensors", "universal"):
            cases[f"{variant}-pp{pp}-dp{dp}-{kind}"] = (("runs", variant, pp, dp), (kind, 2))
    for variant in tp_change.EXPORTED.values():  # axis_exports: safetensors W = 2, universal W = 3
        cases[f"{variant}-safetensors"] = (("tp", variant), ("safetensors", 2))
        cases[f"{variant}-universal"] = (("tp", variant), ("universal", 3))
    return cases


def save_and_truth(save, pipeline_runs, tp_saves) -> tuple[Path, Path]:
    return pipeline_runs(*save[1:]) if save[0] == "runs" else tp_saves[save[1]]


def produce(job, save_dir: Path, out: Path) -> Path:
    """Run `job` on `save_dir` into `out` as the owning test file does; the directory whose files are pinned."""
    from test_pipeline import BATCH_SETTINGS_CHANGE
    from threaded_transport import run_workers
    from trained import reshard_in_threads

    from reshard.export import export_safetensors, export_universal
    if job[0] == "reshard":
        (pp, tp, dp), workers, options = job[1:]
        reshard_in_threads(save_dir, out, dp, workers, **{**options, **BATCH_SETTINGS_CHANGE})
        return out
    if job[0] == "round trip":
        from test_pipeline_tp_change import LAYERS
        first = out.parent / f"{out.name}-first"
        reshard_in_threads(save_dir, first, 4, 2, target_pp=1, target_tp=1, **LAYERS)
        reshard_in_threads(first, out, 1, 2, target_pp=2, target_tp=2, **LAYERS)
        return out
    kind, workers = job
    if kind == "safetensors":
        run_workers(workers, lambda t: export_safetensors(str(save_dir), str(out), max_shard_size="4KB", transport=t))
    else:
        run_workers(workers, lambda t: export_universal(str(save_dir), str(out), transport=t))
    return out


def tree_hashes(root: Path) -> dict:
    """relative path -> SHA-256 of every file under `root` but the manifest (it names paths and times)."""
    found = {}
    for directory, _, names in os.walk(root):
        for name in names:
            if name != "reshard_manifest.json":
                path = Path(directory) / name
                found[str(path.relative_to(root))] = hashlib.sha256(path.read_bytes()).hexdigest()
    return dict(sorted(found.items()))


RUN_STATE_KEYS = ("lr_scheduler", "adam_steps")
"""What tests/pipeline_run.py records for the DCP judge since the pins were recorded (pipeline_run.run_state):
a record of the run, not a trained value the pinned outputs depend on, so not digested."""


def truth_dir_digest(truth: Path) -> str:
    """SHA-256 over every rank's truth file's values (test_output_pinned.truth_digest), in rank order, less
    RUN_STATE_KEYS."""
    from test_output_pinned import truth_digest
    digests = "".join(truth_digest(truth / name, leave_out=RUN_STATE_KEYS) for name in sorted(os.listdir(truth)))
    return hashlib.sha256(digests.encode()).hexdigest()


CASES = _cases()


@pytest.fixture(scope="module")
def produced(pipeline_runs, tp_saves, tmp_path_factory):
    """produced(name) -> the output directory of case `name`, made once per session, after its save's
    truth was found equal to the one the pins were recorded beside."""
    made = {}

    def produced(name: str) -> Path:
        if name not in made:
            assert name in PINNED, f"no pin recorded for {name} (a case added after the pins were taken)"
            save, job = CASES[name]
            save_dir, truth = save_and_truth(save, pipeline_runs, tp_saves)
            save_name = "/".join(map(str, save))
            digest = truth_dir_digest(truth)
            assert digest == TRUTH_DIGESTS[save_name], (
                f"{save_name} trained to other values on this machine than where the hashes were recorded (CPU or "
                f"torch build: truth digest {digest}, recorded {TRUTH_DIGESTS[save_name]}); the pin cannot judge "
                "the output here")
            made[name] = produce(job, save_dir, tmp_path_factory.mktemp("pinned") / "out")
        return made[name]
    return produced


@pytest.mark.parametrize("name", list(CASES))
def test_pipeline_output_bytes_are_pinned(produced, name):
    assert tree_hashes(produced(name)) == PINNED[name]


RESHARDS = [name for name, (_, job) in CASES.items() if job[0] in ("reshard", "round trip")]


@pytest.mark.parametrize("name", RESHARDS)
def test_the_main_roads_writer_makes_each_pinned_file_but_its_crcs(produced, tmp_path, name):
    """What the lowering onto the main road (docs/architecture.md, "One road") can keep: every .pt file
    the side road writes today (torch.save of whole trees), read back without torch and written again
    as the main road writes (`torch_pickle.write_skeleton_tree`: the structure first, each storage's
    bytes then put at its offset), equals the pinned file byte for byte but for the zip CRCs and the
    CRC half of `.data/serialization_id` (a skeleton records none: the writer of the CRC fix must fill
    them). So the pins can hold through the lowering if it builds the same trees."""
    from test_torch_save_layouts import NAMES, _without_crcs

    from reshard.formats.torch_bytes import torch_pickle, torch_zip
    from reshard.formats.torch_bytes.torch_archive import pinned_writer_layout
    layout, why_not = pinned_writer_layout()  # the installed torch's
    assert why_not is None, why_not
    files = sorted(produced(name).rglob("*.pt"))
    assert files
    for path in files:
        out = tmp_path / path.relative_to(produced(name))  # the same name: it is the archive prefix
        out.parent.mkdir(parents=True, exist_ok=True)
        torch_pickle.write_skeleton_tree(out, torch_pickle.read_portable(path, NAMES), NAMES, layout)
        original, rewritten = path.read_bytes(), bytearray(out.read_bytes())
        with torch_zip.ArchiveReader(str(path)) as theirs, torch_zip.ArchiveReader(str(out)) as ours:
            assert list(ours.infos) == list(theirs.infos), path
            for record, info in theirs.infos.items():
                assert ours.infos[record].data_offset == info.data_offset, (path, record)
                if record.startswith("data/"):
                    rewritten[info.data_offset:info.data_offset + info.file_size] = \
                        original[info.data_offset:info.data_offset + info.file_size]
        out.write_bytes(bytes(rewritten))
        assert _without_crcs(out) == _without_crcs(path), path


def _pins() -> tuple[dict, dict]:
    """(truth digest by save, hashes by case) from tests/data/pipeline_output_pins.json."""
    import json
    recorded = json.loads((Path(__file__).parent / "data" / "pipeline_output_pins.json").read_text())
    return recorded["truth_digests"], recorded["pinned"]


TRUTH_DIGESTS, PINNED = _pins()
