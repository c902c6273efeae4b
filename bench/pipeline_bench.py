"""Pipeline bench: reshard against DeepSpeed's universal path on one trained PipelineModule save.

    python bench/pipeline_bench.py                       # ~160 MB save, (pp, dp) (2, 1) -> (1, 2)
    python bench/pipeline_bench.py --dim 1024 --pairs 8  # bigger
    python bench/pipeline_bench.py --budget 512M         # reshard's --memory-budget (default 1G)
    python bench/pipeline_bench.py --source 2,1 --target 2,2 --budget 32M --in-job-budget 2G   # the main road
    python bench/pipeline_bench.py --tp-from 2 --tp-to 1 --source 2,1 --target 1,4   # a model axis

One save, trained here with real DeepSpeed on CPU ranks (a tied embedding/head, `--pairs` pairs of
Linear layers of odd widths around a GELU, a LayerNorm; ZeRO-1 fp32, Adam), at the source
(pp, dp). Then, on that same save, each contender runs as a watched process tree
(`process_tree.run_watched`: wall time, peak RSS of the tree and of its largest process):

    reshard       torchrun -nproc W -m reshard SRC DST --target-dp D --target-pp P
                  --pipeline-layers N --pipeline-tied embed:0,N-1, then plain load_checkpoint(DST)
                  in a PipelineModule engine at (P, D)
    universal     DeepSpeed's ds_to_universal.py (W extract and merge workers), then
                  load_checkpoint with "load_universal" at (P, D)
    in-job        reshard.deepspeed.load_checkpoint(engine, SRC) at (P, D): no converted copy

With `--tp-from T` (the model axis, (pp, tp, dp) = (source pp, T, source dp), PipeModelDataParallel-
Topology) the pairs are Megatron-style: tests/pipeline_run.py's ColumnParallelLinear (dim -> hidden,
cut on dim 0) and RowParallelLinear (hidden -> dim, weight cut on dim 1, bias whole), and the save
carries the `universal_checkpoint_info` patterns Megatron-DeepSpeed writes for them (model_axis_info).
reshard then also gets `--target-tp` (`--tp-to`), and every engine at the target is built at that tp.
The source engine's dumps (cut at T) are joined by the same dims and cut again at the target tp
before they are compared (joined_truth).

Every load dumps every parameter's full fp32 master and Adam moments by name
(`safe_get_full_fp32_param`, `safe_get_full_optimizer_state`); the universal load is the
independent oracle: every tensor must be equal, bit for bit (and equal to the source engine's).
The page cache is not dropped (a 2-core shared machine; both contenders start with the source
cached by the training that just wrote it). Prints both rows and writes
bench/results/pipeline-<timestamp>.json.

Worker modes (run under torchrun by the bench itself): `train`, `load`.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)

VOCAB, MICRO_BATCH, SEQ, GRAD_ACCUM = 1001, 2, 8, 1
TAG = "step2"
sys.path.insert(0, os.path.join(REPO, "tests"))  # --tp-from: tests/pipeline_run.py's Megatron-style layers


def column_layers(pairs: int) -> list[int]:
    """The layer indices of the pairs' first Linears (ColumnParallelLinear with a model axis)."""
    return [1 + 3 * i for i in range(pairs)]


def row_layers(pairs: int) -> list[int]:
    """The layer indices of the pairs' second Linears (RowParallelLinear with a model axis)."""
    return [3 + 3 * i for i in range(pairs)]


def model_axis_info(pairs: int) -> dict:
    """The universal_checkpoint_info a Megatron-DeepSpeed script saves for the model-axis model: what
    every model rank holds whole (the tied embedding, the row-parallel biases, the LayerNorm) and the
    row-parallel weights (cut on dim 1); the rest, the column-parallel weights and biases, are cut on
    dim 0, ds_to_universal's default. Both ds_to_universal and reshard match with re.match: anchored
    at the start, so "$" keeps "3." from matching "30.". """
    rows = "|".join(map(str, row_layers(pairs)))
    return {"tp_replicated_parameter_patterns": [r"tied_modules\.embed\.", rf"(?:{rows})\.bias$",
                                                 rf"{3 * pairs + 1}\.(?:weight|bias)$"],
            "parameter_with_row_parallelism_patterns": [rf"(?:{rows})\.weight$"]}


# ---- worker side (under torchrun) -------------------------------------------------------------

