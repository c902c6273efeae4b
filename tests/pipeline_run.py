"""Train, save and check a small DeepSpeed PipelineModule on CPU (gloo); the e2e pipeline tests run it.

    DS_ACCELERATOR=cpu torchrun --standalone --nproc_per_node=2 tests/pipeline_run.py \
        train --pp 2 --precision fp32 --save /tmp/pipe --truth /tmp/pipe.truth
    DS_ACCELERATOR=cpu torchrun --standalone --nproc_per_node=3 tests/pipeline_run.py \
        check --pp 1 --precision fp32 --load /tmp/out --truth /tmp/pipe.truth --verdict /tmp/v.json

The model: an embedding tied to the output head (`TiedLayerSpec`, key "embed"), Linear layers of
odd sizes (so ZeRO-1 pads), a parameterless GELU and a LayerNorm; ZeRO-1, Adam, an LR scheduler;
fp32, bf16, or fp16 with dynamic loss scaling. `--frozen build|later`: layer 1's weight frozen in its
constructor, or after the PipelineModule was built (DeepSpeed's partition counted it then).
`--groups`: two optimizer param groups (no weight decay on biases and the LayerNorm, the usual
split) and a persistent buffer drawn from the seed in the LayerNorm layer (ScaledLayerNorm).
`train` runs a few `train_batch` steps and writes, per rank, the truth of its stage: each
parameter's full fp32 master and Adam moments by name (`safe_get_full_fp32_param`,
`safe_get_full_optimizer_state`, read from the live engine) and the eval loss on one fixed
micro-batch (the number of micro-batches per step changes with dp, a fixed one does not).
`check` builds the engine from another seed at (pp, world / pp), loads with plain
`load_checkpoint` (with --in-job: reshard.deepspeed.load_checkpoint on the source itself),
compares its stage's tensors by name (a frozen parameter by its module value), the eval loss, the
step counters, the LR and (fp16) the loss scaler's state with the truth, then runs one more
`train_batch`; rank 0 writes the verdict as JSON. `--also LOAD VERDICT plain|in-job` (repeatable)
checks one more save against the same truth in the same launch, in an engine of its own built the
same way, since the launch is what costs; `--judge VARIANT LOAD TRUTH VERDICT plain|in-job`
(repeatable) one more save of another variant (variant_settings' names) against
its own truth, and `train --more VARIANT SAVE TRUTH` (repeatable) trains one more variant after the
first, each in an engine of its own. Every precision shares a launch: a bf16 engine built after
fp16 and fp32 ones here trained and judged bit for bit as in a launch of its own (checked by hand).
The other eval loss once seen in a shared launch came from a ZeRO-3 engine's patch of
torch.nn.functional.linear (tests/reshard_proof/engine_setup.py undo_zero3_linear_patch); this
harness builds ZeRO-1 engines only.
`train --node-local` saves with `use_node_local_storage` (under two agents playing two nodes, each
its own --save directory, tests/test_node_local_pipeline.py; each `--more` save too, into its own
directory per node); `--own-load-report JSON` then tries DeepSpeed's own `load_checkpoint` of the first
save at the same topology and writes every rank's error.
`--safetensors DIR TRUTH VERDICT` (repeatable) then loads a safetensors export of a pipeline save
strictly into a PipelineModule built at pp=1 and compares every tensor with that truth
(tests/test_pipeline_export.py).
"""
from __future__ import annotations

import argparse
import faulthandler
import json
import os

import torch

VOCAB, DIM, HIDDEN = 37, 24, 41
MP_HIDDEN = 42  # --mp 2: 21 rows / columns per model rank
MP_HIDDEN_U = 44  # the "-mpNu" variants: 44 cuts evenly for tp 1, 2 and 4
# "-mpNu": the client state Megatron-DeepSpeed saves (universal_checkpoint_info) for this model: which
# stage parameters every model rank holds whole and which are row-parallel (cut on dim 1); the rest
# (layer 1's column-parallel weight and bias) are cut on dim 0, ds_to_universal's default
UNIVERSAL_INFO = {"tp_replicated_parameter_patterns": [r"tied_modules\.embed\.", r"3\.bias", r"4\.", r"5\."],
                  "parameter_with_row_parallelism_patterns": [r"3\.weight"]}
