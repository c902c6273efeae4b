"""The DeepSpeed version matrix: train with each release, reshard here, load with that release, compare.

    python bench/compat.py                                  # 0.14.5 .. 0.19.8, every variant, 2 -> 3 and 1
    python bench/compat.py --versions 0.16.9 --variants z2_fp32 z3_bf16 --deadline 10:10
    python bench/compat.py --versions 0.16.9 --torch 2.5.1 --update   # another torch: its own venv
    python bench/compat.py --readme-only                    # README's grid from bench/results/compat.json

For each DeepSpeed release (the last patch of each minor from 0.14 to 0.19), a virtual environment
over this interpreter's torch (reshard_proof.deepspeed_venv: its own TORCH_EXTENSIONS_DIR, the CPU
op built once before any ranks start, TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1 where that release's
checkpoint engine needs it), or with `--torch T` over torch T's own environment (built once per
torch, reshard_proof.deepspeed_venv.torch_venv). In it, the proof harness trains each variant on 2 CPU
ranks (reshard_proof.train: two param groups, a frozen layer, a tied weight, a buffer, client_state, a
scheduler) and records the truth; `python -m reshard SRC DST --target-dp M` runs in *this*
environment (DeepSpeed 0.19.8 installed, never imported), or with `--torch T` under that
environment's python (so reshard itself runs on torch T); the same release loads DST at M ranks
with plain `engine.load_checkpoint` (reshard_proof.check_load, all variants of one M in one launch)
and compares every fp32 master and optimizer moment, counters, scheduler, frozen params, buffers and
client_state element by element, then trains a step.

Writes bench/results/compat.md (the table, rewritten after every release, so a run stopped at
--deadline keeps what it finished) and bench/results/compat.json. Slow on a shared 2-core machine:
about 5 launches per release and variant set, plus a minute or more to build each environment.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]  # reshard and the harness beside the tests (tests/reshard_proof)

from reshard_proof.deepspeed_venv import DEFAULT_CACHE, deepspeed_venv
from reshard_proof.launch import TorchrunError, run_torchrun, train_checkpoint

VERSIONS = ["0.14.5", "0.15.4", "0.16.9", "0.17.6", "0.18.9", "0.19.8"]
VARIANTS = ["z1_fp32", "z1_bf16", "z2_fp32", "z2_bf16", "z3_fp32", "z3_bf16"]
TARGETS = [3, 1]
RESULTS = REPO / "bench" / "results"


def _reshard(source: Path, destination: Path, m: int, python: str = sys.executable) -> dict:
    """`python -m reshard` under `python` (here by default): exit status and the summary's io line."""
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH=str(REPO))
    started = time.perf_counter()
    done = subprocess.run([python, "-m", "reshard", str(source), str(destination), "--target-dp", str(m)], check=False,
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=600)
    io = next((line.split(":", 1)[1].strip() for line in done.stdout.splitlines() if line.startswith("  io ")), "")
    torch_files = [line.split(":", 1)[1].strip() for line in done.stdout.splitlines() if line.startswith("  torch ")]
    return {"rc": done.returncode, "io": io, "torch_files": torch_files, "seconds": time.perf_counter() - started,
            "error": (done.stderr.strip().splitlines() or [""])[-1] if done.returncode else ""}


def _reason(error: Exception) -> str:
    """The exception a failed launch's ranks raised (its last `...Error: ...` line), else its first line."""
    text = str(error)
    raised = re.findall(r"^(?:\[rank\d+\]: )?(\w+(?:Error|Exception): .+)$", text, flags=re.MULTILINE)
    return (raised[-1] if raised else text.splitlines()[0])[:160]


def _judge(venv, m: int, jobs: list[tuple[str, Path, Path, Path]]) -> None:
    """check_load at m ranks under the release, every (variant, dst, truth, verdict) in one launch."""
    (variant, dst, truth, verdict), *also = jobs
    args = ["--variant", variant, "--load-dir", dst, "--truth", truth, "--verdict", verdict]
    for job in also:
        args += ["--also", *job]
    run_torchrun("reshard_proof.check_load", m, args, python=venv.python, env=venv.env(),
                 expect_files=[job[3] for job in jobs], timeout=900)


