"""The fast tier (`-m "not e2e"`) starts no process: tests/conftest.py refuses every way of starting
one in a test not marked e2e. These check that refusal, and start nothing themselves.

    python -m pytest -q tests/test_tiers.py
"""
from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys

import pytest


def test_a_subprocess_is_refused_outside_e2e():
    with pytest.raises(AssertionError, match="starts a process: mark it @pytest.mark.e2e"):
        subprocess.run([sys.executable, "-c", "pass"])
    with pytest.raises(AssertionError, match="starts a process"):
        multiprocessing.get_context("spawn").Process(target=print).start()


def test_fork_is_replaced_outside_e2e():
    # not called: were the refusal missing, a forked copy of pytest would run on
    assert os.fork.__name__ == "refuse" and os.posix_spawn.__name__ == "refuse"