MICRO_BATCH, SEQ, GRAD_ACCUM = 2, 5, 2
HANG_SECONDS = 400


FROZEN = "1.weight"  # the parameter --frozen freezes (layer 1's weight)


class FrozenWeightLinear(torch.nn.Linear):
    """A Linear whose weight is frozen (`requires_grad=False`) from construction on (--frozen build):
    DeepSpeed's `parameters` partition then counts only its bias (runtime/pipe/module.py
    `_count_layer_params` builds each layer and counts its trainable parameters). Frozen after the
    PipelineModule is built (--frozen later), the weight was counted. Either way ZeRO-1 leaves it
    out of its flat groups, and only the layer file holds it."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.weight.requires_grad_(False)


class ScaledLayerNorm(torch.nn.LayerNorm):
    """A LayerNorm times a persistent buffer drawn from the seed (--groups): only its layer file
    holds the buffer, so an engine built from another seed computes another loss until it loads. Under
    bf16 DeepSpeed 0.19.8 casts parameters only and leaves buffers in their dtype (engine.py
    `_mixed_precision_dtypes`: "buffers keep loaded dtype"), so the fp32 buffer is cast to the
    activation's dtype here (a no-op in fp32), or the next Linear gets fp32 input for bf16 weights."""

    def __init__(self, dim: int):
        super().__init__(dim)
        self.register_buffer("scale", torch.rand(dim) + 0.5)

    def forward(self, x):
        return super().forward(x) * self.scale.to(x.dtype)


class ModelAxis:
    """This rank's place on the pipeline's model (tensor-slicing) axis (--mp): its coordinate, set from
    the topology before the PipelineModule builds its layers, and the slice group
    (PipelineParallelGrid.get_slice_parallel_group), set once the module has its grid."""

    rank, size, group = 0, 1, None


