"""Invariant 4, preload: the cache gives back the items, typed as default_collate types them.

Items are drawn field by field: tensors (uint8, int64, float32, float64, bfloat16, bool;
fixed shapes of 0 to 3 dimensions, or sizes that vary from item to item in any dimension,
empty ones included), Python ints, floats and bools, numpy scalars; one field alone, or a
tuple or list of fields; special floats (nan, inf, -0.0, subnormals, 0.1, 2**24 + 1) and
int64's extremes. Either as the data set's items, or built by ``transform`` from an index.

The reference is torch's own ``default_collate``: ``cache[i]``'s field j must equal
``default_collate([transform(dataset[i])[j]])[0]`` bit for bit, with its dtype and shape.
A ``distributed.loader`` over the cache (0, 1 or 2 workers) must give the batches the same
loader gives over the data set itself with ``default_collate`` for fixed-shape fields and
lists for fields whose sizes vary; a plain ``DataLoader`` over the cache must give the
data set's batches or refuse with an error naming ``distributed.loader``; a ``collate_fn``
that changes its input in place must not change the cache. A data set preload cannot
store (a dict or a string field, items that disagree in fields, dtypes or dimensions)
raises a TypeError/ValueError naming the item or field, and leaves no file behind.
"""

from __future__ import annotations

import tempfile
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import deep
from hypothesis import given
from hypothesis import strategies as st
from inv_budget import prop
from torch.utils.data import DataLoader, default_collate

import loopkit
from loopkit import distributed

Spec = dict[str, Any]
TENSOR_DTYPES = ["uint8", "int64", "float32", "float64", "bfloat16", "bool"]
NUMPY_SCALARS = ["float32", "float64", "int64", "int16", "uint8", "bool_"]
SPECIAL = [float("nan"), float("inf"), -float("inf"), -0.0, 1e-310, 0.1, 2.0**24 + 1, 1 / 3]


@st.composite
def fields(draw: Any) -> Spec:
    kind = draw(st.sampled_from(["tensor", "tensor", "tensor", "int", "float", "bool", "numpy"]))
    if kind == "tensor":
        ndim = draw(st.integers(0, 3))
        varying = [draw(st.booleans()) for _ in range(ndim)] if draw(st.booleans()) else []
        return {
            "kind": kind,
            "dtype": draw(st.sampled_from(TENSOR_DTYPES)),
            "shape": [draw(st.integers(0 if draw(st.booleans()) else 1, 3)) for _ in range(ndim)],
            "vary": varying if any(varying) else [],
        }
    if kind == "numpy":
        return {"kind": kind, "dtype": draw(st.sampled_from(NUMPY_SCALARS))}
    return {"kind": kind}


@st.composite
def datasets(draw: Any) -> Spec:
    n_fields = draw(st.integers(1, 4))
    container = draw(st.sampled_from(["single", "tuple", "list"])) if n_fields == 1 else None
    return {
        "fields": [draw(fields()) for _ in range(n_fields)],
        "container": container or draw(st.sampled_from(["tuple", "list"])),
        "length": draw(st.integers(1, 12)),
        "seed": draw(st.integers(0, 1000)),
        "via_transform": draw(st.booleans()),
        "batch_size": draw(st.integers(1, 5)),
        "shuffle": draw(st.booleans()),
        "drop_last": draw(st.booleans()),
        "workers": draw(st.sampled_from([0, 0, 0, 1, 2])),
        "collate_in_place": draw(st.booleans()),
    }


def _value(f: Spec, rng: np.random.Generator) -> Any:
    """One field of one item, as the data set returns it."""
    kind = f["kind"]
    special = rng.random() < 0.3
    if kind == "int":
        return (
            int(rng.choice([0, -1, 2**63 - 1, -(2**63)])) if special else int(rng.integers(-50, 50))
        )
    if kind == "float":
        return float(rng.choice(SPECIAL)) if special else float(rng.normal())
    if kind == "bool":
        return bool(rng.random() < 0.5)
    if kind == "numpy":
        if f["dtype"] == "bool_":
            return np.bool_(rng.random() < 0.5)
        return getattr(np, f["dtype"])(
            rng.normal() * 50 if "float" in f["dtype"] else rng.integers(0, 100)
        )
    shape = [int(rng.integers(0, 4)) if i < len(f["vary"]) and f["vary"][i] else s
             for i, s in enumerate(f["shape"])]  # fmt: skip
    dtype = getattr(torch, f["dtype"])
    if dtype == torch.bool:
        return torch.from_numpy(np.asarray(rng.random(shape) < 0.5))
    if dtype == torch.uint8:
        return torch.from_numpy(np.asarray(rng.integers(0, 256, shape, dtype=np.uint8)))
    if dtype == torch.int64:
        ints = rng.integers(-(2**63), 2**63 - 1, shape, dtype=np.int64, endpoint=True)
        return torch.from_numpy(np.asarray(ints))
    values = np.asarray(rng.normal(size=shape))
    if special and values.size:
        values.flat[0] = rng.choice(SPECIAL)
    return torch.from_numpy(values).to(dtype)


