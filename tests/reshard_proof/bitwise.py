"""Exact, bit-for-bit comparison of nested checkpoint-like values, with readable mismatch reports.

    python -c "import torch; from reshard_proof.bitwise import compare_trees; \
        print(compare_trees({'w': torch.tensor([0.0, 1.0])}, {'w': torch.tensor([-0.0, 1.0])}).mismatches)"

Tensors are equal when dtype, shape and every bit agree: both sides are viewed as integers of the
same width, so NaN equals an identical NaN and -0.0 differs from 0.0. Python floats are compared
by their IEEE bits too. Containers must have the same type, keys and lengths.
"""

import math
import struct
from dataclasses import dataclass, field

import torch

_SAME_WIDTH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass
class Comparison:
    """What one comparison looked at and what disagreed."""

    mismatches: list[str] = field(default_factory=list)
    """Human-readable differences, each starting with the path of the value."""
    checked_tensors: int = 0
    """Tensors compared (equal or not)."""
    checked_elements: int = 0
    """Elements of those tensors."""

    @property
    def ok(self) -> bool:
        return not self.mismatches

    def absorb(self, other: "Comparison") -> None:
        self.mismatches += other.mismatches
        self.checked_tensors += other.checked_tensors
        self.checked_elements += other.checked_elements


def _as_bits(tensor: torch.Tensor) -> torch.Tensor:
    tensor = tensor.detach().cpu().contiguous()
    if tensor.dtype == torch.bool:
        return tensor.view(torch.uint8)
    if tensor.is_complex():
        tensor = torch.view_as_real(tensor)
    return tensor.view(_SAME_WIDTH_INT[tensor.element_size()])


def tensors_bitwise_equal(expected: torch.Tensor, actual: torch.Tensor) -> bool:
    return (expected.dtype == actual.dtype and expected.shape == actual.shape
            and torch.equal(_as_bits(expected), _as_bits(actual)))


def describe_tensor_difference(expected: torch.Tensor, actual: torch.Tensor) -> str | None:
    """None when bitwise equal, else what differs: dtype, shape, or the first differing index."""
    if expected.dtype != actual.dtype:
        return f"dtype {expected.dtype} expected, got {actual.dtype}"
    if expected.shape != actual.shape:
        return f"shape {tuple(expected.shape)} expected, got {tuple(actual.shape)}"
    differs = _as_bits(expected) != _as_bits(actual)
    if expected.is_complex():
        differs = differs.any(dim=-1)
    if not bool(differs.any()):
        return None
    flat_index = int(differs.flatten().nonzero()[0])
    index = [int(i) for i in torch.unravel_index(torch.tensor(flat_index), expected.shape)] if expected.ndim else []
    expected_value = expected.detach().cpu().flatten()[flat_index].item()
    actual_value = actual.detach().cpu().flatten()[flat_index].item()
    return (f"first difference at index {index} (flat {flat_index}): expected {expected_value!r}, "
            f"got {actual_value!r}; {int(differs.sum())} of {expected.numel()} elements differ")


def _float_bits(value: float) -> bytes:
    return struct.pack("<d", value)


def compare_trees(expected, actual, path: str = "") -> Comparison:
    """Compare two nested structures of dicts, lists, tuples, tensors and plain Python values."""
    result = Comparison()
    _compare(expected, actual, path or "<root>", result)
    return result


def _compare(expected, actual, path: str, result: Comparison) -> None:
    if isinstance(expected, torch.Tensor) or isinstance(actual, torch.Tensor):
        if not (isinstance(expected, torch.Tensor) and isinstance(actual, torch.Tensor)):
            result.mismatches.append(f"{path}: expected {type(expected).__name__}, got {type(actual).__name__}")
            return
        result.checked_tensors += 1
        result.checked_elements += expected.numel()
        difference = describe_tensor_difference(expected, actual)
        if difference is not None:
            result.mismatches.append(f"{path}: {difference}")
        return
    if type(expected) is not type(actual):
        result.mismatches.append(f"{path}: expected {type(expected).__name__} {expected!r:.80}, "
                                 f"got {type(actual).__name__} {actual!r:.80}")
        return
    if isinstance(expected, dict):
        for key in expected:
            if key in actual:
                _compare(expected[key], actual[key], f"{path}[{key!r}]", result)
            else:
                result.mismatches.append(f"{path}[{key!r}]: missing")
        for key in actual:
            if key not in expected:
                result.mismatches.append(f"{path}[{key!r}]: unexpected key")
        return
    if isinstance(expected, (list, tuple)):
        if len(expected) != len(actual):
            result.mismatches.append(f"{path}: length {len(expected)} expected, got {len(actual)}")
            return
        for index, (left, right) in enumerate(zip(expected, actual)):
            _compare(left, right, f"{path}[{index}]", result)
        return
    if isinstance(expected, float):
        if _float_bits(expected) != _float_bits(actual):
            hint = " (NaN)" if math.isnan(expected) else ""
            result.mismatches.append(f"{path}: expected {expected!r}{hint}, got {actual!r}")
        return
    if expected != actual:
        result.mismatches.append(f"{path}: expected {expected!r}, got {actual!r}")
