"""How many examples the invariant harness draws: a few in CI, many with LOOPKIT_DEEP.

``LOOPKIT_DEEP`` is read once, here. Unset (CI): every property draws a few examples,
derandomized (the same ones on every run, so CI never flakes and both ranks of a torchrun
worker draw the same ones). ``LOOPKIT_DEEP=1``: every budget is multiplied by
``DEEP_FACTOR`` (``LOOPKIT_DEEP=<n>`` multiplies by ``n`` instead, for n > 1) and the
examples are random; a failure prints the seed that reproduces it (``LOOPKIT_SEED=<seed>``
replays a deep run, in the workers too).
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from typing import Any, TypeVar

from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

F = TypeVar("F", bound=Callable[..., Any])

_RAW = os.environ.get("LOOPKIT_DEEP", "").strip()
DEEP = _RAW not in ("", "0", "false", "False", "no")
"""Whether this run explores many random examples (LOOPKIT_DEEP=1) instead of CI's few."""
DEEP_FACTOR = int(_RAW) if DEEP and _RAW.isdigit() and int(_RAW) > 1 else 10
"""How many times CI's budget a deep run draws (LOOPKIT_DEEP=1: 10)."""
SEED: int = int(os.environ.get("LOOPKIT_SEED", "") or random.SystemRandom().randrange(2**32))
"""The seed of a deep run's random examples (printed with every failure)."""


def budget(ci: int) -> int:
    """The number of examples a property draws: ``ci`` in CI, DEEP_FACTOR times it deep."""
    return ci * DEEP_FACTOR if DEEP else ci


def examples(ci: int, *, shrink: bool = True, **more: Any) -> settings:
    """Hypothesis settings for a property: ``budget(ci)`` examples, no deadline, no database.

    CI: derandomized (the same examples every run). Deep: random, from ``SEED``.
    Health checks are off: the examples are tiny trainings, slow by hypothesis's standards.
    """
    phases = [Phase.explicit, Phase.reuse, Phase.generate] + ([Phase.shrink] if shrink else [])
    return settings(
        max_examples=budget(ci),
        deadline=None,
        derandomize=not DEEP,
        database=None,
        phases=phases,
        suppress_health_check=list(HealthCheck),
        print_blob=True,
        **more,
    )


def where() -> str:
    """How to reproduce this run's examples, for failure messages."""
    if DEEP:
        return f"LOOPKIT_DEEP={_RAW} LOOPKIT_SEED={SEED}"
    return "CI examples (derandomized)"


def prop(ci: int, **more: Any) -> Callable[[F], F]:
    """Decorate a ``@given`` test: ``examples(ci)``, and deep runs seeded from ``SEED``."""

    def apply(fn: F) -> F:
        fn = examples(ci, **more)(fn)
        return seed(SEED)(fn) if DEEP else fn

    return apply


def draw(strategy: st.SearchStrategy[Any], ci: int) -> list[Any]:
    """``budget(ci)`` examples of ``strategy``, the same list in every process of a run.

    What a torchrun worker iterates over: derandomized in CI; seeded from ``SEED`` (which
    the launcher passes to every rank) in deep runs. Simple examples come first.
    """
    drawn: dict[str, Any] = {}

    @examples(ci, shrink=False)
    @given(strategy)
    def collect(value: Any) -> None:
        drawn.setdefault(repr(value), value)  # hypothesis may draw one example twice

    (seed(SEED)(collect) if DEEP else collect)()
    return list(drawn.values())
