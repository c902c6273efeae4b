"""Train, save and judge DeepSpeed AutoTP checkpoints of a tiny plain `nn.Module` on CPU ranks.

    DS_ACCELERATOR=cpu torchrun --standalone --nproc_per_node=4 -m reshard_proof.tensor_parallel \
        train --tp 2 --stage 2 --precision fp32 --save-dir /tmp/tp --truth /tmp/tp.truth.pt
    DS_ACCELERATOR=cpu torchrun --standalone --nproc_per_node=3 -m reshard_proof.tensor_parallel \
        check --tp 1 --stage 2 --precision fp32 --load-dir /tmp/out --truth /tmp/tp.truth.pt \
        --verdict /tmp/v.json [--load-dir /tmp/out2 --verdict /tmp/v2.json [--truth ...] ...] \
        [--load-via native --load-via in-job --load-via universal ...]
    DS_ACCELERATOR=cpu torchrun --standalone --nproc_per_node=2 -m reshard_proof.tensor_parallel \
        train --tp 2 --save 1 bf16 base /tmp/a /tmp/a.truth.pt --save 3 fp32 base /tmp/b /tmp/b.truth.pt
    DS_ACCELERATOR=cpu torchrun --standalone --nproc_per_node=2 -m reshard_proof.tensor_parallel \
        check --tp 1 --load 1 bf16 base native /tmp/out /tmp/a.truth.pt /tmp/v1.json \
        --load 2 fp16 fused in-job /tmp/c /tmp/c.truth.pt /tmp/v2.json        # any stage, precision, model

The model has a column-parallel linear with bias (`up`, 9 outputs: uneven at TP 2 and 4), a
row-parallel linear whose bias is replicated (`down`), and parameters AutoTP leaves whole on
every TP rank (embedding, layer norm, head, a frozen linear); two optimizer param groups.
The TP split comes from `tensor_parallel.partition_config.layer_specs`. `--model vocab` ties an
`lm_head` to the embedding and turns on `vocab_parallel_lm_head` (both split over a vocabulary
of 11); `--model fused` adds to that a fused gate/up linear whose layer spec has `shape`
(each half cut on its own) and a row-parallel `fused_down`.

Truth (written by global rank 0 after the save): every trainable parameter's full, unsharded
fp32 master and optimizer states (TP shards joined along their partition dimension, per
sub-parameter for a fused one: `join_shards`, from the parameter's AutoTP metadata), module
values, frozen values (under ZeRO-3 gathered over the dp group first), counters and the eval loss. `check` builds an engine at its own
(tp, dp) from another seed, loads each directory with plain `engine.load_checkpoint`, slices
the truth for its TP rank as DeepSpeed sizes the shards, and compares every element; then it
trains one more step. Several directories per launch share one start-up (each with its own
truth, or all with one), each loaded into a fresh engine (so nothing an earlier load left can
pass for a later one); `--load` gives each its own ZeRO stage, precision and model, and
`train --save` trains several checkpoints at one (tp, dp) in one launch, each from a fresh engine. `--load-via in-job` loads that directory with
`reshard.deepspeed.load_checkpoint` instead (a checkpoint at another (tp, dp), resharded in the
job); `--load-via universal` loads a `ds_to_universal.py` output (a folder with
`latest_universal`) with `engine.load_checkpoint` in a second engine built with
`checkpoint.load_universal` (DeepSpeed's own path, the oracle: it restores masters and moments
from `zero/`, module weights from the masters, never the module states, so frozen parameters
keep their init, which is the truth here). Each verdict gives per rank the number of tensors
compared and a digest of the fp32 masters and moments, so two loads can be compared rank by
rank. `train_checkpoint` and `check_checkpoints` run these under torchrun.
"""
from __future__ import annotations

import argparse
import json
import os

import torch
import torch.nn.functional as F
from torch import nn

from reshard_proof.engine_state import relink_optimizer_fragments

VOCAB, HIDDEN, FFN = 11, 8, 9
SEQUENCE, MICRO_BATCH = 5, 2
LAYER_SPECS = [
    {"patterns": [r"^up\.weight$"], "partition_type": "column"},
    {"patterns": [r"^down\.weight$"], "partition_type": "row"},
]
FROZEN_SEED = 4242


