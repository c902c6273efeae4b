"""Hostile input: tags that point outside, links inside DST, swapped rank files, bad option
values, a full disk, too many files, sub-directories in the tag directory.

    python -m pytest tests/test_path_safety.py -q

Refusals run reshard.cli.main in this process (trained.reshard_in_process: what they check is the
message and what is left on disk); the cases that write an output, the full disk and the open-file
limit run `python -m reshard`. Every case works on a private copy of a real DeepSpeed checkpoint. Besides the checks of each
case, every case hashes a victim directory beside SRC and DST (a copy of the tag directory, the
thing a crafted `latest` would aim at) and lists every path under the test's directory before
and after: nothing outside DST may change or appear.
"""
from __future__ import annotations

import errno
import json
import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from trained import REPO, reshard_cli, reshard_in_process, reshard_in_threads, tree_state


VARIANT, N = "z2_fp32", 2
# the checkpoints its tests ask `trained` for, trained with the session's others (conftest.py)
pytestmark = [pytest.mark.e2e, pytest.mark.trains((VARIANT, N), ("z3_fp32", 2))]


@pytest.fixture
def world(trained, tmp_path):
    """tmp/src (a copy of a real 2-rank ZeRO-2 checkpoint), tmp/other/src/TAG (a victim: another
    run's tag directory) and tmp/dst (not created). Checks afterwards that nothing outside DST
    changed."""
    original, _ = trained(VARIANT, N)
    src = tmp_path / "src"
    shutil.copytree(original, src)
    tag = (src / "latest").read_text().strip()
    victim = tmp_path / "other" / "src" / tag
    shutil.copytree(src / tag, victim)
    dst = tmp_path / "dst"
    sealed = {}

    def seal():
        """Call once the case has prepared its input: from here on nothing outside DST may change."""
        sealed["before"] = tree_state(tmp_path, skip=dst)

    yield {"src": src, "tag": tag, "victim": victim, "dst": dst, "root": tmp_path, "seal": seal}
    assert "before" in sealed, "the case never sealed its input"
    assert victim.is_dir(), "the victim directory outside SRC and DST was deleted"
    assert tree_state(tmp_path, skip=dst) == sealed["before"], "something outside DST changed or appeared"


def _refused(result: subprocess.CompletedProcess, *fragments: str) -> str:
    assert result.returncode == 2, result.stdout + result.stderr
    message = result.stderr.strip()
    assert message.startswith("reshard: error: ") and "\n" not in message, message
    assert "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    return message


@pytest.mark.parametrize("case", ["latest-absolute", "tag-absolute", "tag-escapes-to-other",
                                  "tag-escapes-to-sibling", "latest-dotdot", "latest-separator",
                                  "latest-nul", "tag-dot"])
def test_a_tag_never_reaches_outside(world, case):
    src, dst, victim = world["src"], world["dst"], world["victim"]
    args = [src, dst, "--target-dp", "3"]
    if case == "latest-absolute":  # the reported data loss: reshard deleted this directory
        (src / "latest").write_text(str(victim))
        expected = [str(src / "latest"), "absolute path"]
    elif case == "tag-absolute":
        args += ["--tag", str(victim)]
        expected = ["--tag", "absolute path"]
    elif case == "tag-escapes-to-other":
        args += ["--tag", f"../../other/src/{world['tag']}"]
        expected = ["--tag", "separator"]
    elif case == "tag-escapes-to-sibling":
        args += ["--tag", f"../src/{world['tag']}"]
        expected = ["--tag", "separator"]
    elif case == "latest-dotdot":
        (src / "latest").write_text("..")
        expected = [str(src / "latest"), "relative path component"]
    elif case == "latest-separator":
        (src / "latest").write_text(f"../other/src/{world['tag']}")
        expected = [str(src / "latest"), "separator"]
    elif case == "latest-nul":
        (src / "latest").write_bytes(world["tag"].encode() + b"\x00x")
        expected = [str(src / "latest"), "NUL"]
    elif case == "tag-dot":
        args += ["--tag", "."]
        expected = ["--tag", "relative path component"]
    world["seal"]()
    _refused(reshard_in_process(*args), *expected)
    assert not dst.exists()


