"""Node-local PipelineModule saves (`--node-local` on a pipeline save): on the plan, loaded per node.

    python -m pytest -q tests/test_node_local_pipeline.py -m "not e2e"   # placement rules, seconds
    python -m pytest -q tests/test_node_local_pipeline.py                # trains on 2 nodes x 2 ranks (~4-7 min)

Two torchrun agents on one machine play two nodes with their own directories (as tests/test_node_local.py).
tests/pipeline_run.py trains the tied PipelineModule at (pp, dp) = (2, 2), ZeRO-1, with
`use_node_local_storage`, in fp32, then in the same launch in bf16 (BF16_Optimizer, `bf16_` optimizer
files) and in fp16 (dynamic loss scaling): each node then holds its stage's files only, and DeepSpeed's
own load of the fp32 save fails on every rank (its pipeline load counts the stage model-states files
in the directory). reshard, on the same two nodes, writes the fp32 save at (pp 1, dp 4) at 2 ranks per
node and (pp 2, dp 1) at 1 rank per node, and the bf16 and fp16 saves at (pp 1, dp 4), each through the
plan's rounds under a 1K budget (reshard.jobs.node_local_columns), byte for byte what the collective job
writes from the gathered files, the bytes between nodes what the plan says and fewer than every
pipeline file sent to every node; the fp32 save again with a split column (stage 1's model-states file moved
to node 0: no worker sees it with its dp rank 0 optimizer file) at (pp 1, dp 4), its model-states tree
gathered from where it is, the same bytes; a tp change refused by name; each target
rank loads its own node's directory with plain `engine.load_checkpoint` (the half-precision targets in
the fp32 (1, 4) launch, `check --judge`), every fp32 master and Adam moment compared by name with the
source engine's, the eval loss, the counters, the LR and (fp16) the loss scaler's state, and one more
`train_batch` runs.
"""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from reshard.errors import CheckpointError
from reshard.jobs.node_local import WorkerView
from reshard.jobs.node_local_columns import node_layer_files
from reshard.jobs.whole_file_moves import fetch_pieces, fetch_plan
from reshard.topology import Topology

NODES = 2
HARNESS = "tests.pipeline_run"
LAYERS = ("--pipeline-layers", "7", "--pipeline-tied", "embed:0,6")  # tests/pipeline_run.py layer_specs


def optim(dp: int, stage: int, precision: str = "fp32") -> str:
    # engine.py _get_zero_ckpt_name: the bf16_ prefix iff bf16 is enabled (BF16_Optimizer's files)
    return f"{'bf16_' if precision == 'bf16' else ''}zero_pp_rank_{dp}_mp_rank_{stage:02d}_optim_states.pt"


def model(stage: int) -> str:
    return f"mp_rank_{stage:02d}_model_states.pt"


def layer(index: int) -> str:
    return f"layer_{index:02d}-model_states.pt"


# ---- placement (pure) ----

def test_target_ranks_are_numbered_as_deepspeeds_pipeline_topology_numbers_them():
    from deepspeed.runtime.pipe.topology import PipeDataParallelTopology, PipeModelDataParallelTopology
    plain, sliced = PipeDataParallelTopology(num_pp=3, num_dp=2), PipeModelDataParallelTopology(3, 2, 4)
    for s in range(3):
        for d in range(2):
            assert Topology(dp=2, pp=3).rank_of(d, 0, s) == plain.get_rank(pipe=s, data=d)
        for d in range(4):
            for m in range(2):
                assert Topology(dp=4, tp=2, pp=3).rank_of(d, m, s) == sliced.get_rank(pipe=s, data=d, model=m)


def test_each_lacking_file_is_sent_once_per_node_by_a_worker_that_sees_it():
    node0 = frozenset({layer(0), model(0), optim(0, 0), optim(1, 0)})
    node1 = frozenset({layer(1), model(1), optim(0, 1), optim(1, 1)})
    views = [WorkerView(0, "step3", node0), WorkerView(0, "step3", node0), WorkerView(1, None, node1),
             WorkerView(1, None, node1)]
    sizes = {name: 10 * (i + 1) for i, name in enumerate(sorted(node0 | node1))}
    plan = fetch_plan({0: node0 | node1, 1: node0 | node1}, views, sizes, "/ckpt/step3")
    assert sorted((t.name, t.receiver) for t in plan if t.receiver in (0, 1)) == \
        sorted((name, r) for name, r in zip(sorted(node1), (0, 1, 0, 1)))  # node 1's files, to node 0's workers
    assert all(views[t.sender].node != views[t.receiver].node and t.name in views[t.sender].files for t in plan)
    assert len(plan) == 8 and {t.sender for t in plan} == {0, 1, 2, 3}  # the senders share the bytes
    with pytest.raises(CheckpointError, match=r"/ckpt/step3/layer_02-model_states\.pt: is on no node"):
        fetch_plan({0: {layer(2)}}, views, {layer(2): 1}, "/ckpt/step3")
    pieces = fetch_pieces(plan, 4, 16)
    for sender, own in enumerate(pieces):
        assert all(plan[i].sender == sender and 0 < length <= 16 for i, _, length in own)
    assert sum(length for own in pieces for _, _, length in own) == sum(t.size for t in plan)


