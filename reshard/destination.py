"""The destination save directory: refuse unsafe targets, write into staging, publish atomically.

    from reshard.destination import check_paths, Staging
    check_paths(src, dst)                            # DST inside SRC, unwritable DST, ... refused
    staging = Staging(dst, tag); staging.create()    # DST/.reshard-staging/TAG/
    ...workers write files into staging.tag_dir...
    staging.publish()                                # move into DST/TAG, then write DST/latest

Until `publish` renames the staging directory into place and writes `latest` (last, by
atomic rename), DeepSpeed finds no loadable checkpoint in DST: `load_checkpoint` reads the
tag from `latest`, and a tag directory only appears complete.
"""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass

from reshard.byte_io import hash_file
from reshard.errors import OptionError
from reshard.formats import deepspeed_schema as schema
from reshard.manifest import JOURNAL_NAME
from reshard.paths import check_tag, confined, is_inside, open_new_file

STAGING = ".reshard-staging"


def check_paths(src: str, dst: str) -> None:
    """Refuse destinations that could touch the source, or that cannot be written."""
    src_real, dst_real = os.path.realpath(src), os.path.realpath(dst)
    if is_inside(dst_real, src_real):
        raise OptionError(f"{dst}: the destination is {'the source' if dst_real == src_real else 'inside the source'} "
                          f"{src}; choose a directory outside it (the source is never modified)")
    if is_inside(src_real, dst_real):
        raise OptionError(f"{dst}: the destination contains the source {src}; choose a directory outside it")
    if os.path.exists(dst_real):
        if not os.path.isdir(dst_real):
            raise OptionError(f"{dst}: exists and is not a directory")
        if not os.access(dst_real, os.W_OK | os.X_OK):
            raise OptionError(f"{dst}: is not writable")
    else:
        parent = os.path.dirname(dst_real.rstrip(os.sep)) or "."
        while not os.path.exists(parent):
            parent = os.path.dirname(parent)
        if not os.access(parent, os.W_OK | os.X_OK):
            raise OptionError(f"{dst}: cannot be created, {parent} is not writable")


def check_empty(dst: str, ours: set[str], overwrite: bool) -> None:
    """Refuse a destination holding anything but reshard's own files for this output."""
    if not os.path.isdir(dst) or overwrite:
        return
    leftovers = sorted(n for n in os.listdir(dst) if n not in ours)
    if leftovers:
        raise OptionError(f"{dst}: is not empty ({', '.join(leftovers[:5])}{' ...' if len(leftovers) > 5 else ''}); "
                          "pass --overwrite to replace the tag there")


