"""End to end with real DeepSpeed: train at N ranks, reshard to M, load at M, compare bit for bit.

    python -m pytest tests/test_e2e_reshard.py -q            # ~10 min on 2 cores

Each case trains a small model with real DeepSpeed on N CPU ranks (odd-sized parameters, two
param groups, a frozen layer, a tied weight, buffers, an LR scheduler, nested client_state),
records the truth from the source engine, reshards with W workers, then loads the result in a
DeepSpeed engine on M ranks (different seed) with plain `engine.load_checkpoint` and compares
every fp32 master weight and optimizer state element, counters, per-group hyperparameters,
scheduler, loss scaler, frozen parameters, buffers, client_state and the eval loss, then trains
one more step. DeepSpeed's own zero_to_fp32 and `reshard verify --against` must agree too.

The matrix, the W=3 torchrun case, the in-job cases and the module-only in-job load are resharded
first and judged together: all loads at one M, plain, in-job and module-only, share one launch
(tests/trained.py judge_together), each in a fresh engine of its variant. The launch is what costs (~20-35 s on 2 cores); one more load in it about a second.
"""
from __future__ import annotations

import filecmp
import os

import pytest
from trained import MODULE_ONLY, judge, judge_together, reshard_in_threads, reshard_with_torchrun, verdict_of

from reshard_proof.zero_to_fp32_check import UNSUPPORTED, check_zero_to_fp32

pytestmark = pytest.mark.e2e

# variant, N (source ranks), M (target ranks), W (workers)
MATRIX = [
    ("z1_fp32", 2, 3, 2),
    ("z2_fp32", 2, 3, 1),
    ("z3_fp32", 2, 3, 2),
    ("z1_fp16", 2, 3, 3),
    ("z2_fp16", 3, 2, 2),
    ("z3_fp16", 2, 3, 1),
    ("z1_bf16", 2, 3, 2),
    ("z2_bf16", 2, 3, 4),
    ("z3_bf16", 3, 2, 4),
    ("bf16_optimizer", 2, 3, 2),
    ("bf16_optimizer", 3, 2, 1),
    ("z3_subgroups", 2, 3, 2),
    ("z2_round_robin", 2, 3, 2),
    ("z2_param_alignment", 2, 3, 2),
    ("z1_bf16_param_alignment", 3, 2, 2),
    ("z2_exclude_frozen", 2, 3, 2),
    ("z3_exclude_frozen", 2, 3, 2),
    ("z2_sgd_momentum", 2, 3, 2),
    ("z3_sgd_momentum", 2, 3, 3),
    ("z2_fp32", 4, 3, 2),
    ("z2_fp16_overflow", 2, 3, 2),  # a skipped step: Adam's step lags global_steps, the scale was cut
]

# `python -m reshard` under torchrun (separate worker processes over gloo), resharded by judged_loads
# and judged in its shared launch: test name -> (variant, N, M, W, --memory-budget)
TORCHRUN_CASES = {
    "test_torchrun_workers_more_than_source_and_target": ("z3_bf16", 2, 1, 3, "16K"),
    "test_torchrun_grows_zero2_over_gloo_with_a_tiny_budget": ("z2_bf16", 2, 3, 2, "4K"),
}


def _assert_exact(verdict, m):
    assert verdict["ok"], "\n".join([verdict.get("load_error") or ""] + verdict["mismatches"][:20])
    assert verdict["checked_tensors"] > 0 and verdict["world_size"] == m


def _assert_loads_exactly(variant, m, destination, truth, verdict_path):
    _assert_exact(judge(variant, m, destination, truth, verdict_path), m)


def _case_id(variant, n, m, workers=None):
    return f"{variant}-{n}to{m}" + ("" if workers is None else f"-w{workers}")


def _selected(request, test_name: str, cases: list, names: tuple) -> list:
    """The `cases` of `test_name` this session runs (all of them, or those -k / a node id picked):
    a module fixture that prepares every case at once prepares only these."""
    chosen = {tuple(item.callspec.params[name] for name in names) for item in request.session.items
              if getattr(item, "originalname", None) == test_name and hasattr(item, "callspec")}
    return [case for case in cases if tuple(case) in chosen]