def test_a_column_is_inspected_where_its_first_optimizer_file_is_its_model_states_tree_read_where_it_is():
    from reshard.jobs.node_local_columns import column_inspectors, model_readers
    from reshard.jobs.whole_file_moves import bytes_between_nodes
    node0 = frozenset({layer(0), model(0), optim(0, 0), optim(1, 0)})
    node1 = frozenset({layer(1), model(1), optim(0, 1), optim(1, 1)})
    views = [WorkerView(0, "step3", node0), WorkerView(0, "step3", node0), WorkerView(1, None, node1),
             WorkerView(1, None, node1)]
    assert column_inspectors(views) == [0, 2]  # the first worker that sees each column's files
    assert model_readers(views, [0, 2]) == {}
    # stage 1's model-states file where a node's local rank 0 ran it, its dp rank 0 optimizer file on the
    # other node (pp 2, dp 3 on 3 nodes x 2 ranks): that optimizer file's worker inspects the column, with
    # the model-states tree read by the worker that sees it
    split = [WorkerView(0, "step3", node0), WorkerView(1, None, frozenset({optim(0, 1)})),
             WorkerView(2, None, frozenset({model(1), optim(1, 1)}))]
    assert column_inspectors(split) == [0, 1] and model_readers(split, [0, 1]) == {1: 2}
    assert column_inspectors([split[0], split[2]]) is None  # stage 1's dp rank 0 optimizer file on no node
    plan = fetch_plan({0: {layer(0), layer(1)}, 1: {layer(0), layer(1)}}, views, {layer(0): 5, layer(1): 7},
                      "/ckpt/step3")
    assert bytes_between_nodes(plan, [0, 0, 1, 1]) == 12 and bytes_between_nodes(plan, [0, 0, 0, 0]) == 0


def test_a_tp_change_is_refused_by_name_from_the_names_alone():
    from reshard.errors import UnsupportedCheckpoint
    from reshard.jobs.node_local_columns import refuse_tp_change
    from reshard.jobs.options import ReshardOptions
    from reshard.jobs.runs import Unit
    node0 = frozenset({layer(0), model(0), optim(0, 0), optim(1, 0)})
    node1 = frozenset({layer(1), model(1), optim(0, 1), optim(1, 1)})
    views, unit = [WorkerView(0, "step3", node0), WorkerView(1, None, node1)], Unit("/ckpt", "step3", "/dst", "step3")

    def refuse(**options) -> None:
        refuse_tp_change(ReshardOptions(source="/ckpt", destination="/dst", **options), unit, views)
    refuse(target_dp=4)
    refuse(target_dp=4, target_pp=1, target_tp=1)  # tp 1 kept
    with pytest.raises(UnsupportedCheckpoint, match=r"^/ckpt/step3: --target-tp 2 \(the save has tp 1\) with "
                                                    r"--node-local: a node-local tp change .* is not served.*shared "
                                                    r"storage"):
        refuse(target_dp=4, target_tp=2)


def test_a_stage_model_states_file_on_no_node_is_named_from_the_names_alone():
    from reshard.formats.deepspeed_pipeline import check_stage_model_files
    with pytest.raises(CheckpointError, match=r"/ckpt/step3/mp_rank_01_model_states\.pt: is missing"):
        check_stage_model_files("/ckpt/step3", {0}, {0}, 2)


def test_a_node_gets_the_layer_files_of_its_stages():
    from reshard.formats.deepspeed_pipeline import PipelineSource
    source = PipelineSource("/ckpt", "step3", 2, 2, False, False, (), tuple(map(layer, range(6))), ())
    assert node_layer_files(source, (0, 3, 7), {1}) == [layer(3), layer(4), layer(5)]
    assert node_layer_files(source, (0, 3, 7), {0, 1}) == list(map(layer, range(6)))
    assert node_layer_files(source, None, {1}) == list(map(layer, range(6)))  # the assignment unknown: all


