"""Node-local pipeline bytes: what crosses between 2 simulated nodes for a pp change, beside the plan's figure.

    python bench/pipeline_node_local.py                  # (pp, dp) (2, 2) -> (1, 4), 2 nodes x 2 ranks
    python bench/pipeline_node_local.py --keep --scratch /tmp/nl
    python bench/pipeline_node_local.py --reuse --keep --scratch /tmp/nl   # again on the kept sources

Trains tests/pipeline_run.py's tied PipelineModule (fp32, ZeRO-1) at (pp, dp) = (2, 2) with
`"checkpoint": {"use_node_local_storage": true}` on 2 torchrun agents playing 2 nodes of 2 ranks, each
saving into its own directory (as tests/test_node_local_pipeline.py does), then runs

    torchrun --nnodes 2 ... -m reshard node{k}/src node{k}/dst --node-local --target-ranks-per-node 2
        --target-dp 4 --target-pp 1 --pipeline-layers 7 --pipeline-tied embed:0,6 --result-json ...

and reads from its result file the bytes that crossed between the nodes (`bytes_between_nodes`, counted
by the transport) and the job's own plan figure (`plan_bytes_between_nodes`). Beside them it prints the
figure of the main road's plan for the same job: the source inspected as the main road inspects a
pipeline (`inspect_pipeline_columns` on the two nodes' files gathered, `collective_job.pipeline_stage_change`
for the target stages), planned by `plan_reshard` with node-local ownership (`node_local.node_local_ownership`:
each source rank read on a node that holds its files, target rank r written on node r // 2), and
`ReshardPlan.bytes_between_nodes`: the optimizer bytes the collective job's exchange would send between the
nodes (it carries the layer files whole, outside its plan). The job (reshard.jobs.node_local_columns, on the
plan since issue 37's node-local branch; the whole-file job it replaced sent every pipeline file a node
lacks) sends the optimizer exchange and the layer files' tensors a node's ranks load, both as pieces of its
plan (no whole-file move beside the rounds since issue 37's nltp branch), so the measured figure equals the
job's own plan figure. The source bytes on each node are printed
too. Writes bench/results/pipeline-node-local-<timestamp>.json.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import shutil
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "tests"))

NODES, PER_NODE = 2, 2


@dataclasses.dataclass(frozen=True)
class Model:
    """Which trainer makes the node-local save, its layer count and the tag it saves."""

    harness: str
    train_args: tuple
    layers: int
    tag: str

    @property
    def layer_options(self) -> tuple:
        return ("--pipeline-layers", str(self.layers), "--pipeline-tied", f"embed:0,{self.layers - 1}")


def model_of(args) -> Model:
    """tests/pipeline_run.py's tiny tied model (as tests/test_node_local_pipeline.py trains it), or with
    --dim, bench/pipeline_bench.py's (a tied embedding/head and --pairs Linear pairs)."""
    if args.dim is None:
        return Model("tests.pipeline_run", ("--variant", "fp32"), 7, "step3")
    shape = ("--dim", args.dim, "--hidden", args.hidden or args.dim - 1, "--pairs", args.pairs)
    return Model("bench.pipeline_bench", (*shape, "--tp", 1), 3 * args.pairs + 3, "step2")


def tree_bytes(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(folder) for f in files)


