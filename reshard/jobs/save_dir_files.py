"""Files a save directory holds beside DeepSpeed's own, carried over unchanged into DST.

    from reshard.jobs.save_dir_files import list_save_dir_files
    list_save_dir_files("/out/checkpoint-3")
    # ["config.json", "rng_state_0.pth", "rng_state_1.pth", "tokenizer/vocab.json", "trainer_state.json", ...]

The Hugging Face Trainer keeps its own state in the save directory next to DeepSpeed's tag
directory (`checkpoint-N/trainer_state.json`, `rng_state_{rank}.pth`, `training_args.bin`,
`config.json`, `model.safetensors`, tokenizer files), Accelerate its `random_states_{rank}.pkl`,
users anything else. A resume needs them all, so every file of the save directory is carried,
sub-directories included, except what DeepSpeed itself writes there (`latest`, the recovery
scripts, which reshard writes anew) and the tag directories (the ZeRO files: resharded, or not
selected), and reshard's own staging and lock.

They go through the same guarantees as the tag's files: copied into staging
(DST/.reshard-staging/TAG/.reshard-save-dir/, inside the tag's staging so that a failed run's
clean-up and a resume treat them alike), hashed into the tag's manifest under names relative to
the tag directory ("../trainer_state.json", so `reshard verify` re-hashes them as they are), moved
into place before the tag directory and `latest`; every path written is confined to DST
(`reshard.files.paths`), as for the tag's own files. Their sizes and mtimes join the source identity, so a
changed trainer_state.json is a different output.
"""
from __future__ import annotations

import os
import re
import shutil

from reshard.files.byte_io import hash_file
from reshard.jobs.destination import SAVE_DIR_NAMES
from reshard.files.paths import confined, open_new_file

PREFIX = "../"
"""Manifest and source-identity names of save-directory files are relative to the tag directory."""


def list_save_dir_files(save_dir: str) -> list[str]:
    """Paths (relative to `save_dir`, '/'-separated, sorted) of every file to carry."""
    from reshard.jobs.runs import is_tag_dir
    found = []
    for name in sorted(os.listdir(save_dir)):
        path = os.path.join(save_dir, name)
        if name in SAVE_DIR_NAMES or is_tag_dir(path):
            continue
        if os.path.isfile(path):
            found.append(name)
        elif os.path.isdir(path):
            for root, dirs, files in os.walk(path):
                dirs.sort()
                relative = os.path.relpath(root, save_dir).replace(os.sep, "/")
                found += [f"{relative}/{f}" for f in sorted(files) if os.path.isfile(os.path.join(root, f))]
    return sorted(found)


_PER_RANK_RNG = re.compile(r"^(rng_state_|random_states_)(\d+)(\.pth|\.pkl)$")
"""transformers trainer.py `_save_rng_state` / accelerate checkpointing.py `save_accelerator_state`."""


def per_rank_rng_notes(files, target_dp: int) -> list[str]:
    """What happens to per-rank RNG files at `target_dp` ranks. No RNG stream is invented: ranks
    without a file keep the fresh one their job seeded (both frameworks log that and go on)."""
    ranks_of: dict[tuple[str, str], list[int]] = {}
    for name in files:
        match = _PER_RANK_RNG.match(name)
        if match:
            ranks_of.setdefault((match[1], match[3]), []).append(int(match[2]))
    notes = []
    for (prefix, suffix), ranks in sorted(ranks_of.items()):
        present = set(ranks)
        missing = [r for r in range(target_dp) if r not in present]
        unread = sorted(r for r in present if r >= target_dp)
        if prefix == "rng_state_" and target_dp == 1 and "rng_state.pth" not in files:
            # trainer.py `_load_rng_state`: a one-process job reads rng_state.pth, never rng_state_{rank}.pth
            notes.append("at 1 rank the Trainer reads rng_state.pth, not rng_state_{rank}.pth, and this checkpoint has "
                         "none: it resumes with the fresh RNG the job seeds; reshard invents no RNG state")
            continue
        if missing:
            notes.append(f"rank(s) {_span(missing)} of {target_dp} have no {prefix}{{rank}}{suffix}: they resume with "
                         f"the fresh RNG their job seeds (the framework skips restoring it); reshard invents no RNG state")
        if unread:
            notes.append(f"{prefix}{{rank}}{suffix} of rank(s) {_span(unread)} are carried unchanged, but no rank "
                         f"reads them at {target_dp} ranks")
    return notes


def _span(ranks: list[int]) -> str:
    return str(ranks[0]) if len(ranks) == 1 else (f"{ranks[0]}-{ranks[-1]}" if ranks[-1] - ranks[0] == len(ranks) - 1
                                                   else ", ".join(map(str, ranks)))


def manifest_names(files) -> list[str]:
    return [PREFIX + name for name in files]


def top_level_names(files) -> set[str]:
    """What the carried files occupy directly under DST (for the not-empty check on a re-run)."""
    return {name.split("/")[0] for name in files}


STAGED = ".reshard-save-dir"


def staging_dir(staging_tag_dir: str) -> str:
    return os.path.join(staging_tag_dir, STAGED)


def _make_parents(destination: str, path: str) -> None:
    parent = os.path.dirname(os.path.abspath(path))
    if parent != os.path.abspath(destination):  # DST itself exists already
        confined(destination, parent)
        os.makedirs(parent, exist_ok=True)


def stage(save_dir: str, files, staged: str, destination: str) -> dict:
    """Copy `files` into `staged` (emptied first); {manifest name: {"bytes", "blake3"}} of the copies."""
    confined(destination, staged)
    if os.path.lexists(staged):
        shutil.rmtree(staged)
    entries = {}
    for name in files:
        target = os.path.join(staged, name)
        _make_parents(destination, target)
        source = os.path.join(save_dir, name)
        with open(source, "rb") as src, os.fdopen(open_new_file(destination, target), "wb") as out:
            shutil.copyfileobj(src, out, 1 << 20)
            out.flush()
            os.fsync(out.fileno())
        shutil.copystat(source, target)
        entries[PREFIX + name] = {"bytes": os.path.getsize(target), "blake3": hash_file(target)}
    return entries


def publish(staged: str, files, destination: str) -> None:
    """Move the staged copies into `destination`, each by an atomic rename (a link of that name is
    replaced, never followed); then remove the emptied `staged`."""
    for name in files:
        target = confined(destination, os.path.join(destination, name))
        _make_parents(destination, target)
        os.replace(os.path.join(staged, name), target)
    shutil.rmtree(confined(destination, staged), ignore_errors=True)


def differences(source_save_dir: str, destination_save_dir: str) -> tuple[list[str], int]:
    """(problems, files compared): each carried file of the source must be in DST with the same bytes."""
    problems, names = [], list_save_dir_files(source_save_dir)
    for name in names:
        path = os.path.join(destination_save_dir, name)
        if not os.path.isfile(path):
            problems.append(f"{path}: missing (carried from {os.path.join(source_save_dir, name)})")
        elif hash_file(path) != hash_file(os.path.join(source_save_dir, name)):
            problems.append(f"{path}: content differs from {os.path.join(source_save_dir, name)}")
    return problems, len(names)