class TensorParallelModel(nn.Module):
    """embed -> norm -> up (column) -> gelu -> down (row) -> + frozen -> head; cross-entropy."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.norm = nn.LayerNorm(HIDDEN)
        self.up = nn.Linear(HIDDEN, FFN)
        self.down = nn.Linear(FFN, HIDDEN)
        self.frozen = nn.Linear(HIDDEN, HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)
        generator = torch.Generator().manual_seed(FROZEN_SEED)
        with torch.no_grad():
            self.frozen.weight.copy_(torch.randn(self.frozen.weight.shape, generator=generator) * 0.3)
            self.frozen.bias.copy_(torch.randn(self.frozen.bias.shape, generator=generator) * 0.1)
        self.frozen.requires_grad_(False)

    def forward(self, tokens, targets):
        hidden = self.norm(self.embed(tokens))
        hidden = hidden + self.down(F.gelu(self.up(hidden)))
        hidden = hidden + 0.5 * self.frozen(hidden)
        logits = self.head(hidden)
        return F.cross_entropy(logits.float().flatten(0, -2), targets.flatten())


def causal_lm_loss(logits, labels=None, **_):
    """Next-token cross-entropy, as DeepSpeed's `VocabParallelCausalLMLoss` computes it over the
    vocabulary shards (sequence/cross_entropy.py): labels shifted left by one, mean over tokens."""
    return F.cross_entropy(logits[..., :-1, :].float().flatten(0, -2), labels[..., 1:].flatten())


class VocabParallelModel(TensorParallelModel):
    """The same body with an `nn.Linear` named `lm_head` tied to the embedding, and a writable
    `loss_function` hook: with `tensor_parallel.vocab_parallel_lm_head` AutoTP (TP > 1) makes
    the head a `VocabParallelLinear` (no-gather, dim 0 over the vocabulary), the tied embedding a
    `VocabParallelEmbedding` sharing its shard, and installs its vocabulary-parallel loss in
    `loss_function` (runtime/engine.py `_apply_autotp_partitioning`, `finalize_autotp`). VOCAB
    (11) divides by none of TP 2, 3, 4, so the shards are uneven."""

    def __init__(self) -> None:
        super().__init__()
        del self.head
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.lm_head.weight = self.embed.weight
        self.loss_function = causal_lm_loss

    def forward(self, tokens, targets):
        hidden = self.norm(self.embed(tokens))
        hidden = hidden + self.down(F.gelu(self.up(hidden)))
        hidden = hidden + 0.5 * self.frozen(hidden)
        return self.loss_function(self.lm_head(hidden), labels=targets)


FUSED = 5
FUSED_LAYER_SPECS = [
    {"patterns": [r"^gate_up\.weight$"], "partition_type": "column", "shape": [2, -1], "partition_dim": 0},
    {"patterns": [r"^fused_down\.weight$"], "partition_type": "row"},
]


class FusedSubParamModel(VocabParallelModel):
    """The vocabulary-parallel model plus a fused gate/up projection (`gate_up`, 2 x 5 outputs)
    whose layer spec has `shape: [2, -1]`: AutoTP's `SubParamLinearLayer` cuts each half on its
    own (3 + 2 rows of each at TP 2), so a rank holds [its gate rows, its up rows]; then a
    row-parallel `fused_down`."""

    def __init__(self) -> None:
        super().__init__()
        self.gate_up = nn.Linear(HIDDEN, 2 * FUSED)
        self.fused_down = nn.Linear(FUSED, HIDDEN)

    def forward(self, tokens, targets):
        hidden = self.norm(self.embed(tokens))
        hidden = hidden + self.down(F.gelu(self.up(hidden)))
        gate, up = self.gate_up(hidden).chunk(2, dim=-1)
        hidden = hidden + self.fused_down(F.silu(gate) * up)
        hidden = hidden + 0.5 * self.frozen(hidden)
        return self.loss_function(self.lm_head(hidden), labels=targets)


MODELS = {"base": TensorParallelModel, "vocab": VocabParallelModel, "fused": FusedSubParamModel}


def ds_config(tp: int, stage: int, precision: str, model: str = "base", load_universal: bool = False) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": stage},
        "steps_per_print": 1_000_000,
        "tensor_parallel": {"autotp_size": tp, "partition_config": {"use_default_specs": False,
                                                                      "layer_specs": LAYER_SPECS}},
    }
    if load_universal:  # engine.load_checkpoint reads a ds_to_universal.py output (runtime/config.py)
        config["checkpoint"] = {"load_universal": True}
    if model in ("vocab", "fused"):
        config["tensor_parallel"]["vocab_parallel_lm_head"] = True
    if model == "fused":
        config["tensor_parallel"]["partition_config"]["layer_specs"] = LAYER_SPECS + FUSED_LAYER_SPECS
    if precision == "fp16":
        config["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 8, "loss_scale_window": 2}
    if precision in ("bf16", "bf16_optimizer"):
        config["bf16"] = {"enabled": True}
    if precision == "bf16_optimizer":  # bf16 + ZeRO-1 + fp32 gradient accumulation: BF16_Optimizer
        config["data_types"] = {"grad_accum_dtype": "fp32"}
    return config


def batch(seed: int, step: int, dp_rank: int, size: int = MICRO_BATCH):
    generator = torch.Generator().manual_seed(1_000_003 * seed + 1_009 * step + dp_rank)
    tokens = torch.randint(0, VOCAB, (size, SEQUENCE), generator=generator)
    return tokens, (3 * tokens + 1) % VOCAB


BETAS = (0.9, 0.95)
CLIENT_STATE = {"note": "tp proof"}


def param_groups(module: nn.Module) -> list[dict]:
    """The optimizer's groups: matrices with weight decay, the rest without (torch AdamW, betas BETAS)."""
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    return [dict(params=[p for _, p in named if p.ndim >= 2], lr=1e-2, weight_decay=0.1),
            dict(params=[p for _, p in named if p.ndim < 2], lr=2e-2, weight_decay=0.0)]


