"""DST on another filesystem than SRC: every mode writes the same bytes as on SRC's own filesystem.

    PYTHONPATH=$PWD python -m pytest -q tests/test_other_filesystem.py     # ~1 min (trains once)

SRC on a shared filesystem and DST on local NVMe is what pre-staging a checkpoint means. Here
SRC lies under /tmp and DST under /dev/shm, a tmpfs on every machine here (and in CI), so the
kernel refuses `copy_file_range` between them (EXDEV) and reshard must copy another way. The
reference for each output is the same command with DST under /tmp.
"""
from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

import pytest
from threaded_transport import run_workers
from trained import reshard_cli, tree_files

from reshard.export import export_universal

VARIANT, N, M = "z2_fp32", 2, 3
# the checkpoints its tests ask `trained` for, trained with the session's others (conftest.py)
pytestmark = pytest.mark.trains((VARIANT, N))


@pytest.fixture
def shm_dir():
    path = Path("/dev/shm") / f"reshard-e2e-{uuid.uuid4().hex[:12]}"
    path.mkdir()
    yield path
    shutil.rmtree(path)


@pytest.fixture(scope="module")
def same_filesystem_output(trained, tmp_path_factory):
    source, _ = trained(VARIANT, N)
    reference = tmp_path_factory.mktemp("same-fs") / "dst"
    done = reshard_cli(source, reference, "--target-dp", M, "--memory-budget", "4K", "--quiet")
    assert done.returncode == 0, done.stderr
    return source, reference


def _ok(result):
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.mark.e2e
def test_reshard_to_tmpfs_is_byte_identical(same_filesystem_output, shm_dir):
    source, reference = same_filesystem_output
    assert os.stat(source).st_dev != os.stat(shm_dir).st_dev
    expected = tree_files(reference)
    assert any(name.endswith("model_states.pt") for name in expected)

    _ok(reshard_cli(source, shm_dir / "one", "--target-dp", M, "--memory-budget", "4K", "--quiet"))
    assert tree_files(shm_dir / "one") == expected

    _ok(reshard_cli(source, shm_dir / "workers", "--target-dp", M, "--workers", "2", "--memory-budget", "4K",
                    "--quiet"))
    assert tree_files(shm_dir / "workers") == expected

    for task in range(2):  # SLURM array tasks, one after the other; the second publishes
        _ok(reshard_cli(source, shm_dir / "array", "--target-dp", M, "--array-task", task, "--array-tasks", 2,
                        "--memory-budget", "4K", "--quiet"))
    assert tree_files(shm_dir / "array") == expected


@pytest.mark.e2e
def test_universal_export_to_tmpfs_is_byte_identical(same_filesystem_output, shm_dir, tmp_path):
    source, _ = same_filesystem_output
    for out in (tmp_path / "universal", shm_dir / "universal"):
        run_workers(1, lambda t: export_universal(str(source), str(out), memory_budget=4 << 10, transport=t))
    assert tree_files(shm_dir / "universal") == tree_files(tmp_path / "universal")
