"""What a job reshards: one save directory, or every save directory of a run (actor, critic, ...).

    from reshard.jobs.runs import discover_units
    units, notes = discover_units("/ckpt/ppo", "/ckpt/ppo-dp16", all_tags=True)
    # [Unit(source="/ckpt/ppo/_actor", tag="global_step10", destination="/ckpt/ppo-dp16/_actor"), ...]

SRC is a DeepSpeed save directory when it holds `latest` or tag directories with ZeRO files.
Otherwise its sub-directories that are save directories are taken, one level deep (OpenRLHF
keeps `CKPT/_actor` and `CKPT/_critic`), and mirrored under DST. In each save directory the
tag is `--tag`, or every tag directory with `--all-tags` (`best_*` included), or the one
`latest` names. A `latest_universal` pointer is reported, never followed: reshard reads the
native ZeRO files. A tag directory given as SRC (`ckpt/global_step3`) stands for its save
directory with `--tag global_step3` (`as_save_dir`): DST is then a save directory too, and
receives DST/global_step3 and DST/latest.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

from reshard.errors import CheckpointError
from reshard.formats.deepspeed_files import deepspeed_schema as schema
from reshard.formats.deepspeed_files.deepspeed_inspect import resolve_tag
from reshard.formats.deepspeed_files.deepspeed_zero0_moe import is_zero0_moe


@dataclass(frozen=True)
class Unit:
    """One checkpoint (save directory + tag) and where its reshard goes."""

    source: str
    tag: str
    destination: str
    latest: str | None
    """Tag to write into the destination's `latest` once this save directory is done (None: none)."""


def is_tag_dir(path: str) -> bool:
    """Whether `path` is a DeepSpeed tag directory: it holds ZeRO optimizer files, or a ZeRO-0 MoE
    save's per-EP-rank ones (`expp_rank_{e}`), which are not a save directory's files to carry."""
    return os.path.isdir(path) and (any(schema.classify(n).kind == "optim" for n in os.listdir(path))
                                    or is_zero0_moe(path))


def holds_checkpoint_files(path: str) -> bool:
    """Whether `path` holds DeepSpeed checkpoint files directly (model states, ZeRO or layer files):
    a tag directory."""
    return os.path.isdir(path) and any(schema.classify(n).kind != "other" for n in os.listdir(path))


def as_save_dir(source: str, tag: str | None = None, all_tags: bool = False) -> tuple[str, str | None]:
    """(save directory, tag) for SRC as a user gave it: a save directory as it is, with `tag`; or a
    tag directory (`ckpt/global_step3`: DeepSpeed's files directly in it, and its parent's `latest`
    names it or there is none) as its parent and its name, so that `reshard ckpt/global_step3 DST`
    is `reshard ckpt DST --tag global_step3`. Anything else comes back as given."""
    path = os.path.abspath(source)
    if is_save_dir(path) or not holds_checkpoint_files(path):
        return source, tag
    parent, name = os.path.split(path.rstrip(os.sep))
    latest = os.path.join(parent, schema.LATEST)
    if os.path.isfile(latest):
        with open(latest) as fd:
            named = fd.read().strip()
        if named != name:
            raise CheckpointError(path, f"is a tag directory, but {latest} names tag {named!r}, not {name!r}: "
                                        f"to read this one, pass its save directory and the tag: {parent} --tag {name}")
    if tag is not None and tag != name:
        raise CheckpointError(path, f"is the tag directory of tag {name!r}, but --tag {tag} was given: "
                                    f"pass the save directory {parent} with --tag {tag}, or drop --tag")
    if all_tags:
        raise CheckpointError(path, f"is one tag directory: --all-tags takes the save directory, {parent}")
    return parent, name


def is_save_dir(path: str) -> bool:
    if not os.path.isdir(path):
        return False
    if os.path.isfile(os.path.join(path, schema.LATEST)):
        return True
    return any(is_tag_dir(os.path.join(path, d)) for d in os.listdir(path))


def _natural(name: str):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def discover_units(source: str, destination: str, tag: str | None = None, all_tags: bool = False
                   ) -> tuple[list[Unit], list[str]]:
    source, destination = os.path.abspath(source), os.path.abspath(destination)
    if not os.path.isdir(source):
        raise CheckpointError(source, "is not a directory (expected a DeepSpeed save_dir)")
    if is_save_dir(source):
        pairs = [(source, destination)]
    else:
        children = sorted(d for d in os.listdir(source) if is_save_dir(os.path.join(source, d)))
        if not children:
            raise CheckpointError(os.path.join(source, schema.LATEST),
                                  "does not exist, and no sub-directory is a DeepSpeed save directory either: "
                                  "nothing to reshard here (pass the save_dir given to engine.save_checkpoint)")
        pairs = [(os.path.join(source, d), os.path.join(destination, d)) for d in children]
    units, notes = [], []
    if len(pairs) > 1 or pairs[0][0] != source:
        outside = sorted(set(os.listdir(source)) - {os.path.basename(s) for s, _ in pairs})
        if outside:
            notes.append(f"{source}: {', '.join(outside[:8])}{' ...' if len(outside) > 8 else ''} lie outside every "
                         f"save directory and are not carried (copy them yourself if the resumed job needs them)")
    for save_dir, target in pairs:
        universal = os.path.join(save_dir, "latest_universal")
        if os.path.isfile(universal):
            with open(universal) as fd:
                notes.append(f"{universal} names universal checkpoint {fd.read().strip()!r}; not followed "
                             "(reshard reads the native ZeRO files)")
        latest_tag = None
        if os.path.isfile(os.path.join(save_dir, schema.LATEST)):
            latest_tag = resolve_tag(save_dir, None)
        if all_tags and tag is None:
            tags = sorted((d for d in os.listdir(save_dir) if is_tag_dir(os.path.join(save_dir, d))), key=_natural)
            if not tags:
                raise CheckpointError(save_dir, "holds no tag directory with ZeRO files")
            latest = latest_tag if latest_tag in tags else None
            # the tag `latest` names goes last, so `latest` appears only once everything is there
            tags = [t for t in tags if t != latest] + ([latest] if latest else [])
            units += [Unit(save_dir, t, target, latest if t == latest else None) for t in tags]
        else:
            chosen = resolve_tag(save_dir, tag)
            units.append(Unit(save_dir, chosen, target, chosen))
    return units, notes