@pytest.fixture(scope="module")
def judged_loads(trained, tmp_path_factory, request):
    """{"matrix": {case: (source, truth, destination, reshard result or its error, verdict path, verdicts)},
    "in_job": {case: (files of its source before, after, verdicts, verdict path)}, "torchrun": {test:
    (verdicts, verdict path or the error resharding raised)}, "module_only": (verdicts, result path)}:
    every MATRIX case this session runs resharded in threads, the TORCHRUN_CASES resharded, every IN_JOB case
    loaded straight from its source, the module-only in-job load, and all these loads at one M, plain,
    in-job and module-only alike, judged in one launch (judge_together)."""
    root = tmp_path_factory.mktemp("judged")
    found, jobs = {"matrix": {}, "in_job": {}, "torchrun": {}}, []
    for variant, n, m, workers in _selected(request, "test_reshard_loads_bit_exactly", MATRIX,
                                            ("variant", "n", "m", "workers")):
        case = _case_id(variant, n, m, workers)
        source = truth = None
        destination, verdict_path = root / case / "dst", root / case / "verdict.json"
        try:
            source, truth = trained(variant, n)
            result = reshard_in_threads(source, destination, m, workers, memory_budget=64 << 10)
        except Exception as error:  # noqa: BLE001 (raised by this case's test)
            result = error
        else:
            jobs.append((m, variant, destination, truth, verdict_path))
        found["matrix"][(variant, n, m, workers)] = (source, truth, destination, result, verdict_path)

    for test, (variant, n, m, workers, budget) in TORCHRUN_CASES.items():
        if not any(item.originalname == test for item in request.session.items if item.module is request.module):
            continue
        source, truth = trained(variant, n)
        destination, verdict_path = root / test / "dst", root / test / "verdict.json"
        try:
            reshard_with_torchrun(source, destination, m, workers, "--memory-budget", budget)
        except Exception as error:  # noqa: BLE001 (raised by its test)
            found["torchrun"][test] = error
        else:
            jobs.append((m, variant, destination, truth, verdict_path))
            found["torchrun"][test] = verdict_path

    def listing(source):
        return sorted(p.relative_to(source) for p in source.rglob("*"))

    in_job, before, failed = {}, {}, {}
    for case in _selected(request, "test_in_job_resharding_loads_bit_exactly", IN_JOB, ("variant", "n", "m")):
        verdict_path = root / f"{_case_id(*case)}.json"
        try:
            in_job[case] = trained(case[0], case[1])
        except Exception as error:  # noqa: BLE001 (raised by this case's test)
            failed[str(verdict_path)] = error
        else:
            before[case] = listing(in_job[case][0])
            jobs.append((case[2], case[0], *in_job[case], verdict_path, True))
        found["in_job"][case] = verdict_path

    if any(item.originalname == "test_in_job_module_only_load_of_zero3_goes_through_staging_and_cleans_up"
           for item in request.session.items if item.module is request.module):
        result_path = root / "module-only.json"
        try:
            source, truth = trained("z3_fp32", 2)
        except Exception as error:  # noqa: BLE001 (raised by its test)
            failed[str(result_path)] = error
        else:
            jobs.append((3, "z3_fp32", source, truth, result_path, MODULE_ONLY))
        found["module_only"] = result_path

    verdicts = {**judge_together(jobs), **failed}
    found["matrix"] = {key: (*value, verdicts) for key, value in found["matrix"].items()}
    found["in_job"] = {case: (before.get(case), listing(in_job[case][0]) if case in in_job else None, verdicts,
                              verdict_path) for case, verdict_path in found["in_job"].items()}
    if "module_only" in found:
        found["module_only"] = (verdicts, found["module_only"])
    found["torchrun"] = {test: (verdicts, case) for test, case in found["torchrun"].items()}
    return found


@pytest.fixture(scope="module")
def matrix_outputs(judged_loads):
    """The MATRIX cases of judged_loads."""
    return judged_loads["matrix"]


@pytest.fixture(scope="module")
def in_job_verdicts(judged_loads):
    """The IN_JOB cases of judged_loads."""
    return judged_loads["in_job"]


def _cases(cases) -> list:
    """`cases` as parameters, each marked with the checkpoint it trains (its variant at N)."""
    return [pytest.param(*case, id=_case_id(*case), marks=pytest.mark.trains(case[:2])) for case in cases]


