"""SLURM array mode for DeepSpeed PipelineModule checkpoints: K tasks without collectives, out of
order, one failing mid-unit and re-run, publish the collective pipeline job's output byte for byte.

    python -m pytest -q tests/test_pipeline_array.py -m "not e2e"   # the dealing of items to tasks, no DeepSpeed run
    python -m pytest -q tests/test_pipeline_array.py                # the session's fp32 and fp32-mp2 (2, 1) saves

A target (stage, model rank) unit (its model-states file and its optimizer files, built together
from the unit's whole tensors; a stage, without a model axis) is one item; the layer files are
items of their own, dealt by size with the units. The e2e tests reshard the shared saves (conftest
`pipeline_runs`, also used by tests/test_pipeline.py and tests/test_pipeline_model_axis.py, whose
native loads prove the collective job's output) with the collective job, in threads, and with array
tasks in this process, then compare every file, manifest included.
"""
from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
from test_pipeline import BATCH_SETTINGS_CHANGE
from trained import reshard_in_threads, tree_files

from reshard.errors import ReshardError
from reshard.formats.deepspeed_pipeline import LAYER_RE, PipelineSource, PipelineStage
from reshard.jobs.array_job import PIPELINE_LAYER, PIPELINE_STAGE, deal_files, item_file_names, pipeline_files
from reshard.jobs.options import ReshardOptions
from reshard.jobs.pipeline_job import PipelineTarget, stage_output_bytes
from reshard.layouts.model_axis import model_axis_rules
from reshard.layouts.pipeline import PipelineLayers, assign_stages
from reshard.topology import Topology

# tests/pipeline_run.py's model: what the checkpoint does not record, for a pp change (as tests/test_pipeline.py)
PP_CHANGE = {"pipeline_layers": 7, "pipeline_tied": "embed:0,6"}