def layer_specs(dim: int, hidden: int, pairs: int, model_axis: bool = False):
    import torch
    from deepspeed.pipe import LayerSpec, TiedLayerSpec

    def head(embedding, x):  # the tied weight again, as the output projection
        return x @ embedding.weight.t()

    if model_axis:
        from pipeline_run import ColumnParallelLinear, RowParallelLinear
        first, second = ColumnParallelLinear, RowParallelLinear
    else:
        first = second = torch.nn.Linear
    layers = [TiedLayerSpec("embed", torch.nn.Embedding, VOCAB, dim)]
    for _ in range(pairs):
        layers += [LayerSpec(first, dim, hidden), torch.nn.GELU(), LayerSpec(second, hidden, dim)]
    layers += [LayerSpec(torch.nn.LayerNorm, dim), TiedLayerSpec("embed", torch.nn.Embedding, VOCAB, dim,
                                                                 forward_fn=head)]
    return layers


def build_engine(args, pp: int, seed: int, universal: bool):
    import deepspeed
    import torch
    from deepspeed.pipe import PipelineModule
    deepspeed.init_distributed(dist_backend="gloo")
    dp = int(os.environ["WORLD_SIZE"]) // (pp * args.tp)
    torch.manual_seed(seed)

    def loss_fn(logits, labels):
        return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB).float(), labels.reshape(-1))

    if args.model_axis:  # PipeModelDataParallelTopology, as a Megatron script builds it (tests/pipeline_run.py)
        from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology
        from pipeline_run import ModelAxis
        topology = PipeModelDataParallelTopology(num_pp=pp, num_mp=args.tp, num_dp=dp)
        ModelAxis.rank, ModelAxis.size = topology.get_coord(torch.distributed.get_rank()).model, args.tp
        module = PipelineModule(layers=layer_specs(args.dim, args.hidden, args.pairs, True), topology=topology,
                                loss_fn=loss_fn, partition_method="parameters", base_seed=seed)
        ModelAxis.group = module._grid.get_slice_parallel_group()
    else:
        module = PipelineModule(layers=layer_specs(args.dim, args.hidden, args.pairs), num_stages=pp,
                                loss_fn=loss_fn, partition_method="parameters", base_seed=seed)
    config = {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": GRAD_ACCUM,
              "train_batch_size": MICRO_BATCH * GRAD_ACCUM * dp,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
              "zero_optimization": {"stage": 1}, "steps_per_print": 1000}
    if args.model_axis:  # whole activations between stages, as tests/pipeline_run.py config() says why
        config["pipeline"] = {"pipe_partitioned": False, "grad_partitioned": False}
    if universal:
        config["checkpoint"] = {"load_universal": True}
    if getattr(args, "node_local", False):  # each rank saves on its own node (bench/pipeline_node_local.py)
        config["checkpoint"] = {"use_node_local_storage": True}
    engine, _, _, _ = deepspeed.initialize(model=module, model_parameters=list(module.parameters()), config=config)
    return engine


def batches(count: int, offset: int):
    import torch
    out = []
    for i in range(count):
        ids = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ), generator=torch.Generator().manual_seed(offset + i))
        out.append((ids, torch.roll(ids, 1, dims=1)))
    return iter(out)


def dump_stage(engine, path: str, extra: dict) -> None:
    """Every parameter of this rank's stage: full fp32 master and Adam moments, by name."""
    import torch
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    engine.optimizer._hp_optimizer_states_linked = False
    engine.optimizer._lazy_init_hp_params_optimizer_state()
    tensors = {name: {"fp32": safe_get_full_fp32_param(p).clone(),
                      "exp_avg": safe_get_full_optimizer_state(p, "exp_avg").clone(),
                      "exp_avg_sq": safe_get_full_optimizer_state(p, "exp_avg_sq").clone()}
               for name, p in engine.module.named_parameters()}
    if engine.grid.get_data_parallel_rank() == 0:  # one dump per (stage, model rank)
        torch.save({"tensors": tensors, "model_rank": engine.grid.get_slice_parallel_rank(),
                    "tp": engine.grid.get_slice_parallel_world_size(), **extra}, path)