@pytest.mark.parametrize("variant,n,m,workers", _cases(MATRIX))
def test_reshard_loads_bit_exactly(matrix_outputs, variant, n, m, workers):
    source, truth, destination, result, verdict_path, verdicts = matrix_outputs[(variant, n, m, workers)]
    if isinstance(result, BaseException):
        raise result
    assert result.checkpoints[0].target_dp == m and (destination / "latest").is_file()

    _assert_exact(verdict_of(verdicts, verdict_path), m)

    problems = check_zero_to_fp32(str(destination), str(truth))
    if variant != "bf16_optimizer":  # zero_to_fp32 refuses BF16_Optimizer checkpoints, native ones too
        assert problems == [], problems
    else:
        assert len(problems) == 1 and problems[0].startswith(UNSUPPORTED)

    from threaded_transport import run_workers

    from reshard.verify import verify_against, verify_hashes
    assert verify_hashes(str(destination)).ok
    checked = run_workers(2, lambda t: verify_against(str(destination), str(source), transport=t))[0]
    assert checked.ok, checked.summary()
    assert checked.checked_elements > 0


def _torchrun_verdict(judged_loads, test: str, m: int) -> None:
    verdicts, case = judged_loads["torchrun"][test]
    if isinstance(case, BaseException):
        raise case
    _assert_exact(verdict_of(verdicts, case), m)


@pytest.mark.trains(("z3_bf16", 2))
def test_torchrun_workers_more_than_source_and_target(judged_loads):
    """W=3 processes over gloo for N=2 -> M=1: workers that read nothing, workers that write nothing
    (resharded by judged_loads, and judged in its launch at M=1)."""
    _torchrun_verdict(judged_loads, "test_torchrun_workers_more_than_source_and_target", 1)


@pytest.mark.trains(("z2_bf16", 2))
def test_torchrun_grows_zero2_over_gloo_with_a_tiny_budget(judged_loads):
    """Separate processes over gloo, N=2 -> M=3 with W=2, budget 4K: tensors split across many rounds
    (resharded by judged_loads, and judged in its launch at M=3, where the matrix's loads are)."""
    _torchrun_verdict(judged_loads, "test_torchrun_grows_zero2_over_gloo_with_a_tiny_budget", 3)


@pytest.mark.trains(("z3_bf16", 3), ("z2_round_robin", 2), ("bf16_optimizer", 2))
@pytest.mark.parametrize("variant,n,m", [("z3_bf16", 3, 2), ("z2_round_robin", 2, 3), ("bf16_optimizer", 2, 3)])
def test_output_is_byte_identical_whatever_the_workers_and_budget(trained, tmp_path, variant, n, m):
    source, _ = trained(variant, n)
    outputs = []
    for workers, budget in ((1, 1 << 30), (2, 4096), (4, 1024), (3, 64 << 10)):
        destination = tmp_path / f"w{workers}-b{budget}"
        reshard_in_threads(source, destination, m, workers, memory_budget=budget)
        outputs.append(destination)
    tag = (outputs[0] / "latest").read_text()
    names = sorted(n for n in os.listdir(outputs[0] / tag) if n.endswith(".pt"))
    assert names
    for other in outputs[1:]:
        match, mismatch, errors = filecmp.cmpfiles(outputs[0] / tag, other / tag, names, shallow=False)
        assert mismatch == [] and errors == [], (other, mismatch, errors)


@pytest.mark.trains(("z2_fp16", 3))
def test_source_checkpoint_is_untouched(trained, tmp_path):
    from reshard.files.byte_io import hash_file
    source, _ = trained("z2_fp16", 3)
    before = {p: (p.stat().st_mtime_ns, hash_file(str(p))) for p in source.rglob("*") if p.is_file()}
    reshard_in_threads(source, tmp_path / "dst", 2, 2)
    after = {p: (p.stat().st_mtime_ns, hash_file(str(p))) for p in source.rglob("*") if p.is_file()}
    assert before == after


IN_JOB = [("z3_fp16", 2, 3), ("bf16_optimizer", 3, 2), ("z2_round_robin", 2, 3), ("z1_bf16_param_alignment", 2, 1),
          ("z3_subgroups", 2, 1), ("z2_fp32", 2, 3)]


