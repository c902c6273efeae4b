"""Conversions out of DeepSpeed's native ZeRO format.

    python -m reshard export SRC OUT --format safetensors [--dtype bf16] [--max-shard-size 5GB]

    python -m reshard export SRC OUT --format universal

    from reshard.export import export_safetensors, export_universal
"""
from reshard.export.safetensors_job import export_safetensors
from reshard.export.universal import export_universal

__all__ = ["export_safetensors", "export_universal"]
