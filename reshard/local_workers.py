"""W workers on this host without torchrun: `python -m reshard SRC DST --target-dp M --workers W`.

    from reshard.local_workers import run_local_workers
    code = run_local_workers(options, started)   # the process exit status; worker 0 prints the summary

The command's process imports torch and reshard once, then forks W-1 workers, which start
with everything imported (torchrun starts an agent that imports torch, then W workers that
each import it again). The W processes join a gloo group through a FileStore in a private
temporary directory, run the same job as under torchrun, and the parent (worker 0) waits for
the others. A worker that fails makes its peers fail at the next agreement point (see
reshard.collective), or at the latest when `--timeout` runs out; a worker killed outright
closes its gloo connections, which its peers see at once.

Forking is safe here because nothing has started a thread or a process group yet: this runs
before the job creates its reader, copier and hashing threads.
"""
from __future__ import annotations

import datetime
import os
import shutil
import sys
import tempfile

from reshard.errors import ReshardError


def run_local_workers(options, started: float | None) -> int:
    """Run the job of `options` with `options.workers` forked processes; return the exit status."""
    import torch.distributed as dist

    from reshard.job import run_job
    from reshard.transport import TorchDistributedTransport

    workers = options.workers
    store_dir = tempfile.mkdtemp(prefix="reshard-workers-")
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
        store = dist.FileStore(os.path.join(store_dir, "store"), workers)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=workers,
                                timeout=datetime.timedelta(seconds=options.timeout))
        transport = TorchDistributedTransport(owns_group=True)
        try:
            result = run_job(options, transport, started=started)
            code = 0
        except ReshardError as error:
            if rank == 0:
                print(f"reshard: error: {error}", file=sys.stderr)
            code = 2
        finally:
            transport.close()
        if rank == 0 and code == 0:
            print(result.summary())
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
    for pid in children:
        _, status = os.waitpid(pid, 0)
        child_code = os.waitstatus_to_exitcode(status)
        if child_code != 0 and code == 0:
            print(f"reshard: worker process {pid} exited with status {child_code}", file=sys.stderr)
            code = 1 if child_code < 0 else child_code
    shutil.rmtree(store_dir, ignore_errors=True)
    return code
