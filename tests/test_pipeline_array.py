"""SLURM array mode for DeepSpeed PipelineModule checkpoints: K tasks without collectives, out of
order, one failing mid-stage and re-run, publish the collective pipeline job's output byte for byte.

    python -m pytest -q tests/test_pipeline_array.py -m "not e2e"   # the dealing of items to tasks, no DeepSpeed run
    python -m pytest -q tests/test_pipeline_array.py                # the session's fp32 (2, 1) pipeline save

A target stage (its model-states file and its optimizer files, built together from the stage's
whole tensors) is one item; the layer files are items of their own, dealt by size with the
stages. The e2e tests reshard the shared save (conftest `pipeline_runs`, also used by
tests/test_pipeline.py, whose native loads prove the collective job's output) with the collective
job, in threads, and with array tasks in this process, then compare every file, manifest included.
"""
from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
from trained import reshard_in_threads, tree_files

from reshard.errors import OptionError, ReshardError
from reshard.formats.deepspeed_pipeline import LAYER_RE, PipelineSource, PipelineStage, stage_file_names
from reshard.jobs.array_job import PIPELINE_STAGE, deal_files, pipeline_files
from reshard.jobs.options import ReshardOptions
from reshard.jobs.pipeline_job import PipelineTarget, stage_output_bytes
from reshard.layouts.pipeline import PipelineLayers, assign_stages
from reshard.topology import Topology

# tests/pipeline_run.py's model: what the checkpoint does not record, for a pp change (as tests/test_pipeline.py)
PP_CHANGE = {"pipeline_layers": 7, "pipeline_tied": "embed:0,6"}