@dataclass
class Staging:
    """DST/.reshard-staging/TAG: where workers write before the result is published.

    Every path it creates, writes, renames or deletes is checked by `reshard.paths.confined`
    to lie under DST, and it deletes only what reshard made: a staging directory holding
    reshard's journal (this run's or an interrupted earlier run's), and the replaced tag
    directory of an `--overwrite` publish.
    """

    destination: str
    tag: str

    def __post_init__(self):
        check_tag(self.tag, "the job")

    @property
    def root(self) -> str:
        return os.path.join(self.destination, STAGING)

    @property
    def tag_dir(self) -> str:
        return os.path.join(self.root, self.tag)

    def _mkdir(self, path: str) -> None:
        confined(self.destination, path)
        if os.path.islink(path):
            raise OptionError(f"{path}: is a symbolic link; reshard does not write through links inside the "
                              "destination (remove it)")
        os.makedirs(path, exist_ok=True)

    def create(self) -> None:
        """A fresh, empty staging directory; an earlier run's staging there is removed first.

        Something at that path without reshard's journal was not made by reshard: refused."""
        os.makedirs(self.destination, exist_ok=True)
        self._mkdir(self.root)
        confined(self.destination, self.tag_dir)
        if os.path.lexists(self.tag_dir):
            if os.path.islink(self.tag_dir) or not os.path.isfile(os.path.join(self.tag_dir, JOURNAL_NAME)):
                raise OptionError(f"{self.tag_dir}: exists but was not made by reshard (no "
                                  f"{JOURNAL_NAME}); remove it or choose another destination")
            shutil.rmtree(self.tag_dir)
        os.makedirs(self.tag_dir)

    def copy_in(self, directory: str, names, directories=()) -> None:
        """Copy what the source tag directory holds besides DeepSpeed's files (metric.json,
        sub-directories and their files, by relative path) into staging."""
        for name in directories:
            self._mkdir(os.path.join(self.tag_dir, name))
        for name in names:
            target = os.path.join(self.tag_dir, name)
            self._mkdir(os.path.dirname(target))
            with open(os.path.join(directory, name), "rb") as src:
                fd = open_new_file(self.destination, target)
                with os.fdopen(fd, "wb") as out:
                    shutil.copyfileobj(src, out, 1 << 20)
            shutil.copystat(os.path.join(directory, name), target)

    def copy_in_hashed(self, directory: str, names) -> dict:
        """`copy_in` for files, then {name: {"bytes", "blake3"}} of each copy (its manifest entry)."""
        self.copy_in(directory, names)
        return {name: {"bytes": os.path.getsize(os.path.join(self.tag_dir, name)),
                       "blake3": hash_file(os.path.join(self.tag_dir, name))} for name in names}

    def publish(self, latest: str | None, scripts_from: str | None = None) -> None:
        """Move the tag directory into place, then carry DeepSpeed's helpers and write `latest` (last).

        `latest`: the tag to name in DST/latest, or None to leave it (a tag that is not the
        source's latest, resharded with --all-tags). `scripts_from`: the source save directory whose
        recovery scripts are carried, or None for none (DeepSpeed writes them on global rank 0's
        node only; node-local outputs follow that).
        """
        _fsync_dir(self.tag_dir)
        final = confined(self.destination, os.path.join(self.destination, self.tag))
        old = None
        if os.path.islink(final):
            os.unlink(final)  # a link in DST's place: replaced, its target untouched
        elif os.path.exists(final):
            old = confined(self.destination, os.path.join(self.root, f"replaced-{self.tag}"))
            if os.path.lexists(old):
                _remove(old)
            os.rename(final, old)
        os.rename(self.tag_dir, final)
        for script in schema.RECOVERY_SCRIPTS if scripts_from is not None else ():
            copy_recovery_script(script, scripts_from, self.destination)
        if latest is not None:
            write_latest(self.destination, latest)
        if old is not None:
            _remove(old)
        self.discard()

    def discard(self) -> None:
        """Remove staging this job made (it holds reshard's journal, or nothing yet)."""
        if os.path.isdir(self.tag_dir) and not os.path.islink(self.tag_dir):
            if os.path.isfile(os.path.join(self.tag_dir, JOURNAL_NAME)) or not os.listdir(self.tag_dir):
                _remove(confined(self.destination, self.tag_dir))
        if os.path.isdir(self.root) and not os.path.islink(self.root) and not os.listdir(self.root):
            os.rmdir(self.root)


def _remove(path: str) -> None:
    """Remove a file, a link (not its target) or a directory tree."""
    if os.path.islink(path) or not os.path.isdir(path):
        os.unlink(path)
    else:
        shutil.rmtree(path)


def write_latest(destination: str, tag: str) -> None:
    """`latest` names the tag (no newline, as DeepSpeed writes it); replaced atomically."""
    latest = confined(destination, os.path.join(destination, schema.LATEST))
    if os.path.isfile(latest) and not os.path.islink(latest):
        with open(latest) as fd:
            if fd.read() == tag:
                return
    temporary = latest + ".reshard-tmp"
    with os.fdopen(open_new_file(destination, temporary), "w") as fd:
        fd.write(tag)
        fd.flush()
        os.fsync(fd.fileno())
    os.replace(temporary, latest)
    _fsync_dir(destination)


def copy_recovery_script(name: str, source_save_dir: str, save_dir: str) -> None:
    """The source's copy of DeepSpeed's helper (engine.py `_copy_recovery_script`), byte for byte,
    executable as DeepSpeed leaves it; none where the source has none. Never the installed
    DeepSpeed's: its zero_to_fp32.py may not read the files another version wrote."""
    source, target = os.path.join(source_save_dir, name), os.path.join(save_dir, name)
    if not os.path.isfile(source) or os.path.islink(source):
        if os.path.lexists(target):  # an earlier output's (--overwrite), not the source's
            os.unlink(confined(save_dir, target))
        return
    with open(source, "rb") as src, os.fdopen(open_new_file(save_dir, target, mode=0o755), "wb") as out:
        shutil.copyfileobj(src, out)
    os.chmod(target, os.stat(target).st_mode | 0o111)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
