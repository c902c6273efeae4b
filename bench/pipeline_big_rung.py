"""The pipeline ladder's 10 GB rung: a real DeepSpeed PipelineModule save of ~10 GB, pp 2 -> 1, reshard
--workers against ds_to_universal, judged against DeepSpeed's own universal files.

    nice -n 10 python bench/pipeline_big_rung.py                       # dim 4096, 19 pairs: ~10.3 GB
    nice -n 10 python bench/pipeline_big_rung.py --dim 512 --pairs 2    # a smoke test of the bench (~80 MB)
    nice -n 10 python bench/pipeline_big_rung.py --no-universal         # reshard alone

The save is DeepSpeed's own: pipeline_bench.py's model (a tied embedding/head, Linear pairs dim x dim-1
around a GELU, a LayerNorm; ZeRO-1 fp32, Adam) built by `deepspeed.initialize` on 2 CPU ranks at (pp, dp)
= (2, 1) and saved by `engine.save_checkpoint`, without a training step (`pipeline_bench.py train
--steps 0`): a backward at this size would need ~24 bytes per element at once on both ranks, ~15 GB on
a 24 GB machine shared with others. torch's Adam makes its moments at its first step, so each rank in turn
runs the optimizer's own step on zero gradients (masters unchanged, moments zero), and the moments are
then filled in place with distinct values, by parameter name (pipeline_bench.fill_moments), so a misplaced
slice of a moment cannot pass unseen. Each Linear weight
(dim x dim-1 fp32, 67 MB at dim 4096) is larger than the 32M budget: reshard must split it over rounds.

Then, each a watched process tree, page cache warm:

    reshard       python -m reshard SRC DST --workers W --target-pp 1 --target-dp 2 --pipeline-layers N
                  --pipeline-tied embed:0,N-1 --memory-budget B
    universal     ds_to_universal.py (W extract and merge workers)

A DeepSpeed engine cannot load 10 GB at pp 1 here (it would hold ~20 bytes per element on one rank, and
`torch.load` the whole optimizer file beside it), so the judge is DeepSpeed's own conversion instead:
every fp32 master and Adam moment element of reshard's optimizer partitions (walked by their
param_slice_mappings, memory-mapped) and every tensor of its layer files must equal ds_to_universal's
per-parameter files, or the bench exits 1. That the output loads in DeepSpeed is what the 0.6 GB and 2 GB
rungs (bench/pipeline_ladder.py) and the e2e tests show for this model at smaller sizes.
Prints reshard's and ds_to_universal's wall, bytes read against source bytes, peak private memory per
worker against budget + 300 MB, peak tree RSS and disk. Writes bench/results/pipeline-big-rung-<ts>.json.
"""
from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import re
import shutil
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, REPO)

LAYER_FILE_RE = re.compile(r"layer_(\d+)-model_states\.pt$")


def universal_tensor(root: str, name: str, state: str):
    import torch
    return torch.load(os.path.join(root, "zero", name, f"{state}.pt"), mmap=True, weights_only=False)["param"]


