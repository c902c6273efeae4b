"""Issue 37's held-out-shaped check: a pipeline save resharded pp 2 -> 1 by torchrun under a 32M budget,
killed mid-rounds, resumed, byte-identical to an uninterrupted run, judged by a native DeepSpeed load.

    nice -n 10 python bench/pipeline_kill_resume.py                   # the 0.6 GB save, killed at round >= 3
    nice -n 10 python bench/pipeline_kill_resume.py --size tiny       # a smoke test of the bench (~5 MB)
    nice -n 10 python bench/pipeline_kill_resume.py --kill-at-round 5 --budget 32M --durable-every 32M

One PipelineModule save is trained here with real DeepSpeed on 2 CPU ranks at (pp, dp) = (2, 1), as
bench/pipeline_ladder.py trains its rungs (pipeline_bench.py's model: a tied embedding/head, Linear pairs
of odd widths, ZeRO-1 fp32, Adam; `--size` picks the ladder's rung). Then, each as its own process tree:

    uninterrupted  torchrun --nproc_per_node W -m reshard SRC FULL --target-pp 1 --target-dp 2
                   --pipeline-layers N --pipeline-tied embed:0,N-1 --memory-budget B --durable-every D
    killed         the same command into KILLED; the bench reads KILLED's journal
                   (.reshard-staging/*/.reshard-journal.json, written by the lifecycle once every worker has
                   fsynced) and, once it says rounds_done >= --kill-at-round, SIGKILLs the whole torchrun
                   tree from outside (no failpoint, no signal the job could catch)
    resumed        the same command into KILLED again: it must say it resumes and publish

then every file under FULL and KILLED is hashed (SHA-256, by relative path): identical or the bench exits
1. KILLED is loaded with plain `load_checkpoint` in a PipelineModule engine at (pp, dp) = (1, 2) and every
parameter's full fp32 master and Adam moments (dumped by name) must equal the source engine's, bit for
bit, or the bench exits 1. `--durable-every` defaults to the budget: the default (1 GiB) would make the
first durable point the end of a 0.6 GB job, leaving nothing to resume from.

Prints: rounds, the journal's round at the kill, bytes read (uninterrupted and resumed) beside the
source's bytes, every worker's peak private (anonymous) memory beside budget + 300 MB (issue 37's goal),
identical yes/no and the load verdict; the uninterrupted run is the baseline the resumed one is read
against. Writes bench/results/pipeline-kill-resume-<timestamp>.json. Nothing is asserted in tests.
"""
from __future__ import annotations

import argparse
import datetime
import glob
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, REPO)


def tree_hashes(folder: str) -> dict[str, str]:
    """SHA-256 of every file under `folder`, by path relative to it."""
    out = {}
    for root, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(root, name)
            digest = hashlib.sha256()
            with open(path, "rb") as fd:
                while chunk := fd.read(1 << 24):
                    digest.update(chunk)
            out[os.path.relpath(path, folder)] = digest.hexdigest()
    return out


def journal_rounds(dst: str) -> int | None:
    """rounds_done in DST's staging journal (None while there is none, or it is being replaced)."""
    from reshard.jobs.destination import STAGING
    from reshard.jobs.manifest import JOURNAL_NAME
    for path in glob.glob(os.path.join(dst, STAGING, "*", JOURNAL_NAME)):
        try:
            with open(path) as fd:
                return int(json.load(fd)["rounds_done"])
        except (OSError, ValueError, KeyError):
            return None
    return None


def kill_tree(pid: int) -> None:
    """SIGKILL the process group started for `pid` and any descendant that left it."""
    import psutil
    try:
        descendants = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        descendants = []
    os.killpg(pid, signal.SIGKILL)
    for child in descendants:
        try:
            child.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass


def killed_run(command: list[str], dst: str, at_round: int, log_path: str, timeout: float) -> dict:
    """Run `command` in its own session; SIGKILL it from outside once DST's journal shows `at_round`."""
    from make_checkpoint import child_env
    started = time.perf_counter()
    seen = None
    with open(log_path, "wb") as log:
        child = subprocess.Popen(command, env=child_env(), cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                 start_new_session=True)
        while child.poll() is None:
            seen = journal_rounds(dst)
            if seen is not None and seen >= at_round:
                kill_tree(child.pid)
                break
            if time.perf_counter() - started > timeout:
                kill_tree(child.pid)
                raise SystemExit(f"the run to kill did not reach round {at_round} in {timeout} s; log {log_path}")
            time.sleep(0.05)
        child.wait()
    if seen is None or seen < at_round:
        raise SystemExit(f"the run finished (exit {child.returncode}) before its journal showed round {at_round}: "
                         f"nothing was killed; try a smaller --kill-at-round or --durable-every; log {log_path}")
    return {"round_at_kill": seen, "seconds_to_kill": time.perf_counter() - started, "returncode": child.returncode,
            "published_latest": os.path.exists(os.path.join(dst, "latest")), "log": log_path}


