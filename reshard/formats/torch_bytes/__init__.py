"""Torch's file format at the byte level: the zip archive (`torch_zip`), the pickle records (`torch_pickle`), the
stand-in classes and allowlist (`torch_classes`, `torch_allowlist`), trees and loads (`torch_tree`,
`torch_archive`), the installed release (`torch_release`) and float casts (`float_casts`). Knows no DeepSpeed
(import-linter contract "formats-layers")."""
