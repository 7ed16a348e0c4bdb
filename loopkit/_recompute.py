"""checkpointed: activation checkpointing as a decorator, or applied to modules in place.

Always ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``: the reentrant
variant breaks under DDP ("Expected to mark a variable ready only once") and ignores
inputs that do not require grad. Non-reentrant checkpointing re-enters the autocast state
captured at the forward, so the recompute matches the forward under ``autocast_step``.

Applied to a module, the module's class is swapped for a cached subclass whose
``forward`` runs under checkpoint: parameter names, ``state_dict`` keys, ``deepcopy``
(an EMA copy stays checkpointed) and ``isinstance`` are all unchanged.

The recompute in backward runs the checkpointed code a second time. Two kinds of state
that code may write would then be written twice, so they are handled here:

- Module buffers updated by the forward (BatchNorm running statistics and
  ``num_batches_tracked``, spectral norm's power-iteration vectors, counters): the
  recompute runs on stand-in tensors holding the values the forward started from, and the
  modules get their own buffers back after it, so only the forward's update stands and
  the recompute computes exactly what the forward did (``_BufferGuard``).
- A KV cache (transformers' ``past_key_values``): appended to again by the recompute. A
  checkpointed call in grad mode that receives one is refused, and checkpointing blocks
  of a model whose ``config.use_cache`` is True turns it off, as transformers does.
"""

from __future__ import annotations

import functools
import sys
import threading
import warnings
import weakref
from collections.abc import Callable, Iterable
from typing import Any, Literal, TypeAlias, TypeVar, overload

import torch
from torch import nn
from torch.nn.parameter import is_lazy
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from ._checks import is_int_at_least

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


# Keyword arguments under which transformers layers receive a KV cache.
_KV_CACHE_KWARGS = ("past_key_values", "past_key_value", "layer_past")
_CACHE_TYPES: dict[type, bool] = {}


def _is_kv_cache(value: object) -> bool:
    """Whether ``value`` is a KV cache object (transformers' ``Cache`` API)."""
    kind = type(value)
    known = _CACHE_TYPES.get(kind)
    if known is None:
        known = callable(getattr(kind, "update", None)) and callable(
            getattr(kind, "get_seq_length", None)
        )
        _CACHE_TYPES[kind] = known
    return known


def _inspect_call(
    args: tuple[Any, ...], kwargs: dict[str, Any], module: nn.Module | None
) -> tuple[bool, list[nn.Module], str | None]:
    """Whether a backward can follow, the modules whose buffers the call may update, and
    which argument passes a KV cache (None when none does)."""
    owners: list[nn.Module] = [] if module is None else [module]
    grad = False
    cache: str | None = None
    for where, value in (*enumerate(args), *kwargs.items()):
        if isinstance(value, torch.Tensor):
            grad = grad or value.requires_grad
        elif isinstance(value, nn.Module):
            owners.append(value)  # `self` of a decorated forward, or a module argument
        elif isinstance(value, (list, tuple)):
            grad = grad or any(isinstance(v, torch.Tensor) and v.requires_grad for v in value)
        elif value is not None and (where in _KV_CACHE_KWARGS or _is_kv_cache(value)):
            label = f"positional argument {where}" if isinstance(where, int) else f"{where}="
            cache = f"{label} ({type(value).__name__})"
    # A module's own parameters make a backward happen even for inputs without grad.
    grad = grad or any(p.requires_grad for m in owners for p in m.parameters())
    return grad, owners, cache