def build_engine(tp: int, stage: int, precision: str, seed: int, model: str = "base", load_universal: bool = False):
    """A fresh `model` from `seed` in an AutoTP engine at `tp`, started as in a fresh process even
    after other engines in this one (engine_setup.start_as_a_fresh_process)."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    from reshard_proof.engine_setup import start_as_a_fresh_process

    start_as_a_fresh_process()
    if precision == "fp16":  # DeepSpeed's CPU accelerator refuses fp16; torch runs it (DESIGN.md section 4)
        get_accelerator().is_fp16_supported = lambda: True
    torch.manual_seed(seed)
    module = MODELS[model]()
    optimizer = torch.optim.AdamW(param_groups(module), betas=BETAS)
    engine, *_ = deepspeed.initialize(model=module, optimizer=optimizer,
                                      config=ds_config(tp, stage, precision, model, load_universal))
    return engine


def _groups():
    """(TP group, TP rank, DP rank) of this rank; at TP 1 DeepSpeed builds no TP group."""
    import deepspeed.comm as dist
    from deepspeed.utils import groups
    if groups._TENSOR_MODEL_PARALLEL_GROUP is None:
        return None, 0, dist.get_rank()
    return groups.get_tensor_model_parallel_group(), groups.get_tensor_model_parallel_rank(), \
        groups.get_data_parallel_rank()


def train_steps(engine, seed: int, first: int, count: int) -> list[float]:
    _, _, dp_rank = _groups()
    losses = []
    engine.train()
    for step in range(first, first + count):
        tokens, targets = batch(seed, step, dp_rank)
        loss = engine(tokens, targets)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach().float()))
    return losses


def eval_loss(engine) -> float:
    tokens, targets = batch(777, 0, 0, size=4)
    engine.eval()
    with torch.no_grad():
        loss = float(engine(tokens, targets).detach().float())
    engine.train()
    return loss


def partition_of(param) -> tuple | None:
    """(logical shape, partition dim, per-sub-parameter per-TP-rank widths) of an AutoTP
    parameter, None for one left whole. A plain column/row/vocabulary split is one
    sub-parameter over the parameter's own shape; a `shape` layer spec (SubParamLinearLayer)
    views the parameter as `logical_shape` and cuts each sub-parameter on its own
    (`sub_param_shard_widths`, module_inject/layers.py `_partition_logical_tensor`)."""
    meta = getattr(param, "ds_autotp_universal_checkpoint_meta", None) or {}
    conversion = meta.get("conversion") or {}
    if conversion.get("replicated") or conversion.get("partition_dim") is None:
        return None
    widths = meta.get("sub_param_shard_widths") or [meta.get("partition_sizes")]
    logical = meta.get("logical_shape") or meta.get("original_shape")
    return (tuple(int(d) for d in logical), int(conversion["partition_dim"]),
            [[int(w) for w in per_rank] for per_rank in widths])


def module_values(engine) -> dict:
    """{name: value} of every parameter of this rank's TP-local module, trainable and frozen;
    under ZeRO-3 each is gathered over its dp group first (a partitioned param holds nothing)."""
    import deepspeed

    params = list(engine.module.named_parameters())
    if not engine.zero_optimization_partition_weights():
        return {name: param.detach().float().clone() for name, param in params}
    with deepspeed.zero.GatheredParameters([param for _, param in params], modifier_rank=None):
        return {name: param.detach().float().clone() for name, param in params}


def local_state(engine) -> dict:
    """{name: {"fp32", "state": {key}, "module"}} of this rank's TP-local parameters (DP-gathered)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    relink_optimizer_fragments(engine)
    values = module_values(engine)
    found = {}
    for name, param in engine.module.named_parameters():
        if not param.requires_grad:
            continue
        found[name] = {"fp32": safe_get_full_fp32_param(param).detach().float().clone(),
                       "state": {k: safe_get_full_optimizer_state(param, k).detach().float().clone()
                                 for k in ("exp_avg", "exp_avg_sq")},
                       "module": values[name]}
    return found


