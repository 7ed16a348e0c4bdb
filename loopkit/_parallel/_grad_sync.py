"""no_sync: skip gradient synchronization for the micro-steps inside it.

DDP decides at the *forward* whether the following backward all-reduces, so the forward
must run inside ``no_sync`` too (DDP's own docstring says so; a forward outside it still
synchronizes). FSDP2 has no ``no_sync``: it is ``set_requires_gradient_sync(False)``, and
the previous setting is restored on exit rather than forced back to True.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Sequence
from types import TracebackType
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .. import _ranks
from .._sync_points import expected_sync
from .._types import SyncKind


def _fsdp_types() -> tuple[Any, Any]:
    """``(FSDPModule, FullyShardedDataParallel)``, or None for each not loaded.

    Importing ``torch.distributed.fsdp`` costs about 1.6 s, so loopkit never does it: a model
    can only be an FSDP module if something already imported that package, which
    ``sys.modules`` says exactly, for free.
    """
    fsdp = sys.modules.get("torch.distributed.fsdp")
    if fsdp is None:
        return None, None
    return getattr(fsdp, "FSDPModule", None), getattr(fsdp, "FullyShardedDataParallel", None)


def unwrap(model: nn.Module) -> nn.Module:
    """Peel ``torch.compile`` wrappers; stop at the first DDP/FSDP wrapper or plain module."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"expected an nn.Module, got {type(model).__name__}")
    seen = 0
    while seen < 16:
        if _is_sync_wrapper(model):
            return model
        inner = getattr(model, "_orig_mod", None)  # torch.compile's OptimizedModule
        if isinstance(inner, nn.Module):
            model = inner
            seen += 1
            continue
        return model
    return model


def innermost(model: nn.Module) -> nn.Module:
    """The user's module inside ``torch.compile`` and DDP wrappers, in any order and number
    (FSDP, which holds shards, is not peeled)."""
    for _ in range(16):
        inner = unwrap(model)
        if isinstance(inner, DistributedDataParallel):
            inner = inner.module
        if inner is model:
            return model
        model = inner
    return model


def plain_key(key: str) -> str:
    """A state-dict key without ``torch.compile``'s ``_orig_mod`` levels (a compiled block)."""
    return (
        key if "_orig_mod" not in key else ".".join(p for p in key.split(".") if p != "_orig_mod")
    )


def _is_sync_wrapper(m: nn.Module) -> bool:
    fsdp2, fsdp1 = _fsdp_types()
    return (
        isinstance(m, DistributedDataParallel)
        or (fsdp1 is not None and isinstance(m, fsdp1))
        or (fsdp2 is not None and isinstance(m, fsdp2))
    )


def sync_kind(model: nn.Module) -> SyncKind:
    """``"ddp"``, ``"fsdp1"``, ``"fsdp2"`` or ``"none"`` for what synchronizes ``model``."""
    m = unwrap(model)
    if isinstance(m, DistributedDataParallel):
        return "ddp"
    fsdp2, fsdp1 = _fsdp_types()
    if fsdp1 is not None and isinstance(m, fsdp1):
        return "fsdp1"
    if fsdp2 is not None and isinstance(m, fsdp2):
        return "fsdp2"
    if fsdp2 is not None and any(isinstance(c, fsdp2) for c in m.modules()):
        return "fsdp2"
    return "none"


def reshard(model: nn.Module) -> None:
    """Register each FSDP2 module's shards again where a forward left them gathered.

    A module that does not reshard after its forward (the root by default, a block given
    ``reshard_after_forward=False``) keeps its whole parameters registered after a forward no
    backward follows (an evaluation, a no-grad pass) until its next forward or backward:
    what reads ``named_parameters()`` then (the ema's swap) must see the shards. Local, no
    collective; a no-op on a model already sharded or not FSDP2's.
    """
    fsdp2 = _fsdp_types()[0]
    if fsdp2 is None:
        return
    for m in unwrap(model).modules():
        if isinstance(m, fsdp2):
            m.reshard()


class no_sync(contextlib.ContextDecorator):
    """Suppress gradient synchronization for the forward *and* backward inside it.

    Works on DDP, FSDP1 and FSDP2 models (also under ``torch.compile``); a plain module
    needs no synchronization, so there it does nothing and costs nothing. With
    ``enabled=False`` it is a no-op, so ``no_sync(model, enabled=not last)`` reads like
    nanoGPT's toggle.
    """

    __slots__ = ("_fsdp2", "_kind", "_saved", "enabled", "model")

    def __init__(self, model: nn.Module, enabled: bool = True) -> None:
        if not isinstance(enabled, bool):
            raise TypeError(f"enabled must be True or False, got {enabled!r}")
        self.model = unwrap(model)
        self._kind = sync_kind(model)
        self.enabled = enabled
        self._fsdp2: list[Any] = []
        if self._kind == "fsdp2":
            root = self.model
            fsdp2 = _fsdp_types()[0]
            self._fsdp2 = [m for m in root.modules() if isinstance(m, fsdp2)]
        self._saved: list[Any] = []

    def __enter__(self) -> no_sync:
        kind = self._kind
        if not self.enabled or kind == "none":
            self._saved.append(None)
        elif kind == "ddp":
            ddp: Any = self.model
            self._saved.append(ddp.require_backward_grad_sync)
            ddp.require_backward_grad_sync = False
        elif kind == "fsdp1":
            cm = self.model.no_sync()  # type: ignore[operator]  # unwrap() is typed nn.Module
            cm.__enter__()
            self._saved.append(cm)
        else:
            previous = [_fsdp2_requires_sync(m) for m in self._fsdp2]
            for m in self._fsdp2:
                m.set_requires_gradient_sync(False, recurse=False)
            self._saved.append(previous)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        saved = self._saved.pop()
        if saved is None:
            return
        kind = self._kind
        if kind == "ddp":
            self.model.require_backward_grad_sync = saved
        elif kind == "fsdp1":
            saved.__exit__(exc_type, exc, tb)
        else:
            for m, prev in zip(self._fsdp2, saved, strict=True):
                m.set_requires_gradient_sync(prev, recurse=False)


