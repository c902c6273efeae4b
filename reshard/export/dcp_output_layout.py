"""Where a DCP export puts its entries: one torch DCP directory, or the pair Accelerate's FSDP2 resume reads.

    reshard export SRC OUT --format dcp                                  # --layout torch (the default)
    reshard export /run/checkpoint-300 /fsdp2/checkpoint-300 --format dcp --layout accelerate

    from reshard.export.dcp_output_layout import OUTPUT_LAYOUTS
    out = OUTPUT_LAYOUTS["accelerate"]
    out.model_dir, out.optimizer_dir, out.optimizer_key     # "pytorch_model_fsdp_0", "optimizer_0", "optimizer"

`torch`: OUT is one DCP checkpoint with the keys `get_state_dict(model, optimizer)` gives, read by
`dcp.load({"model": ..., "optim": ...})` (`model.<fqn>`, `optim.state...`, `optim.param_groups...`).

`accelerate`: OUT is a checkpoint directory as Accelerate 1.15 saves an FSDP2 model with
`state_dict_type` SHARDED_STATE_DICT (accelerate/utils/fsdp_utils.py `save_fsdp_model`,
`save_fsdp_optimizer`; names from accelerate/utils/constants.py FSDP_MODEL_NAME, OPTIMIZER_NAME):
    OUT/pytorch_model_fsdp_0/   DCP of {"model": get_model_state_dict(model)}: keys `model.<fqn>`
    OUT/optimizer_0/            DCP of {"optimizer": get_optimizer_state_dict(model, optimizer)}: keys
                                `optimizer.state.<fqn>.{step, exp_avg, exp_avg_sq}`,
                                `optimizer.param_groups.<i>.<hyperparameter>`
`load_fsdp_model` / `load_fsdp_optimizer` read exactly these (`dcp.load` with the default planner, so
every key of the live model and optimizer must be there). Beside them the export carries every file of
the DeepSpeed save directory but DeepSpeed's own (reshard.jobs.save_dir_files): the Trainer's
`trainer_state.json`, `scheduler.pt`, `rng_state_{rank}.pth`, `training_args.bin`, the config and
tokenizer files, so that `trainer.train(resume_from_checkpoint=OUT)` under FSDP2 resumes the run
(transformers trainer.py `_load_from_checkpoint`: a sub-directory named pytorch_model_fsdp* makes it an
FSDP checkpoint; `_load_optimizer_and_scheduler`: an `optimizer*` sub-directory and `scheduler.pt`).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from reshard.errors import UnsupportedCheckpoint


@dataclass(frozen=True)
class DcpOutputLayout:
    """The directories (relative to OUT, "" for OUT itself) and the optimizer's top-level key."""

    name: str
    model_dir: str
    """Holds the `model.<fqn>` entries and its own `.metadata`."""
    optimizer_dir: str
    """Holds the optimizer's entries; the same directory as the model's in the torch layout."""
    optimizer_key: str
    """The optimizer state dict's key in the saved state: "optim" (get_state_dict's pair, as the docs
    load it) or "optimizer" (Accelerate's `save_fsdp_optimizer`)."""
    carries_save_dir: bool
    """Whether the save directory's other files (the Trainer's) are carried into OUT."""

    @property
    def directories(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys((self.model_dir, self.optimizer_dir)))

    @property
    def complete_marker(self) -> str:
        """The file, relative to OUT, moved into OUT last: with it there, the output is complete."""
        return os.path.join(self.model_dir, ".metadata") if self.model_dir else ".metadata"


OUTPUT_LAYOUTS = {
    "torch": DcpOutputLayout("torch", "", "", "optim", carries_save_dir=False),
    "accelerate": DcpOutputLayout("accelerate", "pytorch_model_fsdp_0", "optimizer_0", "optimizer",
                                  carries_save_dir=True),
}

TRAINER_STATE = "trainer_state.json"
TRAINER_SCHEDULER = "scheduler.pt"
"""transformers trainer.py TRAINER_STATE_NAME and SCHEDULER_NAME."""


def check_carried_files(save_dir: str, files, out: DcpOutputLayout, written: tuple[str, ...]) -> None:
    """Refuse, naming the file, what the accelerate layout cannot carry: a save-directory file at a path
    the export writes itself (`written`: top-level names), and a Trainer checkpoint without `scheduler.pt`.
    The Trainer restores the optimizer only when `scheduler.pt` is beside it (trainer.py
    `_load_optimizer_and_scheduler`); under DeepSpeed it is missing when the LR scheduler is DeepSpeed's
    own (a "scheduler" section in the config, DeepSpeedSchedulerWrapper), whose state no torch scheduler
    loads: the resume would silently start Adam from zero."""
    for name in files:
        top = name.split("/")[0]
        if top in written:
            raise UnsupportedCheckpoint(os.path.join(save_dir, name),
                                        f"the {out.name} layout writes {top} itself, so this file of the save "
                                        "directory cannot be carried into the export; move it away first")
    if TRAINER_STATE in files and TRAINER_SCHEDULER not in files:
        raise UnsupportedCheckpoint(os.path.join(save_dir, TRAINER_STATE),
                                    f"is a Trainer checkpoint without {TRAINER_SCHEDULER}: its LR scheduler is "
                                    "DeepSpeed's own (config 'scheduler'), which a torch scheduler cannot load, and "
                                    f"the Trainer restores the optimizer only beside {TRAINER_SCHEDULER}; the "
                                    f"{out.name} layout cannot resume it (use --layout torch and restore the "
                                    "scheduler yourself from reshard_run_state.pt)")
