"""Path rules: a tag is a plain name, and everything reshard writes or deletes lies inside DST.

    from reshard.files.paths import check_tag, confined
    check_tag("global_step3", "--tag")                  # ok; "../x", "/abs", "a/b", "" are refused
    path = confined("/ckpt/out", "/ckpt/out/.reshard-staging/global_step3")   # ok, returned as given
    write_named_file(tag_dir, path, lambda p: torch.save(tree, p))   # a writer that must open by name
    check_output_file("r.json", "--result-json", {"SRC": src, "DST": dst}, reads=[job_file])
    write_file_atomically("r.json", text)               # temp file beside it, then one rename

A tag comes from the user (`--tag`), from a file in the checkpoint (`latest`) or from a
directory listing, and is joined to both SRC and DST. DeepSpeed writes it as one directory
name (engine.py `save_checkpoint`: `os.path.join(save_dir, str(tag))`), so anything that is
not a single path component is refused here, before any path is built from it. `confined`
is the last line of defence for every create, write, rename and delete: the path, with
every symlink above it resolved, must lie under the destination's real path.

A file the user names for output besides DST (`--result-json`) must lie outside SRC and DST and
be no file reshard reads (`check_output_file`), and is written by `write_file_atomically`: a
new temporary file beside it (O_EXCL, so a link planted at that name is never followed), renamed
over the name, which replaces a link there rather than writing through it.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable

from reshard.errors import CheckpointError, OptionError


def tag_problem(tag: object) -> str | None:
    """Why `tag` is not a safe single directory name (None when it is)."""
    if not isinstance(tag, str) or not tag:
        return "is empty"
    if "\x00" in tag:
        return "contains a NUL byte"
    if os.path.isabs(tag) or tag.startswith("~"):
        return "is an absolute path"
    if "/" in tag or (os.altsep and os.altsep in tag) or "\\" in tag:
        return "contains a path separator"
    if tag in (".", ".."):
        return "is a relative path component"
    if tag != tag.strip():
        return "has leading or trailing white space"
    return None


def check_tag(tag: object, origin: str, path: str | None = None) -> str:
    """Return `tag` if it is a plain directory name; else raise naming where it came from.

    `origin` says where the tag was read ("--tag", "latest", ...); `path` is the file that held
    it, so the error names it (a checkpoint's `latest` is input like any shard)."""
    problem = tag_problem(tag)
    if problem is None:
        return tag
    message = (f"tag {tag!r} from {origin} {problem}: a tag must be one directory name inside the save "
               "directory (reshard never follows a tag outside it)")
    if path is not None:
        raise CheckpointError(path, message)
    raise OptionError(message)


def is_inside(path: str, root: str) -> bool:
    """`path` is `root` or below it (both already real paths)."""
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def confined(root: str, path: str) -> str:
    """`path`, after checking that it (its parent's real path plus its own name) lies strictly under `root`.

    The last component is not resolved: renaming or unlinking a symlink inside DST touches the
    link, not its target. Writers that open files use O_NOFOLLOW (see `open_new_file`)."""
    real_root = os.path.realpath(root)
    parent, name = os.path.split(os.path.abspath(path))
    resolved = os.path.join(os.path.realpath(parent), name)
    if name in ("", ".", "..") or not is_inside(resolved, real_root) or resolved == real_root:
        raise OptionError(f"{path}: refusing to write outside the destination {root} (resolves to {resolved})")
    return path


def open_new_file(root: str, path: str, flags: int = os.O_WRONLY, mode: int = 0o644) -> int:
    """Create `path` (replacing a file or symlink of that name) without following any link at it."""
    confined(root, path)
    if os.path.islink(path):
        os.unlink(path)
    return os.open(path, flags | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, mode)


def write_named_file(root: str, path: str, write: Callable[[str], object]) -> str:
    """Create `path` (under `root`) with `write(p)`, a writer that opens the file by name itself, without
    following a link at `path`. Returns `path`.

    torch.save opens by name, and its bytes depend on the name: a path's archive folder is the file's
    stem (torch/serialization.py `_open_zipfile_writer_file`, inline_container.cc `basename`), a file
    object's "archive", so it cannot write through `open_new_file`'s descriptor and keep the bytes.
    Instead `write` writes a file of the same name in a fresh private directory beside `root`
    (mkdtemp: mode 0700, empty, so nothing can be waiting there; beside `root`, not in it, so that one
    left by a killed run is never published or walked as output), which is then renamed onto `path`:
    a rename replaces whatever `path` is, a symlink included, and never follows it."""
    confined(root, path)
    scratch = tempfile.mkdtemp(prefix=".reshard-writing-", dir=os.path.dirname(os.path.abspath(root)))
    try:
        staged = os.path.join(scratch, os.path.basename(path))
        write(staged)
        os.replace(staged, path)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return path


def _resolved(path: str) -> str:
    """`path` absolute, every link above its last component resolved (the last one kept: what a
    rename onto `path` replaces)."""
    parent, name = os.path.split(os.path.abspath(path))
    return os.path.join(os.path.realpath(parent), name)


def output_file_problem(path: str, inside: dict[str, str], reads=()) -> str | None:
    """Why reshard must not write the file `path` the user named (None when it may): it lies in one
    of the directories `inside` ({"SRC": dir, ...}: a job's input and output, whose files reshard
    reads, writes or publishes), is one of the files `reads`, or cannot be a file. Links count as
    where they lead: above the last component, and at it."""
    if not isinstance(path, str) or not path or "\x00" in path:
        return "is not a file path"
    here = _resolved(path)
    candidates = {here, os.path.realpath(path)}  # the name itself, and where a link at it leads
    for what, directory in inside.items():
        root = os.path.realpath(directory)
        for candidate in candidates:
            if is_inside(candidate, root):
                return (f"lies inside {what} {directory} (resolves to {candidate}), among the checkpoint's "
                        "files, which a record must never replace or join: name a file outside SRC and DST")
    for other in reads:
        if other and (os.path.realpath(other) in candidates or _resolved(other) in candidates):
            return f"is {other}, a file reshard reads"
    if os.path.isdir(here):
        return "is a directory"
    if not os.path.isdir(os.path.dirname(here)):
        return f"cannot be created: {os.path.dirname(here)} is not a directory"
    return None


def check_output_file(path: str, flag: str, inside: dict[str, str], reads=()) -> str:
    """`path` as an absolute path, after `output_file_problem` found nothing; else OptionError
    naming the flag, the path and why."""
    problem = output_file_problem(path, inside, reads)
    if problem is not None:
        raise OptionError(f"{flag} {path}: {problem}")
    return os.path.abspath(path)


def write_file_atomically(path: str, data: bytes | str) -> None:
    """Write `data` to `path` whole: into a new temporary file beside it (created exclusively, so
    never through a planted link), fsynced, then renamed over `path` (a link there is replaced, not
    followed). A failure leaves `path` as it was and removes the temporary file."""
    directory, name = os.path.split(os.path.abspath(path))
    fd, temporary = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(data.encode() if isinstance(data, str) else data)
            file.flush()
            os.fchmod(file.fileno(), 0o644)  # mkstemp makes 0600; a record is for others to read
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        if os.path.lexists(temporary):
            os.unlink(temporary)
        raise

