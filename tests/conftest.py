"""Shared test set-up: CPU DeepSpeed, the tests directory on sys.path, session-wide checkpoints.

    python -m pytest -q                  # everything
    python -m pytest -q -m "not e2e"     # the fast tier: no process started, no checkpoint trained

A test that starts a process (torchrun, a python subprocess, forked workers) or trains is marked
`@pytest.mark.e2e`; an unmarked one that tries fails at that call (`refuse_processes_outside_e2e`).
A test that asks `trained` for checkpoints names them with `@pytest.mark.trains((variant, n[, steps]), ...)`
(on the module, or on a parametrized case): the session trains every one named by a test it runs
in one launch per N when the first test asks. An unnamed one is trained on first use, alone.
"""
from __future__ import annotations

import _posixsubprocess
import os
import subprocess
import sys

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before anything imports deepspeed
sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(scope="session")
def trained(tmp_path_factory, request):
    """trained(variant, n) -> (save_dir, truth_path): a real checkpoint, trained once per session.
    Every checkpoint the session's tests name with `@pytest.mark.trains` is trained when the first
    test asks, one launch per N whatever the steps (trained.TrainedCheckpoints.prepare), since the
    launch is what costs."""
    from trained import TrainedCheckpoints, checkpoints_named
    checkpoints = TrainedCheckpoints(tmp_path_factory.mktemp("trained"))
    checkpoints.prepare([(variant, n, steps) for steps, wanted in checkpoints_named(request.session.items).items()
                         for variant, n in wanted])  # one launch per N, whatever the steps
    return checkpoints


@pytest.fixture(scope="session")
def autotp_trained(tmp_path_factory):
    """autotp_trained(tp, dp, stage, precision[, model]) -> (save_dir, truth): an AutoTP checkpoint
    (reshard_proof.tensor_parallel), trained once per session."""
    from trained import AutoTPCheckpoints
    return AutoTPCheckpoints(tmp_path_factory.mktemp("autotp"))


@pytest.fixture(scope="session")
def torchrun_output(trained, tmp_path_factory):
    """torchrun_output(variant, n, m) -> DST of a 2-worker torchrun reshard, made once per session."""
    from trained import TorchrunOutputs
    return TorchrunOutputs(tmp_path_factory.mktemp("torchrun-outputs"), trained)


@pytest.fixture(scope="session")
def pipeline_runs(tmp_path_factory):
    """pipeline_runs(variant, pp, dp) -> (save_dir, truth_dir): a PipelineModule save (tests/pipeline_run.py),
    trained once per session and shared by tests/test_pipeline.py and tests/test_pipeline_export.py."""
    from test_pipeline import PipelineRuns
    return PipelineRuns(tmp_path_factory.mktemp("pipeline"))


@pytest.fixture(scope="session")
def tp_saves(tmp_path_factory):
    """{"fp32-mp2u" | "fp32-mp1u" | "bf16-groups-mp2u" | "fp16-mp2u" | "fp32-frozen-mp2u": (save, truth)}: ONE
    training launch on 4 ranks, the (pp, tp, dp) = (2, 2, 1) save of tests/pipeline_run.py's Megatron-style model (its
    universal_checkpoint_info patterns as client state), then (pipeline_run.py train --more) the same
    model at (2, 1, 2) built with PipeModelDataParallelTopology at tp 1, as DeepSpeed writes it
    (`-model_00` layer files), then the model in bf16 with two param groups and a buffer at (2, 2, 1),
    then in fp16 (dynamic loss scaling) at (2, 2, 1), then in fp32 with the column-parallel weight
    "1.weight" frozen after the build at (2, 2, 1). Shared by tests/test_pipeline_tp_change.py and
    tests/test_pipeline_array.py."""
    from reshard_proof.launch import run_torchrun
    from test_pipeline import HARNESS
    root = tmp_path_factory.mktemp("pipeline-tp-saves")
    places = {v: (root / v / "ckpt", root / v / "truth")
              for v in ("fp32-mp2u", "fp32-mp1u", "bf16-groups-mp2u", "fp16-mp2u", "fp32-frozen-mp2u")}
    run_torchrun(HARNESS, 4, ["train", "--pp", 2, "--variant", "fp32-mp2u", "--save", places["fp32-mp2u"][0],
                              "--truth", places["fp32-mp2u"][1], "--more", "fp32-mp1u", *places["fp32-mp1u"],
                              "--more", "bf16-groups-mp2u", *places["bf16-groups-mp2u"],
                              "--more", "fp16-mp2u", *places["fp16-mp2u"],
                              "--more", "fp32-frozen-mp2u", *places["fp32-frozen-mp2u"]],
                 expect_files=[truth / f"rank{r}.pt" for _, truth in places.values() for r in range(4)], timeout=500)
    return places


@pytest.fixture(scope="session")
def moe_sources(tmp_path_factory):
    """moe_sources(variant, ep, world) -> (save_dir, truth): a native DeepSpeed MoE or AutoEP save
    (reshard_proof.moe_run), trained once per session, several at one (ep, world) in one launch
    (`train_many`); shared by tests/test_expert_parallel.py and tests/test_export_dcp.py."""
    from test_expert_parallel import MoeSources
    return MoeSources(tmp_path_factory.mktemp("moe"))


@pytest.fixture(scope="session")
def folded_sources(tmp_path_factory):
    """folded_sources(name) -> (save_dir, truth): an AutoEP save folded with AutoTP (reshard_proof.folded_tp_ep,
    tests/test_expert_parallel.py FOLDED_SOURCES), trained once per session, one launch per (nproc, tp, ep);
    shared by tests/test_expert_parallel.py and tests/test_export_dcp.py."""
    from test_expert_parallel import FoldedSources
    return FoldedSources(tmp_path_factory.mktemp("folded"))


@pytest.fixture(scope="session")
def hf_trained(tmp_path_factory):
    """hf_trained(name) -> directory of a Hugging Face Trainer / Accelerate run at 2 ranks (tests/hf_runs.py)."""
    from hf_runs import HfRuns
    return HfRuns(tmp_path_factory.mktemp("hf"))


@pytest.fixture(autouse=True)
def refuse_processes_outside_e2e(request, monkeypatch):
    """Outside e2e tests every way of starting a process raises: subprocess (its own reference to
    fork_exec, and posix_spawn), multiprocessing's spawn (_posixsubprocess.fork_exec) and fork
    (os.fork, as the forked workers)."""
    if request.node.get_closest_marker("e2e") is not None:
        return

    def refuse(*args, **kwargs):
        raise AssertionError(f"{request.node.nodeid} starts a process: mark it @pytest.mark.e2e")
    monkeypatch.setattr(_posixsubprocess, "fork_exec", refuse)
    monkeypatch.setattr(subprocess, "_fork_exec", refuse)
    for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp"):
        if hasattr(os, name):
            monkeypatch.setattr(os, name, refuse)
