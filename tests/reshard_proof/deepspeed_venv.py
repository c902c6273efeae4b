"""Another DeepSpeed release beside this one: a virtual environment that trains and loads with it.

    python -m reshard_proof.deepspeed_venv 0.16.9 [--torch 2.5.1] [--cache DIR]   # build (once), print where

    from reshard_proof.deepspeed_venv import deepspeed_venv
    venv = deepspeed_venv("0.16.9")                  # cached under ~/.cache/reshard/compat/...
    train_checkpoint("z2_fp32", 2, save_dir, truth, python=venv.python, env=venv.env())
    venv = deepspeed_venv("0.16.9", torch="2.5.1")   # the same release over another torch

Without `torch`, the environment is made with `--system-site-packages`, so it runs this interpreter's
torch (and numpy, transformers, ...) and `pip install deepspeed==X` inside it shadows the DeepSpeed
installed here: only DeepSpeed differs, in about a minute. reshard itself comes from the proof
launchers' PYTHONPATH (launch.child_env), never from the environment.

With `torch=T` (a release other than this interpreter's), the torch comes from a torch environment
built once per release (`torch_venv`: a plain venv, `pip install torch==T` and reshard's base
dependencies, so reshard itself runs there too). On a machine without T's CPU wheel that is the CUDA
build with its nvidia-* libraries (several GB; torch imports them, then runs on CPU). Each
DeepSpeed environment over it is a plain venv whose `torch_venv.pth` adds the torch environment's
site-packages (`site.addsitedir`), and `pip install deepspeed==X` under the constraint torch==T
goes into the DeepSpeed environment: one torch download serves every DeepSpeed release.

Each release gets its own TORCH_EXTENSIONS_DIR: on CPU DeepSpeed compiles its shared-memory
communication op (ShareMemCommBuilder, ops/op_builder/cpu/comm.py) on first use, under a name that
does not carry the release, so two releases sharing the default directory load each other's
build. The op is built once here, before any ranks start, so parallel ranks never race to build it.

DeepSpeed's own quirk: releases whose `torch_checkpoint_engine.py` calls `torch.load` without
`weights_only` (0.14, 0.15) cannot load even their own checkpoints under torch >= 2.6, which defaults
to weights_only=True; `env()` sets TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1 for them under such a torch,
as their users must (torch 2.4 and 2.5 default to weights_only=False and need nothing).
Without `numactl` installed, 0.14's ZeRO-3 fails on CPU unless LOCAL_SIZE is set (see `env`).
The environment is complete once its `ready` marker exists (written last), keyed by the release
and the torch, so an interrupted build is redone and a torch upgrade makes a new one.
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
RESHARD_BASE = ("numpy>=1.24", "pyyaml>=6", "tqdm>=4.60", "blake3>=0.4")
"""reshard's base dependencies besides torch (pyproject.toml), installed into a torch environment so
that `python -m reshard` runs under that torch."""
BUILD_OP = ("from deepspeed.accelerator import get_accelerator\n"
            "builder = get_accelerator().create_op_builder('ShareMemCommBuilder')\n"
            "builder is None or builder.load()\n")


@dataclass(frozen=True)
class DeepSpeedVenv:
    """A virtual environment holding DeepSpeed `version` over this interpreter's packages."""

    version: str
    root: Path
    torch: str | None = None
    """The torch release of its own torch environment (`torch_venv`); None: this interpreter's."""

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
        if self.loads_without_weights_only() and defaults_to_weights_only(self.torch_version()):
            env["TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"] = "1"
        if shutil.which("numactl") is None:
            # The CPU accelerator's device_count() (cpu_accelerator.py) asks `numactl --hardware` for
            # the NUMA nodes unless LOCAL_SIZE is set (DeepSpeed's own launcher sets it); 0.14's
            # utils/numa.py fails without numactl (ZeRO-3's gradient reduce calls it). Give the answer
            # numactl would: the NUMA nodes that hold CPUs.
            env["LOCAL_SIZE"] = str(_numa_nodes_with_cpus())
        return env


    def torch_version(self) -> str:
        """The torch this environment runs."""
        if self.torch is not None:
            return self.torch
        import torch
        return torch.__version__


def defaults_to_weights_only(torch_version: str) -> bool:
    """torch >= 2.6 loads with weights_only=True unless told otherwise (torch/serialization.py `load`);
    2.4 and 2.5 default to False."""
    major, minor = (int(part) for part in torch_version.split("+")[0].split(".")[:2])
    return (major, minor) >= (2, 6)


def _numa_nodes_with_cpus() -> int:
    nodes = Path("/sys/devices/system/node").glob("node[0-9]*")
    return max(1, sum(1 for node in nodes if (node / "cpulist").is_file() and (node / "cpulist").read_text().strip()))