def full_state(engine) -> dict:
    """Every trainable parameter unsharded: TP shards all-gathered and joined (`join_shards`)."""
    import deepspeed.comm as dist

    group, _, _ = _groups()
    tp_size = 1 if group is None else dist.get_world_size(group=group)
    local = local_state(engine)
    params = dict(engine.module.named_parameters())
    full = {}
    for name, entry in local.items():
        layout = partition_of(params[name])

        def join(tensor):
            if layout is None or tp_size == 1:
                return tensor
            shards = [None] * tp_size
            dist.all_gather_object(shards, tensor, group=group)
            return join_shards(shards, *layout)
        full[name] = {"fp32": join(entry["fp32"]), "state": {k: join(v) for k, v in entry["state"].items()},
                      "module": join(entry["module"])}
    return full


def join_shards(shards, logical, dim, widths):
    """The full parameter from its TP shards: each shard viewed in the logical shape, cut into
    its piece of every sub-parameter, the pieces of each sub-parameter joined in rank order."""
    pieces = []
    for rank, shard in enumerate(shards):
        view = list(logical)
        view[dim] = sum(w[rank] for w in widths)
        pieces.append(shard.reshape(view).split([w[rank] for w in widths], dim=dim))
    joined = [torch.cat([pieces[rank][s] for rank in range(len(shards))], dim=dim) for s in range(len(widths))]
    whole = torch.cat(joined, dim=dim)
    return whole.reshape(-1) if shards[0].dim() == 1 else whole.reshape(-1, whole.shape[-1])


def slice_for(tensor, layout, tp_rank, local_shape):
    """TP rank `tp_rank`'s shard of the full `tensor` (the inverse of `join_shards`)."""
    if layout is None:
        return tensor
    logical, dim, widths = layout
    subs = tensor.reshape(logical).split([sum(w) for w in widths], dim=dim)
    mine = [sub.split(w, dim=dim)[tp_rank] for sub, w in zip(subs, widths)]
    return torch.cat(mine, dim=dim).reshape(local_shape)


def cmd_train(args) -> None:
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    saves = [(int(stage), precision, model, save_dir, truth) for stage, precision, model, save_dir, truth in args.save]
    if args.save_dir is not None:
        saves.insert(0, (args.stage, args.precision, args.model, args.save_dir, args.truth[0]))
    for stage, precision, model, save_dir, truth_path in saves:
        train_one(args, stage, precision, model, save_dir, truth_path)


def is_truth(truth: dict) -> bool:
    """Whether a loaded truth file is one `train_one` wrote (not reshard_proof.truth_file's)."""
    return "params" in truth and "tp" in truth and "global_steps" in truth


