"""Conversions out of DeepSpeed's native ZeRO format.

    python -m reshard export SRC OUT --format safetensors [--dtype bf16] [--max-shard-size 5GB]

    python -m reshard export SRC OUT --format universal

    python -m reshard export SRC OUT --format dcp [--dtype bf16]     # PyTorch DCP for FSDP2, Adam state too

    from reshard.export import export_dcp, export_safetensors, export_universal

A PipelineModule save (layer_XX-model_states.pt files) takes the same road, its tensors named as
PipelineModule.state_dict() names them (reshard.export.pipeline_layout), each parameter once and whole.
"""
from reshard.export.dcp_job import export_dcp
from reshard.export.safetensors_job import export_safetensors
from reshard.export.universal import export_universal

__all__ = ["export_dcp", "export_safetensors", "export_universal"]
