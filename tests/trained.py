"""Real DeepSpeed checkpoints for the end-to-end tests, trained once per test session.

    def test_something(trained):
        save_dir, truth = trained("z2_fp32", 2)      # trains on 2 CPU ranks the first time only

The `trained` fixture lives in conftest.py; this module holds the cache and the helpers the
end-to-end tests share: resharding with W workers (as threads of this process, or as a real
multi-process torchrun job over gloo) and judging a checkpoint at M ranks (`judge`), or many at
once (`judge_together`: one launch per M, since the launch is what costs).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from reshard_proof.launch import (
    check_checkpoint,
    judge_in_shared_launches,
    run_torchrun,
    shared_launches,
    train_checkpoint,
    train_checkpoints,
)

REPO = Path(__file__).resolve().parents[1]


class TrainedCheckpoints:
    """variant, N, steps -> (save_dir, truth path), trained on first use.

    `prepare(wanted)` trains the missing ones among many (variant, N[, steps]) in one launch per N,
    each in a fresh engine (reshard_proof.train --also), the same files a launch each writes, without the
    ~10-20 s a launch costs to start. The session calls it once, for every checkpoint its tests name
    with `@pytest.mark.trains` (conftest.py `trained`, `checkpoints_named`)."""

    def __init__(self, root: Path):
        self.root = root
        self.cache: dict[tuple[str, int, int], tuple[Path, Path]] = {}

    def _paths(self, variant: str, n: int, steps: int) -> tuple[Path, Path]:
        base = self.root / f"{variant}-n{n}-s{steps}"
        base.mkdir(parents=True, exist_ok=True)
        return base / "ckpt", base / "truth.pt"

    def __call__(self, variant: str, n: int, steps: int = 3) -> tuple[Path, Path]:
        key = (variant, n, steps)
        if key not in self.cache:
            save_dir, truth = self._paths(variant, n, steps)
            train_checkpoint(variant, n, save_dir, truth, steps=steps)
            self.cache[key] = (save_dir, truth)
        return self.cache[key]

    def prepare(self, wanted, steps: int = 3) -> None:
        """Train every (variant, n[, steps]) of `wanted` not trained yet (`steps` for those that name
        none), one launch per n whatever the steps (reshard_proof.train --also-steps). Should a
        shared launch fail, nothing is cached from it: each later call trains its own, so every test
        still meets its own checkpoint or its own error."""
        by_n: dict[int, list[tuple[str, int]]] = {}
        for variant, n, *own in wanted:
            key = (variant, own[0] if own else steps)
            if (variant, n, key[1]) not in self.cache and key not in by_n.get(n, []):
                by_n.setdefault(n, []).append(key)
        for n, keys in by_n.items():
            first = keys[0][1]
            keys.sort(key=lambda key: key[1] != first)  # the first one's step count first (--also), stable
            jobs = [(variant, *self._paths(variant, n, count), count) for variant, count in keys]
            try:  # a launch's own timeout, and about a minute more for each engine under load
                train_checkpoints(n, jobs, timeout=600 + 60 * (len(jobs) - 1))
            except Exception as error:  # noqa: BLE001 (each __call__ trains, or fails, on its own)
                print(f"[trained.prepare] the shared launch at N={n} failed; each checkpoint trains on first use: "
                      f"{str(error)[-2000:]}", file=sys.stderr, flush=True)
                continue
            for variant, save_dir, truth, count in jobs:
                self.cache[(variant, n, count)] = (save_dir, truth)


class AutoTPCheckpoints:
    """(tp, dp, ZeRO stage, precision, harness model) -> (save_dir, truth) of reshard_proof.tensor_parallel,
    trained on first use and shared by every test file of the session."""

    def __init__(self, root: Path):
        self.root = root
        self.cache: dict[tuple, tuple[Path, Path]] = {}

    def __call__(self, tp: int, dp: int, stage: int, precision: str, model: str = "base") -> tuple[Path, Path]:
        key = (tp, dp, stage, precision, model)
        if key not in self.cache:
            failed = self.train_many([key])
            if key in failed:
                raise failed[key]
        return self.cache[key]

    def _paths(self, key) -> tuple[Path, Path]:
        tp, dp, stage, precision, model = key
        name = f"{model}-z{stage}-{precision}-tp{tp}-dp{dp}"
        return self.root / name, self.root / f"{name}.truth.pt"

    def train_many(self, keys) -> dict:
        """Train every key not trained yet, one launch per (tp, dp) whatever the stage, precision
        and model (reshard_proof.tensor_parallel `train_checkpoints`: a fresh engine each), since
        the launch is what costs. {key: the exception its launch raised} for those that failed."""
        from reshard_proof.tensor_parallel import train_checkpoints
        by_world: dict[tuple[int, int], list[tuple]] = {}
        for key in keys:
            key = (*key, "base") if len(key) == 4 else tuple(key)
            if key not in self.cache and key not in by_world.get(key[:2], []):
                by_world.setdefault(key[:2], []).append(key)
        failed = {}
        for (tp, dp), group in by_world.items():
            try:
                train_checkpoints(tp, dp, [(stage, precision, model, *self._paths(key))
                                           for key in group for _, _, stage, precision, model in [key]])
            except Exception as error:  # noqa: BLE001 (each test that needs one of them raises it)
                failed.update({key: error for key in group})
                continue
            self.cache.update({key: self._paths(key) for key in group})
        return failed


def checkpoints_named(items) -> dict[int, list[tuple[str, int]]]:
    """{steps: [(variant, n), ...]} named by `@pytest.mark.trains((variant, n[, steps]), ...)` on the
    `items` that use the `trained` fixture, in the order first named: what the session trains up front."""
    found: dict[int, list[tuple[str, int]]] = {}
    for item in items:
        if "trained" not in getattr(item, "fixturenames", ()):
            continue
        for mark in item.iter_markers("trains"):
            for variant, n, *steps in mark.args:
                wanted = found.setdefault(steps[0] if steps else 3, [])
                if (variant, n) not in wanted:
                    wanted.append((variant, n))
    return found


def reshard_in_threads(source, destination, target_dp: int, workers: int, **options):
    """The whole job with `workers` workers as threads of this process (no torchrun)."""
    from threaded_transport import run_workers

    from reshard.jobs.collective_job import reshard_checkpoint
    options.setdefault("quiet", True)
    return run_workers(workers, lambda t: reshard_checkpoint(str(source), str(destination), target_dp,
                                                             transport=t, **options))[0]


def reshard_with_torchrun(source, destination, target_dp: int, workers: int, *extra: str,
                          env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """`torchrun --nproc_per_node=workers -m reshard SRC DST --target-dp M`: separate processes (shared memory
    on one host unless `--transport torch` is in `extra`)."""
    return run_torchrun("reshard", workers, [str(source), str(destination), "--target-dp", str(target_dp),
                                             "--quiet", *extra], env=env, timeout=timeout,
                        expect_files=[Path(destination) / "latest"])


def reshard_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m reshard ...` as a user runs it (one worker), output captured."""
    child = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH=str(REPO))
    child.update(env or {})
    return subprocess.run([sys.executable, "-m", "reshard", *map(str, args)], capture_output=True, text=True,
                          env=child, cwd=REPO, timeout=300)