def fill_moments(engine) -> None:
    """Give an untrained engine's Adam moments distinct values, parameter by parameter, seeded by the
    parameter's name (exp_avg in [-1, 1), exp_avg_sq in [0, 1)). torch's Adam makes its state at the first
    step; DeepSpeed 0.19.8's ZeRO-1 no longer runs one at init (stage_1_and_2.py
    `initialize_optimizer_states` only sets zero gradients), so here each rank in turn (the ranks one after
    the other: the step's gradient and temporaries stay on one rank at a time) runs the optimizer's own step
    on zero gradients with weight decay off, which leaves the masters as they are (equal to the module
    weights) and the moments zero; zero moments would let a
    misplaced slice of a moment pass a comparison unseen, so they are filled in place. Seeding by name gives
    the tied embedding's two copies (one per stage) the same moments, as training keeps them. Each group's
    fragments are found by the optimizer's own `_param_slice_mappings` (`_create_param_mapping`, offsets in
    this rank's partition). The save is still DeepSpeed's own `save_checkpoint` of this engine."""
    import zlib

    import torch
    zero = engine.optimizer
    for turn in range(torch.distributed.get_world_size()):
        if turn == torch.distributed.get_rank():
            for flat in zero.single_partition_of_fp32_groups:
                flat.grad = torch.zeros_like(flat)
            decay = [group["weight_decay"] for group in zero.optimizer.param_groups]
            for group in zero.optimizer.param_groups:  # AdamW's decay would move the masters off the module
                group["weight_decay"] = 0.0            # weights (this step copies nothing back to them)
            zero.optimizer.step()
            for group, value in zip(zero.optimizer.param_groups, decay):
                group["weight_decay"] = value
            for flat in zero.single_partition_of_fp32_groups:
                flat.grad = None
        torch.distributed.barrier()
    for group, mapping in zip(zero.optimizer.param_groups, zero._param_slice_mappings):
        state = zero.optimizer.state[group["params"][0]]
        for name, fragment in mapping.items():
            generator = torch.Generator().manual_seed(zlib.crc32(name.encode()))
            state["exp_avg"].narrow(0, fragment.start, fragment.numel).uniform_(-1, 1, generator=generator)
            state["exp_avg_sq"].narrow(0, fragment.start, fragment.numel).uniform_(0, 1, generator=generator)


