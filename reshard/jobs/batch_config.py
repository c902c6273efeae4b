"""Can the training job, configured as the checkpoint says, run at the target size at all?

    from reshard.jobs.batch_config import batch_config_problem
    batch_config_problem({"train_batch_size": 8, "gradient_accumulation_steps": 2}, target_dp=3)
    # -> "train_batch_size 8 ... cannot run on 3 data-parallel ranks ...; sizes that work: 1, 2, 4"

DeepSpeed requires train_batch_size = micro batch per GPU x gradient accumulation steps x
data-parallel size (runtime/config.py, `_batch_assertion`); under Ulysses sequence parallelism the
data-parallel size is the ranks divided by sp (runtime/config.py `DeepSpeedConfig.__init__`:
`world_size / sequence_parallel_size`), while reshard's --target-dp counts all sp x dp ranks ZeRO
partitions over (reshard.formats.deepspeed_files.deepspeed_sequence_parallel), so the rule divides by `sp`:

    batch_config_problem({"train_batch_size": 2, "train_micro_batch_size_per_gpu": 2}, target_dp=2, sp=2)  # None

A checkpoint's ds_config that
fixes train_batch_size rules out most sizes. reshard explains that before writing anything,
since the resumed job would stop at deepspeed.initialize. The target job may of course use
new batch settings: then --ignore-batch-config.

Launchers that fill in DeepSpeed's batch sizes at start-up from their own per-device settings
(the Hugging Face Trainer, Accelerate) start at any size: for their checkpoints, recognised by
the files they keep in the save directory, the refusal becomes a one-line warning saying how the
global batch size changes (`batch_size_warning`).

    batch_size_warning({"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2,
                        "gradient_accumulation_steps": 1}, 2, 3, ["trainer_state.json"])
    # -> "the Hugging Face Trainer sets DeepSpeed's batch sizes at start-up: the global batch ..."
"""
from __future__ import annotations

import re

_LAUNCHER_FILES = (
    # transformers trainer.py `_save_checkpoint` (TRAINER_STATE_NAME) / accelerate checkpointing.py
    # `save_accelerator_state` (RNG_STATE_NAME): written at every save, by these launchers only.
    ("the Hugging Face Trainer", re.compile(r"^trainer_state\.json$")),
    ("Accelerate", re.compile(r"^random_states_\d+\.pkl$")),
)


def batch_recomputing_launcher(save_dir_files) -> str | None:
    """The launcher whose files the save directory holds, when it recomputes batch sizes; else None."""
    for launcher, pattern in _LAUNCHER_FILES:
        if any(pattern.match(name) for name in save_dir_files):
            return launcher
    return None


def batch_size_warning(ds_config, source_dp: int, target_dp: int, save_dir_files, *, source_sp: int = 1,
                       sp: int = 1) -> str | None:
    """For a recomputing launcher's checkpoint whose saved batch config does not fit `target_dp`:
    one line stating the global batch size before and after. None otherwise. The sizes count ZeRO's
    ranks (sp x dp; `source_sp`, `sp`: the sequence-parallel sizes at the save and at the target)."""
    launcher = batch_recomputing_launcher(save_dir_files)
    if launcher is None or batch_config_problem(ds_config, target_dp, sp) is None:
        return None
    mbs, gas = ds_config.get("train_micro_batch_size_per_gpu"), ds_config.get("gradient_accumulation_steps") or 1
    tbs = ds_config["train_batch_size"]
    source_dp, target_dp = source_dp // source_sp, target_dp // sp
    if not isinstance(mbs, int):
        mbs = tbs // (gas * source_dp)
    return (f"warning: {launcher} sets DeepSpeed's batch sizes at start-up: the global batch size is {tbs} at "
            f"{source_dp} ranks and becomes {mbs * gas * target_dp} at {target_dp} ranks ({mbs} per rank x {gas} "
            f"accumulation steps x ranks) unless the resumed job changes its per-device batch or accumulation steps")


def _fits(tbs: int, mbs: int | None, gas: int | None, dp: int) -> bool:
    if mbs is not None and gas is not None:
        return tbs == mbs * gas * dp
    per_rank, remainder = divmod(tbs, dp)
    if remainder or per_rank < 1:
        return False
    fixed = mbs if mbs is not None else gas
    return fixed is None or (per_rank % fixed == 0 and per_rank >= fixed)


def batch_config_problem(ds_config, target_dp: int, sp: int = 1) -> str | None:
    """Why `ds_config` cannot train on `target_dp` ranks at sequence-parallel size `sp` (target_dp / sp
    data-parallel ranks), or None when it can (or says nothing, or sp does not divide target_dp:
    reshard.formats.deepspeed_files.deepspeed_sequence_parallel.sequence_parallel_problem says that)."""
    if not isinstance(ds_config, dict) or target_dp % sp:
        return None
    values = {key: ds_config.get(key) for key in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                                  "gradient_accumulation_steps")}
    tbs, mbs, gas = values.values()
    if not isinstance(tbs, int) or any(v is not None and not isinstance(v, int) for v in (mbs, gas)):
        return None  # no fixed global batch, or "auto" values a launcher fills in
    if _fits(tbs, mbs, gas, target_dp // sp):
        return None
    working = [sp * dp for dp in working_data_parallel_sizes(ds_config)][:12]
    given = ", ".join(f"{k} {v}" for k, v in values.items() if v is not None)
    ranks = (f"{target_dp} data-parallel ranks" if sp == 1 else
             f"{target_dp} ranks at sequence-parallel size {sp} ({target_dp // sp} data-parallel ranks)")
    rule = "ranks" if sp == 1 else "data-parallel ranks (ranks / sp)"
    sizes = "sizes that work with this config" + ("" if sp == 1 else f" at sp {sp} (--target-dp, sp x dp)")
    return (f"ds_config ({given}) cannot train on {ranks}: DeepSpeed requires "
            f"train_batch_size = micro batch x accumulation steps x {rule}; {sizes}: "
            f"{', '.join(map(str, working)) or 'none'}. Give the target job new batch settings and pass "
            f"--ignore-batch-config, or choose one of those sizes")


def working_data_parallel_sizes(ds_config, limit: int | None = None) -> list[int] | None:
    """The data-parallel sizes (ranks / sp) `ds_config`'s fixed train_batch_size allows, up to `limit`
    (default: train_batch_size); None when it fixes no global batch."""
    if not isinstance(ds_config, dict):
        return None
    tbs, mbs, gas = (ds_config.get(key) for key in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                                    "gradient_accumulation_steps"))
    if not isinstance(tbs, int) or any(v is not None and not isinstance(v, int) for v in (mbs, gas)):
        return None
    return [dp for dp in range(1, min(tbs, limit or tbs) + 1) if _fits(tbs, mbs, gas, dp)]
