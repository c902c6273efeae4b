"""Another DeepSpeed release beside this one: a virtual environment that trains and loads with it.

    python -m reshard_proof.deepspeed_venv 0.16.9 [--cache DIR]     # build (once) and print where

    from reshard_proof.deepspeed_venv import deepspeed_venv
    venv = deepspeed_venv("0.16.9")                  # cached under ~/.cache/reshard/compat/...
    train_checkpoint("z2_fp32", 2, save_dir, truth, python=venv.python, env=venv.env())

The environment is made with `--system-site-packages`, so it runs this interpreter's torch (and
numpy, transformers, ...) and `pip install deepspeed==X` inside it shadows the DeepSpeed installed
here: only DeepSpeed differs, in about a minute. reshard itself comes from the proof launchers'
PYTHONPATH (launch.child_env), never from the environment.

Each release gets its own TORCH_EXTENSIONS_DIR: on CPU DeepSpeed compiles its shared-memory
communication op (ShareMemCommBuilder, ops/op_builder/cpu/comm.py) on first use, under a name that
does not carry the release, so two releases sharing the default directory load each other's
build. The op is built once here, before any ranks start, so parallel ranks never race to build it.

DeepSpeed's own quirk: releases whose `torch_checkpoint_engine.py` calls `torch.load` without
`weights_only` (0.14, 0.15) cannot load even their own checkpoints under torch >= 2.6, which defaults
to weights_only=True; `env()` sets TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1 for them, as their users must.
Without `numactl` installed, 0.14's ZeRO-3 fails on CPU unless LOCAL_SIZE is set (see `env`).
The environment is complete once its `ready` marker exists (written last), keyed by the release
and this torch, so an interrupted build is redone and a torch upgrade makes a new one.
"""
from __future__ import annotations

import argparse
import functools
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

DEFAULT_CACHE = Path(os.environ.get("RESHARD_COMPAT_CACHE", Path.home() / ".cache" / "reshard" / "compat"))
BUILD_OP = ("from deepspeed.accelerator import get_accelerator\n"
            "builder = get_accelerator().create_op_builder('ShareMemCommBuilder')\n"
            "builder is None or builder.load()\n")


@dataclass(frozen=True)
class DeepSpeedVenv:
    """A virtual environment holding DeepSpeed `version` over this interpreter's packages."""

    version: str
    root: Path

    @property
    def python(self) -> str:
        return str(self.root / "bin" / "python")

    @property
    def extensions_dir(self) -> Path:
        return self.root / "torch_extensions"

    def loads_without_weights_only(self) -> bool:
        """True where this release's checkpoint engine leaves torch.load's weights_only unset."""
        engine = Path(_package_dir(self.python, "deepspeed")) / "runtime" / "checkpoint_engine" / \
            "torch_checkpoint_engine.py"
        return "weights_only" not in engine.read_text()

    def env(self) -> dict:
        """What a launch under this release needs in its environment."""
        env = {"TORCH_EXTENSIONS_DIR": str(self.extensions_dir), "DS_ACCELERATOR": "cpu"}
        if self.loads_without_weights_only():
            env["TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"] = "1"
        if shutil.which("numactl") is None:
            # The CPU accelerator's device_count() (cpu_accelerator.py) asks `numactl --hardware` for
            # the NUMA nodes unless LOCAL_SIZE is set (DeepSpeed's own launcher sets it); 0.14's
            # utils/numa.py fails without numactl (ZeRO-3's gradient reduce calls it). Give the answer
            # numactl would: the NUMA nodes that hold CPUs.
            env["LOCAL_SIZE"] = str(_numa_nodes_with_cpus())
        return env


def _numa_nodes_with_cpus() -> int:
    nodes = Path("/sys/devices/system/node").glob("node[0-9]*")
    return max(1, sum(1 for node in nodes if (node / "cpulist").is_file() and (node / "cpulist").read_text().strip()))


@functools.lru_cache
def _package_dir(python: str, package: str) -> str:
    """Where `python` finds `package` (its own site-packages, or the inherited one when the release
    is the one installed here), found without importing it."""
    code = f"import importlib.util as u; print(u.find_spec({package!r}).submodule_search_locations[0])"
    return subprocess.run([python, "-c", code], check=True, capture_output=True, text=True, cwd="/").stdout.strip()


def deepspeed_venv(version: str, cache: Path | str = DEFAULT_CACHE, *, log=None) -> DeepSpeedVenv:
    """The environment for DeepSpeed `version`, built on first use (about a minute, plus the op's
    compile), then reused from `cache`."""
    import fcntl

    import torch
    venv = DeepSpeedVenv(version, Path(cache) / f"deepspeed-{version}-torch-{torch.__version__}")
    ready = venv.root / "ready"
    if ready.is_file():
        return venv
    venv.root.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.root.with_name(venv.root.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a test session and bench/compat.py may build the same one
        if not ready.is_file():
            _build(venv, log)
    return venv


def _build(venv: DeepSpeedVenv, log) -> None:
    import torch
    version = venv.version
    out = log if log is not None else subprocess.DEVNULL
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--clear", str(venv.root)], check=True,
                   stdout=out, stderr=subprocess.STDOUT)
    # torch stays this interpreter's: pip must not touch it (a constraint pins the running release)
    constraint = venv.root / "constraints.txt"
    constraint.write_text(f"torch=={torch.__version__}\n")
    subprocess.run([venv.python, "-m", "pip", "install", "--quiet", "-c", str(constraint), f"deepspeed=={version}"],
                   check=True, stdout=out, stderr=subprocess.STDOUT)
    env = dict(os.environ, **venv.env(), PYTHONPATH="")
    subprocess.run([venv.python, "-c", BUILD_OP], check=True, env=env, cwd=venv.root, stdout=out,
                   stderr=subprocess.STDOUT)
    found = subprocess.run([venv.python, "-c", "import deepspeed, torch; print(deepspeed.__version__, torch.__version__)"],
                           check=True, env=env, cwd=venv.root, capture_output=True, text=True)
    found = found.stdout.strip().splitlines()[-1].split()  # after DeepSpeed's own log lines
    if found[:2] != [version, torch.__version__]:
        raise RuntimeError(f"{venv.root}: runs DeepSpeed {found[0]} with torch {found[1]}, "
                           f"not {version} with {torch.__version__}")
    (venv.root / "ready").write_text(f"deepspeed {version} torch {torch.__version__}\n")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("version")
    parser.add_argument("--cache", default=str(DEFAULT_CACHE))
    args = parser.parse_args(argv)
    venv = deepspeed_venv(args.version, args.cache, log=sys.stderr)
    print(venv.root, venv.env())


if __name__ == "__main__":
    main()
