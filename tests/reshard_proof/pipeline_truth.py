"""A PipelineModule save's truth as the FSDP2 judge reads a truth, and a model without a pipeline under the same names.

    from reshard_proof.pipeline_truth import judge_truth, proof_model, proof_param_groups
    truth = judge_truth("/tmp/pipe.truth")        # tests/pipeline_run.py's truth directory (one file per rank)
    model = proof_model(truth["model"])           # tied_modules.embed, children "1", "3", "4", "5"
    optimizer = torch.optim.AdamW(proof_param_groups(model, truth["model"]))

tests/pipeline_run.py records, per rank, its stage's fp32 masters and Adam moments by name (read from the
live engine with safe_get_full_fp32_param / safe_get_full_optimizer_state), frozen values, buffers and the
engine's counters, its LR scheduler's state_dict and the Adam steps its optimizer holds
(`pipeline_run.run_state`). `judge_truth` gives them the shape of reshard_proof.fsdp2_judge's truth: every
parameter once (a tied one is in each stage holding it, equal; with a model axis every model rank's slices
joined whole by that harness's own layers, `pipeline_run.sliced_truth`), each with Adam's step as the
optimizers recorded it (one value on every rank, or a ValueError), and the scheduler's state, which the
judge compares with the export's. Betas and eps are torch AdamW's defaults, which the harness's config
leaves as they are ("Adam", torch_adam, lr and weight_decay given). The client state is the harness's own
key (`{"note": "pipeline"}`).

`proof_model` is the model a user moving to FSDP2 builds: the same layers as tests/pipeline_run.py's
PipelineModule at pp=1 (no model axis: the parallel Linears whole), registered under the names
`PipelineModule.state_dict()` gives them: each layer as the child `str(index)` and the tied embedding
once as `tied_modules.embed` (docs/moving-to-fsdp2.md says how to map other names).
"""
from __future__ import annotations

import os

import torch
from pipeline_run import DIM, VOCAB, ScaledLayerNorm, param_groups, sliced_truth
from torch import nn

ADAMW_BETAS, ADAMW_EPS = (0.9, 0.999), 1e-8


def judge_truth(truth_dir: str) -> dict:
    truths = [torch.load(os.path.join(truth_dir, name), map_location="cpu", weights_only=True)
              for name in sorted(os.listdir(truth_dir))]
    if truths[0].get("tp", 1) > 1:
        tensors = sliced_truth(truths, 1, 0)
    else:
        tensors = {}
        for truth in truths:
            for name, states in truth["tensors"].items():
                tensors.setdefault(name, states)
    counters = truths[0]["counters"]
    steps = sorted({step for truth in truths for step in truth["adam_steps"]})  # tests/pipeline_run.py run_state
    if len(steps) != 1:
        raise ValueError(f"{truth_dir}: the ranks' optimizers hold Adam steps {steps}, not one")
    step = steps[0]
    master = {name: {"fp32": s["fp32"], "state": {"exp_avg": s["exp_avg"], "exp_avg_sq": s["exp_avg_sq"]},
                     "scalars": {"step": step}} for name, s in tensors.items() if "fp32" in s}
    frozen = {name: s["frozen"] for name, s in tensors.items() if "frozen" in s}
    buffers = {name: s["buffer"] for name, s in tensors.items() if "buffer" in s}
    groups = [{"lr": group["lr"], "weight_decay": group["weight_decay"], "betas": ADAMW_BETAS, "eps": ADAMW_EPS}
              for group in counters["hyperparameters"]]
    engine = {"master": master, "frozen": frozen, "buffers": buffers, "param_groups": groups,
              "counters": {key: counters[key] for key in ("global_steps", "global_samples", "skipped_steps")},
              "lr_scheduler": truths[0]["lr_scheduler"]}
    whole = tensors["1.bias"][next(iter(tensors["1.bias"]))]
    model = {"hidden": int(whole.shape[0]), "scaled": "4.scale" in buffers, "frozen": sorted(frozen),
             "groups": len(groups)}
    # the harness saves client_state {"note", "universal_checkpoint_info"}; DeepSpeed writes the second key
    # itself too (engine.py `_save_checkpoint`, AutoTP and AutoEP), so the run state counts it as DeepSpeed's
    return {"engine": engine, "client_state": {"note": "pipeline"}, "meta": {}, "model": model}


class PipelineProofModel(nn.Module):
    """tests/pipeline_run.py's seven layers without a pipeline, under PipelineModule.state_dict()'s names."""

    def __init__(self, hidden: int, scaled: bool):
        super().__init__()
        self.tied_modules = nn.ModuleDict({"embed": nn.Embedding(VOCAB, DIM)})
        for index, layer in ((1, nn.Linear(DIM, hidden)), (2, nn.GELU()), (3, nn.Linear(hidden, DIM)),
                             (4, ScaledLayerNorm(DIM) if scaled else nn.LayerNorm(DIM)), (5, nn.Linear(DIM, DIM))):
            self.add_module(str(index), layer)

    def forward(self, ids):
        embed = self.tied_modules["embed"]
        x = embed(ids)
        for index in range(1, 6):
            x = getattr(self, str(index))(x)
        return x @ embed.weight.t()  # layer 6: the tied embedding again, as the output head


def proof_model(model: dict) -> PipelineProofModel:
    built = PipelineProofModel(model["hidden"], model["scaled"])
    for name, param in built.named_parameters():
        if name in model["frozen"]:
            param.requires_grad_(False)
    return built


def proof_param_groups(built: nn.Module, model: dict) -> list:
    """The harness's groups: one of every trainable parameter, or (--groups) matrices and the rest."""
    if model["groups"] == 2:
        return param_groups(built)
    return [{"params": [p for p in built.parameters() if p.requires_grad]}]
