"""Every rule, collected from the theme modules; which ones a run uses; the docs table."""

from __future__ import annotations

from collections.abc import Iterable
from types import ModuleType

from ._declaration import Rule
from ._rules import accumulation, autograd, data, memory, parallel, syncs

THEMES: tuple[ModuleType, ...] = (syncs, memory, data, autograd, accumulation, parallel)


def collect(modules: Iterable[ModuleType]) -> dict[str, Rule]:
    """code -> Rule for every ``@rule`` in ``modules``, sorted by code; a code used twice raises."""
    found: dict[str, Rule] = {}
    for module in modules:
        for value in vars(module).values():
            if not isinstance(value, Rule):
                continue
            if found.get(value.code, value) is not value:
                raise ValueError(f"lint rule code {value.code} is declared twice")
            found[value.code] = value
    return dict(sorted(found.items()))


REGISTRY: dict[str, Rule] = collect(THEMES)


def rules_for(select: Iterable[str] | None) -> tuple[Rule, ...]:
    """The rules a run uses: those whose codes are in ``select``, or the default set for None."""
    if select is None:
        return tuple(r for r in REGISTRY.values() if r.default)
    wanted = frozenset(select)
    return tuple(r for r in REGISTRY.values() if r.code in wanted)


def markdown_table() -> str:
    """The rules table (docs/lint.md): code, theme, what it flags, the fix, on by default or not."""
    lines = [
        "| Code | Theme | What it flags | Fix | Default |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in REGISTRY.values():
        cells = (r.code, r.theme, r.flags, r.fix, "on" if r.default else "off")
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines) + "\n"
