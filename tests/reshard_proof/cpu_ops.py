"""Build DeepSpeed's CPU optimizer op once, before any ranks start.

    python -m reshard_proof.cpu_ops          # builds DeepSpeedCPUAdam's op if needed, prints the seconds

    from reshard_proof.cpu_ops import build_cpu_ops_for
    build_cpu_ops_for(["z2_offload", "z2_fp32"])     # builds only if a variant needs DeepSpeedCPUAdam

DeepSpeedCPUAdam (ZeRO-Offload's optimizer) is a C++ op DeepSpeed compiles on first use
(ops/op_builder/cpu/cpu_adam.py `CPUAdamBuilder`, through torch.utils.cpp_extension into
TORCH_EXTENSIONS_DIR): about 3 minutes on a loaded 2-core machine, a no-op once built. Building it
here, in one process, keeps the ranks of a launch from all compiling it at once (they would wait
on one another's lock file, each inside a launch timeout). A clean CI machine pays the build once
per session; later sessions find it in TORCH_EXTENSIONS_DIR.
"""
from __future__ import annotations

import subprocess
import sys
import time

from reshard_proof.launch import child_env
from reshard_proof.variants import get_variant

BUILD_CPU_ADAM = ("from deepspeed.accelerator import get_accelerator\n"
                  "get_accelerator().create_op_builder('CPUAdamBuilder').load()\n")

_built: set[str] = set()


def build_cpu_adam(env: dict | None = None, timeout: float = 1800) -> float:
    """Compile (or find) the CPUAdam op in a process of its own; returns the seconds it took."""
    started = time.perf_counter()
    result = subprocess.run([sys.executable, "-c", BUILD_CPU_ADAM], env=child_env(env), capture_output=True,
                            text=True, timeout=timeout)
    if result.returncode != 0:
        raise RuntimeError(f"building DeepSpeed's CPUAdam op failed (exit {result.returncode}):\n"
                           f"{(result.stdout + result.stderr)[-3000:]}")
    return time.perf_counter() - started


def build_cpu_ops_for(variant_names, env: dict | None = None) -> None:
    """Build the CPU ops the named variants' engines load (once per process)."""
    if "cpu_adam" in _built:
        return
    if any(get_variant(name).optimizer == "ds_cpu_adam" for name in variant_names):
        build_cpu_adam(env)
        _built.add("cpu_adam")


if __name__ == "__main__":
    print(f"CPUAdam op ready in {build_cpu_adam():.1f} s")
