"""Can the training job, configured as the checkpoint says, run at the target size at all?

    from reshard.batch_config import batch_config_problem
    batch_config_problem({"train_batch_size": 8, "gradient_accumulation_steps": 2}, target_dp=3)
    # -> "train_batch_size 8 ... cannot run on 3 data-parallel ranks ...; sizes that work: 1, 2, 4"

DeepSpeed requires train_batch_size = micro batch per GPU x gradient accumulation steps x
data-parallel size (runtime/config.py, `_batch_assertion`); a checkpoint's ds_config that
fixes train_batch_size rules out most sizes. reshard explains that before writing anything,
since the resumed job would stop at deepspeed.initialize. The target job may of course use
new batch settings: then --ignore-batch-config.
"""
from __future__ import annotations


def _fits(tbs: int, mbs: int | None, gas: int | None, dp: int) -> bool:
    if mbs is not None and gas is not None:
        return tbs == mbs * gas * dp
    per_rank, remainder = divmod(tbs, dp)
    if remainder or per_rank < 1:
        return False
    fixed = mbs if mbs is not None else gas
    return fixed is None or (per_rank % fixed == 0 and per_rank >= fixed)


def batch_config_problem(ds_config, target_dp: int) -> str | None:
    """Why `ds_config` cannot train on `target_dp` ranks, or None when it can (or says nothing)."""
    if not isinstance(ds_config, dict):
        return None
    values = {key: ds_config.get(key) for key in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                                  "gradient_accumulation_steps")}
    tbs, mbs, gas = values.values()
    if not isinstance(tbs, int) or any(v is not None and not isinstance(v, int) for v in (mbs, gas)):
        return None  # no fixed global batch, or "auto" values a launcher fills in
    if _fits(tbs, mbs, gas, target_dp):
        return None
    working = [dp for dp in range(1, tbs + 1) if _fits(tbs, mbs, gas, dp)][:12]
    given = ", ".join(f"{k} {v}" for k, v in values.items() if v is not None)
    return (f"ds_config ({given}) cannot train on {target_dp} data-parallel ranks: DeepSpeed requires "
            f"train_batch_size = micro batch x accumulation steps x ranks; sizes that work with this config: "
            f"{', '.join(map(str, working)) or 'none'}. Give the target job new batch settings and pass "
            f"--ignore-batch-config, or choose one of those sizes")