def test_a_tag_of_a_run_directory_is_checked_too(world):
    """A run directory (actor/critic save directories one level down) with a crafted `latest`."""
    src, dst, root = world["src"], world["dst"], world["root"]
    run = root / "run"
    shutil.copytree(src, run / "_actor")
    (run / "_actor" / "latest").write_text(str(world["victim"]))
    world["seal"]()
    _refused(reshard_in_process(run, dst, "--target-dp", "3"), str(run / "_actor" / "latest"), "absolute path")
    assert not dst.exists()


def test_links_inside_dst_are_replaced_not_followed(world):
    """A destination re-used with --overwrite, holding links that point outside it."""
    src, dst, root = world["src"], world["dst"], world["root"]
    outside = root / "outside.txt"
    outside.write_text("must stay")
    dst.mkdir()
    (dst / "latest").symlink_to(outside)
    (dst / "zero_to_fp32.py").symlink_to(outside)
    (dst / world["tag"]).symlink_to(world["victim"], target_is_directory=True)
    world["seal"]()
    result = reshard_cli(src, dst, "--target-dp", "3", "--overwrite", "--quiet")
    assert result.returncode == 0, result.stderr
    assert outside.read_text() == "must stay"
    assert not (dst / "latest").is_symlink() and (dst / "latest").read_text() == world["tag"]
    assert not (dst / "zero_to_fp32.py").is_symlink()
    assert not (dst / world["tag"]).is_symlink() and (dst / world["tag"] / "reshard_manifest.json").is_file()


def test_a_staging_link_or_foreign_staging_is_refused(world):
    src, dst, root = world["src"], world["dst"], world["root"]
    elsewhere = root / "elsewhere"
    elsewhere.mkdir()
    dst.mkdir()
    (dst / ".reshard-staging").symlink_to(elsewhere, target_is_directory=True)
    world["seal"]()
    _refused(reshard_in_process(src, dst, "--target-dp", "3"), ".reshard-staging", "symbolic link")
    assert list(elsewhere.iterdir()) == []
    (dst / ".reshard-staging").unlink()
    foreign = dst / ".reshard-staging" / world["tag"]
    foreign.mkdir(parents=True)
    (foreign / "keep.txt").write_text("not reshard's")
    _refused(reshard_in_process(src, dst, "--target-dp", "3"), str(foreign), "not made by reshard")
    assert (foreign / "keep.txt").read_text() == "not reshard's"


@pytest.mark.parametrize("flags,fragment", [
    (["--memory-budget", "-5"], "--memory-budget"),
    (["--memory-budget", "abc"], "--memory-budget"),
    (["--memory-budget", "1e3"], "--memory-budget"),
    (["--memory-budget", "12"], "at least 1K"),
    (["--durable-every", "abc"], "--durable-every"),
    (["--durable-every", "0"], "--durable-every"),
    (["--timeout", "-1"], "--timeout"),
    (["--timeout", "nan"], "--timeout"),
    (["--timeout", "soon"], "--timeout"),
    (["--target-dp", "three"], "--target-dp"),
    (["--target-dp", "2.5"], "--target-dp"),
    (["--backend", "carrier-pigeon"], "--backend"),
    (["--no-such-flag"], "--no-such-flag"),
    (["--config", "/nonexistent/job.yaml"], "/nonexistent/job.yaml"),
])
def test_every_bad_option_value_exits_2_in_one_line(world, flags, fragment):
    args = [world["src"], world["dst"], *(["--target-dp", "3"] if "--target-dp" not in flags else []), *flags]
    world["seal"]()
    _refused(reshard_in_process(*args), fragment)
    assert not world["dst"].exists()


def test_bad_yaml_values_exit_2(world):
    job = world["root"] / "job.yaml"
    for text, fragment in [("target_dp: [\n", "not valid YAML"), ("target_dp: '3'\n", "--target-dp"),
                           ("target_dp: 3\nmemory_budget: lots\n", "cannot read size"),
                           ("target_dp: 3\ndurable_every: -1\n", "cannot read size"),
                           ("target_dp: 3\ntag: /etc\n", "absolute path")]:
        job.write_text(f"source: {world['src']}\ndestination: {world['dst']}\n{text}")
        world["seal"]()
        _refused(reshard_in_process("--config", job), fragment)