def reshard_in_process(*args) -> subprocess.CompletedProcess:
    """`reshard ARGS` through reshard.cli.main in this process (one worker), stdout and stderr
    captured: for a test about what the command says and writes, not about the launcher, without
    the ~1-2 s a fresh interpreter costs. An exception main() does not turn into a message
    propagates (where `python -m reshard` would print a traceback)."""
    import contextlib
    import io

    from reshard.cli import main
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main([str(arg) for arg in args])
        except SystemExit as exit:  # argparse's refusals (cli._Parser.error) end the process: its status
            code = exit.code if isinstance(exit.code, int) else 1
    return subprocess.CompletedProcess(["reshard", *map(str, args)], code, out.getvalue(), err.getvalue())


def judge(variant: str, m: int, load_dir, truth, verdict_path, *, in_job: bool = False) -> dict:
    """Load at M ranks with plain load_checkpoint (or reshard.deepspeed.load_checkpoint) and compare."""
    return check_checkpoint(variant, m, load_dir, truth, verdict_path, in_job=in_job)


def judge_together(jobs, *, in_job: bool = False) -> dict:
    """Judge many checkpoints with few launches: jobs are (m, variant, load_dir, truth, verdict_path);
    all those at one M load in one torchrun job of M ranks (reshard_proof.check_load's --also, a fresh
    engine each, fp32, bf16 and fp16 alike: reshard_proof.engine_setup.build_engine undoes what an
    earlier ZeRO-3 engine left in the process), since starting the job costs ~20-35 s on 2 cores and
    one more load in it ~1 s. Returns {str(verdict_path): verdict dict, or the exception judging it
    raised} (reshard_proof.launch `judge_in_shared_launches`: should the shared launch fail as a
    whole, each job is judged in a launch of its own). A job may end in a sixth element, True to
    load that one in-job, or MODULE_ONLY to load it in-job without its optimizer states (its
    "verdict" then is check_load.judge_module_only's result): plain, in-job and module-only loads
    at one M share the launch (check_load --also-in-job, --also-module-only), in that order."""
    kind_of = _kind_of(in_job)
    flags = ("--also", "--also-in-job", "--also-module-only")
    return judge_in_shared_launches("reshard_proof.check_load", sorted(jobs, key=kind_of),  # stable
                                    launch=_check_load_launch,
                                    job_args=lambda job: [flags[kind_of(job)], *job[1:5]],
                                    verdict=lambda job: job[4])


