"""The one lifecycle (reshard.jobs.lifecycle), alone: one worker over a LocalTransport, no checkpoint.

    PYTHONPATH=$PWD python -m pytest -q tests/test_lifecycle.py

Each job kind's own tests run it end to end (test_e2e_reshard, test_array_job, test_pipeline,
test_export_staging ...); these pin the sequence itself: fresh, publish, complete, a failure
before and after the rounds began, resume, and a destination holding other files; and for array
tasks, which resume per file: the task's own lock, what a failure keeps, and placing a complete
set once.
"""
from __future__ import annotations

import os

import pytest

from reshard.jobs.destination import STAGING
from reshard.errors import OptionError, ReshardError
from reshard.jobs.lifecycle import (
    EXPORT,
    RESHARD,
    JobOutput,
    Lifecycle,
    ReadySet,
    ResumeByFile,
    destination_names,
    publish_sets,
    publish_tag_dir,
)
from reshard.jobs.lock import LOCK_NAME
from reshard.jobs.manifest import JOURNAL_NAME, Manifest, read_journal
from reshard.transport.local import LocalTransport


def _output(fingerprint="out", plan="plan", earlier=None, latest="t1") -> JobOutput:
    return JobOutput(fingerprint, {STAGING, LOCK_NAME}, plan, rounds=4, identity={"a.pt": {"bytes": 1}},
                     earlier=earlier, latest=latest)


def _write_and_publish(life: Lifecycle, transport, rounds: int = 4):
    life.opened()
    for done in range(1, rounds + 1):
        life.journal(done)
    with open(os.path.join(life.staging.tag_dir, "w.pt"), "wb") as out:
        out.write(b"bytes")
    files = {"w.pt": {"bytes": 5, "blake3": _hash(os.path.join(life.staging.tag_dir, "w.pt"))}}
    life.publish(transport, files, lambda hashes: publish_tag_dir(
        life.staging, Manifest("out", source={}, target={}, files=hashes[0]), "t1", scripts_from=None))


def _hash(path):
    from reshard.files.byte_io import hash_file
    return hash_file(path)


def test_fresh_run_publishes_the_tag_then_latest_and_a_rerun_is_complete(tmp_path):
    dst, transport = str(tmp_path / "dst"), LocalTransport()
    life = Lifecycle(dst, "t1", leader=True)
    start = life.begin(transport, _output)
    assert start.mode == "fresh" and start.created_destination
    assert read_journal(life.staging.tag_dir) == {"plan_fingerprint": "plan", "skeletons": False, "rounds_done": 0}
    life.run(lambda: _write_and_publish(life, transport))
    assert sorted(os.listdir(dst)) == ["latest", "t1"]  # no staging, no lock left
    assert _read(os.path.join(dst, "latest")) == "t1"
    assert not os.path.exists(os.path.join(dst, "t1", JOURNAL_NAME))

    again = Lifecycle(dst, "t1", leader=True)
    start = again.begin(transport, lambda: _output(earlier=Manifest.read(os.path.join(dst, "t1"))))
    assert start.mode == "complete" and "already holds this output" in start.notes[0]
    assert not os.path.exists(os.path.join(dst, LOCK_NAME))


def test_failure_before_the_rounds_removes_staging_and_the_destination_it_created(tmp_path):
    dst, transport = str(tmp_path / "dst"), LocalTransport()
    life = Lifecycle(dst, "t1", leader=True)
    life.begin(transport, _output)

    def fail():
        raise ReshardError("opening failed")

    with pytest.raises(ReshardError, match="opening failed. Nothing was kept: .* created by this run"):
        life.run(fail)
    assert not os.path.exists(dst)


def test_failure_after_the_rounds_began_keeps_staging_and_the_same_plan_resumes(tmp_path):
    dst, transport = str(tmp_path / "dst"), LocalTransport()
    life = Lifecycle(dst, "t1", leader=True)
    life.begin(transport, _output)

    def fail_after_two_rounds():
        life.opened()
        life.journal(2)
        raise OSError(5, "Input/output error", os.path.join(life.staging.tag_dir, "w.pt"))

    with pytest.raises(ReshardError, match=r"w.pt: writing failed: Input/output error. The partial output stays in"):
        life.run(fail_after_two_rounds)
    assert os.path.isfile(os.path.join(life.staging.tag_dir, JOURNAL_NAME))
    assert not os.path.exists(os.path.join(dst, LOCK_NAME))

    other_plan = Lifecycle(dst, "t1", leader=True, words=EXPORT)
    discarded = other_plan.begin(transport, lambda: _output(plan="another"))
    assert discarded.mode == "fresh" and any("discarded the staging of an earlier export" in n for n in discarded.notes)

    def fail_after_three_rounds():
        other_plan.opened()
        other_plan.journal(3)
        raise OSError(28, "No space left on device")

    with pytest.raises(ReshardError, match="No space left on device. The partial output stays in"):
        other_plan.run(fail_after_three_rounds)

    resumed = Lifecycle(dst, "t1", leader=True, words=RESHARD)
    start = resumed.begin(transport, lambda: _output(plan="another"))
    assert (start.mode, start.rounds_done, start.skeletons) == ("resume", 3, True)
    assert start.notes == ["resuming an interrupted run: 3 of 4 rounds were done"]
    resumed.run(lambda: _write_and_publish(resumed, transport))
    assert _read(os.path.join(dst, "latest")) == "t1"