SWAPS = [("z1_fp32", "zero_pp_rank_{}_mp_rank_00_optim_states.pt"),
         ("z2_fp32", "zero_pp_rank_{}_mp_rank_00_optim_states.pt"),
         ("bf16_optimizer", "bf16_zero_pp_rank_{}_mp_rank_00_optim_states.pt")]


@pytest.mark.trains(*[(variant, 2) for variant, _ in SWAPS])
@pytest.mark.parametrize("variant,pattern", SWAPS, ids=[v for v, _ in SWAPS])
def test_swapped_rank_files_are_refused_by_name(trained, tmp_path, variant, pattern):
    original, _ = trained(variant, 2)
    src = tmp_path / "src"
    shutil.copytree(original, src)
    tag_dir = src / (src / "latest").read_text().strip()
    a, b = tag_dir / pattern.format(0), tag_dir / pattern.format(1)
    a.rename(tag_dir / "swap"), b.rename(a), (tag_dir / "swap").rename(b)
    before = tree_state(src)
    _refused(reshard_in_process(src, tmp_path / "dst", "--target-dp", "3"), str(a), "holds the partition of dp rank 1",
             "renamed or swapped")
    assert tree_state(src) == before and not (tmp_path / "dst").exists()


def test_zero3_swapped_ranks_cannot_be_seen_and_the_summary_says_so(trained, tmp_path):
    """ZeRO-3 files carry nothing that names their rank (stage3.py `_rigid_state_dict`): the job
    cannot refuse a swap, so the summary and the dry run say how to check."""
    original, _ = trained("z3_fp32", 2)
    dry = reshard_cli(original, tmp_path / "dst", "--target-dp", "3", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    run = reshard_cli(original, tmp_path / "dst", "--target-dp", "3", "--quiet")
    assert run.returncode == 0, run.stderr
    for output in (dry.stdout, run.stdout):
        assert "ZeRO-3 rank files carry nothing that identifies their rank" in output, output


def _mount_tmpfs(path: Path, size: str) -> bool:
    path.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True).returncode == 0


def test_a_destination_without_space_is_refused_before_writing(world, monkeypatch):
    """A 40 KiB tmpfs as DST (or, where mounting is not allowed, a file system said to be that full)."""
    small = world["root"] / "small"
    world["seal"]()
    mounted = _mount_tmpfs(small, "40k")
    try:
        dst = small / "dst"
        if mounted:
            result = reshard_cli(world["src"], dst, "--target-dp", "3")
            message = _refused(result, f"no space left on {dst}", "needed about", "free", "nothing was written")
        else:
            import reshard.files.resources as resources
            monkeypatch.setattr(resources, "free_bytes", lambda path: 40 << 10)
            from reshard.errors import OptionError
            with pytest.raises(OptionError) as refused:
                reshard_in_threads(world["src"], dst, 3, 1)
            message = str(refused.value)
            assert f"no space left on {dst}" in message and "needed about" in message
        assert "stays in" not in message
        assert not dst.exists()
    finally:
        if mounted:
            subprocess.run(["umount", str(small)], check=True)
        small.rmdir()


