"""A tiny attention model trained with DeepSpeed Ulysses sequence parallelism (sp ranks share one
sequence, each holding a contiguous slice of it).

    python -c "from reshard_proof.ulysses_model import UlyssesProofModel; print(UlyssesProofModel(1))"

Used by the harness variants with `sequence_parallel` set (reshard_proof.variants, engine_setup):
at sp > 1 the attention runs through `deepspeed.sequence.layer.DistributedAttention` over the
sequence-parallel group of DeepSpeed's own sp mpu (runtime/sequence_parallel/parallel_state_sp.py),
which DeepSpeed then uses to partition ZeRO over the sequence-data-parallel group (sp x dp ranks).
At sp 1 the same local attention runs directly. The parameters are the same at every sp size, so
a checkpoint saved at one sp loads into an engine at another: what a reshard between sp sizes needs.

Every rank returns the loss averaged over its sp group (a value identical on the group's ranks, so
the harness's eval loss is one number), while backward sees only the rank's own slice: ZeRO's
gradient averaging over the sequence-data-parallel group then gives the mean over all slices.
"""

import torch
import torch.nn.functional as F
from torch import nn

from reshard_proof.model import FROZEN_LAYER_SEED, VOCAB_SIZE

EMBED_DIM = 7
HEADS = 4            # divisible by every sp size the suite uses (1, 2, 4): Ulysses splits heads
HEAD_DIM = 3
SEQUENCE = 4         # the first 4 positions of the harness batches (batches.SEQUENCE_LENGTH 5): divisible by sp
FROZEN_DIM = 5


def _local_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """Full-sequence attention over this rank's heads; [seq, batch, heads, dim] in and out."""
    q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True).permute(2, 0, 1, 3)


class _LocalAttention(nn.Module):
    def forward(self, query, key, value):
        return _local_attention(query, key, value)


class _GroupMean(torch.autograd.Function):
    """Forward: the mean of `local` over `group` (the same value on every rank of it). Backward: the
    gradient passes to `local` unchanged, as if each rank had returned its own loss."""

    @staticmethod
    def forward(ctx, local, group, size):
        import torch.distributed as dist
        total = local.detach().clone()
        dist.all_reduce(total, group=group)
        return total / size

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class UlyssesProofModel(nn.Module):
    """embed -> [embedding, frozen projection] -> q, k, v -> (Distributed)Attention -> out -> gain -> head.

    forward(tokens, targets) takes the full sequence (the same on every rank of an sp group) and
    works on this rank's slice of it. Two param groups (build_param_groups), a frozen layer and a
    persistent buffer, as the proof model has.
    """

    def __init__(self, sequence_parallel: int) -> None:
        super().__init__()
        self.sequence_parallel = sequence_parallel
        self.embed = nn.Embedding(VOCAB_SIZE, EMBED_DIM)
        self.frozen_proj = nn.Linear(EMBED_DIM, FROZEN_DIM)
        width = HEADS * HEAD_DIM
        self.query = nn.Linear(EMBED_DIM + FROZEN_DIM, width)
        self.key = nn.Linear(EMBED_DIM + FROZEN_DIM, width, bias=False)
        self.value = nn.Linear(EMBED_DIM + FROZEN_DIM, width)
        self.out = nn.Linear(width, EMBED_DIM)
        self.gain = nn.Parameter(torch.ones(EMBED_DIM))
        self.head = nn.Linear(EMBED_DIM, VOCAB_SIZE, bias=False)
        self.register_buffer("num_updates", torch.zeros((), dtype=torch.int64))

        generator = torch.Generator().manual_seed(FROZEN_LAYER_SEED)
        with torch.no_grad():
            self.frozen_proj.weight.copy_(torch.randn(self.frozen_proj.weight.shape, generator=generator) * 0.3)
            self.frozen_proj.bias.copy_(torch.randn(self.frozen_proj.bias.shape, generator=generator) * 0.1)
        self.frozen_proj.requires_grad_(False)

        self._group = None
        if sequence_parallel > 1:
            from deepspeed.runtime.sequence_parallel import parallel_state_sp
            from deepspeed.sequence.layer import DistributedAttention
            self._group = parallel_state_sp.get_sequence_parallel_group()
            # [seq, batch, heads, dim]: scatter heads (2), gather the sequence (0), batch on dim 1
            self.attention = DistributedAttention(_LocalAttention(), self._group, scatter_idx=2, gather_idx=0)
        else:
            self.attention = None

    def _slice(self, tokens: torch.Tensor) -> torch.Tensor:
        tokens = tokens[:, :SEQUENCE]
        if self._group is None:
            return tokens
        import torch.distributed as dist
        length = SEQUENCE // self.sequence_parallel
        start = dist.get_rank(self._group) * length
        return tokens[:, start:start + length]

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        tokens, targets = self._slice(tokens), self._slice(targets)
        hidden = self.embed(tokens)
        features = torch.cat([hidden, self.frozen_proj(hidden)], dim=-1).transpose(0, 1)  # [seq, batch, .]
        shape = (*features.shape[:2], HEADS, HEAD_DIM)
        q, k, v = (proj(features).view(shape) for proj in (self.query, self.key, self.value))
        if self.attention is None:
            context = _local_attention(q, k, v)
        else:
            context = self.attention(q, k, v, 1)
        hidden = hidden + self.out(context.flatten(2)).transpose(0, 1)
        if self.training:
            with torch.no_grad():
                self.num_updates.add_(1)
        logits = self.head(hidden * self.gain)
        loss = F.cross_entropy(logits.float().flatten(0, -2), targets.flatten())
        if self._group is None:
            return loss
        return _GroupMean.apply(loss, self._group, self.sequence_parallel)
