"""Workers over torch.distributed: gloo on CPU, or NCCL with buffers staged through the GPU.

    import torch.distributed as dist
    dist.init_process_group("gloo")
    transport = TorchDistributedTransport()           # the default group, or group=...
    received = transport.all_to_all(send, send_counts, recv_counts)
"""
from __future__ import annotations

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
