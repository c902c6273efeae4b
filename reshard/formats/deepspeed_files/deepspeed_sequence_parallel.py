"""DeepSpeed Ulysses sequence parallelism in a save: the sp size it was trained at, and what a target needs.

    from reshard.formats.deepspeed_files.deepspeed_sequence_parallel import saved_sequence_parallel_size, sequence_parallel_problem
    saved_sequence_parallel_size(model_tree)          # 2 for an (sp 2, dp 1) save, 1 without sp
    sequence_parallel_problem(target_dp=3, sp=2)      # "... 3 ranks ... not a multiple of ... 2 ..."

Under Ulysses, ZeRO partitions over the sequence-data-parallel group, sp x dp ranks (engine.py
`_configure_distributed_model`: `seq_data_parallel_group`, `seq_dp_world_size`), so the files are
those of a ZeRO save at sp x dp ranks: `zero_pp_rank_{seq-dp rank}_mp_rank_00_optim_states.pt`, one
`mp_rank_00_model_states.pt`, `dp_world_size` = sp x dp. The sp size changes no byte of the files:
reshard's `--target-dp` counts those sp x dp ranks, and the sp size matters only to what the
resumed job can run (the batch config divides by it, the ranks must be a multiple of it).

The save records sp in two places:
- `ds_config["sequence_parallel_size"]`, where the job put it there (HF Transformers' ALST does;
  DeepSpeed's config reads it: runtime/config.py `DeepSpeedConfig.__init__`, world_size / sp);
- `checkpoint_parallel_dimensions["tp_degree"]`: DeepSpeed's sp mpu aliases the model-parallel
  size to sp (runtime/sequence_parallel/parallel_state_sp.py `get_model_parallel_world_size =
  get_sequence_parallel_world_size`) and engine.py `_checkpoint_parallel_metadata` records
  `bwc_tensor_model_parallel_world_size(mpu)`, while `mp_world_size` stays 1 and there is one
  `mp_rank_00` file. A tp_degree above mp_world_size without AutoTP metadata is therefore sp.
"""
from __future__ import annotations


def saved_sequence_parallel_size(model_tree) -> int:
    """The Ulysses sp size of the engine that wrote `model_tree` (a model-states file), 1 without sp."""
    if not isinstance(model_tree, dict):
        return 1
    config = model_tree.get("ds_config")
    configured = config.get("sequence_parallel_size") if isinstance(config, dict) else None
    if isinstance(configured, int) and not isinstance(configured, bool) and configured >= 1:
        return configured
    dims = model_tree.get("checkpoint_parallel_dimensions")
    degree = dims.get("tp_degree") if isinstance(dims, dict) else None
    mp = model_tree.get("mp_world_size", 1)
    if (isinstance(degree, int) and not isinstance(degree, bool) and isinstance(mp, int) and degree > mp == 1
            and "universal_checkpoint_info" not in model_tree):
        return degree
    return 1


def sequence_parallel_problem(target_dp: int, sp: int) -> str | None:
    """Why `target_dp` ZeRO ranks (sp x dp) cannot run at sequence-parallel size `sp`, or None.
    DeepSpeed's sp groups need the world to be a multiple of sp (parallel_state_sp.py
    `initialize_sequence_parallel`: "world_size ... is not divisible by sequence_parallel_size")."""
    if target_dp % sp == 0:
        return None
    return (f"--target-dp {target_dp} is not a multiple of the sequence-parallel size {sp}: under DeepSpeed "
            f"Ulysses, --target-dp counts the sp x dp ranks ZeRO partitions over (the save's dp_world_size), so it "
            f"must be sp x dp ({', '.join(str(sp * dp) for dp in range(1, 5))}, ...); give --target-sp S for a job "
            f"at another sp size (--target-sp 1: no sequence parallelism)")