@pytest.mark.parametrize("variant,n,m", _cases(IN_JOB))
def test_in_job_resharding_loads_bit_exactly(in_job_verdicts, variant, n, m):
    """reshard.deepspeed.load_checkpoint at M ranks straight from the N-rank checkpoint: no copy on
    disk, and every rank's torch.serialization.get_safe_globals() is the same after the load as
    before it (the last case was tests/test_rank_values.py's allowlist test)."""
    before, after, verdicts, verdict_path = in_job_verdicts[(variant, n, m)]
    verdict = verdict_of(verdicts, verdict_path)
    assert verdict["in_job"] and verdict["ok"], "\n".join([verdict.get("load_error") or ""] + verdict["mismatches"][:20])
    assert verdict["checked_tensors"] > 0
    assert verdict["allowlist_changed"] == []
    assert after == before


UNIVERSAL = [("z2_fp32", 2, 3), ("z3_bf16", 3, 2), ("z1_bf16", 2, 3)]


@pytest.fixture(scope="module")
def universal_conversions(trained, tmp_path_factory, request):
    """{case: (truth path, ds_to_universal's output, why it failed or None)}: every UNIVERSAL case this
    session runs resharded in threads, then every output converted by DeepSpeed's ds_to_universal.py
    in one process (reshard_proof.ds_universal), since importing DeepSpeed is most of what one costs."""
    from reshard_proof.ds_universal import ds_to_universal_all
    root = tmp_path_factory.mktemp("universal-oracle")
    cases = _selected(request, "test_deepspeeds_universal_converter_reads_the_output", UNIVERSAL, ("variant", "n", "m"))
    found, conversions = {}, []
    for variant, n, m in cases:
        try:
            source, truth_path = trained(variant, n)
            destination = root / _case_id(variant, n, m) / "dst"
            reshard_in_threads(source, destination, m, 2)
            tag = (destination / "latest").read_text()
        except Exception as error:  # noqa: BLE001 (raised by this case's test)
            found[(variant, n, m)] = error
            continue
        out = root / _case_id(variant, n, m) / "universal" / tag
        conversions.append((destination / tag, out))
        found[(variant, n, m)] = (truth_path, out)
    failures = ds_to_universal_all(conversions) if conversions else {}
    return {case: value if isinstance(value, BaseException) else (*value, failures.get(str(value[1])))
            for case, value in found.items()}


@pytest.mark.trains(*[case[:2] for case in UNIVERSAL])
@pytest.mark.parametrize("variant,n,m", UNIVERSAL)
def test_deepspeeds_universal_converter_reads_the_output(universal_conversions, variant, n, m):
    """ds_to_universal.py on DST gives every parameter's fp32 weight and optimizer state of the truth."""
    import torch

    from reshard_proof.bitwise import compare_trees
    from reshard_proof.truth_file import read_truth
    case = universal_conversions[(variant, n, m)]
    if isinstance(case, BaseException):
        raise case
    truth_path, out, failure = case
    assert failure is None, failure
    master = read_truth(str(truth_path))["engine"]["master"]
    for name, entry in master.items():
        expected = {"fp32": entry["fp32"].flatten(), **{k: v.flatten() for k, v in entry["state"].items()}}
        for key, value in expected.items():
            saved = torch.load(out / "zero" / name / f"{key}.pt", weights_only=False)
            saved = saved["param"] if isinstance(saved, dict) else saved
            comparison = compare_trees(value, saved.flatten(), f"{name}/{key}")
            assert comparison.ok, comparison.mismatches


@pytest.mark.trains(("z3_fp32", 2))
def test_in_job_module_only_load_of_zero3_goes_through_staging_and_cleans_up(judged_loads):
    """load_optimizer_states=False under ZeRO-3: DeepSpeed reads the directory with zero_to_fp32, so the
    in-job path reshards into a temporary directory; the module comes back exact and nothing is left.
    Loaded at 3 ranks in the launch judged_loads shares at M=3 (check_load --also-module-only)."""
    verdicts, result_path = judged_loads["module_only"]
    result = verdict_of(verdicts, result_path)
    assert result["mismatches"] == [] and result["checked_tensors"] > 0
    assert result["through_staging"] == 1 and result["staging_left"] == []
