"""ZeRO-Offload: saves trained with optimizer (and, at stage 3, parameter) offload resharded 2 -> 3.

    python -m pytest -q tests/test_offload.py          # builds DeepSpeedCPUAdam once, trains, judges

The saves are reshard_proof's `z2_offload` (ZeRO-2 fp32, offload_optimizer cpu) and `z3_offload`
(ZeRO-3 bf16, offload_optimizer and offload_param cpu), both with the optimizer DeepSpeed builds from
the config's AdamW under offload: DeepSpeedCPUAdam, a CPU op compiled once before any rank starts
(reshard_proof.cpu_ops; about 3 minutes on a clean machine, then cached in TORCH_EXTENSIONS_DIR).
Offload changes no file: the output is loaded with plain `load_checkpoint` at 3 ranks by an
engine with offload and by one without (`NAME@nooffload`: the same DeepSpeedCPUAdam as a client
optimizer), and in-job from the save itself by both, every master and moment compared with the
source engine's truth, then one more step trained. One judging launch for the eight loads.
"""
from __future__ import annotations

import pytest
from trained import judge_together, reshard_in_threads

from reshard.inspect_report import client_optimizer_family, configured_optimizer_class, inspect_report

SAVES = ("z2_offload", "z3_offload")
TARGET_DP = 3

pytestmark = pytest.mark.trains(*((variant, 2) for variant in SAVES))


@pytest.fixture(scope="module")
def offload_loads(trained, tmp_path_factory):
    """{(variant, engine, in_job): verdict} for every save, loaded at 3 ranks with and without offload."""
    root = tmp_path_factory.mktemp("offload")
    jobs = []
    for variant in SAVES:
        source, truth = trained(variant, 2)
        destination = root / variant
        reshard_in_threads(source, destination, TARGET_DP, 2)
        for engine in (variant, f"{variant}@nooffload"):
            name = engine.replace("@", "-")
            jobs.append((TARGET_DP, engine, destination, truth, root / f"{name}.json"))
            jobs.append((TARGET_DP, engine, source, truth, root / f"{name}-in-job.json", True))
    verdicts = judge_together(jobs)
    return {(job[1].partition("@")[0], job[1], len(job) > 5): verdicts[str(job[4])] for job in jobs}


@pytest.mark.e2e
@pytest.mark.parametrize("in_job", (False, True), ids=("offline", "in-job"))
@pytest.mark.parametrize("offload", (True, False), ids=("offload", "no-offload"))
@pytest.mark.parametrize("variant", SAVES)
def test_offload_save_loads_at_another_size_with_and_without_offload(offload_loads, variant, offload, in_job):
    engine = variant if offload else f"{variant}@nooffload"
    verdict = offload_loads[(variant, engine, in_job)]
    assert not isinstance(verdict, Exception), verdict
    assert verdict["ok"], verdict["load_error"] or verdict["mismatches"]
    assert verdict["world_size"] == TARGET_DP and verdict["source_world_size"] == 2
    assert verdict["checked_tensors"] > 30  # masters, both moments, module values, frozen, buffers, ...
    assert all(len(losses) == 1 for losses in verdict["extra_step_losses"])


@pytest.mark.e2e
@pytest.mark.parametrize("variant", SAVES)
def test_inspect_names_the_optimizer_that_ran(trained, variant):
    """On main, inspect said "over AdamW" (the config's type) where DeepSpeedCPUAdam ran."""
    source, _ = trained(variant, 2)
    report = inspect_report(source)
    assert report.ok, report.problems
    assert report.optimizer["base_optimizer"] == "DeepSpeedCPUAdam (ds_config AdamW, offload_optimizer cpu)"
    assert "over DeepSpeedCPUAdam" in report.text()


def test_optimizer_named_from_config_and_from_param_groups():
    adamw = {"optimizer": {"type": "AdamW", "params": {}}}
    assert configured_optimizer_class(adamw) == "FusedAdam (ds_config AdamW)"
    assert configured_optimizer_class({**adamw, "zero_optimization": {"offload_optimizer": {"device": "nvme"}}}
                                 ) == "DeepSpeedCPUAdam (ds_config AdamW, offload_optimizer nvme)"
    assert configured_optimizer_class({"optimizer": {"type": "Adam", "params": {"torch_adam": True}},
                                  "zero_optimization": {"offload_optimizer": {"device": "cpu"}}}
                                 ).startswith("torch.optim.AdamW")
    assert configured_optimizer_class({}) is None
    assert client_optimizer_family([{"lr": 1, "betas": (0.9, 0.9), "bias_correction": True, "amsgrad": False}]
                                 ) == "DeepSpeedCPUAdam (client optimizer)"
    assert client_optimizer_family([{"lr": 1, "betas": (0.9, 0.9), "decoupled_weight_decay": True}]
                                 ) == "AdamW (client optimizer)"
