"""Conversions out of DeepSpeed's native ZeRO format.

    python -m reshard export SRC OUT --format safetensors [--dtype bf16] [--max-shard-size 5GB]

    from reshard.export import export_safetensors
"""
from reshard.export.safetensors_job import export_safetensors

__all__ = ["export_safetensors"]
