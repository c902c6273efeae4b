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
plan's rounds under a 1K budget (reshard.jobs.node_local_columns), the layer files tensors of the plan,
byte for byte what the collective job (which copies them whole) writes from the gathered files, the bytes between nodes what the plan says and fewer than every
pipeline file sent to every node; the fp32 save again with a split column (stage 1's model-states file moved
to node 0: no worker sees it with its dp rank 0 optimizer file) at (pp 1, dp 4), its model-states tree
gathered from where it is, the same bytes; each target
rank loads its own node's directory with plain `engine.load_checkpoint` (the half-precision targets in
the fp32 (1, 4) launch, `check --judge`), every fp32 master and Adam moment compared by name with the
source engine's, the eval loss, the counters, the LR and (fp16) the loss scaler's state, and one more
`train_batch` runs. A tp change (the session's (pp, tp, dp) = (2, 2, 1) model-axis save, conftest `tp_saves`,
its files split onto 2 simulated nodes by stage as node-local storage holds them) to (1, 1, 4) through the
plan under a 2 KiB budget, its layer files re-cut in the rounds and written on every node whose ranks load
them, and with tp kept to (1, 2, 2), each model rank's layer files whole through the plan: each node's files
the collective job's byte for byte (pinned at tp 1), the bytes between nodes the plan's, and each node's
directory loaded by DeepSpeed on that node's ranks and judged against the source's truth (one 4-rank launch).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil

import pytest
import torch

from reshard.errors import CheckpointError
from reshard.jobs.node_local import WorkerView
from reshard.topology import LayerFiles, Topology

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


def test_a_column_is_inspected_where_its_first_optimizer_file_is_its_model_states_tree_read_where_it_is():
    from reshard.jobs.node_local_columns import column_inspectors, model_readers
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


def test_a_tp_change_writes_each_columns_layer_files_on_every_node_that_runs_it():
    """The layer files a node-local tp change writes besides dp rank 0's (LayerFiles.copies): every rank
    of a column loads them (runtime/pipe/module.py `load_state_dir`), so each other node running the column
    gets them, from its first rank there; ranks numbered as runtime/pipe/topology.py numbers them."""
    from reshard.jobs.node_local_columns import layer_file_copies
    # (pp 1, tp 1, dp 4) at 2 ranks per node: ranks 0, 1 on node 0 (dp rank 0's), 2, 3 on node 1
    assert layer_file_copies(Topology(dp=4, tp=1, pp=1), 2) == ((2,),)
    # (pp 2, tp 1, dp 2) at 2 ranks per node: each stage on one node, no copy
    assert layer_file_copies(Topology(dp=2, tp=1, pp=2), 2) == ()
    # (pp 2, tp 2, dp 3) at 4 ranks per node: stage 0 = ranks 0..5 (nodes 0, 0, 1), stage 1 = 6..11 (1, 2, 2)
    topology = Topology(dp=3, tp=2, pp=2)
    assert [topology.rank_of(d, 1, 1) for d in range(3)] == [7, 9, 11]
    assert layer_file_copies(topology, 4) == ((4, 5, 8, 9),)
    # one rank per node: every dp rank's node
    assert layer_file_copies(Topology(dp=3, tp=1, pp=1), 1) == ((1,), (2,))
    # (pp 2, tp 1, dp 3) at 2 ranks per node: stage 0 = ranks 0..2 (nodes 0, 0, 1), stage 1 = 3..5 (1, 2, 2)
    assert layer_file_copies(Topology(dp=3, tp=1, pp=2), 2) == ((2, 4),)
    # stages spanning different numbers of nodes: -1 where a stage has no such copy; (pp 2, dp 2) at 3 ranks
    # per node: stage 0 = ranks 0, 1 (node 0), stage 1 = 2, 3 (nodes 0, 1)
    assert layer_file_copies(Topology(dp=2, tp=1, pp=2), 3) == ((-1, 3),)


