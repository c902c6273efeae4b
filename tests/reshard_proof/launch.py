"""Run the proof entry points under torchrun from Python (tests, loops), judging runs by their files.

    python -c "from reshard_proof.launch import train_checkpoint, check_checkpoint as c; \
        train_checkpoint('z2_fp32', 2, '/tmp/ck', '/tmp/ck.truth.pt'); \
        print(c('z2_fp32', 2, '/tmp/ck', '/tmp/ck.truth.pt', '/tmp/v.json')['ok'])"

About one torchrun launch in seventy aborts (SIGABRT) at process teardown after all its work is
done. A run that failed but left every expected file complete is therefore retried once; a run
that failed without its files, or failed twice, raises with the tail of its output.
"""

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
# The harness lives beside the tests, outside the installed package: every process it starts finds
# `reshard` (the checkout, installed or not) and `reshard_proof` through PYTHONPATH (child_env).
TESTS_DIR = Path(__file__).resolve().parents[1]
OUTPUT_TAIL_CHARS = 6000


class TorchrunError(RuntimeError):
    """A torchrun launch failed; the message carries the command and the tail of its output."""


def _looks_complete(path: Path) -> bool:
    """Writers here replace files atomically; this also catches files written by other means."""
    if not path.is_file() or path.stat().st_size == 0:
        return False
    try:
        if path.suffix == ".json":
            json.loads(path.read_text())
        elif path.suffix == ".pt":
            torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:
        return False
    return True


