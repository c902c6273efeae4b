"""What the command line says to a new user (issue 39's papercuts): usage, help, messages, docs, summaries.

    python -m pytest -q tests/test_cli_papercuts.py                 # fast: no process started, seconds
    python -m pytest -q tests/test_cli_papercuts.py -m e2e          # closed pipes, tag directories, progress

The e2e tests use the session's ("z2_fp32", 2) save (trained with test_cli.py's) and start
`python -m reshard` once per subcommand, plus one torchrun launch.
"""
from __future__ import annotations

import dataclasses
import json
import os
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import pytest
from trained import REPO, reshard_in_process, tree_files

from reshard.jobs.options import ReshardOptions

pytestmark = pytest.mark.trains(("z2_fp32", 2))

FIELDS = [field.name for field in dataclasses.fields(ReshardOptions)]


def _parsers() -> dict:
    """Every parser the command line has, by the subcommand (None: `reshard` itself)."""
    from reshard.cli import build_export_parser, build_inspect_parser, build_parser, build_verify_parser
    from reshard.jobs.array_job import build_publish_parser
    return {None: build_parser(), "verify": build_verify_parser(), "inspect": build_inspect_parser(),
            "export": build_export_parser(), "publish": build_publish_parser()}


def _flags(parser) -> set[str]:
    return {option for action in parser._actions for option in action.option_strings
            if option.startswith("--") and option != "--help"}


def _field_names_in(text: str) -> list[str]:
    """Option field names where a flag name belongs: `target_dp`, `workers` in backticks, `transport "torch"`."""
    found = [name for name in FIELDS if "_" in name and re.search(rf"(?<![\w-]){name}(?!\w)", text)]
    found += [name for name in FIELDS if f"`{name}`" in text or re.search(rf"(?<![\w-]){name} \"", text)]
    return found