def test_a_layer_file_is_read_by_a_stage_whose_ranks_see_it():
    """Under a tp change the collective job reads a tied layer's file through the first stage holding the tied
    weight; node-local, through a stage whose dp rank 0 optimizer files a worker sees with that file."""
    from reshard.formats.deepspeed_files.deepspeed_pipeline import PipelineSource
    from reshard.jobs.node_local_columns import layer_reading_stages

    def mp_layer(index: int, model: int) -> str:
        return f"layer_{index:02d}-model_{model:02d}-model_states.pt"

    def mp_optim(stage: int, model: int) -> str:
        return f"zero_pp_rank_0_mp_rank_{stage * 2 + model:02d}_optim_states.pt"
    pipe = PipelineSource("/ckpt", "step3", 2, 1, False, False, (), (), (), tp=2, model_axis=True)
    node0 = frozenset({mp_optim(0, 0), mp_optim(0, 1), *(mp_layer(i, m) for i in (0, 1) for m in (0, 1))})
    node1 = frozenset({mp_optim(1, 0), mp_optim(1, 1), *(mp_layer(i, m) for i in (2, 3) for m in (0, 1))})
    views = [WorkerView(0, "step3", node0), WorkerView(1, None, node1)]
    # layer 3 holds a weight tied to stage 0's layer 0: the collective job reads it through stage 0
    assert layer_reading_stages(pipe, views, {0: 0, 1: 0, 2: 1, 3: 0}) == {0: 0, 1: 0, 2: 1, 3: 1}
    split = [WorkerView(0, "step3", node0 - {mp_layer(1, 1)}), WorkerView(1, None, node1 | {mp_layer(1, 1)})]
    with pytest.raises(CheckpointError, match=r"^/ckpt/step3/layer_01-model_00-model_states\.pt: is on no node "
                                              r"with a stage's dp rank 0 optimizer file"):
        layer_reading_stages(pipe, split, {0: 0, 1: 0})


def test_each_copy_of_the_layer_files_takes_its_stages_tensors_as_pieces():
    """checkpoint_plan.layer_copy_pieces: dp rank 0's copy is module_pieces' (every tensor); another copy takes
    the tensors of the stages it writes, at the copy's ranks, each tensor keeping its buffer number (the file
    slots are the same on every rank that writes them), and moves each of them whole from its source rank."""
    import numpy as np

    from reshard.layouts.model_axis import LayerFileSpace
    from reshard.layouts.tensor_parallel import TensorParallelParams, TensorSplit
    from reshard.layouts.zero import Stream
    from reshard.planning.checkpoint_plan import layer_copy_pieces
    from reshard.planning.plan import intersect
    column, row, whole = TensorSplit("column", 0), TensorSplit("row", 1), TensorSplit("replicated", None)
    tensors = TensorParallelParams(("0.w", "1.w", "1.b", "2.w"), ((4, 6), (6, 4), (6,), (4, 4)),
                                   (column, row, column, whole))
    layer = LayerFileSpace("layer_float32", Stream("layer", "float32", 4), tensors,
                           ((0, "w"), (1, "w"), (1, "b"), (2, "w")), (0, 0, 0, 1), (0, 1, 1, 1))
    source, target = Topology(dp=1, tp=2, pp=2), Topology(dp=2, tp=1, pp=2)
    old, new = layer_copy_pieces(layer, source, target)
    assert sorted(set(new.rank.tolist())) == [0, 2]  # dp rank 0 of stages 0 and 1
    # a copy of stage 1's files on rank 3 (dp rank 1 of stage 1), none of stage 0's
    old_copy, new_copy = layer_copy_pieces(layer, source, target, (-1, 3))
    assert set(new_copy.rank.tolist()) == {3} and sorted(set(new_copy.buffer.tolist())) == [1, 2, 3]
    segments = intersect(old_copy, new_copy)
    assert int(segments.length.sum()) == 24 + 6 + 16  # stage 1's tensors, whole once at tp 1
    # read at its source stage (1.w, 1.b at stage 0: ranks 0, 1), a replicated tensor from model rank 0 only
    for j, size, ranks in ((1, 24, {0, 1}), (2, 6, {0, 1}), (3, 16, {2})):
        assert int(segments.length[segments.dst_buffer == j].sum()) == size
        assert set(segments.src_rank[segments.dst_buffer == j].tolist()) == ranks
    # dp rank 0's copy: the same buffers of the same tensors, every element once
    segments = intersect(old, new)
    assert int(segments.length[new.rank[np.searchsorted(new.start, segments.logical, side="right") - 1] == 2].sum()) \
        == 24 + 6 + 16