def run_release(version: str, variants, targets, workdir: Path, cache: Path, deadline: float,
                torch_release: str | None = None) -> list[dict]:
    """Every variant of DeepSpeed `version` over `torch_release` (None: this interpreter's torch)."""
    rows = []
    started = time.perf_counter()
    venv = deepspeed_venv(version, cache, torch=torch_release)
    build_seconds = time.perf_counter() - started
    quirks = ["TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1"] if "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD" in venv.env() else []
    # reshard runs here over this torch, or under the environment's python over its own torch
    reshard_python = sys.executable if venv.torch is None else venv.python
    torch_version = venv.torch_version()
    for variant in variants:
        if time.time() > deadline:
            break
        row = {"deepspeed": version, "torch": torch_version, "variant": variant, "quirks": quirks, "targets": {},
               "venv_seconds": round(build_seconds, 1)}
        rows.append(row)
        base = workdir / f"{version}-torch-{torch_version}" / variant
        save_dir, truth = base / "ckpt", base / "truth.pt"
        try:
            train_checkpoint(variant, 2, save_dir, truth, python=venv.python, env=venv.env(), timeout=900)
        except TorchrunError as error:
            row["train"] = "failed: " + _reason(error)
            continue
        row["train"] = "ok"
        for m in targets:
            out = base / f"to{m}"
            row["targets"][m] = {"reshard": _reshard(save_dir, out, m, reshard_python)}
    for m in targets:
        base = workdir / f"{version}-torch-{torch_version}"
        jobs = [(row["variant"], base / row["variant"] / f"to{m}", base / row["variant"] / "truth.pt",
                 base / row["variant"] / f"to{m}.verdict.json")
                for row in rows if row.get("train") == "ok" and row["targets"][m]["reshard"]["rc"] == 0]
        if not jobs or time.time() > deadline:
            continue
        try:
            _judge(venv, m, jobs)
        except TorchrunError as error:
            for job in jobs:
                next(r for r in rows if r["variant"] == job[0])["targets"][m]["load"] = {
                    "ok": False, "error": _reason(error)}
            continue
        for job in jobs:
            verdict = json.loads(Path(job[3]).read_text())
            next(r for r in rows if r["variant"] == job[0])["targets"][m]["load"] = {
                "ok": verdict["ok"], "elements": verdict["checked_elements"], "tensors": verdict["checked_tensors"],
                "mismatches": verdict["mismatch_count"], "error": verdict.get("load_error") or
                (verdict["mismatches"][0] if verdict["mismatches"] else "")}
    return rows


def _cell(target: dict | None) -> str:
    if target is None:
        return "not run"
    reshard = target["reshard"]
    if reshard["rc"] != 0:
        return f"reshard exit {reshard['rc']}: {reshard['error'][:80]}"
    load = target.get("load")
    io = "torch-free" if reshard["io"].startswith("torch-free") else f"io torch ({len(reshard['torch_files'])} file(s))"
    if load is None:
        return f"{io}; load not run"
    if load["ok"]:
        return f"{io}; equal ({load['elements']} elements)"
    return f"{io}; NOT equal: {str(load['error'])[:80]}"


def _grid_cell(row: dict) -> str:
    """One README grid cell: every target equal, or what stood in the way (a row's `recheck`, added
    by hand after a load was repeated, says what the repeat showed)."""
    if row.get("train", "not run") != "ok":
        return "not run" if row.get("train", "not run") == "not run" else "training failed (see compat.md)"
    loads = [target.get("load") or {} for target in row["targets"].values()]
    if loads and all(load.get("ok") for load in loads):
        return "equal"
    if row.get("recheck"):
        return "equal on re-check (see compat.md)"
    return "NOT equal (see compat.md)"


def _order(row: dict) -> tuple:
    """Table order: DeepSpeed release, then torch (oldest first), then variant."""
    order = {version: i for i, version in enumerate(VERSIONS)}
    torch_release = tuple(int(part) for part in row["torch"].split("+")[0].split("."))
    return (order.get(row["deepspeed"], len(order)), torch_release,
            VARIANTS.index(row["variant"]) if row["variant"] in VARIANTS else len(VARIANTS))


def write_readme_grid(rows: list[dict], dated: str, readme: Path = REPO / "README.md") -> None:
    """README's (DeepSpeed, torch) x variant grid, between its compat-table markers."""
    variants = [v for v in VARIANTS if any(row["variant"] == v for row in rows)]
    pairs = list(dict.fromkeys((row["deepspeed"], row["torch"]) for row in sorted(rows, key=_order)))
    by_cell = {(row["deepspeed"], row["torch"], row["variant"]): row for row in rows}
    lines = ["<!-- compat-table -->",
             f"Each cell: trained on 2 CPU ranks with that DeepSpeed and torch, resharded to 3 and 1 by reshard "
             f"running on the same torch, loaded with the same DeepSpeed, every element compared (last run {dated} "
             "UTC; full table and notes: [bench/results/compat.md](bench/results/compat.md)).", "",
             "| DeepSpeed | torch | " + " | ".join(variants) + " |", "|---|---|" + "---|" * len(variants)]
    for version, torch_release in pairs:
        lines.append(f"| {version} | {torch_release} | " + " | ".join(
            _grid_cell(by_cell[(version, torch_release, v)]) if (version, torch_release, v) in by_cell else "not run"
            for v in variants) + " |")
    lines.append("<!-- /compat-table -->")
    text = readme.read_text()
    start, end = text.index("<!-- compat-table -->"), text.index("<!-- /compat-table -->") + len("<!-- /compat-table -->")
    readme.write_text(text[:start] + "\n".join(lines) + text[end:])