def test_a_destination_holding_other_files_is_refused_and_nothing_is_locked(tmp_path):
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "notes.txt").write_text("mine")
    life = Lifecycle(str(dst), "t1", leader=True)
    with pytest.raises(OptionError, match="is not empty .notes.txt.; pass --overwrite"):
        life.begin(LocalTransport(), _output)
    assert sorted(os.listdir(dst)) == ["notes.txt"]


def test_destination_names_grow_with_an_earlier_output_of_this_source():
    assert destination_names({}, ["hf.json"]) == {STAGING, LOCK_NAME}
    with_earlier = destination_names({"t0": None}, [])
    assert {"t0", "latest", STAGING, LOCK_NAME} <= with_earlier


def _task(dst: str, task: int, done: set, prepared: list, tag: str = "t1") -> ResumeByFile:
    """Task `task`'s share {a.pt, b.pt} of `tag`; `done` holds the names whose markers exist."""
    markers = os.path.join(dst, STAGING, tag + ".array")
    return ResumeByFile({"a.pt": 3, "b.pt": 4}, done.__contains__, (markers,), prepared.append,
                        os.path.join(markers, f"task-{task}"), f"re-run task {task} to write the rest")


def test_an_array_task_resumes_per_file_under_its_own_lock_and_a_failure_keeps_everything(tmp_path):
    dst, transport, done, prepared = str(tmp_path / "dst"), LocalTransport(), {"a.pt"}, []
    life = Lifecycle(dst, "t1", leader=True, resume=_task(dst, 1, done, prepared))
    start = life.begin(transport, lambda: JobOutput("out", {STAGING, LOCK_NAME}))
    assert (start.mode, start.remaining) == ("resume", ["b.pt"])
    assert start.notes == ["1 of this task's 2 file(s) were already done"] and start.output_bytes == 4
    assert prepared == [life.staging] and os.path.isdir(life.staging.tag_dir)
    assert os.path.isfile(os.path.join(dst, STAGING, "t1.array", "task-1", LOCK_NAME))
    assert not os.path.exists(os.path.join(dst, LOCK_NAME))  # DST's lock is the publisher's
    assert not os.path.exists(os.path.join(life.staging.tag_dir, JOURNAL_NAME))  # tasks share it: no journal

    def fail():
        with open(os.path.join(life.staging.tag_dir, "b.pt"), "wb") as out:
            out.write(b"ha")
        raise OSError(5, "Input/output error", os.path.join(life.staging.tag_dir, "b.pt"))

    with pytest.raises(ReshardError, match=r"b.pt: writing failed: Input/output error. re-run task 1 to write the "
                                           r"rest$"):
        life.run(fail)
    assert os.path.isfile(os.path.join(life.staging.tag_dir, "b.pt"))  # the shared staging stays
    assert not os.path.exists(os.path.join(dst, STAGING, "t1.array", "task-1"))  # the task's lock went with it

    def refused():
        raise ReshardError("not a write")

    other = Lifecycle(dst, "t2", leader=True, resume=_task(dst, 0, set(), [], "t2"))
    assert other.begin(transport, lambda: JobOutput("out", {STAGING, LOCK_NAME})).mode == "fresh"
    with pytest.raises(ReshardError, match=r"^not a write$"):  # only a failed write says how to go on
        other.run(refused)
    assert os.path.isdir(other.staging.tag_dir)  # empty, but other tasks may be writing there: kept


def test_an_array_task_refuses_the_staging_of_a_collective_run(tmp_path):
    dst, transport = str(tmp_path / "dst"), LocalTransport()
    interrupted = Lifecycle(dst, "t1", leader=True)
    interrupted.begin(transport, _output)
    interrupted.lock.release()
    task = Lifecycle(dst, "t1", leader=True, resume=_task(dst, 0, set(), []))
    with pytest.raises(OptionError, match="holds an interrupted collective job"):
        task.begin(transport, lambda: JobOutput("out", {STAGING, LOCK_NAME}))


def test_publish_sets_places_each_complete_set_once_and_latest_last(tmp_path):
    dst = str(tmp_path / "dst")
    placed = []

    def ready(tag: str) -> ReadySet:
        staging = Lifecycle(dst, tag, leader=True).staging
        markers = os.path.join(dst, STAGING, tag + ".array")
        os.makedirs(markers, exist_ok=True)
        os.makedirs(staging.tag_dir, exist_ok=True)

        def place():
            placed.append(tag)
            publish_tag_dir(staging, Manifest("out-" + tag, source={}, target={}, files={}), None, scripts_from=None)
        return ReadySet(tag, "out-" + tag, markers, place)

    first = publish_sets(dst, [ready("t1")], tags=["t1", "t2"], latest="t2")
    assert first == [f"published {os.path.join(dst, 't1')} (this task completed the set)"]
    assert not os.path.exists(os.path.join(dst, "latest"))  # t2 is not in place yet
    second = publish_sets(dst, [ready("t2")], tags=["t1", "t2"], latest="t2")
    assert second[-1] == f"wrote {os.path.join(dst, 'latest')} -> t2" and _read(os.path.join(dst, "latest")) == "t2"
    os.makedirs(os.path.join(dst, STAGING, "t2.array"))  # a late publisher's view of the same set
    late = ReadySet("t2", "out-t2", os.path.join(dst, STAGING, "t2.array"), lambda: placed.append("again"))
    assert publish_sets(dst, [late], tags=["t1", "t2"], latest="t2") == []  # in place already: not again
    assert placed == ["t1", "t2"]
    assert sorted(os.listdir(dst)) == ["latest", "t1", "t2"]  # markers, staging and lock gone


def _read(path: str) -> str:
    with open(path) as fd:
        return fd.read()
