"""Messages that tell the truth about what is on disk and what to do about it.

    PYTHONPATH=$PWD python -m pytest -q tests/test_messages.py

A collective job meeting an array job's staging says what it is and how to finish or remove it;
`--workers W` beyond the open-file limit says that the command's own process opens W * W files
(more workers would make it worse); staging left by an interrupted run for a tag SRC no longer
names is pointed out in the summary, with the command that removes it.
"""
from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys

import pytest
from trained import REPO, reshard_cli

from reshard.jobs.destination import STAGING, stale_staging_notes
from reshard.jobs.manifest import JOURNAL_NAME

VARIANT, N = "z2_fp32", 2
# the checkpoints its tests ask `trained` for, trained with the session's others (conftest.py)
pytestmark = pytest.mark.trains((VARIANT, N))


@pytest.fixture
def source(trained, tmp_path):
    original, _ = trained(VARIANT, N)
    copy = tmp_path / "src"
    shutil.copytree(original, copy)
    return copy


def test_stale_staging_of_other_tags_is_named_with_its_removal(tmp_path):
    root = tmp_path / "dst" / STAGING
    for name in ("global_step3", "global_step5", "global_step7", "global_step7.array", "replaced-global_step1"):
        (root / name).mkdir(parents=True)
    (root / "global_step3" / JOURNAL_NAME).write_text("{}")
    (root / "global_step5" / JOURNAL_NAME).write_text("{}")
    (root / "global_step7.array" / "record.json").write_text(json.dumps({"tasks": 4, "owners": {"a": 0, "b": 1}}))
    notes = stale_staging_notes(str(tmp_path / "dst"), ["global_step5"])
    assert len(notes) == 3, notes
    interrupted, array, replaced = notes
    assert "interrupted run for tag global_step3" in interrupted
    assert interrupted.endswith(f"rm -rf {root / 'global_step3'}")
    assert "SLURM array job for tag global_step7" in array and "4 tasks, 0 of 2 files done" in array
    assert array.endswith(f"rm -rf {root / 'global_step7'} {root / 'global_step7.array'}")
    assert replaced.endswith(f"rm -rf {root / 'replaced-global_step1'}")
    assert stale_staging_notes(str(tmp_path / "dst"), ["global_step3", "global_step5", "global_step7",
                                                       "replaced-global_step1"]) == []


@pytest.mark.e2e
def test_a_collective_job_names_an_array_jobs_staging(source, tmp_path):
    destination = tmp_path / "dst"
    first = reshard_cli(source, destination, "--target-dp", 3, "--array-task", 0, "--array-tasks", 2, "--quiet")
    assert first.returncode == 0, first.stderr
    refused = reshard_cli(source, destination, "--target-dp", 3, "--quiet")
    assert refused.returncode == 2, refused.stdout + refused.stderr
    message = refused.stderr
    assert "not made by reshard" not in message
    staging = destination / STAGING / "global_step3"
    assert f"{staging}: holds the staging of a SLURM array job" in message
    assert "--array-task I --array-tasks 2" in message and f"python -m reshard publish {destination}" in message
    assert f"rm -rf {staging} {staging}.array" in message
    assert staging.is_dir() and (destination / STAGING / "global_step3.array" / "record.json").is_file()
    # the advice works: the remaining task finishes and publishes the set
    second = reshard_cli(source, destination, "--target-dp", 3, "--array-task", 1, "--array-tasks", 2, "--quiet")
    assert second.returncode == 0, second.stderr
    assert (destination / "latest").read_text() == "global_step3"


@pytest.mark.e2e
def test_too_many_forked_workers_explains_the_parents_files(source, tmp_path):
    def low_limit():
        resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))
    refused = subprocess.run([sys.executable, "-m", "reshard", str(source), str(tmp_path / "dst"), "--target-dp", "3",
                              "--workers", "200"], capture_output=True, text=True, cwd=REPO, preexec_fn=low_limit,
                             env=dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH=str(REPO)), timeout=120)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    message = refused.stderr
    assert "--workers 200 makes this process open 40000 files" in message, message
    assert "per worker" not in message and "run more workers" not in message
    assert "use at most --workers 30 here" in message  # 30 * 30 + 64 spare <= 1024 < 31 * 31 + 64
    assert not (tmp_path / "dst").exists()


@pytest.mark.e2e
def test_staging_of_a_tag_latest_moved_away_from_is_named(source, tmp_path):
    destination = tmp_path / "dst"
    killed = reshard_cli(source, destination, "--target-dp", 3, "--memory-budget", "2K", "--durable-every", "1K",
                         "--quiet", env={"RESHARD_FAILPOINTS": "kill@round=3"})
    assert killed.returncode != 0
    old = destination / STAGING / "global_step3"
    assert (old / JOURNAL_NAME).is_file()
    (source / "global_step3").rename(source / "global_step4")  # training went on and saved a new tag
    (source / "latest").write_text("global_step4")
    done = reshard_cli(source, destination, "--target-dp", 3, "--quiet")
    assert done.returncode == 0, done.stderr
    assert (destination / "latest").read_text() == "global_step4"
    assert "interrupted run for tag global_step3" in done.stdout, done.stdout
    assert f"rm -rf {old}" in done.stdout
    assert old.is_dir()  # named, never removed without being asked
