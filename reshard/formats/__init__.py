"""Checkpoint formats: torch archives at the byte level, and DeepSpeed's files on top of them."""