MODULE_ONLY = "module_only"
"""A judge_together job's sixth element for an in-job load without optimizer states."""


def _kind_of(in_job: bool):
    """0 (plain), 1 (in-job) or 2 (module-only) of a judge_together job: in-job for all of them with
    in_job (module-only ones stay module-only), else as its sixth element says."""
    def kind(job) -> int:
        how = job[5] if len(job) > 5 else False
        if how == MODULE_ONLY:
            return 2
        return 1 if in_job or how else 0
    return kind


def _check_load_launch(job):
    """(M, base args) of a judge_together job: one check_load launch per M, every job added by --also(-in-job)."""
    return job[0], []


def launches_of(jobs) -> dict[int, list[tuple[str, str, str, str]]]:
    """{M: [(variant, load_dir, truth, verdict_path), ...]}: the check_load launches judge_together
    starts, one per M, holding every job at that M in the order given."""
    return {m: [tuple(map(str, job[1:5])) for job in group]
            for (m, *_), group in shared_launches(jobs, _check_load_launch).items()}


class JudgedCase:
    """One end-to-end test's share of work judged together with other tests' (a module fixture
    prepares every selected test's case, then judges all their loads with one launch per target
    topology): `root` its folder, `loads` what it wants judged (each with a `verdict` path),
    `error` what preparing it raised, `verdicts` {str(verdict path): verdict, or the exception
    judging it raised}, `values` whatever its test reads back."""

    def __init__(self, root: Path):
        self.root, self.loads, self.error, self.verdicts, self.values = root, [], None, {}, {}

    def verdicts_in_order(self) -> list[tuple]:
        """[(load, verdict)] in the order the loads were added; the error of preparing the case,
        or of judging one of its loads, raised."""
        if self.error is not None:
            raise self.error
        return [(load, verdict_of(self.verdicts, load.verdict)) for load in self.loads]