def worker(args) -> None:
    import resource

    import torch

    from reshard.jobs.options import parse_size
    rank = int(os.environ["RANK"])
    if args.dump:
        os.makedirs(args.dump, exist_ok=True)
    if args.mode == "train":
        engine = build_engine(args, args.pp, seed=1, universal=False)
        for step in range(args.steps):
            engine.train_batch(data_iter=batches(GRAD_ACCUM, 100 * step + 10 * engine.grid.data_parallel_id))
        if args.steps == 0:  # no backward (bench/pipeline_big_rung.py: a save too big to train here)
            fill_moments(engine)
        # ds_to_universal refuses a save without universal_checkpoint_info (Megatron-DeepSpeed writes it)
        info = model_axis_info(args.pairs) if args.model_axis else {}
        engine.save_checkpoint(args.save, tag=TAG, client_state={"universal_checkpoint_info": info})
        if args.dump:
            dump_stage(engine, os.path.join(args.dump, f"rank{rank}.pt"), {})
    else:
        engine = build_engine(args, args.pp, seed=777, universal=args.universal)
        torch.distributed.barrier()
        started = time.perf_counter()
        if args.in_job:  # reshard.deepspeed.load_checkpoint on the source itself: no converted copy
            import reshard.deepspeed
            path, _ = reshard.deepspeed.load_checkpoint(engine, args.load, memory_budget=parse_size(args.budget))
        else:
            path, _ = engine.load_checkpoint(args.load)
        seconds = time.perf_counter() - started
        if path is None:
            raise SystemExit(f"rank {rank}: load_checkpoint({args.load}) found nothing")
        dump_stage(engine, os.path.join(args.dump, f"rank{rank}.pt"),
                   {"load_seconds": seconds, "ru_maxrss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                    * 1024})
    torch.distributed.barrier()


# ---- bench side ------------------------------------------------------------------------------

def torchrun(nproc: int, *args) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            os.path.abspath(__file__), *map(str, args)]


def watched(command: list, what: str, scratch: str, expect: str | None = None) -> dict:
    from make_checkpoint import child_env
    from process_tree import run_watched
    from run import require_success
    run = run_watched([str(c) for c in command], env=child_env(), cwd=REPO,
                      log_path=os.path.join(scratch, what.replace(" ", "_") + ".log"), disk_path=scratch)
    require_success(run, what, expect)
    result = {k: v for k, v in run.to_dict().items() if k != "output_tail"}
    result["command"] = " ".join(run.command)
    return result


def read_dumps(folder: str) -> tuple[dict, list[dict]]:
    """Every dumped tensor by name; with a model axis (tp > 1) by "name@mpR", R the model rank."""
    import torch
    tensors, extras = {}, []
    for name in sorted(os.listdir(folder)):
        dump = torch.load(os.path.join(folder, name), weights_only=True)
        suffix = f"@mp{dump['model_rank']}" if dump["tp"] > 1 else ""
        for key, value in dump.pop("tensors").items():
            tensors.setdefault(key + suffix, value)
        extras.append(dump)
    return tensors, extras


def joined_truth(tensors: dict, pairs: int, tp_from: int, tp_to: int) -> dict:
    """The source engine's dumps (read_dumps, cut at tp_from) as an engine at tp_to holds them: each
    tensor joined over the model ranks by the model's own layers (column-parallel: dim 0; row-parallel
    weight: dim 1; the rest whole: model rank 0's) and cut evenly again."""
    import torch
    if tp_from == tp_to:
        return tensors
    by_name: dict[str, list] = {}
    for key in sorted(tensors, key=lambda k: int(k.rpartition("@mp")[2] or 0)):
        by_name.setdefault(key.rpartition("@mp")[0] or key, []).append(tensors[key])
    columns = {str(i) for i in column_layers(pairs)}
    rows = {f"{i}.weight" for i in row_layers(pairs)}
    out = {}
    for name, slices in by_name.items():
        dim = 0 if name.partition(".")[0] in columns else 1 if name in rows else None
        for rank in range(tp_to):
            key = name + (f"@mp{rank}" if tp_to > 1 else "")
            out[key] = {state: slices[0][state] if dim is None else
                        torch.cat([s[state] for s in slices], dim=dim).chunk(tp_to, dim=dim)[rank].contiguous()
                        for state in slices[0]}
    return out


def differences(got: dict, want: dict) -> list[str]:
    import torch
    problems = [f"{name}: missing" for name in want if name not in got]
    problems += [f"{name}: extra" for name in got if name not in want]
    for name in sorted(set(got) & set(want)):
        for key, value in want[name].items():
            if not torch.equal(got[name][key], value):
                problems.append(f"{name}.{key}: differs")
    return problems


def model_files_and_bytes(folder: str) -> tuple[int, int]:
    from make_checkpoint import tree_bytes
    return sum(len(names) for _, _, names in os.walk(folder)), tree_bytes(folder)


def bench(args) -> None:
    from run import log, machine_info, run_universal_conversion
    scratch = os.path.abspath(args.scratch)
    shutil.rmtree(scratch, ignore_errors=True)
    os.makedirs(scratch)
    spp, sdp = args.source
    tpp, tdp = args.target
    stp, ttp = args.tp_from, args.tp_to or args.tp_from
    axis = ["--model-axis"] if stp > 1 else []
    shape = ["--dim", args.dim, "--hidden", args.hidden, "--pairs", args.pairs, *axis]
    layers = 3 * args.pairs + 3
    src, dst, uni = (os.path.join(scratch, n) for n in ("src", "reshard", "universal"))
    results = {"started": datetime.datetime.now(datetime.UTC), "machine": machine_info(),
               "model": {"dim": args.dim, "hidden": args.hidden, "pairs": args.pairs, "layers": layers,
                         "vocab": VOCAB, "precision": "fp32", "zero_stage": 1,
                         "megatron_model_axis": bool(axis)},
               "source": {"pp": spp, "tp": stp, "dp": sdp}, "target": {"pp": tpp, "tp": ttp, "dp": tdp}, "workers": args.workers,
               "memory_budget": args.budget, "in_job_memory_budget": args.in_job_budget or args.budget}
    results["load_average_at_start"] = os.getloadavg()  # a shared 2-core machine: say how busy it was
    log(f"training the source at (pp, tp, dp) = ({spp}, {stp}, {sdp}) ...")
    results["train"] = watched(torchrun(spp * stp * sdp, "train", "--pp", spp, "--tp", stp, *shape, "--save", src,
                                        "--dump", os.path.join(scratch, "truth")), "train", scratch)
    results["source_files"], results["source_bytes"] = model_files_and_bytes(src)
    log(f"  source: {results['source_bytes'] / 1e6:.1f} MB in {results['source_files']} files")

    log("reshard ...")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.workers}",
               "-m", "reshard", src, dst, "--target-dp", tdp, "--target-pp", tpp, "--pipeline-layers", layers,
               "--pipeline-tied", f"embed:0,{layers - 1}", "--memory-budget", args.budget,
               "--ignore-batch-config",  # the harness fixes train_batch_size for the source's dp
               *(["--target-tp", ttp] if axis else [])]
    results["reshard"] = watched(command, "reshard", scratch)
    run = results["reshard"]
    log(f"  {run['wall_seconds']:.2f} s ({run['cpu_user_seconds'] + run['cpu_system_seconds']:.2f} CPU s), "
        f"peak tree RSS {run['peak_tree_rss_bytes'] / 1e6:.0f} MB, "
        f"largest process {run['peak_process_rss_bytes'] / 1e6:.0f} MB")
    with open(os.path.join(scratch, "reshard.log")) as fd:  # its summary: per-worker VmHWM, the estimate note
        run["summary"] = fd.read()[-4000:]
    results["reshard_load"] = watched(torchrun(tpp * ttp * tdp, "load", "--pp", tpp, "--tp", ttp, *shape, "--load", dst, "--dump",
                                               os.path.join(scratch, "dump-reshard")), "reshard load", scratch)

    log("ds_to_universal ...")
    results["ds_to_universal"] = run_universal_conversion(os.path.join(src, TAG), uni, TAG, args.workers, scratch)
    log(f"  {results['ds_to_universal']['wall_seconds']:.2f} s, peak tree RSS "
        f"{results['ds_to_universal']['peak_tree_rss_bytes'] / 1e6:.0f} MB")
    results["universal_load"] = watched(torchrun(tpp * ttp * tdp, "load", "--pp", tpp, "--tp", ttp, *shape, "--load", uni, "--universal",
                                                 "--dump", os.path.join(scratch, "dump-universal")),
                                        "universal load", scratch)

    log("reshard in-job (reshard.deepspeed.load_checkpoint on the source) ...")
    results["in_job_load"] = watched(torchrun(tpp * ttp * tdp, "load", "--pp", tpp, "--tp", ttp, *shape, "--load", src, "--in-job",
                                              "--budget", args.in_job_budget or args.budget,
                                              "--dump", os.path.join(scratch, "dump-in-job")),
                                     "in-job load", scratch)

    truth, _ = read_dumps(os.path.join(scratch, "truth"))
    whole = joined_truth(truth, args.pairs, stp, 1)  # the model's own count, whatever the tp
    results["parameters"] = len(whole)
    results["elements"] = sum(v["fp32"].numel() for v in whole.values())
    truth = joined_truth(truth, args.pairs, stp, ttp)
    ours, our_extra = read_dumps(os.path.join(scratch, "dump-reshard"))
    theirs, their_extra = read_dumps(os.path.join(scratch, "dump-universal"))
    in_job, in_job_extra = read_dumps(os.path.join(scratch, "dump-in-job"))
    results["in_job_load"]["load_seconds"] = max(e["load_seconds"] for e in in_job_extra)
    results["in_job_load"]["max_rank_ru_maxrss_bytes"] = max(e["ru_maxrss_bytes"] for e in in_job_extra)
    results["in_job_vs_universal"] = differences(in_job, theirs)
    results["reshard_load"]["load_seconds"] = max(e["load_seconds"] for e in our_extra)
    results["universal_load"]["load_seconds"] = max(e["load_seconds"] for e in their_extra)
    results["reshard_vs_universal"] = differences(ours, theirs)
    results["reshard_vs_source"] = differences(ours, truth)
    results["universal_vs_source"] = differences(theirs, truth)
    results["equal"] = not (results["reshard_vs_universal"] or results["reshard_vs_source"]
                            or results["in_job_vs_universal"])

    ours_total = results["reshard"]["wall_seconds"] + results["reshard_load"]["load_seconds"]
    theirs_total = results["ds_to_universal"]["wall_seconds"] + results["universal_load"]["load_seconds"]
    results["totals"] = {"reshard_plus_native_load_seconds": ours_total,
                         "ds_to_universal_plus_universal_load_seconds": theirs_total,
                         "ratio": theirs_total / ours_total}
    print(f"\npipeline (pp, tp, dp) ({spp},{stp},{sdp}) -> ({tpp},{ttp},{tdp}), {results['elements'] / 1e6:.1f}M fp32 elements, "
          f"{results['source_bytes'] / 1e6:.0f} MB source, W={args.workers}")
    print(f"{'path':38} {'convert s':>10} {'load s':>8} {'total s':>8} {'peak tree RSS':>14} {'convert CPU s':>14}")
    for label, convert, load in (("reshard + native load", "reshard", "reshard_load"),
                                 ("ds_to_universal + load_universal", "ds_to_universal", "universal_load")):
        c, ld = results[convert]["wall_seconds"], results[load]["load_seconds"]
        cpu = results[convert].get("cpu_user_seconds", 0.0) + results[convert].get("cpu_system_seconds", 0.0)
        print(f"{label:38} {c:10.2f} {ld:8.2f} {c + ld:8.2f} {results[convert]['peak_tree_rss_bytes'] / 1e6:11.0f} MB"
              f" {cpu:14.2f}")
    in_job_run = results["in_job_load"]
    print(f"{'reshard in-job (load_checkpoint on SRC)':38} {'':>10} {in_job_run['load_seconds']:8.2f} "
          f"{in_job_run['load_seconds']:8.2f} {in_job_run['peak_tree_rss_bytes'] / 1e6:11.0f} MB"
          f"  (in-job equal to universal: {not results['in_job_vs_universal']})")
    print(f"ratio (universal / reshard): {results['totals']['ratio']:.2f}x; every fp32 master and Adam moment equal "
          f"to the universal load's: {not results['reshard_vs_universal']} "
          f"({len(results['reshard_vs_universal'])} differ), to the source's: {not results['reshard_vs_source']}")
    results["load_average_at_end"] = os.getloadavg()
    print(f"load average (1, 5, 15 min) at start {results['load_average_at_start']}, at end "
          f"{results['load_average_at_end']}")
    folder = os.path.join(HERE, "results")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"pipeline-{results['started']:%Y%m%d-%H%M%S}.json")
    with open(path, "w") as fd:
        json.dump(results, fd, indent=1, default=str)
    print(f"wrote {path}")
    if not args.keep:
        shutil.rmtree(scratch, ignore_errors=True)
    if not results["equal"]:
        raise SystemExit(1)


