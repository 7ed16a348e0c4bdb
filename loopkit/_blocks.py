"""Block selection: the repeated blocks of a model that checkpointing and FSDP act on.

``checkpointed(model, blocks=Block, every=k)`` checkpoints them and
``distributed.wrap(model, fsdp=Block)`` shards them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeAlias, cast

from torch import nn

Blocks: TypeAlias = "type[nn.Module] | tuple[type[nn.Module], ...] | Callable[[nn.Module], bool]"
Above: TypeAlias = "tuple[nn.Module, ...]"  # the modules above a block, the model first


def select_blocks(model: nn.Module, blocks: Blocks, every: int = 1) -> list[nn.Module]:
    """The chosen blocks of ``model``."""
    return [m for m, _ in select_blocks_with_paths(model, blocks, every)]


def select_blocks_with_paths(
    model: nn.Module, blocks: Blocks, every: int = 1
) -> list[tuple[nn.Module, Above]]:
    """The chosen blocks of ``model``, each with the modules above it (``model`` first).

    Only the outermost matches count (a match inside a match would be checkpointed, or
    sharded, twice); ``every``: block stride, counted from 1 as torchtitan does
    (``every=2`` picks blocks 2, 4, 6, ...).
    """
    match = _matcher(blocks)
    found: list[tuple[nn.Module, Above]] = []

    def visit(m: nn.Module, above: Above) -> None:
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
    return [pair for i, pair in enumerate(found, 1) if i % every == 0]


def _is_module_class(obj: object) -> bool:
    return isinstance(obj, type) and issubclass(obj, nn.Module)


def _matcher(blocks: Blocks) -> Callable[[nn.Module], bool]:
    """``blocks`` as a predicate on modules."""
    if isinstance(blocks, tuple):
        if blocks and all(_is_module_class(b) for b in blocks):
            return lambda m: isinstance(m, blocks)
    elif isinstance(blocks, type) and issubclass(blocks, nn.Module):
        return lambda m: isinstance(m, blocks)
    elif callable(blocks):
        # mypy cannot rule out a class here: one that is no Module subclass is a predicate too.
        return cast("Callable[[nn.Module], bool]", blocks)
    raise TypeError(
        f"blocks must be an nn.Module subclass, a tuple of them, or a predicate "
        f"module -> bool, got {blocks!r}"
    )