# ---- two nodes on this machine ----

PRECISIONS = ("fp32", "bf16", "fp16")


def source_name(precision: str) -> str:
    """Each node's directory of the save in `precision` (fp32: "src", as the tests below name it)."""
    return "src" if precision == "fp32" else f"src-{precision}"


@pytest.fixture(scope="module")
def node_local_pipeline(tmp_path_factory):
    """(root, truth): the tied model trained at (pp, dp) = (2, 2) on 2 nodes x 2 ranks with
    use_node_local_storage, in fp32 saved into root/node{k}/src (truth root/truth), then in the same
    launch (pipeline_run.py train --more) in bf16 and in fp16 into root/node{k}/src-bf16, src-fp16
    (truths root/truth-bf16, truth-fp16), each in an engine of its own; DeepSpeed's own load of the fp32
    save is tried in that launch too (root/own_load.json)."""
    from reshard_proof.launch import run_torchrun_nodes
    root = tmp_path_factory.mktemp("node-local-pipeline")
    run_torchrun_nodes(HARNESS, NODES, 2, lambda k: [
        "train", "--pp", 2, "--variant", "fp32", "--node-local", "--save", root / f"node{k}" / "src",
        "--truth", root / "truth", "--own-load-report", root / "own_load.json",
        *[arg for p in PRECISIONS[1:] for arg in ("--more", p, root / f"node{k}" / source_name(p), root / f"truth-{p}")]],
        expect_files=[root / "own_load.json", *[root / f"truth-{p}" / f"rank{r}.pt" for p in PRECISIONS[1:]
                                                for r in range(NODES * 2)]], timeout=700)
    return root, root / "truth"


def truth_of(root, precision: str):
    return root / ("truth" if precision == "fp32" else f"truth-{precision}")


def tag_files(directory) -> set[str]:
    return {p.name for p in (directory / "step3").iterdir()}


@pytest.mark.e2e
@pytest.mark.parametrize("precision", PRECISIONS)
def test_deepspeed_saves_each_stage_on_its_nodes(node_local_pipeline, precision):
    root, _ = node_local_pipeline
    src = source_name(precision)
    # runtime/pipe/module.py save_state_dict: a stage's layer files on its dp-rank-0 node; engine.py
    # _configure_checkpointing: mp_rank_XX where a node's local rank 0 runs stage XX; latest on node 0
    assert tag_files(root / "node0" / src) == {layer(0), layer(1), layer(2), model(0), optim(0, 0, precision),
                                               optim(1, 0, precision)}
    assert tag_files(root / "node1" / src) == {layer(3), layer(4), layer(5), model(1), optim(0, 1, precision),
                                               optim(1, 1, precision)}
    assert (root / "node0" / src / "latest").exists() and not (root / "node1" / src / "latest").exists()


@pytest.mark.e2e
def test_deepspeed_cannot_load_its_own_node_local_pipeline_save(node_local_pipeline):
    root, _ = node_local_pipeline
    errors = json.loads((root / "own_load.json").read_text())["errors"]
    assert errors == ["AssertionError: checkpoint count 1 is different from saved mp_world_size 2"] * 4, errors


def gathered(root, directory, src: str = "src"):
    """Both nodes' files of the save in each node's `src` in one save directory: what a job without
    --node-local reads."""
    shutil.copytree(root / "node0" / src, directory)
    for path in (root / "node1" / src / "step3").iterdir():
        shutil.copy2(path, directory / "step3")
    return directory