def child_env(env: dict | None = None) -> dict:
    """The environment of a process the harness starts: CPU DeepSpeed, one thread, and PYTHONPATH
    holding the checkout (reshard may not be installed) and tests/ (reshard_proof is never installed),
    so `-m reshard_proof.X` and tests/entry scripts import from any cwd and any interpreter (another
    DeepSpeed's virtual environment included). `env` is applied last."""
    child = dict(os.environ)
    child.update({"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"})
    child["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), str(TESTS_DIR), child.get("PYTHONPATH")]))
    child.update(env or {})
    return child


RANKS_WITHOUT_AGENT = frozenset({
    "reshard_proof.train", "reshard_proof.check_load", "reshard_proof.moe_run", "reshard_proof.folded_tp_ep",
    "reshard_proof.tensor_parallel", "tests.pipeline_run", "reshard_proof.fsdp2_judge",
    # scripts, by their path in the checkout
    "tests/entry/universal_load.py", "tests/entry/hf_trainer.py",
    "tests/entry/hf_accelerate.py", "tests/entry/hf_fsdp2.py", "tests/entry/ppo_resumes.py", "launch/examples/ppo_actor_critic.py",
    "bench/synthetic_load_check.py",
})
"""Proof entry points (modules, or scripts by their path relative to the checkout) run_torchrun starts
as their ranks themselves (run_ranks), without torchrun's agent: the same gloo job of separate
processes, one start-up of torch fewer per launch. Each of them joins its job through
deepspeed.init_distributed (env://: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and needs nothing
that only the agent gives (TORCHELASTIC_*: its store, its run id). `python -m reshard` is not one
of them: it picks its transport by TORCHELASTIC_RUN_ID (reshard.transport), so the tests that
launch it keep the agent. RESHARD_PROOF_TORCHRUN=1 in the environment starts them all under
torchrun again."""


def program_of(module: str | os.PathLike) -> tuple[list[str], str]:
    """(what follows the interpreter, or torchrun's options, in a command line; its key in
    RANKS_WITHOUT_AGENT) of `module`: a module name (`-m module`), or the path of a script (a
    str ending in .py, or a path), run as torchrun runs a script: `python SCRIPT`, its folder first
    on sys.path."""
    if isinstance(module, os.PathLike) or str(module).endswith(".py"):
        script = Path(module).resolve()
        try:
            key = script.relative_to(REPO_ROOT).as_posix()
        except ValueError:
            key = str(script)
        return [str(script)], key
    return ["-m", module], module


RANK_GRACE_SECONDS = 5.0
"""How long the other ranks may run on after one failed (to flush what they print) before they are
killed, as torchrun's agent stops a job's workers when one fails."""


def run_ranks(module: str | os.PathLike, nproc: int, args, *, env: dict | None = None,
              timeout: float = 600, python: str | None = None, nodes: int = 1) -> subprocess.CompletedProcess:
    """`python -m module *args` (or `python SCRIPT *args`: program_of) as ranks 0..nproc-1 of one job
    on this host, each process given the variables torchrun's agent gives its workers (RANK,
    LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT:
    torch/distributed/elastic/agent/server/local_elastic_agent.py `_start_workers`), rank 0's
    TCPStore on a free port serving the rendezvous (env://), but no agent: the agent imports torch
    before it starts a rank, 3-4 s of CPU per launch on this machine, all before any rank begins.
    `nodes` > 1: nproc ranks on each of that many nodes played on this host, as launch_torchrun_nodes'
    agents play them (node k holds ranks k*nproc.., its GROUP_RANK k; `args` may be a function of
    the node index). As the agent does, the job ends when one rank fails (the others are
    killed RANK_GRACE_SECONDS later). The result holds every rank's output, rank by rank, and the
    exit status of the first rank that failed (0 when none did); TimeoutExpired after `timeout`."""
    import tempfile

    def command_of(node: int) -> list[str]:
        return [python or sys.executable, *program_of(module)[0], *map(str, args(node) if callable(args) else args)]
    command = command_of(0)
    base, port, world = child_env(env), _free_port(), nodes * nproc
    ranks, logs = [], []
    try:
        for rank in range(world):
            node, local = divmod(rank, nproc)
            logs.append(tempfile.TemporaryFile(mode="w+"))
            rank_env = dict(base, RANK=str(rank), LOCAL_RANK=str(local), WORLD_SIZE=str(world),
                            LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK=str(node), GROUP_WORLD_SIZE=str(nodes),
                            ROLE_RANK=str(rank), ROLE_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                            MASTER_PORT=str(port))
            ranks.append(subprocess.Popen(command_of(node), env=rank_env, cwd=REPO_ROOT, stdout=logs[-1],
                                          stderr=subprocess.STDOUT, text=True))
        deadline, failed_at, first_failure = time.monotonic() + timeout, None, 0
        while any(rank.poll() is None for rank in ranks):
            now = time.monotonic()
            if failed_at is None:
                failures = [rank.returncode for rank in ranks if rank.returncode not in (None, 0)]
                if failures:
                    failed_at, first_failure = now, failures[0]
            if now > deadline or (failed_at is not None and now - failed_at > RANK_GRACE_SECONDS):
                break
            time.sleep(0.05)
        timed_out = any(rank.poll() is None for rank in ranks) and failed_at is None
    finally:
        for rank in ranks:
            if rank.poll() is None:
                rank.kill()
            rank.wait()
        output = ""
        for rank, log in enumerate(logs):
            log.seek(0)
            output += f"--- rank {rank} ---\n{log.read()}"
            log.close()
    if timed_out:
        raise subprocess.TimeoutExpired(command, timeout, output=output.encode())
    if not first_failure:
        first_failure = next((rank.returncode for rank in ranks if rank.returncode), 0)
    return subprocess.CompletedProcess(command, first_failure, output, "")


def runs_without_agent(module: str | os.PathLike) -> bool:
    """Whether run_torchrun and run_torchrun_nodes start `module`'s ranks without torchrun's agent."""
    return program_of(module)[1] in RANKS_WITHOUT_AGENT and os.environ.get("RESHARD_PROOF_TORCHRUN") != "1"


def run_torchrun(module: str | os.PathLike, nproc: int, args: Sequence[str], *, env: dict | None = None,
                 timeout: float = 600, expect_files: Iterable[str | os.PathLike] = (),
                 python: str | None = None, nodes: int = 1) -> subprocess.CompletedProcess:
    """`python -m torch.distributed.run --standalone --nproc_per_node=nproc -m module *args` (or a
    script's path in place of `-m module`: program_of), or for the entry points of RANKS_WITHOUT_AGENT
    the same ranks without the agent (run_ranks; only these take `nodes`, see run_torchrun_nodes).
    `python`: the interpreter to run (another DeepSpeed's virtual environment); this one by default."""
    program = program_of(module)[0]
    shown_args = args(0) if callable(args) else args
    command = [python or sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               *program, *map(str, shown_args)]
    without_agent = runs_without_agent(module)
    if nodes > 1 and not without_agent:
        raise ValueError(f"{module}: several nodes under torchrun's agents are run_torchrun_nodes' to start")
    if without_agent:  # what the error messages show
        command = [f"{nodes} x {nproc} ranks without torchrun's agent:" if nodes > 1 else
                   f"{nproc} ranks without torchrun's agent:", command[0], *command[5:]]
    expected = [Path(path) for path in expect_files]
    for attempt in (1, 2):
        for path in expected:  # stale files from an earlier run must not pass for this one's
            path.unlink(missing_ok=True)
        try:
            if without_agent:
                result = run_ranks(module, nproc, args, env=env, timeout=timeout, python=python, nodes=nodes)
            else:
                result = subprocess.run(command, env=child_env(env), cwd=REPO_ROOT, capture_output=True, text=True,
                                        timeout=timeout)
        except subprocess.TimeoutExpired as expired:
            output = (expired.stdout or b"").decode(errors="replace") + (expired.stderr or b"").decode(errors="replace")
            raise TorchrunError(f"timed out after {timeout}s: {' '.join(command)}\n{output[-OUTPUT_TAIL_CHARS:]}")
        if result.returncode == 0:
            return result
        output = result.stdout + result.stderr
        if without_agent and attempt == 1 and "EADDRINUSE" in output:
            # the free port run_ranks picked was taken before rank 0 listened on it: a new port
            print(f"[proof.launch] {module}: port taken before rank 0 listened; retrying once", file=sys.stderr,
                  flush=True)
            continue
        died_at_exit = all(_looks_complete(path) for path in expected) and expected
        if died_at_exit and attempt == 1:
            print(f"[proof.launch] {module} exited {result.returncode} after writing its files; retrying once. "
                  f"Output tail:\n{output[-1500:]}", file=sys.stderr, flush=True)
            continue
        missing = [str(path) for path in expected if not _looks_complete(path)]
        raise TorchrunError(f"exit code {result.returncode} (attempt {attempt}); missing or incomplete: {missing}\n"
                            f"command: {' '.join(command)}\n--- output tail ---\n{output[-OUTPUT_TAIL_CHARS:]}")
    raise AssertionError("unreachable")


def train_checkpoint(variant: str, n: int, save_dir, truth_path, *, steps: int = 3, seed: int = 0,
                     tag: str | None = None, timeout: float = 600, nodes: int = 1, python: str | None = None,
                     env: dict | None = None):
    """Train `variant` on n ranks, save to save_dir, write the truth to truth_path. `nodes` > 1:
    n // nodes ranks on each of that many agents (`run_torchrun_nodes`; "{node}" in save_dir
    becomes each node's index)."""
    from reshard_proof.cpu_ops import build_cpu_ops_for
    build_cpu_ops_for([variant], env)  # once, before the ranks: they would all compile it at once
    args = ["--variant", variant, "--save-dir", save_dir, "--truth", truth_path, "--steps", steps, "--seed", seed]
    if tag is not None:
        args += ["--tag", tag]
    if nodes > 1:
        return run_torchrun_nodes("reshard_proof.train", nodes, n // nodes, args, timeout=timeout,
                                  expect_files=[truth_path])
    return run_torchrun("reshard_proof.train", n, args, timeout=timeout, expect_files=[truth_path], python=python,
                        env=env)


def train_checkpoints(n: int, jobs: Sequence[tuple], *, steps: int = 3, seed: int = 0,
                      timeout: float = 600, python: str | None = None,
                      env: dict | None = None) -> subprocess.CompletedProcess:
    """Train several variants on n ranks in one launch: jobs are (variant, save_dir, truth_path[, steps]),
    trained one after the other, each in a fresh engine (reshard_proof.train --also, --also-steps for
    a job whose steps differ from the first's; those come last); every one writes the files a
    train_checkpoint launch of its own writes. `steps`: of the jobs that name none. `python`, `env`:
    as train_checkpoint's (another DeepSpeed's virtual environment)."""
    from reshard_proof.cpu_ops import build_cpu_ops_for
    build_cpu_ops_for([job[0] for job in jobs], env)  # once, before the ranks: they would all compile it at once
    (variant, save_dir, truth_path, *own), *rest = jobs
    steps = own[0] if own else steps
    args = ["--variant", variant, "--save-dir", save_dir, "--truth", truth_path, "--steps", steps, "--seed", seed]
    for job in rest:
        if len(job) > 3 and job[3] != steps:
            args += ["--also-steps", *job]
        else:
            args += ["--also", *job[:3]]
    return run_torchrun("reshard_proof.train", n, args, timeout=timeout, expect_files=[job[2] for job in jobs],
                        python=python, env=env)


def check_checkpoint(variant: str, m: int, load_dir, truth_path, verdict_path, *, seed: int = 1,
                     tag: str | None = None, extra_steps: int = 1, in_job: bool = False,
                     timeout: float = 600, nodes: int = 1, python: str | None = None, env: dict | None = None) -> dict:
    """Load load_dir on m ranks, judge it against truth_path; returns the parsed verdict.
    in_job: load with reshard.deepspeed.load_checkpoint rather than engine.load_checkpoint.
    nodes > 1: m // nodes ranks on each of that many agents, "{node}" in load_dir their node index."""
    args = ["--variant", variant, "--load-dir", load_dir, "--truth", truth_path, "--verdict", verdict_path,
            "--seed", seed, "--extra-steps", extra_steps]
    if tag is not None:
        args += ["--tag", tag]
    if in_job:
        args.append("--in-job")
    if nodes > 1:
        run_torchrun_nodes("reshard_proof.check_load", nodes, m // nodes, args, timeout=timeout,
                           expect_files=[verdict_path])
    else:
        run_torchrun("reshard_proof.check_load", m, args, timeout=timeout, expect_files=[verdict_path], python=python,
                     env=env)
    with open(verdict_path) as handle:
        return json.load(handle)


def _free_port() -> int:
    import socket
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def launch_torchrun_nodes(module: str, nnodes: int, nproc_per_node: int, args, *, env: dict | None = None,
                          timeout: float = 600) -> tuple[list[int | None], list[str]]:
    """`nnodes` torchrun agents on this host playing nodes 0..nnodes-1 of one job, each running
    `nproc_per_node` workers of `-m module`: (exit code of each agent, None if timed out; output).

    `args`: the module's arguments, or a function of the node index giving them (a per-node path,
    as node-local storage has on real nodes). The agents meet in a c10d rendezvous on a free
    localhost port; agent k names itself 127.0.0.(k+1), and c10d numbers nodes in the order of
    their names, so agent k is node k (GROUP_RANK) every time.
    """
    import tempfile
    port = _free_port()
    agents, logs = [], []
    codes: list[int | None] = []
    try:
        for node in range(nnodes):
            node_args = args(node) if callable(args) else args
            command = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}",
                       f"--nproc_per_node={nproc_per_node}", "--rdzv_backend=c10d",
                       f"--rdzv_endpoint=127.0.0.1:{port}", f"--rdzv_id=proof-{port}",
                       f"--local_addr=127.0.0.{node + 1}", "-m", module, *map(str, node_args)]
            log = tempfile.TemporaryFile(mode="w+")
            logs.append(log)
            agents.append(subprocess.Popen(command, env=child_env(env), cwd=REPO_ROOT, stdout=log,
                                           stderr=subprocess.STDOUT, text=True))
        deadline = time.monotonic() + timeout
        for agent in agents:
            try:
                codes.append(agent.wait(timeout=max(1.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append(None)
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
                agent.wait()
        outputs = []
        for log in logs:
            log.seek(0)
            outputs.append(log.read())
            log.close()
    return codes, outputs


def run_torchrun_nodes(module: str, nnodes: int, nproc_per_node: int, args, *, env: dict | None = None,
                       timeout: float = 600, expect_files: Iterable[str | os.PathLike] = ()) -> list[str]:
    """`launch_torchrun_nodes`, judged and retried as run_torchrun; returns each agent's output.
    The entry points of RANKS_WITHOUT_AGENT run as the same ranks without the agents (run_ranks
    `nodes`, GROUP_RANK the node index as the agents give it): one output, every node's ranks'."""
    if runs_without_agent(module):
        return [run_torchrun(module, nproc_per_node, args, env=env, timeout=timeout, expect_files=expect_files,
                             nodes=nnodes).stdout]
    expected = [Path(path) for path in expect_files]
    for attempt in (1, 2):
        for path in expected:
            path.unlink(missing_ok=True)
        codes, outputs = launch_torchrun_nodes(module, nnodes, nproc_per_node, args, env=env, timeout=timeout)
        if all(code == 0 for code in codes):
            return outputs
        tail = "\n".join(f"--- node {k} (exit {code}) ---\n{out[-OUTPUT_TAIL_CHARS // nnodes:]}"
                         for k, (code, out) in enumerate(zip(codes, outputs)))
        if None in codes:
            raise TorchrunError(f"timed out after {timeout}s: {nnodes} agents of -m {module}\n{tail}")
        if expected and all(_looks_complete(path) for path in expected) and attempt == 1:
            print(f"[proof.launch] {module} on {nnodes} nodes exited {codes} after writing its files; retrying once",
                  file=sys.stderr, flush=True)
            continue
        missing = [str(path) for path in expected if not _looks_complete(path)]
        raise TorchrunError(f"exit codes {codes} (attempt {attempt}) of -m {module} on {nnodes} nodes; missing or "
                            f"incomplete: {missing}\n{tail}")
    raise AssertionError("unreachable")


def check_checkpoints(m: int, jobs: Sequence[tuple], *, seed: int = 1, extra_steps: int = 1,
                      timeout: float = 600) -> list[dict]:
    """Judge several checkpoints at m ranks in one launch: jobs are (variant, load_dir, truth_path,
    verdict_path); each is loaded in a fresh engine of its variant. Returns the parsed verdicts."""
    (variant, load_dir, truth_path, verdict_path), *rest = jobs
    args = ["--variant", variant, "--load-dir", load_dir, "--truth", truth_path, "--verdict", verdict_path,
            "--seed", seed, "--extra-steps", extra_steps]
    for job in rest:
        args += ["--also", *job]
    run_torchrun("reshard_proof.check_load", m, args, timeout=timeout, expect_files=[job[3] for job in jobs])
    verdicts = []
    for job in jobs:
        with open(job[3]) as handle:
            verdicts.append(json.load(handle))
    return verdicts


def train_moe_checkpoint(variant: str, ep: int, world: int, save_dir, truth_path, *, steps: int = 3,
                         timeout: float = 600) -> subprocess.CompletedProcess:
    """Train the native MoE `variant` on `world` ranks at expert-parallel size `ep` (reshard_proof.moe_run)."""
    args = ["train", "--variant", variant, "--ep", ep, "--save-dir", save_dir, "--truth", truth_path,
            "--steps", steps]
    return run_torchrun("reshard_proof.moe_run", world, args, timeout=timeout, expect_files=[truth_path])


def train_moe_checkpoints(ep: int, world: int, saves: Sequence[tuple], *, steps: int = 3,
                          timeout: float = 1200) -> subprocess.CompletedProcess:
    """Train each (variant, save_dir, truth_path) of `saves` on `world` ranks at expert-parallel
    size `ep` in ONE launch, a fresh engine each (reshard_proof.moe_run train --save)."""
    args = ["train", "--ep", ep, "--steps", steps]
    for save in saves:
        args += ["--save", *save]
    return run_torchrun("reshard_proof.moe_run", world, args, timeout=timeout,
                        expect_files=[truth for *_, truth in saves])


def check_moe_loads(variant: str, ep: int, world: int, truth_path, loads: Sequence[tuple], *,
                    timeout: float = 600) -> list[dict]:
    """Load each (load_dir, verdict_path[, how]) in one job of `world` ranks at `ep`; returns the
    verdicts in that order. how: True or "in_job" (reshard.deepspeed.load_checkpoint), "universal"
    (a ds_to_universal.py output with load_universal), else plain engine.load_checkpoint."""
    args = ["check", "--variant", variant, "--ep", ep, "--truth", truth_path]
    flags = {True: "--in-job-", "in_job": "--in-job-", "universal": "--universal-"}
    for load_dir, verdict_path, *how in loads:
        flag = flags.get(how[0], "--") if how else "--"
        args += [f"{flag}load-dir", load_dir, f"{flag}verdict", verdict_path]
    run_torchrun("reshard_proof.moe_run", world, args, timeout=timeout, expect_files=[load[1] for load in loads])
    verdicts = []
    for _, verdict_path, *_ in loads:
        with open(verdict_path) as handle:
            verdicts.append(json.load(handle))
    return verdicts


def shared_launches(jobs: Sequence[tuple], launch: Callable[[tuple], tuple[int, Sequence]]) -> dict[tuple, list[tuple]]:
    """{(nproc, *base args): [job, ...]}: the launches judge_in_shared_launches starts, one per
    distinct `launch(job)`, each holding its jobs in the order given."""
    launches: dict[tuple, list[tuple]] = {}
    for job in jobs:
        nproc, base_args = launch(job)
        launches.setdefault((nproc, *map(str, base_args)), []).append(job)
    return launches


def judge_in_shared_launches(module: str, jobs: Sequence[tuple], *, launch: Callable[[tuple], tuple[int, Sequence]],
                             job_args: Callable[[tuple], Sequence], verdict: Callable[[tuple], str | os.PathLike],
                             timeout: float = 600) -> dict:
    """Judge `jobs` with one torchrun launch of `module` per launch key, since starting a 2-4 rank job
    costs far more than one more engine in it: `launch(job)` gives (nproc, base args) of the launch
    a job belongs in, `job_args(job)` the arguments that add the job to it (`--job ...`, `--load ...`),
    `verdict(job)` the JSON file the job's verdict is written to. The jobs of one launch keep their
    order. Returns {str(verdict path): the verdict dict, or the exception judging it raised}.

    Should a shared launch fail as a whole (one job's bad input can end the process for all), each
    of its jobs is judged again in a launch of its own, so that every test still meets its own
    verdict or its own error rather than its neighbour's."""
    found: dict = {}
    for (nproc, *base_args), group in shared_launches(jobs, launch).items():
        batches = [group]
        for batch in batches:  # grows by one batch per job should the shared launch fail
            paths = [Path(verdict(job)) for job in batch]
            args = [*base_args, *(arg for job in batch for arg in job_args(job))]
            try:
                run_torchrun(module, nproc, args, timeout=timeout, expect_files=paths)
            except Exception as error:  # noqa: BLE001 (judged one by one, or raised by the test owning it)
                if len(batch) > 1:
                    print(f"[proof.launch] the shared launch of {module} on {nproc} ranks ({' '.join(base_args)}) "
                          f"failed; judging its {len(batch)} jobs one by one: {str(error)[-2000:]}",
                          file=sys.stderr, flush=True)
                    batches += [[job] for job in batch]
                else:
                    found[str(paths[0])] = error
                continue
            for path in paths:
                try:
                    found[str(path)] = json.loads(path.read_text())
                except (OSError, ValueError) as error:  # exit 0 without its verdict: this job's error only
                    found[str(path)] = TorchrunError(f"{module} exited 0 without a readable verdict {path}: {error}")
    return found


def check_moe_together(jobs: Sequence[tuple], *, timeout: float = 600) -> dict:
    """Judge loads of many MoE / AutoEP sources with one launch per (ep, world): jobs are
    (ep, world, variant, truth_path, how, load_dir, verdict_path), how as in check_moe_loads
    ("native", "in_job" or "universal"); each load gets a fresh engine of its own variant
    (moe_run check --job). {str(verdict_path): verdict dict, or the exception judging it raised}
    (judge_in_shared_launches: a failed shared launch is judged again one load per launch)."""
    return judge_in_shared_launches("reshard_proof.moe_run", jobs, timeout=timeout,
                                    launch=lambda job: (job[1], ["check", "--ep", job[0]]),
                                    job_args=lambda job: ["--job", *job[2:7]], verdict=lambda job: job[6])
