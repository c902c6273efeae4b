"""torchrun entry for tests: in-job load with load_optimizer_states=False, module values vs truth.

    torchrun --standalone --nproc_per_node=3 tests/entry/module_only_load.py VARIANT LOAD_DIR TRUTH OUT.json

ZeRO-3 then makes DeepSpeed run zero_to_fp32 on the load directory itself, so
reshard.deepspeed.load_checkpoint reshards through a temporary staging directory; this checks
the module values that result and that the staging directory is gone afterwards.
"""
import glob
import json
import os
import sys
import tempfile

from reshard_proof.bitwise import compare_trees
from reshard_proof.engine_setup import build_engine, finish_and_exit, init_distributed
from reshard_proof.engine_state import _capture_module_values, _trainable_names
from reshard_proof.truth_file import read_truth
from reshard_proof.variants import get_variant


def main() -> None:
    variant_name, load_dir, truth_path, out = sys.argv[1:5]
    init_distributed()
    import deepspeed.comm as dist

    import reshard.deepspeed
    engine = build_engine(get_variant(variant_name), seed=1)
    staging_before = set(glob.glob(os.path.join(tempfile.gettempdir(), "reshard-injob-staging-*")))
    through_staging, original = [], reshard.deepspeed._load_through_staging

    def spy(*args, **kwargs):
        through_staging.append(True)
        return original(*args, **kwargs)
    reshard.deepspeed._load_through_staging = spy
    _, client_state = reshard.deepspeed.load_checkpoint(engine, load_dir, load_optimizer_states=False)
    values = _capture_module_values(engine, _trainable_names(engine))
    truth = read_truth(truth_path)
    comparison = compare_trees(truth["engine"]["module"], values["module"], "module")
    comparison.absorb(compare_trees(truth["engine"]["frozen"], values["frozen"], "frozen"))
    comparison.absorb(compare_trees(truth["client_state"], {k: client_state.get(k) for k in truth["client_state"]},
                                    "client_state"))
    staging_after = set(glob.glob(os.path.join(tempfile.gettempdir(), "reshard-injob-staging-*")))
    if dist.get_rank() == 0:
        with open(out, "w") as fd:
            json.dump({"mismatches": comparison.mismatches, "checked_tensors": comparison.checked_tensors,
                       "staging_left": sorted(staging_after - staging_before),
                       "through_staging": len(through_staging)}, fd)
    finish_and_exit()


if __name__ == "__main__":
    main()