@pytest.mark.e2e
def test_each_node_gets_what_deepspeed_loads_there_and_it_loads(node_local_pipeline, tmp_path):
    from reshard_proof.launch import run_torchrun_nodes
    from trained import reshard_in_threads, tree_state
    root, truth = node_local_pipeline
    # a split column, from the fp32 save: stage 1's model-states file on node 0, its optimizer files on node 1,
    # so no worker sees it with its dp rank 0 optimizer file (DeepSpeed writes it where a node's local rank 0
    # runs the stage: at pp 2, dp 3 on 3 nodes x 2 ranks, node 1 runs stage 0's dp rank 2 and stage 1's dp
    # rank 0, and stage 1's model-states file lands on node 2)
    for k in range(NODES):
        if not (root / f"node{k}" / "split").exists():
            shutil.copytree(root / f"node{k}" / "src", root / f"node{k}" / "split")
    if (root / "node1" / "split" / "step3" / model(1)).exists():
        shutil.move(root / "node1" / "split" / "step3" / model(1), root / "node0" / "split" / "step3" / model(1))
    sources = [*(source_name(p) for p in PRECISIONS), "split"]
    before = {(k, src): tree_state(root / f"node{k}" / src) for k in range(NODES) for src in sources}
    # (precision, pp, dp, ranks per node, extra options); target rank r on node r // G. bf16 and fp16 at
    # the pp change only, judged in the pp-1 launch that runs anyway (pipeline_run.py check --judge), as the
    # split column's fp32 output is
    targets = {"pp1": ("fp32", 1, 4, 2, ("--target-pp", "1")), "pp2": ("fp32", 2, 1, 1, ()),
               "pp1-bf16": ("bf16", 1, 4, 2, ("--target-pp", "1")), "pp1-fp16": ("fp16", 1, 4, 2, ("--target-pp", "1")),
               "pp1-split": ("fp32", 1, 4, 2, ("--target-pp", "1"))}

    def expected(name, node):
        """Every stage's model-states file on every node, the node's ranks' optimizer files, its stages' layers."""
        precision, pp, _, _, _ = targets[name]
        if pp == 1:
            return {layer(i) for i in range(6)} | {model(0), optim(2 * node, 0, precision),
                                                   optim(2 * node + 1, 0, precision)}
        return {layer(i) for i in range(3 * node, 3 * node + 3)} | {model(0), model(1), optim(0, node, precision)}

    for name, (precision, pp, dp, per_node, extra) in targets.items():
        src = "split" if name.endswith("-split") else source_name(precision)
        result_path = tmp_path / f"result-{name}.json"
        # a budget far below a stage's optimizer bytes (each ~20 KiB): the plan's rounds, more than one
        run_torchrun_nodes("reshard", NODES, 2, lambda k: [
            root / f"node{k}" / src, root / f"node{k}" / name, "--node-local", "--target-ranks-per-node", per_node,
            "--target-dp", dp, *extra, *LAYERS, "--ignore-batch-config", "--quiet", "--memory-budget", "1K",
            "--result-json", result_path],
            expect_files=[root / f"node{k}" / name / "latest" for k in range(NODES)], timeout=300)
        (result,) = json.loads(result_path.read_text())["checkpoints"]
        assert result["rounds"] > 1 and result["nodes"] == NODES, result
        # what crossed between the nodes is what the plan says: its rounds' segments and the layer files
        # a node's target stages load but it lacks, sent whole
        assert result["bytes_between_nodes"] == result["plan_bytes_between_nodes"], result
        assert (result["plan_bytes_between_nodes"] > 0) == (pp == 1), result  # pp kept: each node holds its stage
        held = [{p.name: p.stat().st_size for p in (root / f"node{k}" / src / "step3").iterdir()} for k in range(NODES)]
        every_file_everywhere = sum(size for k in range(NODES) for other in range(NODES) if other != k
                                    for file, size in held[other].items() if file not in held[k])
        print(f"\n[node-local {name}] bytes between nodes: {result['bytes_between_nodes']} (plan "
              f"{result['plan_bytes_between_nodes']}); every pipeline file to every node: {every_file_everywhere}; "
              f"{result['rounds']} rounds")
        assert result["plan_bytes_between_nodes"] < every_file_everywhere, (result, every_file_everywhere)
        reference = tmp_path / f"reference-{name}"
        reshard_in_threads(gathered(root, tmp_path / f"merged-{name}", src), reference, dp, 2, target_pp=pp,
                           pipeline_layers=7, pipeline_tied="embed:0,6", ignore_batch_config=True)
        for node in range(NODES):
            out = root / f"node{node}" / name
            assert tag_files(out) == expected(name, node) | {"reshard_manifest.json"}, (name, node)
            assert (out / "latest").read_text() == "step3"  # on every node: each node's load reads it
            assert (out / "zero_to_fp32.py").exists() == (node == 0)  # as DeepSpeed: global rank 0's node
            assert not list(out.rglob(".reshard-*"))  # no fetch area, no staging left
            for file in expected(name, node):  # byte for byte what the job on the gathered files writes
                assert (out / "step3" / file).read_bytes() == (reference / "step3" / file).read_bytes(), (name, file)
            manifest = json.loads((out / "step3" / "reshard_manifest.json").read_text())
            assert manifest["target"]["node"] == node and manifest["target"]["ranks_per_node"] == per_node
            assert set(manifest["files"]) == expected(name, node)
    assert {(k, src): tree_state(root / f"node{k}" / src) for k in range(NODES) for src in sources} \
        == before  # the sources are only read
    # the fp16 truth holds the dynamic loss scaler's state, which check_one compares: it moved from a
    # fresh engine's (initial_scale_power 8, loss_scale_window 2), so a scaler not loaded is seen
    scaler = torch.load(truth_of(root, "fp16") / "rank0.pt", weights_only=True)["counters"]["loss_scaler"]
    assert scaler["cur_iter"] > 0 and scaler["cur_scale"] != 2.0 ** 8, scaler
    verdicts = {}
    for launch, (_, pp, dp, _, _) in [("pp1", targets["pp1"]), ("pp2", targets["pp2"])]:
        judged = [name for name in targets if name.startswith(launch + "-")]  # the half precisions at pp 1
        verdicts.update({name: tmp_path / f"verdict-{name}.json" for name in (launch, *judged)})
        run_torchrun_nodes(HARNESS, NODES, pp * dp // NODES, lambda k: [
            "check", "--pp", pp, "--variant", "fp32", "--load", root / f"node{k}" / launch, "--truth", truth,
            "--verdict", verdicts[launch],
            *[arg for name in judged for arg in ("--judge", targets[name][0], root / f"node{k}" / name,
                                                 truth_of(root, targets[name][0]), verdicts[name], "plain")]],
            expect_files=[verdicts[name] for name in (launch, *judged)], timeout=700)
    assert set(verdicts) == set(targets)
    for name, verdict in verdicts.items():
        record = json.loads(verdict.read_text())
        assert record["ok"], (name, record)
        _, pp, dp, _, _ = targets[name]
        assert len(record["ranks"]) == pp * dp and all(r["checked"] > 0 for r in record["ranks"])