def judge_truth(truth: dict) -> dict:
    """A truth `train_one` wrote, in the shape reshard_proof.fsdp2_judge compares (the engine's whole
    masters, moments and step, frozen values, param groups, counters; client_state; the model to build:
    MODELS[truth["model"]], groups `param_groups`)."""
    if truth["precision"] == "fp16":  # a skipped step (overflow) is not an Adam step: the step is not known
        raise ValueError("an fp16 AutoTP truth does not record Adam's step; judge fp32 or bf16 saves")
    step = float(truth["global_steps"])  # fp32 and bf16 skip no step: every engine step is an Adam step
    master = {name: {"fp32": s["fp32"], "state": s["state"], "scalars": {"step": step}}
              for name, s in truth["params"].items()}
    engine = {"master": master, "frozen": truth["frozen"], "buffers": {}, "param_groups": truth["param_groups"],
              "counters": {"global_steps": truth["global_steps"]}}
    return {"engine": engine, "client_state": CLIENT_STATE, "meta": {}, "model": truth["model"]}


def train_one(args, stage: int, precision: str, model: str, save_dir: str, truth_path: str) -> None:
    """Train a fresh engine from args.seed, save it, write its truth (rank 0). Collective."""
    import deepspeed.comm as dist

    engine = build_engine(args.tp, stage, precision, args.seed, model)
    train_steps(engine, args.seed, 0, args.steps)
    engine.save_checkpoint(save_dir, tag=f"global_step{args.steps}", client_state=CLIENT_STATE)
    dist.barrier()
    params = dict(engine.module.named_parameters())
    truth = {"params": full_state(engine), "eval_loss": eval_loss(engine),
             "frozen": {n: v for n, v in module_values(engine).items() if not params[n].requires_grad},
             "global_steps": engine.global_steps, "tp": args.tp, "stage": stage,
             "precision": precision, "model": model,
             # as the engine's optimizer holds them (DeepSpeed's wrapper over the client AdamW)
             "param_groups": [{k: group[k] for k in ("lr", "betas", "eps", "weight_decay")}
                              for group in engine.optimizer.param_groups]}
    if dist.get_rank() == 0:
        torch.save(truth, truth_path + ".tmp")
        os.replace(truth_path + ".tmp", truth_path)
    dist.barrier()


def judge(engine, truth: dict) -> tuple[list[str], int, str]:
    """Mismatches of this rank's loaded state against the truth, sliced for its TP rank; the number
    of tensors compared; a digest of this rank's fp32 masters and moments (to compare two loads)."""
    import hashlib

    _, tp_rank, _ = _groups()
    params = dict(engine.module.named_parameters())
    problems, checked, digest = [], 0, hashlib.sha256()
    for name, entry in sorted(local_state(engine).items()):
        layout = partition_of(params[name])
        want = truth["params"][name]
        pairs = [("fp32", entry["fp32"], want["fp32"])] + \
            [(k, entry["state"][k], want["state"][k]) for k in sorted(entry["state"])] + \
            [("module", entry["module"], want["module"])]
        for what, got, full in pairs:
            if full.numel() == 0:  # a check of nothing (a partitioned ZeRO-3 param read as is) must not pass
                problems.append(f"{name} {what}: the truth is empty")
            try:
                expected = slice_for(full, layout, tp_rank, got.shape)
            except RuntimeError:  # the loaded shard has another element count
                expected = full
            checked += 1
            if what != "module":
                digest.update(f"{name} {what} {tuple(got.shape)}".encode())
                digest.update(got.contiguous().numpy().tobytes())
            if got.shape != expected.shape or not torch.equal(got, expected):
                problems.append(f"{name} {what}: tp rank {tp_rank} differs (shape {tuple(got.shape)} vs "
                                f"{tuple(expected.shape)})")
    values = module_values(engine)
    for name, param in params.items():
        if not param.requires_grad and not torch.equal(values[name], truth["frozen"][name]):
            problems.append(f"frozen {name} differs")
    if engine.global_steps != truth["global_steps"]:
        problems.append(f"global_steps {engine.global_steps} != {truth['global_steps']}")
    return problems, checked, digest.hexdigest()


def load_one(engine, load_dir: str, via: str) -> str | None:
    """Load `load_dir` into `engine` as `via` says; the traceback of a failure, else None."""
    import traceback

    try:
        if via == "in-job":
            import reshard.deepspeed
            load_path, _ = reshard.deepspeed.load_checkpoint(engine, load_dir)
        else:  # native, or universal (an engine built with checkpoint.load_universal)
            load_path, _ = engine.load_checkpoint(load_dir)
        return None if load_path is not None else f"load_checkpoint returned no path for {load_dir}"
    except Exception:
        return traceback.format_exc(limit=8)


