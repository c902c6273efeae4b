"""Differential fuzz of reshard's two torch-file readers against torch.load, at scale, with figures.

    python bench/fuzz_reader.py                                  # 20,000 mutants, seed 0
    python bench/fuzz_reader.py --mutants 50000 --seed 3 --file CKPT/global_step3/zero_pp_rank_0_mp_rank_00_optim_states.pt

Mutants of torch.save files of every kind a road reads (tests/reader_fuzz.py: the ZeRO-like ones,
a pipeline layer, stage and optimizer file, a model-axis layer file, a MoE expert file, made here,
plus any --file, e.g. a real DeepSpeed file), byte-level and structure-aware (data.pkl rewritten
op by op) alternately. Each is judged by both readers: the torch-free one (torch_pickle.read_portable,
in this process) against torch.load(weights_only=True), and the memory-mapped load of the whole-file
roads (torch_archive.load_checked) against a plain, unmapped torch.load; torch runs in a child process,
so a mutant that crashes torch is counted, not fatal. A mutant the torch-free reader refuses is
loaded as reshard's torch path would load it (map_location="meta", where a big-endian file crashes
torch). Prints per reader: mutants, refusals, files handed to torch, agreements and disagreements
(which must be 0; the script exits 1 otherwise), and the same per file kind and per mutation kind.
"""
from __future__ import annotations

import argparse
import collections
import multiprocessing
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from reader_fuzz import (  # noqa: E402
    KINDS,
    STRUCTURE_KINDS,
    Mutator,
    StructureMutator,
    base_files,
    read_mapped,
    read_ours,
    torch_load,
)


def _serve(connection) -> None:
    """The child: reads each path it is sent with torch, as asked, and answers."""
    import torch
    from reader_fuzz import SAFE
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")  # "Detected pickle protocol 113", TypedStorage deprecation: mutants
    while True:
        path, mode = connection.recv()
        try:
            if mode == "mapped":  # reshard's whole-file load: refused, or its tree
                result = read_mapped(path)
            elif mode == "meta":  # as reshard's torch path would load it: the load that crashes on some files
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


FILE_KINDS = {"mixed.pt": "mixed (every dtype, views, classes)", "optim_like.pt": "ZeRO optimizer-like",
              "model_like.pt": "ZeRO model-like", "layer_01-model_states.pt": "pipeline layer",
              "mp_rank_01_model_states.pt": "pipeline stage", "zero_pp_rank_1_mp_rank_01_optim_states.pt":
              "pipeline optimizer", "layer_01-model_01-model_states.pt": "model-axis layer",
              "layer_0_expert_3_mp_rank_00_model_states.pt": "MoE expert"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mutants", type=int, default=20000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--file", action="append", default=[], help="another torch.save file to mutate")
    args = parser.parse_args()

    torch = TorchReader()
    work = Path(tempfile.mkdtemp(prefix="fuzz-reader-"))
    base_files_made = base_files(work / "bases")
    bases = base_files_made + [Path(f) for f in args.file]
    families = [(KINDS, [Mutator(base, args.seed * 1000 + i) for i, base in enumerate(bases)]),
                (STRUCTURE_KINDS, [StructureMutator(base, args.seed * 1000 + 500 + i) for i, base in enumerate(bases)])]
    figures: collections.Counter = collections.Counter()
    by_kind: collections.Counter = collections.Counter()
    by_file: collections.Counter = collections.Counter()
    disagreements = []
    started = time.perf_counter()
    for i in range(args.mutants):
        kinds, mutators = families[i % 2]
        index = (i // 2) % len(mutators)
        label = FILE_KINDS[bases[index].name] if index < len(base_files_made) else f"--file {bases[index].name}"
        path, kind = mutators[index].mutant(work / "mutant.pt", kinds[(i // (2 * len(mutators))) % len(kinds)])
        # the torch-free reader (in this process), then torch's plain load in the child
        ours, found = read_ours(path)
        theirs, answer = torch.read(path, "cpu" if ours == "tree" else "meta")
        # the mapped load of the whole-file roads (torch_archive.load_checked), in the child, against a plain load
        mapped, mapped_tree = torch.read(path, "mapped")
        plain, plain_tree = (theirs, answer) if ours == "tree" else torch.read(path, "cpu")
        for reader, verdict, got, their_verdict, their_tree in (("torch-free", ours, found, theirs, answer),
                                                                ("mapped", mapped, mapped_tree, plain, plain_tree)):
            by_file[label, reader, "mutants"] += 1
            if verdict == "tree":
                if their_verdict == "tree" and got == their_tree:
                    outcome = "agree"
                else:
                    outcome = "DISAGREE"
                    kept = work / f"disagreement-{len(disagreements)}.pt"
                    shutil.copy(path, kept)
                    disagreements.append((reader, kind, kept, their_verdict, str(their_tree)[:300]))
            else:
                outcome = {"refused": "refused", "torch": "torch", "crashed": "crashed"}[verdict]
            by_file[label, reader, outcome] += 1
            by_kind[reader, kind, outcome] += 1
            if reader == "torch-free" and outcome in ("refused", "torch"):
                figures[f"{'refusals' if outcome == 'refused' else 'handed to torch'}, torch {theirs}"] += 1
                if outcome == "refused" and theirs == "crashed":
                    figures["torch crashes avoided"] += 1
    seconds = time.perf_counter() - started
    print(f"fuzz_reader: {args.mutants:,} mutants of {len(bases)} files (seed {args.seed}), byte-level and "
          f"structure-aware alternately, each judged by both readers, in {seconds:.0f} s")
    for reader in ("torch-free", "mapped"):
        print(f"  {reader} reader: {args.mutants:,} mutants, {sum(v for (_, r, o), v in by_file.items() if r == reader and o == 'refused'):,} "
              f"refusals, {sum(v for (_, r, o), v in by_file.items() if r == reader and o == 'torch'):,} handed to torch, "
              f"{sum(v for (_, r, o), v in by_file.items() if r == reader and o == 'agree'):,} agreements, "
              f"{sum(v for (_, r, o), v in by_file.items() if r == reader and o == 'DISAGREE'):,} disagreements")
    for key in sorted(k for k in figures if k.startswith("refusals")):
        print(f"    torch-free refusals, {key[len('refusals, '):]:<16}: {figures[key]:,}")
    print(f"    torch crashes avoided         : {figures['torch crashes avoided']:,}")
    print("  per file kind (reader: mutants / refused / handed to torch / agree / disagree):")
    for label in dict.fromkeys(k[0] for k in by_file):
        print(f"    {label:<48}" + "  ".join(
            f"{reader} {by_file[label, reader, 'mutants']}/{by_file[label, reader, 'refused']}/"
            f"{by_file[label, reader, 'torch']}/{by_file[label, reader, 'agree']}/{by_file[label, reader, 'DISAGREE']}"
            for reader in ("torch-free", "mapped")))
    for reader in ("torch-free", "mapped"):
        print(f"  per mutation kind, {reader} (agree / refused / torch): " + ", ".join(
            f"{kind} {by_kind[reader, kind, 'agree']}/{by_kind[reader, kind, 'refused']}/{by_kind[reader, kind, 'torch']}"
            for kind in KINDS + STRUCTURE_KINDS))
    for reader, kind, kept, theirs, answer in disagreements[:10]:
        print(f"  DISAGREEMENT ({reader}, {kind}): {kept}: torch {theirs}: {answer}")
    return 1 if disagreements else 0


if __name__ == "__main__":
    sys.exit(main())
