"""The nested, RLHF-flavoured client_state that train saves and check_load expects back.

    python -c "from reshard_proof.client_state import make_client_state; print(make_client_state())"

DeepSpeed merges client_state into the top level of the model-states file, so any resharder must
carry unknown top-level keys through unchanged. The values cover what tends to break: Python
floats (compared by their bits), int64 and bf16 tensors, NaN and -0.0, tuples, lists, nesting.
"""

import torch


def make_client_state() -> dict:
    """Identical on every rank and every call (ZeRO-3 saves a copy in each rank's file)."""
    return {
        "ppo": {
            "iteration": 7,
            "kl_coef": 0.123,
            "clip_range": (0.1, 0.2),
            "reward_stats": {
                "mean": torch.tensor([0.5, -1.25, 3.0]),
                "var": torch.tensor([[2.0, 0.25], [-0.0, float("nan")]]),
                "count": torch.tensor(1234, dtype=torch.int64),
            },
            "value_head_bias": torch.tensor([1.5, -0.0, 2.0 ** -9], dtype=torch.bfloat16),
        },
        "dataloader": {"epoch": 1, "index": 42, "order": [3, 1, 2]},
        "note": "text",
    }
