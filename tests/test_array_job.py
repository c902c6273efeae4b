"""SLURM array mode: K tasks without collectives, run at once, one after another, or killed and
re-run, each time producing the torchrun job's output byte for byte, published exactly once.

    python -m pytest tests/test_array_job.py -q
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_plan import STREAMS, cases
from trained import REPO, reshard_cli, tree_files

from reshard.jobs.array_job import ArrayFile, deal_files, restrict_to_files
from reshard.errors import OptionError
from reshard.layouts.zero import buffer_numels
from reshard.jobs.options import ReshardOptions
from reshard.planning.plan import Ownership, ReshardPlan, plan_space

# the checkpoints its tests ask `trained` for, trained with the session's others (conftest.py)
pytestmark = pytest.mark.trains(("z3_bf16", 2))

VARIANT, N, M, K = "z3_bf16", 2, 4, 3
ENTRY = REPO / "tests" / "entry" / "array_task.py"


def test_files_are_dealt_by_bytes_deterministically():
    files = [ArrayFile(u, f"f{u}-{i}", size, i) for u in range(2) for i, size in enumerate([90, 10, 40, 40, 35, 5, 1])]
    owners = deal_files(files, 3)
    assert owners == deal_files(list(files), 3)
    loads = [sum(f.nbytes for f, o in zip(files, owners) if o == t) for t in range(3)]
    assert sum(loads) == sum(f.nbytes for f in files)
    assert max(loads) - min(loads) <= max(f.nbytes for f in files)
    assert sorted(set(owners)) == [0, 1, 2]
    assert deal_files(files, 1) == [0] * len(files)


@given(cases(), st.integers(1, 4), st.randoms(use_true_random=False))
@settings(max_examples=100, deadline=None)
def test_shares_restrict_the_plan_to_disjoint_parts_that_cover_it(case, tasks, rng):
    """Slots dealt to tasks at random: each restricted plan keeps exactly its own target buffers'
    segments, with the rounds and order of the one-worker plan; together they cover it once."""
    _, source_layout, target_layout, own, budget = case
    one = Ownership(own.source_ranks, own.target_ranks, 1)
    space = plan_space("optim", source_layout.pieces, target_layout.pieces, STREAMS[:2],
                       buffer_numels(target_layout), one, budget)
    plan = ReshardPlan(one, (space,), budget)
    slots = sorted({(int(r), int(b)) for r, b in zip(space.segments.dst_rank, space.segments.dst_buffer)})
    owner = {slot: rng.randrange(tasks) for slot in slots}
    seen = np.zeros(len(space.segments), dtype=int)
    for task in range(tasks):
        locations = [(r, ("optim", b, s.name)) for (r, b), t in owner.items() if t == task for s in STREAMS[:2]]
        share = restrict_to_files(plan, locations).spaces[0]
        assert share.rounds == space.rounds
        mine = np.asarray([owner[(int(r), int(b))] == task
                           for r, b in zip(space.segments.dst_rank, space.segments.dst_buffer)], dtype=bool)
        assert np.array_equal(share.segments.logical, space.segments.logical[mine])
        assert np.array_equal(share.segments.round, space.segments.round[mine])
        seen += mine
    assert (seen == 1).all()


def test_a_share_missing_some_states_of_a_buffer_is_refused():
    from reshard.errors import ReshardError
    from reshard.layouts.zero import ParamSpec, zero12_layout
    layout = zero12_layout((ParamSpec("w", (10,)),), [(0,)], 2)
    one = Ownership(2, 2, 1)
    space = plan_space("optim", layout.pieces, layout.pieces, STREAMS[:2], buffer_numels(layout), one, 1 << 20)
    with pytest.raises(ReshardError, match="exp_avg"):
        restrict_to_files(ReshardPlan(one, (space,), 1 << 20), [(0, ("optim", 0, "fp32"))])


@pytest.mark.parametrize("task,tasks", [(3, 3), (-1, 2), (0, 0), (None, 2), (1, None)])
def test_bad_array_options_are_refused(task, tasks):
    with pytest.raises(OptionError, match="--array-task"):
        ReshardOptions(source="/a", destination="/b", target_dp=2, array_task=task, array_tasks=tasks).validate()


def _start(task: int, source, destination, report: Path, env: dict | None = None) -> subprocess.Popen:
    child = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    child.update(env or {})
    return subprocess.Popen([sys.executable, str(ENTRY), str(report), str(source), str(destination),
                             "--target-dp", str(M), "--array-task", str(task), "--array-tasks", str(K),
                             "--memory-budget", "1K", "--quiet"],
                            env=child, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(process: subprocess.Popen, expect_ok: bool = True) -> str:
    output, _ = process.communicate(timeout=300)
    if expect_ok:
        assert process.returncode == 0, output[-4000:]
    return output


def _storage_bytes(tag_dir: Path) -> int:
    """Bytes of tensor storage the target files hold (each storage once), read back with torch."""
    total = 0
    for path in tag_dir.glob("*.pt"):
        seen = {}
        def visit(obj):
            if isinstance(obj, torch.Tensor):
                storage = obj.untyped_storage()
                seen[storage.data_ptr()] = storage.nbytes()
            elif isinstance(obj, dict):
                for value in obj.values():
                    visit(value)
            elif isinstance(obj, (list, tuple)):
                for value in obj:
                    visit(value)
        visit(torch.load(path, map_location="cpu", mmap=True, weights_only=False))
        total += sum(seen.values())
    return total


def _check_output(destination: Path, reference: Path, reports: list[Path]) -> None:
    assert tree_files(destination) == tree_files(reference)
    read = sum(json.loads(r.read_text())["bytes_read"] + json.loads(r.read_text())["bytes_carried"] for r in reports)
    needed = _storage_bytes(destination / (destination / "latest").read_text())
    assert 0 < read <= 1.05 * needed, (read, needed)


def _not_published(destination: Path) -> None:
    assert not (destination / "latest").exists()
    assert not any(p.is_dir() and p.name.startswith("global_step") for p in destination.iterdir())


@pytest.fixture(scope="module")
def reference(trained, torchrun_output):
    return trained(VARIANT, N)[0], torchrun_output(VARIANT, N, M)


@pytest.mark.e2e
def test_array_tasks_at_once(reference, tmp_path):
    source, expected = reference
    destination = tmp_path / "dst"
    reports = [tmp_path / f"task{i}.json" for i in range(K)]
    outputs = [_finish(p) for p in [_start(i, source, destination, reports[i]) for i in range(K)]]
    _check_output(destination, expected, reports)
    published = [o for o in outputs if "this task completed the set" in o]
    assert len(published) == 1, outputs   # exactly one task moved the tag into place


@pytest.mark.e2e
def test_array_tasks_one_after_another_in_any_order(reference, tmp_path):
    source, expected = reference
    destination = tmp_path / "dst"
    reports = {i: tmp_path / f"task{i}.json" for i in range(K)}
    for position, task in enumerate((2, 0, 1)):
        output = _finish(_start(task, source, destination, reports[task]))
        if position < K - 1:
            _not_published(destination)
            assert "still to write" in output
    _check_output(destination, expected, list(reports.values()))
    again = _finish(_start(0, source, destination, tmp_path / "again.json"))  # a retry after the end: no-op
    assert "nothing to do" in again and tree_files(destination) == tree_files(expected)
    from reshard.verify import verify_hashes
    assert verify_hashes(str(destination)).ok


@pytest.mark.e2e
def test_array_task_killed_mid_write_then_rerun(reference, tmp_path):
    source, expected = reference
    destination = tmp_path / "dst"
    reports = {i: tmp_path / f"task{i}.json" for i in range(K)}
    killed = _start(1, source, destination, tmp_path / "killed.json", env={"RESHARD_FAILPOINTS": "kill@round=3"})
    _finish(killed, expect_ok=False)
    assert killed.returncode == -9
    for task in (0, 2):
        _finish(_start(task, source, destination, reports[task]))
    _not_published(destination)
    pending = reshard_cli("publish", destination)
    assert pending.returncode == 1 and "array task(s) 1" in pending.stdout, pending.stdout + pending.stderr
    _not_published(destination)
    output = _finish(_start(1, source, destination, reports[1]))
    assert "stale lock" in output and "this task completed the set" in output
    _check_output(destination, expected, list(reports.values()))
    assert not (destination / ".reshard-staging").exists() and not (destination / ".reshard.lock").exists()


@pytest.mark.e2e
def test_tasks_finishing_together_publish_exactly_once(trained, tmp_path, monkeypatch):
    """Every file done, then three publishers at the same instant: one moves the tag and writes `latest`."""
    import threading

    import reshard.jobs.array_job as array_job
    from reshard.jobs.collective_job import run_job
    source, _ = trained(VARIANT, N)
    destination = tmp_path / "dst"
    monkeypatch.setattr(array_job, "publish_ready", lambda *args, **kwargs: [])
    for task in range(K):
        run_job(ReshardOptions(source=str(source), destination=str(destination), target_dp=M, array_task=task,
                               array_tasks=K, quiet=True).validate())
    monkeypatch.undo()
    _not_published(destination)
    tag = (source / "latest").read_text()
    start, notes = threading.Barrier(3), [None] * 3

    def publisher(i):
        start.wait()
        notes[i] = " ".join(array_job.publish_ready(str(destination), tags=[tag], latest=tag))
    threads = [threading.Thread(target=publisher, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sum("this task completed the set" in n for n in notes) == 1, notes
    assert sum("wrote" in n for n in notes) == 1, notes
    assert (destination / "latest").read_text() == tag
    from reshard.verify import verify_hashes
    assert verify_hashes(str(destination)).ok


@pytest.mark.e2e
def test_array_tasks_carry_save_directory_and_tag_files_like_the_collective_job(trained, tmp_path):
    """Trainer-style files beside the tag directory and extra files inside it: the array output (tasks
    in-process, out of order) equals the collective job's byte for byte, manifest included."""
    import shutil

    from trained import reshard_in_threads

    from reshard.jobs.collective_job import run_job
    original, _ = trained(VARIANT, N)
    source = tmp_path / "src"
    shutil.copytree(original, source)
    tag = (source / "latest").read_text()
    (source / "trainer_state.json").write_text('{"global_step": 3}')
    (source / "tokenizer").mkdir()
    (source / "tokenizer" / "vocab.json").write_text('{"a": 0}')
    (source / tag / "metric.json").write_text('{"loss": 1.5}')
    expected = tmp_path / "collective"
    reshard_in_threads(source, expected, M, 2)
    destination = tmp_path / "array"
    for task in (1, 0):
        run_job(ReshardOptions(source=str(source), destination=str(destination), target_dp=M, array_task=task,
                               array_tasks=2, quiet=True).validate())
    assert (destination / "tokenizer" / "vocab.json").read_text() == '{"a": 0}'
    manifest = json.loads((destination / tag / "reshard_manifest.json").read_text())
    assert {"../trainer_state.json", "../tokenizer/vocab.json", "metric.json"} <= set(manifest["files"])
    assert tree_files(destination) == tree_files(expected)