def main_road_plan_bytes(root: str, model: Model, target_pp: int, target_dp: int, budget: int) -> dict:
    """The main road's plan for the job on the gathered source, with node-local ownership: the bytes
    its exchange sends between nodes (optimizer space only: the collective job carries the layer files whole,
    and no job moves model-states files between nodes)."""
    from reshard.jobs.collective_job import pipeline_stage_change
    from reshard.jobs.node_local import node_local_ownership
    from reshard.jobs.options import ReshardOptions
    from reshard.formats.deepspeed_files.deepspeed_inspect import inspect_pipeline_columns
    from reshard.planning.checkpoint_plan import plan_reshard
    gathered = os.path.join(root, "gathered")
    shutil.rmtree(gathered, ignore_errors=True)
    shutil.copytree(os.path.join(root, "node0", "src"), gathered)
    for name in os.listdir(os.path.join(root, "node1", "src", model.tag)):
        shutil.copy2(os.path.join(root, "node1", "src", model.tag, name), os.path.join(gathered, model.tag))
    source = inspect_pipeline_columns(gathered, model.tag, read_tensors=False)
    opts = ReshardOptions(source=gathered, destination=os.path.join(root, "unused"), target_dp=target_dp,
                          target_pp=target_pp, pipeline_layers=model.layers, pipeline_tied=f"embed:0,{model.layers - 1}",
                          ignore_batch_config=True)
    if target_pp != source.spec.topology.pp:
        source, target, _ = pipeline_stage_change(opts, source)
        topology = target.topology
    else:
        topology = dataclasses.replace(source.spec.topology, dp=target_dp)
    seen = [frozenset(os.listdir(os.path.join(root, f"node{w // PER_NODE}", "src", model.tag)))
            for w in range(NODES * PER_NODE)]
    worker_nodes = [w // PER_NODE for w in range(NODES * PER_NODE)]
    needed = [[os.path.basename(source.optim_path(r))] for r in range(source.spec.topology.world_size)]
    ownership = node_local_ownership(needed, seen, worker_nodes, topology.world_size, PER_NODE, source.tag_dir)
    plan = plan_reshard(source.spec, topology, NODES * PER_NODE, budget, ownership=ownership)
    shutil.rmtree(gathered, ignore_errors=True)
    return {"plan_bytes_between_nodes": plan.bytes_between_nodes(worker_nodes),
            "source_optimizer_bytes": sum(p.numel for p in source.spec.params) * sum(s.itemsize for s in source.spec.streams),
            "readers": [ownership.reader(r) for r in range(ownership.source_ranks)],
            "writers": [ownership.writer(r) for r in range(ownership.target_ranks)], "rounds": plan.rounds}


def main() -> None:
    from reshard_proof.launch import run_torchrun_nodes
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target-pp", type=int, default=1)
    parser.add_argument("--target-dp", type=int, default=4)
    parser.add_argument("--budget", default="1G")
    parser.add_argument("--dim", type=int, help="train bench/pipeline_bench.py's model at this width instead of the "
                                                "tests' tiny one (e.g. --dim 1024 --pairs 6: ~200 MB)")
    parser.add_argument("--hidden", type=int, help="with --dim (default dim - 1)")
    parser.add_argument("--pairs", type=int, default=6, help="with --dim")
    parser.add_argument("--scratch", default=os.path.join(HERE, ".cache", "pipeline-node-local"))
    parser.add_argument("--keep", action="store_true", help="keep the scratch directory (the sources, the outputs)")
    parser.add_argument("--reuse", action="store_true", help="reuse the sources a --keep run left in --scratch")
    args = parser.parse_args()
    from reshard.jobs.options import parse_size
    root = os.path.abspath(args.scratch)
    model = model_of(args)
    if not args.reuse:
        shutil.rmtree(root, ignore_errors=True)
        os.makedirs(root)
    results = {"started": datetime.datetime.now(datetime.UTC), "load_average_at_start": os.getloadavg(),
               "nodes": NODES, "ranks_per_node": PER_NODE, "source": {"pp": 2, "dp": 2},
               "target": {"pp": args.target_pp, "dp": args.target_dp}, "model": dataclasses.asdict(model)}
    started = time.perf_counter()
    if not args.reuse:
        truth = ("--truth", os.path.join(root, "truth")) if model.harness == "tests.pipeline_run" else \
            ("--dump", os.path.join(root, "truth"))
        run_torchrun_nodes(model.harness, NODES, PER_NODE, lambda k: [
            "train", "--pp", 2, *model.train_args, "--node-local", "--save", os.path.join(root, f"node{k}", "src"),
            *truth], timeout=700)
    for k in range(NODES):
        shutil.rmtree(os.path.join(root, f"node{k}", "dst"), ignore_errors=True)
    results["train_seconds"] = time.perf_counter() - started
    results["source_bytes_per_node"] = [tree_bytes(os.path.join(root, f"node{k}", "src")) for k in range(NODES)]
    results["source_files_per_node"] = {k: {name: os.path.getsize(os.path.join(root, f"node{k}", "src", model.tag, name))
                                            for name in sorted(os.listdir(os.path.join(root, f"node{k}", "src", model.tag)))}
                                        for k in range(NODES)}
    started = time.perf_counter()
    run_torchrun_nodes("reshard", NODES, PER_NODE, lambda k: [
        os.path.join(root, f"node{k}", "src"), os.path.join(root, f"node{k}", "dst"), "--node-local",
        "--target-ranks-per-node", PER_NODE, "--target-dp", args.target_dp, "--target-pp", args.target_pp, *model.layer_options,
        "--memory-budget", args.budget, "--ignore-batch-config", "--quiet",
        "--result-json", os.path.join(root, f"result-node{k}.json")],
        expect_files=[os.path.join(root, f"node{k}", "dst", "latest") for k in range(NODES)], timeout=600)
    results["reshard_seconds"] = time.perf_counter() - started
    with open(os.path.join(root, "result-node0.json")) as fd:  # global worker 0 (node 0) writes it
        record = json.load(fd)["checkpoints"][0]  # one save directory, one tag
    results["job"] = record
    results["output_bytes_per_node"] = [tree_bytes(os.path.join(root, f"node{k}", "dst")) for k in range(NODES)]
    results["main_road_plan"] = main_road_plan_bytes(root, model, args.target_pp, args.target_dp, parse_size(args.budget))
    crossed, planned = record["bytes_between_nodes"], record["plan_bytes_between_nodes"]
    road = results["main_road_plan"]["plan_bytes_between_nodes"]
    held = results["source_files_per_node"]
    lacking = [{name: size for other in range(NODES) if other != k for name, size in held[other].items()
                if name not in held[k]} for k in range(NODES)]  # a file on both nodes counted once per node lacking it
    results["lacking_bytes"] = {"optimizer_files": sum(size for node in lacking for name, size in node.items()
                                                       if name.endswith("optim_states.pt")),
                                "layer_and_model_files": sum(size for node in lacking for name, size in node.items()
                                                             if not name.endswith("optim_states.pt"))}
    results["load_average_at_end"] = os.getloadavg()
    print(f"\nnode-local pipeline, (pp, dp) (2, 2) -> ({args.target_pp}, {args.target_dp}), {NODES} nodes x {PER_NODE} "
          f"ranks; source per node {results['source_bytes_per_node']} bytes")
    print(f"  crossed between nodes (measured)               {crossed:>12,} bytes")
    print(f"  the job's own plan figure (layer files in it)   {planned:>12,} bytes  (equal: {crossed == planned})")
    print(f"  every file a node lacks: optimizer files {results['lacking_bytes']['optimizer_files']:,} bytes, "
          f"layer and model-states files {results['lacking_bytes']['layer_and_model_files']:,} bytes")
    print(f"  collective plan (optimizer exchange only)       {road:>12,} bytes  "
          f"({'the same as crossed' if road == crossed else f'crossed is {crossed / road:.2f}x this' if road else 'none'})")
    folder = os.path.join(HERE, "results")
    path = os.path.join(folder, f"pipeline-node-local-{results['started']:%Y%m%d-%H%M%S}.json")
    with open(path, "w") as fd:
        json.dump(results, fd, indent=1, default=str)
    print(f"wrote {path}")
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
