"""How workers talk: an all-to-all of byte buffers plus small object collectives.

    from reshard.transport import transport_from_environment
    transport = transport_from_environment()      # torchrun: torch.distributed; mpiexec: MPI; else one worker
    received = transport.all_to_all(send_bytes, send_counts, recv_counts)

The exchange only needs `all_to_all` (uneven splits of a uint8 buffer) and the job needs
`broadcast_object`/`all_gather_object`/`barrier`; any transport offering these works:
torch.distributed (gloo on CPU, NCCL on GPU; `torch_distributed.py`), MPI through mpi4py
(`mpi.py`), or one worker alone (`local.py`).
"""
from __future__ import annotations

import datetime
import os
from typing import Any, Protocol

import torch

from reshard.errors import OptionError
from reshard.transport.local import LocalTransport
from reshard.transport.torch_distributed import TorchDistributedTransport

TRANSPORTS = ("auto", "torch", "mpi")
MPI_RANK_VARIABLES = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")
"""Set by Open MPI's mpirun, MPICH/Hydra's mpiexec (and srun --mpi=pmi2), and PMIx launchers."""

__all__ = ["Transport", "LocalTransport", "TorchDistributedTransport", "transport_from_environment",
           "started_by_mpi", "is_first_worker", "started_by_torchrun", "TRANSPORTS"]


class Transport(Protocol):
    rank: int
    size: int
    name: str

    def all_to_all(self, send: torch.Tensor, send_counts: list[int], recv_counts: list[int],
                   out: torch.Tensor | None = None) -> torch.Tensor:
        """Send `send[sum(send_counts[:p]):...]` to peer p; return what each peer sent, in peer order.

        The result is `out` when given (a CPU tensor of sum(recv_counts) bytes); `send` may be
        reused as soon as this returns."""

    def broadcast_object(self, obj: Any, src: int = 0) -> Any: ...

    def all_gather_object(self, obj: Any) -> list: ...

    def barrier(self) -> None: ...

    def close(self) -> None: ...


def launched_with_workers() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def started_by_torchrun() -> bool:
    """torchrun (torch.distributed.elastic) names its run in every worker's environment."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def started_by_mpi() -> bool:
    return any(name in os.environ for name in MPI_RANK_VARIABLES)


def is_first_worker() -> bool:
    """Whether this process is worker 0 of its launcher (torchrun or MPI), or runs alone."""
    for name in ("RANK", *MPI_RANK_VARIABLES):
        if name in os.environ:
            return os.environ[name] == "0"
    return True


def _choose(kind: str) -> str:
    """"torch", "mpi" or "local" for `--transport kind`, from how the process was started."""
    import torch.distributed as dist
    if kind not in TRANSPORTS:
        raise OptionError(f"--transport must be one of {', '.join(TRANSPORTS)}, got {kind!r}")
    if kind != "auto":
        return kind
    if (dist.is_available() and dist.is_initialized()) or started_by_torchrun():
        return "torch"
    if started_by_mpi():
        return "mpi"
    return "torch"


def transport_from_environment(backend: str = "auto", timeout_seconds: float = 600, kind: str = "auto") -> Transport:
    """The transport for this process: `kind` "torch", "mpi", or "auto" (below).

    auto: the initialised torch.distributed group if there is one; torch.distributed under
    torchrun; MPI when an MPI launcher started the process (OMPI_COMM_WORLD_RANK, PMI_RANK or
    PMIX_RANK set); else torch.distributed if WORLD_SIZE > 1, else one worker alone.
    `timeout_seconds` bounds every collective: a worker whose peer died fails (torch) or aborts
    the MPI job (mpi) instead of hanging.
    """
    import torch.distributed as dist
    if _choose(kind) == "mpi":
        from reshard.transport.mpi import MPITransport
        return MPITransport(timeout_seconds=timeout_seconds, owns_process=True)
    if dist.is_available() and dist.is_initialized():
        return TorchDistributedTransport()
    if not launched_with_workers():
        return LocalTransport()
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_seconds))
    return TorchDistributedTransport(owns_group=True)
