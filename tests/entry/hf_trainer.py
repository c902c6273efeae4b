"""torchrun entry for tests: a tiny Llama trained by the Hugging Face Trainer with DeepSpeed, on CPU ranks.

    torchrun --standalone --nproc_per_node=2 tests/entry/hf_trainer.py train  OUT --stage 2 [--bf16 | --fp16] [--autotp 2]
    torchrun --standalone --nproc_per_node=3 tests/entry/hf_trainer.py resume OUT --stage 2 \
        --from CKPT/checkpoint-3 --truth OUT_OF_TRAIN/truth-3.pt --report R.json [--in-job]
    torchrun --standalone --nproc_per_node=3 tests/entry/hf_trainer.py jobs JOBS.json

train: 6 optimizer steps, a save every 3 (checkpoint-3, checkpoint-6), the loss logged at every step
(trainer_state.json `log_history`: what a resume elsewhere is compared with); at each save rank 0 writes
truth-{step}.pt: every parameter's full fp32 master and Adam moments (DeepSpeed's own getters),
the learning rate, the global step, and an fp16 run's loss scaler (DeepSpeed's attributes, below).
--fp16: DeepSpeed's fp16 (dynamic loss scale from 2**8, growing after 2 clean steps, so that by step 3
the scale has moved); DeepSpeed's CPU accelerator refuses fp16, torch runs it on CPU: the entry lets it.
--autotp K: DeepSpeed AutoTP at tp K (`tensor_parallel.autotp_size`; transformers builds it with
`deepspeed.tp_model_init`), the Llama with 2 key/value heads; the truth joins each split parameter whole.
resume: a model from another seed, `trainer.train(resume_from_checkpoint=...)` with nothing else
done; at the first on_step_begin the same quantities are compared with the truth, element by
element; training then goes on to step 6 and its save. With --in-job the Trainer resumes through
`reshard.integrations.huggingface.enable_resharding(trainer)` from the checkpoint as saved.
jobs: several trainings or resumes one after the other in one launch, since starting torch, DeepSpeed
and transformers on every rank is what one costs; JOBS.json lists them as {"mode": "train", "out",
"stage", "bf16", "fp16", "autotp"}, {"mode": "resume", "out", "stage", "bf16", "source", "truth", "report", "in_job"},
or, for hf_accelerate.py's, the same with "kind": "accelerate" and its arguments (put those last:
Accelerate's DeepSpeed switch is an environment variable). Each gets a Trainer or Accelerator, an
Accelerator state and a DeepSpeed engine of its own (Accelerate's shared state is reset between
them, the process group kept), and an in-job resume's replacement of the Trainer's load is undone
after it, so a later offline resume loads through transformers' own function. A training records
its truth in the same process, from its own engine.
"""
import argparse
import os

import torch
from hf_common import TokenRows, compare_with_truth, full_state, leave_and_exit, tiny_llama, write_report

STEPS, SAVE_EVERY = 6, 3


LOSS_SCALER_FIELDS = ("cur_scale", "cur_iter", "last_overflow_iter", "scale_factor", "scale_window")


def ds_config(stage: int, bf16: bool, fp16: bool = False, autotp: int = 1) -> dict:
    config = {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
              "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
              "zero_optimization": {"stage": stage}, "bf16": {"enabled": bf16}}
    if fp16:  # "auto" takes TrainingArguments.fp16; a small scale that grows, so the scaler has a state to carry
        config["fp16"] = {"enabled": "auto", "initial_scale_power": 8, "loss_scale_window": 2, "hysteresis": 1}
    if autotp > 1:  # the Trainer builds the AutoTP model itself (integrations/deepspeed.py: deepspeed.tp_model_init)
        config["tensor_parallel"] = {"autotp_size": autotp}
    if stage == 3:
        config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = False
    return config


def make_trainer(args, seed: int, callbacks):
    from transformers import Trainer, TrainingArguments
    fp16, autotp = getattr(args, "fp16", False), getattr(args, "autotp", 1)
    if fp16:
        from deepspeed.accelerator import get_accelerator
        get_accelerator().is_fp16_supported = lambda: True  # DeepSpeed's CPU accelerator says no; torch can
    training = TrainingArguments(
        output_dir=args.out, use_cpu=True, deepspeed=ds_config(args.stage, args.bf16, fp16, autotp), bf16=args.bf16, fp16=fp16,
        per_device_train_batch_size=2, gradient_accumulation_steps=1, max_steps=STEPS, save_steps=SAVE_EVERY,
        save_strategy="steps", learning_rate=3e-3, warmup_steps=2, lr_scheduler_type="linear", weight_decay=0.01,
        logging_strategy="steps", logging_steps=1, report_to="none", seed=seed, data_seed=7, disable_tqdm=True,
        dataloader_num_workers=0, save_only_model=False)
    return Trainer(model=tiny_llama(seed, kv_heads=2 if autotp > 1 else 1), args=training, train_dataset=TokenRows(),
                   callbacks=callbacks)


