"""Resume's decision: the file checked against the run, agreed by every rank, then loaded.

Nothing changes until every rank has found the same file and checked it in full; if a load
still fails (user code in a hook or an extra's ``load_state_dict``), every piece loaded so
far is put back (``_contract.load_all``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import cast

import torch

from .. import _ranks
from .._errors import CheckpointError
from . import _files as files
from . import _from_whole, _sharded, _unreadable
from ._contract import (
    ExtraStates,
    StatePiece,
    UserState,
    check_all,
    load_all,
    need,
    per_rank,
    spread,
)
from ._step_state import StepsState, StepState

BOOKKEEPING = ("format", "world_size", "saves")
"""Entries of a file beside the pieces' states."""
# Pieces every run has, or that come with another: a file without one is incomplete, while
# a file without any other piece was saved by a run built with other objects.
_ALWAYS_SAVED = ("model", "optimizer_shapes", "extra", "rng")
# Loaded last, in this order, after the pieces whose loading runs user code and which have
# cheap copies: the optimizer (its old state tensors are the way back), the RNG states (no
# user code draws after them), the model (no cheap copy; its keys and shapes are checked).
_LOADED_LAST = ("optimizer", "rng", "model")


def check_file(
    pieces: Mapping[str, StatePiece], state: Mapping[str, object], path: Path, reseed: bool = False
) -> Mapping[str, object]:
    """``state`` as this run loads it; CheckpointError if it cannot be loaded; changes nothing.

    Written by another number of processes, it is refused unless ``reseed``: then each
    per-rank piece (the RNG states) gets fresh streams and the pieces whose state depends on
    the number of ranks (the loader's place, the log's interval) judge the change themselves.
    """
    try:
        world = _ranks.world()[1]
        try:
            saved_world = need(state, "world_size", int, "'world_size'")
            if saved_world < 1:
                raise CheckpointError(f"damaged checkpoint: 'world_size' is {saved_world}")
            if need(state, "saves", int, "'saves'") < 0:
                raise CheckpointError("damaged checkpoint: 'saves' is negative")
        except CheckpointError as err:  # what every loopkit file holds: the file is damaged
            raise files.damaged(err) from None
        if saved_world != world:
            if not reseed:
                raise CheckpointError(
                    f"written by {saved_world} process(es), resumed by {world}: each rank's "
                    "random streams (dropout, random augmentation) cannot carry over to "
                    "another number of processes. Resume with ckpt.resume(reseed=True) to "
                    "continue the data where it stopped with fresh streams drawn from the "
                    f"checkpoint (the loader needs the same global_batch_size), or with "
                    f"{saved_world} process(es) to continue bit for bit"
                )
            state = spread(pieces, state, world)
        check_all(pieces, state, bookkeeping=BOOKKEEPING, always_saved=_ALWAYS_SAVED)
    except CheckpointError as err:  # said without the file: name it
        named = files.damaged(CheckpointError(f"{path}: {err}"), files.is_damaged(err))
        raise named from err.__cause__
    return state


def load_file(pieces: Mapping[str, StatePiece], state: Mapping[str, object], path: Path) -> None:
    """Load a checked ``state``; if anything fails, put back what was already loaded."""
    try:
        load_all(pieces, state, last=_LOADED_LAST)
    except (ValueError, KeyError, RuntimeError, TypeError, IndexError) as err:
        raise CheckpointError(
            f"{path}: does not fit this run: {err} (nothing was restored)"
        ) from err


def agreed(target: Path | None, error: Exception | None) -> Exception | None:
    """The error every rank raises unless all found ``target`` and could resume from it.

    Every rank must take the same decision: a rank that went on alone would hang or train
    from other weights. (One host-level collective per resume.)
    """
    reports: list[tuple[str | None, str | None, bool]] = _ranks.gather_objects(
        (None if target is None else str(target), None if error is None else str(error),
         files.is_damaged(error))
    )  # fmt: skip
    # Damaged only where every rank that failed found it damaged (none found a mismatch):
    # every rank then takes the same decision (skip_damaged goes to an older one, or not).
    damaged = all(hurt for _, err, hurt in reports if err is not None)
    if error is not None:
        return files.damaged(error, damaged)
    if len({t for t, _, _ in reports}) > 1:
        listing = ", ".join(f"rank {r}: {t or 'none'}" for r, (t, _, _) in enumerate(reports))
        return CheckpointError(
            f"the ranks found different checkpoints to resume from ({listing}): every rank "
            "must see the same directory (a shared filesystem) and pass the same path"
        )
    for r, (_, err, _) in enumerate(reports):
        if err is not None:
            said = CheckpointError(f"{target}: rank {r} cannot resume from it: {err}")
            return files.damaged(said, damaged)
    return None