def write_table(rows: list[dict], targets, path: Path, started: str) -> None:
    lines = [f"# DeepSpeed version matrix ({started} UTC)", "",
             f"Python {platform.python_version()}, CPU ({os.cpu_count()} cores), "
             f"`python bench/compat.py`. Each release trains on 2 ranks (reshard_proof.train) over the row's torch, "
             f"reshard runs on the same torch (this environment for this interpreter's torch, the release's "
             f"environment for `--torch`), the release loads the result with plain `load_checkpoint` and every fp32 "
             f"master, moment, counter, scheduler, frozen param, buffer and client_state value is compared.", "",
             "| DeepSpeed | torch | variant | train | " + " | ".join(f"2 -> {m}" for m in targets) + " | notes |",
             "|---|---|---|---|" + "---|" * len(targets) + "---|"]
    for row in rows:
        cells = [_cell(row["targets"].get(m)) for m in targets]
        notes = ", ".join(row["quirks"] + ([row["recheck"]] if row.get("recheck") else []))
        lines.append(f"| {row['deepspeed']} | {row['torch']} | {row['variant']} | {row.get('train', 'not run')} | "
                     + " | ".join(cells) + f" | {notes} |")
    path.write_text("\n".join(lines) + "\n")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--versions", nargs="+", default=VERSIONS)
    parser.add_argument("--variants", nargs="+", default=VARIANTS)
    parser.add_argument("--targets", nargs="+", type=int, default=TARGETS)
    parser.add_argument("--torch", help="a torch release to run instead of this interpreter's (its own environment)")
    parser.add_argument("--workdir", default="/tmp/reshard-compat")
    parser.add_argument("--cache", default=str(DEFAULT_CACHE), help="where the per-release environments live")
    parser.add_argument("--deadline", help="HH:MM (UTC): start nothing new after it")
    parser.add_argument("--out", default=str(RESULTS / "compat.md"))
    parser.add_argument("--update", action="store_true",
                        help="keep the rows of OUT's .json that this run does not redo (rerun a few cells)")
    parser.add_argument("--readme-only", action="store_true", help="only rewrite README's grid from OUT's .json")
    args = parser.parse_args(argv)
    if args.readme_only:
        header = Path(args.out).read_text().splitlines()[0]  # "# DeepSpeed version matrix (DATE UTC)"
        write_readme_grid(json.loads(Path(args.out).with_suffix(".json").read_text()),
                          header.split("(", 1)[1].split(" UTC")[0])
        return
    now = datetime.datetime.now(datetime.UTC)
    deadline = float("inf")
    if args.deadline:
        hours, minutes = map(int, args.deadline.split(":"))
        deadline = now.replace(hour=hours, minute=minutes, second=0).timestamp()
    started = now.strftime("%Y-%m-%d %H:%M")
    kept: list[dict] = []
    if args.update and Path(args.out).with_suffix(".json").is_file():
        kept = json.loads(Path(args.out).with_suffix(".json").read_text())
        for row in kept:  # JSON made the target sizes strings
            row["targets"] = {int(m): cell for m, cell in row["targets"].items()}
    rows: list[dict] = []
    for version in args.versions:
        if time.time() > deadline:
            break
        rows += run_release(version, args.variants, args.targets, Path(args.workdir), Path(args.cache), deadline,
                            args.torch)
        redone = {(row["deepspeed"], row["torch"], row["variant"]) for row in rows}
        table = sorted([row for row in kept if (row["deepspeed"], row["torch"], row["variant"]) not in redone] + rows,
                       key=_order)
        write_table(table, args.targets, Path(args.out), started)
        Path(args.out).with_suffix(".json").write_text(json.dumps(table, indent=1, default=str))
        write_readme_grid(table, started)
        print(Path(args.out).read_text().splitlines()[-len(args.variants):], flush=True)


if __name__ == "__main__":
    main()
