"""The destination save directory: refuse unsafe targets, write into staging, publish atomically.

    from reshard.jobs.destination import check_paths, Staging
    check_paths(src, dst)                            # DST inside SRC, unwritable DST, ... refused
    staging = Staging(dst, tag); staging.create()    # DST/.reshard-staging/TAG/
    ...workers write files into staging.tag_dir...
    staging.publish()                                # move into DST/TAG, then write DST/latest

Until `publish` renames the staging directory into place and writes `latest` (last, by
atomic rename), DeepSpeed finds no loadable checkpoint in DST: `load_checkpoint` reads the
tag from `latest`, and a tag directory only appears complete.

Staging lies inside DST, so every rename here stays on DST's filesystem (atomic, never EXDEV)
whatever filesystem SRC is on; bytes cross from SRC only by copying (`reshard.files.byte_io`). The
reshard jobs and the exports (`reshard.export.runner`) share this lifecycle: `Staging`,
`clean_up_after_failure` and `what_was_kept` after a failure, `stale_staging_notes` for what
earlier runs left behind.
"""
from __future__ import annotations

import json
import os
import shlex
import shutil
from collections.abc import Callable
from dataclasses import dataclass

from reshard.files.byte_io import hash_file
from reshard.errors import OptionError
from reshard.formats.deepspeed_files import deepspeed_schema as schema
from reshard.jobs.lock import LOCK_NAME, DestinationLock
from reshard.jobs.manifest import JOURNAL_NAME
from reshard.files.paths import check_tag, confined, is_inside, open_new_file