def resume(args, rank: int) -> None:
    """One resume from args.source at this world size, judged at its first step; rank 0 writes args.report."""
    from transformers import TrainerCallback
    holder = {}

    class Check(TrainerCallback):
        first = True

        def on_step_begin(self, training_args, state, control, **kwargs):
            if not self.first:
                return
            self.first = False
            trainer = holder["trainer"]
            full = full_state(trainer.model_wrapped)
            truth = torch.load(args.truth, weights_only=True)
            mismatches, checked = compare_with_truth(full, truth["state"])
            holder["report"] = {"mismatches": mismatches, "checked_tensors": checked,
                                "global_step_at_resume": state.global_step, "truth_global_step": truth["global_step"],
                                "lr_at_resume": trainer.lr_scheduler.get_last_lr(), "truth_lr": truth["lr"],
                                "world_size": training_args.world_size}

    trainer = holder["trainer"] = make_trainer(args, seed=99, callbacks=[Check()])
    if args.in_job:
        from reshard.integrations.huggingface import enable_resharding
        enable_resharding(trainer)
    trainer.train(resume_from_checkpoint=args.source)
    report = holder["report"]
    report["final_global_step"] = trainer.state.global_step
    report["final_save"] = os.path.isdir(os.path.join(args.out, f"checkpoint-{STEPS}", f"global_step{STEPS}"))
    report["final_loss_finite"] = all(torch.isfinite(p.detach()).all().item() for p in trainer.model.parameters())
    if rank == 0:
        write_report(args.report, report)


def train(args, rank: int) -> None:
    """6 steps from seed 11, a save every 3; at each save rank 0 writes args.out/truth-{step}.pt."""
    from transformers import TrainerCallback
    holder = {}

    class Truth(TrainerCallback):
        def on_save(self, training_args, state, control, **kwargs):
            trainer = holder["trainer"]
            engine = trainer.model_wrapped
            full = full_state(engine) if getattr(args, "autotp", 1) == 1 else joined_tp_state(engine)
            scaler = getattr(engine.optimizer, "loss_scaler", None) if engine.fp16_enabled() else None
            if rank == 0:
                torch.save({"state": full, "lr": trainer.lr_scheduler.get_last_lr(), "global_step": state.global_step,
                            "skipped_steps": engine.skipped_steps,
                            "loss_scaler": None if scaler is None else
                            {k: float(getattr(scaler, k)) for k in LOSS_SCALER_FIELDS}},
                           os.path.join(args.out, f"truth-{state.global_step}.pt"))

    trainer = holder["trainer"] = make_trainer(args, seed=11, callbacks=[Truth()])
    trainer.train()


def joined_tp_state(engine) -> dict:
    """name -> {fp32, exp_avg, exp_avg_sq}, each TP-split parameter joined whole as DeepSpeed cut it
    (reshard_proof.tensor_parallel.full_state); collective."""
    from reshard_proof.tensor_parallel import full_state as tp_full_state
    return {name: {"fp32": entry["fp32"], **entry["state"]} for name, entry in tp_full_state(engine).items()}


def run_jobs(jobs: list[dict], rank: int) -> None:
    """Each job in turn: {"mode": "train" or "resume", "kind": "trainer" (default) or "accelerate", and the
    arguments of that mode}. Accelerate's shared state is reset between jobs (the process group kept);
    an in-job resume's replacement of the Trainer's load is undone after it."""
    import transformers.trainer as trainer_module
    from accelerate.state import AcceleratorState
    own_load = trainer_module.deepspeed_load_checkpoint
    for number, job in enumerate(jobs):
        job = dict(job)
        if number:
            AcceleratorState._reset_state(reset_partial_state=False)  # this job's precision and plugin
        mode, kind = job.pop("mode"), job.pop("kind", "trainer")
        if kind == "accelerate":
            import hf_accelerate
            (hf_accelerate.train if mode == "train" else hf_accelerate.resume)(argparse.Namespace(**job), rank)
        else:
            (train if mode == "train" else resume)(argparse.Namespace(**job), rank)
        trainer_module.deepspeed_load_checkpoint = own_load  # enable_resharding affects every Trainer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=("train", "resume", "jobs"))
    parser.add_argument("out", help="the output directory; for jobs, JOBS.json")
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--fp16", action="store_true")
    parser.add_argument("--autotp", type=int, default=1, help="DeepSpeed AutoTP at this tp size")
    parser.add_argument("--from", dest="source")
    parser.add_argument("--truth")
    parser.add_argument("--report")
    parser.add_argument("--in-job", action="store_true")
    args = parser.parse_args()
    rank = int(os.environ.get("RANK", "0"))
    if args.mode == "train":
        train(args, rank)
    elif args.mode == "resume":
        resume(args, rank)
    else:
        import json
        with open(args.out) as jobs_file:
            run_jobs(json.load(jobs_file), rank)
    leave_and_exit()


if __name__ == "__main__":
    main()
