"""Writes the safetensors files one worker owns: header and reserved space first, then values at offsets.

    writer = SafetensorsWriter.create(layout, out_dir, [0, 2], {"optim": "float32"}, model_path, budget)
    writer.write(rank=2, slot=("optim", 5, "fp32"), element=0, itemsize=4, data=view)  # from the exchange
    writer.finish()   # copies the buffers / ZeRO-1/2 frozen params from model_path in chunks, fsyncs

`rank` is the output file's index and the slot's buffer the tensor's index in that file (see
`hf_layout.ExportLayout.pieces`). Incoming values are cast to the file's dtype here, chunk by chunk,
so no worker ever holds more than a round's slices. The file is reserved with ftruncate: bytes
not yet written read back as zeros, and every byte of the data section is written exactly once.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np
import torch

from reshard.files.byte_io import pread_exact, pwrite_exact
from reshard.export.hf_layout import ExportFile, ExportLayout, safetensors_header
from reshard.formats.torch_bytes.torch_archive import dtype_of
from reshard.files.paths import confined, open_new_file


def _cast(data: memoryview, source_dtype: str, target_dtype: str) -> memoryview:
    if source_dtype == target_dtype:
        return data
    values = torch.frombuffer(data, dtype=dtype_of(source_dtype)) if len(data) else torch.empty(0, dtype=dtype_of(source_dtype))
    return memoryview(values.to(dtype_of(target_dtype)).view(torch.uint8).numpy())


@dataclass
class SafetensorsWriter:
    layout: ExportLayout
    out_dir: str
    files: list[int]
    fds: dict = field(default_factory=dict)
    """file index -> fd"""
    data_start: dict = field(default_factory=dict)
    """file index -> byte offset of the data section"""
    stream_dtypes: dict = field(default_factory=dict)
    """space name -> dtype of the values the exchange delivers ("optim": float32 masters)"""
    model_path: str = ""
    """Rank-0 model-states file, source of the tensors stored whole"""
    budget_bytes: int = 1 << 30
    bytes_written: int = 0

    @classmethod
    def create(cls, layout: ExportLayout, out_dir: str, files, stream_dtypes: dict, model_path: str,
               budget_bytes: int, reuse_existing: bool = False) -> "SafetensorsWriter":
        """`reuse_existing`: resuming, keep what the files hold (the header, the same bytes, is rewritten)."""
        writer = cls(layout, out_dir, list(files), stream_dtypes=dict(stream_dtypes), model_path=model_path,
                     budget_bytes=budget_bytes)
        try:
            for f in writer.files:
                export = layout.files[f]
                header = safetensors_header(export)
                path = os.path.join(out_dir, export.name)
                fd = (os.open(confined(out_dir, path), os.O_RDWR | os.O_NOFOLLOW) if reuse_existing
                      else open_new_file(out_dir, path, os.O_RDWR))
                writer.fds[f] = fd
                pwrite_exact(fd, memoryview(header), 0)
                os.ftruncate(fd, len(header) + export.data_bytes)
                writer.data_start[f] = len(header)
        except BaseException:
            writer.close()
            raise
        return writer

    def write(self, rank: int, slot: tuple, element: int, itemsize: int, data: memoryview) -> None:
        space, k, _stream = slot
        tensor = self.layout.files[rank].tensors[k]
        out = _cast(data, self.stream_dtypes[space], tensor.dtype)
        offset = self.data_start[rank] + tensor.data_offset + element * dtype_of(tensor.dtype).itemsize
        pwrite_exact(self.fds[rank], out, offset)
        self.bytes_written += len(out)

    def copy_whole(self, model_path: str, budget_bytes: int) -> None:
        """Tensors stored whole in the model-states file (or in their own files: a pipeline's layer
        files, joined over a model axis run by run, `ExportTensor.whole_runs`): read, cast and write in
        chunks of at most a third of the budget (the exchange is over by then, so its buffers are gone)."""
        chunk_bytes = max(budget_bytes // 3, 64)
        sources = {}
        try:
            for f in self.files:
                export: ExportFile = self.layout.files[f]
                for tensor in export.tensors:
                    if tensor.source != "whole" or not tensor.numel:
                        continue
                    ref = tensor.ref
                    step = max(1, chunk_bytes // ref.itemsize)
                    out_itemsize = dtype_of(tensor.dtype).itemsize
                    for path, at, element, count in tensor.whole_runs(model_path):
                        if path not in sources:
                            sources[path] = os.open(path, os.O_RDONLY)
                        for first in range(0, count, step):
                            n = min(step, count - first)
                            buffer = np.empty(n * ref.itemsize, dtype=np.uint8)
                            pread_exact(sources[path], memoryview(buffer), at + first * ref.itemsize, path)
                            out = _cast(memoryview(buffer), ref.dtype, tensor.dtype)
                            pwrite_exact(self.fds[f], out,
                                         self.data_start[f] + tensor.data_offset + (element + first) * out_itemsize)
                            self.bytes_written += len(out)
        finally:
            for src in sources.values():
                os.close(src)

    def sync(self) -> None:
        for fd in self.fds.values():
            os.fsync(fd)

    def finish(self) -> None:
        self.copy_whole(self.model_path, self.budget_bytes)
        self.sync()
        self.close()

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()
