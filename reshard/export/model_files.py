"""The files beside the weights that `from_pretrained` reads: carried from the save directory into an export.

    from reshard.export.model_files import model_files_in, copy_model_files, missing_notes
    names = model_files_in("/out/checkpoint-300")        # ["config.json", "generation_config.json", ...]
    copy_model_files("/out/checkpoint-300", "/models/hf", names)
    missing_notes(names)                                 # what from_pretrained(OUT) will still need

A Hugging Face Trainer's `checkpoint-N` holds the model's `config.json` and
`generation_config.json` (trainer.py `_save` -> `save_pretrained`) and, when the Trainer was given
one, the tokenizer's files (`processing_class.save_pretrained`). An export without them is not a
model directory: `AutoModelForCausalLM.from_pretrained(OUT)` fails on the missing config. They are
copied unchanged, top level only, as transformers names them (configuration_utils.py CONFIG_NAME,
generation/configuration_utils.py GENERATION_CONFIG_NAME, tokenization_utils_base.py
SPECIAL_TOKENS_MAP_FILE / ADDED_TOKENS_FILE / TOKENIZER_CONFIG_FILE / FULL_TOKENIZER_FILE, and each
tokenizer's `vocab_files_names`); where they are missing, the export's summary says what to add.
"""
from __future__ import annotations

import os
import shutil

CONFIG_FILES = ("config.json", "generation_config.json")
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "vocab.json", "merges.txt", "vocab.txt", "tokenizer.model", "spiece.model", "sentencepiece.bpe.model",
    "chat_template.jinja", "chat_template.json",
)
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")
MODEL_FILES = CONFIG_FILES + TOKENIZER_FILES + PROCESSOR_FILES


def model_files_in(save_dir: str) -> list[str]:
    """The names of MODEL_FILES that `save_dir` holds as regular files (links are not followed)."""
    return [name for name in MODEL_FILES
            if os.path.isfile(os.path.join(save_dir, name)) and not os.path.islink(os.path.join(save_dir, name))]


def copy_model_files(save_dir: str, destination: str, names) -> None:
    """Copy `names` from `save_dir` into `destination`, each through a temporary name and a rename;
    MODEL_FILES the source lacks are removed from `destination` (left by an export --overwrite
    replaces, they would describe another model)."""
    for name in MODEL_FILES:
        target = os.path.join(destination, name)
        if name not in names:
            if os.path.lexists(target):
                os.unlink(target)
            continue
        partial = target + ".partial"
        if os.path.lexists(partial):
            os.unlink(partial)
        with open(os.path.join(save_dir, name), "rb") as src, open(partial, "xb") as out:
            shutil.copyfileobj(src, out, 1 << 20)
            out.flush()
            os.fsync(out.fileno())
        os.replace(partial, target)


def missing_notes(names) -> list[str]:
    """What `from_pretrained(OUT)` needs that the save directory did not hold."""
    notes = []
    if "config.json" not in names:
        notes.append("no config.json in the save directory: AutoModel*.from_pretrained(OUT) needs the model's config; "
                     "write it with config.save_pretrained(OUT) (or pass config= to from_pretrained)")
    if not any(name in names for name in TOKENIZER_FILES):
        notes.append("no tokenizer files in the save directory: AutoTokenizer.from_pretrained(OUT) needs them; "
                     "write them with tokenizer.save_pretrained(OUT)")
    return notes