def _refuse_kv_cache(
    fn: Callable[..., Any], owners: list[nn.Module], cache: str | None, use_cache: object
) -> None:
    # transformers' layers that only read the cache declare it; the recompute reads the
    # same states again, which is harmless.
    reads_only = bool(owners) and getattr(owners[0], "_can_checkpoint_with_cache", False) is True
    if use_cache is not True and (cache is None or reads_only):
        return
    what = "use_cache=True" if use_cache is True else f"a KV cache, {cache},"
    name = type(owners[0]).__name__ if owners else getattr(fn, "__qualname__", repr(fn))
    raise ValueError(
        f"checkpointed {name} received {what} in a call that records a graph for backward: "
        "the recompute in backward would write the cache a second time (transformers "
        "raises a size mismatch, or silently attends to duplicated keys). Train without the "
        "cache: set model.config.use_cache = False (loopkit.checkpointed(model, blocks=...) "
        "does this for the model it is given) or pass use_cache=False; a cache still works "
        "under torch.no_grad()"
    )


# Which buffers a forward wrote is read from their version counters, which every in-place
# op and out= op bumps. The batch-norm kernels are the exception: they write running_mean
# and running_var without declaring it, so no counter moves. A module tracking running
# statistics in training mode (BatchNorm*, SyncBatchNorm, InstanceNorm*) is taken to
# write those two.
_RUNNING_STATS = frozenset(("running_mean", "running_var"))
_NONE: frozenset[str] = frozenset()

# The buffer names each module's checkpointed forwards have been seen to write in place.
# A module not in here has not run under loopkit's checkpoint yet: all of its buffers are
# copied before that first forward, since which of them it writes is not known yet.
_UPDATES: weakref.WeakKeyDictionary[nn.Module, frozenset[str]] = weakref.WeakKeyDictionary()

# (module, buffer name, its tensor before the forward, its version then (or one of the two
# markers below), its value then if copied, whether it is written without a version bump)
_Slot: TypeAlias = "tuple[nn.Module, str, torch.Tensor, int, torch.Tensor | None, bool]"
_NO_VERSION = -1  # an inference tensor: no version counter
_LAZY = -2  # not materialized yet


