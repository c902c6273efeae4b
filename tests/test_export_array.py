"""`reshard export --format safetensors|universal --array-task I --array-tasks K`, then `reshard publish OUT`:
byte for byte the `--workers K` export.

    python -m pytest -q tests/test_export_array.py

The collective exports these are compared with are judged elsewhere: the safetensors export against the
engine's truth (tests/test_export_safetensors.py, and at pp 1 for a pipeline save in
tests/test_pipeline_export.py), the universal export by DeepSpeed's own load_universal against
ds_to_universal (tests/test_export_universal.py, tests/test_pipeline_export.py). Here the array tasks
(reshard.export.array_formats) must write exactly those bytes, for a ZeRO-1/2 save, a ZeRO-3 save and a
PipelineModule save (pp 2, dp 2, a tied embedding and a frozen layer), and the DCP export's (the same road)
beside them; one task SIGKILLed and run again
resumes by file; publishing is refused by name while a task is unfinished, and a record edited by hand is
refused.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from threaded_transport import run_workers
from trained import tree_files

from reshard.export import export_dcp, export_safetensors, export_universal
from reshard.export.array_formats import (SAFETENSORS, UNIVERSAL, export_safetensors_array_task,
                                          export_universal_array_task)
from reshard.export.dcp_array import DCP, export_dcp_array_task
from reshard.export.safetensors_job import parse_shard_size
from reshard.jobs.array_job import done_path
from reshard_proof.launch import REPO_ROOT, child_env

pytestmark = [pytest.mark.e2e, pytest.mark.trains(("z2_fp32", 2), ("z3_bf16", 2))]

BUDGET = 4 << 10
"""Small enough that every export takes several rounds (the kill lands in the first)."""
OPTIONS = {"safetensors": {"max_shard_size": "300B"}, "universal": {}, "dcp": {"chunk_bytes": 256}}
PIPELINE_OPTIONS = {"safetensors": {"max_shard_size": "4KB"}, "universal": {}, "dcp": {"chunk_bytes": 256}}
COLLECTIVE = {"safetensors": export_safetensors, "universal": export_universal, "dcp": export_dcp}
ARRAY_TASK = {"safetensors": export_safetensors_array_task, "universal": export_universal_array_task,
              "dcp": export_dcp_array_task}
FORMATS = {"safetensors": SAFETENSORS, "universal": UNIVERSAL, "dcp": DCP}


def _source(save: str, trained, pipeline_runs):
    if save == "pipeline_frozen":
        return pipeline_runs("fp32-frozen", 2, 2)[0], PIPELINE_OPTIONS
    return trained(save, 2)[0], OPTIONS


def _record_options(fmt: str, options: dict) -> dict:
    """The format's own options as its record holds them."""
    if fmt == "safetensors":
        return {"dtype": "fp32", "max_shard_bytes": parse_shard_size(options[fmt]["max_shard_size"])}
    if fmt == "dcp":
        return {"dtype": "fp32", "layout": "torch", **options[fmt]}
    return {}


def _collective(fmt: str, source, out, workers: int, options: dict) -> None:
    run_workers(workers, lambda t: COLLECTIVE[fmt](str(source), str(out), memory_budget=BUDGET, transport=t,
                                                   **options))


