"""A lint rule, declared once: its code, theme, texts and check, with the ``@rule`` decorator."""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Literal

from ._script import Script

Theme = Literal["syncs", "memory", "data", "autograd", "accumulation", "parallel"]
# What a check reports: the node to point at, and what it saw there.
Hit = tuple[ast.AST, str]
Check = Callable[[Script], Iterator[Hit]]


@dataclass(frozen=True)
class Rule:
    """One habit the linter knows: ``check`` finds it, ``why`` and ``fix`` explain it."""

    code: str
    theme: Theme
    flags: str  # what it flags, one line of markdown (the docs table)
    why: str  # why it costs, ends every finding's message
    fix: str  # the loopkit line that fixes it
    check: Check
    default: bool = True  # False: runs only when asked for (--select CODE, --all)


def rule(
    code: str, *, theme: Theme, flags: str, why: str, fix: str, default: bool = True
) -> Callable[[Check], Rule]:
    """Declare the decorated check as rule ``code``; the registry finds it in its theme module."""

    def declare(check: Check) -> Rule:
        return Rule(code, theme, flags, why, fix, check, default)

    return declare
