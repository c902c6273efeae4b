"""What the Hugging Face entry scripts share: a tiny Llama, fixed token rows, full optimizer state.

    from hf_common import tiny_llama, TokenRows, full_state, compare_with_truth
    state = full_state(engine)      # collective: every rank calls it
"""
import torch


def tiny_llama(seed: int, kv_heads: int = 1):
    """kv_heads 2 for an AutoTP run at tp 2: AutoTP cuts k_proj / v_proj by whole heads."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=67, hidden_size=24, intermediate_size=37, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=kv_heads, max_position_embeddings=32,
                         tie_word_embeddings=False)
    return LlamaForCausalLM(config)


class TokenRows(torch.utils.data.Dataset):
    """Fixed random token rows (the same for every seed, so data is not what differs)."""

    def __init__(self, rows: int = 96, length: int = 12):
        generator = torch.Generator().manual_seed(1234)
        self.ids = torch.randint(0, 67, (rows, length), generator=generator)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def full_state(engine) -> dict:
    """name -> {fp32, exp_avg, exp_avg_sq} full tensors; collective (every rank calls it)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    from reshard_proof.engine_state import relink_optimizer_fragments
    relink_optimizer_fragments(engine)  # every group's moments visible, also right after a load
    state = {}
    for name, param in engine.module.named_parameters():
        entry = {"fp32": safe_get_full_fp32_param(param)}
        for key in ("exp_avg", "exp_avg_sq"):
            entry[key] = safe_get_full_optimizer_state(param, key)
        state[name] = {k: v.detach().clone().float().cpu() for k, v in entry.items()}
    return state


def compare_with_truth(full: dict, truth: dict) -> tuple[list[str], int]:
    """(names of tensors that differ in any element, how many tensors were compared)."""
    mismatches, checked = [], 0
    for name, entry in truth.items():
        for key, expected in entry.items():
            checked += 1
            if name not in full or not torch.equal(full[name][key], expected):
                mismatches.append(f"{name}.{key}")
    return mismatches, checked


def write_report(path: str, report: dict) -> None:
    """The JSON report the test reads, replaced atomically (rank 0 writes it)."""
    import json
    import os
    with open(path + ".tmp", "w") as fd:
        json.dump(report, fd)
    os.replace(path + ".tmp", path)


def leave_and_exit() -> None:
    """Leave the process group on every rank, then exit without interpreter teardown."""
    import os
    import sys

    import torch.distributed as dist
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
