"""Jobs: what every worker runs from start to finish, and the one lifecycle they share.

    python -m reshard SRC DST --target-dp M          # collective_job, under any launcher

`lifecycle` sequences lock, staging, journal, resume, manifest, publish and clean-up for every
kind of job; `collective_job` (with `node_local` and `node_local_columns`), `array_job` and the exports (reshard.export) supply what differs. `options`, `preflight`,
`results` and the destination pieces (`destination`, `lock`, `manifest`, `save_dir_files`) are
what they share. Imports transport/, formats/, files/, planning/, layouts/ below it; nothing below
imports it (pyproject.toml's import-linter contract)."""
