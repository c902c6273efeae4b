"""The torch releases reshard's torch path runs under, and the refusal by name below them.

    python -m pytest -q tests/test_torch_release.py        # one process, no training

reshard.formats.torch_bytes.torch_release says which torch first has each feature its torch path uses; the
project's floor (pyproject.toml) is the oldest torch that bench/compat.py proved end to end.
"""
from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from reshard.errors import UnsupportedTorch
from reshard.formats.torch_bytes import torch_allowlist, torch_release
from reshard.formats.torch_bytes.torch_archive import pinned_writer_layout
from reshard.formats.torch_bytes.torch_release import missing, release_of

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("version, expected", [("2.5.1+cu124", (2, 5)), ("2.13.0+cpu", (2, 13)), ("2.14.1", (2, 14)),
                                               ("2.6.0a0+git1234", (2, 6)), ("2.10.0rc1", (2, 10))])
def test_release_of(version, expected):
    assert release_of(version) == expected


def test_each_feature_is_missing_just_below_its_first_release():
    assert missing("skip_data", "2.4.1") and "torch 2.5 and later" in missing("skip_data", "2.4.1")
    assert missing("skip_data", "2.5.1") is None
    assert "2.5.1" in missing("named_allowlist", "2.5.1+cu124")
    assert missing("named_allowlist", "2.6.0") is None
    assert missing("named_allowlist", "2.13.0+cpu") is None


def test_named_allowlist_is_refused_by_name_under_an_older_torch(monkeypatch):
    """torch 2.5 would fail inside torch.load; reshard refuses before it, naming the release."""
    class StandIn:
        pass
    monkeypatch.setattr(torch_release, "installed_version", lambda: "2.5.1+cu124")
    with pytest.raises(UnsupportedTorch, match=r"torch 2\.5\.1\+cu124 lacks \(class, 'module.Name'\).*torch 2\.6"):
        with torch_allowlist.allowed_globals([(StandIn, "deepspeed.runtime.Thing")]):
            pass
    with torch_allowlist.allowed_globals([StandIn]):  # bare classes 2.5 takes
        pass


def test_pyproject_floor_is_a_release_the_writer_serves():
    """The floor names a torch the torch-free writer is pinned for, or one with skip_data (the
    writer for unpinned releases), and so is every later release; README says it."""
    dependencies = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    floor = next(re.fullmatch(r"torch>=(\d+\.\d+(?:\.\d+)?)", dep).group(1)
                 for dep in dependencies if dep.startswith("torch"))
    assert pinned_writer_layout(floor)[0] is not None or missing("skip_data", floor) is None
    assert missing("skip_data", "2.5.0") is None  # every release after 2.4.1 (the last 2.4) has it
    assert f"torch {floor} or later" in (REPO / "README.md").read_text()



def test_installed_version_is_the_distributions_without_importing_torch(monkeypatch):
    """Read from torch/version.py (a few ms) instead of importlib.metadata (tens of ms in every writer
    process): the same string, and torch stays unimported (as in a worker, which has not imported it)."""
    import importlib.metadata
    import sys
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    assert torch_release.installed_version() == importlib.metadata.version("torch")
    assert "torch" not in sys.modules
