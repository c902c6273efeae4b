"""The checks every job runs before it writes (reshard.jobs.preflight), on a checkpoint written
without DeepSpeed (bench/synthetic_checkpoint.py, whose files test_synthetic_checkpoint holds to
DeepSpeed's): no process, no training.

    PYTHONPATH=$PWD python -m pytest -q tests/test_preflight.py
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from reshard.errors import OptionError
from reshard.formats.deepspeed_files.deepspeed_inspect import inspect_checkpoint, resolve_tag
from reshard.jobs.options import ReshardOptions
from reshard.formats.deepspeed_files.stage_change import SameStage, StageChange
from reshard.jobs.preflight import CheckpointTarget, checkpoint_target, preflight, target_topology
from reshard.topology import Topology

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

from synthetic_checkpoint import MODELS, write_checkpoint  # noqa: E402


def test_preflight_checks_the_one_target_it_is_given(tmp_path):
    """The job derives its target once (target_topology) and hands it down: preflight refuses what
    that value asks for, and derives no second target from the options."""
    source_dir = tmp_path / "src"
    write_checkpoint(str(source_dir), MODELS["tiny"], 2, 2)  # ZeRO-2, 2 ranks, no AutoTP metadata
    source = inspect_checkpoint(str(source_dir), resolve_tag(str(source_dir), None))
    opts = ReshardOptions(source=str(source_dir), destination=str(tmp_path / "dst"), target_dp=3,
                          target_tp=2).validate()
    target = target_topology(opts, source)
    assert target == Topology(dp=3, tp=2)
    with pytest.raises(OptionError, match=r"mp_rank_00_model_states.pt: --target-tp 2: this checkpoint has no "
                                          r"AutoTP tensor-parallel metadata"):
        preflight(opts, source, target, [])
    assert preflight(opts, source, Topology(dp=3), []) == []  # the value given is the one checked


def test_the_collective_target_is_one_value_of_topology_and_zero_stage(tmp_path):
    """checkpoint_target: the topology and the ZeRO stage form together, worked out once on the
    inspecting worker (the job receives it with the source); refused as target_topology refuses."""
    source_dir = tmp_path / "src"
    write_checkpoint(str(source_dir), MODELS["tiny"], 2, 2)  # ZeRO-2, 2 ranks
    source = inspect_checkpoint(str(source_dir), resolve_tag(str(source_dir), None))

    def target(**options):
        return checkpoint_target(ReshardOptions(source=str(source_dir), destination=str(tmp_path / "dst"),
                                                target_dp=3, **options).validate(), source)

    assert target() == CheckpointTarget(Topology(dp=3), SameStage(2))
    assert target(target_stage=2) == CheckpointTarget(Topology(dp=3), SameStage(2))
    assert target(target_stage=3) == CheckpointTarget(Topology(dp=3), StageChange(3))
    with pytest.raises(OptionError, match="has no experts, so the target ep must be 1"):
        target(target_ep=3)  # the topology's own refusal, as target_topology gives it