class _GatherColumns(torch.autograd.Function):
    """Megatron's gather from the model-parallel region: every model rank's columns joined on the
    last dim; backward keeps this rank's columns (the loss after it is computed alike on every rank)."""

    @staticmethod
    def forward(ctx, local):
        parts = [torch.empty_like(local) for _ in range(ModelAxis.size)]
        torch.distributed.all_gather(parts, local.contiguous(), group=ModelAxis.group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        return grad.chunk(ModelAxis.size, dim=-1)[ModelAxis.rank].contiguous()


class _SplitColumns(torch.autograd.Function):
    """Megatron's scatter to the model-parallel region: this rank's columns of a replicated input;
    backward gathers every rank's columns of the gradient."""

    @staticmethod
    def forward(ctx, full):
        return full.chunk(ModelAxis.size, dim=-1)[ModelAxis.rank].contiguous()

    @staticmethod
    def backward(ctx, grad):
        return _GatherColumns.forward(ctx, grad)


class _CopyToModelRanks(torch.autograd.Function):
    """Megatron's copy to the model-parallel region: identity forward; backward sums every model
    rank's gradient of the replicated input (each rank's rows contribute their part)."""

    @staticmethod
    def forward(ctx, full):
        return full

    @staticmethod
    def backward(ctx, grad):
        return _SumOverModelRanks.forward(ctx, grad)


class _SumOverModelRanks(torch.autograd.Function):
    """Megatron's reduce from the model-parallel region: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, partial):
        total = partial.clone()
        torch.distributed.all_reduce(total, group=ModelAxis.group)
        return total

    @staticmethod
    def backward(ctx, grad):
        return grad


def _slice_generator() -> torch.Generator:
    """A generator drawn from the global one (same on every model rank, so replicated layers stay
    equal) and offset by the model rank: each rank's slice of a parallel layer has its own values."""
    return torch.Generator().manual_seed(int(torch.randint(0, 2 ** 30, (1,))) + 7919 * ModelAxis.rank)


class ColumnParallelLinear(torch.nn.Module):
    """Megatron's column-parallel Linear: out_features / mp rows of weight and bias per model rank,
    outputs gathered."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        rows, generator = out_features // ModelAxis.size, _slice_generator()
        self.weight = torch.nn.Parameter(torch.randn(rows, in_features, generator=generator) / in_features ** 0.5)
        self.bias = torch.nn.Parameter(torch.randn(rows, generator=generator) * 0.1)

    def forward(self, x):
        return _GatherColumns.apply(torch.nn.functional.linear(_CopyToModelRanks.apply(x), self.weight, self.bias))


class RowParallelLinear(torch.nn.Module):
    """Megatron's row-parallel Linear: in_features / mp columns of weight per model rank, partial
    products summed over the model ranks, the bias replicated."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        columns, generator = in_features // ModelAxis.size, _slice_generator()
        self.weight = torch.nn.Parameter(torch.randn(out_features, columns, generator=generator) / in_features ** 0.5)
        self.bias = torch.nn.Parameter(torch.zeros(out_features))

    def forward(self, x):
        return _SumOverModelRanks.apply(_SplitColumns.apply(x) @ self.weight.t()) + self.bias


def param_groups(module) -> list[dict]:
    """--groups: weight decay on matrices only (DeepSpeed's flat per group keeps each group's order)."""
    named = [(name, param) for name, param in module.named_parameters() if param.requires_grad]
    return [{"params": [p for _, p in named if p.dim() > 1]},
            {"params": [p for _, p in named if p.dim() <= 1], "weight_decay": 0.0}]


def layer_specs(frozen: str | None = None, groups: bool = False, mp: int = 1, hidden: int | None = None):
    from deepspeed.pipe import LayerSpec, TiedLayerSpec

    def head(embedding, hidden):  # the tied weight again, as the output projection
        return hidden @ embedding.weight.t()

    if hidden:  # the same seven layers, the two wide Linears sliced over the model axis
        return [TiedLayerSpec("embed", torch.nn.Embedding, VOCAB, DIM),
                LayerSpec(ColumnParallelLinear, DIM, hidden),
                torch.nn.GELU(),
                LayerSpec(RowParallelLinear, hidden, DIM),
                LayerSpec(ScaledLayerNorm if groups else torch.nn.LayerNorm, DIM),
                LayerSpec(torch.nn.Linear, DIM, DIM),
                TiedLayerSpec("embed", torch.nn.Embedding, VOCAB, DIM, forward_fn=head)]
    return [TiedLayerSpec("embed", torch.nn.Embedding, VOCAB, DIM),
            LayerSpec(FrozenWeightLinear if frozen == "build" else torch.nn.Linear, DIM, HIDDEN),
            torch.nn.GELU(),
            LayerSpec(torch.nn.Linear, HIDDEN, DIM),
            LayerSpec(ScaledLayerNorm if groups else torch.nn.LayerNorm, DIM),
            LayerSpec(torch.nn.Linear, DIM, DIM),
            TiedLayerSpec("embed", torch.nn.Embedding, VOCAB, DIM, forward_fn=head)]


def loss_fn(logits, labels):
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB).float(), labels.reshape(-1))


def config(precision: str, dp: int, universal: bool = False, mp: int = 1, node_local: bool = False) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": GRAD_ACCUM,
           "train_batch_size": MICRO_BATCH * GRAD_ACCUM * dp,
           "optimizer": {"type": "Adam", "params": {"lr": 2e-2, "weight_decay": 0.01, "torch_adam": True}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 2e-2,
                                                          "warmup_num_steps": 10}},
           "zero_optimization": {"stage": 1}, "steps_per_print": 1000}
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif precision == "fp16":  # dynamic loss scaling; a short window so that the scale and its counters move
        cfg["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 8, "loss_scale_window": 2,
                       "hysteresis": 2, "min_loss_scale": 1}
    if mp > 1:
        # with a model axis the PipelineEngine by default cuts activations and their gradients into
        # mp pieces between stages (runtime/pipe/engine.py is_pipe_partitioned, is_grad_partitioned,
        # PartitionedTensor over the slice group); off, whole tensors are sent, as without one. Not
        # needed on CPU/gloo: with DeepSpeed's defaults (both on) `train --pp 2 --mp 2` ran too and
        # saved bit-identical masters and moments; off keeps the judging engines' sends plain
        cfg["pipeline"] = {"pipe_partitioned": False, "grad_partitioned": False}
    if universal:  # DeepSpeed's own path, the second oracle: ds_to_universal's output
        cfg["checkpoint"] = {"load_universal": True}
    if node_local:  # each node saves into its own directory (engine.py use_node_local_storage)
        cfg["checkpoint"] = {**cfg.get("checkpoint", {}), "use_node_local_storage": True}
    return cfg


