"""A checkpoint's pieces: the contract every stateful part of a run meets, and resume's
all-or-nothing check and load over them.

The Checkpointer holds ``{file key: piece}`` and treats every piece alike: a save stores
each ``state_dict()`` under its key; a resume first calls every ``check_state_dict``
(which raises ``CheckpointError`` saying what does not fit, and changes nothing), then
loads piece after piece, each after its ``snapshot()``, and if a load fails puts every
piece loaded so far back with ``restore``. A new stateful part of a run (an EMA of the
weights, a stop condition) plugs in as a piece, through ``extra=``, with no change to the
Checkpointer. The pieces for loopkit's own objects are in ``_pieces``, ``_step_state``,
``_amp_state`` and ``_rng``.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Collection, Mapping, Sequence
from typing import Any, Protocol, TypeVar, runtime_checkable

from .. import _ranks
from .._data import _consumed
from .._errors import CheckpointError
from .._stream._resumed_pass import own_state, refuse_unsaved_order
from .._types import Stateful

T = TypeVar("T")


@runtime_checkable
class StatePiece(Protocol):
    """What a Checkpointer needs of each part of a run it saves and restores.

    States and snapshots are the piece's own business: the Checkpointer only stores them
    and hands them back (so a piece may type what it takes back as narrowly as it likes).
    A piece with ``per_rank = True`` saves one state per rank: the Checkpointer gathers
    them on save and gives each rank its own on resume.
    """

    def state_dict(self) -> object: ...
    def check_state_dict(self, saved: object, /) -> None: ...
    def snapshot(self) -> object: ...
    def load_state_dict(self, saved: Any, /) -> object: ...
    def restore(self, snapshot: Any, /) -> None: ...


def expect(value: object, kind: type[T] | tuple[type[T], ...], label: str) -> T:
    """``value`` if it is a ``kind`` (never a bool); else a CheckpointError naming ``label``."""
    if not isinstance(value, kind) or isinstance(value, bool):
        name = getattr(kind, "__name__", "the expected type")
        raise CheckpointError(
            f"damaged checkpoint: {label} is a {type(value).__name__}, not {name}"
        )
    return value


def need(
    where: Mapping[str, object], key: str, kind: type[T] | tuple[type[T], ...], label: str
) -> T:
    """``where[key]``, checked to be a ``kind``; a CheckpointError naming ``label`` if not."""
    if key not in where:
        raise CheckpointError(f"incomplete checkpoint: {label} is missing")
    return expect(where[key], kind, label)


def copied(state: T) -> T:
    """A copy of a small object's state dict that its later loads cannot change."""
    try:
        return copy.deepcopy(state)
    except Exception:  # an uncopyable user state: the reference is the best there is
        return state


class UserState:
    """A user's ``Stateful`` (a scheduler, an ``extra=`` object), saved and loaded as it is."""

    per_rank = False

    def __init__(self, obj: Stateful) -> None:
        self.obj = obj

    def state_dict(self) -> object:
        return self.obj.state_dict()

    def check_state_dict(self, saved: object) -> None:
        """Nothing to check: the object's own ``load_state_dict`` judges its state."""

    def snapshot(self) -> object:
        return copied(self.obj.state_dict())

    def load_state_dict(self, saved: object) -> None:
        self.obj.load_state_dict(saved)

    def restore(self, snapshot: object) -> None:
        self.obj.load_state_dict(snapshot)


class ExtraStates:
    """The ``extra=`` objects, under the file's ``"extra"`` key by name.

    An object that is a whole ``StatePiece`` (it checks, snapshots and restores itself)
    is used as it is; any other ``Stateful`` is wrapped in a ``UserState``. A loader among
    them that the loop reads through ``step.iterate`` is saved at the place after the
    batches the loop consumed, not past the batch iterate took ahead (``_data._consumed``).
    """

    per_rank = False

    def __init__(self, extra: Mapping[str, object]) -> None:
        self.pieces: dict[str, StatePiece] = {}
        for name, obj in extra.items():
            if isinstance(obj, StatePiece):
                self.pieces[name] = obj
            elif isinstance(obj, Stateful):
                self.pieces[name] = UserState(obj)
            else:
                raise TypeError(
                    f"extra[{name!r}] has no state_dict()/load_state_dict(): wrap it in an "
                    "object that has them"
                )
        for name, obj in extra.items():
            refuse_unsaved_order(obj, f"extra[{name!r}]")
        self._objects = dict(extra)
        self._refuse_loaders()
        for obj in self._objects.values():
            _consumed.watch(obj)  # iterate records its state only if it reads this object

    def _refuse_loaders(self) -> None:
        """A loader's place differs by rank; ``extra=`` saves one state for all (rank 0's)."""
        world = _ranks.world()[1]
        if world == 1:
            return
        for name, obj in self._objects.items():
            if _is_data(obj):
                raise TypeError(
                    f"extra[{name!r}] is a data loader ({type(obj).__name__}): with {world} "
                    "processes each rank reads its own part of the data, and extra= saves one "
                    "state for every rank (rank 0's), so the other ranks would resume at rank "
                    f"0's place. Pass it as Checkpointer(loader=...), which saves each rank's"
                )

    def state_dict(self) -> dict[str, object]:
        self._refuse_loaders()  # a process group set up after the Checkpointer was built
        states: dict[str, object] = {}
        for name, piece in self.pieces.items():
            obj = self._objects[name]
            states[name] = _consumed.state_of(obj, own_state(obj, piece.state_dict))
        return states

    def check_state_dict(self, saved: object) -> None:
        states = expect(saved, Mapping, "'extra'")
        differ = set(self.pieces) ^ set(states)
        if differ:
            raise CheckpointError(
                f"extra objects differ ({sorted(differ)}): pass the same extra= as when saving"
            )
        for name, piece in self.pieces.items():
            piece.check_state_dict(states[name])

    def snapshot(self) -> dict[str, object]:
        return {name: piece.snapshot() for name, piece in self.pieces.items()}

    def load_state_dict(self, saved: Mapping[str, object]) -> None:
        from .._stream._resumed_pass import quiet_first_iterator

        for name, piece in self.pieces.items():
            piece.load_state_dict(saved[name])
            if _is_data(self._objects[name]):
                quiet_first_iterator(self._objects[name])  # its pass drew before the save

    def restore(self, snapshot: Mapping[str, object]) -> None:
        # All of them: putting back one that was not loaded yet loads its own state again.
        for name, piece in reversed(self.pieces.items()):
            piece.restore(snapshot[name])


