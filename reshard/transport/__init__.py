"""How workers talk: an all-to-all of byte buffers plus small object collectives.

    from reshard.transport import transport_from_environment
    transport = transport_from_environment()      # torchrun: torch.distributed; mpiexec: MPI; else one worker
    received = transport.all_to_all(send_bytes, send_counts, recv_counts)

The exchange only needs `all_to_all` (uneven splits of a uint8 numpy buffer) and the job needs
`broadcast_object`/`all_gather_object`/`barrier`; any transport offering these works:
torch.distributed (gloo on CPU, NCCL on GPU; `torch_distributed.py`, which wraps the numpy
buffers as tensors at its edge), MPI through mpi4py (`mpi.py`), workers forked by
`python -m reshard --workers W` (`forked.py`: shared memory, no torch), torchrun workers that
all run on one host (`same_host.py`: they meet over abstract Unix sockets, then the same shared
memory as forked workers, no torch), torchrun workers on several nodes (`nodes.py`: shared memory
inside each node, torch.distributed between one leader per node), or one worker alone
(`local.py`). Only the torch.distributed transport and the node leaders import torch.

The exchange that runs a plan's rounds over a transport lives here too (`exchange`, with
`read_once`, `collective` for agreement, `failpoints` for tests): below the jobs, above formats/.
"""
from __future__ import annotations

import datetime
import os
import sys
from typing import Any, Protocol

import numpy as np

from reshard.errors import OptionError
from reshard.transport.local import LocalTransport
from reshard.transport.torch_backend import torch_backend_for

TRANSPORTS = ("auto", "torch", "mpi")
MPI_RANK_VARIABLES = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")
"""Set by Open MPI's mpirun, MPICH/Hydra's mpiexec (and srun --mpi=pmi2), and PMIx launchers."""

__all__ = ["Transport", "LocalTransport", "TorchDistributedTransport", "transport_from_environment",
           "started_by_mpi", "is_first_worker", "started_by_torchrun", "torch_backend_for", "TRANSPORTS"]


class Transport(Protocol):
    rank: int
    size: int
    name: str

    def all_to_all(self, send: np.ndarray, send_counts: list[int], recv_counts: list[int],
                   out: np.ndarray | None = None) -> np.ndarray:
        """Send `send[sum(send_counts[:p]):...]` (a uint8 numpy array) to peer p; return what each
        peer sent, in peer order.

        The result is `out` when given (a uint8 numpy array of sum(recv_counts) bytes); `send`
        may be reused as soon as this returns."""

    def broadcast_object(self, obj: Any, src: int = 0) -> Any: ...

    def all_gather_object(self, obj: Any) -> list: ...

    def barrier(self) -> None: ...

    def close(self) -> None: ...


def __getattr__(name: str):
    if name == "TorchDistributedTransport":  # imports torch: only when asked for
        from reshard.transport.torch_distributed import TorchDistributedTransport
        return TorchDistributedTransport
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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


def _choose(kind: str, backend: str = "auto") -> str:
    """"torch", "mpi" or "shared" for `--transport kind`, from how the process was started.

    "shared": torchrun started every worker of the job on this host (reshard.transport.same_host),
    and nothing asks for torch: no torch.distributed group is initialised in this process (the
    in-job path keeps its group) and no `--backend` is named (naming gloo or nccl asks for torch).
    "nodes": the same, but torchrun's workers span several nodes (or RESHARD_RANKS_PER_NODE says
    to treat this host's ranks as several): shared memory inside each node, torch.distributed
    between the nodes' leaders (reshard.transport.nodes)."""
    if kind not in TRANSPORTS:
        raise OptionError(f"--transport must be one of {', '.join(TRANSPORTS)}, got {kind!r}")
    if kind != "auto":
        return kind
    if _torch_group_initialised():
        return "torch"
    if started_by_torchrun():
        from reshard.transport import nodes, same_host
        if backend == "auto" and same_host.available():
            if nodes.spans_nodes(nodes.NodeLayout.from_environment()):
                return "nodes"
            if same_host.all_workers_on_this_host():
                return "shared"
        return "torch"
    if started_by_mpi():
        return "mpi"
    return "torch"


def _torch_group_initialised() -> bool:
    """Whether this process already joined a torch.distributed group (never imports torch to find out:
    a process that has not imported it has none)."""
    dist = sys.modules.get("torch.distributed")
    return dist is not None and dist.is_available() and dist.is_initialized()


def transport_from_environment(backend: str = "auto", timeout_seconds: float = 600, kind: str = "auto") -> Transport:
    """The transport for this process: `kind` "torch", "mpi", or "auto" (below).

    auto: the initialised torch.distributed group if there is one; under torchrun (and `backend`
    "auto"), shared memory when all workers run on this host, shared memory inside each node and
    torch.distributed between nodes when they span several, else torch.distributed; MPI
    (shared memory inside each node and MPI between their leaders when the ranks span several nodes)
    when an MPI launcher started the process (OMPI_COMM_WORLD_RANK, PMI_RANK or PMIX_RANK set); else torch.distributed if WORLD_SIZE > 1, else one worker alone.
    `timeout_seconds` bounds every collective: a worker whose peer died fails (torch) or aborts
    the MPI job (mpi) instead of hanging.
    """
    chosen = _choose(kind, backend)
    if chosen == "mpi":
        from reshard.transport import same_host
        from reshard.transport.mpi import MPITransport
        if same_host.available():  # ranks on several nodes: shared memory inside each, MPI between leaders
            from reshard.transport.nodes import join_mpi_nodes
            two_levels = join_mpi_nodes(timeout_seconds)
            if two_levels is not None:
                return two_levels
        return MPITransport(timeout_seconds=timeout_seconds, owns_process=True)
    if chosen == "nodes":
        from reshard.transport.nodes import NodeLayout, join_nodes
        return join_nodes(NodeLayout.from_environment(), backend, timeout_seconds)
    if chosen == "shared":
        from reshard.transport.same_host import job_identity, join_workers_on_this_host
        return join_workers_on_this_host(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), job_identity(),
                                         timeout_seconds)
    if not launched_with_workers() and not _torch_group_initialised():
        return LocalTransport()  # one worker alone: torch is not needed
    import torch
    import torch.distributed as dist

    from reshard.transport.torch_distributed import TorchDistributedTransport
    if dist.is_available() and dist.is_initialized():
        return TorchDistributedTransport()
    backend = torch_backend_for(backend, torch.cuda.device_count() if torch.cuda.is_available() else 0)
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_seconds))
    return TorchDistributedTransport(owns_group=True)
