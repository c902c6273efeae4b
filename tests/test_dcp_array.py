"""`reshard export --format dcp --array-task I --array-tasks K`: what the command line refuses before reading anything.

    python -m pytest -q tests/test_dcp_array.py        # fast: no process started

The array tasks themselves (killed, refused, resumed, byte for byte the collective export) are judged end
to end in tests/test_export_dcp.py::test_array_tasks_killed_refused_and_resumed_publish_the_collective_exports_bytes.
"""
from __future__ import annotations

import pytest

from reshard.cli import main


@pytest.mark.parametrize("flags, message", [
    (["--format", "dcp", "--array-task", "0"], "--array-task and --array-tasks go together"),
    (["--format", "dcp", "--array-tasks", "2"], "--array-task and --array-tasks go together"),
    (["--format", "dcp", "--array-task", "0", "--array-tasks", "2", "--workers", "2"], "not with --workers"),
    (["--format", "dcp", "--array-task", "2", "--array-tasks", "2"], "--array-task must be in [0, --array-tasks), "
                                                                     "got 2 of 2"),
    (["--format", "dcp", "--array-task", "-1", "--array-tasks", "2"], "got -1 of 2"),
])
def test_array_flags_are_refused_by_name_before_the_source_is_read(tmp_path, capsys, flags, message):
    source, out = tmp_path / "absent", tmp_path / "out"  # never looked at: the refusal comes first
    assert main(["export", str(source), str(out), *flags]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()
