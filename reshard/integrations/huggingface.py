"""Resume a Hugging Face Trainer or Accelerate run at another world size, resharding in the job.

    from reshard.integrations.huggingface import enable_resharding

    trainer = Trainer(model=model, args=TrainingArguments(..., deepspeed=ds_config), ...)
    enable_resharding(trainer)                         # once, before train()
    trainer.train(resume_from_checkpoint="out/checkpoint-300")   # saved at any data-parallel size

    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    enable_resharding(accelerator)                     # after prepare(), before load_state()
    accelerator.load_state("out/state")

Both make DeepSpeed's load go through `reshard.deepspeed.load_checkpoint`: when the checkpoint
was saved at the job's data-parallel size that is DeepSpeed's own `load_checkpoint`; otherwise
the job's ranks reshard it over the job's process group and DeepSpeed loads the result from
memory (nothing is written next to the checkpoint). Everything else the frameworks restore
(trainer_state.json, RNG files, the data position) they restore as usual: ranks without a saved
RNG file keep their fresh RNG (both frameworks log that and go on).

How it hooks in, and why versions are checked: the Trainer resumes a DeepSpeed engine through
the module-level function `transformers.trainer.deepspeed_load_checkpoint` (trainer.py,
`_prepare_for_training`); that name is replaced by one with the same signature and checks
(transformers/integrations/deepspeed.py, `deepspeed_load_checkpoint`). Accelerate calls
`engine.load_checkpoint(input_dir, ckpt_id, **kwargs)` on each prepared DeepSpeed engine
(accelerator.py, `load_state`); those engines' method is replaced, instance by instance. These
are internal call paths, so only the versions tested here are accepted (TESTED); another
version raises UntestedVersion, which names the override for users who checked it themselves.
"""
from __future__ import annotations

import glob
import os
import sys

from reshard.deepspeed_version import check_installed_deepspeed
from reshard.errors import ReshardError

check_installed_deepspeed()  # the user's own DeepSpeed: warns outside the tested range

TESTED = {"transformers": ("5.24",), "accelerate": ("1.15",)}
"""Package -> release series (major.minor) whose call paths were checked by tests/test_huggingface.py."""
OVERRIDE_ENV = "RESHARD_ALLOW_UNTESTED_HF"


class UntestedVersion(ReshardError):
    """The installed transformers / accelerate is not one whose internal call path was tested."""


def check_version(package: str) -> str:
    """The installed version of `package`, or UntestedVersion when its series was not tested."""
    import importlib.metadata
    version = importlib.metadata.version(package)
    series = ".".join(version.split(".")[:2])
    if series not in TESTED[package] and os.environ.get(OVERRIDE_ENV) != "1":
        raise UntestedVersion(f"reshard.integrations.huggingface was tested with {package} "
                              f"{', '.join(s + '.x' for s in TESTED[package])}, not {version}: the internal call path "
                              f"it hooks may have changed. Reshard offline instead (`torchrun -m reshard SRC DST "
                              f"--target-dp M`), or set {OVERRIDE_ENV}=1 if you have checked that it still works")
    return version


def enable_resharding(framework, **options):
    """Make `framework` (a transformers Trainer or an accelerate Accelerator) resume at any size.

    Trainer: call before `trainer.train(resume_from_checkpoint=...)`; affects every Trainer of
    the process. Accelerator: call after `accelerator.prepare(...)`, before `load_state()`.
    `options` go to reshard.deepspeed.load_checkpoint (memory_budget, trust_pickle, staging_dir).
    Returns `framework`.
    """
    if _is_a(framework, "transformers", "Trainer"):  # subclasses too (trl's SFTTrainer, ...)
        _enable_for_trainer(options)
    elif _is_a(framework, "accelerate", "Accelerator"):
        _enable_for_accelerator(framework, options)
    else:
        raise ReshardError(f"enable_resharding takes a transformers Trainer or an accelerate Accelerator, "
                           f"not {type(framework).__name__}")
    return framework


def _is_a(obj, package: str, name: str) -> bool:
    """isinstance(obj, package.name), without importing a package the caller has not imported."""
    module = sys.modules.get(package)
    return module is not None and isinstance(obj, getattr(module, name))


def _enable_for_trainer(options: dict) -> None:
    check_version("transformers")
    check_version("accelerate")
    import transformers.trainer as trainer_module
    current = getattr(trainer_module, "deepspeed_load_checkpoint", None)
    if current is None:
        raise UntestedVersion("transformers.trainer.deepspeed_load_checkpoint does not exist in this transformers: "
                              "the Trainer's DeepSpeed resume path changed; reshard offline instead")
    if getattr(current, "_reshard_options", None) is not None:
        current._reshard_options.update(options)
        return

    def deepspeed_load_checkpoint(deepspeed_engine, checkpoint_path, load_module_strict=True):
        # The same checks and load flags as transformers' own function, through reshard.
        import reshard.deepspeed
        if not glob.glob(f"{checkpoint_path}/global_step*"):
            raise ValueError(f"Can't find a valid checkpoint at {checkpoint_path}")
        load_path, _ = reshard.deepspeed.load_checkpoint(
            deepspeed_engine, checkpoint_path, load_module_strict=load_module_strict, load_optimizer_states=True,
            load_lr_scheduler_states=True, **deepspeed_load_checkpoint._reshard_options)
        if load_path is None:
            raise ValueError(f"[deepspeed] failed to resume from checkpoint {checkpoint_path}")

    deepspeed_load_checkpoint._reshard_options = dict(options)
    deepspeed_load_checkpoint._replaced = current
    trainer_module.deepspeed_load_checkpoint = deepspeed_load_checkpoint


def _enable_for_accelerator(accelerator, options: dict) -> None:
    check_version("accelerate")
    from deepspeed import DeepSpeedEngine
    engines = [m for m in getattr(accelerator, "_models", []) if isinstance(m, DeepSpeedEngine)]
    if not engines:
        raise ReshardError("enable_resharding(accelerator): no DeepSpeed engine among the prepared models; call it "
                           "after accelerator.prepare(...) with a DeepSpeed plugin")
    for engine in engines:
        if "load_checkpoint" not in vars(engine):
            engine.load_checkpoint = _ReshardingLoad(engine, options)
        else:
            vars(engine)["load_checkpoint"].options.update(options)


class _ReshardingLoad:
    """Stands in for one engine's `load_checkpoint`; reshard's loader reaches DeepSpeed's own method
    by removing this instance attribute for the duration of the call."""

    def __init__(self, engine, options: dict):
        self.engine, self.options = engine, dict(options)

    def __call__(self, load_dir, tag=None, **kwargs):
        import reshard.deepspeed
        del self.engine.load_checkpoint
        try:
            return reshard.deepspeed.load_checkpoint(self.engine, load_dir, tag, **self.options, **kwargs)
        finally:
            self.engine.load_checkpoint = self
