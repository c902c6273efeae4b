"""W workers on this host without torchrun: `python -m reshard SRC DST --target-dp M --workers W`.

    from reshard.local_workers import run_local_workers
    code = run_local_workers(options, started)   # the process exit status; worker 0 prints the summary

The command's process imports reshard once, then forks W-1 workers, which start with
everything imported (torchrun starts an agent that imports torch, then W workers that each
import it again). The workers talk through shared memory and socket pairs the parent made
before forking (reshard.transport.forked), so no worker imports torch unless the job's files
need it (reshard.formats.torch_bytes.torch_archive decides that at inspection). `--transport torch` keeps
the earlier way: the W processes join a gloo group through a FileStore in a private temporary
directory. Either way they run the same job as under torchrun, and the parent (worker 0) waits
for the others. A worker that fails makes its peers fail at the next agreement point (see
reshard.transport.collective), or at the latest when `--timeout` runs out; a worker killed outright
closes its connections, which its peers see at once.

Forking is safe here because nothing has started a thread or a process group yet: this runs
before the job creates its reader, copier and hashing threads.
"""
from __future__ import annotations

import datetime
import os
import shutil
import signal
import sys
import tempfile
import time

from reshard.errors import ReshardError


def _gloo_transport(store_dir: str, rank: int, workers: int, timeout: float):
    """torch.distributed over gloo, joined through a FileStore in `store_dir` (`--transport torch`)."""
    import torch.distributed as dist

    from reshard.transport.torch_distributed import TorchDistributedTransport
    store = dist.FileStore(os.path.join(store_dir, "store"), workers)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=workers,
                            timeout=datetime.timedelta(seconds=timeout))
    return TorchDistributedTransport(owns_group=True)


STOP_SECONDS = 10.0
"""After a failure, how long worker 0 waits for the other workers to stop before killing them
(one that hangs, e.g. in a write to a dead disk, would otherwise keep the command waiting)."""


def _reap(children: list[int], patience: float | None):
    """Yield (pid, exit status) of each child; with `patience`, kill those still running after that long."""
    deadline = None if patience is None else time.monotonic() + patience
    waiting = list(children)
    while waiting:
        for pid in list(waiting):
            done, status = os.waitpid(pid, 0 if deadline is None else os.WNOHANG)
            if done:
                waiting.remove(pid)
                yield pid, os.waitstatus_to_exitcode(status)
        if waiting and deadline is not None:
            if time.monotonic() < deadline:
                time.sleep(0.05)
                continue
            for pid in waiting:
                print(f"reshard: worker process {pid} did not stop after the job failed; killing it", file=sys.stderr)
                os.kill(pid, signal.SIGKILL)
            deadline = None


def run_local_workers(options, started: float | None) -> int:
    """Run the job of `options` with `options.workers` forked processes; return the exit status."""
    from reshard.jobs.collective_job import run_job
    return run_forked(options.workers, options.timeout, lambda transport: run_job(options, transport, started=started),
                      over_gloo=options.transport == "torch", result_json=options.result_json)


def run_forked(workers: int, timeout: float, work, *, over_gloo: bool = False, result_json: str | None = None,
               prefix: str = "reshard") -> int:
    """Run `work(transport)` on `workers` forked processes (this one is worker 0); worker 0 prints the
    result's summary (and writes `result_json`, or the refusal there); return the exit status.
    `python -m reshard export --workers W` runs its export this way too."""
    from reshard.jobs.results import report_result, write_refusal_json
    from reshard.transport.forked import ForkedLinks, ForkedTransport, WorkerLost

    if over_gloo:
        import torch.distributed  # noqa: F401  (imported once, before forking)
    store_dir = tempfile.mkdtemp(prefix="reshard-workers-") if over_gloo else None
    links = None if over_gloo else ForkedLinks.create(workers)
    sys.stdout.flush()
    sys.stderr.flush()
    children = []
    rank = 0
    for worker in range(1, workers):
        pid = os.fork()
        if pid == 0:
            rank, children = worker, []
            break
        children.append(pid)
    code = 1
    try:
        transport = _gloo_transport(store_dir, rank, workers, timeout) if over_gloo else \
            ForkedTransport(links, rank, timeout)
        try:
            result = work(transport)
            code = 0
        except ReshardError as error:
            if rank == 0:
                print(f"{prefix}: error: {error}", file=sys.stderr)
                if result_json:
                    write_refusal_json(result_json, error)
            code = 2
        except WorkerLost as error:  # every worker that saw it says so: the lost one may have said nothing
            print(f"{prefix}: error: {error}", file=sys.stderr)
            code = 1
        finally:
            transport.close()
        if rank == 0 and code == 0:
            report_result(result, result_json)
    except BaseException:
        if rank == 0:
            raise
        import traceback
        traceback.print_exc()
    finally:
        if rank != 0:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    for pid, child_code in _reap(children, patience=None if code == 0 else STOP_SECONDS):
        if child_code != 0 and code == 0:
            print(f"{prefix}: worker process {pid} exited with status {child_code}", file=sys.stderr)
            code = 1 if child_code < 0 else child_code
    if store_dir is not None:
        shutil.rmtree(store_dir, ignore_errors=True)
    return code
