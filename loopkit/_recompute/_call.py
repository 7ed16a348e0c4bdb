"""One call of checkpointed code: run plainly, or under checkpoint() with its buffers guarded.

Always ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``: the reentrant
variant breaks under DDP ("Expected to mark a variable ready only once") and ignores
inputs that do not require grad. Non-reentrant checkpointing re-enters the autocast state
captured at the forward, so the recompute matches the forward under ``autocast_step``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ._buffer_guard import BufferSnapshot, StandIns
from ._policy import RecomputeConfig
from ._refusals import passes_kv_cache, refuse_kv_cache

Fn = Callable[..., object]


class _Depth(threading.local):
    """How many checkpointed regions this thread is inside."""

    value = 0


_depth = _Depth()


def _backward_owners(
    fn: Fn, args: tuple[object, ...], kwargs: dict[str, object], module: nn.Module | None
) -> list[nn.Module] | None:
    """The modules whose buffers a call may update; None when no backward can follow.

    A call that can be followed by a backward and passes a KV cache is refused.
    """
    owners: list[nn.Module] = [] if module is None else [module]
    grad = False
    cache: str | None = None  # the argument that passes a KV cache
    arguments: list[tuple[int | str, object]] = [*enumerate(args), *kwargs.items()]
    for where, value in arguments:
        if isinstance(value, torch.Tensor):
            grad = grad or value.requires_grad
        elif isinstance(value, nn.Module):
            owners.append(value)  # `self` of a decorated forward, or a module argument
        elif isinstance(value, (list, tuple)):
            grad = grad or any(isinstance(v, torch.Tensor) and v.requires_grad for v in value)
        elif passes_kv_cache(where, value):
            label = f"positional argument {where}" if isinstance(where, int) else f"{where}="
            cache = f"{label} ({type(value).__name__})"
    # A module's own parameters make a backward happen even for inputs without grad.
    if not (grad or any(p.requires_grad for m in owners for p in m.parameters())):
        return None
    refuse_kv_cache(fn, owners, cache, kwargs.get("use_cache"))
    return owners


def _checkpoint(body: Fn, config: RecomputeConfig, args: tuple[object, ...]) -> object:
    """``checkpoint(body, *args)`` with ``config``'s options."""
    rng = config.preserve_rng_state
    if config.context_fn is None:
        # No context_fn at all: torch.compile takes any one passed as a selective policy.
        return checkpoint(body, *args, use_reentrant=False, preserve_rng_state=rng)
    return checkpoint(
        body, *args, use_reentrant=False, preserve_rng_state=rng, context_fn=config.context_fn
    )


def run_checkpointed(
    fn: Fn,
    config: RecomputeConfig,
    args: tuple[object, ...],
    kwargs: dict[str, object],
    module: nn.Module | None = None,
) -> object:
    """``fn(*args, **kwargs)``, checkpointed when a backward can follow (``module``: its owner)."""
    if torch.compiler.is_compiling():
        return _run_traced(fn, config, args, kwargs, module)
    # Nested checkpointed code (a checkpointed block inside a checkpointed model) runs
    # plainly: the outer recompute already covers it, a second one would double the cost.
    if _depth.value > 0 or not torch.is_grad_enabled() or torch.is_inference_mode_enabled():
        return fn(*args, **kwargs)
    owners = _backward_owners(fn, args, kwargs, module)
    if owners is None:
        return fn(*args, **kwargs)
    snapshot = BufferSnapshot.take(owners)
    stand_ins: StandIns | None = None  # set once the forward is done
    calls = 0

    def inner(*a: object) -> object:
        # Runs at the forward and again at each recompute (possibly on an autograd thread).
        nonlocal calls
        calls += 1
        _depth.value += 1
        try:
            if calls > 1 and stand_ins is not None:
                return stand_ins.run(fn, a, kwargs)
            return fn(*a, **kwargs)
        finally:
            _depth.value -= 1

    # User kwargs travel in the closure, not through checkpoint(**kwargs), where names such
    # as `debug` or `context_fn` would be taken as checkpoint's own options.
    out = _checkpoint(inner, config, args)
    if snapshot is not None:
        # None when the forward updated no buffer: the recompute then needs nothing.
        stand_ins = snapshot.stand_ins(fresh=config.context_fn is None)
    return out


def _run_traced(
    fn: Fn,
    config: RecomputeConfig,
    args: tuple[object, ...],
    kwargs: dict[str, object],
    module: nn.Module | None,
) -> object:
    """The checkpoint as torch.compile traces it: one region whose recompute the compiler
    plans, applying the region's buffer updates once. Kept free of what dynamo cannot
    trace (thread-locals, inference-mode queries, state changed inside the region)."""
    if not torch.is_grad_enabled():
        return fn(*args, **kwargs)
    owners = _backward_owners(fn, args, kwargs, module)
    if owners is None:
        return fn(*args, **kwargs)
    stand_ins: StandIns | None = None
    calls = 0

    def body(*a: object) -> object:
        nonlocal stand_ins, calls
        if torch.compiler.is_compiling():
            return fn(*a, **kwargs)
        # torch.compile could not trace the region (a graph break inside it) and runs this
        # checkpoint eagerly: the recompute would update the buffers again, so guard them
        # as in eager mode, from inside the region since the code around it was traced.
        # (A selective policy's op log then sees the guard's copies: one that saves
        # aten.clone outputs would misplace them.)
        calls += 1
        if calls > 1:
            return fn(*a, **kwargs) if stand_ins is None else stand_ins.run(fn, a, kwargs)
        snapshot = BufferSnapshot.take(owners)
        out = fn(*a, **kwargs)
        if snapshot is not None:
            stand_ins = snapshot.stand_ins(fresh=config.context_fn is None)
        return out

    return _checkpoint(body, config, args)
