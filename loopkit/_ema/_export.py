"""An average in and out as a whole model's ``state_dict``: ``ema.export()`` and ``ema.adopt()``.

The average holds the trainable parameters only, so its tensors line up with neither
``model.state_dict()`` nor ``model.named_parameters()`` once a parameter is frozen
(``requires_grad=False``), tied (one tensor under two names) or a buffer sits between two
parameters. Both directions go by tensor identity and name instead: every key of the model's
``state_dict`` gets its own tensor (the average for an averaged parameter, the copied buffer
for a buffer, the model's own tensor for a frozen parameter, which the average leaves as it is).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import torch
from torch import nn

from .._parallel._grad_sync import plain_key
from ._tensors import _as_param, _local


class Averaged(Protocol):
    """What is read and set of a ``loopkit.ema`` here."""

    updates: int
    seen: int

    @property
    def _module(self) -> nn.Module: ...
    @property
    def _params(self) -> Sequence[torch.Tensor]: ...
    @property
    def _names(self) -> Sequence[str]: ...
    @property
    def _buffers(self) -> Sequence[torch.Tensor]: ...
    @property
    def _buffer_names(self) -> Sequence[str]: ...
    @property
    def shadow(self) -> Sequence[torch.Tensor]: ...
    @property
    def buffers(self) -> Sequence[torch.Tensor]: ...
    @property
    def every(self) -> int: ...


def export(average: Averaged, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """``ema.export``: the model's ``state_dict`` with the average in it (new tensors)."""
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be None or a torch.dtype (torch.float32), got {dtype!r}")
    shadow = {id(p): s for p, s in zip(average._params, average.shadow, strict=True)}
    copied = {id(b): c for b, c in zip(average._buffers, average.buffers, strict=True)}
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for key, tensor in average._module.state_dict(keep_vars=True).items():
            mine = shadow.get(id(tensor))
            if mine is not None:
                value = _like(tensor, mine).to(tensor.dtype if dtype is None else dtype)
            elif id(tensor) in copied:
                value = _like(tensor, copied[id(tensor)])
            else:  # a frozen parameter (not averaged: the average's model holds it as is)
                value = tensor.detach()
            full = getattr(value, "full_tensor", None)  # FSDP2: gathered (every rank calls)
            out[plain_key(key)] = (full() if callable(full) else value).clone()
    return out


def _like(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` (this rank's part) laid out as ``param``: a DTensor for an FSDP2 tensor."""
    return _as_param(param, local)


def adopt(average: Averaged, state: object, updates: object) -> None:
    """``ema.adopt``: a job's saved average (a model ``state_dict``) as this one's, after
    ``updates`` optimizer updates; checked in full before anything changes."""
    if isinstance(updates, bool) or not isinstance(updates, int) or updates < 0:
        raise ValueError(f"updates must be an int >= 0 (the job's optimizer updates), got "
                         f"{updates!r}")  # fmt: skip
    if not isinstance(state, Mapping) or not all(isinstance(k, str) for k in state):
        raise TypeError(
            "adopt() takes the job's average as a model state_dict (names -> tensors, "
            f"torch.load('ema.pt')), got {type(state).__name__}"
        )
    if any(getattr(p, "device_mesh", None) is not None for p in average._params):
        raise ValueError(
            "adopt() takes a full state_dict, and this average is of an FSDP2 model (each rank "
            "holds shards): build the run unsharded to adopt the job, or restore the average "
            "with torch.distributed.checkpoint (docs/middlewares.md)"
        )
    named = _plain(state)
    params = _picked(named, average._names, average.shadow, "parameter")
    buffers: list[torch.Tensor] = []
    if any(n in named for n in average._buffer_names):  # else the model's own are kept
        buffers = _picked(named, average._buffer_names, average.buffers, "buffer")
    with torch.no_grad():
        for mine, saved in zip(average.shadow, params, strict=True):
            mine.copy_(_local(saved))
        for mine, saved in zip(average.buffers, buffers, strict=False):
            mine.copy_(saved)
    average.seen, average.updates = updates, updates // average.every


def _plain(state: Mapping[str, object]) -> dict[str, object]:
    """A saved state's keys as the average names them: no torch.compile ``_orig_mod.``, no
    DDP ``module.`` (when every key has it)."""
    named = {plain_key(k): v for k, v in state.items()}
    if named and all(k.startswith("module.") for k in named):
        named = {k.removeprefix("module."): v for k, v in named.items()}
    return named


def _picked(
    named: Mapping[str, object], names: Sequence[str], mine: Sequence[torch.Tensor], label: str
) -> list[torch.Tensor]:
    """The saved tensor of each of ``names``, refused unless each is there with its shape."""
    missing = [n for n in names if n not in named]
    if missing:
        raise ValueError(
            f"the saved average has no {label} {missing[0]!r} ({len(missing)} of the "
            f"{len(names)} {label}s the model's average holds are missing): pass the job's "
            "whole model state_dict of its average, saved from this architecture"
        )
    out = []
    for name, t in zip(names, mine, strict=True):
        saved = named[name]
        if not isinstance(saved, torch.Tensor) or tuple(saved.shape) != tuple(t.shape):
            shape = tuple(saved.shape) if isinstance(saved, torch.Tensor) else type(saved).__name__
            raise ValueError(
                f"the saved average's {label} {name!r} is {shape}, the model's is "
                f"{tuple(t.shape)}: pass the average of this architecture"
            )
        out.append(saved)
    return out