def _fsdp2_requires_sync(module: Any) -> bool:
    # FSDP2 has a setter but no getter; its param groups hold the flag.
    groups = getattr(module._get_fsdp_state(), "_fsdp_param_groups", None) or []
    return all(g.reduce_grads for g in groups) if groups else True


def divides_first(ddp: Any) -> bool:
    """Whether DDP divides a bucket by the world size before reducing it: only with no comm hook.

    DDP's reducer multiplies each gradient by ``1 / world`` as it copies it into its bucket
    when no hook is registered, then all-reduces by sum; any registered hook, a Python one
    (``register_comm_hook``: ``allreduce_hook``, the fp16/bf16 compression hooks, PowerSGD)
    or a built-in C++ one (``_register_builtin_comm_hook``: ALLREDUCE, FP16_COMPRESS), gets
    the undivided bucket and averages by itself. Built-in hooks leave no trace in
    ``_comm_hooks``; DDP's logger records the name of every registered hook.
    """
    if getattr(ddp, "_comm_hooks", None):
        return False
    if getattr(ddp, "logger", None) is None:
        return True
    return "comm_hook" not in ddp._get_ddp_logging_data()


def sync_grads_now(model: nn.Module, extras: Sequence[float] = ()) -> list[float]:
    """All-reduce (average) the local gradients of a DDP model through DDP's own buckets.

    Used when a window's gradients are still local at its end: a ragged window closed by
    ``flush()``, a final micro-step without backward, a micro-step with several backward
    passes. Each of DDP's buckets is filled with the gradients (zeros where a parameter has
    none) and sent through the model's comm hook, exactly as DDP's backward would: divided
    by the world size first only when DDP itself would (no hook), and through any hook,
    Python or built-in (fp16 compression applies too). Gradients are aligned by parameter:
    ranks whose forwards used different parameters (``find_unused_parameters=True``) send
    zeros plus a presence count; as with DDP, a parameter used on any rank gets the average
    over all ranks, one used on none keeps ``grad is None``. ``extras`` (numbers every rank
    sends) come back summed over the ranks with the presence counts, in one more collective.
    """
    m: Any = unwrap(model)
    group = getattr(m, "process_group", None)
    buckets = m.reducer._get_zeros_like_grad_buckets()  # DDP's layout, in DDP's order
    params = [p for b in buckets for p in b.parameters()]
    present = [float(p.grad is not None) for p in params]
    device = params[0].device if params else torch.device("cpu")
    meta = torch.tensor(present + list(extras), dtype=torch.float64, device=device)
    scale = 1.0 / _ranks.world(group)[1] if divides_first(m) else None
    # The bookkeeping goes first, then one bucket at a time: a hook that chains collectives
    # in its callbacks (PowerSGD) then issues them in the same order on every rank.
    _ranks.sum_(meta, group)
    # Host-device sync: which parameters got a gradient anywhere decides whether their
    # .grad exists, a host-side fact (only in this rare by-hand path).
    with expected_sync("the by-hand reduction's presence counts"):
        reduced = meta.tolist()
    used = iter(reduced[: len(present)])
    with torch.no_grad():
        for bucket in buckets:
            for p, view in zip(bucket.parameters(), bucket.gradients(), strict=True):
                if p.grad is not None:
                    view.copy_(p.grad.reshape(view.shape))
            if scale is not None:
                # As DDP's reducer does (a multiplication by 1 / world, not a division), so
                # the result is DDP's to the bit.
                bucket.buffer().mul_(scale)
            work = m.reducer._run_comm_hook(bucket)
            work.wait()
            result = work.value()
            if isinstance(result, list):  # DDP's built-in all-reduce gives [tensor]
                result = result[0]
            buffer = bucket.buffer()
            if result is not buffer:  # a hook may return a new tensor (fp16 compression)
                buffer.copy_(result)
            for p, view in zip(bucket.parameters(), bucket.gradients(), strict=True):
                anywhere = next(used) > 0
                if p.grad is not None:
                    p.grad.copy_(view.reshape(p.grad.shape))
                elif anywhere:
                    p.grad = view.reshape(p.shape).clone()
    if getattr(m, "find_unused_parameters", False):
        # DDP's reducer remembers which parameters this rank used in its no_sync steps and
        # would treat them as used in the next synced backward, although their gradients
        # were just reduced here and are cleared before that window: forget them.
        m.reducer._reset_state()
    # After a synced iteration DDP broadcasts rank 0's buffers (BatchNorm's running
    # statistics) at the next forward; a window reduced here counts as one, so the next
    # forward does it too (a model whose windows are all reduced by hand would never).
    m.require_forward_param_sync = True
    return reduced[len(present) :]
