"""DeepSpeed's own ds_to_universal.py, the second oracle, run over many checkpoints in one process.

    from reshard_proof.ds_universal import ds_to_universal_all
    failures = ds_to_universal_all([(save_dir / tag, out / tag), ...])   # {} when every one converted

Each conversion is DeepSpeed's `main(parse_arguments())` from deepspeed/checkpoint/ds_to_universal.py,
called as its `__main__` block calls it, with the script's own arguments (one extract and one merge
worker, so no process pool; `--inject_missing_state`), in one child Python process: importing
DeepSpeed is most of what a conversion of these tiny checkpoints costs, a new interpreter each
would pay it again. Nothing of ours runs between DeepSpeed's reading and writing; a conversion that
raises is recorded with its traceback and the next one still runs, so every caller meets its own error.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence

from reshard_proof.launch import child_env

# The child: every conversion in turn, each outcome (None, or the traceback) written to a JSON file.
_PROGRAM = """\
import json, sys, traceback
from deepspeed.checkpoint import ds_to_universal
jobs, outcomes = json.loads(sys.argv[1]), []
for argv in jobs:
    sys.argv = argv
    try:
        ds_to_universal.main(ds_to_universal.parse_arguments())
        outcomes.append(None)
    except BaseException:
        outcomes.append(traceback.format_exc())
with open(OUTCOMES, "w") as handle:
    json.dump(outcomes, handle)
"""


def ds_to_universal_all(conversions: Sequence[tuple], *, timeout: float = 300) -> dict[str, str]:
    """Convert every (tag_dir, out_dir) with DeepSpeed's ds_to_universal.py, all in one process.
    Returns {str(out_dir): why} for those that failed (the traceback, or the process's output when it
    died before recording its outcomes); an empty dict when every conversion succeeded."""
    import deepspeed.checkpoint
    script = os.path.join(os.path.dirname(deepspeed.checkpoint.__file__), "ds_to_universal.py")
    jobs = [[script, "--input_folder", str(tag_dir), "--output_folder", str(out_dir), "--num_extract_workers", "1",
             "--num_merge_workers", "1", "--inject_missing_state"] for tag_dir, out_dir in conversions]
    with tempfile.TemporaryDirectory() as scratch:
        outcomes_path = os.path.join(scratch, "outcomes.json")
        program = f"OUTCOMES = {outcomes_path!r}\n" + _PROGRAM
        done = subprocess.run([sys.executable, "-c", program, json.dumps(jobs)], capture_output=True, text=True,
                              env=child_env(None), timeout=timeout * max(1, len(jobs)), check=False)
        if not os.path.isfile(outcomes_path):
            output = f"exit {done.returncode}\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
            return {str(out_dir): output for _, out_dir in conversions}
        with open(outcomes_path) as handle:
            outcomes = json.load(handle)
    return {str(out_dir): why for (_, out_dir), why in zip(conversions, outcomes) if why is not None}