def make_item(spec: Spec, i: int) -> Any:
    rng = np.random.default_rng(spec["seed"] * 1000 + i)
    parts = [_value(f, rng) for f in spec["fields"]]
    if spec["container"] == "single":
        return parts[0]
    return tuple(parts) if spec["container"] == "tuple" else list(parts)


class Items(torch.utils.data.Dataset[Any]):
    """The data set: item i built from its index (or the index itself, for ``transform``)."""

    def __init__(self, spec: Spec, raw: bool = False) -> None:
        self.spec, self.raw = spec, raw

    def __len__(self) -> int:
        return int(self.spec["length"])

    def __getitem__(self, i: int) -> Any:
        return i if self.raw else make_item(self.spec, i)


class Transform:
    """A named transform: item i from its index (preload's key names it)."""

    def __init__(self, spec: Spec) -> None:
        self.spec = spec

    def __call__(self, i: int) -> Any:
        return make_item(self.spec, i)


def fields_of(item: Any, spec: Spec) -> list[Any]:
    return [item] if spec["container"] == "single" else list(item)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and bits (nan and -0.0 included)."""
    if not isinstance(a, torch.Tensor) or a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype == torch.bool:
        return bool(torch.equal(a, b))
    flat = (a.contiguous().reshape(-1), b.contiguous().reshape(-1))
    return bool(torch.equal(flat[0].view(torch.uint8), flat[1].view(torch.uint8)))


def varies(spec: Spec, j: int) -> bool:
    """Whether field j's sizes differ between the data set's items (so batches list it)."""
    shapes = {tuple(default_collate([fields_of(make_item(spec, i), spec)[j]])[0].shape)
              for i in range(spec["length"])}  # fmt: skip
    return len(shapes) > 1


def reference_collate(spec: Spec) -> Any:
    """The batches of the data set without preload: stacked fields, lists where sizes vary."""
    ragged = [varies(spec, j) for j in range(len(spec["fields"]))]

    def collate(items: list[Any]) -> Any:
        columns = list(zip(*[fields_of(it, spec) for it in items], strict=True))
        out = [
            [default_collate([v])[0] for v in col] if ragged[j] else default_collate(list(col))
            for j, col in enumerate(columns)
        ]
        return out[0] if spec["container"] == "single" else tuple(out)

    return collate


def flatten(batch: Any, spec: Spec) -> list[torch.Tensor]:
    parts = [batch] if spec["container"] == "single" else list(batch)
    return [t for p in parts for t in (p if isinstance(p, list) else [p])]


def _build(spec: Spec, root: Path) -> loopkit.Preloaded:
    if spec["via_transform"]:
        return loopkit.preload(Items(spec, raw=True), root, transform=Transform(spec))
    return loopkit.preload(Items(spec), root)


def _loader_batches(dataset: Any, spec: Spec, collate: Any) -> list[list[torch.Tensor]]:
    loader = distributed.loader(
        dataset, batch_size=spec["batch_size"], shuffle=spec["shuffle"], seed=spec["seed"],
        drop_last=spec["drop_last"], num_workers=spec["workers"], collate_fn=collate,
        persistent_workers=False, timeout=60 if spec["workers"] else 0,
    )  # fmt: skip
    return [flatten(b, spec) for b in loader]


@deep
@prop(ci=80, shrink=False)  # a failing build is described by its spec: report it unshrunk
@given(datasets())
def test_the_cache_equals_the_data_set_and_its_batches(spec: Spec) -> None:
    """cache[i] == default_collate's typing of item i; loader batches == the uncached pipeline's."""
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cache = _build(spec, Path(tmp))
        assert len(cache) == spec["length"]
        expected = [
            [default_collate([f])[0] for f in fields_of(make_item(spec, i), spec)]
            for i in range(spec["length"])
        ]
        for i in range(spec["length"]):
            got = fields_of(cache[i], spec)
            assert len(got) == len(expected[i]), f"item {i}: {len(got)} fields"
            for j, (g, e) in enumerate(zip(got, expected[i], strict=True)):
                said = f"item {i} field {j}: {g!r} ({getattr(g, 'dtype', '')})"
                assert same(g, e), f"{said}, expected {e!r} ({e.dtype})"
        ref = _loader_batches(Items(spec), spec, reference_collate(spec))

        def in_place(batch: Any) -> Any:  # a collate_fn that writes into what it receives
            if spec["collate_in_place"]:
                for t in flatten(batch, spec):
                    if t.numel():
                        t.view(-1)[0] = t.view(-1)[-1]
            return batch

        for epoch_batches in (
            _loader_batches(cache, spec, in_place),
            _loader_batches(cache, spec, None),
        ):
            if not spec["collate_in_place"]:
                assert len(epoch_batches) == len(ref)
                for b, (got_b, ref_b) in enumerate(zip(epoch_batches, ref, strict=True)):
                    assert len(got_b) == len(ref_b), f"batch {b}: {len(got_b)} tensors"
                    for t, (g, e) in enumerate(zip(got_b, ref_b, strict=True)):
                        assert same(g, e), f"batch {b} tensor {t}: {g!r}, expected {e!r}"
            spec = {**spec, "collate_in_place": False}  # the second pass must be intact
        for i in range(spec["length"]):  # and the cache as it was built
            for j, (g, e) in enumerate(zip(fields_of(cache[i], spec), expected[i], strict=True)):
                assert same(g, e), f"after the loaders, item {i} field {j} changed: {g!r}"
        _plain_dataloader_agrees(cache, spec)


def _plain_dataloader_agrees(cache: loopkit.Preloaded, spec: Spec) -> None:
    """A plain DataLoader over the cache: the data set's batches, or an error naming the way.

    Where default_collate cannot batch the data set itself (sizes that vary), any error
    will do; where it can, the cache must give the same batches or say to use
    ``distributed.loader``.
    """
    try:
        ref: list[Any] | None = [
            flatten(b, spec) for b in DataLoader(Items(spec), batch_size=spec["batch_size"])
        ]
    except Exception:
        ref = None
    try:
        got = [flatten(b, spec) for b in DataLoader(cache, batch_size=spec["batch_size"])]
    except Exception as err:
        assert ref is None or "distributed.loader" in str(err), (
            f"a plain DataLoader over the cache fails where one over the data set works: {err!r}"
        )
        return
    assert ref is not None, "a plain DataLoader batches the cache but not the data set"
    assert len(got) == len(ref)
    for b, (got_b, ref_b) in enumerate(zip(got, ref, strict=True)):
        assert len(got_b) == len(ref_b) and all(
            same(g, e) for g, e in zip(got_b, ref_b, strict=True)
        ), f"a plain DataLoader's batch {b} differs from the data set's"


CORRUPTIONS = ["dict", "string", "fields", "dtype", "ndim"]


@prop(ci=30, shrink=False)
@given(datasets(), st.sampled_from(CORRUPTIONS), st.integers(0, 11))
def test_an_item_preload_cannot_store_is_refused_leaving_nothing(
    spec: Spec, corruption: str, at: int
) -> None:
    """A TypeError/ValueError naming the item or field; no file left under the cache root."""
    at %= spec["length"]
    first = fields_of(make_item(spec, at), spec)

    class Broken(Items):
        def __getitem__(self, i: int) -> Any:
            if i != at:
                return make_item(self.spec, i)
            if corruption == "dict":
                return {"x": first[0]}
            if corruption == "string":
                return ("text", *first[1:])
            if corruption == "fields":
                return (*first, first[0])
            if corruption == "dtype":  # an int field becomes a float, or a float an int
                f0 = default_collate([first[0]])[0]
                return (
                    f0.to(torch.float32 if not f0.is_floating_point() else torch.int64),
                    *first[1:],
                )
            return (default_collate([first[0]])[0].unsqueeze(0).unsqueeze(0), *first[1:])  # ndim

    spec = {**spec, "container": "tuple", "length": max(spec["length"], 2)}
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        root = Path(tmp) / "cache"
        with pytest.raises((TypeError, ValueError)) as err:
            loopkit.preload(Broken(spec), root)
        said = str(err.value)
        assert "item" in said or "field" in said, said
        left = [p for p in root.rglob("*") if p.is_file()] if root.exists() else []
        assert not left, f"left behind: {left}"
