"""torchrun entry for tests: the Hugging Face Trainer with FSDP2 (Accelerate) resumes a DeepSpeed run, on CPU ranks.

    torchrun --standalone --nproc_per_node=2 tests/entry/hf_fsdp2.py OUT --from EXPORT --truth truth-3.pt \
        --report R.json [--control truth-6.pt] [--fp16]
    torchrun --standalone --nproc_per_node=2 tests/entry/hf_fsdp2.py --jobs JOBS.json

EXPORT is `reshard export CHECKPOINT EXPORT --format dcp --layout accelerate` of a checkpoint-N that
tests/entry/hf_trainer.py trained under DeepSpeed. The same tiny Llama and TrainingArguments as that
run, but `fsdp` (FSDP2, SHARDED_STATE_DICT) in place of `deepspeed`, from another seed;
`trainer.train(resume_from_checkpoint=EXPORT)` with nothing else done. At the first on_step_begin,
before any step, every rank gathers each parameter and its Adam exp_avg / exp_avg_sq (DTensor
`full_tensor`) and rank 0 compares them with DeepSpeed's truth element by element, with the Adam step,
the learning rate and the global step; training then goes on to step 6 and saves an FSDP2 checkpoint.
With --control, the same state is also compared with another truth (a negative control: that must differ).
--jobs: several resumes one after the other in one launch (starting torch and transformers on every rank
is what a launch costs); JOBS.json lists them as {"out", "source", "truth", "report", "control", "fp16", "kv_heads", "batch"}.
Accelerate's shared state is reset between them, the process group kept.

Accelerate 1.15 turns FSDP on only for accelerator devices: accelerate/state.py
`AcceleratorState.__init__` sets DistributedType.FSDP when the type is MULTI_GPU, MULTI_NPU, ... and
never for MULTI_CPU, so a CPU run with an FSDP plugin is silently plain data parallel. FSDP2 itself
(`fully_shard`) runs on CPU with gloo: `CpuFsdpTrainer` sets the distributed type and the plugin the
Trainer built, as a GPU run gets them; everything after that (Accelerate's `fsdp2_prepare_model`,
`load_fsdp_model`, `load_fsdp_optimizer`, the Trainer's resume) is the libraries' own code.

--fp16 (`TrainingArguments(fp16=True)`): on a GPU, Accelerate gives the FSDP plugin a
`MixedPrecisionPolicy` of fp16 (state.py, `fsdp_plugin.set_mixed_precision`), turns on native AMP
(autocast) and makes a `torch.amp.GradScaler` (accelerator.py `Accelerator.__init__`, via
`get_fsdp2_grad_scaler`). On CPU it does none of the last two (its condition is
`self.device.type != "cpu"`), so `CpuFsdpTrainer` does all three as a GPU run gets them. Two things
then differ from a GPU run, both for reasons outside reshard:
  - the optimizer is `adamw_torch`, not the default `adamw_torch_fused`: `AdamW(fused=True)` tells the
    GradScaler it takes `grad_scale` / `found_inf` (`_step_supports_amp_scaling`), yet on these CPU
    DTensor parameters the step ran torch's single-tensor Adam, which refuses them ("Expected grad_scale
    and found_inf to be None", torch/optim/adam.py `_single_tensor_adam`; seen here, not run on a GPU);
  - before `train()`, the scaler is given its scale by one `scaler.scale(torch.zeros(()))`: resuming an
    FSDP2 optimizer calls torch's `get_optimizer_state_dict` (accelerate fsdp_utils.py
    `load_fsdp_optimizer`), which initialises Adam's state by one `optimizer.step()` on zero gradients
    (torch/distributed/checkpoint/state_dict.py `_init_optim_state`); Accelerate's optimizer routes that
    step through `scaler.step` (accelerate/optimizer.py `AcceleratedOptimizer.step`), which fails
    ("Attempted step but _scale is None") until the scaler has scaled once. The Trainer then loads
    scaler.pt (`_load_scaler`), which sets the scale DeepSpeed had. Read, not run on a GPU: the same code
    path runs there, for any FSDP2 fp16 Trainer resume, not only from an export.
"""
import argparse
import os

import torch
from hf_common import TokenRows, compare_with_truth, leave_and_exit, tiny_llama, write_report

STEPS, SAVE_EVERY = 6, 3


def make_trainer(out: str, seed: int, callbacks, fp16: bool = False, kv_heads: int = 1, batch: int = 2):
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import get_fsdp2_grad_scaler
    from transformers import Trainer, TrainingArguments

    class CpuFsdpTrainer(Trainer):
        def create_accelerator_and_postprocess(self):
            super().create_accelerator_and_postprocess()
            if not self.is_fsdp_enabled:  # see the module docstring: Accelerate's CPU state drops the plugin
                state = self.accelerator.state
                state.distributed_type = DistributedType.FSDP
                state.fsdp_plugin = FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args)
                if state.mixed_precision != "no":  # what AcceleratorState.__init__ does for an FSDP plugin
                    state.fsdp_plugin.set_mixed_precision(state.mixed_precision)
                if state.mixed_precision == "fp16":  # what Accelerator.__init__ does for fp16 off CPU
                    self.accelerator.native_amp = True
                    self.accelerator.scaler = get_fsdp2_grad_scaler(device="cpu")
                self.is_fsdp_enabled = True

    training = TrainingArguments(
        output_dir=out, use_cpu=True, fsdp=True,
        fsdp_config={"fsdp_version": 2, "state_dict_type": "SHARDED_STATE_DICT", "reshard_after_forward": True},
        per_device_train_batch_size=batch, gradient_accumulation_steps=1, max_steps=STEPS, save_steps=SAVE_EVERY,
        save_strategy="steps", learning_rate=3e-3, warmup_steps=2, lr_scheduler_type="linear", weight_decay=0.01,
        logging_strategy="steps", logging_steps=1, report_to="none", seed=seed, data_seed=7, disable_tqdm=True,
        dataloader_num_workers=0, save_only_model=False, fp16=fp16, **({"optim": "adamw_torch"} if fp16 else {}))
    return CpuFsdpTrainer(model=tiny_llama(seed, kv_heads), args=training, train_dataset=TokenRows(), callbacks=callbacks)


