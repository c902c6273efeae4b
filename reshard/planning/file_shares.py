"""Which worker copies which whole file (expert files, the tag directory's other files). Pure.

    from reshard.planning.file_shares import file_shares
    file_shares({"layer_0_expert_0_mp_rank_00_model_states.pt": 4 << 20, "metrics.json": 10}, workers=3)
    # (("layer_0_expert_0_mp_rank_00_model_states.pt",), ("metrics.json",), ())

Files that travel unchanged (native MoE expert files, by global expert id, are most of a large
MoE's bytes) are copied whole, each by exactly one worker: largest first, each to the worker
with the fewest bytes so far (ties: the lower worker), names breaking ties between equal sizes,
so every worker derives the same shares from the same sizes and the output bytes do not
depend on who copied what.
"""
from __future__ import annotations

from typing import Mapping


def file_shares(sizes: Mapping[str, int], workers: int) -> tuple[tuple[str, ...], ...]:
    """Per worker, the files it copies (in name order); every file in exactly one share."""
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    loads = [0] * workers
    shares: list[list[str]] = [[] for _ in range(workers)]
    for name in sorted(sizes, key=lambda n: (-int(sizes[n]), n)):
        worker = min(range(workers), key=lambda w: (loads[w], w))
        shares[worker].append(name)
        loads[worker] += int(sizes[name])
    return tuple(tuple(sorted(share)) for share in shares)
