"""The wrapping order that gives the fewest graph breaks, applied by ``distributed.wrap``.

``checkpointed`` blocks, then compile (each FSDP2 block on its own, as torchtitan does),
then FSDP2/HSDP or DDP. Each module is compiled in place by giving it a compiled
``forward``: its hooks (FSDP2's all-gathers) run eagerly around the graph, its state-dict
keys stay free of ``_orig_mod.``, and a forward made of torch's own modules compiles too
(``module.compile()`` compiles ``_call_impl``, whose frame dynamo skips when the forward is
torch's; and a deepcopy or a pickle of the module would lose it). That ``forward`` reads
as the plain one to whatever inspects or traces the module (``CompiledForward``).
``torch.compile(DDP(model))``, Accelerate's and Fabric's order, breaks DDP's
forward into several graphs; ``DDP(torch.compile(model))`` breaks nothing.
"""

from __future__ import annotations

import copy
import functools
import sys
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.fx import _symbolic_trace as _fx


class CompiledForward:
    """A module's ``forward``, compiled: the one set on the instance if any (a patched or
    adapter forward), else its class's. To whatever inspects or traces the module it is that
    forward: its signature, ``__code__``, name and docstring (``inspect.signature``, a
    Trainer's column filter, ``torch.export``), and the plain forward runs under
    ``torch.jit.trace`` and ``torch.fx`` (which refuse compiled code). A ``deepcopy`` or a
    pickle of the module gets one of its own, compiled for the copy."""

    def __init__(
        self,
        module: nn.Module,
        options: Mapping[str, Any],
        forward: Callable[..., Any] | None = None,
    ) -> None:
        # The class's forward is bound to module here (a copy rebinds it to itself).
        plain: Callable[..., Any] = forward or type(module).forward.__get__(module)
        # __name__, __qualname__, __doc__, __module__ and __wrapped__ (which
        # inspect.signature follows) of the forward, as functools.wraps gives a wrapper;
        # first, so that no attribute of the forward's function hides one set below.
        functools.update_wrapper(self, plain)
        self.module = module
        self.own = forward  # the instance's forward, when it had one
        self.forward = plain
        self.options = dict(options)
        self._compiled: Callable[..., Any] = torch.compile(plain, **self.options)

    def __getattr__(self, name: str) -> Any:
        # Only for what the instance lacks: a method's and a function's own attributes
        # (__code__, __defaults__, __func__, __self__, ...) are the forward's.
        forward = self.__dict__.get("forward")
        if forward is not None and name in _FORWARDED:
            return getattr(forward, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # torch.jit.trace and torch.fx trace the forward's own code, and raise on compiled
        # code: they get the plain forward (torch.export skips the compiled call itself).
        # Two flag reads per call (about 0.2 us), no device work.
        if _fx._is_fx_tracing_flag or torch._C._get_tracing_state() is not None:
            return self.forward(*args, **kwargs)
        return self._compiled(*args, **kwargs)

    def __deepcopy__(self, memo: dict[int, Any]) -> CompiledForward:
        # Deep-copying the module: memo holds its copy, which must run its own weights.
        own = None if self.own is None else copy.deepcopy(self.own, memo)
        return CompiledForward(copy.deepcopy(self.module, memo), self.options, own)

    def __reduce__(self) -> tuple[Any, ...]:
        # A compiled function does not pickle: the unpickled module compiles its own.
        return (CompiledForward, (self.module, self.options, self.own))


# A bound method's and a function's attributes that introspection reads (export reads
# __code__; getfullargspec and accelerate-style unwrapping read __func__ and __self__).
_FORWARDED = frozenset(
    ("__code__", "__defaults__", "__kwdefaults__", "__func__", "__self__", "__annotations__",
     "__type_params__", "__closure__", "__globals__", "__builtins__")
)  # fmt: skip


def orig_module(module: nn.Module) -> nn.Module | None:
    """The module a ``torch.compile(module)`` wrapper runs; None for any other module."""
    # Only a loaded torch._dynamo can have made the wrapper; importing it here would cost
    # every user about a second.
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    if eval_frame is not None and isinstance(module, eval_frame.OptimizedModule):
        orig: nn.Module = module._orig_mod
        return orig
    return None


def compiled_how(module: nn.Module) -> str | None:
    """``module`` named with how it was compiled, or None when it was not."""
    orig = orig_module(module)
    if orig is not None:
        return f"the torch.compile wrapper of {type(orig).__name__}"
    if module.__dict__.get("_compiled_call_impl") is not None:
        return f"{type(module).__name__}, compiled in place with .compile()"
    own = module.__dict__.get("forward")
    if isinstance(own, CompiledForward):
        return f"{type(module).__name__}, compiled by distributed.wrap(compile=)"
    if hasattr(own, "_torchdynamo_orig_callable"):  # module.forward = torch.compile(...)
        return f"{type(module).__name__}, whose forward is torch.compile'd"
    return None


def refuse_compiled_twice(model: nn.Module) -> None:
    """``wrap(compile=...)`` compiles: a model compiled already (or a part of it) is refused."""
    for name, m in model.named_modules():
        how = compiled_how(m)
        if how is not None:
            where = f" (at {name!r})" if name else ""
            raise ValueError(
                f"the model is compiled already: {how}{where}. distributed.wrap(model, "
                "compile=...) compiles it in the order that gives the fewest graph breaks: "
                "pass it uncompiled, or leave compile= out"
            )


def compile_in_place(
    model: nn.Module, blocks: Sequence[nn.Module] | None, options: Mapping[str, Any]
) -> None:
    """Compile each of ``blocks`` (the model if None) in place: same module, same keys."""
    for target in blocks or [model]:
        target.forward = CompiledForward(target, options, target.__dict__.get("forward"))


def warn_if_sharded_after_compile(model: nn.Module) -> None:
    """A model compiled whole and then sharded: say the order FSDP2 wants."""
    if orig_module(model) is None:
        return
    warnings.warn(
        "distributed.wrap(torch.compile(model), fsdp=...) shards a model compiled whole: "
        "FSDP2's per-block all-gathers then break its graph. Compile each block before "
        "sharding: distributed.wrap(model, fsdp=Block, compile=True)",
        UserWarning,
        stacklevel=3,
    )


def compiled_around_wrapper(model: nn.Module, kind: str) -> str | None:
    """What to say of ``torch.compile(DDP(model))`` (or of an FSDP model) and of
    ``DDP(model).compile()`` (2 breaks on 2 ranks, against 3); None otherwise. (An FSDP2
    model compiled in place is the module itself, its hooks run around the graph.)"""
    in_place = kind == "ddp" and model.__dict__.get("_compiled_call_impl") is not None
    if kind == "none" or (orig_module(model) is None and not in_place):
        return None
    name = kind.upper().rstrip("12")
    return (
        f"the {name} model is compiled around its wrapper ({compiled_how(model)}), which breaks "
        f"its forward into several graphs at {name}'s hooks. Compile first, then wrap: "
        "loopkit.distributed.wrap(model, compile=True), which is DDP(torch.compile(model)) "
        "(FSDP2: each block compiled, then sharded)"
    )
