"""Issue 37's first case on the one road: a pipeline save's dp change, column by column, through the planner and execute().

    python -m pytest -q tests/test_pipeline_columns.py     # the session's pipeline saves (3 shared training launches)

With its stages and model ranks kept, each column of a PipelineModule save, the files
`zero_pp_rank_{d}_mp_rank_{c}_optim_states.pt` and `mp_rank_{c}_model_states.pt` of mp index
c = stage * tp + model rank (layouts/pipeline.stage_model_rank), is an ordinary ZeRO-1 save over
that stage's own parameters (docs/architecture.md, "One road"), and the collective job reshards it
so (collective_job.inspect_pipeline_target). The first tests take one column alone, made a
`SourceCheckpoint` here (`column_checkpoint`: spec from the column's own `param_shapes`, files named
by its mp index), through the unchanged main-road parts (`plan_reshard`, `execute`, `SourceReader`,
`target_files`, `TargetWriter`) under a 4 KiB budget, in many rounds, reading each source partition
byte once, and compare the output byte for byte with the collective job's on every dp-change case
the suite reshards (the job's output is pinned in tests/test_pipeline_pinned.py, recorded from the
whole-tensor pipeline job, the side road it took before, now deleted); a column stopped after 5 rounds and resumed from that round into the same files
gives the same bytes. The last test runs the job itself: `python -m reshard` killed mid-rounds and
resumed to the pinned bytes.

One difference was decided, not hidden: DeepSpeed saves each group's `param_slice_mappings` as an
OrderedDict (runtime/zero/stage_1_and_2.py `_create_param_mapping`) and the main road keeps that type
for ZeRO saves (formats/deepspeed_files/deepspeed_target `_optim_tree`), while the pipeline job pickles plain dicts
(formats/deepspeed_files/deepspeed_pipeline `build_optimizers`), which the pins of tests/test_pipeline_pinned.py
record; the pickles differ by that type alone (3 bytes of data.pkl, its CRC and the serialization
id). A pipeline column keeps the dicts; the per-column tests here give their standalone columns'
trees the dicts before writing, check that the source files hold OrderedDicts, and judge the
OrderedDicts by a native load, should the pins be re-taken.

No process of its own: the saves are the session's (`pipeline_runs`), already trained for
test_pipeline.py and test_pipeline_model_axis.py; the side road and the columns run in-process.
"""
from __future__ import annotations

import dataclasses
import hashlib
from collections import OrderedDict
from pathlib import Path

import pytest

from reshard.formats.deepspeed_files import deepspeed_schema as schema
from reshard.formats.deepspeed_files.deepspeed_spec import CheckpointSpec, SourceCheckpoint

pytestmark = pytest.mark.e2e

BUDGET = 4096
# (variant, source (pp, dp), target dp): every dp change of a pipeline save the suite reshards
CASES = [("fp32", (2, 1), 2), ("bf16", (2, 2), 1), ("fp16", (2, 2), 1), ("fp32-frozen", (2, 2), 1),
         ("fp32-groups", (2, 2), 1), ("fp32-mp2", (2, 1), 2), ("bf16-mp2", (2, 1), 2),
         ("fp32-groups-mp2", (2, 1), 2), ("fp32-frozen-mp2", (2, 1), 2)]


@dataclasses.dataclass(frozen=True)
class ColumnCheckpoint(SourceCheckpoint):
    """One (stage, model rank) column of a pipeline save as a ZeRO-1 save: its files carry mp index `column`."""

    column: int = 0

    def optim_name(self, rank: int) -> str:
        return schema.optim_file_name(rank, self.spec.bf16_prefix, self.column)

    def model_name(self, rank: int = 0) -> str:
        return schema.model_file_name(1, 0, self.column)


def column_checkpoint(save_dir: str, tag: str, column: int, dp: int, bf16: bool) -> ColumnCheckpoint:
    """Column `column` of the pipeline save at `dp` ranks: spec from its model-states file's `param_shapes`
    (one param group per entry, in flat order), streams from its first optimizer file."""
    import os

    from reshard.formats.deepspeed_files.deepspeed_inspect import read_carried, validate_optim_tree
    from reshard.formats.torch_bytes.torch_archive import TensorRef, load_portable
    from reshard.layouts.zero import ParamSpec, Stream, buffer_numels
    from reshard.topology import Topology
    tag_dir = os.path.join(save_dir, tag)
    model_name, optim_name = schema.model_file_name(1, 0, column), schema.optim_file_name(0, bf16, column)
    model = load_portable(os.path.join(tag_dir, model_name), schema.safe_globals(), False)
    optim = load_portable(os.path.join(tag_dir, optim_name), schema.safe_globals(), False)
    params, groups = [], []
    for shapes in model["param_shapes"]:
        groups.append(tuple(range(len(params), len(params) + len(shapes))))
        params.extend(ParamSpec(name, tuple(int(d) for d in shape)) for name, shape in shapes.items())
    osd = optim[schema.OPTIM]
    optimizer = "zero" if "zero_stage" in osd else "bf16_optimizer"
    # lp_dtype only sets parameter alignment (off in these saves) and the module streams AutoTP files use
    spec = CheckpointSpec(1, optimizer, bf16, Topology(dp=dp), tuple(params), tuple(groups), False, 1, 0,
                          "bfloat16" if bf16 else "float32", ())
    fp32 = osd["single_partition_of_fp32_groups"]
    sizes = buffer_numels(spec.layout(dp))
    moments = osd["base_optimizer_state"]["state"][0]
    streams = (Stream("fp32", fp32[0].dtype, fp32[0].itemsize),
               *(Stream(key, ref.dtype, ref.itemsize) for key, ref in moments.items()
                 if isinstance(ref, TensorRef) and ref.shape == (sizes[0],)))
    spec = dataclasses.replace(spec, streams=streams)
    path = os.path.join(tag_dir, optim_name)
    parts = validate_optim_tree(optim, path, spec, spec.layout(spec.topology), 0)
    return ColumnCheckpoint(save_dir, tag, spec, optim, model, {optim_name: read_carried(path, optim, parts.values())},
                            column=column)


