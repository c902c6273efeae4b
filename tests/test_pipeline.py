"""DeepSpeed PipelineModule checkpoints: dp changes per stage; other pp refused by name.

    python -m pytest -q tests/test_pipeline.py -m "not e2e"   # seconds, no DeepSpeed run
    python -m pytest -q tests/test_pipeline.py                # trains on 2 and 4 CPU ranks

The e2e tests train a tied PipelineModule (tests/pipeline_run.py) at (pp, dp), reshard it with
several workers, load it natively with plain `load_checkpoint` in an engine from another seed at
the target (pp, dp), and compare every fp32 master and Adam moment by name, the eval loss on a
fixed micro-batch, the step counters, the LR and client_state with the source engine's; one more
`train_batch` then runs.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from reshard.errors import OptionError, UnsupportedCheckpoint
from reshard.formats.deepspeed_pipeline import LAYER_RE, PipelineSource, PipelineStage
from reshard.options import ReshardOptions
from reshard.pipeline_job import stages_written_by, target_topology

HARNESS = "tests.pipeline_run"  # run as `-m tests.pipeline_run` from the repository root


def _source(pp: int = 2, dp: int = 1) -> PipelineSource:
    stage = PipelineStage(0, (("tied_modules.embed.weight",),), ((888,),))
    return PipelineSource("/ckpt", "step3", pp, dp, False, False, (stage,) * pp, ("layer_00-model_states.pt",), ())


def test_layer_file_names_with_and_without_a_model_axis():
    assert LAYER_RE.match("layer_07-model_states.pt")[1] == "07"
    assert LAYER_RE.match("layer_07-model_01-model_states.pt")[3] == "01"
    assert not LAYER_RE.match("layer_7_expert_0_mp_rank_00_model_states.pt")


def test_every_stage_is_built_by_exactly_one_worker():
    assert stages_written_by(5, 2) == ((0, 2, 4), (1, 3))
    assert stages_written_by(2, 3) == ((0,), (1,), ())


def test_changing_pp_is_refused_naming_what_the_checkpoint_lacks():
    with pytest.raises(UnsupportedCheckpoint, match="layer count and the positions of its TiedLayerSpec"):
        target_topology(ReshardOptions(source="a", destination="b", target_dp=2, target_pp=1), _source())
    kept = target_topology(ReshardOptions(source="a", destination="b", target_dp=3, target_pp=2), _source())
    assert (kept.pp, kept.dp) == (2, 3)
    with pytest.raises(OptionError, match="--target-tp 2 is not supported for pipeline"):
        target_topology(ReshardOptions(source="a", destination="b", target_dp=2, target_tp=2), _source())


class PipelineRuns:
    """(precision, pp, dp) -> (save_dir, truth_dir), trained once per session with tests/pipeline_run.py."""

    def __init__(self, root: Path):
        self.root, self.cache = root, {}

    def __call__(self, precision: str, pp: int, dp: int):
        from reshard_proof.launch import run_torchrun
        key = (precision, pp, dp)
        if key not in self.cache:
            base = self.root / f"{precision}-pp{pp}-dp{dp}"
            truth = base / "truth"
            run_torchrun(HARNESS, pp * dp, ["train", "--pp", pp, "--precision", precision,
                                                 "--save", base / "ckpt", "--truth", truth],
                         expect_files=[truth / f"rank{r}.pt" for r in range(pp * dp)], timeout=500)
            self.cache[key] = (base / "ckpt", truth)
        return self.cache[key]


def check_at(pp: int, dp: int, precision: str, load_dir, truth, verdict: Path) -> dict:
    from reshard_proof.launch import run_torchrun
    run_torchrun(HARNESS, pp * dp, ["check", "--pp", pp, "--precision", precision, "--load", load_dir,
                                         "--truth", truth, "--verdict", verdict],
                 expect_files=[verdict], timeout=500)
    return json.loads(verdict.read_text())


@pytest.fixture(scope="module")
def pipeline_runs(tmp_path_factory):
    return PipelineRuns(tmp_path_factory.mktemp("pipeline"))


@pytest.mark.e2e
@pytest.mark.parametrize("precision, source, target, workers", [
    ("fp32", (2, 1), (2, 2), 2),   # dp up; W equals the target dp
    ("bf16", (2, 2), (2, 1), 3),   # dp down; W differs from both
    ("fp32", (2, 1), (1, 2), 1),   # pp down, dp up
    ("bf16", (2, 2), (3, 1), 2),   # pp up, dp down
])
def test_pipeline_reshard_loads_natively_equal_to_the_source(pipeline_runs, tmp_path, precision, source, target,
                                                             workers):
    from trained import reshard_in_threads
    save_dir, truth = pipeline_runs(precision, *source)
    out = tmp_path / "out"
    options = {}
    if target[0] != source[0]:  # what the checkpoint lacks: tests/pipeline_run.py's layer list
        options = {"target_pp": target[0], "pipeline_layers": 7, "pipeline_tied": "embed:0,6"}
    result = reshard_in_threads(save_dir, out, target[1], workers, **options)
    [checkpoint] = result.checkpoints
    assert (checkpoint.target_topology.pp, checkpoint.target_topology.dp) == target
    tag_dir = out / "step3"
    names = sorted(os.listdir(tag_dir))
    prefix = "bf16_" if precision == "bf16" else ""
    assert [n for n in names if n.endswith("optim_states.pt")] == sorted(
        f"{prefix}zero_pp_rank_{d}_mp_rank_{s:02d}_optim_states.pt" for s in range(target[0]) for d in range(target[1]))
    for name in names:  # layer files travel unchanged
        if LAYER_RE.match(name):
            assert (tag_dir / name).read_bytes() == (save_dir / "step3" / name).read_bytes()
    verdict = check_at(*target, precision, out, truth, tmp_path / "verdict.json")
    assert verdict["ok"], verdict
    assert sum(rank["checked"] for rank in verdict["ranks"]) >= 9  # every parameter on some rank


@pytest.mark.e2e
def test_pipeline_pp_change_without_the_layer_list_exits_2_and_writes_nothing(pipeline_runs, tmp_path):
    from trained import reshard_cli
    save_dir, _ = pipeline_runs("fp32", 2, 1)
    out = tmp_path / "out"
    run = reshard_cli(save_dir, out, "--target-dp", "2", "--target-pp", "1")
    assert run.returncode == 2, run.stderr
    assert "mp_rank_00_model_states.pt: --target-pp 1 (the save has 2 stages)" in run.stderr
    assert "give --pipeline-layers N" in run.stderr
    assert not out.exists()


def test_partitions_equal_deepspeeds_own():
    import random

    from deepspeed.runtime import utils as ds_utils

    from reshard.pipeline_layout import partition_balanced, partition_uniform
    rng = random.Random(5)
    for _ in range(300):
        n, parts = rng.randint(0, 12), rng.randint(1, 6)
        weights = [rng.choice([0, 0, 1, 7, 24, 600, 888]) for _ in range(n)]
        assert partition_uniform(n, parts) == list(ds_utils.partition_uniform(n, parts)), (n, parts)
        assert partition_balanced(weights, parts) == [int(x) for x in ds_utils.partition_balanced(weights, parts)], \
            (weights, parts)


def test_stage_names_list_tied_modules_first_then_layers_in_order():
    from reshard.pipeline_layout import PipelineLayers, stage_bounds, stage_names
    numels = {"tied_modules.embed.weight": 888, "1.weight": 984, "1.bias": 41, "3.weight": 984, "3.bias": 24,
              "4.weight": 24, "4.bias": 24, "5.weight": 576, "5.bias": 24}
    layers = PipelineLayers(7, {"embed": (0, 6)})
    bounds = stage_bounds("parameters", layers, numels, 2)
    assert bounds == [0, 3, 7]  # what DeepSpeed printed for tests/pipeline_run.py's model
    assert stage_names(layers, bounds, 1, list(numels)) == [
        "tied_modules.embed.weight", "3.weight", "3.bias", "4.weight", "4.bias", "5.weight", "5.bias"]
    assert stage_bounds("uniform", layers, numels, 2) == [0, 4, 7]  # the two methods differ on this model
    with pytest.raises(ValueError, match="class name"):
        stage_bounds("type:Linear", layers, numels, 2)


@pytest.mark.e2e
def test_pipeline_layers_that_do_not_reproduce_the_source_are_refused(pipeline_runs, tmp_path):
    from trained import reshard_cli
    save_dir, _ = pipeline_runs("fp32", 2, 1)
    out = tmp_path / "out"
    run = reshard_cli(save_dir, out, "--target-dp", "2", "--target-pp", "1", "--pipeline-layers", "6",
                      "--pipeline-tied", "embed:0,5")
    assert run.returncode == 2, run.stderr
    assert "mp_rank_01_model_states.pt: holds" in run.stderr and "differ from the model's" in run.stderr
    assert not out.exists()


@pytest.mark.e2e
def test_inspect_describes_a_pipeline_save(pipeline_runs):
    from reshard.formats.deepspeed_pipeline import pipeline_summary
    save_dir, _ = pipeline_runs("bf16", 2, 2)
    summary = pipeline_summary(str(save_dir), None)
    assert (summary["pp"], summary["dp"], summary["bf16"]) == (2, 2, True)
    assert [(s["params"], s["elements"], s["tied"]) for s in summary["stages"]] == [
        (3, 888 + 984 + 41, ["embed"]), (7, 888 + 984 + 24 * 4 + 576, ["embed"])]
