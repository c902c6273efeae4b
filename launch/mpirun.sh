#!/usr/bin/env bash
# Reshard under an MPI launcher (Open MPI, MPICH/Hydra, or srun --mpi=pmix): each MPI process is one worker.
#
#   mpirun -np 16 --hostfile hosts launch/mpirun.sh SRC DST --target-dp 64
#   mpiexec -n 4 launch/mpirun.sh SRC DST --target-dp 8 --timeout 300
#
# The workers talk over MPI (mpi4py, `pip install 'reshard[mpi]'`): Alltoallv on host buffers.
# No rendezvous address is needed. A worker that dies or stalls aborts the whole MPI job after
# --timeout seconds at most, so no peer is left waiting.
set -euo pipefail
exec python -m reshard "$@" --transport mpi
