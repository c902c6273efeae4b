"""torchrun workers on one host over shared memory: `python -m pytest -q tests/test_same_host_transport.py`.

The choice (shared memory only when torchrun put every worker on this host and nothing asks for
torch), the meeting itself in threads of one process (abstract sockets, memfds passed with
SCM_RIGHTS, then ForkedTransport's rounds), a peer that never comes or belongs to another job,
and one real `torchrun --nproc_per_node=2 -m reshard` (e2e): it says it ran over shared memory
without torch and writes the bytes of `--workers 2` and of `--transport torch`.
"""
from __future__ import annotations

import filecmp
import hashlib
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from reshard.errors import OptionError
from reshard.transport import _choose, torch_backend_for
from reshard.transport.forked import WorkerLost
from reshard.transport.same_host import GREETING, MAGIC, _address, join_workers_on_this_host
from threaded_transport import in_threads

REPO = Path(__file__).resolve().parents[1]
TORCHRUN_VARIABLES = ("TORCHELASTIC_RUN_ID", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "RANK", "PMI_RANK",
                      "OMPI_COMM_WORLD_RANK", "PMIX_RANK")


@pytest.mark.parametrize("environment,kind,backend,expected", [
    ({"TORCHELASTIC_RUN_ID": "x", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}, "auto", "auto", "shared"),
    ({"TORCHELASTIC_RUN_ID": "x", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}, "auto", "auto", "torch"),  # 2 nodes, no node index (test_nodes_transport: with one, "nodes")
    ({"TORCHELASTIC_RUN_ID": "x", "WORLD_SIZE": "2"}, "auto", "auto", "torch"),  # node size unknown
    ({"TORCHELASTIC_RUN_ID": "x", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}, "torch", "auto", "torch"),
    ({"TORCHELASTIC_RUN_ID": "x", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}, "auto", "gloo", "torch"),
    ({"TORCHELASTIC_RUN_ID": "x", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}, "auto", "nccl", "torch"),
    ({"TORCHELASTIC_RUN_ID": "x", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}, "mpi", "auto", "mpi"),
    ({"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}, "auto", "auto", "torch"),  # not torchrun
])
def test_shared_memory_is_chosen_only_for_one_host_under_torchrun(monkeypatch, environment, kind, backend, expected):
    for name in TORCHRUN_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    assert _choose(kind, backend) == expected


@pytest.mark.parametrize("local_workers,gpus,backend,expected", [
    ("1", 1, "auto", "nccl"), ("2", 2, "auto", "nccl"), ("8", 8, "auto", "nccl"),
    ("2", 1, "auto", "gloo"),  # one H200, torchrun --nproc_per_node=2: set_device(1) failed before
    ("2", 0, "auto", "gloo"), ("1", 0, "auto", "gloo"), ("2", 0, "gloo", "gloo"), ("2", 2, "gloo", "gloo"),
])
def test_nccl_only_when_every_worker_on_the_host_has_a_gpu(monkeypatch, local_workers, gpus, backend, expected):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", local_workers)
    assert torch_backend_for(backend, gpus) == expected


def test_a_node_leader_alone_needs_a_gpu_for_nccl(monkeypatch):
    """reshard.transport.nodes: only the leader of each node joins the group, so one GPU serves it
    whatever LOCAL_WORLD_SIZE says; without one it takes gloo."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert torch_backend_for("auto", 1, local_workers=1) == "nccl"
    assert torch_backend_for("auto", 0, local_workers=1) == "gloo"
    assert torch_backend_for("auto", 1) == "gloo"  # all four workers of the host would join


def test_nccl_asked_for_without_a_gpu_per_worker_is_refused_by_name(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(OptionError, match=r"--backend nccl needs one GPU for each worker on a host: 2 workers .* 1 GPU"):
        torch_backend_for("nccl", 1)


def _meet(size: int, job: str, timeout: float = 30, ranks=None, sizes=None) -> list:
    """join_workers_on_this_host for `ranks` (default all) in threads: each rank's transport or exception."""
    ranks = range(size) if ranks is None else ranks
    results: list = [None] * size

    def worker(rank: int):
        try:
            results[rank] = join_workers_on_this_host(rank, (sizes or {}).get(rank, size), job, timeout)
        except BaseException as error:  # noqa: BLE001  (handed to the test)
            results[rank] = error

    threads = [threading.Thread(target=worker, args=(rank,)) for rank in ranks]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout + 30)
    return results


def test_three_workers_meet_and_exchange_through_shared_memory():
    transports = _meet(3, f"test-{uuid.uuid4()}")
    assert all(not isinstance(t, BaseException) for t in transports), transports
    try:
        assert [t.rank for t in transports] == [0, 1, 2] and {t.size for t in transports} == {3}
        assert transports[0].name == "shared memory (torchrun workers on one host)"

        def exchange(transport):
            # worker r sends (r+1) * (p+1) bytes of value 10r+p to worker p, from its shared segment
            counts = [(transport.rank + 1) * (peer + 1) for peer in range(3)]
            send = transport.send_buffers(1, sum(counts))[0]
            at = 0
            for peer, count in enumerate(counts):
                send[at:at + count] = 10 * transport.rank + peer
                at += count
            received = transport.all_to_all(send, counts, [(peer + 1) * (transport.rank + 1) for peer in range(3)])
            return received.tolist(), transport.all_gather_object(transport.rank * 7)

        results = in_threads(transports, exchange)
        for rank, (received, gathered) in enumerate(results):
            expected = []
            for peer in range(3):
                expected += [10 * peer + rank] * ((peer + 1) * (rank + 1))
            assert received == expected and gathered == [0, 7, 14]
    finally:
        for transport in transports:
            if not isinstance(transport, BaseException):
                transport.close()


@pytest.mark.parametrize("present", [0, 1], ids=["lower-rank-missing", "higher-rank-missing"])
def test_a_worker_that_never_comes_fails_its_peers_after_the_timeout(present):
    (error,) = [r for r in _meet(2, f"test-{uuid.uuid4()}", timeout=0.5, ranks=[present]) if r is not None]
    assert isinstance(error, WorkerLost), error
    assert f"worker {present}: waited more than 0.5s for worker" in str(error)


def test_a_worker_of_another_world_size_is_refused():
    results = _meet(2, f"test-{uuid.uuid4()}", timeout=5, sizes={1: 3})
    assert isinstance(results[0], WorkerLost) and "another job or another world size" in str(results[0]), results
    assert isinstance(results[1], WorkerLost) and "closed its connection" in str(results[1]), results


def _tree_equal(a: Path, b: Path) -> None:
    tag = (a / "latest").read_text()
    names = sorted(os.listdir(a / tag))
    assert names == sorted(os.listdir(b / tag)) and "reshard_manifest.json" in names
    match, mismatch, errors = filecmp.cmpfiles(a / tag, b / tag, names, shallow=False)
    assert mismatch == [] and errors == [], mismatch


@pytest.mark.e2e
def test_torchrun_on_one_host_runs_over_shared_memory_without_torch_and_writes_the_same_bytes(tmp_path):
    sys.path.insert(0, str(REPO / "bench"))
    from synthetic_checkpoint import MODELS, write_checkpoint
    source = tmp_path / "src"  # ZeRO-3: optimizer and model-states files per rank, both rebuilt
    write_checkpoint(str(source), MODELS["tiny"], 3, 2)
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    for name in TORCHRUN_VARIABLES:
        env.pop(name, None)
    job = [str(source), None, "--target-dp", "3", "--memory-budget", "4K", "--quiet"]

    def run(launcher: list[str], name: str, *extra: str) -> str:
        args = [str(tmp_path / name) if a is None else a for a in job]
        done = subprocess.run([*launcher, "-m", "reshard", *args, *extra], capture_output=True, text=True, env=env,
                              cwd=REPO, timeout=300)
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    shared = run(torchrun, "torchrun")
    assert "2 worker(s) over shared memory (torchrun workers on one host)" in shared, shared
    assert "  io     : torch-free (no worker imported torch)" in shared.splitlines(), shared
    gloo = run(torchrun, "gloo", "--transport", "torch")
    assert "2 worker(s) over torch.distributed/gloo" in gloo, gloo
    forked = run([sys.executable], "forked", "--workers", "2")
    assert "2 worker(s) over shared memory (forked workers)" in forked, forked
    _tree_equal(tmp_path / "torchrun", tmp_path / "gloo")
    _tree_equal(tmp_path / "torchrun", tmp_path / "forked")


def test_segments_received_from_peers_are_not_inherited_by_child_processes():
    transports = _meet(2, f"test-{uuid.uuid4()}")
    try:
        assert all(not isinstance(t, BaseException) for t in transports), transports
        for transport in transports:
            assert not any(os.get_inheritable(mapping.fd) for mapping in transport.segments)
    finally:
        for transport in transports:
            if not isinstance(transport, BaseException):
                transport.close()


@pytest.mark.e2e
def test_a_torchrun_worker_whose_peer_never_comes_says_so_and_exits_1(tmp_path):
    """Worker 0 of a 2-worker torchrun job on this host whose worker 1 never starts: after --timeout
    the command prints one `reshard: error:` line naming the missing worker, no traceback, status 1."""
    sys.path.insert(0, str(REPO / "bench"))
    from synthetic_checkpoint import MODELS, write_checkpoint
    source = tmp_path / "src"
    write_checkpoint(str(source), MODELS["tiny"], 2, 2)
    env = {name: value for name, value in os.environ.items() if name not in TORCHRUN_VARIABLES}
    env.update(PYTHONPATH=str(REPO), TORCHELASTIC_RUN_ID=uuid.uuid4().hex, RANK="0", LOCAL_RANK="0",
               WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT="29999")
    done = subprocess.run([sys.executable, "-m", "reshard", str(source), str(tmp_path / "dst"), "--target-dp", "3",
                           "--timeout", "1", "--quiet"], capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stderr.startswith("reshard: error: worker 0: waited more than 1s for "), done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert not (tmp_path / "dst").exists()


@pytest.mark.parametrize("garbage", [b"GET / HTTP/1.1\r\n\r\n", MAGIC + bytes(GREETING.size - len(MAGIC))],
                         ids=["not-a-greeting", "greeting-without-memory"])
def test_a_foreign_process_on_the_socket_is_named_as_such(garbage):
    """A process that is no reshard worker connects to worker 0's socket and sends bytes that are
    not a greeting: worker 0 names an unexpected process and its pid, at once (not "a worker
    closed its connection", not a timeout)."""
    job = f"test-{uuid.uuid4()}"
    results: list = [None]

    def worker0():
        try:
            results[0] = join_workers_on_this_host(0, 2, job, 10)
        except BaseException as error:  # noqa: BLE001  (handed to the test)
            results[0] = error

    thread = threading.Thread(target=worker0)
    thread.start()
    intruder = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                intruder.connect(_address(hashlib.sha256(job.encode()).digest(), 0))
                break
            except (ConnectionRefusedError, FileNotFoundError):
                assert time.monotonic() < deadline, "worker 0 never listened"
                time.sleep(0.01)
        intruder.sendall(garbage)
        thread.join(15)
    finally:
        intruder.close()
    assert not thread.is_alive()
    assert isinstance(results[0], WorkerLost), results
    assert f"an unexpected process (pid {os.getpid()}), not a reshard worker of this job" in str(results[0]), results
    assert "closed its connection" not in str(results[0])
