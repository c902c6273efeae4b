#!/usr/bin/env bash
# Reshard under an MPI launcher (Open MPI or MPICH/Hydra): each MPI process becomes one worker.
#
#   mpirun -np 16 --hostfile hosts launch/mpirun.sh SRC DST --target-dp 64
#
# The workers talk over torch.distributed (gloo, or NCCL with CUDA); the MPI launcher only
# starts them. Rank, size and the rendezvous address come from the launcher's environment.
set -euo pipefail
export RANK=${OMPI_COMM_WORLD_RANK:-${PMI_RANK:-${PMIX_RANK:-0}}}
export WORLD_SIZE=${OMPI_COMM_WORLD_SIZE:-${PMI_SIZE:-1}}
export LOCAL_RANK=${OMPI_COMM_WORLD_LOCAL_RANK:-${MPI_LOCALRANKID:-0}}
export MASTER_ADDR=${MASTER_ADDR:?set MASTER_ADDR to the host of MPI rank 0}
export MASTER_PORT=${MASTER_PORT:-29518}
exec python -m reshard "$@"
