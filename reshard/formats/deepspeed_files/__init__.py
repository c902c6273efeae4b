"""DeepSpeed's checkpoint files on top of torch_bytes: names and schema, inspection, specs, target trees,
stage change, the source reader and the target writer."""