def side_road_mappings(files: list) -> list:
    """The target files with each group's param_slice_mappings a plain dict, as the side road pickles them."""
    for file in files:
        osd = file.tree.get(schema.OPTIM) if isinstance(file.tree, dict) else None
        if isinstance(osd, dict) and "param_slice_mappings" in osd:
            osd["param_slice_mappings"] = [dict(m) for m in osd["param_slice_mappings"]]
    return files


def reshard_column(source: ColumnCheckpoint, target_dp: int, out: Path, *, stop_after: int | None = None,
                   start_round: int = 0, side_road_mappings_too: bool = True) -> tuple[object, int]:
    """(plan, bytes read): column `source` through the main road into `out`, one worker, BUDGET bytes a round.
    `stop_after`: raise after that many rounds (a crash); `start_round`: resume into the files there;
    `side_road_mappings_too`: write param_slice_mappings as the side road does (plain dicts), else as
    the main road does (DeepSpeed's OrderedDicts)."""
    from reshard.formats.deepspeed_files.deepspeed_target import target_files
    from reshard.formats.deepspeed_files.source_reader import SourceReader
    from reshard.formats.deepspeed_files.target_writer import TargetWriter
    from reshard.jobs.execute import execute
    from reshard.planning.checkpoint_plan import plan_reshard
    from reshard.topology import Topology
    from reshard.transport.local import LocalTransport
    target = Topology(dp=target_dp)
    column = f"mp_rank_{source.column:02d}"

    def files_of(src, topology, rank):
        return [dataclasses.replace(f, name=f.name.replace("mp_rank_00", column),
                                    template=f.template.replace("mp_rank_00", column))
                for f in (side_road_mappings if side_road_mappings_too else list)(target_files(src, topology, rank))]

    def on_round(index, moved):
        if stop_after is not None and index + 1 == stop_after:
            raise RuntimeError("stopped")

    plan = plan_reshard(source.spec, target, 1, BUDGET)
    read = []
    execute(plan, LocalTransport(),
            open_source=lambda: SourceReader.open(source, range(source.spec.topology.dp), target=target),
            open_sink=lambda: TargetWriter.create(source, str(out), target, range(target_dp), files_of=files_of,
                                                  reuse_existing=start_round > 0),
            opening="opening", finish=lambda reader, writer: (read.append(reader.bytes_read), writer.finish()),
            start_round=start_round, on_round=on_round)
    return plan, read[0]


def hashes(directory: Path) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.glob("*.pt"))}


def _side_and_columns(pipeline_runs, tmp_path, case):
    import os
    import shutil

    from reshard.jobs.options import ReshardOptions
    from reshard.jobs.collective_job import run_job
    from reshard.transport.local import LocalTransport
    from reshard.formats.deepspeed_files.deepspeed_pipeline import inspect_pipeline
    from test_pipeline import model_ranks
    variant, (pp, dp), target_dp = case
    save, _ = pipeline_runs(variant, pp, dp)
    opts = ReshardOptions(source=str(save), destination=str(tmp_path / "side"), target_dp=target_dp, quiet=True,
                          ignore_batch_config=True).validate()
    [checkpoint] = run_job(opts, LocalTransport()).checkpoints
    tag = checkpoint.tag
    source = inspect_pipeline(str(save), tag)
    assert (source.pp, source.tp, source.dp) == (pp, model_ranks(variant), dp)
    main = tmp_path / "main" / tag
    main.mkdir(parents=True)
    (tmp_path / "main" / "latest").write_text(tag)
    for name in source.layer_files:  # carried as they are, as the side road copies them
        shutil.copyfile(os.path.join(source.tag_dir, name), main / name)
    columns = [column_checkpoint(str(save), tag, c, dp, source.bf16) for c in range(pp * source.tp)]
    return tmp_path / "side" / tag, main, columns


