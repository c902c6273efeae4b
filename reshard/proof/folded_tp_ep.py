"""Train and save a DeepSpeed AutoEP checkpoint folded with AutoTP (tensor and expert parallelism together).

    DS_ACCELERATOR=cpu torchrun --standalone --nproc_per_node=4 -m reshard.proof.folded_tp_ep \
        --stage 2 --tp 2 --ep 2 --save-dir /tmp/folded

reshard refuses these checkpoints (formats/deepspeed_inspect.py `_refuse_tensor_and_expert_parallel`);
this trains the real thing that the refusal is tested on. DeepSpeed 0.19.8 trains and saves it on
CPU ranks at ZeRO-1, 2 and 3 (module_inject/auto_ep_folding.py `build_folding_spec`: TP groups of
consecutive ranks, dense DP strided over TP lanes, EP groups of consecutive ranks that may cross TP
lanes, expert DP across EP groups). The model is `AutoEPProofModel` (two AutoEP MoE layers) with a
column-parallel `up` and a row-parallel `down` AutoTP splits, so that the save holds TP shards as
well as experts. The ranks of a TP group train on the same micro-batch (AutoTP replicates the
activations over the TP group), chosen by the dense data-parallel rank.
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn

from reshard.proof.moe_model import AUTOEP_HIDDEN, AutoEPProofModel, build_autoep_param_groups

TP_FFN = 12
LAYER_SPECS = [
    {"patterns": [r"^up\.weight$"], "partition_type": "column"},
    {"patterns": [r"^down\.weight$"], "partition_type": "row"},
]


class FoldedProofModel(AutoEPProofModel):
    """AutoEPProofModel with a TP-split MLP (`up` column, `down` row) after the embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(AUTOEP_HIDDEN, TP_FFN)
        self.down = nn.Linear(TP_FFN, AUTOEP_HIDDEN)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(tokens)
        hidden = hidden + self.down(F.gelu(self.up(hidden)))
        for layer in self.model.layers:
            out = layer.mlp(layer.norm(hidden))
            hidden = hidden + (out[0] if isinstance(out, tuple) else out)
        return F.cross_entropy(self.head(hidden).float().flatten(0, -2), targets.flatten())


def ds_config(stage: int, tp: int, ep: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "steps_per_print": 1_000_000,
        "expert_parallel": {"enabled": True, "autoep_size": ep, "preset_model": "mixtral"},
        "tensor_parallel": {"autotp_size": tp,
                            "partition_config": {"use_default_specs": False, "layer_specs": LAYER_SPECS}},
    }


def main() -> None:
    import deepspeed
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    from reshard.proof.batches import train_batch
    from reshard.proof.engine_setup import finish_and_exit, init_distributed

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stage", type=int, required=True)
    parser.add_argument("--tp", type=int, required=True)
    parser.add_argument("--ep", type=int, required=True)
    parser.add_argument("--save-dir", required=True)
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()

    init_distributed()
    torch.manual_seed(0)
    model = FoldedProofModel()
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=build_autoep_param_groups(model),
        optimizer=lambda groups: torch.optim.AdamW(
            split_params_into_different_moe_groups_for_optimizer([dict(group) for group in groups])),
        config=ds_config(args.stage, args.tp, args.ep))
    dense_dp_rank = torch.distributed.get_rank() // args.tp  # auto_ep_folding.py `expected_folding_group_tables`
    for step in range(args.steps):
        tokens, targets = train_batch(seed=0, step=step, rank=dense_dp_rank, batch_size=2)
        loss = engine(tokens, targets)
        engine.backward(loss)
        engine.step()
        if not torch.isfinite(loss.detach()):
            raise RuntimeError(f"loss {loss.item()} at step {step}")
    engine.save_checkpoint(args.save_dir)
    finish_and_exit()


if __name__ == "__main__":
    main()
