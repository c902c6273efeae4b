"""The command line as users run it: dry run, job files, sizes, exit codes.

    python -m pytest tests/test_cli.py -q
"""
from __future__ import annotations

import filecmp
import os
import re

import pytest
from trained import reshard_cli, reshard_in_threads

from reshard.errors import OptionError
from reshard.jobs.options import ReshardOptions, parse_size
from reshard.jobs.results import PHASES

# the checkpoints its tests ask `trained` for, trained with the session's others (conftest.py)
pytestmark = pytest.mark.trains(("z3_bf16", 2), ("z2_fp32", 2))


@pytest.mark.parametrize("text,expected", [("512M", 512 << 20), ("4G", 4 << 30), ("1.5G", int(1.5 * (1 << 30))),
                                           ("65536", 65536), ("8KiB", 8 << 10), ("2t", 2 << 40)])
def test_sizes(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "lots", "4X", "-1G"])
def test_bad_sizes_are_refused(text):
    with pytest.raises(OptionError, match="size"):
        parse_size(text)


def test_yaml_job_file_with_unknown_key_is_refused(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text("source: /a\ndestination: /b\ntarget_dp: 4\nbudget: 1G\n")
    with pytest.raises(OptionError, match="unknown option.*budget"):
        ReshardOptions.from_yaml(str(job))


def test_help_lists_every_subcommand_with_one_line(capsys):
    from reshard.cli import SUBCOMMANDS, main
    with pytest.raises(SystemExit) as exited:
        main(["--help"])
    assert exited.value.code == 0
    help_text = capsys.readouterr().out
    for name in SUBCOMMANDS:
        lines = [line for line in help_text.splitlines() if line.startswith(f"  {name} ")]
        assert len(lines) == 1 and len(lines[0].split(None, 1)[1]) > 20, (name, help_text)
    assert set(SUBCOMMANDS) == {"verify", "inspect", "export", "publish"}


def test_missing_target_dp_is_named(tmp_path, capsys):
    from reshard.cli import main
    assert main(["a", "b"]) == 2
    assert "--target-dp is required" in capsys.readouterr().err
    job = tmp_path / "job.yaml"
    job.write_text("source: a\ndestination: b\n")
    assert main(["--config", str(job)]) == 2
    assert "--target-dp is required" in capsys.readouterr().err
    assert main(["a", "b", "--target-dp", "0"]) == 2  # given but wrong: says what it got
    assert "--target-dp must be an integer >= 1, got 0" in capsys.readouterr().err


def test_flags_are_made_from_the_options_fields():
    """One flag per ReshardOptions field, its help the field's docstring; parsed flags give the same
    options as the keyword arguments."""
    import dataclasses

    from reshard.cli import build_parser, options_from_args
    from reshard.jobs.options import field_docs
    parser = build_parser()
    fields = [field.name for field in dataclasses.fields(ReshardOptions)]
    assert sorted(action.dest for action in parser._actions if action.dest != "help") == sorted(fields + ["config"])
    docs = field_docs(ReshardOptions)
    assert set(docs) == set(fields) and all(docs.values())
    help_text = " ".join(parser.format_help().split())
    assert "Bytes of slices one worker holds at once" in help_text and "(default 1G)" in help_text
    args = parser.parse_args(["a", "b", "--target-dp", "3", "--target-stage", "3", "--memory-budget", "4K",
                              "--backend", "gloo", "--quiet", "--timeout", "7.5", "--workers", "2"])
    assert options_from_args(args) == ReshardOptions(source="a", destination="b", target_dp=3, target_stage=3,
                                                     memory_budget=4096, backend="gloo", quiet=True, timeout=7.5,
                                                     workers=2).validate()
    with pytest.raises(SystemExit) as refused:
        parser.parse_args(["a", "b", "--target-stage", "4"])
    assert refused.value.code == 2


@pytest.mark.parametrize("command", [["inspect", "SRC"], ["export", "SRC", "OUT", "--format", "universal"]])
def test_inspect_and_export_take_no_target_ep(command, capsys):
    """They never used it: an option that does nothing is refused, not silently accepted."""
    from reshard.cli import main
    with pytest.raises(SystemExit) as refused:
        main(command + ["--target-ep", "2"])
    assert refused.value.code == 2 and "unrecognized arguments: --target-ep 2" in capsys.readouterr().err


@pytest.mark.e2e
def test_dry_run_prints_the_plan_and_touches_nothing(trained, tmp_path, monkeypatch):
    source, _ = trained("z3_bf16", 2)
    destination = tmp_path / "dst"
    result = reshard_cli(source, destination, "--target-dp", "3", "--dry-run", "--memory-budget", "4K")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert out.startswith("reshard plan:") and "ZeRO-3 bfloat16, 2 dp ranks" in out and "3 dp ranks" in out
    assert "reads ranks" in out and "send" in out and "receive" in out
    assert not destination.exists()
    # and in-process, with every tensor read made to fail: a dry run reads no tensor
    import reshard.formats.torch_bytes.torch_archive as archive

    def no_reads(*args, **kwargs):
        raise AssertionError("a dry run read tensor bytes")
    monkeypatch.setattr(archive.os, "preadv", no_reads)
    monkeypatch.setattr(archive.os, "pwritev", no_reads)
    plan = reshard_in_threads(source, destination, 3, 2, dry_run=True).checkpoints[0]
    traffic = plan.plan.traffic()
    assert sum(t.bytes_read for t in traffic) == sum(t.bytes_written for t in traffic) > 0
    assert not destination.exists()


@pytest.mark.e2e
def test_job_file_runs_and_flags_override_it(trained, tmp_path):
    source, _ = trained("z2_fp32", 2)
    job = tmp_path / "job.yaml"
    job.write_text(f"source: {source}\ndestination: {tmp_path / 'from-yaml'}\ntarget_dp: 4\n"
                   f"memory_budget: 8K\nquiet: true\n")
    result = reshard_cli("--config", job, "--target-dp", "3")
    assert result.returncode == 0, result.stderr
    assert "3 dp ranks" in result.stdout and "8.0 KiB budget" in result.stdout
    # quiet: no progress bar, but the summary's one line of wall seconds per phase stays
    assert "reshard:" not in result.stderr and "%|" not in result.stderr
    phases = dict(re.findall(r"([a-z+-]+) (\d+\.\d\d) s", _line(result.stdout, "  phases : ")))
    assert list(phases) == list(PHASES)
    assert float(phases["start-up"]) > 0.1  # counts the interpreter and imports, from the process start
    tag = (tmp_path / "from-yaml" / "latest").read_text()
    assert sorted(os.listdir(tmp_path / "from-yaml" / tag))[-1] == "zero_pp_rank_2_mp_rank_00_optim_states.pt"


def _line(text: str, prefix: str) -> str:
    found = [line for line in text.splitlines() if line.startswith(prefix)]
    assert len(found) == 1, text
    return found[0][len(prefix):]


@pytest.mark.e2e
def test_workers_flag_runs_forked_workers_without_torchrun(trained, tmp_path):
    source, _ = trained("z2_fp32", 2)
    result = reshard_cli(source, tmp_path / "forked", "--target-dp", "3", "--workers", "2", "--memory-budget", "4K",
                         "--quiet")
    assert result.returncode == 0, result.stderr
    assert "2 workers over shared memory (forked workers)" in result.stdout
    reshard_in_threads(source, tmp_path / "threads", 3, 1)
    tag = (tmp_path / "threads" / "latest").read_text()
    names = sorted(os.listdir(tmp_path / "threads" / tag))
    assert sorted(os.listdir(tmp_path / "forked" / tag)) == names
    match, mismatch, errors = filecmp.cmpfiles(tmp_path / "threads" / tag, tmp_path / "forked" / tag, names,
                                               shallow=False)
    assert mismatch == [] and errors == []

    (tmp_path / "a-file").write_text("")
    refused = reshard_cli(source, tmp_path / "a-file", "--target-dp", "3", "--workers", "2")
    assert refused.returncode == 2 and "a-file" in refused.stderr and refused.stdout == ""
