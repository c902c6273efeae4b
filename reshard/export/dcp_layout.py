"""Where each tensor of a PyTorch Distributed Checkpoint export goes, pure: row-block chunks dealt to files.

    from reshard.export.dcp_layout import dcp_layout
    layout = dcp_layout(hf_layout(source, "float32", 1 << 62), files=4, chunk_bytes=64 << 20)
    layout.files[0][0]              # DcpChunk(tensor=0, row=0, rows=11, element=0, numel=77)
    layout.pieces("optim", numels)  # PieceTable: optimizer space -> (file, chunk index, element)

The model's tensors (`hf_layout`: names and order of the model's state_dict(), a tied alias stored
once) whose values the exchange moves ("optim": trainable parameters, "frozen": ZeRO-3 frozen ones)
are cut along dim 0 into row blocks of at most `chunk_bytes` of fp32 values (at least one row).
DCP's loader (torch/distributed/checkpoint/filesystem.py `FileSystemReader.read_data`) reads a
stored chunk whole (`torch.load` of its blob) and narrows it to the loading rank's part; FSDP2
shards every parameter along dim 0 (`Shard(0)`), so with row blocks a loading rank reads its own
rows plus at most one partial block at each end, whatever its world size. A 0-d tensor is one row.

The chunks, in the tensors' order, are dealt to `files` output files in runs of about equal bytes;
each file is a target "rank" of the plan (owned by one worker) and each chunk in it a target buffer,
holding one `torch.save` blob per stream (the parameter, each optimizer state) in
`reshard.export.dcp_format`.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from reshard.export.hf_layout import ExportTensor
from reshard.layouts.zero import PieceTable, logical_bases

FP32_BYTES = 4
DEFAULT_CHUNK_BYTES = 64 << 20
"""Largest chunk of one stream (fp32 values): big enough that the per-blob overhead (~1.5 kB) is
nothing, small enough that a loading rank over-reads at most two such blocks per parameter."""


@dataclass(frozen=True)
class DcpChunk:
    """Rows [row, row + rows) of tensor `tensor`: elements [element, element + numel) of it."""

    tensor: int
    """Index in DcpLayout.tensors."""
    row: int
    rows: int
    element: int
    numel: int

    def offsets(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The chunk's first index in every dimension (DCP's `ChunkStorageMetadata.offsets`)."""
        return (self.row,) + (0,) * (len(shape) - 1) if shape else ()

    def sizes(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return (self.rows,) + tuple(shape[1:]) if shape else ()


@dataclass(frozen=True)
class DcpLayout:
    """The exchanged tensors cut into chunks, the chunks dealt to files; the same on every worker."""

    tensors: tuple[ExportTensor, ...]
    """Every tensor of the model's state dict but the tied aliases (`hf_layout` order and kinds)."""
    aliases: dict
    """alias -> owner: the alias is written as the owner's chunks under its own key."""
    files: tuple[tuple[DcpChunk, ...], ...]
    """Per output file, its chunks in file order (only "optim" and "frozen" tensors are chunked)."""

    def chunks_of(self, tensor: int) -> list[DcpChunk]:
        return [c for chunks in self.files for c in chunks if c.tensor == tensor]

    def pieces(self, source_kind: str, numels) -> PieceTable:
        """Where each element of a source space ("optim" or "frozen") goes: rank = file,
        buffer = the chunk's index in its file, offset = element in the chunk."""
        bases = logical_bases(numels)
        start, rank, buffer = [], [], []
        for f, chunks in enumerate(self.files):
            for k, chunk in enumerate(chunks):
                tensor = self.tensors[chunk.tensor]
                if tensor.source == source_kind and chunk.numel:
                    start.append(bases[tensor.index] + chunk.element)
                    rank.append(f)
                    buffer.append(k)
        return PieceTable.from_unsorted(start, rank, buffer, np.zeros(len(start), np.int64), int(np.sum(numels)))

    def buffer_numels(self) -> list[int]:
        """Per chunk index, the largest chunk at that index in any file (round windows)."""
        width = max((len(chunks) for chunks in self.files), default=0)
        return [max((chunks[k].numel for chunks in self.files if k < len(chunks)), default=0) for k in range(width)]


def row_blocks(index: int, shape: tuple[int, ...], numel: int, chunk_bytes: int) -> list[DcpChunk]:
    """Tensor `index` cut along dim 0 into blocks of at most `chunk_bytes` of fp32 (one row at least)."""
    rows = shape[0] if shape else 1
    if rows == 0 or numel == 0:
        return [DcpChunk(index, 0, rows, 0, 0)]
    row_numel = numel // rows
    step = max(1, chunk_bytes // max(1, row_numel * FP32_BYTES))
    return [DcpChunk(index, r, min(step, rows - r), r * row_numel, min(step, rows - r) * row_numel)
            for r in range(0, rows, step)]


def dcp_layout(tensors, aliases: dict, files: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> DcpLayout:
    """`tensors`: ExportTensors (hf_layout's, all files); the "optim" and "frozen" ones are chunked and
    dealt to at most `files` files (at least one) in order, each run about total/files bytes."""
    tensors = tuple(tensors)
    chunks = [c for i, t in enumerate(tensors) if t.source in ("optim", "frozen")
              for c in row_blocks(i, t.shape, t.numel, chunk_bytes)]
    files = max(1, min(files, len(chunks)))
    total = sum(c.numel for c in chunks) or 1
    dealt: list[list[DcpChunk]] = [[] for _ in range(files)]
    before = 0
    for chunk in chunks:
        # the file whose share of the bytes holds the chunk's middle element
        middle = before + chunk.numel // 2
        dealt[min(files - 1, middle * files // total)].append(chunk)
        before += chunk.numel
    return DcpLayout(tensors, dict(aliases), tuple(tuple(f) for f in dealt))