def _copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` outside autograd (a buffer may require grad)."""
    with torch.no_grad():
        return t.clone()


class _BufferGuard:
    """Keeps the recompute of one checkpointed call from updating module buffers again.

    The forward's buffer updates (BatchNorm running statistics, counters) are the step's.
    Each recompute runs on stand-ins holding the values the forward started from (so it
    computes what the forward computed, even where the output depends on the updated
    buffer, as with spectral norm), and the modules get their own buffers back after it,
    also when torch stops the recompute early by raising out of the middle of it. The
    buffers are those of ``owners`` and all their submodules.
    """

    __slots__ = ("first_seen", "fresh", "slots", "stand_ins")

    def __init__(self, slots: list[_Slot], first_seen: list[nn.Module], fresh: bool) -> None:
        self.slots = slots
        self.first_seen = first_seen
        # Whether each recompute may copy its stand-ins: True when no selective-checkpoint
        # mode runs around the recompute (there an op the forward did not run is an error);
        # a selective region is recomputed once, so one set of stand-ins serves.
        self.fresh = fresh
        self.stand_ins: list[tuple[nn.Module, str, torch.Tensor]] = []

    @classmethod
    def start(cls, owners: list[nn.Module], fresh: bool) -> _BufferGuard | None:
        """Before the forward: note each buffer's tensor and version and copy those that
        may be written in place; None when there are no buffers at all."""
        slots: list[_Slot] = []
        first_seen: list[nn.Module] = []
        seen: set[int] = set()
        stack = list(owners)
        while stack:
            m = stack.pop()
            if m is None or id(m) in seen:
                continue
            seen.add(id(m))
            stack.extend(m._modules.values())  # type: ignore[arg-type]  # None entries too
            if not m._buffers:
                continue
            known = _UPDATES.get(m)
            if known is None:
                first_seen.append(m)
            silent = (
                _RUNNING_STATS if m.training and m.__dict__.get("track_running_stats") else _NONE
            )
            for name, t in m._buffers.items():
                if t is None:
                    continue
                if is_lazy(t):  # a lazy module's buffer, filled in by its first forward
                    slots.append((m, name, t, _LAZY, None, False))
                    continue
                if t.is_inference():  # no version counter, and read-only outside inference
                    slots.append((m, name, t, _NO_VERSION, None, False))
                    continue
                before = None
                if known is None or name in known or name in silent:
                    before = _copy(t)
                slots.append((m, name, t, t._version, before, name in silent))
        return cls(slots, first_seen, fresh) if slots else None

    def forward_done(self) -> bool:
        """After the forward: keep stand-ins for the buffers it updated; False if none.

        Called once checkpoint() has returned, outside the checkpointed region, so a
        selective checkpoint's op log does not see its copies (except after a torch.compile
        fallback, see _run_traced).
        """
        learned: dict[nn.Module, set[str]] = {m: set() for m in self.first_seen}
        for m, name, t, version, before, silent in self.slots:
            if version == _LAZY:
                # Filled in by this forward, which also wrote it (a lazy BatchNorm's
                # statistics): the recompute starts from the forward's result.
                if is_lazy(t):
                    continue
                written = True
            else:
                written = silent or (version >= 0 and t._version != version)
            if not written and m._buffers.get(name) is t:
                continue
            if not written:
                stand_in = t  # rebound to a new tensor: the old one still holds the input value
            elif before is not None:
                stand_in = before
            else:
                # Written in place for the first time on a later call: the value before is
                # gone, so this recompute starts from the forward's result; the next calls
                # copy it beforehand.
                stand_in = _copy(t)
                learned.setdefault(m, set())
            if written and not silent and m in learned:
                learned[m].add(name)
            self.stand_ins.append((m, name, stand_in))
        for m, names in learned.items():
            _UPDATES[m] = _UPDATES.get(m, _NONE) | names
        self.slots = []  # drops the copies of buffers the forward left alone
        self.first_seen = []
        return bool(self.stand_ins)

    def recompute(
        self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """Run ``fn`` with the stand-ins bound in place of the buffers, then rebind these."""
        bound: list[tuple[dict[str, Any], str, Any]] = []
        try:
            for m, name, stand_in in self.stand_ins:
                buffers = m._buffers
                if name in buffers:
                    bound.append((buffers, name, buffers[name]))
                    buffers[name] = _copy(stand_in) if self.fresh else stand_in
            return fn(*args, **kwargs)
        finally:
            for buffers, name, tensor in reversed(bound):
                buffers[name] = tensor


def _run_checkpointed(
    fn: Callable[..., Any],
    config: _Config,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    module: nn.Module | None = None,
) -> Any:
    if torch.compiler.is_compiling():
        return _run_traced(fn, config, args, kwargs, module)
    # Nested checkpointed code (a checkpointed block inside a checkpointed model) runs
    # plainly: the outer recompute already covers it, a second one would double the cost.
    if (
        getattr(_state, "depth", 0) > 0
        or not torch.is_grad_enabled()
        or torch.is_inference_mode_enabled()
    ):
        return fn(*args, **kwargs)
    grad, owners, cache = _inspect_call(args, kwargs, module)
    if not grad:
        return fn(*args, **kwargs)
    _refuse_kv_cache(fn, owners, cache, kwargs.get("use_cache") if kwargs else None)
    guard = _BufferGuard.start(owners, fresh=config.context_fn is None) if owners else None
    calls = 0

    def inner(*a: Any) -> Any:
        # Runs at the forward and again at each recompute (possibly on an autograd thread).
        nonlocal calls
        calls += 1
        _state.depth = getattr(_state, "depth", 0) + 1
        try:
            if calls > 1 and guard is not None:
                return guard.recompute(fn, a, kwargs)
            return fn(*a, **kwargs)
        finally:
            _state.depth -= 1

    extra: dict[str, Any] = {"preserve_rng_state": config.preserve_rng_state}
    if config.context_fn is not None:
        extra["context_fn"] = config.context_fn
    # User kwargs travel in the closure, not through checkpoint(**kwargs), where names such
    # as `debug` or `context_fn` would be taken as checkpoint's own options.
    out = checkpoint(inner, *args, use_reentrant=False, **extra)
    if guard is not None and not guard.forward_done():
        guard = None  # the forward updated no buffer: the recompute needs nothing
    return out


def _run_traced(
    fn: Callable[..., Any],
    config: _Config,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    module: nn.Module | None,
) -> Any:
    """The checkpoint as torch.compile traces it: one region whose recompute the compiler
    plans, applying the region's buffer updates once. Kept free of what dynamo cannot
    trace (thread-locals, inference-mode queries, state changed inside the region)."""
    if not torch.is_grad_enabled():
        return fn(*args, **kwargs)
    grad, owners, cache = _inspect_call(args, kwargs, module)
    if not grad:
        return fn(*args, **kwargs)
    _refuse_kv_cache(fn, owners, cache, kwargs.get("use_cache") if kwargs else None)
    guard: _BufferGuard | None = None
    calls = 0

    def body(*a: Any) -> Any:
        nonlocal guard, calls
        if torch.compiler.is_compiling():
            return fn(*a, **kwargs)
        # torch.compile could not trace the region (a graph break inside it) and runs this
        # checkpoint eagerly: the recompute would update the buffers again, so guard them
        # as in eager mode, from inside the region since the code around it was traced.
        # (A selective policy's op log then sees the guard's copies: one that saves
        # aten.clone outputs would misplace them.)
        calls += 1
        if calls > 1:
            return fn(*a, **kwargs) if guard is None else guard.recompute(fn, a, kwargs)
        guard = _BufferGuard.start(owners, fresh=config.context_fn is None) if owners else None
        out = fn(*a, **kwargs)
        if guard is not None and not guard.forward_done():
            guard = None
        return out

    extra: dict[str, Any] = {"preserve_rng_state": config.preserve_rng_state}
    if config.context_fn is not None:
        extra["context_fn"] = config.context_fn
    return checkpoint(body, *args, use_reentrant=False, **extra)


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


def _orig_module(module: nn.Module) -> nn.Module | None:
    """The module a ``torch.compile(module)`` wrapper runs; None for any other module."""
    # Only a loaded torch._dynamo can have made the wrapper; importing it here would cost
    # every user about a second.
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    if eval_frame is not None and isinstance(module, eval_frame.OptimizedModule):
        orig: nn.Module = module._orig_mod
        return orig
    return None


def _compiled(module: nn.Module) -> str | None:
    """``module`` named with how it was compiled, or None when it was not."""
    orig = _orig_module(module)
    if orig is not None:
        return f"the torch.compile wrapper of {type(orig).__name__}"
    if module.__dict__.get("_compiled_call_impl") is not None:
        return f"{type(module).__name__}, compiled in place with .compile()"
    return None


def _applied(module: nn.Module) -> _Config | None:
    """The settings loopkit checkpointed ``module`` with (seen through a compile wrapper)."""
    orig = _orig_module(module)
    config: _Config | None = (module if orig is None else orig).__dict__.get("_loopkit_checkpoint")
    return config


def _check_reapply(module: nn.Module, config: _Config) -> None:
    existing = _applied(module)
    if existing is not None and not existing.same_as(config):
        raise ValueError(
            f"{type(module).__name__} is already checkpointed with another policy: apply "
            "loopkit.checkpointed once per module"
        )


def _check_not_compiled(module: nn.Module, above: tuple[nn.Module, ...]) -> None:
    # A compiled module runs the code torch.compile traced (or will trace, guarded on what
    # it saw): swapping the class of it, or of a block inside it, may never take effect,
    # and is_checkpointed would claim what does not happen.
    for m in (*above, module):
        compiled = _compiled(m)
        if compiled is not None:
            what = compiled if m is module else f"{type(module).__name__} inside {compiled}"
            raise ValueError(
                f"loopkit.checkpointed cannot checkpoint {what}: the compiled code would go "
                "on running without the checkpoint. Apply loopkit.checkpointed first, then "
                "compile: model = torch.compile(loopkit.checkpointed(model, ...)), or "
                "loopkit.checkpointed(model, ...) then model.compile()"
            )


def _apply_to_module(module: nn.Module, config: _Config) -> None:
    if _applied(module) is not None:
        return  # the same settings again: harmless, never a second recompute
    module.__dict__["_loopkit_checkpoint"] = config
    module.__class__ = _checkpointed_class(type(module))


def _turn_off_kv_cache(model: nn.Module) -> None:
    """``model.config.use_cache = False`` (with a warning) when it is True."""
    config = getattr(model, "config", None)
    if getattr(config, "use_cache", None) is not True:
        return
    config.use_cache = False  # type: ignore[union-attr]
    # Once per model: the next call finds it False. transformers warns alike.
    warnings.warn(
        f"loopkit.checkpointed set {type(model).__name__}.config.use_cache = False: the "
        "recompute in backward would write the KV cache a second time. Generation under "
        "torch.no_grad() can still pass use_cache=True.",
        UserWarning,
        stacklevel=3,
    )


def _select(model: nn.Module, blocks: Blocks, every: int) -> list[nn.Module]:
    """The chosen blocks of ``model`` (also what ``distributed.wrap(fsdp=Block)`` shards)."""
    return [m for m, _ in _select_with_paths(model, blocks, every)]


def _select_with_paths(
    model: nn.Module, blocks: Blocks, every: int
) -> list[tuple[nn.Module, tuple[nn.Module, ...]]]:
    """The chosen blocks of ``model``, each with the modules above it (``model`` first)."""
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
    found: list[tuple[nn.Module, tuple[nn.Module, ...]]] = []

    def visit(m: nn.Module, above: tuple[nn.Module, ...]) -> None:
        path = (*above, m)
        for child in m.children():
            if match(child):
                found.append((child, path))
            else:
                visit(child, path)

    visit(model, ())
    if not found:
        raise ValueError(
            f"blocks={blocks!r} matches no submodule of {type(model).__name__}: pass the class "
            "of the repeated block (e.g. the transformer layer) or a predicate that selects it"
        )
    # Every k-th block, counted from 1 as torchtitan does: every=2 picks blocks 2, 4, 6...
    return [pair for i, pair in enumerate(found, 1) if i % every == 0]


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

    Buffers the forward writes (BatchNorm running statistics, counters) are written once,
    as without checkpointing: those of a checkpointed module and its submodules, of
    ``self`` for a decorated ``forward``, and of the modules passed as arguments to a
    decorated function (a module it reaches otherwise, e.g. a global, is not covered:
    pass it as an argument, or checkpoint the module). Checkpointing blocks of a model
    whose ``config.use_cache`` is True sets it False (with a warning); a KV cache passed to
    a checkpointed call that records a graph is refused. A compiled module, or a block
    inside one, is refused: apply ``checkpointed`` first, then compile.
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
        chosen = [(target, ())] if blocks is None else _select_with_paths(target, blocks, every)
        # Checked for every module first, so a refusal changes none of them.
        for m, _ in chosen:
            _check_reapply(m, config)
        for m, above in chosen:
            if _applied(m) is None:
                _check_not_compiled(m, above)
        # The models the chosen blocks sit in: a KV cache they create and pass down would be
        # written again by each block's recompute. (A cache created inside a checkpointed
        # module is created afresh by its recompute: no harm.)
        containers = {id(a): a for _, above in chosen for a in above}
        for container in containers.values():
            _turn_off_kv_cache(container)
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
    """Whether a module or function was made checkpointed by loopkit."""
    if isinstance(obj, nn.Module):
        return _applied(obj) is not None
    return getattr(obj, "__loopkit_checkpoint__", None) is not None
