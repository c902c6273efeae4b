"""Tamper with a copy of a checkpoint, so a test can show that check_load notices.

    python -m reshard_proof.negative_controls SRC_CKPT DST_CKPT fp32_bit --rank 1

A harness that never fails proves nothing: each control here changes one thing a resharder could
get wrong (usually by the smallest possible amount, one bit) and returns a description naming the
parameter or key it touched, which the verdict's mismatches must then name too.
DeepSpeed's files pickle its own classes, so they are read with weights_only=False: only ever
point this at checkpoints this harness wrote.
"""

import argparse
import math
import shutil
from collections.abc import Callable
from pathlib import Path

import torch


def copy_checkpoint(source, destination) -> Path:
    destination = Path(destination)
    if destination.exists():
        shutil.rmtree(destination)
    shutil.copytree(source, destination)
    return destination


def _tag_dir(ckpt_dir: Path) -> Path:
    return ckpt_dir / (ckpt_dir / "latest").read_text().strip()


def _edit(path: Path, edit: Callable[[dict], str]) -> str:
    state = torch.load(path, map_location="cpu", weights_only=False)
    description = edit(state)
    torch.save(state, path)
    return description


def _optim_file(ckpt_dir: Path, rank: int) -> Path:
    (path,) = _tag_dir(ckpt_dir).glob(f"*zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
    return path


def _model_files(ckpt_dir: Path) -> list[Path]:
    return sorted(_tag_dir(ckpt_dir).glob("*model_states.pt"))


def _flip_lowest_bit(tensor: torch.Tensor, index: int) -> None:
    """One ulp: the smallest change a float can undergo."""
    bits = tensor.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()])
    bits.view(-1)[index] ^= 1


