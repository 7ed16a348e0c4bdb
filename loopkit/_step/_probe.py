"""probe_micro_batch: the largest micro-batch whose worst case fits, agreed by every rank.

Each trial runs the worst case (the given batch cut to the size tried: forward, backward and
an optimizer step, so the optimizer's state counts) without gradient sync, and is taken
back (``_take_back``: weights, optimizer state, RNGs, gradients, DDP's and FSDP2's state).
Only an out-of-memory error, as ``accelerate.utils.memory`` recognizes it on every backend,
means "too big".

Two searches: ``"halving"`` (any device: the whole batch, then half, ... until one fits)
and ``"two_peaks"`` (CUDA only: the peak memory of two sizes that fit, extrapolated to the
device's capacity, then confirmed by a trial; fewer out-of-memory errors on a large batch).
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from typing import Any, Literal

import torch
from torch import nn

from .. import _ranks
from .._checks import is_int_at_least
from .._devices import model_device
from .._parallel._grad_sync import no_sync
from . import _misuse
from ._batch_layout import read, take
from ._take_back import Saved

Search = Literal["halving", "two_peaks"]
LossFn = Callable[[nn.Module, Any], torch.Tensor]
CAPACITY_SHARE = 0.9
"""The share of the device's memory the two-peak extrapolation aims at (fragmentation room)."""


def probe_micro_batch(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: LossFn,
    batch: Any,
    *,
    smallest: int = 1,
    search: Search = "halving",
) -> int:
    """The largest micro-batch whose forward, backward and optimizer step run without an
    out-of-memory error; agreed across ranks (the minimum).

    ``loss_fn(model, batch)`` returns the batch's mean loss. Every trial is taken back: the
    weights, the optimizer's state, the RNGs, the gradients (as they were) and what DDP and
    FSDP2 keep between backwards (a sharded model's unreduced gradients). Only an
    out-of-memory error (as ``accelerate.utils.memory`` recognizes on every backend) means
    "too big"; any other exception propagates unchanged. ``search="two_peaks"`` (CUDA):
    extrapolate from the peak memory of two sizes instead of halving from the batch.
    ``smallest``: the smallest size tried; if none of at least that size fits, RuntimeError.
    """
    # accelerate's cross-backend out-of-memory test and cache release (CUDA, XPU, NPU, MPS).
    memory: Any = importlib.import_module("accelerate.utils.memory")

    layout = read(batch)
    size = 0 if layout is None else layout.size
    if layout is None or size < 1:
        raise ValueError("probe_micro_batch needs a batch with a leading batch dimension")
    if not is_int_at_least(smallest, 1) or smallest > size:
        raise ValueError(f"smallest must be an int in 1..{size}, got {smallest!r}")
    if search not in ("halving", "two_peaks"):
        raise ValueError(f"search must be 'halving' or 'two_peaks', got {search!r}")
    device = model_device(model) or torch.device("cpu")
    if search == "two_peaks" and device.type != "cuda":
        raise ValueError(
            f"search='two_peaks' measures peak memory with torch.cuda, but the model is on "
            f"{device}: use search='halving' (any device)"
        )
    saved = Saved(model, optimizer)

    def fits(m: int) -> bool:
        """Whether a trial of ``m`` samples runs (taken back either way)."""
        failed = True
        try:
            _trial(model, optimizer, loss_fn, take(batch, 0, m, layout))
            failed = False
        except Exception as err:
            if not memory.should_reduce_batch_size(err):
                raise
        finally:
            saved.restore(failed)  # a trial cut short: FSDP2's iteration state reset too
        if failed:
            memory.clear_device_cache(garbage_collection=True)
            return False
        return True

    try:
        if search == "halving":
            found = _halving(fits, size, smallest)
        else:
            found = _two_peaks(fits, size, smallest, device)
    finally:
        saved.restore()
    # The smallest over the ranks (one all-reduce; every rank calls it, OOM or not).
    agreed = int(-_ranks.max_values([-float(found)])[0])
    if agreed < smallest:
        raise RuntimeError(
            f"no micro-batch of {smallest} or more samples fits (on at least one rank): "
            "lower the memory (precision='bf16', loopkit.checkpointed(...)) or the model"
        )
    return agreed


def _halving(fits: Callable[[int], bool], size: int, smallest: int) -> int:
    """The first of size, size/2, size/4, ... that fits (0 if none down to ``smallest``)."""
    m = size
    while m >= smallest:
        if fits(m):
            return m
        m //= 2
    return 0


def _two_peaks(fits: Callable[[int], bool], size: int, smallest: int, device: torch.device) -> int:
    """The whole batch if it fits; else the size the peaks of two smaller ones extrapolate
    to (a straight line: peak = fixed + per_sample * m), confirmed by a trial and shrunk
    by 10% per out-of-memory error, never below the larger measured size."""
    if fits(size):
        return size
    capacity = CAPACITY_SHARE * capacity_bytes(device)
    a = max(smallest, size // 8)
    while a >= smallest:
        peak_a = peak_bytes(fits, a, device)
        if peak_a is None:
            a //= 2
            continue
        b = min(size - 1, 2 * a)
        peak_b = peak_bytes(fits, b, device) if b > a else None
        if peak_b is None:
            return a  # twice a does not fit (or is the batch): no second point to go on
        m = extrapolate(a, peak_a, b, peak_b, capacity, size - 1)
        while m > b:
            if fits(m):
                return m
            m = max(b, math.floor(m * 0.9))
        return b
    return 0


def extrapolate(a: int, peak_a: float, b: int, peak_b: float, capacity: float, upper: int) -> int:
    """The largest size whose straight-line peak (through ``(a, peak_a)``, ``(b, peak_b)``)
    stays within ``capacity``, clamped to ``b..upper``."""
    per_sample = (peak_b - peak_a) / (b - a)
    if per_sample <= 0:
        return upper  # memory does not grow with the batch here: the rest is the limit
    fixed = peak_a - per_sample * a
    return max(b, min(upper, math.floor((capacity - fixed) / per_sample)))


def peak_bytes(fits: Callable[[int], bool], m: int, device: torch.device) -> float | None:
    """The peak memory allocated during a trial of ``m`` samples (None: it did not fit)."""
    torch.cuda.synchronize(device)  # host sync: the peak counter is read after the trial
    torch.cuda.reset_peak_memory_stats(device)
    if not fits(m):
        return None
    torch.cuda.synchronize(device)
    return float(torch.cuda.max_memory_allocated(device))


def capacity_bytes(device: torch.device) -> float:
    """The device's memory that this process can fill: what is free plus what it holds."""
    free, _ = torch.cuda.mem_get_info(device)
    return float(free + torch.cuda.memory_allocated(device))


def _trial(model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: LossFn, batch: Any) -> None:
    """Forward, backward and an optimizer step, with no gradient sync to other ranks."""
    _misuse.STEPPING.add(id(optimizer))  # a step that owns it lets this one through
    try:
        with no_sync(model):
            loss: Any = loss_fn(model, batch)
            loss.backward()
        optimizer.step()
    finally:
        _misuse.STEPPING.discard(id(optimizer))