def batch(seed: int):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ), generator=generator)
    return ids, torch.roll(ids, 1, dims=1)


def build_engine(pp: int, precision: str, seed: int, universal: bool = False, frozen: str | None = None,
                 groups: bool = False, mp: int = 1, info: bool = False, node_local: bool = False):
    faulthandler.dump_traceback_later(HANG_SECONDS, exit=True)  # a hung collective fails the run, with stacks
    import deepspeed
    from deepspeed.accelerator import get_accelerator
    from deepspeed.pipe import PipelineModule
    if precision == "fp16":  # the CPU accelerator refuses fp16, which torch computes on CPU (DESIGN.md 4)
        get_accelerator().is_fp16_supported = lambda: True
    deepspeed.init_distributed(dist_backend="gloo")
    world = int(os.environ["WORLD_SIZE"])
    torch.manual_seed(seed)
    ModelAxis.rank, ModelAxis.size, ModelAxis.group = 0, 1, None  # a model-axis engine before this one set them
    if mp > 1 or info:  # "-mpNu" at tp 1 too: PipeModelDataParallelTopology, as a Megatron script builds it
        from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology
        topology = PipeModelDataParallelTopology(num_pp=pp, num_mp=mp, num_dp=world // (pp * mp))
        ModelAxis.rank, ModelAxis.size = topology.get_coord(torch.distributed.get_rank()).model, mp
        module = PipelineModule(layers=layer_specs(frozen, groups, mp, MP_HIDDEN_U if info else MP_HIDDEN),
                                topology=topology, loss_fn=loss_fn,
                                partition_method="parameters", base_seed=seed)
        ModelAxis.group = module._grid.get_slice_parallel_group()
    else:
        module = PipelineModule(layers=layer_specs(frozen, groups), num_stages=pp, loss_fn=loss_fn,
                                partition_method="parameters", base_seed=seed)
    if frozen == "later":  # after the partition was made, as a fine-tuning script freezing part of a model does
        for name, param in module.named_parameters():
            if name == FROZEN:
                param.requires_grad_(False)
    parameters = param_groups(module) if groups else [p for p in module.parameters()]
    engine, _, _, _ = deepspeed.initialize(model=module, model_parameters=parameters,
                                           config=config(precision, world // (pp * mp), universal, mp, node_local))
    return engine


def stage_truth(engine) -> dict:
    """Per parameter of this rank's stage: its fp32 master and Adam moments, or, for a frozen one
    (which no optimizer holds), its module value."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    engine.optimizer._hp_optimizer_states_linked = False
    engine.optimizer._lazy_init_hp_params_optimizer_state()
    tensors = {}
    for name, param in engine.module.named_parameters():
        if not param.requires_grad:
            tensors[name] = {"frozen": param.detach().clone()}
            continue
        tensors[name] = {"fp32": safe_get_full_fp32_param(param).clone(),
                         "exp_avg": safe_get_full_optimizer_state(param, "exp_avg").clone(),
                         "exp_avg_sq": safe_get_full_optimizer_state(param, "exp_avg_sq").clone()}
    for name, buffer in engine.module.named_buffers():
        tensors[name] = {"buffer": buffer.detach().clone()}
    return tensors


def counters(engine) -> dict:
    """The step counters and, under fp16, the dynamic loss scaler's state (DynamicLossScaler's
    attributes: cur_scale, cur_iter, last_overflow_iter, cur_hysteresis, ...)."""
    state = {"global_steps": engine.global_steps, "global_samples": engine.global_samples,
             "skipped_steps": engine.skipped_steps, "lr": engine.optimizer.param_groups[0]["lr"],
             "hyperparameters": [{key: group[key] for key in ("lr", "weight_decay")}
                                 for group in engine.optimizer.param_groups]}
    scaler = getattr(engine.optimizer, "loss_scaler", None)
    if engine.fp16_enabled():
        state["loss_scaler"] = {key: value for key, value in sorted(vars(scaler).items())
                                if isinstance(value, (bool, int, float, str))}
        state["dynamic_loss_scale"] = engine.optimizer.dynamic_loss_scale
    return state


def run_state(engine) -> dict:
    """What the DCP export's judge compares beside the tensors (reshard_proof.pipeline_truth): the LR
    scheduler's state_dict (WarmupLR from the config) and the Adam steps of this rank's optimizer, as the
    optimizer holds them (its base optimizer's per-partition `step`; fp16 steps skipped on overflow are not
    counted there). Kept out of `counters`, which a load's engine is compared with key by key."""
    steps = {float(state["step"]) for state in engine.optimizer.optimizer.state.values() if "step" in state}
    return {"lr_scheduler": engine.lr_scheduler.state_dict(), "adam_steps": sorted(steps)}


def eval_loss(engine) -> float:
    fixed = batch(12345)
    return float(engine.eval_batch(iter([fixed]), num_micro_batches=1))


def variant_settings(variant: str) -> dict:
    """A variant's name (`--variant`, `--more`, `--judge`; tests/test_pipeline.py names them) as this
    harness's settings: a precision, with "-frozen" layer 1's weight frozen after the build, with
    "-groups" two param groups and a buffer, with "-mp2" a model axis of 2 ("-groups-mp2",
    "-frozen-mp2": both), with "-mp1u", "-mp2u", "-mp4u" a model axis of 1, 2, 4 (hidden MP_HIDDEN_U)
    saving UNIVERSAL_INFO as client state ("-groups-mpNu", N 1, 2 or 4: with the groups and the buffer, whose name
    "4.scale" UNIVERSAL_INFO's replicated pattern for layer 4 covers)."""
    precision, _, model = variant.partition("-")
    if precision not in ("fp32", "fp16", "bf16") or model not in ("", "frozen", "groups", "mp2", "groups-mp2",
                                                                   "frozen-mp2", "mp1u", "mp2u", "mp4u",
                                                                   "groups-mp1u", "groups-mp2u", "groups-mp4u",
                                                                   "frozen-mp1u", "frozen-mp2u"):
        raise SystemExit(f"unknown variant {variant!r}")
    axis = model.rpartition("-")[2]
    return {"precision": precision, "frozen": "later" if model.startswith("frozen") else None,
            "groups": model.startswith("groups"), "mp": int(axis[2]) if axis.startswith("mp") else 1,
            "info": axis.endswith("u")}


def with_variant(args, variant: str) -> argparse.Namespace:
    """`args` with the precision and model flags of `variant`: the same launch, another engine's settings."""
    return argparse.Namespace(**{**vars(args), **variant_settings(variant)})


def train(args) -> None:
    train_one(args, args.save, args.truth)
    for variant, save, truth in args.more:  # each its own engine, save and truth, one after another
        # --own-load-report is about the first save only: its JSON is not overwritten by the next
        train_one(argparse.Namespace(**{**vars(with_variant(args, variant)), "own_load_report": None}), save, truth)


def train_one(args, save: str, truth_dir: str) -> None:
    engine = build_engine(args.pp, args.precision, seed=1, frozen=args.frozen, groups=args.groups, mp=args.mp,
                          info=args.info, node_local=args.node_local)
    rank = int(os.environ["RANK"])
    steps = iter([batch(100 * step + engine.grid.data_parallel_id * 10 + i)
                  for step in range(args.steps) for i in range(GRAD_ACCUM)])
    for _ in range(args.steps):
        engine.train_batch(data_iter=steps)
    # ds_to_universal refuses a save without universal_checkpoint_info (Megatron-DeepSpeed writes it)
    engine.save_checkpoint(save, tag="step3", client_state={"note": "pipeline", "universal_checkpoint_info":
                                                            UNIVERSAL_INFO if args.info else {}})
    truth = {"tensors": stage_truth(engine), "loss": eval_loss(engine), "counters": counters(engine),
             "model_rank": ModelAxis.rank, "tp": ModelAxis.size, **run_state(engine)}
    os.makedirs(truth_dir, exist_ok=True)
    torch.save(truth, os.path.join(truth_dir, f"rank{rank}.pt"))
    torch.distributed.barrier()
    if args.own_load_report:  # DeepSpeed's own load of what it just saved, at the same topology
        try:
            engine.load_checkpoint(save, tag="step3")  # the tag: `latest` is on node 0 only under node-local
            outcome = None
        except Exception as error:  # noqa: BLE001 (the report says what it was)
            outcome = f"{type(error).__name__}: {error}"
        gathered = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(gathered, outcome)
        if rank == 0:
            with open(args.own_load_report, "w") as out:
                json.dump({"errors": gathered}, out)
        torch.distributed.barrier()


def check(args) -> None:
    check_one(args, args.load, args.verdict, args.in_job)
    for load, verdict, mode in args.also:
        moded, in_job = in_mode(args, mode)
        check_one(moded, load, verdict, in_job)
    for variant, load, truth, verdict, mode in args.judge:
        judged = with_variant(args, variant)
        judged.truth = truth
        judged, in_job = in_mode(judged, mode)
        check_one(judged, load, verdict, in_job)
    for directory, truth, verdict in args.safetensors:  # a "-mpNu" variant: that model's exports
        check_safetensors(directory, truth, verdict, MP_HIDDEN_U if args.info else None)


def check_safetensors(directory: str, truth_dir: str, verdict_path: str, hidden: int | None = None) -> None:
    """A safetensors export of a pipeline save (`reshard export --format safetensors`), loaded with
    strict=True into a PipelineModule built afresh from the same layers at pp=1: every tensor of its
    state_dict() must equal the truth (a trainable parameter's fp32 master, a frozen one's value).
    `hidden`: the model-axis model ("-mpNu": MP_HIDDEN_U) built at tp 1 with no model axis (its
    parallel Linears whole: plain Linears), the truth of a model-axis save joined over its model
    ranks by this harness's own layers (sliced_truth at tp 1)."""
    from deepspeed.pipe import PipelineModule
    from safetensors.torch import load_file
    state = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            state.update(load_file(os.path.join(directory, name)))
    expected = {}
    truths = [torch.load(os.path.join(truth_dir, name), weights_only=True) for name in sorted(os.listdir(truth_dir))]
    for truth in truths:
        for key, states in truth["tensors"].items():
            expected[key] = states["fp32"] if "fp32" in states else states["frozen"]
    if truths[0].get("tp", 1) > 1:  # a model axis: every model rank's slices joined whole
        expected = {key: states["fp32"] if "fp32" in states else states["frozen"]
                    for key, states in sliced_truth(truths, 1, 0).items()}
    torch.manual_seed(4242)
    ModelAxis.rank, ModelAxis.size, ModelAxis.group = 0, 1, None  # no model axis: a model-axis engine set them
    module = PipelineModule(layers=layer_specs(hidden=hidden), num_stages=1, loss_fn=loss_fn,
                            partition_method="parameters")
    problems = []
    try:
        module.load_state_dict(state, strict=True)
    except RuntimeError as error:
        problems.append(f"load_state_dict(strict=True): {error}")
    loaded = module.state_dict()
    if sorted(loaded) != sorted(expected):
        problems.append(f"state_dict names {sorted(loaded)} != the truth's {sorted(expected)}")
    for name, want in expected.items():
        got = loaded.get(name)
        if got is None or got.dtype != want.dtype or not torch.equal(got, want):
            problems.append(f"{name}: differs from the truth")
    if int(os.environ["RANK"]) == 0:
        with open(verdict_path + ".tmp", "w") as out:
            json.dump({"ok": not problems, "problems": problems, "checked": len(expected), "names": sorted(state)},
                      out, indent=1)
        os.replace(verdict_path + ".tmp", verdict_path)
    torch.distributed.barrier()


def in_mode(args, mode: str) -> tuple[argparse.Namespace, bool]:
    """(args, in_job) for check_one of an --also / --judge MODE: "plain", "in-job" (reshard's in-job
    API), or "universal" (a ds_to_universal output, loaded with load_universal: DeepSpeed's own path).
    The MODE decides, whatever the launch's own --universal (a plain or in-job load in an engine
    configured for load_universal would take DeepSpeed's universal path)."""
    universal = argparse.Namespace(**{**vars(args), "universal": mode == "universal"})
    return universal, {"plain": False, "in-job": True, "universal": False}[mode]


def check_one(args, load: str, verdict_path: str, in_job: bool) -> None:
    engine = build_engine(args.pp, args.precision, seed=777, universal=args.universal, frozen=args.frozen,
                          groups=args.groups, mp=args.mp, info=args.info)
    rank = int(os.environ["RANK"])
    note = ""
    if in_job:  # reshard's in-job API: the source's own files, rebuilt in memory for this engine
        import contextlib
        import io

        import reshard.deepspeed
        budget = {"memory_budget": args.in_job_budget} if args.in_job_budget else {}
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):  # its summary line (rounds) goes into the verdict too
            path, client = reshard.deepspeed.load_checkpoint(engine, load, **budget)
        note = printed.getvalue()
        print(note, end="", flush=True)
    else:
        path, client = engine.load_checkpoint(load)
    truths = [torch.load(os.path.join(args.truth, name), weights_only=True) for name in sorted(os.listdir(args.truth))]
    expected = {}
    for truth in truths:  # with a model axis, the truth of this rank's model rank: names repeat, values differ
        if truth.get("model_rank", 0) == ModelAxis.rank:
            expected.update(truth["tensors"])
    saved_tp = truths[0].get("tp", 1)
    if saved_tp != ModelAxis.size:  # another tp: this rank's slice of each tensor joined over the saved ranks
        expected = sliced_truth(truths, ModelAxis.size, ModelAxis.rank)
    problems = []
    if path is None:
        problems.append("load_checkpoint returned None")
    got = stage_truth(engine)
    for name, states in got.items():
        if name not in expected:
            problems.append(f"{name}: not in the truth")
            continue
        for key, value in states.items():
            want = expected[name][key]
            if want.shape != value.shape or not torch.equal(want, value):
                gap = float((want.float() - value.float()).abs().max()) if want.shape == value.shape else "shape"
                problems.append(f"{name}.{key}: differs (max abs {gap})")
    loss = eval_loss(engine)
    # at another tp the row-parallel sums add their partial products in another order: equal to
    # rounding, not bit for bit (at the same tp the loss must be the saved one exactly). In bf16 each
    # rank's partial product is rounded to bf16 before the all-reduce sums them in bf16, so the
    # rounding is bf16's: "bf16-groups-mp2u" saved at tp 2 and loaded at tp 1 with every master,
    # moment, buffer and layer-file weight equal gave 6.128876 for 6.126684 (2.2e-3), 6.129056 at tp 4
    # (2.4e-3). fp16 rounds the same way at its own precision: "fp16-mp2u" saved at tp 2 gave 6.250655
    # at tp 1 for 6.249155 (1.5e-3, at pp 1 and 2 alike), and both figures came out exactly from one
    # process's fp16 forward of the saved layer files' fp16 weights, the row-parallel product summed
    # from two fp16 partial products or computed as one: the gap is the rounding, not a value loaded
    # wrong (the verdict records each rank's loss and the saved one)
    tolerance = {"bf16": 5e-3, "fp16": 3e-3}.get(args.precision, 1e-5)
    if loss != truths[0]["loss"] and (saved_tp == ModelAxis.size or abs(loss - truths[0]["loss"]) > tolerance):
        problems.append(f"eval loss {loss} != {truths[0]['loss']}")
    loaded = counters(engine)
    for key, want in truths[0]["counters"].items():
        if loaded.get(key) != want:
            problems.append(f"{key} {loaded.get(key)} != {want}")
    if (client or {}).get("note") != "pipeline":
        problems.append(f"client_state note lost: {client and client.get('note')}")
    engine.train_batch(data_iter=iter([batch(9000 + i) for i in range(GRAD_ACCUM)]))
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, {"rank": rank, "checked": len(got), "problems": problems,
                                                   "loss": loss, "saved_loss": truths[0]["loss"], "note": note})
    if rank == 0:
        verdict = {"ok": all(not g["problems"] for g in gathered), "ranks": gathered}
        with open(verdict_path + ".tmp", "w") as out:
            json.dump(verdict, out, indent=1)
        os.replace(verdict_path + ".tmp", verdict_path)
    torch.distributed.barrier()


