"""A small PPO-style RLHF loop with an actor and a critic DeepSpeed engine, saved and resumed at a new scale.

    # train 3 PPO iterations on 2 ranks, saving OpenRLHF-style under CKPT/_actor and CKPT/_critic
    torchrun --standalone --nproc_per_node=2 launch/examples/ppo_actor_critic.py train --ckpt CKPT --iterations 3
    # resume on 3 ranks: either from an offline reshard ...
    torchrun --standalone --nproc_per_node=2 -m reshard CKPT CKPT-dp3 --target-dp 3 --all-tags
    torchrun --standalone --nproc_per_node=3 launch/examples/ppo_actor_critic.py resume --ckpt CKPT-dp3
    # ... or straight from CKPT, resharding inside this job
    torchrun --standalone --nproc_per_node=3 launch/examples/ppo_actor_critic.py resume --ckpt CKPT --in-job

The actor (a tiny causal policy with a tied output head, ZeRO-3, bf16) and the critic (a smaller
value model, ZeRO-2, fp32) train together. Each engine's client_state carries what decides
whether a resume is correct: the PPO iteration, the adaptive KL coefficient (a proportional
controller, as in Ziegler et al. 2019), running reward mean/var/count (tensors) and the data
loader position. `--truth FILE` (train) records every weight, optimizer state and client value
of both engines; `--truth FILE --report FILE` (resume) compares the resumed engines with it bit
for bit and writes a JSON report, then continues training.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, ACTOR_DIM, CRITIC_DIM, PROMPT, RESPONSE = 23, 13, 7, 5, 4
KL_INIT, KL_TARGET, KL_HORIZON = 0.2, 0.02, 40
PPO_EPOCHS = 2


class Actor(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, ACTOR_DIM)
        self.mix = nn.Linear(ACTOR_DIM, ACTOR_DIM + 6)
        self.out = nn.Linear(ACTOR_DIM + 6, ACTOR_DIM)
        self.norm = nn.LayerNorm(ACTOR_DIM)
        self.head = nn.Linear(ACTOR_DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight  # tied, as in most LMs

    def forward(self, tokens):
        hidden = self.embed(tokens).cumsum(dim=1) / torch.arange(1, tokens.shape[1] + 1).view(1, -1, 1)
        hidden = self.norm(hidden + self.out(torch.tanh(self.mix(hidden))))
        return self.head(hidden)


class Critic(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, CRITIC_DIM)
        self.value = nn.Linear(CRITIC_DIM, 1)

    def forward(self, tokens):
        return self.value(self.embed(tokens).mean(dim=1)).squeeze(-1)


class AdaptiveKLController:
    """kl_coef follows the measured KL towards a target: value *= 1 + clip(kl / target - 1) * n / horizon."""

    def __init__(self, value=KL_INIT, target=KL_TARGET, horizon=KL_HORIZON):
        self.value, self.target, self.horizon = value, target, horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(current_kl / self.target - 1, -0.2), 0.2)
        self.value *= 1 + error * n_steps / self.horizon


class RunningMoments:
    """Running mean/var/count of rewards, kept as tensors (as RLHF libraries do)."""

    def __init__(self):
        self.mean, self.var, self.count = torch.zeros(()), torch.ones(()), torch.tensor(1e-4, dtype=torch.float64)

    def update(self, values: torch.Tensor) -> None:
        batch_mean, batch_var, n = values.mean(), values.var(unbiased=False), values.numel()
        delta, total = batch_mean - self.mean, self.count + n
        self.mean = self.mean + delta * n / total
        self.var = (self.var * self.count + batch_var * n + delta ** 2 * self.count * n / total) / total
        self.var, self.count = self.var.float(), total


def ds_config(stage: int, precision: str) -> dict:
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0, "steps_per_print": 10 ** 9,
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    return config


def build_engines(seed: int):
    import deepspeed
    torch.manual_seed(seed)
    actor, critic = Actor(), Critic()
    actor_opt = torch.optim.AdamW([
        {"params": [p for n, p in actor.named_parameters() if p.dim() > 1], "weight_decay": 0.01, "lr": 3e-3},
        {"params": [p for n, p in actor.named_parameters() if p.dim() <= 1], "weight_decay": 0.0, "lr": 1e-3}])
    critic_opt = torch.optim.AdamW(critic.parameters(), lr=5e-3)
    actor_engine, *_ = deepspeed.initialize(model=actor, optimizer=actor_opt, config=ds_config(3, "bf16"))
    critic_engine, *_ = deepspeed.initialize(model=critic, optimizer=critic_opt, config=ds_config(2, "fp32"))
    return actor_engine, critic_engine


def prompts(iteration: int, rank: int, batch: int = 2) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * iteration + rank)
    return torch.randint(0, VOCAB, (batch, PROMPT), generator=generator)


def ppo_iteration(actor, critic, state: dict, rank: int) -> dict:
    """Roll out, score, and take one actor and one critic step; returns the losses and the KL."""
    import deepspeed.comm as dist
    it = state["iteration"]
    tokens = prompts(it, rank)
    generator = torch.Generator().manual_seed(7 * it + rank)
    with torch.no_grad():  # rollout with the current policy (the "old" policy of PPO)
        actor.eval()
        for _ in range(RESPONSE):
            probs = F.softmax(actor(tokens)[:, -1].float(), dim=-1)
            tokens = torch.cat([tokens, torch.multinomial(probs, 1, generator=generator)], dim=1)
        old_logp = F.log_softmax(actor(tokens)[:, PROMPT - 1:-1].float(), dim=-1)
        actions = tokens[:, PROMPT:]
        old_logp = old_logp.gather(-1, actions.unsqueeze(-1)).squeeze(-1)
    rewards = (actions % 3 == 0).float().mean(dim=1)  # toy reward model
    gathered = [torch.zeros_like(rewards) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, rewards)
    state["reward_stats"].update(torch.cat(gathered))
    stats = state["reward_stats"]
    normalised = (rewards - stats.mean) / torch.sqrt(stats.var + 1e-8)

    actor.train()
    values = critic(tokens)
    advantages = (normalised - values.detach()).unsqueeze(-1)
    for _ in range(PPO_EPOCHS):  # from the second epoch on the policy has moved: ratio != 1, KL > 0
        logp = F.log_softmax(actor(tokens)[:, PROMPT - 1:-1].float(), dim=-1)
        logp = logp.gather(-1, actions.unsqueeze(-1)).squeeze(-1)
        ratio = torch.exp(logp - old_logp)
        kl = (old_logp - logp).mean()
        policy_loss = -torch.min(ratio * advantages, ratio.clamp(0.8, 1.2) * advantages).mean()
        actor_loss = policy_loss + state["kl"].value * kl
        actor.backward(actor_loss)
        actor.step()
    critic_loss = F.mse_loss(values, normalised)
    critic.backward(critic_loss)
    critic.step()
    state["kl"].update(abs(float(kl.detach())), n_steps=1)
    state["iteration"] += 1
    state["loader"]["index"] += tokens.shape[0]
    return {"actor_loss": float(actor_loss), "critic_loss": float(critic_loss), "kl": float(kl)}


def client_state(state: dict) -> dict:
    stats = state["reward_stats"]
    return {"ppo": {"iteration": state["iteration"], "kl_coef": state["kl"].value, "kl_target": state["kl"].target,
                    "reward_stats": {"mean": stats.mean.clone(), "var": stats.var.clone(), "count": stats.count.clone()}},
            "dataloader": dict(state["loader"])}


def restore_state(saved: dict) -> dict:
    ppo = saved["ppo"]
    stats = RunningMoments()
    stats.mean, stats.var, stats.count = (ppo["reward_stats"][k].clone() for k in ("mean", "var", "count"))
    return {"iteration": ppo["iteration"], "kl": AdaptiveKLController(ppo["kl_coef"], ppo["kl_target"]),
            "reward_stats": stats, "loader": dict(saved["dataloader"])}


def save(actor, critic, ckpt: str, state: dict, metric: float, best: bool) -> None:
    """OpenRLHF layout: CKPT/_actor and CKPT/_critic, tag global_step{N}, metric.json inside."""
    import deepspeed.comm as dist
    tag = f"global_step{state['iteration']}"
    for engine, name in ((actor, "_actor"), (critic, "_critic")):
        save_dir = os.path.join(ckpt, name)
        engine.save_checkpoint(save_dir, tag=tag, client_state=client_state(state))
        if dist.get_rank() == 0:
            with open(os.path.join(save_dir, tag, "metric.json"), "w") as fd:
                json.dump({"reward_mean": metric, "iteration": state["iteration"]}, fd)
        if best:
            engine.save_checkpoint(save_dir, tag=f"best_{tag}", client_state=client_state(state), save_latest=False)
    dist.barrier()


def use_proof_harness() -> None:
    """`--truth` checks with the test suite's proof harness (tests/reshard_proof in this checkout; it is
    not installed with reshard): make it importable however this script was started."""
    import sys
    tests = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir, "tests")
    if os.path.normpath(tests) not in map(os.path.normpath, sys.path):
        sys.path.insert(0, os.path.normpath(tests))


def capture(actor, critic, state: dict) -> dict:
    use_proof_harness()
    from reshard_proof.engine_state import capture_engine_state
    return {"actor": capture_engine_state(actor, master_from="getters"),
            "critic": capture_engine_state(critic, master_from="getters"),
            "client_state": client_state(state)}


def resume(args, rank: int) -> dict:
    """Both engines from another seed, loaded from args.ckpt (resharded inside this job with --in-job),
    compared with --truth, then trained on; rank 0 prints the report (and writes --report)."""
    import deepspeed.comm as dist
    report = {"world_size": dist.get_world_size(), "in_job": args.in_job}
    actor, critic = build_engines(seed=1)  # different seed: nothing matches by accident
    started = time.perf_counter()
    loaded = {}
    for engine, name in ((actor, "_actor"), (critic, "_critic")):
        load_dir = os.path.join(args.ckpt, name)
        if args.in_job:
            import reshard.deepspeed
            _, loaded[name] = reshard.deepspeed.load_checkpoint(engine, load_dir)
        else:
            _, loaded[name] = engine.load_checkpoint(load_dir)
    report["load_seconds"] = time.perf_counter() - started
    state = restore_state(loaded["_actor"])
    report["kl_coef_restored"] = state["kl"].value
    if args.truth:
        use_proof_harness()
        from reshard_proof.bitwise import compare_trees
        truth = torch.load(args.truth, weights_only=False)
        now = capture(actor, critic, state)
        comparison = compare_trees(truth["actor"], now["actor"], "actor")
        comparison.absorb(compare_trees(truth["critic"], now["critic"], "critic"))
        comparison.absorb(compare_trees(truth["client_state"], now["client_state"], "client_state"))
        comparison.absorb(compare_trees(truth["client_state"], client_state(restore_state(loaded["_critic"])),
                                        "critic client_state"))
        report.update(mismatches=comparison.mismatches[:50], checked_tensors=comparison.checked_tensors,
                      checked_elements=comparison.checked_elements, kl_coef_saved=truth["client_state"]["ppo"]["kl_coef"])
    history = []
    for _ in range(args.iterations):
        losses = ppo_iteration(actor, critic, state, rank)
        history.append({**losses, "kl_coef": state["kl"].value, "iteration": state["iteration"]})
    report["continued"] = history
    report["finite"] = all(math.isfinite(v) for h in history for v in h.values())
    if rank == 0:
        print(json.dumps(report, indent=1), flush=True)
        if args.report:
            with open(args.report + ".partial", "w") as fd:
                json.dump(report, fd, indent=1)
            os.replace(args.report + ".partial", args.report)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=("train", "resume"))
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--in-job", action="store_true", help="resume: reshard inside this job (reshard.deepspeed)")
    parser.add_argument("--truth", help="train: record the truth here; resume: compare with it")
    parser.add_argument("--report", help="resume: JSON report of the comparison and the continued training")
    args = parser.parse_args()

    import deepspeed
    import deepspeed.comm as dist
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    if args.command == "train":
        actor, critic = build_engines(seed=0)
        state = {"iteration": 0, "kl": AdaptiveKLController(), "reward_stats": RunningMoments(),
                 "loader": {"epoch": 0, "index": 0, "seed": 1234}}
        for i in range(args.iterations):
            losses = ppo_iteration(actor, critic, state, rank)
            if i >= args.iterations - 2:  # the last two iterations are checkpointed; the first is "best"
                save(actor, critic, args.ckpt, state, metric=float(state["reward_stats"].mean),
                     best=i == args.iterations - 2)
            if rank == 0:
                print(f"iteration {state['iteration']}: {losses}, kl_coef {state['kl'].value:.6f}", flush=True)
        if args.truth:
            truth = capture(actor, critic, state)
            if rank == 0:
                torch.save(truth, args.truth)
    else:
        resume(args, rank)
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()
