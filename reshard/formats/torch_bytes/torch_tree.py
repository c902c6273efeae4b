"""The portable tree: a torch.save object with every tensor replaced by where its bytes are
(TensorRef) or what will fill it (NewTensor), and the walks over such trees in torch.save's order.

    from reshard.formats.torch_bytes.torch_tree import TensorRef, NewTensor, map_leaves, refs_in
    refs = refs_in(tree)                         # every TensorRef/NewTensor, in torch.save's order
    copy = map_leaves(tree, fn, is_ref)          # the tree with each leaf replaced by fn(leaf)

Shared by both ways of reading and writing torch files (torch_archive with torch, torch_pickle
without), and by everything above them; knows neither, nor any checkpoint format.
"""
from __future__ import annotations

import io
import pickle
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from reshard.formats.torch_bytes.torch_classes import ITEMSIZE

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class TensorRef:
    """A tensor of a source file, by where its bytes are: storage key = byte offset in the file."""

    storage_key: int
    storage_nbytes: int
    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int
    requires_grad: bool

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def itemsize(self) -> int:
        size = ITEMSIZE.get(self.dtype)
        return dtype_of(self.dtype).itemsize if size is None else size

    @property
    def is_contiguous(self) -> bool:
        expected, stride = [], 1
        for size in reversed(self.shape):
            expected.append(stride)
            stride *= size
        return all(s == e for s, e, size in zip(self.stride, reversed(expected), self.shape) if size > 1)

    @property
    def byte_offset(self) -> int:
        """Offset of element 0 of this (contiguous) tensor in the file."""
        return self.storage_key + self.storage_offset * self.itemsize


@dataclass(frozen=True)
class NewTensor:
    """A tensor the writer creates: a 1-D buffer of `numel` elements (or of `shape`), filled by the exchange."""

    slot: tuple
    """What fills it, e.g. ("optim", buffer, stream); the writer maps slots to file offsets."""
    numel: int
    dtype: str
    requires_grad: bool = False
    shape: tuple[int, ...] | None = None
    """Its shape when it is not a flat buffer (module weights under tensor parallelism, or written
    whole by a ZeRO stage change)."""


def dtype_of(name: str) -> "torch.dtype":
    import torch

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"not a torch dtype: {name}")
    return dtype


def dtype_name(dtype: "torch.dtype") -> str:
    return str(dtype).removeprefix("torch.")


class _LeafFinder(pickle.Pickler):
    """Pickles `obj` into `file`, noting every object `is_leaf` accepts, in torch.save's order."""

    def __init__(self, file, is_leaf: Callable[[Any], bool]):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.is_leaf = is_leaf
        self.found: list = []

    def persistent_id(self, obj):
        if self.is_leaf(obj):
            self.found.append(obj)
            return len(self.found) - 1
        return None


class _Replacer(pickle.Unpickler):
    def __init__(self, data: bytes, replacements: list):
        super().__init__(io.BytesIO(data))
        self.replacements = replacements

    def persistent_load(self, pid):
        return self.replacements[pid]


def is_tensor(obj) -> bool:
    torch = sys.modules.get("torch")  # no tensor exists before torch is imported
    return torch is not None and isinstance(obj, torch.Tensor)


def leaves_in_order(obj: Any, is_leaf: Callable[[Any], bool] = is_tensor) -> list:
    """Every leaf (by default every tensor) of `obj`, in the order torch.save meets them."""
    finder = _LeafFinder(io.BytesIO(), is_leaf)
    finder.dump(obj)
    return finder.found


def map_leaves(obj: Any, fn: Callable[[Any], Any], is_leaf: Callable[[Any], bool] = is_tensor) -> Any:
    """A copy of `obj` with every leaf replaced by fn(leaf); a leaf met twice maps to one object.

    Only for objects reshard itself holds (already safely loaded): the copy is made by
    pickling and unpickling them in memory.
    """
    out = io.BytesIO()
    pickler = _LeafFinder(out, is_leaf)
    pickler.dump(obj)
    memo: dict[int, Any] = {}
    replacements = []
    for leaf in pickler.found:
        if id(leaf) not in memo:
            memo[id(leaf)] = fn(leaf)
        replacements.append(memo[id(leaf)])
    return _Replacer(out.getvalue(), replacements).load()


def is_ref(obj) -> bool:
    return isinstance(obj, (TensorRef, NewTensor))


def refs_in(tree: Any) -> list:
    return leaves_in_order(tree, is_ref)