def _as_checkpoint_error(err: Exception, target: Path | None) -> Exception:
    """``err`` as the CheckpointError a resume raises (damaged past what the checks name, or
    the move aside failed); the machine's error (I/O, out of memory, a failed collective:
    no damage, ``resume(skip_damaged=True)`` skips nothing for it) as it is."""
    if isinstance(err, CheckpointError) or _unreadable.of_the_machine(err):
        return err
    error = CheckpointError(f"{target}: cannot resume from it: {err!r}")
    error.__cause__ = err
    return error


def _live(pieces: Mapping[str, StatePiece], names: set[str]) -> dict[str, object]:
    """The run's own state of the pieces ``names`` (their layout)."""
    return {name: _laid_out(pieces[name]) for name in names if name in pieces}


def _holding_shards(state: Mapping[str, object]) -> set[str]:
    """The pieces whose saved state holds shards (placeholders)."""
    return {str(path[0]) for path, _ in _sharded.located(state) if path}


def _holding_tensors(state: Mapping[str, object], pieces: Mapping[str, StatePiece]) -> set[str]:
    """The pieces, one state for all ranks, whose saved state holds a tensor (which the run
    may hold sharded)."""
    return {name for name, saved in state.items() if name in pieces
            and not per_rank(pieces[name]) and _from_whole.holds_tensors(saved)}  # fmt: skip


def _laid_out(piece: StatePiece) -> object:
    """``piece``'s state as the run holds it now, where every optimizer (its own piece, or
    one under ``extra=``) that has not stepped yet lays its state out as its parameters: a
    fresh run's optimizer has no state to read the checkpoint's into."""
    if isinstance(piece, ExtraStates):
        return {name: _laid_out(each) for name, each in piece.pieces.items()}
    state = piece.state_dict()
    if isinstance(piece, UserState) and isinstance(piece.obj, torch.optim.Optimizer):
        return _sharded.with_parameter_layout(state, piece.obj)  # OptimizerState's too
    return state


def read_agreed(
    directory: Path,
    target: Path | None,
    pieces: Mapping[str, StatePiece],
    older: Sequence[Path] = (),
    sharded: bool = False,
    reseed: bool = False,
) -> tuple[Mapping[str, object], files.Moves]:
    """``target``'s checked state (empty for None) once every rank could resume from it.

    Rank zero moves the checkpoints newer than ``target`` aside (a new lineage); the moves
    are returned, to be undone if loading fails. Raises the error every rank agreed on,
    with nothing moved; when ``target`` is the newest and unreadable, the error names the
    ``older`` checkpoints that a resume by path can use. ``sharded``: the run's model is
    sharded (the same on every rank): its shards are read once every rank found the file fits;
    a file of whole tensors (one process's, DDP's) gives each rank its part of them.
    ``reseed``: a file written by another number of processes is resumed (``check_file``).
    """
    error: Exception | None = None
    moved: files.Moves = []
    state: Mapping[str, object] = {}
    shards: dict[str, torch.Tensor] = {}
    try:
        if target is not None:
            whole = sharded and not target.is_dir()  # one process's or DDP's, into shards
            with _from_whole.mapped() if whole else contextlib.nullcontext():
                state = files.load_checkpoint(target)
            if whole:
                live = _live(pieces, _holding_tensors(state, pieces))
                state = cast(Mapping[str, object], _from_whole.cut(state, live))
            if _sharded.placeholders(state):  # checked before any shard is read
                try:
                    shards = _sharded.templates(state, _live(pieces, _holding_shards(state)))
                except CheckpointError as err:  # said without the file: name it
                    raise CheckpointError(f"{target}: {err}") from err
                damage = _unreadable.metadata_damage(target)  # found before the collective
                if damage is not None:
                    raise files.damaged(damage)
    except Exception as err:
        error = _as_checkpoint_error(err, target)
    if target is not None and (sharded or target.is_dir()):
        # Reading the shards is a collective: every rank must have read loop.pt and found
        # it fits before any rank starts (one host-level exchange). A directory is a sharded
        # save, whatever this run's model (decided alike on every rank: the same path).
        error = agreed(target, _naming_older(error, directory, older))
        if error is not None:
            raise error
        try:
            _sharded.read_shards(target, shards)  # damage: a CheckpointError marked so
            state = cast(Mapping[str, object], _sharded.filled(state, shards))
        except Exception as err:  # the machine's (a failed collective, out of memory)
            error = _as_checkpoint_error(err, target)
    try:
        if target is not None and error is None:
            state = check_file(pieces, state, target, reseed)
            if _ranks.world()[0] == 0:
                moved = files.abandon_newer(directory, target, number_of(pieces, state))
    except Exception as err:
        error = _as_checkpoint_error(err, target)
    error = agreed(target, _naming_older(error, directory, older))
    if error is not None:
        files.move_back(moved)
        raise error
    return state, moved


