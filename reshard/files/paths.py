"""Path rules: a tag is a plain name, and everything reshard writes or deletes lies inside DST.

    from reshard.files.paths import check_tag, confined
    check_tag("global_step3", "--tag")                  # ok; "../x", "/abs", "a/b", "" are refused
    path = confined("/ckpt/out", "/ckpt/out/.reshard-staging/global_step3")   # ok, returned as given
    write_named_file(tag_dir, path, lambda p: torch.save(tree, p))   # a writer that must open by name

A tag comes from the user (`--tag`), from a file in the checkpoint (`latest`) or from a
directory listing, and is joined to both SRC and DST. DeepSpeed writes it as one directory
name (engine.py `save_checkpoint`: `os.path.join(save_dir, str(tag))`), so anything that is
not a single path component is refused here, before any path is built from it. `confined`
is the last line of defence for every create, write, rename and delete: the path, with
every symlink above it resolved, must lie under the destination's real path.
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
