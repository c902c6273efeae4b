"""How workers talk: an all-to-all of byte buffers plus small object collectives.

    from reshard.transport import transport_from_environment
    transport = transport_from_environment()      # torchrun: torch.distributed; else one worker
    received = transport.all_to_all(send_bytes, send_counts, recv_counts)

The exchange only needs `all_to_all` (uneven splits of a uint8 buffer) and the job needs
`broadcast_object`/`all_gather_object`/`barrier`; any transport offering these works
(torch.distributed with gloo on CPU or NCCL on GPU here; MPI can slot in the same way).
"""
from __future__ import annotations

import datetime
import os
from typing import Any, Protocol

import torch


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


class LocalTransport:
    """A single worker: every exchange is with itself."""

    rank, size, name = 0, 1, "local"

    def all_to_all(self, send, send_counts, recv_counts, out=None):
        assert send_counts == recv_counts, (send_counts, recv_counts)
        if out is None:
            return send.clone()
        return out.copy_(send)

    def broadcast_object(self, obj, src=0):
        return obj

    def all_gather_object(self, obj):
        return [obj]

    def barrier(self):
        pass

    def close(self):
        pass


class TorchDistributedTransport:
    """torch.distributed over a process group; buffers go through the GPU when the backend is NCCL."""

    def __init__(self, group=None, owns_group: bool = False):
        import torch.distributed as dist
        self.dist, self.group, self.owns_group = dist, group, owns_group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        backend = str(dist.get_backend(group))
        self.name = f"torch.distributed/{backend}"
        self.device = torch.device("cpu")
        if "nccl" in backend:
            self.device = torch.device("cuda", torch.cuda.current_device())

    def all_to_all(self, send, send_counts, recv_counts, out=None):
        on_device = self.device.type != "cpu"
        result = out if out is not None and not on_device else \
            torch.empty(sum(recv_counts), dtype=send.dtype, device=self.device)
        self.dist.all_to_all_single(result, send.to(self.device), recv_counts, send_counts, group=self.group)
        if on_device:
            return out.copy_(result) if out is not None else result.cpu()
        return result

    def broadcast_object(self, obj, src=0):
        box = [obj]
        self.dist.broadcast_object_list(box, src=src, group=self.group, device=self.device)
        return box[0]

    def all_gather_object(self, obj):
        out = [None] * self.size
        self.dist.all_gather_object(out, obj, group=self.group)
        return out

    def barrier(self):
        self.dist.barrier(group=self.group)

    def close(self):
        if self.owns_group and self.dist.is_initialized():
            self.dist.destroy_process_group()


def launched_with_workers() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def transport_from_environment(backend: str = "auto", timeout_seconds: float = 600) -> Transport:
    """The job's process group if one exists, a new one under torchrun, else a single worker.

    `timeout_seconds` bounds every collective: a worker whose peer died fails instead of hanging.
    """
    import torch.distributed as dist
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
