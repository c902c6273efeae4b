"""torchrun entry for tests: an Accelerate loop with a DeepSpeed plugin, save_state / load_state, on CPU ranks.

    torchrun --standalone --nproc_per_node=2 tests/entry/hf_accelerate.py train  STATE_DIR --stage 3
    torchrun --standalone --nproc_per_node=3 tests/entry/hf_accelerate.py resume STATE_DIR --stage 3 \
        --truth STATE_DIR.truth.pt --report R.json [--in-job]

train: 3 optimizer steps of a tiny Llama, `accelerator.save_state(STATE_DIR)`; rank 0 writes the
truth (every full fp32 master and Adam moment, the learning rate). resume: a model from another
seed, `accelerator.load_state(STATE_DIR)` (with --in-job after
`reshard.integrations.huggingface.enable_resharding(accelerator)`), compare with the truth
element by element, then one more step.
"""
import argparse
import os

import torch
from hf_common import TokenRows, compare_with_truth, full_state, leave_and_exit, tiny_llama, write_report

STEPS = 3


def build(stage: int, seed: int):
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin, InitProcessGroupKwargs
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"  # what `accelerate launch --use_deepspeed` sets
    plugin = DeepSpeedPlugin(hf_ds_config={"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
                                           "zero_optimization": {"stage": stage}, "gradient_clipping": 1.0})
    # On CPU, Accelerate finds no backend of its own (state.py `_prepare_backend`) and would run
    # every rank as a single process: name gloo, as a CPU cluster launch would.
    accelerator = Accelerator(deepspeed_plugin=plugin, kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")])
    model = tiny_llama(seed)
    decay = [p for n, p in model.named_parameters() if "norm" not in n]
    no_decay = [p for n, p in model.named_parameters() if "norm" in n]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=3e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    loader = torch.utils.data.DataLoader(TokenRows(), batch_size=2, shuffle=False)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    return accelerator, model, optimizer, loader, scheduler


def train_steps(accelerator, model, optimizer, loader, scheduler, steps: int) -> float:
    loss = torch.tensor(0.0)
    for step, batch in enumerate(loader):
        if step == steps:
            break
        loss = model(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    return float(loss.detach())


def train(args, rank: int) -> None:
    """STEPS steps from seed 11, save_state(args.state_dir); rank 0 writes the truth to args.truth."""
    accelerator, model, optimizer, loader, scheduler = build(args.stage, seed=11)
    train_steps(accelerator, model, optimizer, loader, scheduler, STEPS)
    accelerator.save_state(args.state_dir)
    full = full_state(model)
    if rank == 0:
        torch.save({"state": full, "lr": scheduler.get_last_lr()}, args.truth)


def resume(args, rank: int) -> None:
    """A model from another seed, load_state(args.state_dir) (in-job: through enable_resharding), compared
    with args.truth, then one more step; rank 0 writes args.report."""
    accelerator, model, optimizer, loader, scheduler = build(args.stage, seed=99)
    if args.in_job:
        from reshard.integrations.huggingface import enable_resharding
        enable_resharding(accelerator)
    accelerator.load_state(args.state_dir)
    truth = torch.load(args.truth, weights_only=True)
    mismatches, checked = compare_with_truth(full_state(model), truth["state"])
    assert accelerator.num_processes == torch.distributed.get_world_size(), accelerator.num_processes
    report = {"mismatches": mismatches, "checked_tensors": checked, "lr_at_resume": scheduler.get_last_lr(),
              "truth_lr": truth["lr"], "world_size": torch.distributed.get_world_size(),
              "accelerate_processes": accelerator.num_processes, "distributed_type": str(accelerator.distributed_type)}
    report["loss_after_resume"] = train_steps(accelerator, model, optimizer, loader, scheduler, 1)
    if rank == 0:
        write_report(args.report, report)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=("train", "resume"))
    parser.add_argument("state_dir")
    parser.add_argument("--stage", type=int, default=3)
    parser.add_argument("--truth")
    parser.add_argument("--report")
    parser.add_argument("--in-job", action="store_true")
    args = parser.parse_args()
    rank = int(os.environ.get("RANK", "0"))
    if args.mode == "train":
        train(args, rank)
    else:
        resume(args, rank)
    leave_and_exit()


if __name__ == "__main__":
    main()
