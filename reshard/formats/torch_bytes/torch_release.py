"""What reshard's torch path needs from the installed torch, and the refusal that names what is missing.

    from reshard.formats.torch_bytes.torch_release import missing
    problem = missing("named_allowlist")    # None, or "torch 2.5.1 ... (torch 2.6 and later have it)"

reshard reads and writes DeepSpeed's files without torch where it can (torch_pickle). Its torch path
(content outside that subset, --trust-pickle, the writer under a torch the torch-free writer is not
pinned for, the in-job load, the universal export) uses what older torch releases lack:

- `skip_data`: `torch.serialization.skip_data`, a torch.save that reserves each storage's bytes
  instead of writing them (torch_archive.write_skeleton). In torch 2.5.0 and later.
- `named_allowlist`: (class, "module.Name") entries in the weights_only allowlist, which allow
  reshard's stand-ins under DeepSpeed's class names (torch_allowlist.allowed_globals). torch 2.6 and
  later; 2.5's torch/_weights_only_unpickler.py `_get_user_allowed_globals` reads each entry's own
  __module__ and __name__, so a pair fails there.
- storage offsets of a meta load: `_checkpoint_offset` on the storages of
  `torch.load(map_location="meta")` (torch_archive.load_structure), absent in 2.5.1 and checked on
  each load (torch_archive.load_structure refuses a storage without one by name).

Under a torch without one of them, that step refuses (UnsupportedTorch, or CheckpointError naming the
file) and says which torch has it; the rest runs. Under torch 2.5.1+cu124 (run on CPU), the offline
command resharded a DeepSpeed 0.19.8 ZeRO-2 fp32 checkpoint 2 -> 3 (torch-free reader, torch.save
under skip_data as the writer, offsets found torch-free), where before it stopped in torch.load on
the allowlist's pairs ("'tuple' object has no attribute '__module__'"). The end-to-end cell
(`bench/compat.py --torch 2.5.1`, trained and loaded by DeepSpeed 0.16.9 over that torch) is what
the project's torch floor waits for.
"""
from __future__ import annotations

import os
import re

FEATURES = {
    "skip_data": ((2, 5), "torch.serialization.skip_data (a torch.save that reserves storage bytes)"),
    "named_allowlist": ((2, 6), "(class, 'module.Name') entries in the weights_only allowlist, which allow "
                                "reshard's stand-ins under DeepSpeed's class names"),
}
"""feature -> (the first torch release that has it, what it is)."""
VERSION_LINE = re.compile(r"""^__version__\s*=\s*['"]([^'"]+)['"]""", re.M)
"""The line of torch/version.py that names the release."""


def release_of(version: str) -> tuple[int, int]:
    """(major, minor) of a torch version string such as "2.5.1+cu124" or "2.13.0a0+git1234"."""
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def installed_version() -> str | None:
    """The installed torch's version without importing torch (that takes seconds): `torch.__version__`
    when torch is imported already, else the `__version__` line of its torch/version.py (which torch's
    build writes, tools/generate_torch_version.py), else its distribution's metadata. Reading the one
    file takes about 3 ms of CPU; importlib.metadata, 35-45 ms on the development machine, in every
    worker process that writes."""
    import sys
    if "torch" in sys.modules and hasattr(sys.modules["torch"], "__version__"):
        return str(sys.modules["torch"].__version__)
    import importlib.util
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        spec = None
    for folder in (spec.submodule_search_locations or ()) if spec is not None else ():
        try:
            with open(os.path.join(folder, "version.py")) as fd:
                match = VERSION_LINE.search(fd.read())
        except (OSError, UnicodeDecodeError):
            continue
        if match:
            return match.group(1)
    import importlib.metadata
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None


def missing(feature: str, version: str | None = None) -> str | None:
    """Why torch `version` (default: the installed one) cannot do `feature`, or None when it can."""
    version = version or installed_version()
    first, what = FEATURES[feature]
    if version is None or release_of(version) >= first:
        return None
    return f"torch {version} lacks {what} (torch {first[0]}.{first[1]} and later have it)"


def require(feature: str) -> None:
    """Raise UnsupportedTorch unless the installed torch can do `feature`."""
    problem = missing(feature)
    if problem is not None:
        from reshard.errors import UnsupportedTorch
        raise UnsupportedTorch(problem)
