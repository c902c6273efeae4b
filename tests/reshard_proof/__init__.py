"""Proof harness: train a tiny model with real DeepSpeed, record the truth, and judge a load.

The harness never imports DeepSpeed at package import time; the torchrun entry points do.
It is test code beside the tests, not part of the installed package: pytest finds it through the
`pythonpath` ini option, and every process it starts through PYTHONPATH (launch.child_env). By
hand, from the repository root, `export PYTHONPATH=$PWD:$PWD/tests` first. The README demo is
`python tests/demo.py`.

    # save a checkpoint at N=2 ranks and record its truth
    torchrun --standalone --nproc_per_node=2 -m reshard_proof.train \
        --variant z2_fp32 --save-dir /tmp/ck --truth /tmp/ck.truth.pt
    # load it at M ranks with plain engine.load_checkpoint() and compare bit for bit
    torchrun --standalone --nproc_per_node=2 -m reshard_proof.check_load \
        --variant z2_fp32 --load-dir /tmp/ck --truth /tmp/ck.truth.pt --verdict /tmp/verdict.json
    # every variant, N -> M, with a summary table
    python -m reshard_proof.run_all_variants --n 2 --m 2 --workdir /tmp/proof

Modules: model (the tiny model), batches (deterministic data), client_state (what train saves as
client_state), variants (DeepSpeed configs), engine_setup (build and train an engine on the torchrun
ranks), engine_state (capture everything a checkpoint should carry, from a live engine), bitwise
(exact comparison), truth_file / verdict_file (the two schemas), train / check_load (torchrun entry
points), zero_to_fp32_check (DeepSpeed's own consolidation against the truth), launch (subprocess
wrappers with the teardown-abort retry), negative_controls (tampered copies that must fail),
run_all_variants (the whole matrix).
"""
