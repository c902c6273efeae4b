"""`python -m reshard ...` and `torchrun ... -m reshard ...`: see reshard.cli."""
import os
import sys

from reshard.cli import main
from reshard.jobs.results import drop_stdout


def _mpi_is_running() -> bool:
    """Whether this process initialised MPI (mpi4py) and has not finalised it."""
    mpi = sys.modules.get("mpi4py.MPI")
    return mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized()


def _run() -> int:
    """main(), surviving a reader that left (`reshard inspect X | head`): no traceback, and the rest of
    what stdout holds is dropped. Where main() printed its result through results.print_summary, its
    own status stands; a closed pipe met elsewhere (a note printed on the way) ends it with status 1."""
    try:
        code = main()
        sys.stdout.flush()
    except BrokenPipeError:
        drop_stdout()
        code = 1
    try:
        sys.stderr.flush()
    except BrokenPipeError:  # `2>&1 | head`: stderr went with stdout
        pass
    return code


code = _run()
if _mpi_is_running():
    # Leave through the interpreter's teardown, whose atexit hook (mpi4py's) finalises MPI. MPICH's
    # launcher (Hydra 5.0.2, tried here) kills a job's other processes as soon as one of them leaves
    # through os._exit, finalised or not: a finished job then lost what its ranks printed last, and
    # sometimes exited 9 ("BAD TERMINATION ... Killed") after every file was written.
    sys.exit(code)
# Skip interpreter teardown: with torch.distributed loaded, static destructors of its C++
# threads sometimes abort the process ("terminate called without an active exception") after
# all work is done and every file is closed, turning a success into exit status 134.
os._exit(code)
