"""SLURM array mode for DeepSpeed PipelineModule checkpoints: K tasks without collectives, out of
order, one failing mid-unit and re-run, publish the collective pipeline job's output byte for byte.

    python -m pytest -q tests/test_pipeline_array.py     # the session's fp32, fp32-mp2 and fp32-mp2u saves

Each task writes its share of the target files through the one-worker plan restricted to them, as for
a ZeRO save (every pipeline case: dp, pp and tp change); the layer files are items of their own,
copied with tp kept and re-cut target files with tp changed. The e2e tests reshard the shared saves (conftest
`pipeline_runs`, also used by tests/test_pipeline.py and tests/test_pipeline_model_axis.py, whose
native loads prove the collective job's output) with the collective job, in threads, and with array
tasks in this process, then compare every file, manifest included.
"""
from __future__ import annotations

import errno
import os

import pytest
from test_pipeline import BATCH_SETTINGS_CHANGE
from trained import reshard_in_threads, tree_files

from reshard.errors import ReshardError
from reshard.formats.deepspeed_files.deepspeed_pipeline import LAYER_RE
from reshard.jobs.array_job import deal_files
from reshard.jobs.options import ReshardOptions

# tests/pipeline_run.py's model: what the checkpoint does not record, for a pp change (as tests/test_pipeline.py)
PP_CHANGE = {"pipeline_layers": 7, "pipeline_tied": "embed:0,6"}


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
    """Every pipeline case runs on the plan: each task's target files through the one-worker plan
    restricted to them, under a 4 KiB --memory-budget (by rounds), a tp change too (its layer files
    re-cut target files of the plan). One task fails mid-share (the disk fills), the others run in reverse order, and the re-run task
    publishes the collective job's output (pinned in tests/test_pipeline_pinned.py) file for file."""

    import reshard.formats.deepspeed_files.target_writer as target_writer
    from reshard.jobs.array_job import inspect_unit, publish_main
    from reshard.jobs.collective_job import inspect_pipeline_target, run_job
    from reshard.jobs.runs import Unit
    save_dir, _ = (request.getfixturevalue("tp_saves")[variant] if "target_tp" in options
                   else request.getfixturevalue("pipeline_runs")(variant, 2, 1))
    options = {**options, **BATCH_SETTINGS_CHANGE}  # the save's train_batch_size is for dp 1
    dp = target[1]
    expected, destination = tmp_path / "collective", tmp_path / "array"
    reshard_in_threads(save_dir, expected, dp, 2, **options)

    def opts(task: int) -> ReshardOptions:
        return ReshardOptions(source=str(save_dir), destination=str(destination), target_dp=dp, array_task=task,
                              array_tasks=tasks, quiet=True, **options,
                              memory_budget=ON_ROAD_BUDGET).validate()

    # the task to fail: one dealt a target file (or unit) and some copied or re-cut layer files
    job = inspect_unit(opts(0), Unit(str(save_dir), "step3", str(destination), "step3"), inspect_pipeline_target)
    assert job.source.spec.columns is not None  # on the plan
    items, tp = job.files(0), job.target.tp
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
    # the disk fills as the task creates its second target file (the first is begun, never done)
    assert len(its_targets) > 1, its_targets
    fills_at = its_targets[1].name
    begun = [f.name for f in its_targets if f.rank == min(t.rank for t in its_targets)][0]
    skeleton = target_writer.write_tree_skeleton

    def skeleton_until_full(path, *args, **kwargs):
        if os.path.basename(str(path)) == fills_at:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return skeleton(path, *args, **kwargs)
    monkeypatch.setattr(target_writer, "write_tree_skeleton", skeleton_until_full)
    with pytest.raises(ReshardError, match=f"re-run array task {failing} to write the rest"):
        run_job(opts(failing))
    monkeypatch.undo()
    staged = destination / ".reshard-staging" / "step3"
    kept = {f.name: os.stat(staged / f.name) for f in its_layers}  # marked done: a re-run must leave them
    if begun != fills_at:
        assert (staged / begun).is_file()  # begun, not finished
    results = [run_job(opts(task)) for task in reversed([t for t in range(tasks) if t != failing])]
    assert publish_main([str(destination)]) == 1 and not (destination / "latest").exists()
    retried = run_job(opts(failing))
    if its_layers:
        assert f"{len(its_layers)} of this task's {its_items} file(s) were already done" in retried.summary()
    assert "this task completed the set" in retried.summary()
    # by rounds under the budget: every task that wrote a target file moved it in several
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
