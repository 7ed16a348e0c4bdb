"""A checkpoint of whole tensors (written by one process or by DDP) resumed by a sharded run
(FSDP2, HSDP): each rank takes its own part of each tensor the run holds sharded.

The file is mapped rather than read (``mapped``): a rank touches only the pages of its
parts (and the small tensors), not every rank the whole model. Where the run holds a
DTensor (a parameter, an optimizer's moment, an EMA's average) and the file a tensor of
its global shape, the file's tensor is cut to this rank's part (``cut``): the part a
sharded save would have written for this rank, so the resume is the one a run of the
saving shape would make, bit for bit. Any other tensor is copied out of the mapping. A
tensor of another shape is left whole, for the pieces' checks to refuse with the shapes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from ._sharded import _at, _dtensor_type, _leaves


@contextlib.contextmanager
def mapped() -> Iterator[None]:
    """``torch.load`` maps the file's tensors instead of reading them (torch's own setting,
    put back on exit; a torch without it reads them)."""
    try:
        from torch.utils.serialization import config
    except ImportError:  # torch < 2.5
        yield
        return
    load: Any = config.load
    before = load.mmap
    load.mmap = True
    try:
        yield
    finally:
        load.mmap = before


def holds_tensors(state: object) -> bool:
    """Whether ``state`` holds a tensor anywhere."""
    return any(isinstance(v, torch.Tensor) for _, v in _leaves(state, ()))


def cut(saved: object, live: object) -> object:
    """``saved`` with each tensor whose place in ``live`` (the run's state) holds a DTensor of
    the same global shape replaced by a DTensor laid out as that one, holding this rank's
    part; every other tensor copied (out of the file's mapping). Sends nothing to any rank."""
    kind: Any = _dtensor_type()

    def walk(node: object, path: tuple[object, ...]) -> object:
        if isinstance(node, torch.Tensor):
            here: Any
            try:
                here = _at(live, path)
            except (KeyError, IndexError):
                here = None
            if kind is not None and isinstance(here, kind) and here.shape == node.shape:
                return _part(node, here)
            return node.clone()
        if isinstance(node, dict):
            return {k: walk(v, (*path, k)) for k, v in node.items()}
        if isinstance(node, (list, tuple)):
            out = [walk(v, (*path, i)) for i, v in enumerate(node)]
            return out if isinstance(node, list) else tuple(out)
        return node

    return walk(saved, ())


def _part(whole: torch.Tensor, like: Any) -> torch.Tensor:
    """This rank's part of ``whole``, a DTensor on ``like``'s mesh and placements."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh, placements = like.device_mesh, like.placements
    shape, offset = compute_local_shape_and_global_offset(whole.shape, mesh, placements)
    rows = tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))
    local = torch.empty(shape, dtype=whole.dtype, device=like.device)
    local.copy_(whole[rows])  # only this part's pages of the file are read
    return DTensor.from_local(local, mesh, placements, run_check=False,
                              shape=like.shape, stride=like.stride())  # fmt: skip