def _layer_copies_through_the_exchange(spaces, layer, source: Topology, target: Topology, copies, ownership,
                                       budget: int):
    """(bytes the source reader read, bytes of distinct source elements) of `spaces` (a layer dtype's plan
    spaces) run through the real exchange (transport/exchange.run_rounds) on worker threads, every written
    target buffer checked against the source tensor it copies (tp kept: model rank t's tensor j, whole)."""
    import numpy as np

    from reshard.planning.plan import ReshardPlan
    from reshard.transport.exchange import run_rounds
    from test_strided import _Arrays
    from threaded_transport import run_workers
    numels = [int(np.prod(shape)) for shape in layer.tensors.shapes]
    held = {(source.rank_of(0, t, s), j): np.arange(n, dtype=np.int64) + 1000 * (10 * t + j)
            for t in range(source.tp) for j, (n, s) in enumerate(zip(numels, layer.source_stages)) if n}
    writers = {}
    for t in range(target.tp):
        for j, (n, s) in enumerate(zip(numels, layer.target_stages)):
            column = s * target.tp + t
            for rank in [target.rank_of(0, t, s), *(copy[column] for copy in copies if copy[column] >= 0)]:
                if n:
                    writers[(rank, j)] = (10 * t + j, n)
    reader = _Arrays(held, (layer.stream,))
    writer = _Arrays({key: np.full(n, -1, np.int64) for key, (_, n) in writers.items()}, (layer.stream,))
    plan = ReshardPlan(ownership, tuple(spaces), budget)
    run_workers(ownership.workers, lambda transport: run_rounds(plan, transport, reader, writer))
    for (rank, j), (tag, n) in writers.items():
        assert np.array_equal(writer.buffers[(rank, "layer", j)], np.arange(n) + 1000 * tag), (rank, j)
    return reader.bytes_read, sum(len(v) for v in held.values()) * layer.stream.itemsize


@pytest.mark.parametrize("budget", [1 << 20, 256])
def test_every_copy_of_a_layer_file_is_one_space_whose_source_bytes_are_read_once(budget):
    """checkpoint_plan.plan_kept_layer_files: the layer files a node-local job writes on each node whose ranks
    load them (dp rank 0's copy and the target's LayerFiles.copies) are one plan space per dtype whose targets are every copy,
    so each layer file's bytes are read once (transport/read_once.py), however many nodes get them; before,
    each copy was its own space and read the files again. In one round, and in many small ones."""
    import types

    import numpy as np

    from reshard.layouts.model_axis import LayerFileSpace
    from reshard.layouts.tensor_parallel import TensorParallelParams, TensorSplit
    from reshard.layouts.zero import Stream
    from reshard.planning.checkpoint_plan import kept_layer_pieces, plan_kept_layer_files
    from reshard.planning.plan import Ownership, plan_space
    whole = TensorSplit("replicated", None)
    tensors = TensorParallelParams(("0.w", "1.w", "1.b", "2.w"), ((4, 6), (6, 4), (6,), (4, 4)), (whole,) * 4)
    layer = LayerFileSpace("layer_int64", Stream("layer", "int64", 8), tensors,
                           ((0, "w"), (1, "w"), (1, "b"), (2, "w")), (0, 0, 0, 1), (0, 0, 0, 0))
    # (pp 2, tp 2, dp 1) -> (pp 1, tp 2, dp 3) at 2 ranks per node: dp rank 0 on node 0, copies on nodes 1, 2
    source, target = Topology(dp=1, tp=2, pp=2), Topology(dp=3, tp=2, pp=1)
    copies = ((target.rank_of(1, 0, 0), target.rank_of(1, 1, 0)), (target.rank_of(2, 0, 0), target.rank_of(2, 1, 0)))
    ownership = Ownership.between(source, target, 3)
    spec = types.SimpleNamespace(topology=source)
    kept = LayerFiles(types.SimpleNamespace(layer_spaces=(layer,)), recut=False, templates=(), copies=copies)
    after = types.SimpleNamespace(round_offset=0, rounds=0)
    spaces = plan_kept_layer_files(spec, dataclasses.replace(target, layer_files=kept), ownership, budget, after)
    assert len(spaces) == 1  # one space for the dtype, every copy in it
    read, distinct = _layer_copies_through_the_exchange(spaces, layer, source, target, copies, ownership, budget)
    sizes = tuple(int(np.prod(shape)) for shape in tensors.shapes)
    offset, apart = 0, []  # each copy its own space, as before
    for copy in (None, *copies):
        old, new = kept_layer_pieces(layer, source, target, copy)
        apart.append(plan_space(layer.name, old, new, (layer.stream,), sizes, ownership, budget, round_offset=offset))
        offset += apart[-1].rounds
    read_apart, _ = _layer_copies_through_the_exchange(apart, layer, source, target, copies, ownership, budget)
    print(f"\n[layer copies, budget {budget}] bytes read: {read} in one space, {read_apart} a space per copy; "
          f"distinct source bytes {distinct}; rounds {spaces[0].rounds} (apart {offset})")
    assert read == distinct
    # apart, each copy's space re-read the files, unless it was one round served from the round before it
    assert read_apart == (distinct if offset == 3 else 3 * distinct)
    assert (offset == 3) == (budget == 1 << 20)