@pytest.mark.parametrize("writer", ["torch_free", "torch"])
def test_a_disk_that_fills_while_skeletons_are_written_says_what_was_kept(world, monkeypatch, writer):
    """A full disk while skeletons are written (torch.save reports it as "unexpected pos ...",
    reshard's own archive writer as ENOSPC); the message names the cause, and says truthfully
    that nothing was kept (the failure came before the rounds)."""
    import torch

    import reshard.formats.torch_bytes.torch_pickle as torch_pickle
    import reshard.formats.torch_bytes.torch_zip as torch_zip
    import reshard.files.resources as resources
    saves = {"count": 0}

    def full_after_one():
        saves["count"] += 1
        if saves["count"] > 1:
            monkeypatch.setattr(resources, "free_bytes", lambda path: 0)
            return True
        return False

    if writer == "torch":
        real_save = torch.save

        def torch_save(obj, path, *args, **kwargs):
            if full_after_one():
                raise RuntimeError("[enforce fail at inline_container.cc:626] . unexpected pos 9792 vs 9696")
            return real_save(obj, path, *args, **kwargs)

        def needs_torch(path, tree, *stand_ins):
            raise torch_pickle.NeedsTorch("forced by the test")
        monkeypatch.setattr(torch, "save", torch_save)
        monkeypatch.setattr(torch_pickle, "write_skeleton_tree", needs_torch)
    else:
        real_finish = torch_zip.ArchiveWriter.finish

        def finish(self):
            if full_after_one():
                self.close()
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self.path)
            return real_finish(self)
        monkeypatch.setattr(torch_zip.ArchiveWriter, "finish", finish)
    world["seal"]()
    from reshard.errors import ReshardError
    with pytest.raises(ReshardError) as failed:
        reshard_in_threads(world["src"], world["dst"], 3, 1)
    message = str(failed.value)
    assert "no space left on" in message and "needed about" in message, message
    assert "stays in" not in message and "Nothing was kept" in message, message
    assert not world["dst"].exists()


def test_too_many_target_files_for_the_open_file_limit_is_refused_up_front(world):
    """Writing 5000 target ranks with one worker keeps 5000+ files open: under a 1024-file limit
    the job is refused before anything is created, with what to change."""
    def low_limit():
        resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH=str(REPO))
    world["seal"]()
    result = subprocess.run([sys.executable, "-m", "reshard", str(world["src"]), str(world["dst"]),
                             "--target-dp", "5000", "--ignore-batch-config"], capture_output=True, text=True,
                            env=env, cwd=REPO, timeout=300, preexec_fn=low_limit)
    _refused(result, "open-file limit", "1024", "ulimit -n", "more workers")
    assert not world["dst"].exists()


def test_sub_directories_of_the_tag_directory_are_carried_over(world):
    src, dst, tag = world["src"], world["dst"], world["tag"]
    (src / tag / "extras" / "nested").mkdir(parents=True)
    (src / tag / "extras" / "nested" / "sampler.json").write_text('{"position": 17}')
    (src / tag / "extras" / "notes.txt").write_text("kept")
    (src / tag / "empty").mkdir()
    world["seal"]()
    result = reshard_cli(src, dst, "--target-dp", "3", "--quiet")
    assert result.returncode == 0, result.stderr
    out = dst / tag
    assert (out / "extras" / "nested" / "sampler.json").read_text() == '{"position": 17}'
    assert (out / "extras" / "notes.txt").read_text() == "kept" and (out / "empty").is_dir()
    manifest = json.loads((out / "reshard_manifest.json").read_text())
    assert {"extras/nested/sampler.json", "extras/notes.txt"} <= set(manifest["files"])
    assert reshard_cli("verify", dst).returncode == 0
    (out / "extras" / "notes.txt").write_text("changed")
    assert reshard_cli("verify", dst).returncode == 1


def test_a_linked_sub_directory_is_refused_by_name(world):
    src, tag = world["src"], world["tag"]
    (src / tag / "linked").symlink_to(world["victim"], target_is_directory=True)
    world["seal"]()
    _refused(reshard_in_process(src, world["dst"], "--target-dp", "3"), str(src / tag / "linked"), "symbolic link")
    assert not world["dst"].exists()


def test_a_write_failure_after_the_rounds_began_keeps_staging_and_says_so(world, monkeypatch):
    import reshard.formats.torch_bytes.torch_archive as archive
    real_pwritev, written = os.pwritev, {"bytes": 0}

    def failing(fd, buffers, offset):
        written["bytes"] += sum(len(b) for b in buffers)
        if written["bytes"] > 1500:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real_pwritev(fd, buffers, offset)

    monkeypatch.setattr(archive.os, "pwritev", failing)
    world["seal"]()
    from reshard.errors import ReshardError
    with pytest.raises(ReshardError) as failed:
        reshard_in_threads(world["src"], world["dst"], 3, 2, memory_budget=2048)
    message = str(failed.value)
    staging = world["dst"] / ".reshard-staging" / world["tag"]
    assert os.strerror(errno.EIO) in message and f"stays in {staging}" in message, message
    assert staging.is_dir() and not (world["dst"] / "latest").exists()
