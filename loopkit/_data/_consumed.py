"""Where a stateful loader stands as of the batches the loop consumed, whatever was fetched ahead.

``step.iterate`` looks one batch ahead (``_step._last_batch``): while the loop holds batch
``k``, batch ``k + 1`` has been taken from the loader, so the loader's own ``state_dict()``
is already past a batch the loop has not seen. A save must hold the state after ``k``.

For a loader a Checkpointer saves (``watch``: its ``extra=`` objects), iterate reads the
loader's ``state_dict()`` right before each batch it takes ahead of the loop (``Tracker``),
and a save reads ``state_of``: that recorded state while the loop holds a batch taken ahead,
the loader's own otherwise (a pass that ran out, or a loader read without a lookahead). The
loader's own prefetching (its workers' queues) is the loader's business: its state_dict
accounts for it. A loader no Checkpointer saves, and one without ``state_dict`` (a plain
DataLoader), is read with no recording at all.

A loop left with a batch taken ahead (``break``, an exception) keeps the recorded state
for a save after the loop, as long as the loader has not moved since (its ``state_dict()``
is still what it was when the loop was left); a loader moved since (read by hand, loaded)
is saved as it stands.
"""

from __future__ import annotations

import copy
import functools
import pickle
import weakref
from collections.abc import Callable, Mapping

import numpy as np
import torch

_watched: dict[int, Callable[[], object]] = {}
"""id -> a reference to each object a Checkpointer saves (weak where the object allows)."""


class _Held:
    """A loader's state as of the batches the loop consumed, while it differs from its own."""

    __slots__ = ("left", "state")

    def __init__(self, state: object) -> None:
        self.state = state
        self.left: object = _OPEN
        """The loader's own state when the loop was left (``_OPEN`` while it runs)."""


_OPEN = object()
_UNKNOWN = object()
_held: dict[int, _Held] = {}


def watch(obj: object) -> None:
    """A Checkpointer saves ``obj``'s state: iterate records it before each batch taken ahead."""
    key = id(obj)
    ref: Callable[[], object]
    try:
        ref = weakref.ref(obj, functools.partial(_forget, key))
    except TypeError:  # not weakly referenceable: kept for the process's life
        ref = functools.partial(_itself, obj)
    _watched[key] = ref


def _forget(key: int, _ref: object) -> None:
    _watched.pop(key, None)
    _held.pop(key, None)


def _itself(obj: object) -> object:
    return obj


def saved(source: object) -> bool:
    """Whether a Checkpointer saves ``source`` (a resume puts its place back)."""
    ref = _watched.get(id(source))
    return ref is not None and ref() is source


def tracker(source: object) -> Tracker | None:
    """The recorder for a pass over ``source``; None unless a Checkpointer saves its state
    (once per pass: a source nobody saves costs nothing per batch)."""
    ref = _watched.get(id(source))
    if ref is None or ref() is not source:
        return None
    _held.pop(id(source), None)  # a new pass: an earlier pass's record no longer applies
    state_dict = getattr(source, "state_dict", None)
    return Tracker(source, state_dict) if callable(state_dict) else None


class Tracker:
    """Records a pass's states for ``state_of``; made by ``tracker``, called by iterate."""

    __slots__ = ("_held", "_key", "_read")

    def __init__(self, source: object, read: Callable[[], object]) -> None:
        self._key = id(source)
        self._read = read
        self._held: _Held | None = None

    def take(self) -> object:
        """The loader's state now, before a batch is taken ahead of the loop: what a save
        holds once that batch is taken and the loop has the one before it. One
        ``state_dict()`` call and a copy (``_copied``) per batch: a loader may hand out its
        live state, or containers of it, which the batch taken next changes (whether it
        does cannot be told from a few calls: one may rebuild its dict as a pass starts)."""
        return _copied(self._read())

    def hold(self, state: object) -> None:
        """The batch was taken ahead and the loop is handed the one before it: a save now
        holds ``state`` (from ``take``). A batch that could not be taken (an error) leaves
        the previous one held: the loop never had the batch before it."""
        held = self._held
        if held is None:
            self._held = _held[self._key] = _Held(state)
        else:
            held.state = state

    def ended(self) -> None:
        """The pass ran out after the loop's last batch: the loader's own state is right."""
        if self._held is not None and _held.get(self._key) is self._held:
            del _held[self._key]

    def left(self) -> None:
        """The loop was left (break, exception) holding a batch taken ahead: a save after it
        holds the recorded state for as long as the loader does not move."""
        held = self._held
        if held is not None and _held.get(self._key) is held and held.left is _OPEN:
            try:
                held.left = self._read()
            except Exception:  # not readable now: a later save takes the loader's own state
                held.left = _UNKNOWN


def state_of(obj: object, own: Callable[[], object]) -> object:
    """What a save holds of ``obj``, whose own state ``own()`` gives (in plain containers: a
    checkpoint is read back with ``weights_only``)."""
    return _plain(_state_of(obj, own))


def _state_of(obj: object, own: Callable[[], object]) -> object:
    held = _held.get(id(obj))
    if held is None:
        return own()
    if held.left is _OPEN:  # the loop over it runs, holding a batch taken ahead
        return held.state
    now = own()
    if held.left is not _UNKNOWN and same_state(now, held.left):
        return held.state
    _held.pop(id(obj), None)  # moved since the loop was left: its own state is the truth
    return now


def _plain(value: object) -> object:
    """``value`` with each ``Kept`` a tuple (the containers holding one rebuilt, no copy of
    the rest)."""
    if isinstance(value, Kept):
        return tuple(value)
    if type(value) is dict:
        return {k: _plain(v) for k, v in value.items()}
    if type(value) is list:
        return [_plain(v) for v in value]
    if type(value) is tuple:
        return tuple(_plain(v) for v in value)
    return value


def same_state(a: object, b: object) -> bool:
    """Whether two states hold the same values (tensors and arrays compared by value)."""
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return (
            type(a) is type(b)
            and len(a) == len(b)
            and all(same_state(x, y) for x, y in zip(a, b, strict=True))
        )
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a, b))
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        return a.dtype == b.dtype and bool(np.array_equal(a, b))
    try:
        equal = a == b
        if isinstance(equal, (bool, np.bool_)):
            return bool(equal)
    except Exception:  # an object that cannot be compared: by its bytes below
        pass
    try:
        return pickle.dumps(a) == pickle.dumps(b)
    except Exception:  # neither comparable nor picklable: taken as moved
        return False


class Kept(tuple):  # type: ignore[type-arg]
    """A part of a state its owner never changes once handed out (a shuffle buffer's slots,
    copied as it is taken): kept as it is by ``_copied``, with no copy of what it holds."""

    __slots__ = ()


_IMMUTABLE = (int, float, complex, str, bytes, bool, type(None), frozenset, range, Kept)


def _copied(value: object) -> object:
    """``copy.deepcopy(value)``, its dicts, lists and tuples rebuilt by hand and immutable
    values kept (a loader's state is mostly those: a fraction of deepcopy's cost)."""
    if isinstance(value, _IMMUTABLE):
        return value
    if type(value) is dict:
        return {k: _copied(v) for k, v in value.items()}
    if type(value) is list:
        return [_copied(v) for v in value]
    if type(value) is tuple:
        return tuple(_copied(v) for v in value)
    if type(value) is torch.Tensor and not value.requires_grad:
        return value.clone()
    return copy.deepcopy(value)
