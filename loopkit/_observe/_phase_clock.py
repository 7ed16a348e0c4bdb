"""The doctor's clock: seconds per phase, by the host clock or, inside a CUDA step, by events."""

from __future__ import annotations

import time
from typing import TypeAlias

import torch

from ._report import PHASES

# (phase, its start event, its end event once the phase is over)
_Span: TypeAlias = "tuple[str, torch.cuda.Event, torch.cuda.Event | None]"


class PhaseClock:
    """Attribute time to phases; ``begin_step``/``end_step`` bracket each step.

    Inside a step on CUDA each phase boundary records an event, read only by ``resolve``
    (at report time), so timing adds no sync. Outside a step the host clock times the
    phases (the data wait); what no phase claimed between two steps is "between".
    """

    def __init__(self) -> None:
        self.seconds: dict[str, float] = dict.fromkeys(PHASES, 0.0)
        self.cuda = False
        """Whether in-step phases are timed by CUDA events."""
        self.inside = False
        self.first: float | None = None
        """When the first step began (host clock)."""
        self.last_exit: float | None = None
        self._current = ""
        self._mark = 0.0
        self._outside = 0.0  # phase time since the last step (the data wait among it)
        self._spans: list[_Span] = []

    def begin_step(self) -> None:
        """Enter a step: its time is "compute" until another phase is switched to."""
        now = time.perf_counter()
        if self.last_exit is not None:
            # What no phase claimed since the last step (the data wait is claimed by
            # doc.iterate) was the user's code between the steps.
            self.seconds["between"] += max(0.0, now - self.last_exit - self._outside)
        if self.first is None:
            self.first = now
        self._outside = 0.0
        self.inside = True
        self._current = "compute"
        self._mark = now
        if self.cuda:
            self._spans.append(("compute", _cuda_event(), None))

    def end_step(self) -> None:
        """Leave the step (its last phase was closed by ``switch("")``)."""
        self.inside = False
        self.last_exit = time.perf_counter()

    def switch(self, name: str) -> str:
        """Close the current phase and open ``name`` ("" for none); returns the one closed."""
        now = time.perf_counter()
        previous = self._current
        if previous and self.first is not None:  # measured from the first step on
            spent = now - self._mark
            if not (self.cuda and self.inside):  # in-step CUDA phases are timed by events
                self.seconds[previous] += spent
            if not self.inside:
                self._outside += spent
        if self.cuda and self.inside:
            end = _cuda_event()
            if self._spans and self._spans[-1][2] is None:
                label, start, _ = self._spans.pop()
                self._spans.append((label, start, end))
            if name:
                self._spans.append((name, end, None))
        self._current, self._mark = name, now
        return previous

    def resolve(self) -> dict[str, float]:
        """Add the finished CUDA spans to ``seconds`` (one sync, only if there are any)."""
        if self._spans:
            torch.cuda.synchronize()
            for label, start, end in self._spans:
                if end is not None:
                    self.seconds[label] += start.elapsed_time(end) / 1e3
            self._spans = [s for s in self._spans if s[2] is None]
        return self.seconds

    @property
    def wall(self) -> float:
        """Host seconds from the first step's start to the last step's end."""
        if self.last_exit is None or self.first is None:
            return 0.0
        return self.last_exit - self.first


def _cuda_event() -> torch.cuda.Event:
    ev = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]  # torch: unannotated
    ev.record()
    return ev
