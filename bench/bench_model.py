"""The benchmark's transformer-like model, its sizes, its param groups and its DeepSpeed config.

    python bench/bench_model.py            # parameter counts of the full and quick models
    python bench/bench_model.py --quick

Imported by make_checkpoint.py (train one step, save) and load_timing.py (build an engine at the
target world size and time load_checkpoint). Plain nn.Module: token + position embeddings,
pre-norm blocks (LayerNorm, qkv/out Linear attention, 4x MLP, all with biases), a final
LayerNorm and an output head tied to the token embedding; the position embedding is frozen
(see ModelConfig.frozen_position). Two optimizer groups: matrices with weight decay, vectors
(biases, norms) without.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class ModelConfig:
    """Sizes of the benchmark model; everything that changes the checkpoint is in here."""

    name: str
    """Short label used in cache directory names and tables."""
    vocab_size: int
    """Rows of the token embedding (also the tied output head)."""
    dim: int
    """Width of the residual stream."""
    layers: int
    """Number of transformer blocks."""
    heads: int
    """Attention heads (dim must divide by it)."""
    seq_len: int
    """Tokens per sample in the training step (kept small: one step must be fast on CPU)."""
    micro_batch: int = 1
    """Samples per rank in the training step."""
    frozen_position: bool = True
    """Freeze the position embedding. ZeRO-3 then saves frozen_param_fragments; reshard (at the
    time of writing) refuses a ZeRO-3 checkpoint whose frozen_param_fragments is empty, so the
    benchmark keeps one frozen parameter unless run with --no-frozen."""

    def key(self, **extra) -> str:
        """A short hash of the config plus `extra` (stage, ranks, versions): the cache key."""
        text = json.dumps({**dataclasses.asdict(self), **extra}, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:10]

    @property
    def param_count(self) -> int:
        d, mlp = self.dim, 4 * self.dim
        block = (d * 3 * d + 3 * d) + (d * d + d) + (d * mlp + mlp) + (mlp * d + d) + 4 * d
        return self.vocab_size * d + self.seq_len * d + self.layers * block + 2 * d


FULL = ModelConfig(name="t272m", vocab_size=32000, dim=1024, layers=19, heads=16, seq_len=32)
QUICK = ModelConfig(name="t23m", vocab_size=8192, dim=512, layers=6, heads=8, seq_len=32)
LADDER = {  # checkpoint size (ZeRO-2 fp32 AdamW: ~16 bytes per parameter) -> model
    "100M": ModelConfig(name="l100m", vocab_size=4096, dim=256, layers=7, heads=4, seq_len=32),
    "1G": ModelConfig(name="l1g", vocab_size=16000, dim=640, layers=11, heads=10, seq_len=32),
    "2.5G": ModelConfig(name="l2500m", vocab_size=32000, dim=1024, layers=10, heads=16, seq_len=32),
    "10G": ModelConfig(name="l10g", vocab_size=32000, dim=2048, layers=12, heads=16, seq_len=32),  # 10.7 GB
}


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then a 4x GELU MLP."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.heads = cfg.heads
        self.norm1 = nn.LayerNorm(cfg.dim)
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.out = nn.Linear(cfg.dim, cfg.dim)
        self.norm2 = nn.LayerNorm(cfg.dim)
        self.up = nn.Linear(cfg.dim, 4 * cfg.dim)
        self.down = nn.Linear(4 * cfg.dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(attended.transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class BenchModel(nn.Module):
    """Token + position embedding, `layers` blocks, final norm, head tied to the token embedding."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.position = nn.Embedding(cfg.seq_len, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = nn.LayerNorm(cfg.dim)
        nn.init.normal_(self.embed.weight, std=0.02)  # GPT-style; N(0, 1) would blow up the tied logits
        nn.init.normal_(self.position.weight, std=0.02)
        self.position.weight.requires_grad_(not cfg.frozen_position)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.position(torch.arange(tokens.shape[1]))
        for block in self.blocks:
            x = block(x)
        logits = F.linear(self.norm(x), self.embed.weight)  # the tied output head
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def build_model(cfg: ModelConfig, initialise: bool = True) -> BenchModel:
    """The model; with initialise=False its storage is allocated but never written (load timing)."""
    if initialise:
        return BenchModel(cfg)
    with torch.device("meta"):
        model = BenchModel(cfg)
    return model.to_empty(device="cpu")


def param_groups(model: nn.Module) -> list[dict]:
    """Two optimizer groups in model order: matrices with decay, vectors without; frozen in neither."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in trainable if p.ndim >= 2]
    no_decay = [p for p in trainable if p.ndim < 2]
    return [dict(params=decay, weight_decay=0.1, lr=3e-4), dict(params=no_decay, weight_decay=0.0, lr=6e-4)]


def ds_config(stage: int, micro_batch: int, universal: bool = False) -> dict:
    """fp32 ZeRO-`stage` config; small buckets keep 4 CPU ranks of this model inside 24 GB."""
    zero = {"stage": stage, "reduce_bucket_size": 50_000_000, "allgather_bucket_size": 50_000_000}
    if stage == 3:
        zero = {"stage": 3, "reduce_bucket_size": 50_000_000, "stage3_prefetch_bucket_size": 50_000_000,
                "stage3_max_live_parameters": 100_000_000}
    config = {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": 1,
              "gradient_clipping": 1.0, "zero_optimization": zero, "steps_per_print": 1_000_000,
              "wall_clock_breakdown": False}
    if universal:
        config["checkpoint"] = {"load_universal": True}
    return config


def build_engine(cfg: ModelConfig, stage: int, *, initialise: bool = True, universal: bool = False):
    """deepspeed.initialize over the model with torch AdamW; call after init_distributed."""
    import deepspeed
    model = build_model(cfg, initialise)
    optimizer = torch.optim.AdamW(param_groups(model), betas=(0.9, 0.95), eps=1e-8)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer,
                                           config=ds_config(stage, cfg.micro_batch, universal))
    return engine


def config_from_json(text: str) -> ModelConfig:
    return ModelConfig(**json.loads(text))


def config_to_json(cfg: ModelConfig) -> str:
    return json.dumps(dataclasses.asdict(cfg))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    cfg = QUICK if parser.parse_args().quick else FULL
    counted = sum(p.numel() for p in build_model(cfg, initialise=False).parameters())
    print(f"{cfg.name}: {counted:,} parameters (formula {cfg.param_count:,}); fp32 weights {counted * 4 / 1e9:.2f} GB")


if __name__ == "__main__":
    main()