def sliced_truth(truths: list, tp: int, rank: int) -> dict:
    """Every tensor of the truth (every saved rank's) as model rank `rank` of `tp` holds it: the saved
    model ranks' tensors joined by this model's own layers (layer 1 ColumnParallelLinear: dim 0;
    layer 3 RowParallelLinear: weight dim 1, bias whole; the rest whole), then that rank's even slice."""
    by_rank: dict[int, dict] = {}
    for truth in truths:
        by_rank.setdefault(truth["model_rank"], {}).update(truth["tensors"])
    expected = {}
    for name, states in by_rank[0].items():
        dim = 0 if name.startswith("1.") else 1 if name == "3.weight" else None
        expected[name] = {key: value if dim is None else
                          torch.cat([by_rank[m][name][key] for m in range(len(by_rank))], dim=dim).chunk(
                              tp, dim=dim)[rank].contiguous()
                          for key, value in states.items()}
    return expected


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["train", "check"])
    parser.add_argument("--pp", type=int, required=True)
    parser.add_argument("--precision", choices=["fp32", "fp16", "bf16"], default="fp32")
    parser.add_argument("--frozen", choices=["build", "later"],
                        help="layer 1's weight frozen in its constructor (FrozenWeightLinear) or after the build")
    parser.add_argument("--groups", action="store_true", help="two param groups and a buffer (ScaledLayerNorm)")
    parser.add_argument("--mp", type=int, default=1,
                        help="model (tensor-slicing) axis: PipeModelDataParallelTopology(pp, mp, world / (pp * mp))")
    parser.add_argument("--variant", help="the precision and model flags above by a variant's name (variant_settings): "
                                           "fp32, fp16, bf16, each optionally with -frozen, -groups or -mp2")
    parser.add_argument("--save")
    parser.add_argument("--load")
    parser.add_argument("--truth", required=True)
    parser.add_argument("--verdict")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--universal", action="store_true", help="check: load a ds_to_universal output")
    parser.add_argument("--in-job", action="store_true", help="check: load through reshard.deepspeed.load_checkpoint")
    parser.add_argument("--in-job-budget", type=int, help="check: the in-job loads' memory_budget (bytes)")
    parser.add_argument("--also", nargs=3, action="append", default=[], metavar=("LOAD", "VERDICT", "MODE"),
                        help="check: one more save (MODE plain, in-job or universal), in a fresh engine, same truth")
    parser.add_argument("--more", nargs=3, action="append", default=[], metavar=("VARIANT", "SAVE", "TRUTH"),
                        help="train: then one more variant (e.g. fp16, fp32-frozen) in an engine of its own")
    parser.add_argument("--judge", nargs=5, action="append", default=[],
                        metavar=("VARIANT", "LOAD", "TRUTH", "VERDICT", "MODE"),
                        help="check: then one more save of another variant (MODE plain, in-job or universal), its own truth")
    parser.add_argument("--safetensors", nargs=3, action="append", default=[], metavar=("DIR", "TRUTH", "VERDICT"),
                        help="check: then a pipeline save's safetensors export, loaded into a PipelineModule at pp=1")
    parser.add_argument("--node-local", action="store_true",
                        help="train: save with use_node_local_storage (each node its own --save directory)")
    parser.add_argument("--own-load-report", metavar="JSON",
                        help="train: then DeepSpeed's own load_checkpoint of the save; every rank's error to JSON")
    parser.set_defaults(info=False)  # a variant "-mpNu" sets it (variant_settings)
    args = parser.parse_args()
    if args.variant:
        args = with_variant(args, args.variant)
    train(args) if args.mode == "train" else check(args)


if __name__ == "__main__":
    main()