def _fake_source(root: Path) -> PipelineSource:
    """A (pp, dp) = (2, 2) save of tests/pipeline_run.py's parameter names, files of zeros sized
    12 bytes per element (an fp32 master and two moments), layer files of assorted sizes."""
    numels = {"tied_modules.embed.weight": 888, "1.weight": 984, "1.bias": 41, "3.weight": 984, "3.bias": 24,
              "4.weight": 24, "4.bias": 24, "5.weight": 576, "5.bias": 24}
    saved = assign_stages("parameters", PipelineLayers(7, {"embed": (0, 6)}), numels, 2)
    stages = tuple(PipelineStage(s, (tuple(names),), (tuple(numels[n] for n in names),))
                   for s, names in enumerate(saved.names))
    layers = ("layer_00-model_states.pt", "layer_01-model_states.pt", "layer_03-model_states.pt",
              "layer_04-model_states.pt", "layer_05-model_states.pt")
    source = PipelineSource(str(root), "t", 2, 2, False, False, stages, layers, ("metric.json",))
    (root / "t").mkdir()
    for stage in stages:
        (root / "t" / f"mp_rank_{stage.index:02d}_model_states.pt").write_bytes(b"\0" * 700)
        for rank in range(2):
            Path(source.optim_path(stage.index, rank)).write_bytes(b"\0" * (12 * sum(stage.numels[0]) // 2))
    for i, name in enumerate((*layers, "metric.json")):
        (root / "t" / name).write_bytes(b"\0" * (4000 - 600 * i))
    return source


def test_pipeline_items_are_dealt_whole_once_each_deterministically(tmp_path):
    source = _fake_source(tmp_path)
    numels = {n: c for stage in source.stages for n, c in zip(stage.names[0], stage.numels[0])}
    targets = {"kept": PipelineTarget(Topology(dp=3, pp=2), None),
               "pp 3": PipelineTarget(Topology(dp=2, pp=3),
                                      assign_stages("parameters", PipelineLayers(7, {"embed": (0, 6)}), numels, 3))}
    for label, target in targets.items():
        items = pipeline_files(0, source, target)
        sizes = stage_output_bytes(source, target)
        stages = [f for f in items if f.name.startswith(PIPELINE_STAGE)]
        assert [(f.rank, f.nbytes) for f in stages] == list(enumerate(sizes)), label
        assert sorted(f.name for f in items if f.rank is None) == sorted((*source.layer_files, "metric.json"))
        if target.stages is None:  # a kept stage weighs its source files
            assert sizes[1] == 700 + 12 * sum(source.stages[1].numels[0])
        pp, dp = target.topology.pp, target.topology.dp
        output = {f"mp_rank_{s:02d}_model_states.pt" for s in range(pp)} | {
            f"zero_pp_rank_{d}_mp_rank_{s:02d}_optim_states.pt" for s in range(pp) for d in range(dp)} | {
            *source.layer_files, "metric.json"}
        for tasks in (1, 2, 3, 5):
            owners = deal_files(items, tasks)
            shuffled = items[1::2] + items[::2]  # the same items in another order: the same owners
            assert dict(zip(shuffled, deal_files(shuffled, tasks))) == dict(zip(items, owners))
            # the tasks' shares together write every file of the output once
            written = [name for f in items for name in (stage_file_names(f.rank, dp, False) if f.rank is not None
                                                         else [f.name])]
            assert len(written) == len(output) and set(written) == output, label
            loads = [sum(f.nbytes for f, o in zip(items, owners) if o == t) for t in range(tasks)]
            assert max(loads) - min(loads) <= max(f.nbytes for f in items), (label, tasks, loads)
            assert len(set(owners)) == min(tasks, len(items))


@pytest.mark.e2e
def test_a_memory_budget_no_array_task_can_hold_is_refused_by_every_task(pipeline_runs, tmp_path):
    from reshard.jobs.collective_job import run_job
    save_dir, _ = pipeline_runs("fp32", 2, 1)
    for task in range(2):
        with pytest.raises(OptionError, match=r"zero_pp_rank_0_mp_rank_00_optim_states.pt: pipeline checkpoints are "
                                              r"resharded with whole tensors .* array task \d would hold about"):
            run_job(ReshardOptions(source=str(save_dir), destination=str(tmp_path / "out"), target_dp=2,
                                   array_task=task, array_tasks=2, memory_budget="1K").validate())
    assert not (tmp_path / "out").exists()


@pytest.mark.e2e
@pytest.mark.parametrize("target, tasks, options", [((2, 3), 2, {}), ((3, 2), 3, {"target_pp": 3, **PP_CHANGE})],
                         ids=["dp-change", "pp-change"])
def test_array_tasks_out_of_order_one_retried_publish_the_collective_output(pipeline_runs, tmp_path, monkeypatch,
                                                                            target, tasks, options):
    import torch

    from reshard.formats.deepspeed_pipeline import inspect_pipeline
    from reshard.jobs.array_job import publish_main
    from reshard.jobs.collective_job import run_job
    from reshard.jobs.pipeline_job import pipeline_target
    save_dir, _ = pipeline_runs("fp32", 2, 1)
    dp = target[1]
    expected, destination = tmp_path / "collective", tmp_path / "array"
    reshard_in_threads(save_dir, expected, dp, 2, **options)

    def opts(task: int) -> ReshardOptions:
        return ReshardOptions(source=str(save_dir), destination=str(destination), target_dp=dp, array_task=task,
                              array_tasks=tasks, quiet=True, **options).validate()

    # the task to fail: one dealt a stage and some layer files
    source = inspect_pipeline(str(save_dir), "step3")
    items = pipeline_files(0, source, pipeline_target(opts(0), source))
    owners = deal_files(items, tasks)
    failing = next(t for t in range(tasks) if {f.rank is None for f, o in zip(items, owners) if o == t} == {True, False})
    stage = next(f.rank for f, o in zip(items, owners) if o == failing and f.rank is not None)
    its_layers = [f.name for f, o in zip(items, owners) if o == failing and f.rank is None]
    its_items = owners.count(failing)
    # the disk fills as the task saves its stage's second file (dp rank 0's optimizer file)
    fills_at = stage_file_names(stage, dp, False)[1]
    save = torch.save

    def save_until_full(obj, path, *args, **kwargs):
        if os.path.basename(str(path)) == fills_at:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return save(obj, path, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save_until_full)
    with pytest.raises(ReshardError, match=f"re-run array task {failing} to write the rest"):
        run_job(opts(failing))
    monkeypatch.undo()
    staged = destination / ".reshard-staging" / "step3"
    kept = {name: os.stat(staged / name) for name in its_layers}  # marked done: a re-run must leave them
    assert (staged / stage_file_names(stage, dp, False)[0]).is_file()  # the stage was begun, not finished
    for task in reversed([t for t in range(tasks) if t != failing]):
        run_job(opts(task))
    assert publish_main([str(destination)]) == 1 and not (destination / "latest").exists()
    retried = run_job(opts(failing))
    assert f"{len(its_layers)} of this task's {its_items} file(s) were already done" in retried.summary()
    assert "this task completed the set" in retried.summary()
    for name, before in kept.items():
        after = os.stat(destination / "step3" / name)
        assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns), name
    assert tree_files(destination) == tree_files(expected)  # every file, the manifest included
    names = os.listdir(destination / "step3")
    assert sum(bool(LAYER_RE.match(n)) for n in names) == 6 and f"mp_rank_{target[0] - 1:02d}_model_states.pt" in names
    assert "nothing to do" in run_job(opts(failing)).summary()  # a retry after the end