def _fake_source(root: Path, tp: int = 1) -> PipelineSource:
    """A (pp, dp) = (2, 2) save of tests/pipeline_run.py's parameter names, files of zeros sized
    12 bytes per element (an fp32 master and two moments), layer files of assorted sizes; with `tp`
    model ranks, each (stage, model rank)'s files, model rank m's optimizer files m + 1 times as large
    (so that a unit weighed by another's files would show)."""
    numels = {"tied_modules.embed.weight": 888, "1.weight": 984, "1.bias": 41, "3.weight": 984, "3.bias": 24,
              "4.weight": 24, "4.bias": 24, "5.weight": 576, "5.bias": 24}
    saved = assign_stages("parameters", PipelineLayers(7, {"embed": (0, 6)}), numels, 2)
    stages = tuple(PipelineStage(s, (tuple(names),), (tuple(numels[n] for n in names),))
                   for s, names in enumerate(saved.names))
    layers = ("layer_00-model_states.pt", "layer_01-model_states.pt", "layer_03-model_states.pt",
              "layer_04-model_states.pt", "layer_05-model_states.pt")
    if tp > 1:
        layers = tuple(name.replace("-model_states", f"-model_{m:02d}-model_states") for name in layers
                       for m in range(tp))
    source = PipelineSource(str(root), "t", 2, 2, False, False, stages, layers, ("metric.json",), tp)
    (root / "t").mkdir()
    for stage in stages:
        for model in range(tp):
            Path(source.model_path(stage.index, model)).write_bytes(b"\0" * 700)
            for rank in range(2):
                Path(source.optim_path(stage.index, rank, model)).write_bytes(
                    b"\0" * ((model + 1) * 12 * sum(stage.numels[0]) // 2))
    for i, name in enumerate((*layers, "metric.json")):
        (root / "t" / name).write_bytes(b"\0" * (4000 - 300 * i))
    return source


@pytest.mark.parametrize("source_tp", [1, 2], ids=["stages", "model-axis"])
def test_pipeline_items_are_dealt_whole_once_each_deterministically(tmp_path, source_tp):
    source = _fake_source(tmp_path, source_tp)
    numels = {n: c for stage in source.stages for n, c in zip(stage.names[0], stage.numels[0])}
    layers = PipelineLayers(7, {"embed": (0, 6)})
    targets = {"kept": PipelineTarget(Topology(dp=3, tp=source_tp, pp=2), None),
               "pp 3": PipelineTarget(Topology(dp=2, tp=source_tp, pp=3),
                                      assign_stages("parameters", layers, numels, 3))}
    if source_tp > 1:  # tp 2 -> 1 (every parameter replicated here, so the shapes stay the source's)
        targets["tp 1"] = PipelineTarget(Topology(dp=2, tp=1, pp=2), assign_stages("parameters", layers, numels, 2),
                                         model_axis_rules({"tp_replicated_parameter_patterns": [".*"]}),
                                         {n: (c,) for n, c in numels.items()}, layers)
    for label, target in targets.items():
        tp = target.topology.tp
        items = pipeline_files(0, source, target)
        sizes = stage_output_bytes(source, target)
        units = [f for f in items if f.name.startswith(PIPELINE_STAGE)]
        # one item per (stage, model rank), its rank the unit's mp_rank_XX index stage * tp + model
        assert [(f.rank, f.nbytes) for f in units] == list(enumerate(sizes)), label
        assert len({f.name for f in units}) == target.topology.pp * tp
        layer_files = source.layer_files
        if target.tp_changed:  # each layer index's files re-cut, one item; none of the source's copied
            indices = (0, 1, 3, 4, 5)
            assert [(f.name, f.layer) for f in items if f.layer is not None] == [
                (f"{PIPELINE_LAYER}{i:02d}", i) for i in indices], label
            layer_files = tuple(f"layer_{i:02d}-model_00-model_states.pt" for i in indices)
            assert [f.name for f in items if f.rank is None and f.layer is None] == ["metric.json"]
        else:
            assert not any(f.layer is not None for f in items)
            assert sorted(f.name for f in items if f.rank is None) == sorted((*layer_files, "metric.json"))
        if target.stages is None:  # a kept unit weighs its own source files: model rank 1's twice as large
            assert sizes[1 * tp + tp - 1] == 700 + tp * 12 * sum(source.stages[1].numels[0])
        pp, dp = target.topology.pp, target.topology.dp
        output = {f"mp_rank_{u:02d}_model_states.pt" for u in range(pp * tp)} | {
            f"zero_pp_rank_{d}_mp_rank_{u:02d}_optim_states.pt" for u in range(pp * tp) for d in range(dp)} | {
            *layer_files, "metric.json"}
        # the tasks' shares together write every file of the output once
        written = [name for f in items for name in item_file_names(f, source, target)]
        assert len(written) == len(output) and set(written) == output, label
        for tasks in (1, 2, 3, 5):
            owners = deal_files(items, tasks)
            shuffled = items[1::2] + items[::2]  # the same items in another order: the same owners
            assert dict(zip(shuffled, deal_files(shuffled, tasks))) == dict(zip(items, owners))
            loads = [sum(f.nbytes for f, o in zip(items, owners) if o == t) for t in range(tasks)]
            assert max(loads) - min(loads) <= max(f.nbytes for f in items), (label, tasks, loads)
            assert len(set(owners)) == min(tasks, len(items))


ON_ROAD_BUDGET = "4K"
"""The budget array tasks on the plan run under (test_pipeline_stage_change's): many rounds per task, where
the whole-tensor builders refuse anything below a unit's tensors."""


@pytest.mark.e2e
@pytest.mark.parametrize("variant, target, tasks, options", [
    ("fp32", (2, 3), 2, {}), ("fp32", (3, 2), 3, {"target_pp": 3, **PP_CHANGE}),
    # the model-axis save of tests/test_pipeline_model_axis.py ((pp, tp, dp) = (2, 2, 1)): tp kept, pp 2 -> 1,
    # its target files (stage, dp rank, model rank) dealt one by one
    ("fp32-mp2", (1, 2), 3, {"target_pp": 1, **PP_CHANGE}),
    # conftest `tp_saves`' Megatron-style (2, 2, 1) save to tp 1: each layer index's files re-cut, one item
    # (the source's two slices per layer, copied, would publish wrong files with exit 0)
    ("fp32-mp2u", (2, 2), 3, {"target_pp": 2, "target_tp": 1, **PP_CHANGE})],
    ids=["dp-change", "pp-change", "model-axis-pp-change", "tp-change"])
def test_array_tasks_out_of_order_one_retried_publish_the_collective_output(request, tmp_path, monkeypatch,
                                                                            variant, target, tasks, options):
    """The cases collective_job.keeps_pipeline_columns accepts (model ranks kept) run on the plan: each
    task's target files through the one-worker plan restricted to them, under a 4 KiB --memory-budget
    (by rounds); a tp change still on the whole-tensor builders, at the default budget. Either way one
    task fails mid-share (the disk fills), the others run in reverse order, and the re-run task
    publishes the collective job's output (pinned in tests/test_pipeline_pinned.py) file for file."""
    import torch

    import reshard.formats.target_writer as target_writer
    from reshard.formats.deepspeed_pipeline import inspect_pipeline
    from reshard.jobs.array_job import inspect_unit, publish_main
    from reshard.jobs.collective_job import pipeline_on_road, run_job
    from reshard.jobs.pipeline_job import pipeline_target
    from reshard.jobs.runs import Unit
    save_dir, _ = (request.getfixturevalue("tp_saves")[variant] if "target_tp" in options
                   else request.getfixturevalue("pipeline_runs")(variant, 2, 1))
    options = {**options, **BATCH_SETTINGS_CHANGE}  # the save's train_batch_size is for dp 1
    on_road = True  # every pipeline case: the whole-tensor builders are gone from array tasks (issue 37)
    dp = target[1]
    expected, destination = tmp_path / "collective", tmp_path / "array"
    reshard_in_threads(save_dir, expected, dp, 2, **options)

    def opts(task: int) -> ReshardOptions:
        return ReshardOptions(source=str(save_dir), destination=str(destination), target_dp=dp, array_task=task,
                              array_tasks=tasks, quiet=True, **options,
                              **({"memory_budget": ON_ROAD_BUDGET} if on_road else {})).validate()

    # the task to fail: one dealt a target file (or unit) and some copied or re-cut layer files
    if on_road:
        job = inspect_unit(opts(0), Unit(str(save_dir), "step3", str(destination), "step3"), pipeline_on_road)
        assert job.source.spec.columns is not None  # on the plan, not the whole-tensor builders
        items = job.files(0)

        def names_of(item):
            return [item.name]
        tp = job.target.tp
    else:
        source = inspect_pipeline(str(save_dir), "step3")
        planned = pipeline_target(opts(0), source)
        tp = planned.topology.tp
        items = pipeline_files(0, source, planned)

        def names_of(item):
            return item_file_names(item, source, planned)
    owners = deal_files(items, tasks)
    # a task with copied layer files and target files; with tp changed the layer files are re-cut target
    # files of the plan (nothing copied), so a task with two target files
    failing = next((t for t in range(tasks) if {f.rank is None for f, o in zip(items, owners) if o == t}
                    == {True, False}), None)
    if failing is None:
        assert "target_tp" in options, [(f.name, o) for f, o in zip(items, owners)]
        failing = next(t for t in range(tasks) if sum(f.rank is not None for f, o in zip(items, owners) if o == t) > 1)
    its_targets = [f for f, o in zip(items, owners) if o == failing and f.rank is not None]
    # layer items, written before the target files: copied files, or with tp changed each index's re-cut files
    its_layers = [f for f, o in zip(items, owners) if o == failing and f.rank is None]
    its_items = owners.count(failing)
    if on_road:  # the disk fills as the task creates its second target file (the first is begun, never done)
        assert len(its_targets) > 1, its_targets
        fills_at = its_targets[1].name
        begun = [f.name for f in its_targets if f.rank == min(t.rank for t in its_targets)][0]
        skeleton = target_writer.write_tree_skeleton

        def skeleton_until_full(path, *args, **kwargs):
            if os.path.basename(str(path)) == fills_at:
                raise OSError(errno.ENOSPC, "No space left on device", str(path))
            return skeleton(path, *args, **kwargs)
        monkeypatch.setattr(target_writer, "write_tree_skeleton", skeleton_until_full)
    else:  # the disk fills as the task saves its unit's second file (dp rank 0's optimizer file)
        unit_files = names_of(its_targets[0])
        fills_at, begun = unit_files[1], unit_files[0]
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
    kept = {name: os.stat(staged / name) for f in its_layers  # marked done: a re-run must leave them
            for name in names_of(f)}
    if begun != fills_at:
        assert (staged / begun).is_file()  # begun, not finished
    results = [run_job(opts(task)) for task in reversed([t for t in range(tasks) if t != failing])]
    assert publish_main([str(destination)]) == 1 and not (destination / "latest").exists()
    retried = run_job(opts(failing))
    if its_layers:
        assert f"{len(its_layers)} of this task's {its_items} file(s) were already done" in retried.summary()
    assert "this task completed the set" in retried.summary()
    if on_road:  # by rounds under the budget: every task that wrote a target file moved it in several
        rounds = [r.checkpoints[0].rounds for r in (*results, retried) if r.checkpoints[0].reports[0].target_ranks]
        assert rounds and min(rounds) > 1, rounds
        # each task reads only the source bytes its files hold (and copies its layer files): together no
        # more than the output's bytes
        reports = [r.checkpoints[0].reports[0] for r in (*results, retried)]
        read = sum(r.bytes_read + r.bytes_carried for r in reports)
        output = sum(p.stat().st_size for p in (destination / "step3").iterdir() if p.suffix == ".pt")
        assert 0 < read <= output, (read, output)
    for name, before in kept.items():
        after = os.stat(destination / "step3" / name)
        assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns), name
    assert tree_files(destination) == tree_files(expected)  # every file, the manifest included
    names = os.listdir(destination / "step3")
    assert sum(bool(LAYER_RE.match(n)) for n in names) == 6 * tp
    assert f"mp_rank_{target[0] * tp - 1:02d}_model_states.pt" in names
    assert f"mp_rank_{target[0] * tp:02d}_model_states.pt" not in names
    assert "nothing to do" in run_job(opts(failing)).summary()  # a retry after the end
