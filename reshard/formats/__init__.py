"""Checkpoint formats: torch archives at the byte level (`torch_*`, which know no DeepSpeed), and
DeepSpeed's files on top of them (`deepspeed_*`, `stage_change`, `source_reader`, `target_writer`,
`folded_expert_files`, `float_casts`)."""
