"""Deterministic synthetic batches: a different micro-batch per (rank, step), one fixed eval batch.

    python -c "from reshard_proof.batches import train_batch; print(train_batch(seed=0, step=0, rank=1))"

The task is learnable (target = (3 * token + 1) mod vocab) so losses move and optimizer
states become non-trivial within a few steps.
"""

import torch

from reshard_proof.model import VOCAB_SIZE

SEQUENCE_LENGTH = 5
EVAL_BATCH_SIZE = 4
EVAL_BATCH_SEED = 777


def _batch(generator: torch.Generator, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, VOCAB_SIZE, (batch_size, SEQUENCE_LENGTH), generator=generator)
    return tokens, (3 * tokens + 1) % VOCAB_SIZE


def train_batch(*, seed: int, step: int, rank: int, batch_size: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """The micro-batch that `rank` trains on at `step`; distinct across ranks and steps."""
    generator = torch.Generator().manual_seed(1_000_003 * seed + 1_009 * step + rank)
    return _batch(generator, batch_size)


def eval_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """The same batch on every rank, every run: the eval loss is a function of the weights only."""
    return _batch(torch.Generator().manual_seed(EVAL_BATCH_SEED), EVAL_BATCH_SIZE)