def judge_cases(cases, judge) -> None:
    """Judge the loads of every case prepared without error in one call of `judge` (loads ->
    {str(verdict path): verdict, or the exception judging it raised}, e.g. judge_together), and
    hand each case its own verdicts. `cases`: JudgedCases, or a dict of them."""
    cases = list(cases.values()) if isinstance(cases, dict) else list(cases)
    loads = [load for case in cases if case.error is None for load in case.loads]
    verdicts = judge(loads) if loads else {}
    for case in cases:
        case.verdicts = {str(load.verdict): verdicts.get(str(load.verdict), LookupError(f"no verdict for {load}"))
                         for load in case.loads}


def selected_tests(request, names) -> list[tuple[str, object]]:
    """[(test name, its `source_key` parameter or None)] of the tests of the requesting module
    named in `names` that this session runs (after -k and the like), in collection order: what a
    shared fixture prepares, so that running one test does not judge the others."""
    found = []
    for item in request.session.items:
        if item.module is request.module and item.originalname in names:
            callspec = getattr(item, "callspec", None)
            key = (item.originalname, callspec.params.get("source_key") if callspec else None)
            if key not in found:
                found.append(key)
    return found


def verdict_of(verdicts: dict, key) -> dict:
    """The verdict judge_together found for `key` (its verdict path); its error raised if judging it failed."""
    verdict = verdicts[str(key)]
    if isinstance(verdict, BaseException):
        raise verdict
    return verdict


class TorchrunOutputs:
    """(variant, N, M) -> DST written by a 2-worker torchrun job over gloo, once per session.

    The reference other execution modes (MPI, SLURM array tasks) must reproduce byte for byte; it
    stays on gloo (`--transport torch`) so that it shares no transport with them, since torchrun
    on one host otherwise exchanges through shared memory as `--workers` does.
    """

    def __init__(self, root: Path, trained: TrainedCheckpoints):
        self.root, self.trained = root, trained
        self.cache: dict[tuple[str, int, int], Path] = {}

    def __call__(self, variant: str, n: int, m: int) -> Path:
        key = (variant, n, m)
        if key not in self.cache:
            source, _ = self.trained(variant, n)
            destination = self.root / f"{variant}-n{n}-to{m}"
            reshard_with_torchrun(source, destination, m, 2, "--memory-budget", "16K", "--transport", "torch")
            self.cache[key] = destination
        return self.cache[key]


def tree_files(root) -> dict[str, bytes]:
    """Every file under `root` (relative path -> content): what byte-identical outputs must share."""
    root = Path(root)
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def tree_state(root, skip=None) -> dict:
    """Relative path -> BLAKE3 (files), "dir" or "link -> target" below `root`, leaving out `skip`:
    what a test compares before and after to prove that nothing outside DST changed or appeared."""
    from reshard.files.byte_io import hash_file
    root = Path(root)
    skip = None if skip is None else Path(skip)
    found = {}
    for path in sorted(root.rglob("*")):
        if skip is not None and (path == skip or skip in path.parents):
            continue
        if path.is_symlink():
            found[path.relative_to(root)] = f"link -> {os.readlink(path)}"
        elif path.is_file():
            found[path.relative_to(root)] = hash_file(str(path))
        else:
            found[path.relative_to(root)] = "dir"
    return found


def saved_parallel_sizes(tag_dir) -> set[tuple]:
    """{(tensor_parallel.autotp_size, expert_parallel.autoep_size)} over the ds_config of every
    file in `tag_dir` that saves one (None where the config does not name the size)."""
    import torch
    sizes = set()
    for path in sorted(Path(tag_dir).glob("*.pt")):
        config = torch.load(path, weights_only=False, map_location="cpu").get("ds_config")
        if isinstance(config, dict):
            sizes.add(((config.get("tensor_parallel") or {}).get("autotp_size"),
                       (config.get("expert_parallel") or {}).get("autoep_size")))
    return sizes
