"""What the CRC-32s of reshard's output files cost: the same reshard with and without sealing, side by side.

    python bench/crc_cost.py                       # ~0.4 GB synthetic ZeRO-2 save, 2 -> 3, one worker
    python bench/crc_cost.py --dim 1024 --layers 8 --repeat 5 --out-dir /dev/shm/crc

A skeleton's storage records carry CRC 0 until reshard.formats.torch_bytes.torch_zip.seal_crcs computes each
from the written bytes (TargetWriter.seal, before the BLAKE3 hash reads the file back). This
script writes a synthetic ZeRO-2 save (bench/synthetic_checkpoint.py, known values, no training),
then reshards it in this process with one worker, alternating (which goes first swaps every
repeat) a run as shipped ("with CRC") and
a run whose writer skips sealing ("without CRC", `target_writer.seal_crcs` replaced by a no-op:
the files then carry CRC 0, as before issue 36), `--repeat` times each, warm page cache. It
prints the median wall of each beside the other, their difference, the sealing time the writer
measured (TargetWriter.crc_seconds, summed over its files), and the output size. The "with"
outputs are checked with zipfile.testzip(); the "without" ones are expected to fail it.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import statistics
import sys
import tempfile
import time
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from synthetic_checkpoint import MODELS, write_checkpoint  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--ranks", type=int, default=2, help="source dp size")
    parser.add_argument("--target-dp", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out-dir", default=None, help="where to put SRC and the outputs (default: a temp dir)")
    args = parser.parse_args()

    from reshard.formats.deepspeed_files import target_writer
    from reshard.jobs.collective_job import reshard_checkpoint

    work = Path(args.out_dir or tempfile.mkdtemp(prefix="crc-cost-"))
    work.mkdir(parents=True, exist_ok=True)
    cfg = dataclasses.replace(MODELS["small"], name=f"crc{args.dim}x{args.layers}", dim=args.dim, layers=args.layers,
                              heads=max(1, args.dim // 64))
    source = work / "src"
    if not (source / "latest").exists():
        write_checkpoint(str(source), cfg, 2, args.ranks)

    sealed_seconds: list[float] = []
    walls: dict[str, list[float]] = {"without CRC": [], "with CRC": []}
    output_bytes = 0
    for attempt in range(args.repeat):
        for label in (list(walls) if attempt % 2 == 0 else list(walls)[::-1]):  # neither always goes first
            destination = work / f"dst-{label.split()[0]}"
            shutil.rmtree(destination, ignore_errors=True)
            original = target_writer.seal_crcs
            if label == "without CRC":
                target_writer.seal_crcs = lambda path, fd=None: 0
            writers: list = []
            create = target_writer.TargetWriter.create.__func__

            def recording_create(cls, *a, **k):
                writer = create(cls, *a, **k)
                writers.append(writer)
                return writer
            target_writer.TargetWriter.create = classmethod(recording_create)
            try:
                started = time.perf_counter()
                reshard_checkpoint(str(source), str(destination), args.target_dp, quiet=True)
                walls[label].append(time.perf_counter() - started)
            finally:
                target_writer.seal_crcs = original
                target_writer.TargetWriter.create = classmethod(create)
            tag_dir = destination / (destination / "latest").read_text()
            files = sorted(tag_dir.glob("*.pt"))
            bad = [f.name for f in files if zipfile.ZipFile(f).testzip() is not None]
            if label == "with CRC":
                assert not bad, f"sealed outputs with bad CRCs: {bad}"
                sealed_seconds.append(sum(w.crc_seconds for w in writers))
                output_bytes = sum(os.path.getsize(f) for f in files)
            else:
                assert bad, "unsealed outputs unexpectedly valid"
    without, with_ = statistics.median(walls["without CRC"]), statistics.median(walls["with CRC"])
    print(f"output: {output_bytes / 1e9:.3f} GB in {args.target_dp} optimizer files + model states "
          f"({args.ranks} -> {args.target_dp}, one worker, warm cache, {args.repeat} runs each, medians)")
    print(f"{'without CRC':>14} {'with CRC':>10} {'difference':>11} {'sealing (writer)':>17} {'CRC GB/s':>9}")
    seal = statistics.median(sealed_seconds)
    print(f"{without:>13.2f}s {with_:>9.2f}s {with_ - without:>+10.2f}s {seal:>16.2f}s "
          f"{output_bytes / 1e9 / seal if seal else float('inf'):>9.2f}")
    print("runs:", {k: [round(v, 2) for v in vs] for k, vs in walls.items()})


if __name__ == "__main__":
    main()
