"""The verdict check_load writes: whether a loaded engine matches the truth, bit for bit.

    python -c "from reshard_proof.verdict_file import read_verdict; print(read_verdict('/tmp/verdict.json')['ok'])"

Schema (JSON):
    ok:                bool, true iff the load succeeded, nothing mismatched and every extra step's
                       loss is finite
    variant:           variant name
    in_job:            true when loaded by reshard.deepspeed.load_checkpoint, not the plain call
    world_size:        M, the ranks that loaded
    source_world_size: N, from the truth
    tag:               the checkpoint tag that was loaded
    checked_tensors:   tensors compared on rank 0 (every rank compares the same set)
    checked_elements:  elements of those tensors
    mismatch_count:    all mismatches, every rank, after merging identical messages
    mismatches:        the first 50, each "path: what differs [ranks ...]"
    load_error:        the exception load_checkpoint raised, or null
    eval_loss:         loss on the fixed eval batch after loading (float)
    truth_eval_loss:   the same loss recorded by train (float)
    extra_step_losses: [[float] per rank] of the steps trained after loading
    load_seconds:      wall time of engine.load_checkpoint on rank 0
    allowlist_changed: repr of each entry of torch's weights_only allowlist that the load added or
                       removed, any rank (an in-job load must leave it as it found it)
"""

import json
import os

MAX_REPORTED_MISMATCHES = 50


def write_verdict(path: str, verdict: dict) -> None:
    """Atomic, so a verdict file that exists is complete (launch.py judges runs by their files)."""
    partial = f"{path}.partial"
    with open(partial, "w") as handle:
        json.dump(verdict, handle, indent=2)
        handle.write("\n")
    os.replace(partial, path)


def read_verdict(path: str) -> dict:
    with open(path) as handle:
        return json.load(handle)
