"""Planning, pure and deterministic: who reads, who writes, what moves, in which round
(`plan`, `chunked_plan` for evenly chunked ZeRO-3 layouts, `checkpoint_plan` for one checkpoint's
spaces, `file_shares` for whole files). No I/O, no torch; built on layouts/."""
