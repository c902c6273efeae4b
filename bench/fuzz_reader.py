"""Differential fuzz of reshard's torch-free reader against torch.load, at scale, with figures.

    python bench/fuzz_reader.py                                  # 20,000 mutants, seed 0
    python bench/fuzz_reader.py --mutants 50000 --seed 3 --file CKPT/global_step3/zero_pp_rank_0_mp_rank_00_optim_states.pt

Mutants of real torch.save files (tests/reader_fuzz.py: three made here, plus any --file, e.g.
a real DeepSpeed optimizer-states file). reshard's reader (torch_pickle.read_portable) reads each
in this process; torch.load(weights_only=True) reads each in a child process, so a mutant that
crashes torch is counted, not fatal. A refused mutant is loaded as reshard's torch path would
load it (map_location="meta", where a big-endian file crashes torch), a mutant reshard reads
as torch.load(map_location="cpu") to compare every byte. Prints: mutants
tried, refusals (and what torch did with them: refused too, read them, or crashed), files handed
to torch, agreements, and disagreements, which must be 0; the script exits 1 otherwise.
"""
from __future__ import annotations

import argparse
import collections
import multiprocessing
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from reader_fuzz import KINDS, Mutator, base_files, read_ours, torch_load  # noqa: E402


def _serve(connection) -> None:
    """The child: reads each path it is sent with torch, as asked, and answers."""
    import torch
    from reader_fuzz import SAFE
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")  # "Detected pickle protocol 113", TypedStorage deprecation: mutants
    while True:
        path, mode = connection.recv()
        try:
            if mode == "meta":  # as reshard's torch path would load it: the load that crashes on some files
                with torch.serialization.safe_globals(SAFE):
                    torch.load(path, map_location="meta", weights_only=True)
                result = ("tree", None)
            else:
                result = ("tree", torch_load(path))
        except BaseException as error:
            result = ("refused", f"{type(error).__name__}: {str(error)[:200]}")
        connection.send(result)


class TorchReader:
    """torch.load in a child process, restarted when a file crashes it."""

    def __init__(self):
        self.crashes = 0
        self._start()

    def _start(self) -> None:
        context = multiprocessing.get_context("fork")
        self.connection, theirs = context.Pipe()
        self.process = context.Process(target=_serve, args=(theirs,), daemon=True)
        self.process.start()
        theirs.close()

    def read(self, path, mode: str) -> tuple[str, object]:
        """("tree", description) | ("refused", message) | ("crashed", exit code)."""
        self.connection.send((str(path), mode))
        try:
            return self.connection.recv()
        except EOFError:
            self.process.join()
            code = self.process.exitcode
            self.crashes += 1
            self._start()
            return "crashed", code


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mutants", type=int, default=20000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--file", action="append", default=[], help="another torch.save file to mutate")
    args = parser.parse_args()

    torch = TorchReader()
    work = Path(tempfile.mkdtemp(prefix="fuzz-reader-"))
    bases = base_files(work / "bases") + [Path(f) for f in args.file]
    mutators = [Mutator(base, args.seed * 1000 + i) for i, base in enumerate(bases)]
    figures: collections.Counter = collections.Counter()
    by_kind: collections.Counter = collections.Counter()
    disagreements = []
    started = time.perf_counter()
    for i in range(args.mutants):
        mutator = mutators[i % len(mutators)]
        path, kind = mutator.mutant(work / "mutant.pt", KINDS[(i // len(mutators)) % len(KINDS)])
        ours, found = read_ours(path)
        theirs, answer = torch.read(path, "cpu" if ours == "tree" else "meta")
        if ours == "tree":
            if theirs == "tree" and answer == found:
                figures["agreements"] += 1
                by_kind[kind, "agree"] += 1
                continue
            figures["DISAGREEMENTS"] += 1
            kept = work / f"disagreement-{len(disagreements)}.pt"
            os.replace(path, kept)
            disagreements.append((kind, kept, theirs, str(answer)[:300]))
            continue
        figures[f"{'refusals' if ours == 'refused' else 'handed to torch'}, torch {theirs}"] += 1
        by_kind[kind, ours] += 1
        if ours == "refused" and theirs == "crashed":
            figures["torch crashes avoided"] += 1
    seconds = time.perf_counter() - started
    print(f"fuzz_reader: {args.mutants:,} mutants of {len(bases)} files (seed {args.seed}) in {seconds:.0f} s")
    print(f"  mutants tried         : {args.mutants:,}")
    print(f"  refusals              : {sum(v for k, v in figures.items() if k.startswith('refusals')):,}")
    for key in sorted(k for k in figures if k.startswith("refusals")):
        print(f"    {key[len('refusals, '):]:<20}: {figures[key]:,}")
    handed = sum(v for k, v in figures.items() if k.startswith("handed"))
    print(f"  handed to torch       : {handed:,}"
          + "".join(f"\n    {k[len('handed to torch, '):]:<20}: {v:,}" for k, v in sorted(figures.items())
                    if k.startswith("handed")))
    print(f"  agreements            : {figures['agreements']:,}")
    print(f"  disagreements         : {figures['DISAGREEMENTS']:,}")
    print(f"  torch crashes avoided : {figures['torch crashes avoided']:,}")
    print("  per kind (agree / refused / torch): " + ", ".join(
        f"{kind} {by_kind[kind, 'agree']}/{by_kind[kind, 'refused']}/{by_kind[kind, 'torch']}" for kind in KINDS))
    for kind, kept, theirs, answer in disagreements[:10]:
        print(f"  DISAGREEMENT ({kind}): {kept}: torch {theirs}: {answer}")
    return 1 if disagreements else 0


if __name__ == "__main__":
    sys.exit(main())
