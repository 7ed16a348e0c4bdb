"""What checkpointing refuses: a KV cache its recompute would write twice, a compiled module.

A KV cache (transformers' ``past_key_values``) would be appended to again by the
recompute: a checkpointed call in grad mode that receives one is refused, and
checkpointing blocks of a model whose ``config.use_cache`` is True turns it off, as
transformers does. A compiled module runs the code torch.compile traced, so swapping its
class (or a block's inside it) may never take effect: it is refused.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

from torch import nn

from .._compile._order import compiled_how

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


def passes_kv_cache(where: int | str, value: object) -> bool:
    """Whether an argument (its position or keyword, and value) passes a KV cache."""
    return value is not None and (where in _KV_CACHE_KWARGS or _is_kv_cache(value))


def refuse_kv_cache(
    fn: Callable[..., object], owners: list[nn.Module], cache: str | None, use_cache: object
) -> None:
    """Raise if a call that records a graph passes a KV cache (``cache`` names the argument)
    or ``use_cache=True``."""
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


def turn_off_kv_cache(model: nn.Module) -> None:
    """``model.config.use_cache = False`` (with a warning) when it is True."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "use_cache", None) is not True:
        return
    config.use_cache = False
    # Once per model: the next call finds it False. transformers warns alike.
    warnings.warn(
        f"loopkit.checkpointed set {type(model).__name__}.config.use_cache = False: the "
        "recompute in backward would write the KV cache a second time. Generation under "
        "torch.no_grad() can still pass use_cache=True.",
        UserWarning,
        stacklevel=3,
    )


def refuse_compiled(module: nn.Module, above: tuple[nn.Module, ...]) -> None:
    """Raise if ``module`` or a module above it (``above``, the model first) is compiled."""
    for m in (*above, module):
        compiled = compiled_how(m)
        if compiled is not None:
            what = compiled if m is module else f"{type(module).__name__} inside {compiled}"
            raise ValueError(
                f"loopkit.checkpointed cannot checkpoint {what}: the compiled code would go "
                "on running without the checkpoint. Apply loopkit.checkpointed first, then "
                "compile: model = torch.compile(loopkit.checkpointed(model, ...)), or "
                "loopkit.checkpointed(model, ...) then model.compile() (or "
                "loopkit.distributed.wrap(model, compile=True))"
            )
