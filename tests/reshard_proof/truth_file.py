"""The truth file: what train records about the engine it saved, and how to read and write it.

    python -c "from reshard_proof.truth_file import read_truth; t = read_truth('/tmp/ck.truth.pt'); print(t['meta'])"

Schema (torch.save of plain dicts, tensors and Python values):
    meta:         {"variant", "world_size", "seed", "steps", "tag", "master_from", "optimizer_class",
                   "zero_stage", "precision", "exclude_frozen_parameters", "sequence_parallel" (sp variants only;
                   absent: no sequence parallelism), "deepspeed_version",
                   "torch_version", "master_route_cross_check": [mismatches between the getter and
                   internals routes, ZeRO-1/2 and BF16_Optimizer; expected empty unless round robin]}
    engine:       capture_engine_state(...) at save time; see engine_state.py for its keys
    client_state: the dict passed to save_checkpoint(client_state=...)
    eval_loss:    float32 scalar tensor, loss on batches.eval_batch() after saving, eval mode, no_grad
    train_losses: [[float] per rank] the losses of the training steps
"""

import os

import torch


def write_truth(path: str, truth: dict) -> None:
    """Atomic, so a file that exists is complete (launch.py judges runs by their files)."""
    partial = f"{path}.partial"
    torch.save(truth, partial)
    os.replace(partial, path)


def read_truth(path: str) -> dict:
    # Written by this harness from plain values; weights_only stays on.
    return torch.load(path, map_location="cpu", weights_only=True)
