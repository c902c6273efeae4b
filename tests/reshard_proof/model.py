"""A tiny model whose parameter sizes make ZeRO padding appear at every world size 1..8.

    python -c "from reshard_proof.model import ProofModel; m = ProofModel(); print(m.describe())"

Both optimizer param groups hold an odd number of elements (257 and 23), so flattening pads them at
any world size (ZeRO-1/2 pads each group to a multiple of 2*W), and most parameters have an odd
numel, so ZeRO-3's per-parameter ceil(n/W) chunks are padded too. The model also carries what a
checkpoint must not lose: a frozen layer, a tied output head, a persistent buffer pair and a
non-persistent buffer.
"""

import torch
import torch.nn.functional as F
from torch import nn

VOCAB_SIZE = 11
EMBED_DIM = 7
FROZEN_DIM = 6
HIDDEN_DIM = 9

# The frozen layer is drawn from its own generator, not the global seed: a target engine built
# from another seed must still hold the same frozen weights when the checkpoint excluded them.
FROZEN_LAYER_SEED = 20240917

# Weight of the newest observation in the running_mean exponential average.
RUNNING_STATS_MOMENTUM = 0.25

DECAY_GROUP = dict(name="decay", weight_decay=0.1, lr=1e-3)
NO_DECAY_GROUP = dict(name="no_decay", weight_decay=0.0, lr=2e-3)


class ProofModel(nn.Module):
    """embed -> [embedding, frozen projection] -> up -> gelu -> down -> gain -> tied head.

    forward(tokens, targets) returns the mean cross-entropy loss, which is what the DeepSpeed
    engine is trained on.
    """

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB_SIZE, EMBED_DIM)                       # 77
        self.frozen_proj = nn.Linear(EMBED_DIM, FROZEN_DIM)                    # 42 + 6, frozen
        self.up = nn.Linear(EMBED_DIM + FROZEN_DIM, HIDDEN_DIM)                # 117 + 9
        self.down = nn.Linear(HIDDEN_DIM, EMBED_DIM)                           # 63 + 7
        self.gain = nn.Parameter(torch.ones(EMBED_DIM))                        # 7
        self.head = nn.Linear(EMBED_DIM, VOCAB_SIZE, bias=False)
        self.head.weight = self.embed.weight                                   # tied alias

        generator = torch.Generator().manual_seed(FROZEN_LAYER_SEED)
        with torch.no_grad():
            self.frozen_proj.weight.copy_(torch.randn(self.frozen_proj.weight.shape, generator=generator) * 0.3)
            self.frozen_proj.bias.copy_(torch.randn(self.frozen_proj.bias.shape, generator=generator) * 0.1)
        self.frozen_proj.requires_grad_(False)

        # Persistent: updated in training from the (rank-identical) weights, never from the
        # rank-local batch, so every rank holds the same value and rank 0's truth is everyone's.
        self.register_buffer("running_mean", torch.zeros(EMBED_DIM))
        self.register_buffer("num_updates", torch.zeros((), dtype=torch.int64))
        # Non-persistent: rebuilt identically by the constructor, never saved.
        self.register_buffer("position_scale", torch.linspace(1.0, 0.5, 5), persistent=False)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(tokens)
        hidden = hidden * self.position_scale[: tokens.shape[-1]].to(hidden.dtype).unsqueeze(-1)
        features = torch.cat([hidden, self.frozen_proj(hidden)], dim=-1)
        hidden = hidden + self.down(F.gelu(self.up(features)))
        if self.training:
            with torch.no_grad():
                observed = self.down.bias.detach().to(self.running_mean.dtype)
                self.running_mean.mul_(1 - RUNNING_STATS_MOMENTUM).add_(observed * RUNNING_STATS_MOMENTUM)
                self.num_updates.add_(1)
        hidden = (hidden - self.running_mean.to(hidden.dtype)) * self.gain
        logits = self.head(hidden)
        return F.cross_entropy(logits.float().flatten(0, -2), targets.flatten())

    def describe(self) -> str:
        lines = [f"{name}: {tuple(p.shape)} numel={p.numel()} trainable={p.requires_grad}"
                 for name, p in self.named_parameters()]
        lines += [f"buffer {name}: {tuple(b.shape)}" for name, b in self.named_buffers()]
        return "\n".join(lines)


def build_param_groups(model: nn.Module) -> list[dict]:
    """Two optimizer groups with different hyperparameters; frozen parameters are in neither.

    "decay": matrices (weight_decay 0.1, lr 1e-3); "no_decay": biases and gains (0.0, 2e-3).
    """
    decay, no_decay = [], []
    for name, param in model.named_parameters():  # the tied head.weight is yielded once, as embed.weight
        if not param.requires_grad:
            continue
        (decay if param.ndim >= 2 else no_decay).append(param)
    return [dict(DECAY_GROUP, params=decay), dict(NO_DECAY_GROUP, params=no_decay)]