@pytest.mark.e2e
@pytest.mark.parametrize("removed,options,message", [
    (model(1), (), f"step3/{model(1)}: is missing: the save has stage model files [0]"),
    (optim(1, 1), (), f"step3/{optim(1, 1)}: is missing: dp_world_size is 2"),
    (None, ("--target-tp", "2"), "src/step3: --target-tp 2 (the save has tp 1) with --node-local: a node-local "
                                 "tp change of a pipeline save is not served"),
    (None, ("--target-pp", "1"), f"step3/{model(0)}: --target-pp 1 (the save has 2 stages): the new "
                                 "layer-to-stage assignment needs the model's layer count"),
])
def test_what_is_not_served_is_refused_by_name_before_anything_is_written(node_local_pipeline, tmp_path,
                                                                           monkeypatch, removed, options, message):
    """One node, in this process: a stage model-states file on no node (as DeepSpeed leaves pp 4 on 2
    nodes x 2 ranks: stages 1 and 3 have none anywhere), an optimizer file on no node, a tp change, a
    pp change without the layer list."""
    from trained import reshard_in_process
    root, _ = node_local_pipeline
    source = gathered(root, tmp_path / "src")
    if removed:
        os.unlink(source / "step3" / removed)
    monkeypatch.setenv("RESHARD_NODE_RANK", "0")
    run = reshard_in_process(source, tmp_path / "dst", "--node-local", "--target-ranks-per-node", 2, "--target-dp", 2,
                             *options)
    assert run.returncode == 2, run.stdout + run.stderr
    assert message in run.stderr, run.stderr
    assert not (tmp_path / "dst").exists()


@pytest.mark.e2e
def test_a_dry_run_says_what_each_node_fetches_and_writes_nothing(node_local_pipeline, tmp_path, monkeypatch):
    from trained import reshard_in_process
    root, _ = node_local_pipeline
    monkeypatch.setenv("RESHARD_NODE_RANK", "0")
    run = reshard_in_process(root / "node0" / "src", tmp_path / "dst", "--node-local", "--target-ranks-per-node", 2,
                             "--target-dp", 1, "--tag", "step3", "--dry-run")
    # one node that holds stage 0 only: stage 1's model-states file is on no node it sees
    assert run.returncode == 2 and f"{model(1)}: is missing" in run.stderr, run.stdout + run.stderr
    source = gathered(root, tmp_path / "src")
    run = reshard_in_process(source, tmp_path / "dst", "--node-local", "--target-ranks-per-node", 2, "--target-dp", 1,
                             "--ignore-batch-config", "--dry-run")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "node 0: target ranks 0..1; receives 0 layer files (0 bytes) it lacks, whole" in run.stdout, run.stdout
    assert not (tmp_path / "dst").exists()
