"""Topology: the one value rank counts derive from; its checks and where it shows.

    python -m pytest -q tests/test_topology.py
"""
from __future__ import annotations

import dataclasses

import pytest
from trained import reshard_cli

from reshard.errors import OptionError, TopologyError
from reshard.formats.deepspeed_files.deepspeed_schema import model_file_name_of, optim_file_name_of
from reshard.jobs.options import ReshardOptions
from reshard.topology import Topology

# the checkpoints its tests ask `trained` for, trained with the session's others (conftest.py)
pytestmark = pytest.mark.trains(("z2_fp32", 2))


def test_sizes_and_description():
    assert Topology(4).describe() == "dp=4 tp=1 ep=1"
    assert Topology(8, tp=2, ep=4).world_size == 16
    assert Topology(8, ep=4).expert_dp == 2
    assert Topology(2, pp=3).describe() == "dp=2 tp=1 ep=1 pp=3"


@pytest.mark.parametrize("sizes,message", [
    (dict(dp=0), "dp must be an integer >= 1, got 0"),
    (dict(dp=2, tp=-1), "tp must be an integer >= 1, got -1"),
    (dict(dp=True), "dp must be an integer >= 1, got True"),
    (dict(dp=2.0), "dp must be an integer >= 1, got 2.0"),
    (dict(dp=6, ep=4), "ep=4 does not divide dp=6"),
])
def test_impossible_topologies_are_refused_clearly(sizes, message):
    with pytest.raises(TopologyError, match=message):
        Topology(**sizes)
    assert issubclass(TopologyError, OptionError)  # the CLI exits with status 2


def test_coordinates_put_tp_fastest():
    topology = Topology(dp=3, tp=2)
    assert [(c.dp, c.tp) for c in map(topology.coordinates, range(6))] == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0),
                                                                          (2, 1)]
    with pytest.raises(TopologyError, match="rank 6 is outside a world of 6"):
        topology.coordinates(6)


def test_file_names_follow_the_coordinates():
    assert optim_file_name_of(Topology(4), 3, bf16=True) == "bf16_zero_pp_rank_3_mp_rank_00_optim_states.pt"
    assert optim_file_name_of(Topology(2, tp=2), 3, bf16=False) == "zero_pp_rank_1_mp_rank_01_optim_states.pt"
    assert model_file_name_of(Topology(2, tp=2), 3, stage=3) == "zero_pp_rank_1_mp_rank_01_model_states.pt"
    assert model_file_name_of(Topology(2, tp=2), 3, stage=2) == "mp_rank_01_model_states.pt"


def test_options_give_the_target_topology():
    options = ReshardOptions(source="a", destination="b", target_dp=6).validate()
    assert options.target_topology == Topology(6)
    with pytest.raises(OptionError, match="--target-dp must be an integer >= 1"):
        ReshardOptions(source="a", destination="b", target_dp=0).validate()


@pytest.mark.e2e
def test_dry_run_prints_both_topologies(trained, tmp_path):
    source, _ = trained("z2_fp32", 2)
    done = reshard_cli(source, tmp_path / "dst", "--target-dp", "6", "--dry-run")
    assert done.returncode == 0, done.stderr
    assert "source dp=2 tp=1 ep=1 -> target dp=6 tp=1 ep=1" in done.stdout


def test_dry_run_summary_prints_each_note_once():
    """A dry run's summary lists the notes (MoE placement, TP splits) once, above the traffic table."""
    from reshard.jobs.results import CheckpointResult
    note = "MoE layer 0 (4 experts) at ep=2: EP rank 0: experts 0-1, EP rank 1: experts 2-3"
    result = CheckpointResult("src", "dst", "global_step3", "ZeRO-2 float32", Topology(dp=2), Topology(dp=4, ep=2),
                              2, "gloo", 0, 0.0, True, None, notes=[note])
    summary = result.summary()
    assert summary.count(note) == 1 and "source dp=2 tp=1 ep=1 -> target dp=4 tp=1 ep=2" in summary


def test_a_pipeline_targets_stages_travel_on_its_topology_and_stay_out_of_its_equality():
    # issue 37: the spec describes the source; a target at another pp carries its own stages
    # (Topology.stages), which CheckpointSpec.layout lays out for that target and for no other topology
    from reshard.formats.deepspeed_files.deepspeed_spec import CheckpointSpec
    from reshard.layouts.zero import DEFAULT_SUB_GROUP_SIZE, ParamSpec, Stream
    from reshard.planning.checkpoint_plan import plan_reshard
    from reshard.topology import PipelineStages
    a, b, c = ParamSpec("0.w", (4,)), ParamSpec("1.w", (6,)), ParamSpec("2.w", (2,))
    columns = (((a, b), ((0, 1),)), ((c,), ((0,),)))  # the source: two stages
    spec = CheckpointSpec(1, "adam", False, Topology(dp=1, pp=2), (a, b, c), columns[0][1], False, 1,
                          DEFAULT_SUB_GROUP_SIZE, "float32", (Stream("fp32", "float32", 4),), columns=columns)
    target = Topology(dp=2, pp=1, stages=PipelineStages((((a, b, c), ((0, 1, 2),)),), (("0.b",),)))
    assert target == Topology(dp=2, pp=1) and hash(target) == hash(Topology(dp=2, pp=1))
    assert [p.name for p in spec.layout(target, 1, 0, 0).params] == ["0.w", "1.w", "2.w"]
    assert [p.name for p in spec.layout(spec.topology, 1, 0, 1).params] == ["2.w"]  # the source's own
    plan = plan_reshard(spec, target, 1, 1 << 20)
    assert [s.name for s in plan.spaces] == ["optim"]
    assert not any(f.name.startswith("target") for f in dataclasses.fields(CheckpointSpec))