def full_fsdp2_state(model, optimizer) -> tuple[dict, dict]:
    """(name -> {fp32, exp_avg, exp_avg_sq} full tensors, name -> Adam step); collective."""
    state, steps = {}, {}
    for name, param in model.named_parameters():
        entry = {"fp32": param.detach().full_tensor()}
        opt = optimizer.state.get(param, {})
        for key in ("exp_avg", "exp_avg_sq"):
            if key in opt:
                entry[key] = opt[key].full_tensor()
        if "step" in opt:
            steps[name] = float(opt["step"])
        state[name] = {k: v.detach().clone().float().cpu() for k, v in entry.items()}
    return state, steps


def resume(args, rank: int) -> None:
    from transformers import TrainerCallback
    holder = {}

    class Check(TrainerCallback):
        first = True

        def on_step_begin(self, training_args, state, control, **kwargs):
            if not self.first:
                return
            self.first = False
            trainer = holder["trainer"]
            full, steps = full_fsdp2_state(trainer.model, trainer.optimizer)
            truth = torch.load(args.truth, weights_only=True)
            mismatches, checked = compare_with_truth(full, truth["state"])
            holder["report"] = {"mismatches": mismatches, "checked_tensors": checked,
                                "adam_steps": sorted(set(steps.values())), "adam_step_count": len(steps),
                                "parameter_class": type(next(trainer.model.parameters())).__name__,
                                "global_step_at_resume": state.global_step, "truth_global_step": truth["global_step"],
                                "lr_at_resume": trainer.lr_scheduler.get_last_lr(), "truth_lr": truth["lr"],
                                "world_size": training_args.world_size}
            scaler = trainer.accelerator.scaler
            holder["report"]["scale_at_resume"] = None if scaler is None else float(scaler.get_scale())
            if args.control:
                control = torch.load(args.control, weights_only=True)
                holder["report"]["control_mismatches"] = compare_with_truth(full, control["state"])[0]

    trainer = holder["trainer"] = make_trainer(args.out, seed=99, callbacks=[Check()], fp16=args.fp16,
                                                kv_heads=args.kv_heads, batch=args.batch)
    if trainer.accelerator.scaler is not None:  # module docstring: the fp16 resume needs a scale in place
        trainer.accelerator.scaler.scale(torch.zeros(()))
    trainer.train(resume_from_checkpoint=args.source)
    report = holder["report"]
    report["fsdp_version"] = trainer.accelerator.state.fsdp_plugin.fsdp_version
    policy = trainer.accelerator.state.fsdp_plugin.mixed_precision_policy
    report["param_dtype"] = str(getattr(policy, "param_dtype", None))
    report["master_dtype"] = str(next(trainer.model.parameters()).dtype)
    scaler = trainer.accelerator.scaler
    report["grad_scaler"] = None if scaler is None else type(scaler).__name__
    report["final_scale"] = None if scaler is None else float(scaler.get_scale())
    report["final_global_step"] = trainer.state.global_step
    final = os.path.join(args.out, f"checkpoint-{STEPS}")
    report["final_save"] = sorted(os.listdir(final)) if os.path.isdir(final) else []
    if rank == 0:
        write_report(args.report, report)


def run_jobs(jobs: list[dict], rank: int) -> None:
    """Each resume in turn, Accelerate's shared state reset between them (the process group kept)."""
    from accelerate.state import AcceleratorState
    for number, job in enumerate(jobs):
        if number:
            AcceleratorState._reset_state(reset_partial_state=False)  # this job's precision and plugin
        resume(argparse.Namespace(**{"control": None, "fp16": False, "kv_heads": 1, "batch": 2, **job}), rank)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", nargs="?", help="the resumed run's output directory")
    parser.add_argument("--from", dest="source")
    parser.add_argument("--truth")
    parser.add_argument("--report")
    parser.add_argument("--control", help="another run's truth, which the resumed state must not equal")
    parser.add_argument("--fp16", action="store_true", help="TrainingArguments(fp16=True): FSDP2 in fp16")
    parser.add_argument("--kv-heads", type=int, default=1, help="the Llama's key/value heads (2: an AutoTP run's)")
    parser.add_argument("--batch", type=int, default=2, help="per_device_train_batch_size")
    parser.add_argument("--jobs", help="a JSON list of resumes, each with the options above as keys")
    args = parser.parse_args()
    rank = int(os.environ.get("RANK", "0"))
    if args.jobs:
        import json
        with open(args.jobs) as jobs_file:
            run_jobs(json.load(jobs_file), rank)
    else:
        if not (args.out and args.source and args.truth and args.report):
            parser.error("OUT, --from, --truth and --report are required without --jobs")
        resume(args, rank)
    leave_and_exit()


if __name__ == "__main__":
    main()
