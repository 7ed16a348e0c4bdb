"""What a preload cache stores of an item: its fields as tensors, and the fingerprint of a data set.

A field keeps what the data set (through ``default_collate``) would give: a Python float
is a float64, an int an int64, a bool a bool, a numpy scalar or array keeps its dtype,
and a tensor keeps its dtype (bfloat16 and the float8 types included) and its shape.
Bytes are hashed and written as they are in memory, never through numpy, so any torch
dtype is stored bit for bit.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

FORMAT = 2
"""The cache layout's version: part of the fingerprint, so a new layout never opens an old cache."""
SAMPLED = 16
"""Items hashed for the fingerprint, spread over the data set."""

# numpy kinds that are no numbers: objects, strings, bytes, records, dates, durations
_NOT_NUMBERS = "OUSVMm"


@dataclasses.dataclass(frozen=True)
class Field:
    """One field of every item: its dtype, its shape (None where sizes vary), its dimensions."""

    dtype: str
    shape: tuple[int, ...] | None
    ndim: int

    @property
    def torch_dtype(self) -> torch.dtype:
        dtype = getattr(torch, self.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"preload: a cache field has the unknown dtype {self.dtype!r}")
        return dtype

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=self.torch_dtype).element_size()


@dataclasses.dataclass(frozen=True)
class Survey:
    """What a spread sample of items says about a data set."""

    fingerprint: str
    fields: list[Field]
    mean_numel: list[float]
    """Mean elements per item of each field in the sample (to estimate a cache's size)."""


def _number(part: bool | int | float | complex, i: int) -> torch.Tensor:
    # default_collate's dtypes: bool, int64, float64 (a Python float is a double)
    if isinstance(part, bool):
        return torch.tensor(part, dtype=torch.bool)
    if isinstance(part, int):
        if not -(2**63) <= part < 2**63:
            raise ValueError(f"preload: field {i} of an item is the int {part}, beyond int64")
        return torch.tensor(part, dtype=torch.int64)
    if isinstance(part, float):
        return torch.tensor(part, dtype=torch.float64)
    return torch.tensor(part, dtype=torch.complex128)


def _array(part: object, i: int) -> torch.Tensor:
    arr = np.asarray(part)
    if arr.dtype.kind in _NOT_NUMBERS:
        raise TypeError(
            f"preload stores numbers; field {i} of an item is a numpy {arr.dtype} array: "
            "make transform return numeric arrays or tensors"
        )
    if not arr.dtype.isnative:  # big-endian data: the same values in this machine's order
        arr = arr.astype(arr.dtype.newbyteorder("="))
    if not arr.flags.c_contiguous:  # (np.ascontiguousarray would make a 0-d array 1-d)
        arr = arr.copy(order="C")
    return packed(torch.from_numpy(arr))


def as_tensors(item: object) -> tuple[tuple[torch.Tensor, ...], bool]:
    """An item's fields as contiguous CPU tensors, and whether it was a single field.

    Tensors, numpy arrays and scalars, array-likes (a PIL image), bools, ints, floats and
    complex numbers are taken, each in the dtype ``default_collate`` would give it.
    """
    single = not isinstance(item, (tuple, list))
    parts = (item,) if single else tuple(item)  # type: ignore[arg-type]  # checked: a sequence
    out = []
    for i, part in enumerate(parts):
        if isinstance(part, torch.Tensor):
            if part.layout != torch.strided or part.is_quantized or part.is_nested:
                raise TypeError(
                    f"preload stores dense tensors; field {i} of an item is a {part.layout} "
                    f"{part.dtype} tensor: make transform return it dense (.to_dense())"
                )
            out.append(packed(part.detach().cpu().resolve_conj().resolve_neg()))
        elif isinstance(part, (bool, int, float, complex)):
            out.append(_number(part, i))
        elif isinstance(part, (np.ndarray, np.generic)) or hasattr(part, "__array_interface__"):
            out.append(_array(part, i))
        else:
            raise TypeError(
                f"preload stores tensors, arrays and numbers; field {i} of an item is a "
                f"{type(part).__name__}: make transform return tensors (e.g. decoded images)"
            )
    return tuple(out), single


def dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def packed(t: torch.Tensor) -> torch.Tensor:
    """``t`` laid out as a new tensor of its shape is: itself if it is, else a copy.

    ``contiguous()`` is not enough: it keeps the strides of a tensor that merely counts as
    contiguous (an empty one, or one whose size-1 dimensions have other strides), such as
    the 0-stride empty arrays numpy's random generator returns or ``expand`` makes, and
    viewing such a tensor's bytes fails.
    """
    strides, step = [], 1
    for size in reversed(t.shape):
        strides.append(step)
        step *= max(size, 1)
    if t.stride() == tuple(reversed(strides)):
        return t
    return t.clone(memory_format=torch.contiguous_format)


def raw_bytes(t: torch.Tensor) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """A tensor's bytes in row-major order (no copy where ``packed``), whatever its dtype."""
    return packed(t).reshape(-1).view(torch.uint8).numpy()


def check_item(i: int, parts: tuple[torch.Tensor, ...], fields: list[Field]) -> None:
    """Raise ValueError saying how item ``i`` differs from the fields the sample showed."""
    if len(parts) != len(fields):
        raise ValueError(f"preload: item {i} has {len(parts)} fields, not {len(fields)}")
    for j, (p, f) in enumerate(zip(parts, fields, strict=True)):
        if dtype_name(p) != f.dtype:
            raise ValueError(f"preload: field {j} of item {i} is {p.dtype}, not torch.{f.dtype}")
        if p.dim() != f.ndim:
            raise ValueError(
                f"preload: field {j} of item {i} has {p.dim()} dimensions, the sampled items "
                f"{f.ndim}: a field's sizes may vary from item to item, its dimensions may not"
            )
        if f.shape is not None and tuple(p.shape) != f.shape:
            raise ValueError(
                f"preload: field {j} of item {i} has shape {tuple(p.shape)}, the sampled "
                f"items {f.shape}: a field whose shape varies must vary in the sample too "
                "(or give it one shape in transform)"
            )


def spread(n: int) -> list[int]:
    """``min(n, SAMPLED)`` indices spread evenly over ``range(n)``, first and last included.

    Every item of a data set of at most ``SAMPLED`` items: the fingerprint hashes them all,
    and a field whose shape varies is seen to vary. (Over more, the picks are those of
    every earlier version, so the caches of such data sets keep their names.)
    """
    k = min(n, SAMPLED)
    return sorted({round(i * (n - 1) / max(k - 1, 1)) for i in range(k)})


def fingerprint(n: int, get: Callable[[int], tuple[torch.Tensor, ...]], key: str) -> Survey:
    """The cache's name-giving hash, and the fields as a spread sample of items shows them."""
    picks = spread(n)
    h = hashlib.sha256(f"loopkit-preload/{FORMAT}/{key}/{n}".encode())
    fields: list[Field] = []
    numel: list[int] = []
    for i in picks:
        parts = get(i)
        if not fields:
            fields = [Field(dtype_name(p), tuple(p.shape), p.dim()) for p in parts]
            numel = [0] * len(parts)
        elif len(parts) != len(fields):
            raise ValueError(f"preload: item {i} has {len(parts)} fields, item 0 {len(fields)}")
        for j, p in enumerate(parts):
            f = fields[j]
            if dtype_name(p) != f.dtype:
                raise ValueError(
                    f"preload: field {j} of item {i} is {p.dtype}, of item 0 torch.{f.dtype}"
                )
            if p.dim() != f.ndim:
                raise ValueError(
                    f"preload: field {j} of item {i} has {p.dim()} dimensions, of item 0 "
                    f"{f.ndim}: a field's sizes may vary from item to item, its dimensions "
                    "may not"
                )
            if f.shape is not None and tuple(p.shape) != f.shape:
                fields[j] = Field(f.dtype, None, f.ndim)  # its sizes vary: stored ragged
            numel[j] += p.numel()
            h.update(f"{i}:{j}:{p.dtype}:{tuple(p.shape)}".encode())
            h.update(raw_bytes(p).data)
    for j, f in enumerate(fields):
        h.update(f"{j}:{f}".encode())
    return Survey(h.hexdigest()[:20], fields, [k / len(picks) for k in numel])