def judge(dst_tag: str, uni_tag: str, tied_name: str, layers: int) -> dict:
    """Every element of reshard's output against ds_to_universal's files: the ZeRO-1 partitions walked
    in file order (a parameter's fragments follow each other across the dp ranks' partitions), and the
    layer files by their module names (the tied embedding at its first and last layer)."""
    import torch
    problems, compared, consumed = [], 0, {}
    names = sorted(glob.glob(os.path.join(dst_tag, "zero_pp_rank_*_mp_rank_00_optim_states.pt")),
                   key=lambda p: int(re.search(r"zero_pp_rank_(\d+)_", p)[1]))
    for path in names:
        osd = torch.load(path, mmap=True, weights_only=False)["optimizer_state_dict"]
        flats = {"fp32": osd["single_partition_of_fp32_groups"][0]}
        state = osd["base_optimizer_state"]["state"]
        flats.update({k: next(iter(state.values()))[k] for k in ("exp_avg", "exp_avg_sq")})
        for name, fragment in osd["param_slice_mappings"][0].items():
            begin = consumed.get(name, 0)
            for kind, flat in flats.items():
                want = universal_tensor(uni_tag, name, kind).reshape(-1)
                got = flat.narrow(0, fragment.start, fragment.numel)
                if not torch.equal(got, want.narrow(0, begin, fragment.numel)):
                    problems.append(f"{os.path.basename(path)} {name} {kind} [{begin}:+{fragment.numel}] differs")
                compared += fragment.numel
            consumed[name] = begin + fragment.numel
    for name, count in consumed.items():
        if count != universal_tensor(uni_tag, name, "fp32").numel():
            problems.append(f"{name}: {count} elements in the partitions, not the whole parameter")
    for path in sorted(glob.glob(os.path.join(dst_tag, "layer_*-model_states.pt"))):
        index = int(LAYER_FILE_RE.search(path)[1])
        for key, tensor in torch.load(path, mmap=True, weights_only=False).items():
            name = tied_name if index in (0, layers - 1) else f"{index}.{key}"
            if not torch.equal(tensor, universal_tensor(uni_tag, name, "fp32")):
                problems.append(f"{os.path.basename(path)} {key} differs from {name}'s fp32")
            compared += tensor.numel()
    return {"elements_compared": compared, "parameters": len(consumed), "problems": problems}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=4096)
    parser.add_argument("--pairs", type=int, default=19)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--budget", default="32M")
    parser.add_argument("--no-universal", action="store_true", help="reshard's figures alone")
    parser.add_argument("--scratch", default="/tmp/bigbench/big-rung")
    parser.add_argument("--keep", action="store_true")
    args = parser.parse_args()
    from make_checkpoint import tree_bytes
    from pipeline_bench import TAG, torchrun, watched
    from pipeline_ladder import HEADROOM, parse_budget, summary_figures
    from run import log, machine_info, run_universal_conversion
    dim, hidden, pairs = args.dim, args.dim - 1, args.pairs
    layers = 3 * pairs + 3
    scratch = os.path.abspath(args.scratch)
    shutil.rmtree(scratch, ignore_errors=True)
    os.makedirs(scratch)
    src, dst, uni = (os.path.join(scratch, n) for n in ("src", "reshard", "universal"))
    results = {"started": datetime.datetime.now(datetime.UTC), "machine": machine_info(), "dim": dim,
               "hidden": hidden, "pairs": pairs, "layers": layers, "source": {"pp": 2, "dp": 1},
               "target": {"pp": 1, "dp": 2}, "workers": args.workers, "memory_budget": args.budget,
               "nice": os.nice(0), "load_average_at_start": os.getloadavg()}
    log(f"saving the source at (pp, dp) = (2, 1), dim {dim}, {pairs} pairs, no training step ...")
    results["save"] = watched(torchrun(2, "train", "--pp", 2, "--tp", 1, "--dim", dim, "--hidden", hidden,
                                       "--pairs", pairs, "--steps", 0, "--save", src), "save", scratch)
    results["source_bytes"] = tree_bytes(src)
    log(f"  source {results['source_bytes'] / 1e9:.2f} GB in {results['save']['wall_seconds']:.0f} s")

    log("reshard ...")
    record = os.path.join(scratch, "reshard.json")
    command = [sys.executable, "-m", "reshard", src, dst, "--workers", args.workers, "--target-pp", 1,
               "--target-dp", 2, "--pipeline-layers", layers, "--pipeline-tied", f"embed:0,{layers - 1}",
               "--memory-budget", args.budget, "--ignore-batch-config", "--result-json", record]
    run = results["reshard"] = watched(command, "reshard", scratch, record)
    with open(os.path.join(scratch, "reshard.log")) as fd:
        text = fd.read()
    run["summary"] = text[text.find("reshard done"):] if "reshard done" in text else text[-4000:]
    run.update(summary_figures(text))
    with open(record) as fd:
        checkpoint = json.load(fd)["checkpoints"][0]
    run["read_bytes"], run["rounds"] = checkpoint["bytes_read"], checkpoint["rounds"]
    log(f"  {run['wall_seconds']:.1f} s, {run['rounds']} rounds")

    if not args.no_universal:
        log("ds_to_universal ...")
        try:
            results["ds_to_universal"] = run_universal_conversion(os.path.join(src, TAG), uni, TAG, args.workers,
                                                                  scratch)
            log(f"  {results['ds_to_universal']['wall_seconds']:.1f} s")
        except RuntimeError as error:  # said with its error, reshard's figures reported alone
            results["ds_to_universal_error"] = str(error)[-3000:]
            log(f"  ds_to_universal failed: {str(error)[-600:]}")
    if "ds_to_universal" in results:
        shutil.rmtree(src)  # the judge reads only the two outputs: free the disk and the page cache
        log("judging reshard's output against ds_to_universal's files, element by element ...")
        results["judge"] = judge(os.path.join(dst, TAG), os.path.join(uni, TAG), "tied_modules.embed.weight", layers)
        results["equal"] = not results["judge"]["problems"]
        log(f"  {results['judge']['elements_compared']:,} elements compared, "
            f"{len(results['judge']['problems'])} problems")
    results["load_average_at_end"] = os.getloadavg()
    report(results, parse_budget(args.budget) + HEADROOM)
    path = os.path.join(HERE, "results", f"pipeline-big-rung-{results['started']:%Y%m%d-%H%M%S}.json")
    with open(path, "w") as fd:
        json.dump(results, fd, indent=1, default=str)
    print(f"wrote {path}")
    if not args.keep:
        shutil.rmtree(scratch, ignore_errors=True)
    if results.get("equal") is False:
        raise SystemExit(1)


