"""Tiny mixture-of-experts models, for expert-parallel checkpoints: native DeepSpeed MoE and AutoEP.

    DS_ACCELERATOR=cpu torchrun --standalone --nproc_per_node=4 -m reshard_proof.moe_run train \
        --variant moe_z2_fp32 --ep 2 --save-dir /tmp/ck --truth /tmp/ck.truth.pt

embed -> dense -> MoE -> MoE -> head, where each MoE is `deepspeed.moe.layer.MoE` with 4 experts,
top-2 routing and the expert-parallel size `ep` the engine is built at. Expert sizes are odd
(an expert holds 7*9+9 + 9*7+7 = 142 elements), so ZeRO pads the expert groups at every
expert-data-parallel size. The optimizer groups are "decay" and "no_decay", then
`split_params_into_different_moe_groups_for_optimizer` moves the expert parameters into two
more groups (named `ep_size_{ep}`, `moe: True`): four param groups in all.

`AutoEPProofModel` is the same idea for AutoEP (`"expert_parallel": {"enabled": true,
"autoep_size": ep, "preset_model": "mixtral"}`, variants `autoep_*`): a plain module whose
`model.layers.{i}.mlp` has a router `gate` and fused experts `gate_up_proj [E, 2F, H]`,
`down_proj [E, H, F]`, which DeepSpeed's engine replaces by `AutoEPMoELayer`s holding this EP
rank's experts as `experts.w1/w2/w3 [E/ep, ...]` (module_inject/auto_ep.py, mixtral preset).
"""

import torch
import torch.nn.functional as F
from torch import nn

from reshard_proof.model import DECAY_GROUP, NO_DECAY_GROUP, VOCAB_SIZE

NUM_EXPERTS = 4
TOP_K = 2
HIDDEN = 7
EXPERT_FFN = 9
AUX_LOSS_WEIGHT = 0.01


