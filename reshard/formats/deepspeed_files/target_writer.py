"""Writes the target files one worker owns: skeleton first, then slices at their offsets.

    writer = TargetWriter.create(source, staging_tag_dir, Topology(dp=3), ranks=[1, 2])
    writer.write(rank=2, slot=("optim", 0, "fp32"), element=0, itemsize=4, data=view)
    hashes = writer.finish() # fsync, hash and close: {name: {"bytes", "blake3"}} for the manifest

Each file is saved with `skip_data` (structure written, storage space reserved, nothing
resident), its storages located by reloading the skeleton on the meta device, and the
unpartitioned tensors it carries over from the source (step counters, buffers, client
state, the ZeRO-1/2 module weights) written at once: from bytes the job shipped, or copied
file to file in the kernel when this worker owns the source file. Partition slices arrive
later from the exchange, while large carried storages are copied in a background thread.
Padding is never written and reads back as zeros. When resuming, existing skeletons are
reopened and located instead of rewritten.

Before a file is hashed, its records get their real CRC-32s (torch_zip.seal_crcs, computed from
the written bytes, so resumed and kernel-copied bytes count alike): a skeleton records CRC 0, and
the file must be what torch.save of the same object writes, which `zipfile.testzip` and `unzip -t`
accept. Hashing (BLAKE3, for the manifest) reads each file back from the page cache once it is
final: a file no partition slice goes to (ZeRO-1/2 module weights, ZeRO-3 model states) in
the background thread as soon as its carried bytes are in, while the rounds run; the others
after the last round, while a second thread fsyncs (one waits on the disk, the other on the
CPU). BLAKE3 of a whole file cannot be assembled from ranges hashed out of order through the
`blake3` package (it exposes no chunk counter), hence whole files, read back while cached.
"""
from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from reshard.files.byte_io import copy_bytes, hash_file, pwrite_exact, pwritev_exact
from reshard.errors import ReshardError
from reshard.formats.torch_bytes.float_casts import ITEMSIZE, cast_bytes
from reshard.formats.deepspeed_files import deepspeed_classes as classes
from reshard.formats.deepspeed_files.deepspeed_spec import SourceCheckpoint
from reshard.formats.deepspeed_files.deepspeed_target import carried_bytes, is_copy_role, target_files
from reshard.formats.torch_bytes.torch_zip import seal_crcs
from reshard.formats.torch_bytes.torch_archive import (
    NewTensor,
    TensorRef,
    locate_tree_storages,
    refs_in,
    write_tree_skeleton,
)
from reshard.topology import Topology


class WriteFailed(ReshardError):
    """A target file could not be written (disk full, I/O error); what was written is kept for a resume."""

    def __init__(self, path: str, error: OSError):
        self.path, self.error = path, error
        # The lifecycle adds what stays on disk (reshard.jobs.lifecycle.Lifecycle.run): only it knows.
        super().__init__(f"{path}: writing failed: {error.strerror or error}")

    def __reduce__(self):
        return (type(self), (self.path, self.error))