def _is_data(obj: object) -> bool:
    """Whether ``obj`` is a loader or a streamed data set whose place differs by rank (a
    ``distributed.loader``'s state is the job's, the same on every rank)."""
    from torch.utils.data import DataLoader, IterableDataset

    from .._data._epoch_loader import EpochLoader
    from .._stream._replay import replayed

    if isinstance(obj, EpochLoader):
        return False
    return isinstance(obj, (DataLoader, IterableDataset, replayed))


def per_rank(piece: StatePiece) -> bool:
    """Whether ``piece`` saves one state per rank (the file holds them all, in rank order)."""
    return bool(getattr(piece, "per_rank", False))


def optional(piece: object) -> bool:
    """Whether a file may lack ``piece``'s entry (a piece loopkit adds by itself)."""
    return bool(getattr(piece, "optional", False))


def warn_missing(name: str) -> None:
    """Say that an optional piece the file lacks keeps its current state."""
    warnings.warn(
        f"the checkpoint holds no {name!r} state (written by a Checkpointer that did not save "
        f"it): {name} keeps its current state, as it is after it was built",
        stacklevel=4,
    )


def saved_for(state: Mapping[str, object], name: str, piece: StatePiece) -> object:
    """What ``piece`` loads from ``state``: its entry, or this rank's in a per-rank one."""
    if not per_rank(piece):
        return state[name]
    rank, world = _ranks.world()
    states = expect(state[name], (list, tuple), f"'{name}'")
    if len(states) != world:
        raise CheckpointError(
            f"damaged checkpoint: '{name}' holds {len(states)} states for {world} ranks"
        )
    return states[rank]


def spread(
    pieces: Mapping[str, StatePiece], state: Mapping[str, object], world: int
) -> dict[str, object]:
    """``state`` as ``world`` ranks load it when another number of ranks saved it: each
    per-rank piece's states replaced by its ``reseeded(states, world)`` (fresh streams)."""
    out = dict(state)
    for name, piece in pieces.items():
        if not per_rank(piece) or name not in state:
            continue
        states = expect(state[name], (list, tuple), f"'{name}'")
        reseeded = getattr(piece, "reseeded", None)
        if not states or reseeded is None:
            raise CheckpointError(
                f"'{name}' holds one state per rank, which cannot be given to {world} ranks: "
                f"resume with the {len(states)} processes that saved it"
            )
        out[name] = reseeded(states, world)
    return out


def check_all(
    pieces: Mapping[str, StatePiece],
    state: Mapping[str, object],
    *,
    bookkeeping: Collection[str],
    always_saved: Collection[str],
) -> None:
    """Raise CheckpointError if a piece cannot load its entry of ``state``; changes nothing.

    A piece without an entry means a damaged file if it is one of ``always_saved``, else a
    file saved with other objects; so does an entry no piece claims (but ``bookkeeping``).
    """
    for name, piece in pieces.items():
        if name in state:
            piece.check_state_dict(saved_for(state, name, piece))
        elif optional(piece):
            continue  # added by loopkit where a file from before may lack it: loads without
        elif name in always_saved:
            raise CheckpointError(f"incomplete checkpoint: '{name}' is missing")
        else:
            raise CheckpointError(
                f"the checkpoint has no {name} state but the Checkpointer was built with one: "
                "pass the same objects as when saving"
            )
    for name in state:
        if name not in pieces and name not in bookkeeping:
            raise CheckpointError(
                f"the checkpoint has {name} state but the Checkpointer was built without one: "
                "pass the same objects as when saving"
            )


def load_all(
    pieces: Mapping[str, StatePiece], state: Mapping[str, object], last: Sequence[str]
) -> None:
    """Load each piece's entry of a checked ``state``, those named in ``last`` last, in order.

    If a load raises, every piece loaded so far (the failing one included) is restored,
    newest first, and the error propagates.
    """
    order = sorted(pieces, key=lambda name: last.index(name) if name in last else -1)
    undo: list[tuple[StatePiece, object]] = []
    try:
        for name in order:
            piece = pieces[name]
            if name not in state:  # an optional piece the file lacks (checked): left as is
                warn_missing(name)
                continue
            # The way back is recorded before the load: a load that fails half-way is undone.
            undo.append((piece, piece.snapshot()))
            piece.load_state_dict(saved_for(state, name, piece))
    except BaseException:
        for piece, snapshot in reversed(undo):
            piece.restore(snapshot)
        raise
