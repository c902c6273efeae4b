"""DeepSpeed's own ds_to_universal.py, the second oracle, run over many checkpoints in one process.

    from reshard_proof.ds_universal import ds_to_universal_all, ds_to_universal_each
    failures = ds_to_universal_all([(save_dir / tag, out / tag), ...])   # {} when every one converted
    [(why, stdout), ...] = ds_to_universal_each([...], options=["--no_strict"])  # each one's outcome, printout

Each conversion is DeepSpeed's `main(parse_arguments())` from deepspeed/checkpoint/ds_to_universal.py,
called as its `__main__` block calls it, with the script's own arguments (one extract and one merge
worker, so no process pool; `--inject_missing_state` unless other options are named), in one child
Python process, what each prints to stdout kept apart (redirect_stdout): importing
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
import contextlib, io, json, sys, traceback
from deepspeed.checkpoint import ds_to_universal
jobs, outcomes = json.loads(sys.argv[1]), []
for argv in jobs:
    sys.argv, printed = argv, io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            ds_to_universal.main(ds_to_universal.parse_arguments())
        outcomes.append((None, printed.getvalue()))
    except BaseException:
        outcomes.append((traceback.format_exc(), printed.getvalue()))
with open(OUTCOMES, "w") as handle:
    json.dump(outcomes, handle)
"""
DEFAULT_OPTIONS = ("--inject_missing_state",)


def ds_to_universal_each(conversions: Sequence[tuple], *, options: Sequence[str] = DEFAULT_OPTIONS,
                         timeout: float = 300) -> list[tuple[str | None, str]]:
    """Convert every (tag_dir, out_dir) with DeepSpeed's ds_to_universal.py and `options` (besides
    the folders and one extract and one merge worker), all in one process. Returns, per conversion
    in order, (None or why it failed: the traceback, or the process's output when it died before
    recording its outcomes; what the conversion printed to stdout)."""
    import deepspeed.checkpoint
    script = os.path.join(os.path.dirname(deepspeed.checkpoint.__file__), "ds_to_universal.py")
    jobs = [[script, "--input_folder", str(tag_dir), "--output_folder", str(out_dir), "--num_extract_workers", "1",
             "--num_merge_workers", "1", *options] for tag_dir, out_dir in conversions]
    with tempfile.TemporaryDirectory() as scratch:
        outcomes_path = os.path.join(scratch, "outcomes.json")
        program = f"OUTCOMES = {outcomes_path!r}\n" + _PROGRAM
        done = subprocess.run([sys.executable, "-c", program, json.dumps(jobs)], capture_output=True, text=True,
                              env=child_env(None), timeout=timeout * max(1, len(jobs)), check=False)
        if not os.path.isfile(outcomes_path):
            output = f"exit {done.returncode}\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
            return [(output, "") for _ in conversions]
        with open(outcomes_path) as handle:
            return [(why, printed) for why, printed in json.load(handle)]


def ds_to_universal_all(conversions: Sequence[tuple], *, timeout: float = 300) -> dict[str, str]:
    """Convert every (tag_dir, out_dir) with DeepSpeed's ds_to_universal.py, all in one process
    (ds_to_universal_each, its default options). Returns {str(out_dir): why} for those that failed;
    an empty dict when every conversion succeeded."""
    outcomes = ds_to_universal_each(conversions, timeout=timeout)
    return {str(out_dir): why for (_, out_dir), (why, _) in zip(conversions, outcomes) if why is not None}