def test_a_stage_model_states_file_on_no_node_is_named_from_the_names_alone():
    from reshard.formats.deepspeed_files.deepspeed_pipeline import check_stage_model_files
    with pytest.raises(CheckpointError, match=r"/ckpt/step3/mp_rank_01_model_states\.pt: is missing"):
        check_stage_model_files("/ckpt/step3", {0}, {0}, 2)


def test_each_layer_file_is_read_where_it_is_and_written_for_its_stage_with_tp_kept():
    """kept_layer_stages: a layer's source stage by the source bounds when the layer list gives them, else by
    the stage naming its parameters or buffers (a layer without any, or tied, takes its predecessor's); its
    target stage by the target bounds when the stages change, else the same."""
    from reshard.formats.deepspeed_files.deepspeed_pipeline import PipelineSource, PipelineStage
    from reshard.jobs.node_local_columns import kept_layer_stages

    def stage(index: int, *names: str) -> PipelineStage:
        return PipelineStage(index, ((*names,),), ((1,) * len(names),))
    pipe = PipelineSource("/ckpt", "step3", 2, 2, False, False,
                          (stage(0, "tied_modules.embed.weight", "1.weight"), stage(1, "tied_modules.embed.weight",
                                                                                   "4.weight")),
                          tuple(map(layer, (0, 1, 2, 4))), ())
    node0 = frozenset({layer(0), layer(1), layer(2), optim(0, 0)})
    node1 = frozenset({layer(4), optim(0, 1)})
    views = [WorkerView(0, "step3", node0), WorkerView(1, None, node1)]
    # layer 2 has no parameter: stage 0 as layer 1 before it, where its file is
    assert kept_layer_stages(pipe, views, None, None) == {0: (0, 0), 1: (0, 0), 2: (0, 0), 4: (1, 1)}
    assert kept_layer_stages(pipe, views, (0, 3, 7), (0, 7)) == {0: (0, 0), 1: (0, 0), 2: (0, 0), 4: (1, 0)}


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
        # what crossed between the nodes is what the plan says: its rounds' segments, the layer files'
        # tensors among them (a node's layer files written there by the plan, no whole-file moves after it)
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
    (None, ("--target-tp", "2", *LAYERS), f"step3/{model(0)}: --target-tp 2: the save has no pipeline model axis"),
    (None, ("--target-pp", "1"), f"step3/{model(0)}: --target-pp 1 (the save has 2 stages): the new "
                                 "layer-to-stage assignment needs the model's layer count"),
])
def test_what_is_not_served_is_refused_by_name_before_anything_is_written(node_local_pipeline, tmp_path,
                                                                           monkeypatch, removed, options, message):
    """One node, in this process: a stage model-states file on no node (as DeepSpeed leaves pp 4 on 2
    nodes x 2 ranks: stages 1 and 3 have none anywhere), an optimizer file on no node, a tp change of a save
    without a model axis (as without --node-local), a pp change without the layer list."""
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


