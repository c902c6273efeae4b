"""Which torch.distributed backend a group of workers takes: gloo or NCCL, from the GPUs a host has.

    from reshard.transport.torch_backend import torch_backend_for
    torch_backend_for("auto", gpus_visible=8, local_workers=8)   # "nccl"

Its own module, below both the package's transport choice (`reshard/transport/__init__.py`) and the
node leaders (`nodes.py`), which each need it: kept in `__init__`, `nodes` imported its own package
back, and that package imports `nodes`: a cycle import-linter's acyclic_siblings cannot see.
"""
from __future__ import annotations

import os

from reshard.errors import OptionError


def torch_backend_for(backend: str, gpus_visible: int, local_workers: int | None = None) -> str:
    """The torch.distributed backend: NCCL needs a GPU of its own for every worker on a host (two
    ranks on one GPU is refused by NCCL, and LOCAL_RANK past the device count by CUDA), so "auto"
    takes NCCL only when each local worker has one, else gloo; an explicit "nccl" without enough
    GPUs is refused by name. Found on one H200 with two workers: set_device(1) failed with
    "invalid device ordinal". `local_workers`: the processes of this host that join the group
    (the node leaders of reshard.transport.nodes pass 1)."""
    if local_workers is None:  # every worker of this host joins the group (default: torchrun's count)
        local_workers = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if backend == "auto":
        return "nccl" if gpus_visible >= local_workers else "gloo"
    if backend == "nccl" and gpus_visible < local_workers:
        raise OptionError(f"--backend nccl needs one GPU for each worker on a host: {local_workers} workers "
                          f"on this host (LOCAL_WORLD_SIZE), {gpus_visible} GPU(s) visible; use --backend gloo "
                          "or fewer workers per host")
    return backend