def report(results: dict, goal: int) -> None:
    run, source = results["reshard"], results["source_bytes"]
    print(f"\n== pipeline big rung: (pp, dp) (2, 1) -> (1, 2), dim {results['dim']}, {results['pairs']} pairs, source "
          f"{source:,} bytes, W = {results['workers']}, --memory-budget {results['memory_budget']}, "
          f"nice {results['nice']} ==")
    anon = "/".join(f"{a / 1e6:.0f}" for a in run["worker_peak_anon_bytes"]) or "?"
    print(f"reshard --workers     {run['wall_seconds']:7.1f} s  {run['rounds']} rounds, read {run['read_bytes']:,} "
          f"({run['read_bytes'] / source:.3f}x source), worker peak private {anon} MB (goal <= {goal / 1e6:.0f}), "
          f"peak tree RSS {run['peak_tree_rss_bytes'] / 1e6:.0f} MB, disk {run['peak_disk_bytes'] / 1e9:.2f} GB")
    if "ds_to_universal" in results:
        uni = results["ds_to_universal"]
        print(f"ds_to_universal       {uni['wall_seconds']:7.1f} s  peak tree RSS {uni['peak_tree_rss_bytes'] / 1e6:.0f} MB, "
              f"largest process {uni['peak_process_rss_bytes'] / 1e6:.0f} MB, disk {uni['peak_disk_bytes'] / 1e9:.2f} GB")
        print(f"ratio (ds_to_universal / reshard, conversion only): {uni['wall_seconds'] / run['wall_seconds']:.2f}x")
        judged = results["judge"]
        print(f"every element equal to ds_to_universal's: {'yes' if results['equal'] else 'NO'} "
              f"({judged['elements_compared']:,} elements of {judged['parameters']} parameters)")
    else:
        print(f"ds_to_universal: not run{': ' + results['ds_to_universal_error'][-300:] if 'ds_to_universal_error' in results else ''}")
    print(f"load average at start {results['load_average_at_start']}, at end {results['load_average_at_end']}")


if __name__ == "__main__":
    main()
