"""Where the experts of a native DeepSpeed MoE layer live: local <-> global expert ids. Pure.

    from reshard.layouts.expert_placement import ExpertPlacement, expert_name_parts
    placement = ExpertPlacement(num_experts=8, ep=4)
    placement.global_expert(ep_rank=3, local=1)      # 7
    placement.ep_rank_of(7), placement.local_of(7)   # (3, 1)
    expert_name_parts("moe.0.deepspeed_moe.experts.deepspeed_experts.5.fc1.weight")
    # ("moe.0.deepspeed_moe.experts.deepspeed_experts.", 5, ".fc1.weight")

DeepSpeed 0.19.8 rules mirrored here:
- moe/layer.py `MoE.__init__`: each of the `ep` expert-parallel ranks holds
  num_experts // ep local experts (DeepSpeed asserts the division);
- moe/experts.py `Experts`: local expert j is named `...deepspeed_experts.{j}.` in the module;
- runtime/engine.py `_save_moe_checkpoint` / `load_moe_state_dict`: local expert j on EP rank e
  is global expert e * (num_experts // ep) + j, the index in the expert file names and keys;
- which global rank is EP rank e is the topology's business (`Topology.expert_parallel_rank`).

Only the expert index of a name changes between local and global; the rest of the name is the
module path. This is the whole local -> global mapping of expert parallelism: a contiguous block
of global experts per EP rank, named by an offset.

AutoEP (module_inject/auto_ep_layer.py `AutoEPMoELayer`) places experts the same way (its
`legacy_uniform_autoep_placement_descriptor`: EP rank e holds e*n .. e*n+n-1) but FUSES a rank's
experts into one tensor per weight, `{layer}.experts.w1 [n, ...]` (w2, w3 alike). Its expert
files key expert G's slice as `{layer}.experts.w1.{G}` (engine.py `_save_moe_checkpoint`); reshard
names each global expert's slice that way too (`autoep_name_parts`), so the fused tensor of EP
rank e is the run of slices e*n .. e*n+n-1, in order.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

EXPERT_SLOT = ".deepspeed_moe.experts.deepspeed_experts."  # engine.py: moe_str_prefix
_EXPERT_NAME = re.compile(rf"^(.*{re.escape(EXPERT_SLOT)})([0-9]+)(\..*)$")


def expert_name_parts(name: str) -> tuple[str, int, str] | None:
    """(layer prefix through the slot, expert index, rest) of an expert parameter name, else None."""
    match = _EXPERT_NAME.match(name)
    return (match[1], int(match[2]), match[3]) if match else None


_AUTOEP_NAME = re.compile(r"^(.*\.experts\.|experts\.)(w[123])\.([0-9]+)$")


def autoep_name_parts(name: str) -> tuple[str, int, str] | None:
    """(layer prefix through `experts.`, global expert, weight name) of an AutoEP expert slice
    name `...experts.w2.5`, else None."""
    match = _AUTOEP_NAME.match(name)
    return (match[1], int(match[3]), match[2]) if match else None


def autoep_fused_name(name: str) -> str:
    """The fused parameter an AutoEP expert slice belongs to: `...experts.w2.5` -> `...experts.w2`."""
    return name.rpartition(".")[0]


def with_expert_index(name: str, index: int) -> str:
    """`name` with its expert index replaced (local <-> global renaming)."""
    prefix, _, rest = expert_name_parts(name)
    return f"{prefix}{index}{rest}"


@dataclass(frozen=True)
class ExpertPlacement:
    """The experts of one MoE layer over `ep` expert-parallel ranks."""

    num_experts: int
    ep: int

    def __post_init__(self) -> None:
        if self.ep < 1 or self.num_experts % self.ep:
            raise ValueError(f"{self.num_experts} experts cannot be split over ep={self.ep} ranks")

    @property
    def local_count(self) -> int:
        """Experts on each EP rank."""
        return self.num_experts // self.ep

    def global_expert(self, ep_rank: int, local: int) -> int:
        return ep_rank * self.local_count + local

    def ep_rank_of(self, global_expert: int) -> int:
        return global_expert // self.local_count

    def local_of(self, global_expert: int) -> int:
        return global_expert % self.local_count
