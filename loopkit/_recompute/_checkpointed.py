"""checkpointed: activation checkpointing as a decorator, or applied to modules in place.

Applied to a module, the module's class is swapped for a cached subclass whose
``forward`` runs under checkpoint: parameter names, ``state_dict`` keys, ``deepcopy``
(an EMA copy stays checkpointed) and ``isinstance`` are all unchanged.

Where the rest lives: one checkpointed call in ``_call``, what a region keeps
(the policies) in ``_policy``, buffers written once in ``_buffer_guard``, the
KV-cache and compiled-module refusals in ``_refusals``, block selection in
``loopkit._blocks``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import SupportsIndex, TypeVar, cast, overload

from torch import nn

from .._blocks import Above, Blocks, select_blocks_with_paths
from .._checks import is_int_at_least
from .._compile._order import orig_module
from ._call import run_checkpointed
from ._policy import Policy, RecomputeConfig
from ._refusals import refuse_compiled, turn_off_kv_cache

F = TypeVar("F", bound=Callable[..., object])
M = TypeVar("M", bound=nn.Module)

_FN_ATTR = "__loopkit_checkpoint__"  # a checkpointed function's RecomputeConfig
_MODULE_KEY = "_loopkit_checkpoint"  # a checkpointed module's, in its __dict__


def _wrap_function(fn: F, config: RecomputeConfig) -> F:
    existing = getattr(fn, _FN_ATTR, None)
    if isinstance(existing, RecomputeConfig):
        if existing.same_as(config):
            return fn
        raise ValueError(
            f"{getattr(fn, '__name__', fn)!r} is already checkpointed with another policy: "
            "apply loopkit.checkpointed once"
        )

    @functools.wraps(fn)
    def wrapper(*args: object, **kwargs: object) -> object:
        return run_checkpointed(fn, config, args, kwargs)

    setattr(wrapper, _FN_ATTR, config)
    return cast("F", wrapper)  # it takes fn's arguments and returns fn's result


# -- the class swap ---------------------------------------------------------------------------

_CLASSES: dict[type[nn.Module], type[nn.Module]] = {}


def _checkpointed_class(cls: type[nn.Module]) -> type[nn.Module]:
    """The cached subclass of ``cls`` whose ``forward`` runs checkpointed."""
    cached = _CLASSES.get(cls)
    if cached is not None:
        return cached

    def forward(self: nn.Module, *args: object, **kwargs: object) -> object:
        config: RecomputeConfig = self.__dict__[_MODULE_KEY]
        return run_checkpointed(functools.partial(cls.forward, self), config, args, kwargs, self)

    def __reduce_ex__(
        self: nn.Module, protocol: SupportsIndex
    ) -> tuple[Callable[..., nn.Module], tuple[type[nn.Module], dict[str, object]]]:
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


def _rebuild(cls: type[nn.Module], state: dict[str, object]) -> nn.Module:
    obj = cls.__new__(cls)
    obj.__setstate__(state)  # type: ignore[no-untyped-call]  # torch leaves it unannotated
    obj.__class__ = _checkpointed_class(cls)
    return obj


def _applied(module: nn.Module) -> RecomputeConfig | None:
    """The settings loopkit checkpointed ``module`` with (seen through a compile wrapper)."""
    orig = orig_module(module)
    config: RecomputeConfig | None = (module if orig is None else orig).__dict__.get(_MODULE_KEY)
    return config


def _check_reapply(module: nn.Module, config: RecomputeConfig) -> None:
    existing = _applied(module)
    if existing is not None and not existing.same_as(config):
        raise ValueError(
            f"{type(module).__name__} is already checkpointed with another policy: apply "
            "loopkit.checkpointed once per module"
        )


def _apply_to_module(module: nn.Module, config: RecomputeConfig) -> None:
    if _applied(module) is not None:
        return  # the same settings again: harmless, never a second recompute
    module.__dict__[_MODULE_KEY] = config
    module.__class__ = _checkpointed_class(type(module))


# -- the public functions ---------------------------------------------------------------------


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
    target: object = None,
    /,
    *,
    blocks: Blocks | None = None,
    every: int = 1,
    policy: Policy = "full",
    preserve_rng_state: bool = True,
) -> object:
    """Recompute activations in backward instead of keeping them.

    ``@checkpointed`` (or ``@checkpointed(policy=...)``) on a function or a module's
    ``forward``; ``checkpointed(block)`` checkpoints that module in place;
    ``checkpointed(model, blocks=Block, every=k)`` checkpoints every k-th ``Block`` of
    ``model`` (``every``: block stride, counted from 1: ``every=2`` picks the 2nd, 4th, ...).
    ``policy="full"`` recomputes everything, ``"save_matmuls"`` keeps matmul/conv/attention
    outputs and recomputes the cheap ops, or pass a selective-checkpoint policy function or
    a list of ops to keep. Under ``no_grad``/``inference_mode``, or with nothing requiring
    grad, the code runs plainly; checkpointed code nested inside checkpointed code runs
    plainly too.

    Buffers the forward writes (BatchNorm running statistics, counters) are written once,
    as without checkpointing: those of a checkpointed module and its submodules, of
    ``self`` for a decorated ``forward``, and of the modules passed as arguments to a
    decorated function (a module it reaches otherwise, e.g. a global, is not covered:
    pass it as an argument, or checkpoint the module). Checkpointing blocks of a model
    whose ``config.use_cache`` is True sets it False (with a warning); a KV cache passed to
    a checkpointed call that records a graph is refused. A compiled module, or a block
    inside one, is refused: apply ``checkpointed`` first, then compile.
    ``target``: the function or module; ``preserve_rng_state``: recompute with the forward's RNG.
    """
    if not is_int_at_least(every, 1):
        raise ValueError(f"every must be an int >= 1 (checkpoint every k-th block), got {every!r}")
    config = RecomputeConfig(policy, preserve_rng_state)
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
        chosen: list[tuple[nn.Module, Above]] = (
            [(target, ())] if blocks is None else select_blocks_with_paths(target, blocks, every)
        )
        # Checked for every module first, so a refusal changes none of them.
        for m, _ in chosen:
            _check_reapply(m, config)
        for m, above in chosen:
            if _applied(m) is None:
                refuse_compiled(m, above)
        # The models the chosen blocks sit in: a KV cache they create and pass down would be
        # written again by each block's recompute. (A cache created inside a checkpointed
        # module is created afresh by its recompute: no harm.)
        containers = {id(a): a for _, above in chosen for a in above}
        for container in containers.values():
            turn_off_kv_cache(container)
        for m, _ in chosen:
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
    """Whether ``obj`` (a module or function) was made checkpointed by loopkit."""
    if isinstance(obj, nn.Module):
        return _applied(obj) is not None
    return getattr(obj, _FN_ATTR, None) is not None