def cmd_check(args) -> None:
    import deepspeed
    import deepspeed.comm as dist

    deepspeed.init_distributed(dist_backend="gloo")
    truths = args.truth if len(args.truth) == len(args.load_dir) else args.truth[:1] * len(args.load_dir)
    vias = args.load_via + ["native"] * (len(args.load_dir) - len(args.load_via))
    loads = [(args.stage, args.precision, args.model, via, load_dir, truth_path, verdict_path)
             for load_dir, verdict_path, truth_path, via in zip(args.load_dir, args.verdict, truths, vias)]
    loads += [(int(stage), precision, model, via, load_dir, truth_path, verdict_path)
              for stage, precision, model, via, load_dir, truth_path, verdict_path in args.load]
    for stage, precision, model, via, load_dir, truth_path, verdict_path in loads:
        # a fresh engine per load (load_universal is read at initialize, so a universal load needs its own)
        engine = build_engine(args.tp, stage, precision, seed=args.seed + 100, model=model,
                              load_universal=via == "universal")
        truth = torch.load(truth_path, weights_only=False)
        error = load_one(engine, load_dir, via)
        errors = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
        load_errors = [f"rank {r}: {e}" for r, e in enumerate(errors) if e]
        problems, checked, digest, loss = [], 0, None, float("nan")
        if not load_errors:
            problems, checked, digest = judge(engine, truth)
            if truth.get("model", "base") != model:
                problems.append(f"the truth is of model {truth.get('model', 'base')}, the engine of {model}")
            if (truth["stage"], truth["precision"]) != (stage, precision):
                problems.append(f"the truth is of ZeRO-{truth['stage']} {truth['precision']}, "
                                f"the engine of ZeRO-{stage} {precision}")
            if model != "base" and engine.module.lm_head.weight is not engine.module.embed.weight:
                problems.append("lm_head.weight is no longer tied to embed.weight")
            loss = eval_loss(engine)
            # Every load of the suite changes TP, which changes the reduction order (the row-parallel
            # all-reduce sums partial products): bf16/fp16 losses there differed by up to 1.9e-3 from
            # the truth's (13 loads, engines reset by start_as_a_fresh_process; negative controls: 0.1),
            # fp32 ones by 0 in 10 of 10, which the arithmetic does not promise. So no exact comparison.
            tolerance = 1e-4 if truth["precision"] == "fp32" else 2e-2
            if abs(loss - truth["eval_loss"]) > tolerance:
                problems.append(f"eval loss {loss} vs truth {truth['eval_loss']}")
            losses = train_steps(engine, args.seed, 100, 1)
            if not all(map(lambda x: x == x and abs(x) < 1e6, losses)):
                problems.append(f"training did not continue: {losses}")
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (problems, checked, digest))
        if dist.get_rank() == 0:
            flat = load_errors + [p for rank_problems, _, _ in everyone for p in rank_problems]
            with open(verdict_path + ".tmp", "w") as handle:
                json.dump({"ok": not flat, "how": via, "problems": flat[:50], "load_error": "\n".join(load_errors) or None,
                           "tp": args.tp, "dp": dist.get_world_size() // args.tp, "stage": stage,
                           "precision": precision, "model": model, "load_dir": load_dir,
                           "eval_loss": loss if loss == loss else None, "truth_eval_loss": truth["eval_loss"],
                           "truth_tp": truth["tp"],
                           "checked_per_rank": [c for _, c, _ in everyone],
                           "digest_per_rank": [d for _, _, d in everyone]}, handle)
            os.replace(verdict_path + ".tmp", verdict_path)
        dist.barrier()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["train", "check"])
    parser.add_argument("--tp", type=int, required=True)
    parser.add_argument("--stage", type=int)
    parser.add_argument("--save", nargs=5, action="append", default=[],
                        metavar=("STAGE", "PRECISION", "MODEL", "SAVE_DIR", "TRUTH"),
                        help="train: one more checkpoint to train and save in this launch")
    parser.add_argument("--load", nargs=7, action="append", default=[],
                        metavar=("STAGE", "PRECISION", "MODEL", "VIA", "LOAD_DIR", "TRUTH", "VERDICT"),
                        help="check: one more load, into a fresh engine of that stage, precision and model")
    parser.add_argument("--precision", default="fp32", choices=["fp32", "fp16", "bf16", "bf16_optimizer"])
    parser.add_argument("--model", default="base", choices=sorted(MODELS),
                        help="base: column, row and replicated parameters; vocab: + a vocabulary-parallel "
                             "lm_head tied to the embedding")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--save-dir")
    parser.add_argument("--truth", action="append", default=[],
                        help="train: the truth file to write; check: one per --load-dir, or one for all")
    parser.add_argument("--load-dir", action="append", default=[])
    parser.add_argument("--verdict", action="append", default=[])
    parser.add_argument("--load-via", action="append", default=[], choices=["native", "in-job", "universal"],
                        help="check: per --load-dir, plain engine.load_checkpoint (default), reshard's in-job "
                             "load, or DeepSpeed's load_universal of a ds_to_universal.py output")
    args = parser.parse_args(argv)
    if (args.save_dir is not None or args.load_dir) and (args.stage is None or not args.truth):
        parser.error("--save-dir and --load-dir need --stage and --truth")
    if any(load[3] not in ("native", "in-job", "universal") for load in args.load):
        parser.error("a --load's VIA is native, in-job or universal")
    (cmd_train if args.command == "train" else cmd_check)(args)


