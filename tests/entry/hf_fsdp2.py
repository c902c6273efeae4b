"""torchrun entry for tests: the Hugging Face Trainer with FSDP2 (Accelerate) resumes a DeepSpeed run, on CPU ranks.

    torchrun --standalone --nproc_per_node=2 tests/entry/hf_fsdp2.py OUT --from EXPORT --truth truth-3.pt \
        --report R.json [--control truth-6.pt]

EXPORT is `reshard export CHECKPOINT EXPORT --format dcp --layout accelerate` of a checkpoint-N that
tests/entry/hf_trainer.py trained under DeepSpeed. The same tiny Llama and TrainingArguments as that
run, but `fsdp` (FSDP2, SHARDED_STATE_DICT) in place of `deepspeed`, from another seed;
`trainer.train(resume_from_checkpoint=EXPORT)` with nothing else done. At the first on_step_begin,
before any step, every rank gathers each parameter and its Adam exp_avg / exp_avg_sq (DTensor
`full_tensor`) and rank 0 compares them with DeepSpeed's truth element by element, with the Adam step,
the learning rate and the global step; training then goes on to step 6 and saves an FSDP2 checkpoint.
With --control, the same state is also compared with another truth (a negative control: that must differ).

Accelerate 1.15 turns FSDP on only for accelerator devices: accelerate/state.py
`AcceleratorState.__init__` sets DistributedType.FSDP when the type is MULTI_GPU, MULTI_NPU, ... and
never for MULTI_CPU, so a CPU run with an FSDP plugin is silently plain data parallel. FSDP2 itself
(`fully_shard`) runs on CPU with gloo: `CpuFsdpTrainer` sets the distributed type and the plugin the
Trainer built, as a GPU run gets them; everything after that (Accelerate's `fsdp2_prepare_model`,
`load_fsdp_model`, `load_fsdp_optimizer`, the Trainer's resume) is the libraries' own code.
"""
import argparse
import os

import torch
from hf_common import TokenRows, compare_with_truth, leave_and_exit, tiny_llama, write_report

STEPS, SAVE_EVERY = 6, 3


def make_trainer(out: str, seed: int, callbacks):
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
    from transformers import Trainer, TrainingArguments

    class CpuFsdpTrainer(Trainer):
        def create_accelerator_and_postprocess(self):
            super().create_accelerator_and_postprocess()
            if not self.is_fsdp_enabled:  # see the module docstring: Accelerate's CPU state drops the plugin
                state = self.accelerator.state
                state.distributed_type = DistributedType.FSDP
                state.fsdp_plugin = FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args)
                self.is_fsdp_enabled = True

    training = TrainingArguments(
        output_dir=out, use_cpu=True, fsdp=True,
        fsdp_config={"fsdp_version": 2, "state_dict_type": "SHARDED_STATE_DICT", "reshard_after_forward": True},
        per_device_train_batch_size=2, gradient_accumulation_steps=1, max_steps=STEPS, save_steps=SAVE_EVERY,
        save_strategy="steps", learning_rate=3e-3, warmup_steps=2, lr_scheduler_type="linear", weight_decay=0.01,
        logging_strategy="steps", logging_steps=1, report_to="none", seed=seed, data_seed=7, disable_tqdm=True,
        dataloader_num_workers=0, save_only_model=False)
    return CpuFsdpTrainer(model=tiny_llama(seed), args=training, train_dataset=TokenRows(), callbacks=callbacks)


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
            if args.control:
                control = torch.load(args.control, weights_only=True)
                holder["report"]["control_mismatches"] = compare_with_truth(full, control["state"])[0]

    trainer = holder["trainer"] = make_trainer(args.out, seed=99, callbacks=[Check()])
    trainer.train(resume_from_checkpoint=args.source)
    report = holder["report"]
    report["fsdp_version"] = trainer.accelerator.state.fsdp_plugin.fsdp_version
    report["final_global_step"] = trainer.state.global_step
    final = os.path.join(args.out, f"checkpoint-{STEPS}")
    report["final_save"] = sorted(os.listdir(final)) if os.path.isdir(final) else []
    if rank == 0:
        write_report(args.report, report)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", help="the resumed run's output directory")
    parser.add_argument("--from", dest="source", required=True)
    parser.add_argument("--truth", required=True)
    parser.add_argument("--report", required=True)
    parser.add_argument("--control", help="another run's truth, which the resumed state must not equal")
    args = parser.parse_args()
    resume(args, int(os.environ.get("RANK", "0")))
    leave_and_exit()


if __name__ == "__main__":
    main()