def pair(text: str) -> tuple[int, int]:
    pp, dp = text.split(",")
    return int(pp), int(dp)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", nargs="?", default="bench", choices=["bench", "train", "load"])
    parser.add_argument("--dim", type=int, default=640)
    parser.add_argument("--hidden", type=int, help="default 1279, odd, so ZeRO-1 pads; with --tp-from > 1 "
                                                   "1280, a multiple of both tps")
    parser.add_argument("--pairs", type=int, default=6)
    parser.add_argument("--source", type=pair, default=(2, 1), help="pp,dp")
    parser.add_argument("--target", type=pair, default=(1, 2), help="pp,dp")
    parser.add_argument("--tp-from", type=int, default=1,
                        help="> 1: the source has a model axis of this size (Megatron-style pairs, the patterns)")
    parser.add_argument("--tp-to", type=int, help="the target's model axis (reshard --target-tp); default --tp-from")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--budget", default="1G", help="reshard's --memory-budget")
    parser.add_argument("--in-job-budget", help="the in-job load's memory_budget (default --budget): a pipeline "
                                                "in-job load still takes whole tensors and refuses a budget below them")
    parser.add_argument("--scratch", default=os.path.join(HERE, ".cache", "pipeline"))
    parser.add_argument("--keep", action="store_true", help="keep the scratch directory")
    parser.add_argument("--pp", type=int)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--model-axis", action="store_true", help="worker: the Megatron-style model")
    parser.add_argument("--save")
    parser.add_argument("--load")
    parser.add_argument("--dump")
    parser.add_argument("--universal", action="store_true")
    parser.add_argument("--in-job", action="store_true")
    parser.add_argument("--steps", type=int, default=2, help="train: training steps before the save (0: none, "
                                                             "the moments filled in place, fill_moments)")
    parser.add_argument("--node-local", action="store_true", help="train: use_node_local_storage (a per-node --save)")
    args = parser.parse_args()
    if args.mode == "bench" and args.tp_to and args.tp_to != args.tp_from and args.tp_from == 1:
        parser.error("--tp-to needs a source with a model axis (--tp-from > 1)")
    if args.hidden is None:
        args.hidden = 1280 if args.tp_from > 1 else 1279
    if args.mode == "bench" and args.tp_from > 1 and args.hidden % (args.tp_from * (args.tp_to or 1)):
        parser.error(f"--hidden {args.hidden} must cut evenly for --tp-from and --tp-to")
    bench(args) if args.mode == "bench" else worker(args)


if __name__ == "__main__":
    main()