@pytest.mark.parametrize("case", CASES, ids=lambda case: f"{case[0]}-pp{case[1][0]}-dp{case[1][1]}-to-dp{case[2]}")
def test_each_column_through_the_main_road_makes_the_side_roads_bytes(pipeline_runs, tmp_path, case):
    side, main, columns = _side_and_columns(pipeline_runs, tmp_path, case)
    for column in columns:
        plan, read = reshard_column(column, case[2], main)
        spec = column.spec
        assert plan.rounds > 1 and max(plan.round_bytes()) <= BUDGET, (plan.rounds, max(plan.round_bytes()))
        # each source partition byte once: every element of the column's space, in every stream
        assert read == spec.total_elements * sum(s.itemsize for s in spec.streams), (column.column, read)
    assert hashes(main) == hashes(side)
    assert len(hashes(side)) == len(list(side.glob("*.pt"))) > len(columns)


def test_deepspeed_saves_param_slice_mappings_as_ordered_dicts(pipeline_runs):
    """The one difference the lowering must decide (module docstring): the source's own type."""
    import torch
    save, _ = pipeline_runs("fp32", 2, 1)
    for path in sorted(Path(save).glob("*/*optim_states.pt")):
        mappings = torch.load(path, map_location="cpu", weights_only=False)[schema.OPTIM]["param_slice_mappings"]
        assert mappings and all(type(m) is OrderedDict for m in mappings), (path, [type(m) for m in mappings])


def test_a_column_stopped_mid_rounds_resumes_to_the_same_bytes(pipeline_runs, tmp_path):
    side, main, columns = _side_and_columns(pipeline_runs, tmp_path, ("bf16", (2, 2), 1))
    for column in columns:
        with pytest.raises(RuntimeError, match="stopped"):
            reshard_column(column, 1, main, stop_after=5)
        plan, _ = reshard_column(column, 1, main, start_round=5)
        assert plan.rounds > 5
    assert hashes(main) == hashes(side)


def test_the_main_roads_own_mappings_load_natively_equal_to_the_truth(pipeline_runs, tmp_path):
    """The difference (OrderedDict mappings) judged by a DeepSpeed load: the columns of the bf16 (pp 2, dp 2)
    save written at dp 1 as the main road writes them load into a PipelineEngine at (pp 2, dp 1) equal to
    the source engine's truth (tests/pipeline_run.py check; one launch of 2 ranks)."""
    import torch
    from test_pipeline import check_at
    case = ("bf16", (2, 2), 1)
    side, main, columns = _side_and_columns(pipeline_runs, tmp_path, case)
    for column in columns:
        reshard_column(column, 1, main, side_road_mappings_too=False)
    assert hashes(main).keys() == hashes(side).keys()
    differing = sorted(name for name, digest in hashes(main).items() if digest != hashes(side)[name])
    assert differing == sorted(p.name for p in side.glob("*optim_states.pt")), differing
    for name in differing:
        mappings = torch.load(main / name, map_location="cpu", weights_only=False)[schema.OPTIM]["param_slice_mappings"]
        assert all(type(m) is OrderedDict for m in mappings), name
    _, truth = pipeline_runs(*case[0:1], *case[1])
    verdict = check_at(2, 1, "bf16", main.parent, truth, tmp_path / "verdict.json")
    assert verdict["ok"], verdict
    assert sum(rank["checked"] for rank in verdict["ranks"]) >= 9  # every parameter on some rank


def test_a_pipeline_dp_change_killed_mid_rounds_resumes_to_the_pinned_bytes(pipeline_runs, tmp_path):
    """The first case on the one road (issue 37): the fp32 (pp 2, dp 1) save to dp 2 by `python -m reshard`
    under a 4 KiB budget, less than any of its optimizer files, killed in round 3 (a SIGKILL, the journal
    durable every 1 KiB) and run again: the second run resumes from the journal and publishes the bytes
    tests/test_pipeline_pinned.py holds for this case. The pipeline job it replaces refused such a budget
    and had no resume."""
    from test_pipeline_pinned import PINNED, TRUTH_DIGESTS, tree_hashes, truth_dir_digest
    from trained import reshard_cli

    from reshard.jobs.destination import STAGING
    from reshard.jobs.manifest import JOURNAL_NAME
    save, truth = pipeline_runs("fp32", 2, 1)
    assert truth_dir_digest(truth) == TRUTH_DIGESTS["runs/fp32/2/1"], "trained to other values than the pins'"
    assert min(p.stat().st_size for p in save.glob("*/*optim_states.pt")) > BUDGET
    out = tmp_path / "out"
    args = (save, out, "--target-dp", 2, "--memory-budget", "4K", "--durable-every", "1K", "--ignore-batch-config")
    killed = reshard_cli(*args, "--quiet", env={"RESHARD_FAILPOINTS": "kill@round=3"})
    assert killed.returncode != 0, killed.stdout
    assert (out / STAGING / "step3" / JOURNAL_NAME).is_file()
    assert not (out / "latest").exists()
    done = reshard_cli(*args)
    assert done.returncode == 0, done.stderr
    assert "resuming an interrupted" in done.stdout + done.stderr, done.stdout
    assert tree_hashes(out) == PINNED["fp32-pp2-dp1-to-pp2-dp2-w2"]
