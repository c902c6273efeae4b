"""Integrations with training frameworks that drive DeepSpeed for you (see reshard.integrations.huggingface)."""
