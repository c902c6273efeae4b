"""`python -m reshard export --format universal`: what DeepSpeed's load_universal reads, from W workers.

    python -m pytest tests/test_export_universal.py -q

The oracle is DeepSpeed itself: the source checkpoint is converted by its own ds_to_universal.py
and by reshard; both are loaded with `load_universal` in engines at a new world size, and the two
engines' full state (masters, optimizer states, module, frozen, buffers, counters, hyperparameters,
scheduler) must be equal element for element, and the masters equal to the truth.
"""
from __future__ import annotations

import json

import pytest
import torch
from threaded_transport import run_workers

from reshard.export import export_universal
from reshard_proof.ds_universal import ds_to_universal_all
from reshard_proof.launch import REPO_ROOT, TorchrunError, run_torchrun


def _load_all(m, jobs) -> None:
    """Judge every (variant, ours, theirs, truth, out) at m ranks in one launch of tests/entry/universal_load.py
    (reshard_proof.launch.run_torchrun: ranks without torchrun's agent; retried once should it die at
    teardown after writing every result). A failure raises AssertionError with the tail of the output."""
    try:
        run_torchrun(REPO_ROOT / "tests" / "entry" / "universal_load.py", m, [str(x) for job in jobs for x in job],
                     timeout=300 * len(jobs), expect_files=[job[4] for job in jobs])
    except TorchrunError as error:
        raise AssertionError(str(error)) from None


# variant, n, m, workers; "theirs" is ds_to_universal's output, or None where it cannot convert
# (SGD momentum: both sides are reshard's own, so only the comparison with the truth can fail)
CASES = {"z2_fp32": ("z2_fp32", 2, 3, 2), "z3_bf16": ("z3_bf16", 2, 3, 3),
         "bf16_optimizer": ("bf16_optimizer", 2, 3, 2), "z2_sgd_momentum": ("z2_sgd_momentum", 2, 3, 2)}
CONVERTED = ("z2_fp32", "z3_bf16", "bf16_optimizer")
# the checkpoints its tests ask `trained` for, trained with the session's others (conftest.py)
pytestmark = [pytest.mark.e2e, pytest.mark.trains(*[(variant, n) for variant, n, _, _ in CASES.values()])]


@pytest.fixture(scope="module")
def universal_loads(trained, tmp_path_factory):
    """{case: (source, ours, theirs, result or the exception that judging it raised)}: every case exported
    by reshard, the three DeepSpeed can convert also by ds_to_universal.py (one process), and all
    loaded at m = 3 in one torchrun launch. Should the shared launch fail, each case is loaded in a
    launch of its own, so every test still gets its own result or its own error."""
    root = tmp_path_factory.mktemp("universal")
    cases = {}
    for name, (variant, n, m, workers) in CASES.items():
        source, truth = trained(variant, n)
        ours = root / name / "ours"
        run_workers(workers, lambda t, source=source, ours=ours: export_universal(str(source), str(ours),
                                                                                  memory_budget=4 << 10, transport=t))
        theirs = root / name / "theirs" if name in CONVERTED else ours
        cases[name] = (variant, m, source, truth, ours, theirs, root / name / "result.json")
    conversions = [(cases[name][2] / (cases[name][2] / "latest").read_text(),
                    cases[name][5] / (cases[name][2] / "latest").read_text()) for name in CONVERTED]
    failures = ds_to_universal_all(conversions)
    assert not failures, failures
    jobs = [(variant, ours, theirs, truth, out) for variant, m, source, truth, ours, theirs, out in cases.values()]
    assert {case[1] for case in cases.values()} == {3}
    results = {}
    try:
        _load_all(3, jobs)
    except AssertionError as shared_failure:
        print(f"[universal_loads] the shared launch failed, loading each case alone: {shared_failure}", flush=True)
        for name, job in zip(cases, jobs):
            try:
                _load_all(3, [job])
            except AssertionError as error:
                results[name] = error
    for name, (variant, m, source, truth, ours, theirs, out) in cases.items():
        results.setdefault(name, out)
        result = results[name]
        results[name] = result if isinstance(result, BaseException) else json.loads(out.read_text())
        cases[name] = (source, ours, theirs, results[name])
    return cases


def _result(case) -> dict:
    result = case[3]
    if isinstance(result, BaseException):
        raise result
    return result


@pytest.mark.parametrize("variant,n,m,workers", [CASES[name] for name in CONVERTED])
def test_load_universal_gives_the_same_engine_as_ds_to_universal(universal_loads, variant, n, m, workers):
    source, ours, theirs, _ = universal_loads[variant]
    tag = (source / "latest").read_text()
    assert (ours / "latest_universal").read_text() == tag
    theirs_files = {p.relative_to(theirs) for p in theirs.rglob("*") if p.is_file()}
    ours_files = {p.relative_to(ours) for p in ours.rglob("*") if p.is_file()}
    assert ours_files == theirs_files

    result = _result(universal_loads[variant])
    assert result["mismatches"] == [] and result["checked_tensors"] > 0

    # the per-parameter files hold the same values as DeepSpeed's (ZeRO-3's optimizer_state.pt
    # leaves out rank 0's flat partitions, which the loader never reads)
    for relative in sorted(theirs_files):
        if relative.parts[-2:] == ("zero", "optimizer_state.pt") or "zero" not in relative.parts:
            continue
        a = torch.load(ours / relative, weights_only=False)
        b = torch.load(theirs / relative, weights_only=False)
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


def test_universal_of_sgd_momentum_loads_exactly(universal_loads):
    """ds_to_universal.py only knows exp_avg/exp_avg_sq; reshard writes whatever per-partition state
    the optimizer keeps (momentum_buffer here), and load_universal restores it: masters and state
    equal the truth at another world size (both directories are reshard's, so only the truth
    comparison can fail)."""
    source, ours, theirs, _ = universal_loads["z2_sgd_momentum"]
    assert theirs == ours
    tag = (source / "latest").read_text()
    assert sorted(p.name for p in (ours / tag / "zero" / "up.weight").iterdir()) == ["fp32.pt", "momentum_buffer.pt"]
    result = _result(universal_loads["z2_sgd_momentum"])
    assert result["mismatches"] == [] and result["checked_tensors"] > 0
