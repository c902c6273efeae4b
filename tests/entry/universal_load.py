"""torchrun entry for tests: load two universal checkpoints with DeepSpeed's load_universal, compare engines.

    torchrun --standalone --nproc_per_node=3 tests/entry/universal_load.py VARIANT DIR_A DIR_B TRUTH OUT.json \
        [VARIANT DIR_A DIR_B TRUTH OUT.json ...]

Every job (a group of five arguments) is judged in turn in the one launch, since the launch is what
costs (~20-30 s on 2 cores) and one more pair of loads in it ~1 s. Each directory is loaded into its
own engine (config "checkpoint": {"load_universal": true}, seed 1) with plain
`engine.load_checkpoint`; every rank captures the full engine state (fp32 masters,
optimizer states, module values, frozen parameters, buffers, counters, hyperparameters,
scheduler) and compares A with B element by element, and A's masters with the truth. Rank 0
writes {"mismatches": [...], "checked_tensors": n} to each job's OUT.json. Only loaded values are
compared (no loss is computed), so an engine built earlier in the process cannot change a result.
"""
import dataclasses
import json
import os
import sys

from reshard_proof.bitwise import compare_trees
from reshard_proof.engine_setup import build_engine, finish_and_exit, init_distributed
from reshard_proof.engine_state import capture_engine_state, master_route
from reshard_proof.truth_file import read_truth
from reshard_proof.variants import Variant, get_variant


@dataclasses.dataclass(frozen=True)
class UniversalLoad(Variant):
    """The variant's config with DeepSpeed's universal-checkpoint loading switched on."""

    def ds_config(self, ep: int = 1) -> dict:
        config = super().ds_config(ep)
        config["checkpoint"] = {"load_universal": True}
        return config


def judge(variant_name: str, dir_a: str, dir_b: str, truth_path: str, out: str) -> None:
    import deepspeed.comm as dist

    variant = UniversalLoad(**dataclasses.asdict(get_variant(variant_name)))
    states = []
    for load_dir in (dir_a, dir_b):
        engine = build_engine(variant, seed=1)
        load_path, _ = engine.load_checkpoint(load_dir, load_module_strict=not variant.exclude_frozen_parameters)
        assert load_path is not None, f"nothing loaded from {load_dir}"
        states.append(capture_engine_state(engine, master_from=master_route(variant)))
    comparison = compare_trees(states[0], states[1], "reshard-vs-ds_to_universal")
    truth_master = read_truth(truth_path)["engine"]["master"]
    comparison.absorb(compare_trees(truth_master, states[0]["master"], "reshard-vs-truth"))
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (comparison.mismatches, comparison.checked_tensors))
    if dist.get_rank() == 0:
        with open(out + ".tmp", "w") as fd:
            json.dump({"mismatches": [m for ms, _ in gathered for m in ms],
                       "checked_tensors": sum(n for _, n in gathered)}, fd)
        os.replace(out + ".tmp", out)
    dist.barrier()


def main() -> None:
    jobs = sys.argv[1:]
    if not jobs or len(jobs) % 5:
        raise SystemExit(f"expected groups of VARIANT DIR_A DIR_B TRUTH OUT.json, got {jobs}")
    init_distributed()
    for start in range(0, len(jobs), 5):
        judge(*jobs[start:start + 5])


if __name__ == "__main__":
    main()
    finish_and_exit()
