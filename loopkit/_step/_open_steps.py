"""Micro-steps open right now, to refuse two steps whose backward passes feed each other.

Two micro-steps open at once are fine for two models (a GAN's D and G), not when one's
backward reaches the other's parameters: that optimizer would get gradients from a window
it does not normalize, or lose them at its own boundary.
"""

from __future__ import annotations

import weakref
from typing import Protocol

import torch
from torch import nn

from .._data import _passes


class Owner(Protocol):
    """What a step that opens micro-steps exposes: its model and its optimizer."""

    model: nn.Module
    optimizer: torch.optim.Optimizer


# id(owner) -> a weak reference to it: a plain dict is one store and one pop per micro-step
# (a WeakSet makes and hashes a new weak reference for each). A dead entry (a step collected
# inside a micro-step) is dropped by the next micro-step that finds another one open.
_OPEN: dict[int, weakref.ref[Owner]] = {}
# owner -> (ids of its model's parameters, ids of its optimizer's), computed on first need
_IDS: weakref.WeakKeyDictionary[Owner, tuple[frozenset[int], frozenset[int]]] = (
    weakref.WeakKeyDictionary()
)


def _ids(owner: Owner) -> tuple[frozenset[int], frozenset[int]]:
    found = _IDS.get(owner)
    if found is None:
        params = (p for g in owner.optimizer.param_groups for p in g["params"])
        found = (
            frozenset(id(p) for p in owner.model.parameters()),
            frozenset(id(p) for p in params),
        )
        _IDS[owner] = found
    return found


def open_(owner: Owner) -> None:
    """Record ``owner``'s micro-step as open, refusing an overlap first.

    With no other micro-step open (the usual case) this is one check and one set insert,
    and one more: a micro-step that opens consumes the batch a plain pass over a
    ``distributed.loader`` handed out, which makes that pass count (``_data._passes``).
    """
    if _OPEN:
        mine = _ids(owner)
        for key, ref in list(_OPEN.items()):
            other = ref()
            if other is None:
                del _OPEN[key]
                continue
            if other is owner:
                continue
            theirs = _ids(other)
            if mine[0] & theirs[1] or theirs[0] & mine[1]:
                raise RuntimeError(
                    "another step/accumulate whose model shares parameters with this one is "
                    "inside a micro-step: one model with two optimizers in two steps entered "
                    "together is not supported (one backward would feed both windows). Give "
                    "both parameter groups to one optimizer (per-group lr and weight decay are "
                    "kept), or enter the steps one after the other on separate models"
                )
    if _passes.pending:  # before the micro-step changes anything: a save may wait there
        _passes.consumed()
    _OPEN[id(owner)] = weakref.ref(owner)  # the object's one plain weak reference, reused


def close(owner: Owner) -> None:
    """Record ``owner``'s micro-step as closed."""
    _OPEN.pop(id(owner), None)
