"""checkpointed: activation checkpointing as a decorator, or applied to modules in place.

Always ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``: the reentrant
variant breaks under DDP ("Expected to mark a variable ready only once") and ignores
inputs that do not require grad. Non-reentrant checkpointing re-enters the autocast state
captured at the forward, so the recompute matches the forward under ``autocast_step``.

Applied to a module, the module's class is swapped for a cached subclass whose
``forward`` runs under checkpoint: parameter names, ``state_dict`` keys, ``deepcopy``
(an EMA copy stays checkpointed) and ``isinstance`` are all unchanged.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterable
from typing import Any, Literal, TypeAlias, TypeVar, overload

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from ._core import is_int_at_least

F = TypeVar("F", bound=Callable[..., Any])
M = TypeVar("M", bound=nn.Module)

PolicyFn: TypeAlias = Callable[..., "CheckpointPolicy | bool"]
Policy: TypeAlias = "Literal['full', 'save_matmuls'] | PolicyFn | Iterable[Any]"
Blocks: TypeAlias = "type[nn.Module] | tuple[type[nn.Module], ...] | Callable[[nn.Module], bool]"

_aten = torch.ops.aten
# Outputs worth keeping: expensive to recompute, and what backward of the matmul-like ops
# reads anyway. Everything else (pointwise, norms, activations) is cheap to recompute.
SAVE_MATMULS_OPS: frozenset[Any] = frozenset(
    getattr(_aten, name)
    for name in (
        "mm",
        "addmm",
        "bmm",
        "baddbmm",
        "convolution",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_flash_attention_forward",
        "_efficient_attention_forward",
    )
    if hasattr(_aten, name)
)


def _save_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    if getattr(op, "overloadpacket", op) in SAVE_MATMULS_OPS:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


_PRESETS = ("full", "save_matmuls")

_state = threading.local()  # .depth > 0 while inside a checkpointed region on this thread


class _Config:
    """What a checkpointed callable runs with; compared to tell re-application apart."""

    __slots__ = ("context_fn", "policy", "preserve_rng_state")

    def __init__(self, policy: Policy, preserve_rng_state: bool) -> None:
        if not isinstance(preserve_rng_state, bool):
            raise TypeError(f"preserve_rng_state must be True or False, got {preserve_rng_state!r}")
        self.policy = policy
        self.preserve_rng_state = preserve_rng_state
        self.context_fn = _context_fn(policy)

    def same_as(self, other: _Config) -> bool:
        return self.policy == other.policy and self.preserve_rng_state == other.preserve_rng_state


def _context_fn(policy: Policy) -> Callable[[], Any] | None:
    if isinstance(policy, str):
        if policy == "full":
            return None
        if policy == "save_matmuls":
            return functools.partial(create_selective_checkpoint_contexts, _save_matmuls)
        raise ValueError(
            f"unknown checkpoint policy {policy!r}: use 'full' (recompute everything), "
            "'save_matmuls' (keep matmul/conv/attention outputs, recompute the rest), a "
            "function (ctx, op, *args, **kwargs) -> CheckpointPolicy, or a list of ops to save"
        )
    if callable(policy):
        return functools.partial(create_selective_checkpoint_contexts, policy)
    if isinstance(policy, Iterable):
        ops = list(policy)
        if not ops or not all(
            isinstance(op, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)) for op in ops
        ):
            raise ValueError(
                "a list policy must hold torch ops to save, e.g. [torch.ops.aten.mm.default]"
            )
        return functools.partial(create_selective_checkpoint_contexts, ops)
    raise TypeError(f"policy must be a preset name, a function or a list of ops, got {policy!r}")


def _needs_checkpoint(
    args: tuple[Any, ...], kwargs: dict[str, Any], module: nn.Module | None
) -> bool:
    if not torch.is_grad_enabled() or torch.is_inference_mode_enabled():
        return False
    owners: list[nn.Module] = [] if module is None else [module]
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            if value.requires_grad:
                return True
        elif isinstance(value, nn.Module):
            owners.append(value)  # `self` of a decorated forward
        elif isinstance(value, (list, tuple)) and any(
            isinstance(v, torch.Tensor) and v.requires_grad for v in value
        ):
            return True
    # A module's own parameters make a backward happen even for inputs without grad.
    return any(p.requires_grad for m in owners for p in m.parameters())


def _run_checkpointed(
    fn: Callable[..., Any],
    config: _Config,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    module: nn.Module | None = None,
) -> Any:
    # Nested checkpointed code (a checkpointed block inside a checkpointed model) runs
    # plainly: the outer recompute already covers it, a second one would double the cost.
    if getattr(_state, "depth", 0) > 0 or not _needs_checkpoint(args, kwargs, module):
        return fn(*args, **kwargs)

    def inner(*a: Any) -> Any:
        # Runs at the forward and again at the recompute (possibly on an autograd thread).
        _state.depth = getattr(_state, "depth", 0) + 1
        try:
            return fn(*a, **kwargs)
        finally:
            _state.depth -= 1

    extra: dict[str, Any] = {"preserve_rng_state": config.preserve_rng_state}
    if config.context_fn is not None:
        extra["context_fn"] = config.context_fn
    # User kwargs travel in the closure, not through checkpoint(**kwargs), where names such
    # as `debug` or `context_fn` would be taken as checkpoint's own options.
    return checkpoint(inner, *args, use_reentrant=False, **extra)


def _wrap_function(fn: F, config: _Config) -> F:
    if getattr(fn, "__loopkit_checkpoint__", None) is not None:
        existing: _Config = fn.__loopkit_checkpoint__  # type: ignore[attr-defined]
        if existing.same_as(config):
            return fn
        raise ValueError(
            f"{getattr(fn, '__name__', fn)!r} is already checkpointed with another policy: "
            "apply loopkit.checkpointed once"
        )

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return _run_checkpointed(fn, config, args, kwargs)

    wrapper.__loopkit_checkpoint__ = config  # type: ignore[attr-defined]
    return wrapper  # type: ignore[return-value]


_CLASSES: dict[type[nn.Module], type[nn.Module]] = {}


def _checkpointed_class(cls: type[nn.Module]) -> type[nn.Module]:
    cached = _CLASSES.get(cls)
    if cached is not None:
        return cached

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        config: _Config = self.__dict__["_loopkit_checkpoint"]
        return _run_checkpointed(functools.partial(cls.forward, self), config, args, kwargs, self)

    def __reduce_ex__(self: nn.Module, protocol: Any) -> Any:
        # Pickled (and deep-copied) as the original class, checkpointed again on load.
        return (_rebuild, (cls, self.__dict__))

    sub = type(
        cls.__name__,
        (cls,),
        {
            "forward": forward,
            "__reduce_ex__": __reduce_ex__,
            "__module__": cls.__module__,
            "__qualname__": cls.__qualname__,
        },
    )
    _CLASSES[cls] = sub
    return sub


def _rebuild(cls: type[nn.Module], state: dict[str, Any]) -> nn.Module:
    obj = cls.__new__(cls)
    obj.__setstate__(state)  # type: ignore[no-untyped-call]
    obj.__class__ = _checkpointed_class(cls)
    return obj


def _check_reapply(module: nn.Module, config: _Config) -> None:
    existing = module.__dict__.get("_loopkit_checkpoint")
    if existing is not None and not existing.same_as(config):
        raise ValueError(
            f"{type(module).__name__} is already checkpointed with another policy: apply "
            "loopkit.checkpointed once per module"
        )


def _apply_to_module(module: nn.Module, config: _Config) -> None:
    if "_loopkit_checkpoint" in module.__dict__:
        return  # the same settings again: harmless, never a second recompute
    module.__dict__["_loopkit_checkpoint"] = config
    module.__class__ = _checkpointed_class(type(module))


def _select(model: nn.Module, blocks: Blocks, every: int) -> list[nn.Module]:
    if isinstance(blocks, type) and issubclass(blocks, nn.Module):
        match: Callable[[nn.Module], bool] = lambda m: isinstance(m, blocks)  # noqa: E731
    elif (
        isinstance(blocks, tuple)
        and blocks
        and all(isinstance(b, type) and issubclass(b, nn.Module) for b in blocks)
    ):
        match = lambda m: isinstance(m, blocks)  # noqa: E731
    elif callable(blocks):
        match = blocks  # type: ignore[assignment]
    else:
        raise TypeError(
            f"blocks must be an nn.Module subclass, a tuple of them, or a predicate "
            f"module -> bool, got {blocks!r}"
        )
    # Outermost matches only: a match inside a match would be checkpointed twice.
    found: list[nn.Module] = []

    def visit(m: nn.Module) -> None:
        for child in m.children():
            if match(child):
                found.append(child)
            else:
                visit(child)

    visit(model)
    if not found:
        raise ValueError(
            f"blocks={blocks!r} matches no submodule of {type(model).__name__}: pass the class "
            "of the repeated block (e.g. the transformer layer) or a predicate that selects it"
        )
    # Every k-th block, counted from 1 as torchtitan does: every=2 picks blocks 2, 4, 6...
    return [m for i, m in enumerate(found, 1) if i % every == 0]


@overload
def checkpointed(
    target: M,
    /,
    *,
    blocks: Blocks | None = ...,
    every: int = ...,
    policy: Policy = ...,
    preserve_rng_state: bool = ...,
) -> M: ...
@overload
def checkpointed(target: F, /) -> F: ...
@overload
def checkpointed(*, policy: Policy = ..., preserve_rng_state: bool = ...) -> Callable[[F], F]: ...
def checkpointed(
    target: Any = None,
    /,
    *,
    blocks: Blocks | None = None,
    every: int = 1,
    policy: Policy = "full",
    preserve_rng_state: bool = True,
) -> Any:
    """Recompute activations in backward instead of keeping them.

    ``@checkpointed`` (or ``@checkpointed(policy=...)``) on a function or a module's
    ``forward``; ``checkpointed(block)`` checkpoints that module in place;
    ``checkpointed(model, blocks=Block, every=k)`` checkpoints every k-th ``Block`` of
    ``model`` (1-based count: ``every=2`` picks the 2nd, 4th, ...). ``policy="full"``
    recomputes everything, ``"save_matmuls"`` keeps matmul/conv/attention outputs and
    recomputes the cheap ops, or pass a selective-checkpoint policy function or a list of
    ops to keep. Under ``no_grad``/``inference_mode``, or with nothing requiring grad, the
    code runs plainly; checkpointed code nested inside checkpointed code runs plainly too.
    """
    if not is_int_at_least(every, 1):
        raise ValueError(f"every must be an int >= 1 (checkpoint every k-th block), got {every!r}")
    config = _Config(policy, preserve_rng_state)
    if target is None:
        if blocks is not None or every != 1:
            raise TypeError(
                "blocks= and every= select submodules of a model: call "
                "loopkit.checkpointed(model, blocks=Block, every=k)"
            )
        return lambda fn: checkpointed(fn, policy=policy, preserve_rng_state=preserve_rng_state)
    if isinstance(target, nn.Module):
        if blocks is None and every != 1:
            raise TypeError(
                "every= needs blocks=: loopkit.checkpointed(model, blocks=Block, every=k)"
            )
        chosen = [target] if blocks is None else _select(target, blocks, every)
        # Checked for every module first, so a conflict changes none of them.
        for m in chosen:
            _check_reapply(m, config)
        for m in chosen:
            _apply_to_module(m, config)
        return target
    if callable(target):
        if blocks is not None or every != 1:
            raise TypeError("blocks= and every= apply to a module, not to a function")
        return _wrap_function(target, config)
    raise TypeError(
        f"checkpointed takes a module or a function, got {type(target).__name__}: use "
        "@loopkit.checkpointed on a function, or loopkit.checkpointed(module)"
    )


def is_checkpointed(obj: object) -> bool:
    """Whether a module or function was made checkpointed by loopkit."""
    if isinstance(obj, nn.Module):
        return "_loopkit_checkpoint" in obj.__dict__
    return getattr(obj, "__loopkit_checkpoint__", None) is not None