def reshard_command(src: str, dst: str, layers: int, args, record: str) -> list[str]:
    pp, dp = args.target
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.workers}",
            "-m", "reshard", src, dst, "--target-pp", str(pp), "--target-dp", str(dp), "--pipeline-layers", str(layers),
            "--pipeline-tied", f"embed:0,{layers - 1}", "--memory-budget", args.budget,
            "--durable-every", args.durable_every or args.budget, "--ignore-batch-config", "--result-json", record]


def watched_reshard(command: list[str], what: str, scratch: str, record: str) -> dict:
    from pipeline_bench import watched
    from pipeline_ladder import summary_figures
    run = watched(command, what, scratch, record)
    with open(os.path.join(scratch, what.replace(" ", "_") + ".log")) as fd:
        text = fd.read()
    run["resumed"] = "resuming an interrupted" in text
    run["summary"] = text[text.find("reshard done"):] if "reshard done" in text else text[-4000:]
    run.update(summary_figures(text))
    with open(record) as fd:  # exact bytes and the round count (the summary rounds bytes)
        checkpoint = json.load(fd)["checkpoints"][0]
    run["read_bytes"], run["rounds"] = checkpoint["bytes_read"], checkpoint["rounds"]
    return run


def main() -> None:
    from pipeline_ladder import SIZES, parse_budget
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="0.6G", help=f"one of pipeline_ladder's rungs {sorted(SIZES)}")
    parser.add_argument("--target", default="1,2", help="pp,dp of the target (source (2, 1))")
    parser.add_argument("--workers", type=int, default=2, help="torchrun --nproc_per_node")
    parser.add_argument("--budget", default="32M", help="reshard's --memory-budget")
    parser.add_argument("--durable-every", help="reshard's --durable-every (default: the budget)")
    parser.add_argument("--kill-at-round", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds the run to kill may take")
    parser.add_argument("--scratch", default="/tmp/bigbench/kill-resume")
    parser.add_argument("--keep", action="store_true", help="keep the scratch directory")
    args = parser.parse_args()
    args.target = tuple(int(x) for x in args.target.split(","))

    from make_checkpoint import tree_bytes
    from pipeline_bench import TAG, differences, read_dumps, torchrun, watched
    from run import log, machine_info
    dim, hidden, pairs = SIZES[args.size]
    layers = 3 * pairs + 3
    shape = ["--dim", dim, "--hidden", hidden, "--pairs", pairs]
    scratch = os.path.abspath(os.path.join(args.scratch, args.size))
    shutil.rmtree(scratch, ignore_errors=True)
    os.makedirs(scratch)
    src, full, killed = (os.path.join(scratch, n) for n in ("src", "full", "killed"))
    results = {"started": datetime.datetime.now(datetime.UTC), "machine": machine_info(), "size": args.size,
               "dim": dim, "hidden": hidden, "pairs": pairs, "layers": layers, "source": {"pp": 2, "dp": 1},
               "target": {"pp": args.target[0], "dp": args.target[1]}, "workers": args.workers,
               "memory_budget": args.budget, "durable_every": args.durable_every or args.budget,
               "kill_at_round": args.kill_at_round, "nice": os.nice(0), "load_average_at_start": os.getloadavg()}
    log(f"[{args.size}] training the source at (pp, dp) = (2, 1), dim {dim}, {pairs} pairs ...")
    results["train"] = watched(torchrun(2, "train", "--pp", 2, "--tp", 1, *shape, "--save", src, "--dump",
                                        os.path.join(scratch, "truth")), "train", scratch)
    results["source_bytes"] = source_bytes = tree_bytes(src)
    results["source_tag_bytes"] = tree_bytes(os.path.join(src, TAG))
    log(f"  source {source_bytes / 1e9:.3f} GB")

    log("uninterrupted reshard (the baseline) ...")
    record = os.path.join(scratch, "full.json")
    results["uninterrupted"] = watched_reshard(reshard_command(src, full, layers, args, record), "uninterrupted",
                                               scratch, record)
    log(f"  {results['uninterrupted']['wall_seconds']:.1f} s, {results['uninterrupted']['rounds']} rounds")

    log(f"reshard killed (SIGKILL from outside) once its journal shows round >= {args.kill_at_round} ...")
    record = os.path.join(scratch, "killed.json")
    results["killed"] = killed_run(reshard_command(src, killed, layers, args, record), killed, args.kill_at_round,
                                   os.path.join(scratch, "killed.log"), args.timeout)
    log(f"  killed at journal round {results['killed']['round_at_kill']} after "
        f"{results['killed']['seconds_to_kill']:.1f} s (exit {results['killed']['returncode']})")

    log("resumed: the same command again ...")
    record = os.path.join(scratch, "resumed.json")
    results["resumed"] = watched_reshard(reshard_command(src, killed, layers, args, record), "resumed", scratch, record)
    log(f"  {results['resumed']['wall_seconds']:.1f} s, said it resumed: {results['resumed']['resumed']}")

    want, got = tree_hashes(full), tree_hashes(killed)
    results["files"] = len(want)
    results["differing_files"] = sorted(p for p in set(want) | set(got) if want.get(p) != got.get(p))
    results["identical"] = not results["differing_files"]

    log(f"native load_checkpoint of the resumed output at (pp, dp) = {args.target} ...")
    tpp, tdp = args.target
    dump = os.path.join(scratch, "dump-native")
    results["native_load"] = watched(torchrun(tpp * tdp, "load", "--pp", tpp, "--tp", 1, *shape, "--load", killed,
                                              "--dump", dump), "native load", scratch)
    truth, _ = read_dumps(os.path.join(scratch, "truth"))
    loaded, extras = read_dumps(dump)
    results["native_load"]["load_seconds"] = max(e["load_seconds"] for e in extras)
    results["parameters"] = len(truth)
    results["elements"] = sum(v["fp32"].numel() for v in truth.values())
    results["load_vs_source"] = differences(loaded, truth)
    results["load_equal"] = not results["load_vs_source"]
    results["load_average_at_end"] = os.getloadavg()
    report(results, parse_budget(args.budget))
    path = os.path.join(HERE, "results", f"pipeline-kill-resume-{results['started']:%Y%m%d-%H%M%S}.json")
    with open(path, "w") as fd:
        json.dump(results, fd, indent=1, default=str)
    print(f"wrote {path}")
    if not args.keep:
        shutil.rmtree(scratch, ignore_errors=True)
    if not (results["identical"] and results["load_equal"] and results["resumed"]["resumed"]):
        raise SystemExit(1)


def report(results: dict, budget: int) -> None:
    from pipeline_ladder import HEADROOM
    full, resumed, killed = results["uninterrupted"], results["resumed"], results["killed"]
    goal = budget + HEADROOM
    print(f"\n== pipeline kill and resume: (pp, dp) (2, 1) -> ({results['target']['pp']}, {results['target']['dp']}), "
          f"{results['elements'] / 1e6:.1f}M fp32 elements, source {results['source_bytes']:,} bytes, torchrun "
          f"W = {results['workers']}, --memory-budget {results['memory_budget']}, --durable-every "
          f"{results['durable_every']}, nice {results['nice']} ==")
    print(f"{'run':14} {'wall s':>7} {'rounds':>7} {'bytes read':>15} {'/ source':>9} {'worker peak private MB':>24}")
    for label, run in (("uninterrupted", full), ("resumed", resumed)):
        anon = "/".join(f"{a / 1e6:.0f}" for a in run["worker_peak_anon_bytes"]) or "?"
        print(f"{label:14} {run['wall_seconds']:7.1f} {run['rounds']:7d} {run['read_bytes']:15,} "
              f"{run['read_bytes'] / results['source_bytes']:8.3f}x {anon:>24}")
    print(f"killed         {killed['seconds_to_kill']:7.1f} s after start, journal round at kill "
          f"{killed['round_at_kill']} of {full['rounds']}, exit {killed['returncode']}, "
          f"latest published: {killed['published_latest']}")
    worst = max(full["worker_peak_anon_bytes"] + resumed["worker_peak_anon_bytes"], default=0)
    print(f"peak private memory per worker: max {worst / 1e6:.0f} MB against budget + 300 MB = {goal / 1e6:.0f} MB: "
          f"{'within' if worst and worst <= goal else 'OVER' if worst else 'not read'}")
    print(f"resumed said so: {resumed['resumed']}; byte-identical to the uninterrupted run ({results['files']} files, "
          f"SHA-256): {'yes' if results['identical'] else 'NO: ' + ', '.join(results['differing_files'])}")
    print(f"native load_checkpoint at the target: every fp32 master and Adam moment equal to the source engine's: "
          f"{'yes' if results['load_equal'] else 'NO (' + str(len(results['load_vs_source'])) + ' differ)'} "
          f"({results['parameters']} parameters, load {results['native_load']['load_seconds']:.1f} s)")
    print(f"load average at start {results['load_average_at_start']}, at end {results['load_average_at_end']}")


if __name__ == "__main__":
    main()