def _param_at(optim: dict, model_states: dict, group: int, rank: int, index: int) -> str:
    """Name of the parameter owning element `index` of `rank`'s fp32 partition of `group`.

    Computed from `param_shapes` (flat order, round-robin reordering included) and the partition
    arithmetic, never from `param_slice_mappings`: with round_robin_gradients DeepSpeed writes
    those in the un-reordered order, i.e. wrong (stage_1_and_2.py _link_all_hp_params only passes
    real offsets when there is alignment padding).
    """
    shapes = model_states["param_shapes"][group]
    if "fp32_flat_groups" in optim:  # ZeRO-3: the rank's ceil(n/W) chunk of each param, concatenated
        world_size, position = optim["partition_count"], 0
        for name, shape in shapes.items():
            chunk = -(-shape.numel() // world_size)
            if index < position + chunk:
                if rank * chunk + index - position >= shape.numel():
                    raise ValueError(f"element {index} of rank {rank}'s sub-group {group} is padding")
                return name
            position += chunk
        raise ValueError(f"element {index} is beyond rank {rank}'s sub-group {group}")
    # ZeRO-1/2 and BF16_Optimizer (stage_1_and_2.py / bf16_optimizer.py __init__)
    counts = optim["partition_count"]
    world_size = counts[group] if isinstance(counts, list) else counts
    paddings = optim.get("param_alignment_paddings", [[0] * len(shapes)] * (group + 1))[group]
    total = sum(shape.numel() for shape in shapes.values()) + sum(paddings)
    alignment = 2 * world_size  # nccl_start_alignment_factor * W
    partition_size = -(-total // alignment) * alignment // world_size
    flat_index, offset = rank * partition_size + index, 0
    for (name, shape), padding in zip(shapes.items(), paddings):
        if offset <= flat_index < offset + shape.numel():
            return name
        offset += shape.numel() + padding
    raise ValueError(f"element {index} of rank {rank}'s partition of group {group} is padding")


def flip_fp32_partition_bit(ckpt_dir, rank: int = 1, group: int = 0, index: int = 0) -> str:
    """Flip the lowest bit of element `index` of `rank`'s fp32 master partition of `group`;
    returns the name of the parameter that element belongs to (ValueError if it is padding; the
    defaults, rank 1, group 0, index 0, hit real data at N=2)."""
    ckpt_dir = Path(ckpt_dir)
    model_files = _model_files(ckpt_dir)
    model_states = torch.load(model_files[min(rank, len(model_files) - 1)], map_location="cpu", weights_only=False)

    def edit(state: dict) -> str:
        optim = state["optimizer_state_dict"]
        key = "fp32_flat_groups" if "fp32_flat_groups" in optim else "single_partition_of_fp32_groups"
        _flip_lowest_bit(optim[key][group], index)
        return _param_at(optim, model_states, group, rank, index)

    return _edit(_optim_file(ckpt_dir, rank), edit)


def _torch_optimizer_state(optim: dict) -> dict:
    """The torch optimizer state dict inside DeepSpeed's: ZeRO-1/2 and BF16_Optimizer call it
    base_optimizer_state, ZeRO-3 optimizer_state_dict (indexed by sub-group)."""
    return optim["base_optimizer_state"] if "base_optimizer_state" in optim else optim["optimizer_state_dict"]


def flip_optimizer_state_bit(ckpt_dir, rank: int = 1, state_key: str | None = None, group: int = 0) -> str:
    """Flip one bit of element 0 of an optimizer state tensor; by default the first partition-sized
    one, whatever the optimizer calls it (exp_avg, momentum_buffer...). Returns the key."""
    def edit(state: dict) -> str:
        group_state = _torch_optimizer_state(state["optimizer_state_dict"])["state"][group]
        key = state_key or next(name for name, value in group_state.items()
                                if torch.is_tensor(value) and value.ndim == 1 and value.numel() > 1)
        _flip_lowest_bit(group_state[key], 0)
        return key
    return _edit(_optim_file(Path(ckpt_dir), rank), edit)


def change_group_hyperparameter(ckpt_dir, rank: int = 1, group: int = 1, key: str = "lr") -> str:
    """Nudge one hyperparameter of one optimizer group, in one rank's file only, by one ulp."""
    def edit(state: dict) -> str:
        groups = _torch_optimizer_state(state["optimizer_state_dict"])["param_groups"]
        groups[group][key] = math.nextafter(groups[group][key], math.inf)
        return key
    return _edit(_optim_file(Path(ckpt_dir), rank), edit)


def change_model_states(ckpt_dir, edit: Callable[[dict], str]) -> str:
    """Apply `edit` to every model-states file (one for ZeRO-1/2, one per rank for ZeRO-3)."""
    return [_edit(path, edit) for path in _model_files(Path(ckpt_dir))][0]


def change_client_value(ckpt_dir) -> str:
    """client_state sits at the top level of the model states; nudge ppo.kl_coef by one ulp."""
    def edit(state: dict) -> str:
        state["ppo"]["kl_coef"] = math.nextafter(state["ppo"]["kl_coef"], math.inf)
        return "kl_coef"
    return change_model_states(ckpt_dir, edit)


def change_buffer(ckpt_dir, name: str = "running_mean") -> str:
    def edit(state: dict) -> str:
        _flip_lowest_bit(state["module"][name], 0)
        return name
    return change_model_states(ckpt_dir, edit)


def change_scheduler(ckpt_dir) -> str:
    def edit(state: dict) -> str:
        scheduler = state["lr_scheduler"]
        key = "last_epoch" if "last_epoch" in scheduler else "last_batch_iteration"
        scheduler[key] += 1
        return key
    return change_model_states(ckpt_dir, edit)


CONTROLS: dict[str, Callable[..., str]] = {
    "fp32_bit": flip_fp32_partition_bit,
    "optimizer_state_bit": flip_optimizer_state_bit,
    "hyperparameter": change_group_hyperparameter,
    "client_state": change_client_value,
    "buffer": change_buffer,
    "scheduler": change_scheduler,
}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source")
    parser.add_argument("destination")
    parser.add_argument("control", choices=sorted(CONTROLS))
    parser.add_argument("--rank", type=int, default=None)
    arguments = parser.parse_args()
    copied = copy_checkpoint(arguments.source, arguments.destination)
    extra = {} if arguments.rank is None else {"rank": arguments.rank}
    print(CONTROLS[arguments.control](copied, **extra))