def test_no_arguments_prints_the_usage(capsys):
    from reshard.cli import main
    assert main([]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("usage: reshard "), captured.err
    assert "--target-dp is required" not in captured.err and "reshard --help" in captured.err
    assert captured.out == ""


@pytest.mark.parametrize("command", [None, "verify", "inspect", "export", "publish"])
def test_help_shows_flags_not_module_paths_or_option_fields(command):
    modules = {name for _, name, _ in pkgutil.walk_packages([str(REPO / "reshard")], "reshard.")}
    shown_help = reshard_in_process(*([command] if command else []), "--help")
    assert shown_help.returncode == 0 and shown_help.stdout.startswith("usage: reshard"), shown_help
    for name, text in [(command, " ".join(shown_help.stdout.split()))]:  # argparse wraps lines: one line to search
        shown = [module for module in modules if re.search(rf"(?<![\w.]){re.escape(module)}(?![\w])", text)]
        assert shown == [], (name, shown)
        assert "None" not in text, (name, text)
        assert _field_names_in(text) == [], (name, _field_names_in(text))


BAD_OPTIONS = [
    ["a", "b"],
    ["a", "b", "--target-dp", "0"],
    ["a", "b", "--target-dp", "2", "--target-tp", "0"],
    ["a", "b", "--target-dp", "2", "--target-ep", "0"],
    ["a", "b", "--target-dp", "2", "--target-pp", "0"],
    ["a", "b", "--target-dp", "2", "--target-stage", "2", "--array-task", "0", "--array-tasks", "2"],
    ["a", "b", "--target-dp", "2", "--target-stage", "2", "--node-local", "--target-ranks-per-node", "1"],
    ["a", "b", "--target-dp", "2", "--memory-budget", "12"],
    ["a", "b", "--target-dp", "2", "--durable-every", "0"],
    ["a", "b", "--target-dp", "2", "--array-task", "0"],
    ["a", "b", "--target-dp", "2", "--array-task", "3", "--array-tasks", "2"],
    ["a", "b", "--target-dp", "2", "--workers", "0"],
    ["a", "b", "--target-dp", "2", "--workers", "2", "--transport", "mpi"],
    ["a", "b", "--target-dp", "2", "--target-ranks-per-node", "2"],
    ["a", "b", "--target-dp", "2", "--node-local"],
    ["a", "b", "--target-dp", "2", "--node-local", "--target-ranks-per-node", "1", "--all-tags"],
    ["a", "b", "--target-dp", "2", "--timeout", "0"],
    ["a", "--target-dp", "2"],
    ["a", "b", "--target-dp", "2", "--tag", "../x"],
    ["a", "b", "--target-dp", "two"],
    ["a", "b", "--target-dp", "2", "--backend", "mpi"],
    ["a", "b", "--target-dp", "2", "--memory-budget", "lots"],
    ["a", "b", "--target-dp", "2", "--no-such-flag"],
]


@pytest.mark.parametrize("argv", BAD_OPTIONS, ids=lambda argv: " ".join(argv[2:]) or "no --target-dp")
def test_option_errors_name_flags_by_their_flag_names(argv, tmp_path):
    """Every refusal of the options is one line, exit 2, naming the flag as it is typed; a job file's
    key is named only as such ("target_dp in a job file")."""
    done = reshard_in_process(*[str(tmp_path / arg) if arg in ("a", "b") else arg for arg in argv])
    assert done.returncode == 2 and done.stdout == "", done
    message = done.stderr.strip()
    assert message.startswith("reshard: error: ") and "\n" not in message, message
    assert re.search(r"--[a-z]|\bSRC\b|\bDST\b", message), message
    assert _field_names_in(re.sub(r"\w+ in a job file", "", message)) == [], message


@pytest.mark.parametrize("command", [["inspect"], ["export", "--format", "universal"]])
def test_a_directory_without_a_checkpoint_is_refused(command, tmp_path):
    """`reshard inspect docs/` said "tag None" and "0 B of files"; now, as `reshard` does, it says
    there is nothing to read, exit 2, and writes nothing."""
    verb = command[0]
    empty = tmp_path / "notes"
    empty.mkdir()
    (empty / "README.md").write_text("not a checkpoint\n")
    out = tmp_path / "out"
    args = [command[0], empty, *([out] if verb == "export" else []), *command[1:]]
    done = reshard_in_process(*args)
    assert done.returncode == 2 and done.stdout == "", done
    assert done.stderr.startswith(f"reshard {verb}: error: {empty}/latest: does not exist"), done.stderr
    assert f"nothing to {verb} here" in done.stderr, done.stderr
    assert not out.exists()
    # a directory of save directories (OpenRLHF's _actor, _critic) is named as such
    (empty / "_actor").mkdir()
    (empty / "_actor" / "latest").write_text("global_step1")
    done = reshard_in_process(*args)
    assert done.returncode == 2 and "its sub-directories _actor are save directories" in done.stderr, done.stderr


def _usage_sections() -> dict:
    """docs/usage.md's flag tables: the flags in the first column of each table row, by the
    section they are in (None: reshard's own `## Options`; else the `### reshard NAME` subcommand)."""
    sections: dict = {}
    current = "other"
    for line in (REPO / "docs" / "usage.md").read_text().splitlines():
        if line.startswith("## "):
            current = None if line == "## Options" else "other"
        elif line.startswith("### `reshard "):
            current = line.split()[2].strip("`")
        elif line.startswith("| `") and current != "other":
            sections.setdefault(current, set()).update(re.findall(r"--[a-z][a-z-]*", line.split(" | ")[0]))
    return sections


def test_usage_md_lists_every_flag_of_every_subcommand():
    from reshard.cli import build_parser
    sections = _usage_sections()
    assert _flags(build_parser()) == sections[None], "docs/usage.md's Options and reshard's flags differ"
    parsers = _parsers()
    for name, parser in parsers.items():
        documented = sections.get(name, set())
        assert _flags(parser) - documented == set(), f"docs/usage.md lacks {name or 'reshard'}'s flags"
        assert documented - _flags(parser) == set(), f"docs/usage.md lists flags {name or 'reshard'} does not have"
    every = set().union(*(_flags(parser) for parser in parsers.values()))
    named = set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", (REPO / "docs" / "usage.md").read_text()))
    assert named - every - {"--help"} == set(), "docs/usage.md names flags no parser has"


def test_summaries_read_as_sentences():
    from reshard.inspect_report import InspectReport
    from reshard.jobs.results import CheckpointResult
    from reshard.topology import Topology
    one = CheckpointResult("/src", "/dst", "global_step3", "ZeRO-2 fp32", Topology(dp=2), Topology(dp=3), 1, "local",
                           0, 1.0, False).summary()
    assert "1 worker, this process alone" in one and "worker(s)" not in one and "over local" not in one, one
    two = CheckpointResult("/src", "/dst", "global_step3", "ZeRO-2 fp32", Topology(dp=2), Topology(dp=3), 2,
                           "shared memory (forked workers)", 0, 1.0, False).summary()
    assert "2 workers over shared memory (forked workers)" in two, two
    from reshard.export.dcp_job import DcpResult
    dcp = DcpResult("/src", "/out", "global_step3", 1, 3, files=["__0_0.distcp"]).summary()
    assert "1 .distcp file; 1 worker, 3 rounds" in dcp and "(s)" not in dcp, dcp

    def can_write(sizes, why=""):
        report = InspectReport("/src", "global_step3", topology={"stage": 2, "dp": 2, "tp": 1, "ep": 1, "pp": 1},
                               targets={"reshard_dp": sizes, "batch_config": why, "export_formats": [], "notes": []})
        return [line for line in report.text().splitlines() if line.startswith("reshard can write")]
    assert can_write("any") == ["reshard can write it at any --target-dp, as ZeRO-2"]
    assert can_write([1, 2, 4], "train_batch_size 4 is fixed") == [
        "reshard can write it at --target-dp 1, 2 or 4, as ZeRO-2 (train_batch_size 4 is fixed)"]


def _write_tag_dir(save_dir: Path, tag: str) -> Path:
    """Files named as DeepSpeed names them (their contents do not matter to where SRC points)."""
    tag_dir = save_dir / tag
    tag_dir.mkdir(parents=True)
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"):
        (tag_dir / name).write_bytes(b"")
    return tag_dir


def test_a_tag_directory_stands_for_its_save_directory_and_tag(tmp_path):
    from reshard.errors import CheckpointError
    from reshard.jobs.runs import as_save_dir
    save_dir = tmp_path / "ckpt"
    step3 = _write_tag_dir(save_dir, "global_step3")
    step2 = _write_tag_dir(save_dir, "global_step2")
    assert as_save_dir(str(save_dir), None) == (str(save_dir), None)  # a save directory stays as given
    assert as_save_dir(str(step3), None) == (str(save_dir), "global_step3")  # no `latest`: its own name
    (save_dir / "latest").write_text("global_step3")
    assert as_save_dir(str(step3) + "/", "global_step3") == (str(save_dir), "global_step3")
    with pytest.raises(CheckpointError, match=rf"{save_dir}/latest names tag 'global_step3', not 'global_step2'"
                                              rf".*{save_dir} --tag global_step2"):
        as_save_dir(str(step2), None)
    with pytest.raises(CheckpointError, match="is the tag directory of tag 'global_step3', but --tag global_step2"):
        as_save_dir(str(step3), "global_step2")
    with pytest.raises(CheckpointError, match="--all-tags takes the save directory"):
        as_save_dir(str(step3), None, all_tags=True)
    assert as_save_dir(str(tmp_path), None) == (str(tmp_path), None)  # no checkpoint files: left to the job


def test_progress_is_drawn_on_worker_0_with_a_terminal_or_when_asked(monkeypatch, capsys):
    from reshard.jobs.progress import PROGRESS_VARIABLE, Progress, progress_enabled
    monkeypatch.delenv(PROGRESS_VARIABLE, raising=False)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert progress_enabled(False, True) and not progress_enabled(True, True) and not progress_enabled(False, False)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    assert not progress_enabled(False, True)  # a log file gets no bar unless asked
    monkeypatch.setenv(PROGRESS_VARIABLE, "1")
    assert progress_enabled(False, True) and not progress_enabled(True, True) and not progress_enabled(False, False)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    monkeypatch.setenv(PROGRESS_VARIABLE, "0")
    assert not progress_enabled(False, True)
    capsys.readouterr()
    with Progress("copying", True) as bar:
        bar.start(4096)
        bar.update(1024)
        bar.update(3072)
    assert "copying: 100%" in capsys.readouterr().err
    with Progress("building", True, unit="file") as bar:
        bar.start(None)
        bar.update(2)
    assert re.search(r"building: 2 \[00:0\d\]", capsys.readouterr().err)
    with Progress("hidden", False) as bar:
        bar.start(10)
        bar.update(10)
    assert capsys.readouterr().err == ""


# --- with a real DeepSpeed save -----------------------------------------------------------------


def _closed_pipe(*args, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m reshard ARGS | head -0`: the reader closes stdout before the command writes."""
    child = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH=str(REPO), **(env or {}))
    process = subprocess.Popen([sys.executable, "-m", "reshard", *map(str, args)], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=child, cwd=REPO)
    process.stdout.close()
    stderr = process.stderr.read()
    return subprocess.CompletedProcess(args, process.wait(timeout=300), "", stderr)


@pytest.mark.e2e
def test_every_subcommand_survives_a_closed_pipe(trained, tmp_path):
    """`reshard inspect X | head` ended in a BrokenPipeError traceback. Each subcommand, with its
    stdout closed before it prints: no traceback, its own exit status, its work done."""
    source, _ = trained("z2_fp32", 2)
    tag = (Path(source) / "latest").read_text().strip()
    destination, out = tmp_path / "dst", tmp_path / "universal"
    runs = {
        # RESHARD_PROGRESS=1: the bar is drawn into the stderr pipe, which is not a terminal
        # --workers 2: worker 0 of two forked workers prints the summary and draws the bar
        "reshard": (_closed_pipe(source, destination, "--target-dp", "3", "--workers", "2",
                                 env={"RESHARD_PROGRESS": "1"}), 0),
        "dry run": (_closed_pipe(source, tmp_path / "plan", "--target-dp", "3", "--dry-run"), 0),
        "inspect": (_closed_pipe("inspect", source), 0),
        "inspect --json": (_closed_pipe("inspect", source, "--json"), 0),
        "verify": (_closed_pipe("verify", destination), 0),
        "export": (_closed_pipe("export", source, out, "--format", "universal", env={"RESHARD_PROGRESS": "1"}), 0),
        "publish": (_closed_pipe("publish", destination), 0),
        "help": (_closed_pipe("--help"), 0),
    }
    for name, (done, status) in runs.items():
        assert "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr, (name, done.stderr)
        assert done.returncode == status, (name, done.returncode, done.stderr)
    assert (destination / "latest").read_text() == tag and (out / "latest_universal").is_file()
    assert not (tmp_path / "plan").exists()
    bars = runs["reshard"][0].stderr
    assert f"reshard {tag}: 100%" in bars, bars  # asked for: drawn although stderr is a pipe
    assert len(re.findall(rf"reshard {tag}:\s+0%\|", bars)) == 1, bars  # one bar: worker 0's, not worker 1's
    assert "export: 100%" in runs["export"][0].stderr, runs["export"][0].stderr
    assert runs["verify"][0].stderr == ""  # stderr is not a terminal and nothing asked for the bar: none


@pytest.mark.e2e
def test_a_tag_directory_as_source_reshards_that_tag(trained, tmp_path):
    """`reshard ckpt/global_stepN DST` is `reshard ckpt DST --tag global_stepN`: the same files, and
    DST a save directory with `latest`; `inspect` reads it too."""
    source, _ = trained("z2_fp32", 2)
    tag = (Path(source) / "latest").read_text().strip()
    by_tag_dir = reshard_in_process(Path(source) / tag, tmp_path / "a", "--target-dp", "3", "--quiet")
    assert by_tag_dir.returncode == 0, by_tag_dir.stderr
    assert f"reshard done: {source} (tag {tag}) -> {tmp_path / 'a'}" in by_tag_dir.stdout
    by_save_dir = reshard_in_process(source, tmp_path / "b", "--target-dp", "3", "--tag", tag, "--quiet")
    assert by_save_dir.returncode == 0, by_save_dir.stderr
    assert (tmp_path / "a" / "latest").read_text() == tag
    names = sorted(os.listdir(tmp_path / "b" / tag))
    assert sorted(os.listdir(tmp_path / "a" / tag)) == names
    for name in names:
        assert (tmp_path / "a" / tag / name).read_bytes() == (tmp_path / "b" / tag / name).read_bytes(), name
    inspected = reshard_in_process("inspect", Path(source) / tag, "--json")
    assert inspected.returncode == 0, inspected.stderr
    report = json.loads(inspected.stdout)
    assert report["save_dir"] == str(source) and report["tag"] == tag and report["total_bytes"] > 0
    exports = [reshard_in_process("export", src, tmp_path / name, "--format", "safetensors")
               for src, name in ((Path(source) / tag, "exported-a"), (source, "exported-b"))]
    assert [e.returncode for e in exports] == [0, 0], [e.stderr for e in exports]
    assert tree_files(tmp_path / "exported-a") == tree_files(tmp_path / "exported-b")
    # DST inside the save directory the tag directory belongs to is inside the source: refused
    inside = reshard_in_process(Path(source) / tag, Path(source) / "out", "--target-dp", "3")
    assert inside.returncode == 2 and "inside the source" in inside.stderr and not (Path(source) / "out").exists()


@pytest.mark.e2e
def test_under_torchrun_only_worker_0_draws_the_progress_bar(trained, tmp_path):
    """Two torchrun workers, each one's stderr in its own file (torchrun --redirects 2), the bar asked
    for (RESHARD_PROGRESS=1): worker 0's file holds it, worker 1's holds none; stdout closed early."""
    from reshard_proof.launch import child_env
    source, _ = trained("z2_fp32", 2)
    tag = (Path(source) / "latest").read_text().strip()
    logs = tmp_path / "logs"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               f"--log-dir={logs}", "--redirects=2", "-m", "reshard", str(source), str(tmp_path / "dst"),
               "--target-dp", "3", "--memory-budget", "16K"]
    process = subprocess.Popen(command, env=child_env({"RESHARD_PROGRESS": "1"}), cwd=REPO,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    process.stdout.close()
    agent = process.stderr.read()
    assert process.wait(timeout=300) == 0, agent
    assert (tmp_path / "dst" / "latest").read_text() == tag
    worker_stderr = {int(path.parent.name): path.read_text() for path in logs.rglob("stderr.log")}
    assert sorted(worker_stderr) == [0, 1], list(logs.rglob("*"))
    assert f"reshard {tag}: 100%" in worker_stderr[0], worker_stderr[0]
    assert worker_stderr[1] == "", worker_stderr[1]
    assert "Traceback" not in agent + worker_stderr[0], agent


@pytest.mark.e2e
def test_pipeline_reshards_draw_the_rounds_bar(pipeline_runs, tp_saves, tmp_path, monkeypatch):
    """Every pipeline reshard runs in rounds on the main road (issue 37), a tp change too (it was the last
    collective case on the whole-file job, whose bar counted worker 0's files): each draws the rounds' bar,
    --quiet none (in this process: the session's shared pipeline saves, no launch of its own)."""
    monkeypatch.setenv("RESHARD_PROGRESS", "1")
    # the saves' batch configs are for their own dp; the target job brings its own (as every pipeline test says)
    layers = ("--pipeline-layers", "7", "--pipeline-tied", "embed:0,6", "--ignore-batch-config")
    save_dir, _ = tp_saves["fp32-mp2u"]
    tag = (Path(save_dir) / "latest").read_text().strip()
    tp_change = ("--target-dp", "2", "--target-tp", "1", *layers)
    done = reshard_in_process(save_dir, tmp_path / "out", *tp_change)
    assert done.returncode == 0, done.stderr
    assert f"reshard {tag}: 100%" in done.stderr and "files written by worker 0" not in done.stderr, done.stderr
    quiet = reshard_in_process(save_dir, tmp_path / "quiet", *tp_change, "--quiet")
    assert quiet.returncode == 0 and f"reshard {tag}" not in quiet.stderr, quiet.stderr
    save_dir, _ = pipeline_runs("fp32", 2, 1)
    tag = (Path(save_dir) / "latest").read_text().strip()
    by_rounds = reshard_in_process(save_dir, tmp_path / "rounds", "--target-dp", "2", "--ignore-batch-config")
    assert by_rounds.returncode == 0, by_rounds.stderr
    assert f"reshard {tag}: 100%" in by_rounds.stderr and "files written by worker 0" not in by_rounds.stderr, \
        by_rounds.stderr


@pytest.mark.e2e
def test_an_array_task_and_verify_draw_their_bars(trained, tmp_path, monkeypatch):
    """In this process, RESHARD_PROGRESS=1: an array task draws the rounds of its own share (each task
    runs alone), `verify` the bytes it re-hashes and, with --against, the rounds it replays."""
    source, _ = trained("z2_fp32", 2)
    monkeypatch.setenv("RESHARD_PROGRESS", "1")
    task = reshard_in_process(source, tmp_path / "dst", "--target-dp", "3", "--array-task", "0", "--array-tasks", "1")
    assert task.returncode == 0, task.stderr
    assert "reshard task 0: 100%" in task.stderr, task.stderr
    for extra in ([], ["--against", str(source)]):
        checked = reshard_in_process("verify", tmp_path / "dst", *extra)
        assert checked.returncode == 0 and "verify: 100%" in checked.stderr, checked.stderr
    quiet = reshard_in_process("verify", tmp_path / "dst", "--against", str(source), "--quiet")
    assert quiet.returncode == 0 and quiet.stderr == "", quiet.stderr
    assert os.environ["RESHARD_PROGRESS"] == "1"  # --quiet held for that command only