@functools.lru_cache
def _package_dir(python: str, package: str) -> str:
    """Where `python` finds `package` (its own site-packages, or the inherited one when the release
    is the one installed here), found without importing it."""
    code = f"import importlib.util as u; print(u.find_spec({package!r}).submodule_search_locations[0])"
    return subprocess.run([python, "-c", code], check=True, capture_output=True, text=True, cwd="/").stdout.strip()


def deepspeed_venv(version: str, cache: Path | str = DEFAULT_CACHE, *, torch: str | None = None,
                   log=None) -> DeepSpeedVenv:
    """The environment for DeepSpeed `version`, built on first use (about a minute, plus the op's
    compile), then reused from `cache`. `torch`: a torch release to run instead of this
    interpreter's (its torch environment is built first, once: `torch_venv`)."""
    import torch as this_torch
    if torch == this_torch.__version__:
        torch = None  # this interpreter's own: the --system-site-packages environment
    shown = torch or this_torch.__version__
    venv = DeepSpeedVenv(version, Path(cache) / f"deepspeed-{version}-torch-{shown}", torch)
    _once(venv.root, lambda: _build(venv, Path(cache), log))
    return venv


def torch_venv(torch_version: str, cache: Path | str = DEFAULT_CACHE, *, log=None) -> Path:
    """A plain virtual environment holding torch `torch_version` and reshard's base dependencies
    (RESHARD_BASE), built once under `cache`; returns its root."""
    root = Path(cache) / f"torch-{torch_version}"

    def build():
        out = log if log is not None else subprocess.DEVNULL
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(root)], check=True, stdout=out,
                       stderr=subprocess.STDOUT)
        constraint = root / "constraints.txt"
        constraint.write_text(f"torch=={torch_version}\n")
        subprocess.run([str(root / "bin" / "python"), "-m", "pip", "install", "--quiet", "-c", str(constraint),
                        f"torch=={torch_version}", *RESHARD_BASE], check=True, stdout=out, stderr=subprocess.STDOUT)
        _check_runs(str(root / "bin" / "python"), "torch", torch_version, dict(os.environ, PYTHONPATH=""), root)

    _once(root, build)
    return root


def _once(root: Path, build) -> None:
    """`build()` unless `root`'s `ready` marker exists; writes the marker after it."""
    import fcntl

    ready = root / "ready"
    if ready.is_file():
        return
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.with_name(root.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a test session and bench/compat.py may build the same one
        if not ready.is_file():
            build()
            ready.write_text(f"{root.name}\n")


def _site_packages(python: str) -> str:
    code = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    return subprocess.run([python, "-c", code], check=True, capture_output=True, text=True, cwd="/").stdout.strip()


def _check_runs(python: str, module: str, version: str, env: dict, cwd: Path) -> None:
    """Raise unless `python` imports `module` at `version` ("2.5.1" also matches the build "2.5.1+cu124")."""
    found = subprocess.run([python, "-c", f"import {module}; print({module}.__version__)"], check=True, env=env,
                           cwd=cwd, capture_output=True, text=True)
    found = found.stdout.strip().splitlines()[-1]  # after DeepSpeed's own log lines
    if found != version and ("+" in version or found.split("+")[0] != version):
        raise RuntimeError(f"{python}: imports {module} {found}, not {version}")


def _build(venv: DeepSpeedVenv, cache: Path, log) -> None:
    out = log if log is not None else subprocess.DEVNULL
    torch_version = venv.torch_version()
    if venv.torch is None:
        subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--clear", str(venv.root)],
                       check=True, stdout=out, stderr=subprocess.STDOUT)
    else:
        base = torch_venv(venv.torch, cache, log=log)
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv.root)], check=True, stdout=out,
                       stderr=subprocess.STDOUT)
        torch_site = _site_packages(str(base / "bin" / "python"))
        Path(_site_packages(venv.python), "torch_venv.pth").write_text(f"import site; site.addsitedir({torch_site!r})\n")
    # torch stays the environment's: pip must not touch it (a constraint pins the release)
    constraint = venv.root / "constraints.txt"
    constraint.write_text(f"torch=={torch_version}\n")
    subprocess.run([venv.python, "-m", "pip", "install", "--quiet", "-c", str(constraint), f"deepspeed=={venv.version}"],
                   check=True, stdout=out, stderr=subprocess.STDOUT)
    env = dict(os.environ, **venv.env(), PYTHONPATH="")
    subprocess.run([venv.python, "-c", BUILD_OP], check=True, env=env, cwd=venv.root, stdout=out,
                   stderr=subprocess.STDOUT)
    _check_runs(venv.python, "deepspeed", venv.version, env, venv.root)
    _check_runs(venv.python, "torch", torch_version, env, venv.root)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("version")
    parser.add_argument("--torch", help="a torch release to run instead of this interpreter's")
    parser.add_argument("--cache", default=str(DEFAULT_CACHE))
    args = parser.parse_args(argv)
    venv = deepspeed_venv(args.version, args.cache, torch=args.torch, log=sys.stderr)
    print(venv.root, venv.env())


if __name__ == "__main__":
    main()
