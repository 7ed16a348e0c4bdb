"""A loader with no state of its own (a plain ``DataLoader`` over an ``IterableDataset``),
resumed by reading it again up to the saved place: ``replayed``, an explicit opt-in.

Its state is the batches handed out in the current pass and the RNG states the pass
started with (a ``DataLoader`` draws its workers' seeds as a pass starts). A resume starts
the pass again from those states and reads, and drops, as many batches as the loop had
consumed: the same batches follow, with the same random augmentation in workers. Reading
them costs what the skipped part of the pass costs; it is printed when it happens
(``benchmarks/streaming.py`` measures it against a stateful loader's resume).

With ``num_workers=0`` the data set runs in this process, between the loop's own random
draws (and ``iterate`` may take a batch ahead of a save): a data set that draws from the
global RNGs as it yields is not reproduced by a replay there. With workers it is (each
worker's RNG is seeded from the pass's start), as is a data set that seeds itself
(``loopkit.stream_shards``).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Generic, TypeVar

import torch

from .. import _ranks

T = TypeVar("T")

MARK = "loopkit.replayed"


class replayed(Generic[T]):
    """``loader``, resumable by reading its current pass again up to the saved place.

    An opt-in for a loader that cannot save its place (a ``DataLoader`` over an
    ``IterableDataset``): ``Checkpointer(loader=loopkit.replayed(loader))``. Exact when the
    pass gives the same batches when started from the same RNG states (a stream read in a
    fixed order, with workers or without random draws in this process). A loader with a
    ``state_dict`` of its own (torchdata's ``StatefulDataLoader``) resumes at once: use it.
    """

    def __init__(self, loader: Iterable[T]) -> None:
        if not isinstance(loader, Iterable):
            raise TypeError(f"loader must be iterable, got {type(loader).__name__}")
        if callable(getattr(loader, "state_dict", None)):
            raise TypeError(
                f"{type(loader).__name__} saves its own place (it has state_dict()): give it "
                "to the Checkpointer as it is (loader=...), which resumes it without reading "
                "the stream again"
            )
        self.loader = loader
        self.passes = 0
        """Passes read to their end."""
        self._taken = 0  # batches handed out in the current pass
        self._start: dict[str, torch.Tensor] | None = None  # RNG states the pass started with
        self._loaded: Mapping[str, Any] | None = None

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]  # raises TypeError without one

    def _rngs(self) -> dict[str, torch.Tensor]:
        states = {"torch": torch.get_rng_state()}
        generator = getattr(self.loader, "generator", None)
        if isinstance(generator, torch.Generator):
            states["generator"] = generator.get_state()
        return states

    def _set_rngs(self, states: Mapping[str, torch.Tensor]) -> None:
        torch.set_rng_state(states["torch"])
        generator = getattr(self.loader, "generator", None)
        if isinstance(generator, torch.Generator) and "generator" in states:
            generator.set_state(states["generator"])

    def __iter__(self) -> Iterator[T]:
        loaded, self._loaded = self._loaded, None
        if loaded is None or loaded["start"] is None:
            self._start, self._taken = self._rngs(), 0
            return self._pass(iter(self.loader), 0)
        # The pass is started from the RNG states it started with (its workers' seeds are
        # drawn now), then this process's states are put back: the loop's draws go on.
        now = self._rngs()
        self._set_rngs(loaded["start"])
        try:
            it = iter(self.loader)
            begun = self._rngs()  # the states right after the pass began: its first batch's
        finally:
            self._set_rngs(now)
        self._start, self._taken = dict(loaded["start"]), 0
        return self._pass(it, int(loaded["taken"]), begun)

    def _pass(
        self, it: Iterator[T], skip: int, start: Mapping[str, torch.Tensor] | None = None
    ) -> Iterator[T]:
        if skip:
            began = time.perf_counter()
            # The skipped batches' draws in this process (a data set run here) were made
            # before the save: the RNG states loaded hold them, and are put back after. The
            # first batch is taken from the pass's starting states: a sampler draws its order
            # as its first index is asked for, right after the pass began (``start``).
            now = self._rngs()
            if start is not None:
                self._set_rngs(start)
            for k in range(skip):
                try:
                    next(it)
                    if k == 0:
                        self._set_rngs(now)
                except StopIteration:
                    self._set_rngs(now)
                    raise RuntimeError(
                        f"loopkit.replayed: the resumed pass ended after {self._taken} batches, "
                        f"before the {skip} the saved run had consumed: the loader does not "
                        "give the same batches again (another data set, order or batch size)"
                    ) from None
                self._taken += 1
            self._set_rngs(now)
            if _ranks.world()[0] == 0:
                print(
                    f"loopkit.replayed: read {skip} batches again to resume the stream's place "
                    f"in {time.perf_counter() - began:.2f} s (a loader with a state_dict, such "
                    "as torchdata's StatefulDataLoader, resumes at once)",
                    file=sys.stderr,
                    flush=True,
                )
        for batch in it:
            self._taken += 1  # counted before it is handed out: a save after has it consumed
            yield batch
        self.passes += 1
        self._start, self._taken = None, 0

    def state_dict(self) -> dict[str, Any]:
        """The passes read, the batches handed out in this pass and its starting RNG states."""
        if self._loaded is not None:
            return dict(self._loaded)
        return {"loopkit": MARK, "passes": self.passes, "taken": self._taken, "start": self._start}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Replay to ``state``'s place when the next pass starts (checked now)."""
        if not isinstance(state, Mapping) or state.get("loopkit") != MARK:
            raise ValueError("not a loopkit.replayed state: load what its state_dict() gave")
        taken, start = state.get("taken"), state.get("start")
        if not isinstance(taken, int) or taken < 0 or (taken and not isinstance(start, Mapping)):
            raise ValueError(f"damaged loopkit.replayed state: {dict(state)!r:.200}")
        self.passes = int(state.get("passes", 0))
        self._loaded = state
