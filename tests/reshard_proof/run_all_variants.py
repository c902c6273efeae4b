"""Train and natively check every variant (or a chosen few), then print a summary table.

    python -m reshard_proof.run_all_variants --n 2 --m 2 --workdir /tmp/proof [--only z2_fp32 z3_bf16] \
        [--negative-controls]

Without a resharder N must equal M: this is the baseline that proves the harness itself. Also
runs DeepSpeed's zero_to_fp32 against each truth. With --negative-controls, every control of
negative_controls.py is applied to a copy of each checkpoint and its verdict must be NOT ok and
name what was touched. Exit code 1 if any verdict is not as expected.
"""

import argparse
import json
import sys
import time
from pathlib import Path

from reshard_proof.launch import TorchrunError, check_checkpoint, train_checkpoint
from reshard_proof.negative_controls import CONTROLS, copy_checkpoint
from reshard_proof.variants import VARIANTS
from reshard_proof.zero_to_fp32_check import check_zero_to_fp32


def run_negative_controls(variant: str, m: int, save_dir: Path, truth: Path, workdir: Path) -> dict[str, str]:
    """control -> "caught", or why not: every control must give a not-ok verdict naming its target."""
    outcomes = {}
    for control, apply_control in CONTROLS.items():
        tampered = copy_checkpoint(save_dir, workdir / f"tampered_{control}")
        touched = apply_control(tampered)
        verdict = check_checkpoint(variant, m, tampered, truth, workdir / f"verdict_{control}.json")
        named = any(touched in mismatch for mismatch in verdict["mismatches"])
        outcomes[control] = ("caught" if not verdict["ok"] and named else
                             f"MISSED: ok={verdict['ok']}, {touched!r} named={named}: {verdict['mismatches'][:2]}")
        print(f"  control {control} on {variant}: touched {touched!r}: {outcomes[control]}; "
              f"first mismatch: {verdict['mismatches'][:1]}", flush=True)
    return outcomes


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=2)
    parser.add_argument("--m", type=int, default=2)
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--only", nargs="*", default=None)
    parser.add_argument("--negative-controls", action="store_true")
    args = parser.parse_args(argv)

    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    rows, all_ok = [], True
    for name in args.only or list(VARIANTS):
        save_dir, truth = workdir / name / "ckpt", workdir / name / "truth.pt"
        verdict_path = workdir / name / f"verdict_n{args.n}_m{args.m}.json"
        row = {"variant": name}
        try:
            started = time.perf_counter()
            train_checkpoint(name, args.n, save_dir, truth)
            row["train_s"] = round(time.perf_counter() - started, 1)
            started = time.perf_counter()
            verdict = check_checkpoint(name, args.m, save_dir, truth, verdict_path)
            row["check_s"] = round(time.perf_counter() - started, 1)
            row.update(ok=verdict["ok"], tensors=verdict["checked_tensors"], elements=verdict["checked_elements"],
                       mismatches=verdict["mismatches"][:3], load_error=verdict["load_error"])
            row["zero_to_fp32"] = check_zero_to_fp32(save_dir, truth)[:3] or "ok"
            if args.negative_controls:
                row["controls"] = run_negative_controls(name, args.m, save_dir, truth, workdir / name)
                row["ok"] &= all(outcome == "caught" for outcome in row["controls"].values())
        except TorchrunError as error:
            row.update(ok=False, error=str(error)[-2000:])
        all_ok &= bool(row["ok"])
        rows.append(row)
        print(json.dumps(row), flush=True)

    print(f"\n{'variant':26s} {'ok':5s} {'train_s':>7s} {'check_s':>7s} {'tensors':>7s} {'elements':>8s}  zero_to_fp32")
    for row in rows:
        z2f = row.get("zero_to_fp32", "-")
        print(f"{row['variant']:26s} {str(row['ok']):5s} {row.get('train_s', '-'):>7} {row.get('check_s', '-'):>7} "
              f"{row.get('tensors', '-'):>7} {row.get('elements', '-'):>8}  {z2f if isinstance(z2f, str) else z2f[0]}")
    (workdir / f"summary_n{args.n}_m{args.m}.json").write_text(json.dumps(rows, indent=2))
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
