#!/usr/bin/env bash
# Reshard on one node with W worker processes (default: one per CPU core, at most 8).
#
#   launch/torchrun.sh SRC DST --target-dp 16 [--memory-budget 4G] [...any reshard flag]
#   WORKERS=4 launch/torchrun.sh SRC DST --target-dp 16
#
# Workers use gloo on CPU, or NCCL when CUDA is available (--backend overrides).
set -euo pipefail
workers=${WORKERS:-$(( $(nproc) < 8 ? $(nproc) : 8 ))}
export DS_ACCELERATOR=${DS_ACCELERATOR:-$(python -c 'import torch; print("cuda" if torch.cuda.is_available() else "cpu")')}
exec torchrun --standalone --nproc_per_node="$workers" -m reshard "$@"