class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(HIDDEN, EXPERT_FFN)
        self.fc2 = nn.Linear(EXPERT_FFN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class MoEProofModel(nn.Module):
    """forward(tokens, targets) -> mean cross-entropy plus the routers' load-balancing loss."""

    def __init__(self, ep: int) -> None:
        from deepspeed.moe.layer import MoE

        super().__init__()
        self.embed = nn.Embedding(VOCAB_SIZE, HIDDEN)
        self.dense = nn.Linear(HIDDEN, HIDDEN)
        # use_rts=False and top2_2nd_expert_sampling=False: random token selection and Gumbel noise
        # on the second choice would draw from the RNG in every forward,
        # and the eval loss must be a function of the weights only.
        self.moe = nn.ModuleList(MoE(HIDDEN, Expert(), num_experts=NUM_EXPERTS, ep_size=ep, k=TOP_K,
                                     min_capacity=8, drop_tokens=False, use_rts=False,
                                     top2_2nd_expert_sampling=False) for _ in range(2))
        self.head = nn.Linear(HIDDEN, VOCAB_SIZE)
        self._draw_distinct_experts(ep)
        self.register_buffer("num_updates", torch.zeros((), dtype=torch.int64))

    def _draw_distinct_experts(self, ep: int) -> None:
        """DeepSpeed deep-copies one expert into every slot, so all experts start equal and an
        expert that receives no token stays equal to its neighbours: a load that swapped them
        would pass unseen. Draw each expert from a generator of (model seed, layer, GLOBAL expert
        id) instead; the EP rank is rank % ep (utils/groups.py `_create_expert_and_data_parallel`)."""
        import torch.distributed as dist

        ep_rank = dist.get_rank() % ep if dist.is_initialized() else 0
        for layer_index, layer in enumerate(self.moe):
            experts = layer.deepspeed_moe.experts.deepspeed_experts
            for local, expert in enumerate(experts):
                global_id = ep_rank * len(experts) + local
                generator = torch.Generator().manual_seed(torch.initial_seed() * 1000 + layer_index * 100 + global_id)
                with torch.no_grad():
                    for param in expert.parameters():
                        param.copy_(torch.randn(param.shape, generator=generator) * 0.3)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(tokens)
        hidden = hidden + F.gelu(self.dense(hidden))
        aux = 0.0
        for layer in self.moe:
            out, layer_aux, _ = layer(hidden)
            hidden = hidden + out
            aux = aux + layer_aux
        if self.training:
            with torch.no_grad():
                self.num_updates.add_(1)
        logits = self.head(hidden)
        return F.cross_entropy(logits.float().flatten(0, -2), targets.flatten()) + AUX_LOSS_WEIGHT * aux


def build_moe_param_groups(model: nn.Module) -> list[dict]:
    """decay / no_decay, each split into a dense and an expert group by DeepSpeed's own helper."""
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    return split_params_into_different_moe_groups_for_optimizer(
        [dict(DECAY_GROUP, params=decay), dict(NO_DECAY_GROUP, params=no_decay)])


EXPERT_NAME_PART = ".deepspeed_moe.experts."
"""Where an expert's parameters sit in an MoE layer's names (moe/layer.py `MoE.deepspeed_moe`, sharded_moe.py
`MOELayer.experts`): what tells an expert parameter from a dense one once FSDP2 has replaced the parameters,
whose `allreduce` attribute (moe/experts.py) `split_params_into_different_moe_groups_for_optimizer` reads."""


def build_moe_param_groups_by_name(model: nn.Module) -> list[dict]:
    """The param groups `build_moe_param_groups` makes, by parameter name: for a model whose parameters
    `fully_shard` replaced (FSDP2 keeps no `allreduce` attribute). decay, no_decay, then each one's experts in
    a group of its own, in that order, as moe/utils.py `split_params_into_different_moe_groups_for_optimizer`
    orders them; the expert groups named here `<group>_experts` (a loaded checkpoint brings its own names)."""
    named = list(model.named_parameters())
    groups, experts = [], []
    for base, wanted in ((DECAY_GROUP, lambda p: p.ndim >= 2), (NO_DECAY_GROUP, lambda p: p.ndim < 2)):
        params = [(n, p) for n, p in named if wanted(p)]
        groups.append(dict(base, params=[p for n, p in params if EXPERT_NAME_PART not in n]))
        experts.append(dict(base, name=f"{base['name']}_experts", moe=True,
                            params=[p for n, p in params if EXPERT_NAME_PART in n]))
    return groups + experts


AUTOEP_HIDDEN = 8
"""AutoEP computes experts with torch._grouped_mm, which needs 16-byte strides: H and F are
multiples of 8 so that bf16 works too."""
AUTOEP_FFN = 16


class AutoEPProofConfig:
    """The `model.config` attributes the mixtral preset reads (auto_ep.py `ep_parser`)."""

    num_local_experts = NUM_EXPERTS
    num_experts_per_tok = TOP_K
    model_type = "reshard_proof"


class FusedExperts(nn.Module):
    """Mixtral-style fused experts: AutoEP splits gate_up_proj into w1 (gate) and w3 (up)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(NUM_EXPERTS, 2 * AUTOEP_FFN, AUTOEP_HIDDEN) * 0.3)
        self.down_proj = nn.Parameter(torch.randn(NUM_EXPERTS, AUTOEP_HIDDEN, AUTOEP_FFN) * 0.3)


class SparseBlock(nn.Module):
    """Matched by the mixtral preset and replaced whole by AutoEP; never run itself."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(AUTOEP_HIDDEN, NUM_EXPERTS, bias=False)
        self.experts = FusedExperts()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("AutoEPProofModel needs deepspeed.initialize with expert_parallel enabled")


class DecoderLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(AUTOEP_HIDDEN)
        self.mlp = SparseBlock()


class AutoEPProofModel(nn.Module):
    """forward(tokens, targets) -> mean cross-entropy: embed -> dense -> 2 AutoEP MoE layers -> head.

    Every expert starts different (torch.randn over all E experts before the engine slices them),
    and AutoEP routes without noise, so the eval loss is a function of the weights only."""

    def __init__(self) -> None:
        super().__init__()
        self.config = AutoEPProofConfig()
        self.embed = nn.Embedding(VOCAB_SIZE, AUTOEP_HIDDEN)
        self.dense = nn.Linear(AUTOEP_HIDDEN, AUTOEP_HIDDEN)
        self.model = nn.Module()
        self.model.layers = nn.ModuleList(DecoderLayer() for _ in range(2))
        self.head = nn.Linear(AUTOEP_HIDDEN, VOCAB_SIZE)
        self.register_buffer("num_updates", torch.zeros((), dtype=torch.int64))

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(tokens)
        hidden = hidden + F.gelu(self.dense(hidden))
        for layer in self.model.layers:
            out = layer.mlp(layer.norm(hidden))
            hidden = hidden + (out[0] if isinstance(out, tuple) else out)
        if self.training:
            with torch.no_grad():
                self.num_updates.add_(1)
        logits = self.head(hidden)
        return F.cross_entropy(logits.float().flatten(0, -2), targets.flatten())


def build_autoep_param_groups(model: nn.Module) -> list[dict]:
    """decay / no_decay; the engine moves the AutoEP experts into an `ep_size_{ep}` group of its own."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    return [dict(DECAY_GROUP, params=decay), dict(NO_DECAY_GROUP, params=no_decay)]


AUTOEP_EXPERT_PART = ".mlp.experts.w"
"""An AutoEP fused expert parameter's name holds it (auto_ep_layer.py: `experts.w1/w2/w3`)."""


def autoep_model_at_ep_1(model: nn.Module | None = None) -> nn.Module:
    """`AutoEPProofModel` with its MoE blocks replaced as DeepSpeed's engine replaces them at autoep_size 1
    (module_inject/auto_ep.py `AutoEP.replace_moe_layers`, engine.py `_configure_autoep`), with no engine and no
    process group: the module an AutoEP run at ep 1 trains, `experts.w1/w2/w3` [num_experts, ...] each, its
    router holding the gate it replaced (`mlp.router.gate.weight` is `mlp.gate.gate.weight`)."""
    from deepspeed.module_inject.auto_ep import AutoEP
    from deepspeed.module_inject.auto_ep_config import parse_autoep_config

    model = AutoEPProofModel() if model is None else model  # or a subclass (reshard_proof.folded_tp_ep)
    auto_ep = AutoEP(model, parse_autoep_config({"enabled": True, "autoep_size": 1, "preset_model": "mixtral"}))
    auto_ep.replace_moe_layers(auto_ep.ep_parser(), ep_size=1, ep_rank=0)
    return model


def build_autoep_param_groups_by_name(model: nn.Module) -> list[dict]:
    """decay and no_decay for the dense parameters, then the experts in a group of their own, by name (after
    `fully_shard`), as DeepSpeed's engine groups an AutoEP model's parameters (decay, no_decay, `ep_size_{ep}`)."""
    named = list(model.named_parameters())
    dense = [(n, p) for n, p in named if AUTOEP_EXPERT_PART not in n]
    return [dict(DECAY_GROUP, params=[p for _, p in dense if p.ndim >= 2]),
            dict(NO_DECAY_GROUP, params=[p for _, p in dense if p.ndim < 2]),
            dict(DECAY_GROUP, name="experts", moe=True, params=[p for n, p in named if AUTOEP_EXPERT_PART in n])]


def fused_autoep_truth(engine: dict) -> dict:
    """An AutoEP truth (reshard_proof.moe_run: every expert slice `...experts.w1.{G}` on its own) with each
    weight's slices stacked on dim 0 under the fused name, as the ep-1 module holds them."""
    import re

    slices: dict[str, dict[int, dict]] = {}
    master = {}
    for name, entry in engine["master"].items():
        match = re.fullmatch(r"(.*\.experts\.w\d)\.(\d+)", name)
        if match:
            slices.setdefault(match[1], {})[int(match[2])] = entry
        else:
            master[name] = entry
    for name, experts in slices.items():
        ordered = [experts[g] for g in range(len(experts))]
        master[name] = {"fp32": torch.stack([e["fp32"] for e in ordered]),
                        "state": {k: torch.stack([e["state"][k] for e in ordered]) for k in ordered[0]["state"]},
                        "scalars": ordered[0]["scalars"]}
    return dict(engine, master=master)
