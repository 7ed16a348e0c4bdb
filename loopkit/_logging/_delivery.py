"""Handing a flush to its sinks: the x-axis, each sink's keywords, and a failing sink isolated.

A sink is called ``sink(metrics)``, plus ``step=`` and ``axes=`` where it declares those
keywords. ``step`` is the x-axis every tracker plots against: the optimizer-update count
when the log belongs to a loopkit step (its ``clock``), else the number of ``log`` calls.
``axes`` adds the other x-axes known: ``updates``, ``epoch``, ``samples``, ``tokens``.

A sink that raises (a tracker's network error) never stops training: the failure is
reported once per sink, as a ``loopkit.SinkFailedWarning``, and the other sinks still get
the metrics; the failing sink is tried again at the next flush.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .._errors import SinkFailedWarning


def takes_keyword(sink: Callable[..., object], name: str) -> bool:
    """Whether ``sink`` can be called with the keyword ``name``."""
    try:
        params = inspect.signature(sink).parameters
    except (TypeError, ValueError):  # builtins such as print have no signature
        return False
    p = params.get(name)
    if p is not None and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD):
        return True
    return any(q.kind is q.VAR_KEYWORD for q in params.values())


def as_sinks(sink: object) -> list[Callable[..., object]]:
    """The sinks ``sink=`` names (None, one callable, or a list/tuple of them), checked."""
    if sink is None:
        return []
    sinks: list[Any] = list(sink) if isinstance(sink, (list, tuple)) else [sink]
    for s in sinks:
        if not callable(s):
            raise TypeError(
                f"sink must be callable with a dict of floats (e.g. print), or a list of "
                f"them, got {s!r}"
            )
    return sinks


class Delivery:
    """The sinks of one ``detach_logging``, how each is called, and which have failed."""

    __slots__ = ("_axes", "_failed", "_step", "sinks")

    def __init__(self, sinks: Sequence[Callable[..., object]]) -> None:
        self.sinks = list(sinks)
        self._step = [takes_keyword(s, "step") for s in self.sinks]
        self._axes = [takes_keyword(s, "axes") for s in self.sinks]
        self._failed: set[int] = set()  # indices of the sinks already reported

    def send(self, metrics: dict[str, float], step: int, axes: dict[str, float]) -> None:
        """Call every sink; a sink that raises is reported once and the rest still run."""
        for i, sink in enumerate(self.sinks):
            kwargs: dict[str, Any] = {}
            if self._step[i]:
                kwargs["step"] = step
            if self._axes[i]:
                kwargs["axes"] = dict(axes)
            try:
                sink(dict(metrics), **kwargs)
            except Exception as err:  # a sink's failure is its own, never the training's
                if i not in self._failed:
                    self._failed.add(i)
                    warnings.warn(
                        f"the sink {sink!r} failed at step {step} ({type(err).__name__}: "
                        f"{err}); training goes on and the other sinks still get the metrics. "
                        "It is tried again at every flush; this is reported once",
                        SinkFailedWarning,
                        stacklevel=4,
                    )

    def config(self, params: Mapping[str, Any]) -> None:
        """Give the hyperparameters to every sink that takes them (``sink.config``)."""
        for sink in self.sinks:
            method = getattr(sink, "config", None)
            if callable(method):
                method(dict(params))

    def state_dict(self) -> list[Any]:
        """Each sink's state (a tracker's run id and last step), None for a stateless one."""
        return [s.state_dict() if _stateful(s) else None for s in self.sinks]  # type: ignore[attr-defined]

    def check_state(self, states: object) -> list[Any]:
        """``states`` as ``state_dict`` gave it, for these sinks; refused before any change."""
        if not isinstance(states, list) or len(states) != len(self.sinks):
            raise ValueError(
                f"the log's state holds {len(states) if isinstance(states, list) else '?'} "
                f"sink states but this log has {len(self.sinks)} sinks: build the log with the "
                "same sinks, in the same order, as the run that saved it"
            )
        for sink, state in zip(self.sinks, states, strict=True):
            if (state is None) == _stateful(sink):
                raise ValueError(
                    f"the saved sink states do not match this log's sinks at {sink!r}: build "
                    "the log with the same sinks, in the same order, as the run that saved it"
                )
            check = getattr(sink, "check_state_dict", None)
            if state is not None and callable(check):
                check(state)  # a tracker: its state's form, and that it has not started yet
        return states

    def load_state_dict(self, states: list[Any]) -> None:
        """Give each stateful sink its state back (checked by ``check_state`` first)."""
        for sink, state in zip(self.sinks, states, strict=True):
            if state is not None:
                sink.load_state_dict(state)  # type: ignore[attr-defined]

    def close(self) -> None:
        """Close every sink that can be closed (a tracker's run ends)."""
        for sink in self.sinks:
            method = getattr(sink, "close", None)
            if callable(method):
                method()


def _stateful(sink: object) -> bool:
    return callable(getattr(sink, "state_dict", None)) and callable(
        getattr(sink, "load_state_dict", None)
    )