def _naming_older(
    error: Exception | None, directory: Path, older: Sequence[Path]
) -> Exception | None:
    """A damaged newest checkpoint's error, naming the older ones a resume can use."""
    if error is None or not older or not files.is_damaged(error):
        return error
    names = ", ".join(p.name for p in reversed(older[-3:]))
    said = CheckpointError(
        f"{error}. The newest checkpoint is damaged (a save cut short?); older ones are "
        f"in {directory} ({names}{', ...' if len(older) > 3 else ''}): resume the newest "
        f"of them with ckpt.resume({str(older[-1])!r}) (newer files are moved aside), or "
        "let an unattended job do so itself with ckpt.resume(skip_damaged=True)"
    )
    said.__cause__ = error
    return files.damaged(said)


def read_readable(
    ckpt_dir: Path,
    found: Sequence[Path],
    pieces: Mapping[str, StatePiece],
    sharded: bool,
    reseed: bool,
    skip_damaged: bool,
) -> tuple[Mapping[str, object], files.Moves, Path | None, list[tuple[Path, str]]]:
    """``read_agreed`` of the newest of ``found``; with ``skip_damaged``, of the newest that
    every rank can read: its state, the moves, its path and the damaged ones skipped (each
    with its error, newest first), which a resume moves aside (a new lineage)."""
    skipped: list[tuple[Path, str]] = []
    for i in range(len(found) - 1, -1, -1):
        try:
            state, moved = read_agreed(ckpt_dir, found[i], pieces, () if skip_damaged else
                                       found[:i], sharded, reseed)  # fmt: skip
        except CheckpointError as err:
            if not (skip_damaged and files.is_damaged(err)):
                raise
            skipped.append((found[i], str(err)))
            continue
        return state, moved, found[i], skipped
    if skipped:
        listing = "; ".join(f"{p.name}: {why}" for p, why in skipped)
        raise CheckpointError(
            f"every checkpoint in {ckpt_dir} is damaged, none can be resumed ({listing}): "
            "move them aside to start afresh, or resume one a copy of which is whole"
        )
    state, moved = read_agreed(ckpt_dir, None, pieces, (), sharded, reseed)
    return state, moved, None, skipped


def number_of(pieces: Mapping[str, StatePiece], state: Mapping[str, object]) -> int:
    """The number a checked state is named by: its updates, or its saves without step=."""
    stepper = pieces.get("step")
    if isinstance(stepper, (StepState, StepsState)):
        return stepper.saved_updates(state["step"])
    return need(state, "saves", int, "'saves'")


def check_can_add(pieces: Mapping[str, StatePiece], used: bool, name: str, piece: object) -> None:
    """Raise what ``Checkpointer.add(name, piece)`` would raise; changes nothing."""
    if not isinstance(name, str) or not name or name in BOOKKEEPING:
        raise ValueError(f"a piece's name must be a non-empty str, not one of "
                         f"{BOOKKEEPING}, got {name!r}")  # fmt: skip
    if name in pieces:
        raise ValueError(
            f"this Checkpointer already saves a piece named {name!r}: one object per name"
        )
    if not isinstance(piece, StatePiece):
        raise TypeError(
            f"{type(piece).__name__} is not a checkpoint piece (state_dict, "
            "check_state_dict, snapshot, load_state_dict, restore)"
        )
    if used:
        raise RuntimeError(
            f"add {name!r} before the first resume() or save(): a resume before it would "
            "have skipped its state"
        )
