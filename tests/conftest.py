"""Shared test set-up: CPU DeepSpeed, the tests directory on sys.path, session-wide checkpoints.

    python -m pytest -q                  # everything
    python -m pytest -q -m "not e2e"     # without the multi-rank DeepSpeed runs
"""
from __future__ import annotations

import os
import sys

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before anything imports deepspeed
sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(scope="session")
def trained(tmp_path_factory):
    """trained(variant, n) -> (save_dir, truth_path): a real checkpoint, trained once per session."""
    from trained import TrainedCheckpoints
    return TrainedCheckpoints(tmp_path_factory.mktemp("trained"))


@pytest.fixture(scope="session")
def torchrun_output(trained, tmp_path_factory):
    """torchrun_output(variant, n, m) -> DST of a 2-worker torchrun reshard, made once per session."""
    from trained import TorchrunOutputs
    return TorchrunOutputs(tmp_path_factory.mktemp("torchrun-outputs"), trained)


@pytest.fixture(scope="session")
def hf_trained(tmp_path_factory):
    """hf_trained(name) -> directory of a Hugging Face Trainer / Accelerate run at 2 ranks (tests/hf_runs.py)."""
    from hf_runs import HfRuns
    return HfRuns(tmp_path_factory.mktemp("hf"))
