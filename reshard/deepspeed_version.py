"""The DeepSpeed releases reshard's in-job API and proof harness run with, checked without importing DeepSpeed.

    from reshard.deepspeed_version import check_installed_deepspeed
    check_installed_deepspeed()          # at the top of every module that imports deepspeed

    python -m reshard.deepspeed_version  # prints the installed release and whether it is supported

The offline command reads and writes DeepSpeed's files without DeepSpeed, so DeepSpeed is an
extra (`pip install 'reshard[deepspeed]'`), never a base dependency: installing reshard must leave
the user's DeepSpeed as it is. The range is what the version matrix (bench/compat.py,
bench/results/compat.md) covers: the last patch of each minor from 0.14 to 0.19 trained, resharded
and loaded back with the same release. Outside it reshard still runs, with a warning naming the
release, since a new DeepSpeed may well keep the layout; the matrix is where to find out.
"""
from __future__ import annotations

import importlib.metadata
import re
import warnings

SUPPORTED_DEEPSPEED = ((0, 14), (0, 20))
"""[lowest, first unsupported) minor releases; pyproject.toml's `deepspeed` extra says the same."""

SUPPORTED_RANGE = ">=0.14,<0.20"


class UnsupportedDeepSpeedWarning(UserWarning):
    """The installed DeepSpeed is outside the range the version matrix covers."""


def release_of(version: str) -> tuple[int, ...]:
    """(major, minor, patch) of a version string such as "0.16.9", "0.17.0rc1" or "0.19.8+cpu"."""
    match = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version)
    if match is None:
        raise ValueError(f"not a DeepSpeed version: {version!r}")
    return tuple(int(part) for part in match.groups(default="0"))


def version_problem(version: str) -> str | None:
    """Why `version` is outside the supported range, or None when it is inside."""
    lowest, first_unsupported = SUPPORTED_DEEPSPEED
    if lowest <= release_of(version)[:2] < first_unsupported:
        return None
    return (f"DeepSpeed {version} is installed; reshard's in-job API is tested with DeepSpeed {SUPPORTED_RANGE} "
            f"(bench/compat.py runs the matrix). The offline command `python -m reshard` does not use DeepSpeed.")


def installed_deepspeed() -> str | None:
    """The installed DeepSpeed's version, from its distribution metadata (no import), or None."""
    try:
        return importlib.metadata.version("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        return None


def check_installed_deepspeed() -> str:
    """The installed DeepSpeed's version; warns when it is outside the range, raises ImportError
    naming the extra when there is none."""
    version = installed_deepspeed()
    if version is None:
        raise ImportError(f"reshard's in-job API runs inside a DeepSpeed job, and DeepSpeed is not installed: "
                          f"pip install 'deepspeed{SUPPORTED_RANGE}' (or 'reshard[deepspeed]'). "
                          f"The offline command `python -m reshard` needs no DeepSpeed.")
    problem = version_problem(version)
    if problem is not None:
        warnings.warn(problem, UnsupportedDeepSpeedWarning, stacklevel=3)
    return version


if __name__ == "__main__":
    found = installed_deepspeed()
    print(f"DeepSpeed {found}: " + ("not installed" if found is None else (version_problem(found) or
                                                                             f"supported ({SUPPORTED_RANGE})")))
