"""loopkit's own calls under ``torch.compile``: run eagerly, never traced into a graph.

A step's bookkeeping (its counters, autocast entered in one call and left in another, the
guards that read the caller's frame) cannot live in a graph: traced, autocast's state to
restore would be entered inside a graph and left outside it, and every counter change
would be a guard and a recompile. Each entry point asks
``torch.compiler.is_dynamo_compiling()`` (which dynamo folds to True while tracing: in an
eager loop one call that returns False, without ``torch.compiler.is_compiling``'s TorchScript
check) and, while traced, runs itself through ``eagerly``, a graph break; only the user's code
between them (the forward) compiles.

The entry points call it through its attribute path, written out where they ask (not through
a helper: that would be one more Python call per ask, three to five per micro-step): dynamo
folds the call to True only when it sees that path; a module-level alias of the same function
is traced as an ordinary call that returns False (then ``autocast`` entered in a graph is left
outside it: shared/repros/edges3/r3_16). ``tests/compile/test_compiled_micro_step.py`` traces
a whole micro-step of ``step``, and of ``accumulate`` with ``autocast_step``.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from types import TracebackType
from typing import Any, ParamSpec, TypeVar

import torch
from typing_extensions import Self

P = ParamSpec("P")
R = TypeVar("R")


def _call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return fn(*args, **kwargs)


_eager_call = torch.compiler.disable(_call)  # type: ignore[no-untyped-call]


def eagerly(fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
    """``fn(*args, **kwargs)`` run eagerly: called from traced code, a graph break."""
    out: R = _eager_call(fn, *args, **kwargs)
    return out


class EagerUnderCompile(abc.ABC):
    """A context manager whose ``_enter``/``_exit`` run eagerly under ``torch.compile``."""

    @abc.abstractmethod
    def _enter(self) -> Self:
        """What ``__enter__`` does."""

    @abc.abstractmethod
    def _exit(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        """What ``__exit__`` does."""

    def __enter__(self) -> Self:
        if torch.compiler.is_dynamo_compiling():  # traced: run eagerly (module docstring)
            return eagerly(self._enter)
        return self._enter()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        if torch.compiler.is_dynamo_compiling():
            return eagerly(self._exit, exc_type, exc, tb)
        return self._exit(exc_type, exc, tb)


class EagerStance:
    """Compiled code runs eagerly while any EagerStance is entered (``set_stance``).

    What counts ops (loopkit's host-sync counter, torch's FLOP counter) sees nothing inside
    a compiled graph, and a first call of compiled code under such a mode makes dynamo
    skip that code for the rest of the run: a step measured so must run eagerly instead.
    Entered and left as one object (``__enter__`` in one call, ``__exit__`` in another);
    several may be entered and left in any order (one count for the process: the stance
    before the first is restored when the last leaves); free when dynamo is not loaded.
    """

    __slots__ = ("_entered",)
    _open = 0  # entered EagerStances, all objects
    _stance: Any = None  # the set_stance context the first one entered

    def __init__(self) -> None:
        self._entered = False

    @staticmethod
    def active() -> bool:
        """Whether compiled code runs eagerly now (an EagerStance is entered)."""
        return EagerStance._open > 0

    def __enter__(self) -> None:
        import sys

        if self._entered or "torch._dynamo" not in sys.modules:
            return
        if torch.compiler.is_compiling():
            return
        cls = EagerStance
        if cls._open == 0:
            stance = torch.compiler.set_stance("force_eager")
            stance.__enter__()
            cls._stance = stance
        cls._open += 1
        self._entered = True

    def __exit__(self, *exc: object) -> None:
        if not self._entered:
            return
        self._entered = False
        cls = EagerStance
        cls._open -= 1
        if cls._open == 0:
            stance, cls._stance = cls._stance, None
            stance.__exit__(None, None, None)