@pytest.mark.parametrize("fmt", ["safetensors", "universal", "dcp"])
@pytest.mark.parametrize("save", ["z2_fp32", "z3_bf16", "pipeline_frozen"])
def test_array_tasks_publish_the_collective_exports_bytes(trained, pipeline_runs, tmp_path, fmt, save):
    """3 array tasks in this process, in the order 2, 0, 1: only the last one publishes, and OUT is byte for
    byte the `--workers 3` export (files, index or latest_universal, model-states copies). The DCP export
    takes the same road (reshard.export.array_export), judged here beside the two others."""
    source, options = _source(save, trained, pipeline_runs)
    _collective(fmt, source, tmp_path / "collective", 3, options[fmt])
    out = tmp_path / "array"
    results = [ARRAY_TASK[fmt](str(source), str(out), task=i, tasks=3, memory_budget=BUDGET, quiet=True,
                               **options[fmt]) for i in (2, 0, 1)]
    assert [any(n.startswith("published ") for n in r.notes) for r in results] == [False, False, True]
    assert sum(len(r.files) for r in results) > 0
    assert tree_files(out) == tree_files(tmp_path / "collective")
    # each task reads only its share: together, what one worker writing every file reads, each byte once
    export = FORMATS[fmt].derive({"source": str(source), "destination": str(tmp_path / "x"), "tag": None,
                                  "memory_budget": BUDGET, "trust_pickle": False, **_record_options(fmt, options)}, 3)
    plan = export.one_worker_plan(BUDGET)
    once = sum(int(space.traffic(plan.ownership)[0, 0]) for space in plan.spaces)
    assert sum(r.bytes_read for r in results) == once > 0


def _task_cli(fmt: str, source, out, task: int, tasks: int, env=None) -> subprocess.CompletedProcess:
    extra = ["--max-shard-size", OPTIONS[fmt]["max_shard_size"]] if fmt == "safetensors" else []
    return subprocess.run([sys.executable, "-m", "reshard", "export", str(source), str(out), "--format", fmt,
                           "--memory-budget", str(BUDGET), "--array-task", str(task), "--array-tasks", str(tasks),
                           "--quiet", *extra], env={**child_env(), **(env or {})}, cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("fmt", ["safetensors", "universal"])
def test_a_killed_task_resumes_and_publishing_is_refused_until_every_task_is_done(trained, tmp_path, capsys, fmt):
    """Task 1 of 2 (the command line) SIGKILLed in its first round; task 0 finishes and leaves the set
    unpublished; `reshard publish` refuses by name (task 1), as it does a record edited to 3 tasks (with task
    1's files faked done), placing nothing; task 1 run again writes its files and publishes the `--workers 2`
    export's bytes."""
    from reshard.cli import main
    source, _ = trained("z2_fp32", 2)
    _collective(fmt, source, tmp_path / "collective", 2, OPTIONS[fmt])
    out = tmp_path / "array"
    array = out / ".reshard-staging" / "global_step3.array"
    killed = _task_cli(fmt, source, out, 1, 2, env={"RESHARD_FAILPOINTS": "kill@round=1"})
    assert killed.returncode == -9, killed.stdout + killed.stderr
    assert not list((array / "done").iterdir())
    first = ARRAY_TASK[fmt](str(source), str(out), task=0, tasks=2, memory_budget=BUDGET, quiet=True, **OPTIONS[fmt])
    assert first.files and any("by array task(s) 1; not published yet" in n for n in first.notes), first.notes

    publish = subprocess.run([sys.executable, "-m", "reshard", "publish", str(out)], env=child_env(), cwd=REPO_ROOT,
                             capture_output=True, text=True, timeout=120)
    assert publish.returncode == 1 and "by array task(s) 1; not published yet" in publish.stdout, publish.stdout
    assert os.listdir(out) == [".reshard-staging"]

    kept = (array / "record.json").read_text()
    record = json.loads(kept)
    (array / "record.json").write_text(json.dumps({**record, "tasks": 3}))
    faked = [name for name, task in record["owners"].items() if task == 1]
    marker = next((array / "done").iterdir())
    for name in faked:
        shutil.copy(marker, done_path(str(array), name))
    assert main(["publish", str(out)]) == 2
    assert "record.json: its files and their tasks are not those a 3-task export of this source writes" in \
        capsys.readouterr().err
    assert os.listdir(out) == [".reshard-staging"]
    (array / "record.json").write_text(kept)
    for name in faked:
        os.unlink(done_path(str(array), name))

    second = ARRAY_TASK[fmt](str(source), str(out), task=1, tasks=2, memory_budget=BUDGET, quiet=True, **OPTIONS[fmt])
    assert sorted(second.files) == sorted(faked)
    assert any(n.startswith("published ") for n in second.notes), second.notes
    assert tree_files(out) == tree_files(tmp_path / "collective")
