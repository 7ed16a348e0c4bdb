"""A loaded loader's first iterator draws nothing from this process's RNG.

torchdata's ``StatefulDataLoader`` (like ``DataLoader``) draws its workers' base seed from
the global torch RNG (or its ``generator=``) each time it makes an iterator; loading a state
makes its next iterator the loaded pass's, and that iterator then sets the saved seeds over
the drawn ones. The run that saved had drawn for that pass before the save (its RNG states
in the checkpoint hold the draw), so the resumed run's draw would be one too many: dropout
and noise after a resume would differ from the uninterrupted run's. ``quiet_first_iterator``
makes the loaded pass's iterator with the RNG states put back; a pass after it draws as
usual (a loaded pass that had ended is followed at once by a new pass, which draws, as the
run that saved would have).

The hook is an attribute of the loader object itself, removed by its first use: its class,
``type()`` and everything else stay the loader's own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import RandomSampler, SubsetRandomSampler, WeightedRandomSampler

_HOOK = "_get_iterator"


def quiet_first_iterator(loader: object, then: Callable[[], object] | None = None) -> None:
    """The next iterator ``loader`` makes (the loaded pass's) leaves the RNG states as they
    were; ``then`` runs once it is made. Only a loader that takes a loaded state into its
    next iterator (torchdata's ``next_iter_state``, made in ``_get_iterator``)."""
    cls = type(loader)
    if not (callable(getattr(cls, _HOOK, None)) and hasattr(loader, "next_iter_state")):
        return
    undo(loader)
    object.__setattr__(loader, _HOOK, _FirstIterator(loader, then))


class _FirstIterator:
    """The loader's ``_get_iterator`` for its loaded pass (an attribute of the loader object,
    picklable with it, removed by its first call)."""

    __slots__ = ("loader", "then")

    def __init__(self, loader: object, then: Callable[[], object] | None) -> None:
        self.loader, self.then = loader, then

    def __call__(self) -> Any:
        loader = self.loader
        undo(loader)  # once: later passes draw as usual
        generator = getattr(loader, "generator", None)
        own = generator.get_state() if isinstance(generator, torch.Generator) else None
        state = torch.get_rng_state()
        try:
            it = getattr(type(loader), _HOOK)(loader)
            _finish_ended_pass(it)
            return it
        finally:
            torch.set_rng_state(state)
            if own is not None:
                generator.set_state(own)  # type: ignore[union-attr]  # a Generator
            if self.then is not None:
                self.then()


def undo(loader: object) -> None:
    """Take back a waiting ``quiet_first_iterator`` (a failed resume, a new load)."""
    hook = vars(loader).get(_HOOK) if hasattr(loader, "__dict__") else None
    if isinstance(hook, _FirstIterator):
        object.__delattr__(loader, _HOOK)


def _finish_ended_pass(it: object) -> None:
    """A loaded pass that had ended (torchdata's fetcher of an iterable data set, no workers)
    hands out nothing, but its data set was given the saved place (the pass's end) for an
    iteration torchdata never starts: that iteration runs now (it ends at once, its draws
    undone with the rest), so the next pass starts the data set afresh, as in the run that
    saved (else that pass is a second empty one, and draws a seed the saved run did not)."""
    fetcher = getattr(it, "_dataset_fetcher", None)
    rest = getattr(fetcher, "dataset_iter", None)
    if rest is not None and getattr(fetcher, "ended", False) is True:
        for _ in rest:  # (nothing is left: the saved pass had ended)
            pass


def own_state(loader: object, state_dict: Callable[[], object]) -> Callable[[], object]:
    """What gives ``loader``'s own state for a save: ``state_dict``, or, for torchdata's
    loader loaded and not iterated since, the state loaded into it (its ``state_dict()``
    would start an iterator whose iterable data set, given the state only as its pass
    starts, reports the stream's start: a save right after a resume would hold the start)."""
    pending = getattr(loader, "next_iter_state", None)
    if pending is None or getattr(loader, "_iterator", None) is not None:
        return state_dict
    return lambda: pending


def refuse_unsaved_order(loader: object, where: str) -> None:
    """Refuse torchdata's loader over one of torch's random samplers (no ``state_dict``):
    torchdata resumes such a pass by drawing a new order and skipping as many indices, so
    the rest of the pass repeats some samples and skips others."""
    if not hasattr(loader, "next_iter_state"):
        return
    batches = getattr(loader, "batch_sampler", None)
    for sampler in (getattr(loader, "sampler", None), getattr(batches, "sampler", None)):
        if isinstance(
            sampler, (RandomSampler, SubsetRandomSampler, WeightedRandomSampler)
        ) and not callable(getattr(sampler, "state_dict", None)):
            raise TypeError(
                f"{where} is a StatefulDataLoader over torch's {type(sampler).__name__}, "
                "which cannot save its order: torchdata resumes its pass in a new order, "
                "repeating some samples and skipping others. Build it with shuffle=True "
                "(torchdata's own RandomSampler, saved with the loader) or "
                "sampler=torchdata.stateful_dataloader.sampler.RandomSampler(data set, "
                "generator=...)"
            )