def train_checkpoint(tp: int, dp: int, stage: int, precision: str, save_dir, truth, timeout: float = 600,
                     model: str = "base"):
    """Train `model` at (tp, dp) under torchrun, save to save_dir, write the truth."""
    from reshard_proof.launch import run_torchrun
    run_torchrun("reshard_proof.tensor_parallel", tp * dp,
                 ["train", "--tp", tp, "--stage", stage, "--precision", precision, "--model", model,
                  "--save-dir", save_dir, "--truth", truth], timeout=timeout, expect_files=[truth])


def train_checkpoints(tp: int, dp: int, saves, timeout: float = 900) -> None:
    """Train each (stage, precision, model, save_dir, truth) of `saves` at (tp, dp), in ONE launch."""
    from reshard_proof.launch import run_torchrun
    args = ["train", "--tp", tp]
    for save in saves:
        args += ["--save", *save]
    run_torchrun("reshard_proof.tensor_parallel", tp * dp, args, timeout=timeout,
                 expect_files=[truth for *_, truth in saves])


def check_together(loads, timeout: float = 1200) -> dict:
    """Judge loads (tp, dp, stage, precision, model, via, load_dir, truth, verdict) with one launch
    per (tp, dp), each in a fresh engine of its stage, precision and model. {str(verdict): verdict
    dict, or the exception judging it raised} (reshard_proof.launch `judge_in_shared_launches`: a
    failed shared launch is judged again one load per launch)."""
    from reshard_proof.launch import judge_in_shared_launches
    return judge_in_shared_launches("reshard_proof.tensor_parallel", loads, timeout=timeout,
                                    launch=lambda load: (load[0] * load[1], ["check", "--tp", load[0]]),
                                    job_args=lambda load: ["--load", *load[2:9]], verdict=lambda load: load[8])


def check_checkpoints(tp: int, dp: int, stage: int, precision: str, loads, verdict_dir, timeout: float = 600,
                      model: str = "base") -> list[dict]:
    """Load each (directory, truth[, "native", "in-job" or "universal"]) of `loads` at (tp, dp),
    each into a fresh engine (checkpoint.load_universal for the universal ones); the verdicts, in order."""
    from pathlib import Path

    from reshard_proof.launch import run_torchrun
    verdicts = [Path(verdict_dir) / f"verdict-{tp}-{dp}-{i}.json" for i in range(len(loads))]
    args = ["check", "--tp", tp, "--stage", stage, "--precision", precision, "--model", model]
    for (load_dir, truth, *via), verdict in zip(loads, verdicts):
        args += ["--load-dir", load_dir, "--truth", truth, "--verdict", verdict, "--load-via", (via or ["native"])[0]]
    run_torchrun("reshard_proof.tensor_parallel", tp * dp, args, timeout=timeout, expect_files=verdicts)
    return [json.loads(v.read_text()) for v in verdicts]


if __name__ == "__main__":
    from reshard_proof.engine_setup import finish_and_exit
    main()
    finish_and_exit()
