"""`python -m reshard export --format universal`: what DeepSpeed's load_universal reads, from W workers.

    python -m pytest tests/test_export_universal.py -q

The oracle is DeepSpeed itself: the source checkpoint is converted by its own ds_to_universal.py
and by reshard; both are loaded with `load_universal` in engines at a new world size, and the two
engines' full state (masters, optimizer states, module, frozen, buffers, counters, hyperparameters,
scheduler) must be equal element for element, and the masters equal to the truth.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from threaded_transport import run_workers

from reshard.export import export_universal
from reshard_proof.launch import REPO_ROOT, child_env

pytestmark = pytest.mark.e2e


def _ds_to_universal(source, out_root) -> None:
    import deepspeed.checkpoint
    tag = (source / "latest").read_text()
    script = os.path.join(os.path.dirname(deepspeed.checkpoint.__file__), "ds_to_universal.py")
    done = subprocess.run([sys.executable, script, "--input_folder", str(source / tag),
                           "--output_folder", str(out_root / tag), "--num_extract_workers", "1",
                           "--num_merge_workers", "1", "--inject_missing_state"],
                          capture_output=True, text=True, env=child_env(None), timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]


def _load_both(variant, m, ours, theirs, truth, out) -> dict:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={m}",
               str(REPO_ROOT / "tests" / "entry" / "universal_load.py"), variant, str(ours), str(theirs),
               str(truth), str(out)]
    for _ in range(2):  # a launch can die at teardown after writing its result (see proof.launch)
        done = subprocess.run(command, env=child_env(None), capture_output=True, text=True, timeout=300)
        if out.is_file():
            return json.loads(out.read_text())
    raise AssertionError((done.stdout + done.stderr)[-4000:])


@pytest.mark.parametrize("variant,n,m,workers", [("z2_fp32", 2, 3, 2), ("z3_bf16", 2, 3, 3), ("bf16_optimizer", 2, 3, 2)])
def test_load_universal_gives_the_same_engine_as_ds_to_universal(trained, tmp_path, variant, n, m, workers):
    source, truth = trained(variant, n)
    ours = tmp_path / "ours"
    run_workers(workers, lambda t: export_universal(str(source), str(ours), memory_budget=4 << 10, transport=t))
    tag = (source / "latest").read_text()
    assert (ours / "latest_universal").read_text() == tag
    _ds_to_universal(source, tmp_path / "theirs")
    theirs_files = {p.relative_to(tmp_path / "theirs") for p in (tmp_path / "theirs").rglob("*") if p.is_file()}
    ours_files = {p.relative_to(ours) for p in ours.rglob("*") if p.is_file()}
    assert ours_files == theirs_files

    result = _load_both(variant, m, ours, tmp_path / "theirs", truth, tmp_path / "result.json")
    assert result["mismatches"] == [] and result["checked_tensors"] > 0

    # the per-parameter files hold the same values as DeepSpeed's (ZeRO-3's optimizer_state.pt
    # leaves out rank 0's flat partitions, which the loader never reads)
    for relative in sorted(theirs_files):
        if relative.parts[-2:] == ("zero", "optimizer_state.pt") or "zero" not in relative.parts:
            continue
        a = torch.load(ours / relative, weights_only=False)
        b = torch.load(tmp_path / "theirs" / relative, weights_only=False)
        if isinstance(b, dict):
            assert a.keys() == b.keys() and torch.equal(a["param"], b["param"]), relative
            assert a.get("cat_dim") == b.get("cat_dim")
        else:
            assert a.dtype == b.dtype and torch.equal(a, b), relative


def test_universal_workers_agree(trained, tmp_path):
    source, _ = trained("z3_bf16", 2)
    outputs = []
    for workers in (1, 2):
        out = tmp_path / f"w{workers}"
        run_workers(workers, lambda t: export_universal(str(source), str(out), memory_budget=4 << 10, transport=t))
        outputs.append(out)
    files = sorted(p.relative_to(outputs[0]) for p in outputs[0].rglob("*.pt"))
    assert files
    for relative in files:
        if relative.name == "optimizer_state.pt":
            continue  # a pickle of Python objects; compared by value in the load test
        assert (outputs[1] / relative).read_bytes() == (outputs[0] / relative).read_bytes(), relative


def test_universal_of_sgd_momentum_loads_exactly(trained, tmp_path):
    """ds_to_universal.py only knows exp_avg/exp_avg_sq; reshard writes whatever per-partition state
    the optimizer keeps (momentum_buffer here), and load_universal restores it: masters and state
    equal the truth at another world size (both directories are reshard's, so only the truth
    comparison can fail)."""
    source, truth = trained("z2_sgd_momentum", 2)
    ours = tmp_path / "ours"
    run_workers(2, lambda t: export_universal(str(source), str(ours), memory_budget=4 << 10, transport=t))
    tag = (source / "latest").read_text()
    assert sorted(p.name for p in (ours / tag / "zero" / "up.weight").iterdir()) == ["fp32.pt", "momentum_buffer.pt"]
    result = _load_both("z2_sgd_momentum", 3, ours, ours, truth, tmp_path / "result.json")
    assert result["mismatches"] == [] and result["checked_tensors"] > 0
