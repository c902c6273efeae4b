"""Checkpoint formats, in two layers as packages: `torch_bytes` (torch's file format at the byte level,
which knows no DeepSpeed) and `deepspeed_files` (DeepSpeed's files on top of it); the import-linter
contract "formats-layers" in pyproject.toml keeps the direction."""