STAGING = ".reshard-staging"
RESHARD_NAMES = frozenset({STAGING, LOCK_NAME})
"""What reshard itself keeps in a destination while a job runs (its staging and its lock): never the
user's, so the check that DST is empty (`check_empty`) passes over them in every kind of job."""
DEEPSPEED_NAMES = frozenset({schema.LATEST, *schema.RECOVERY_SCRIPTS})
"""What DeepSpeed writes into a save directory beside its tag directories (`latest`, the recovery
scripts; engine.py `save_checkpoint`, `_copy_recovery_script`): a reshard output writes them anew."""
SAVE_DIR_NAMES = RESHARD_NAMES | DEEPSPEED_NAMES
"""Names in a save directory that are neither a tag directory nor the user's: a save directory's
carried files (reshard.jobs.save_dir_files) leave them out, a whole-file job's DST may hold them."""
ARRAY_SUFFIX = ".array"
"""DST/.reshard-staging/TAG.array: the bookkeeping of a SLURM array job (reshard.jobs.array_job) for TAG."""
ARRAY_RECORD = "record.json"
ARRAY_DONE = "done"


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

    Every path it creates, writes, renames or deletes is checked by `reshard.files.paths.confined`
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

        An array job's staging for this tag is refused (its tasks finish it, or the user removes
        it); anything else at that path without reshard's journal was not made by reshard: refused."""
        os.makedirs(self.destination, exist_ok=True)
        self._mkdir(self.root)
        confined(self.destination, self.tag_dir)
        array = array_staging_of(self.destination, self.tag)
        if array is not None:
            raise OptionError(array)
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

    def publish(self, latest: str | None, scripts_from: str | None = None, latest_name: str = schema.LATEST) -> None:
        """Move the tag directory into place, then carry DeepSpeed's helpers and write `latest` (last).

        `latest`: the tag to name in DST/latest, or None to leave it (a tag that is not the
        source's latest, resharded with --all-tags). `scripts_from`: the source save directory whose
        recovery scripts are carried, or None for none (DeepSpeed writes them on global rank 0's
        node only; node-local outputs follow that). `latest_name`: the pointer file (a universal
        checkpoint's is `latest_universal`).
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
            write_latest(self.destination, latest, latest_name)
        if old is not None:
            _remove(old)
        self.discard()

    def publish_files(self, last: str, before_moves: Callable[[], object] = lambda: None) -> None:
        """Move every file of the staging directory into DST itself (sub-directories kept), each by
        an atomic rename that replaces a file or link of its name, `last` (the file that marks the
        output complete, e.g. a safetensors index) after all others; then remove the staging.

        For outputs that are a directory of files rather than a tag directory: no single rename
        can place them, so the marker goes last, and until it is there the output is incomplete.
        An earlier `last` in DST (--overwrite) is removed first: it must not vouch for a mix of old
        and new files while they move. Every target is checked and given its directory before
        `before_moves` runs (the lifecycle removes the journal there), so a refusal up to that point
        leaves a staging the same command resumes."""
        marker = confined(self.destination, os.path.join(self.destination, last))
        _fsync_dir(self.tag_dir)
        names = []
        for root, dirs, files in os.walk(self.tag_dir):
            dirs.sort()
            names += sorted(os.path.relpath(os.path.join(root, f), self.tag_dir) for f in files)
        names = [n for n in names if n not in (JOURNAL_NAME, last)] + ([last] if last in names else [])
        top = os.path.abspath(self.destination).rstrip(os.sep)
        targets = []
        for name in names:
            target = confined(self.destination, os.path.join(self.destination, name))
            parent = os.path.dirname(os.path.abspath(target))
            if parent != top:
                self._mkdir(parent)
            targets.append((name, target))
        before_moves()
        if os.path.lexists(marker):
            os.unlink(marker)
        for name, target in targets:
            os.replace(os.path.join(self.tag_dir, name), target)
        _fsync_dir(self.destination)
        for root, dirs, _ in os.walk(self.tag_dir, topdown=False):  # the emptied sub-directories, then the staging
            for name in dirs:
                path = os.path.join(root, name)
                if not os.path.islink(path) and not os.listdir(path):
                    os.rmdir(path)
        self.discard()

    def discard(self) -> None:
        """Remove staging this job made (it holds reshard's journal, or nothing yet)."""
        if os.path.isdir(self.tag_dir) and not os.path.islink(self.tag_dir):
            if os.path.isfile(os.path.join(self.tag_dir, JOURNAL_NAME)) or not os.listdir(self.tag_dir):
                _remove(confined(self.destination, self.tag_dir))
        if os.path.isdir(self.root) and not os.path.islink(self.root) and not os.listdir(self.root):
            os.rmdir(self.root)


def array_staging_of(destination: str, tag: str) -> str | None:
    """What a SLURM array job's staging of `tag` in `destination` is, and how to finish or remove it
    (None when there is none)."""
    array_dir = os.path.join(destination, STAGING, tag + ARRAY_SUFFIX)
    try:
        with open(os.path.join(array_dir, ARRAY_RECORD)) as fd:
            record = json.load(fd)
        tasks, files = int(record["tasks"]), len(record["owners"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    done_dir = os.path.join(array_dir, ARRAY_DONE)
    done = len(os.listdir(done_dir)) if os.path.isdir(done_dir) else 0
    tag_dir = os.path.join(destination, STAGING, tag)
    return (f"{tag_dir}: holds the staging of a SLURM array job for tag {tag} ({array_dir}: {tasks} tasks, {done} of "
            f"{files} files done), not of this job: finish it by running its remaining tasks (the same command with "
            f"--array-task I --array-tasks {tasks}), then `python -m reshard publish {shlex.quote(destination)}`; or, "
            f"once none of its tasks runs, remove it to start over: rm -rf {shlex.quote(tag_dir)} "
            f"{shlex.quote(array_dir)}")


def stale_staging_notes(destination: str, tags) -> list[str]:
    """Lines naming what DST/.reshard-staging holds for tags other than `tags` (the tags this job
    writes there), each with the command that removes it: the unfinished output of an interrupted
    run for a tag SRC no longer names in `latest`, say, which nothing resumes unless that tag is
    resharded again. Read-only: reshard never deletes staging it was not asked to write."""
    root = os.path.join(destination, STAGING)
    if not os.path.isdir(root) or os.path.islink(root):
        return []
    names = sorted(os.listdir(root))
    mine = set(tags) | {tag + ARRAY_SUFFIX for tag in tags}
    notes = []
    for name in names:
        path = os.path.join(root, name)
        if name in mine or (name + ARRAY_SUFFIX in names and name + ARRAY_SUFFIX not in mine):
            continue  # this job's own, or the tag directory of an array job named with its .array
        if name.endswith(ARRAY_SUFFIX):
            array = array_staging_of(destination, name[:-len(ARRAY_SUFFIX)])
            if array is not None:
                notes.append("stale staging: " + array)
                continue
        if os.path.isfile(os.path.join(path, JOURNAL_NAME)):
            what = (f"the unfinished output of an interrupted run for tag {name}, which this job does not write "
                    f"(it wrote {', '.join(sorted(tags)) or 'no tag'}); it resumes only if that tag is resharded "
                    f"again (--tag {shlex.quote(name)})")
        elif name.startswith("replaced-"):
            what = f"the previous {os.path.join(destination, name[len('replaced-'):])}, left by an interrupted publish"
        else:
            what = "not made by reshard (no journal)"
        notes.append(f"stale staging: {path} is {what}; remove it with: rm -rf {shlex.quote(path)}")
    return notes


def clean_up_after_failure(staging: Staging, lock: DestinationLock, keep_staging: bool,
                           remove_destination: bool) -> bool:
    """Release the lock; keep staging for a resume once rounds
    began, else remove it (and DST, when this run created it and nothing else is there). Returns
    whether DST was removed."""
    removed = False
    try:
        if not keep_staging:
            staging.discard()
            if (remove_destination and os.path.isdir(staging.destination)
                    and os.listdir(staging.destination) == [LOCK_NAME]):
                lock.release()
                os.rmdir(staging.destination)
                removed = True
    except OSError:
        pass
    lock.release()
    return removed


def what_was_kept(staging: Staging, kept: bool, removed_destination: bool) -> str:
    """The end of a failed run's message: what stays on disk, and what re-running does."""
    if kept and os.path.isdir(staging.tag_dir) and not os.path.isfile(os.path.join(staging.tag_dir, JOURNAL_NAME)):
        # the journal goes when publishing starts to move files (Staging.publish_files): no run resumes this
        return (f". Publishing had begun: some files may already be in {staging.destination}, the rest stay in "
                f"{staging.tag_dir}, which no run resumes; remove it (rm -rf {shlex.quote(staging.tag_dir)}) and "
                "re-run with --overwrite")
    if kept:
        return (f". The partial output stays in {staging.tag_dir} (no checkpoint is published); fix the "
                "cause and re-run the same command to resume")
    if removed_destination:
        return f". Nothing was kept: {staging.destination} was created by this run and has been removed"
    return f". Nothing was kept: the staging directory {staging.tag_dir} has been removed"


def _remove(path: str) -> None:
    """Remove a file, a link (not its target) or a directory tree."""
    if os.path.islink(path) or not os.path.isdir(path):
        os.unlink(path)
    else:
        shutil.rmtree(path)


def write_latest(destination: str, tag: str, name: str = schema.LATEST) -> None:
    """`latest` (or the pointer file `name`) names the tag (no newline, as DeepSpeed writes it);
    replaced atomically."""
    latest = confined(destination, os.path.join(destination, name))
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