@dataclass
class TargetWriter:
    locations: dict = field(default_factory=dict)
    """(rank, slot) -> (fd, byte offset of element 0, path)"""
    fds: dict = field(default_factory=dict)
    """path -> fd of every file this worker writes"""
    paths: list = field(default_factory=list)
    bytes_written: int = 0
    bytes_carried: int = 0
    sync_seconds: float = 0.0
    """Wall seconds spent in fsync so far (a phase of its own in the job's summary)."""
    hash_seconds: float = 0.0
    """Wall seconds `finish` spent sealing CRC-32s and hashing (besides the fsync thread): the
    job's "hash" phase."""
    crc_seconds: float = 0.0
    """Wall seconds spent computing and writing the files' CRC-32s (`seal`), in either thread."""
    sealed: set = field(default_factory=set)
    """Paths whose CRC-32s are final."""
    deferred: list = field(default_factory=list)
    """(source path, source offset, fd, target offset, bytes, target path) still to copy"""
    digests: dict = field(default_factory=dict)
    """path -> BLAKE3 hex of the files already final and hashed"""
    casts: dict = field(default_factory=dict)
    """(rank, slot) -> (dtype slices arrive in, dtype the file stores), for slots that differ"""
    _copier: threading.Thread | None = None
    _copy_error: BaseException | None = None

    @classmethod
    def create(cls, source: SourceCheckpoint, tag_dir: str, target: Topology, ranks, *,
               reuse_existing: bool = False, only: set[str] | None = None,
               files_of: Callable[..., list] = target_files) -> "TargetWriter":
        """The files of target `ranks` (only those named in `only`, when given: an array task's share).
        `files_of(source, target, rank)` says what they are: DeepSpeed's at the source's ZeRO stage
        by default; the job's own choice otherwise (another stage, reshard.formats.deepspeed_files.stage_change;
        the model-states file placed elsewhere, reshard.jobs.node_local)."""
        writer = cls()
        try:
            for rank in ranks:
                for file in files_of(source, target, rank):
                    if only is not None and file.name not in only:
                        continue
                    writer._open_file(source, os.path.join(tag_dir, file.name), file, rank, reuse_existing)
            writer.sync()
        except BaseException:
            writer.close()
            raise
        return writer

    def _open_file(self, source: SourceCheckpoint, path: str, target, rank: int, reuse_existing: bool) -> None:
        if os.path.islink(path):  # never write through a link left in staging
            os.unlink(path)
        try:  # without torch where the tree allows (reshard.formats.torch_bytes.torch_pickle), else with it
            offsets = locate_tree_storages(path, target.tree, classes.safe_globals()) if reuse_existing else \
                write_tree_skeleton(path, target.tree, classes.safe_globals())
        except OSError as error:
            raise WriteFailed(path, error) from None
        except RuntimeError as error:  # torch.save reports a failed write this way
            raise WriteFailed(path, OSError(0, str(error).splitlines()[0])) from None
        self.paths.append(path)
        fd = self.fds[path] = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        for role, offset in offsets.items():
            if isinstance(role, tuple) and not is_copy_role(role):
                self.locations[(rank, role)] = (fd, offset, path)
        stored = {ref.slot: ref.dtype for ref in refs_in(target.tree) if isinstance(ref, NewTensor)}
        self.casts.update({(rank, slot): (arrives, stored[slot]) for slot, arrives in target.casts.items()})
        try:
            self._write_carried(source, target, fd, path, offsets)
        except OSError as error:
            raise WriteFailed(path, error) from None

    def _write_carried(self, source: SourceCheckpoint, target, fd: int, path: str, offsets: dict) -> None:
        """Unpartitioned storages: shipped bytes now; storages copied from a source file later,
        in the background (`copy_in_background`), since they can be large (ZeRO-1/2 module
        weights). Rewritten on a resume too: the same bytes, so harmless, and always complete."""
        carried = source.carried.get(target.template)
        template_path = os.path.join(source.tag_dir, target.template)
        nbytes_of = {ref.storage_key: ref.storage_nbytes for ref in refs_in(target.tree) if isinstance(ref, TensorRef)}
        for role, offset in offsets.items():
            if is_copy_role(role):  # deepspeed_target.own_storage
                _, key, start, nbytes = role[:4]
                if carried is not None:
                    pwrite_exact(fd, carried_bytes(carried, role), offset)
                    self.bytes_carried += nbytes
                else:
                    self.deferred.append((template_path, key + start, fd, offset, nbytes, path))
                continue
            if isinstance(role, tuple):
                continue
            if carried is not None:
                data = carried[role]
                pwrite_exact(fd, memoryview(data), offset)
                self.bytes_carried += len(data)
            else:
                self.deferred.append((template_path, role, fd, offset, nbytes_of[role], path))

    def copy_in_background(self) -> None:
        """Start the deferred file-to-file copies, then hash the files no slice goes to; this
        runs while the rounds do."""
        if (self.deferred or self._sliceless()) and self._copier is None:
            self._copier = threading.Thread(target=self._background, name="reshard-copier", daemon=True)
            self._copier.start()

    def _sliceless(self) -> list[str]:
        """Files that receive no partition slice: final once their carried bytes are in."""
        sliced = {path for _, _, path in self.locations.values()}
        return [path for path in self.paths if path not in sliced and path not in self.digests]

    def _background(self) -> None:
        self._copy_deferred()
        if self._copy_error is None:
            try:
                for path in self._sliceless():
                    self.seal(path)
                    self.digests[path] = hash_file(path)
            except BaseException as error:
                self._copy_error = error

    def _copy_deferred(self) -> None:
        try:
            opened: dict[str, int] = {}
            try:
                for template_path, src_offset, fd, dst_offset, nbytes, path in self.deferred:
                    if template_path not in opened:
                        opened[template_path] = os.open(template_path, os.O_RDONLY)
                    try:
                        copy_bytes(opened[template_path], src_offset, fd, dst_offset, nbytes, template_path)
                    except OSError as error:
                        raise WriteFailed(path, error) from None
                    self.bytes_carried += nbytes
            finally:
                for handle in opened.values():
                    os.close(handle)
        except BaseException as error:  # handed to the main thread by wait_for_copies
            self._copy_error = error

    def wait_for_copies(self) -> None:
        if self.deferred and self._copier is None:
            self._copy_deferred()
        elif self._copier is not None:
            self._copier.join()
        self.deferred, self._copier = [], None
        if self._copy_error is not None:
            raise self._copy_error

    def write(self, rank: int, slot: tuple, element: int, itemsize: int, data: memoryview) -> None:
        fd, base, path = self.locations[(rank, slot)]
        cast = self.casts.get((rank, slot))
        if cast is not None:  # round to nearest, as DeepSpeed's own copy_ into the low-precision params
            data = memoryview(cast_bytes(data, cast[0], cast[1]))
            itemsize = ITEMSIZE[cast[1]]
        try:
            pwrite_exact(fd, data, base + element * itemsize)
        except OSError as error:
            raise WriteFailed(path, error) from None
        self.bytes_written += len(data)

    def write_gather(self, rank: int, slot: tuple, element: int, itemsize: int, pieces: list[memoryview]) -> None:
        """`write` of the pieces back to back (elements from `element` on), in as few syscalls as
        IOV_MAX allows: the exchange hands a round's pieces that continue each other here."""
        fd, base, path = self.locations[(rank, slot)]
        cast = self.casts.get((rank, slot))
        if cast is not None:
            pieces = [memoryview(cast_bytes(piece, cast[0], cast[1])) for piece in pieces]
            itemsize = ITEMSIZE[cast[1]]
        try:
            self.bytes_written += pwritev_exact(fd, pieces, base + element * itemsize)
        except OSError as error:
            raise WriteFailed(path, error) from None

    def seal(self, path: str) -> None:
        """Write the real CRC-32 of every record of a file whose bytes are all in (torch_zip.seal_crcs)."""
        if path in self.sealed:
            return
        started = time.perf_counter()
        try:
            seal_crcs(path, self.fds[path])
        except OSError as error:
            raise WriteFailed(path, error) from None
        finally:
            self.crc_seconds += time.perf_counter() - started
        self.sealed.add(path)

    def sync(self, ready: dict | None = None) -> None:
        """fsync every file; with `ready` ({path: threading.Event}), each once its event is set."""
        started = time.perf_counter()
        try:
            self._sync(ready)
        finally:
            self.sync_seconds += time.perf_counter() - started

    def _sync(self, ready: dict | None = None) -> None:
        for path, fd in self.fds.items():
            if ready is not None:
                ready[path].wait()
            try:
                os.fsync(fd)
            except OSError as error:
                raise WriteFailed(path, error) from None

    def finish(self) -> dict:
        """Finish the background work, make every byte durable and hash every file, then close.

        This thread seals each file's CRC-32s (they change bytes the fsync and the hash must see),
        then hashes the files not hashed yet; a second thread fsyncs each file as soon as it is
        sealed. Returns {file name: {"bytes", "blake3"}}.
        """
        self.wait_for_copies()
        failure: list[BaseException] = []
        ready = {path: threading.Event() for path in self.fds}

        def sync():
            try:
                self.sync(ready)
            except BaseException as error:
                failure.append(error)
        syncer = threading.Thread(target=sync, name="reshard-fsync", daemon=True)
        syncer.start()
        started = time.perf_counter()
        try:
            for path in self.paths:
                self.seal(path)
                ready[path].set()
            for path in self.paths:
                if path not in self.digests:
                    self.digests[path] = hash_file(path)
        finally:
            self.hash_seconds += time.perf_counter() - started
            for event in ready.values():  # a failed seal must not leave the fsync thread waiting
                event.set()
            syncer.join()
        if failure:
            raise failure[0]
        self.close()
        return {os.path.basename(p): {"bytes": os.path.getsize(p), "blake3": self.digests[p]} for p in self.paths}

    def close(self) -> None:
        if self._copier is not None:
            self._copier.join()
            self._copier = None
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()
