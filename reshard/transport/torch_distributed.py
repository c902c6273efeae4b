"""Workers over torch.distributed: gloo on CPU, or NCCL with buffers staged through the GPU.

    import torch.distributed as dist
    dist.init_process_group("gloo")
    transport = TorchDistributedTransport()           # the default group, or group=...
    received = transport.all_to_all(send, send_counts, recv_counts)   # numpy uint8 arrays in and out

The Transport protocol moves numpy buffers; they are wrapped as tensors here (no copy on CPU).
"""
from __future__ import annotations

import numpy as np
import torch


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
        host = out if out is not None else np.empty(sum(recv_counts), dtype=np.uint8)
        result = torch.empty(sum(recv_counts), dtype=torch.uint8, device=self.device) if on_device \
            else torch.from_numpy(host)
        self.dist.all_to_all_single(result, torch.from_numpy(send).to(self.device), recv_counts, send_counts,
                                    group=self.group)
        if on_device:
            torch.from_numpy(host).copy_(result)
        return host

    def broadcast_object(self, obj, src=0):
        box = [obj]
        self.dist.broadcast_object_list(box, src=src, group=self.group, device=self.device)
        return box[0]

    def send_object(self, obj, dst: int) -> None:
        """`obj`, pickled, to worker `dst` alone (which calls `recv_object` with this worker's rank)."""
        self.dist.send_object_list([obj], dst=self._global(dst), group=self.group, device=self.device)

    def recv_object(self, src: int):
        """What worker `src` sends with `send_object`."""
        box = [None]
        self.dist.recv_object_list(box, src=self._global(src), group=self.group, device=self.device)
        return box[0]

    def _global(self, rank: int) -> int:
        """A worker's rank in the default group, which send/recv_object_list name it by."""
        return rank if self.group is None else self.dist.get_global_rank(self.group, rank)

    def all_gather_object(self, obj):
        out = [None] * self.size
        self.dist.all_gather_object(out, obj, group=self.group)
        return out

    def barrier(self):
        self.dist.barrier(group=self.group)

    def close(self):
        if self.owns_group and self.dist.is_initialized():
            self.dist.destroy_process_group()