TP_VARIANT, TP_PINNED = "fp32-mp2u", "fp32-mp2u-to-pp1-tp1-dp4-w2"  # conftest tp_saves; test_pipeline_pinned.py
TP_STAGE0_LAYERS = range(4)  # DeepSpeed's `parameters` partition of pipeline_run.py's 7 layers at pp 2: [0, 4, 7]


@pytest.mark.e2e
def test_a_tp_change_is_served_through_the_plan_and_loads_on_each_node(tp_saves, tmp_path):
    """(pp, tp, dp) (2, 2, 1) -> (1, 1, 4) at 2 ranks per node, its files on the node of their stage (a layer
    file where its stage's dp rank 0 ran, module.py `save_state_dict`; a stage's model-states and optimizer
    files where its ranks ran; `latest` on node 0), the layer files re-cut through the plan's rounds and
    written on both nodes (both run ranks of the one column); and with tp kept, -> (1, 2, 2), each model
    rank's layer files whole through the plan, written on both nodes, killed among the layer files' rounds
    and resumed by round to the same bytes."""
    from reshard_proof.launch import TorchrunError, run_torchrun_nodes
    from test_pipeline import HARNESS as PIPELINE_HARNESS
    from test_pipeline_pinned import PINNED, TRUTH_DIGESTS, truth_dir_digest
    from test_pipeline_tp_change_road import expected_reads
    from trained import reshard_in_threads, tree_state
    save, truth = tp_saves[TP_VARIANT]
    assert truth_dir_digest(truth) == TRUTH_DIGESTS[f"tp/{TP_VARIANT}"], "trained to other values than the pins'"
    stage0 = torch.load(save / "step3" / model(0), weights_only=False)["param_shapes"]
    assert {name.split(".")[0] for group in stage0 for name in group} == {"tied_modules", "1", "3"}  # the bounds
    for k in range(NODES):
        (tmp_path / f"node{k}" / "src" / "step3").mkdir(parents=True)
    for path in (save / "step3").iterdir():
        if path.name.startswith("layer_"):
            stage = 0 if int(path.name[len("layer_"):][:2]) in TP_STAGE0_LAYERS else 1
        else:  # mp_rank_XX (stage * tp + model rank) of a model-states or optimizer file
            stage = int(path.name.split("mp_rank_")[1][:2]) // 2
        shutil.copy2(path, tmp_path / f"node{stage}" / "src" / "step3" / path.name)
    shutil.copy2(save / "latest", tmp_path / "node0" / "src" / "latest")
    before = [tree_state(tmp_path / f"node{k}" / "src") for k in range(NODES)]
    every_file_everywhere = sum(p.stat().st_size for p in (save / "step3").iterdir())
    # name -> (tp, dp); each node runs target ranks 2k, 2k + 1: dp ranks 2k, 2k + 1 at tp 1, dp rank k at tp 2
    targets = {"tp1": (1, 4), "tp2-kept": (2, 2)}
    for name, (tp, dp) in targets.items():
        result_path = tmp_path / f"result-{name}.json"

        def reshard(**kwargs) -> list[str]:
            return run_torchrun_nodes("reshard", NODES, 2, lambda k: [
                tmp_path / f"node{k}" / "src", tmp_path / f"node{k}" / name, "--node-local",
                "--target-ranks-per-node", 2, "--target-dp", dp, "--target-pp", 1, "--target-tp", tp, *LAYERS,
                "--ignore-batch-config", "--memory-budget", "2K", "--durable-every", "1K", "--timeout", "30",
                "--result-json", result_path], **kwargs)
        if tp == 2:  # node 1's leader SIGKILLed in round 65 of 68, among the layer files' rounds (both nodes'
            # copies in one space, come last): no node publishes, and the same command resumes on both by round
            with pytest.raises(TorchrunError):
                reshard(env={"RESHARD_FAILPOINTS": "kill@round=65,worker=2"}, timeout=240)
            for k in range(NODES):
                assert not (tmp_path / f"node{k}" / name / "latest").exists()
                assert (tmp_path / f"node{k}" / name / ".reshard-staging" / "step3" / ".reshard-journal.json").exists()
        outputs = reshard(expect_files=[tmp_path / f"node{k}" / name / "latest" for k in range(NODES)], timeout=400)
        assert ("resuming an interrupted run" in outputs[0]) == (tp == 2), outputs[0][-2000:]
        (result,) = json.loads(result_path.read_text())["checkpoints"]
        assert result["rounds"] == {1: 88, 2: 68}[tp] and result["nodes"] == NODES, result  # far below a stage's
        # optimizer bytes; what crossed is what the plan says, and only what the other node's ranks need (the optimizer
        # partitions of their ranks and their layer files), far from every file to every node
        if tp == 1:
            assert result["bytes_between_nodes"] == result["plan_bytes_between_nodes"] > 0, result
            # each source byte read once, as the collective job reads it, though both nodes get the layer files
            # (one plan space for every copy, checkpoint_plan.every_copy_pieces; each copy read them again before)
            assert result["bytes_read"] == expected_reads(save / "step3"), result
        else:  # resumed: the rounds done before the kill are not sent again
            assert result["bytes_between_nodes"] < result["plan_bytes_between_nodes"], result
        assert 0 < result["plan_bytes_between_nodes"] < every_file_everywhere // 2, (result, every_file_everywhere)
        print(f"\n[node-local {name}] bytes between nodes: {result['bytes_between_nodes']} (plan "
              f"{result['plan_bytes_between_nodes']}); every file of the save: {every_file_everywhere}; "
              f"{result['rounds']} rounds")
        if tp == 1:  # the collective job's output, pinned
            reference = {name.split("/", 1)[1]: digest for name, digest in PINNED[TP_PINNED].items()
                         if name.startswith("step3/")}
        else:
            out = tmp_path / f"reference-{name}"
            reshard_in_threads(save, out, dp, 2, target_pp=1, pipeline_layers=7, pipeline_tied="embed:0,6",
                               ignore_batch_config=True)
            reference = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in (out / "step3").iterdir()}
        layers = {f"layer_{i:02d}-model_{m:02d}-model_states.pt" for i in range(6) for m in range(tp)}  # head under 0
        for k in range(NODES):
            out = tmp_path / f"node{k}" / name / "step3"
            names = {p.name for p in out.iterdir()} - {"reshard_manifest.json"}
            ranks = [2 * k, 2 * k + 1] if tp == 1 else [k]
            assert names == layers | {model(m) for m in range(tp)} | {optim(d, m) for d in ranks for m in range(tp)}
            for file in names:  # byte for byte the collective job's output
                assert hashlib.sha256((out / file).read_bytes()).hexdigest() == reference[file], (name, k, file)
    assert [tree_state(tmp_path / f"node{k}" / "src") for k in range(NODES)] == before  # only read
    verdicts = {name: tmp_path / f"verdict-{name}.json" for name in targets}
    run_torchrun_nodes(PIPELINE_HARNESS, NODES, 2, lambda k: [
        "check", "--pp", 1, "--variant", "fp32-mp1u", "--load", tmp_path / f"node{k}" / "tp1", "--truth", truth,
        "--verdict", verdicts["tp1"],
        "--judge", "fp32-mp2u", tmp_path / f"node{k}" / "tp2-kept", truth, verdicts["tp2-kept"], "plain"],
        expect_files=list(verdicts.values()), timeout=500)
    for name, verdict in verdicts.items():
        record = json.loads(verdict.read_text())
        assert record["ok"], (name, record)
        assert len(record["ranks"]) == 4 and all(r["checked"] > 0 for r in record["ranks"]), (name, record)


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
    assert "node 0: target ranks 0..1; the layer files of stage(s) 0, 1 written there through the plan's rounds" \
        in run.stdout, run.stdout
    assert not (tmp_path / "dst").exists()
