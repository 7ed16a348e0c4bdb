"""Checkpointer: atomic loop-state checkpoints and bit-identical resume.

One file holds everything a resumed loop needs: model, optimizer, scheduler, the step's
counters, precision, GradScaler and own scheduler (each member's, for a ``steps`` group),
every rank's RNG states (python, numpy, torch CPU and CUDA), the
epoch and the position within it (with the loader's generator state, so the same batches
come next), and any user object with ``state_dict``/``load_state_dict``. Each of these is
a piece (``_contract``) kept under its own key; the files on disk are
``_files``' business.

A resume checks the whole file against the run first (structure, model, optimizer,
counters, precision, data) and only then changes anything; if loading still fails,
everything already loaded is put back.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .. import _ranks
from .._checks import is_int_at_least
from .._data._epoch_loader import EpochLoader
from .._precision import autocast_step
from .._step import _accumulate, _compose, _group, _misuse
from .._types import Clock, Stateful
from . import _adopt, _owner, _sharded, _standing
from . import _files as files
from ._background import Background
from ._contract import StatePiece, need, per_rank
from ._deferred import DeferredSave, EpochCode
from ._pieces import pieces_for
from ._resume import check_can_add, load_file, read_agreed, read_readable
from ._save_due import holds_state, maybe_save
from ._step_state import StepsState, StepState
from ._write import write


class Checkpointer:
    """Save and resume a training loop; keeps the last ``keep`` checkpoints in ``directory``.

    ``ckpt.resume()`` before the loop restores the newest checkpoint (if any), ``for epoch
    in ckpt.epochs(E):`` loops over the epochs left; ``ckpt.save()`` at a window boundary
    writes one (rank zero writes), ``ckpt.maybe_save(every=N)`` each N-th update. Pass the
    same objects when resuming as when saving. ``step=`` saves the step's counters, precision,
    GradScaler and what it was given (optimizer, scheduler, ``ema=``, ``log=``) unless
    ``optimizer=``/``scheduler=``/``extra=`` holds that object (a ``steps`` group: each
    member's); a resume in another precision is refused.

    Checkpoints are named by the step's update count, or (without ``step=``) by the
    Checkpointer's own count of saves, which carries over a resume.

    ``loader=`` saves the data's place. A ``loopkit.distributed.loader``: its epoch and
    position (``epochs()`` follows its epochs); a ``maybe_save`` on the window that ends a
    pass is deferred to the next pass's start, so it holds what the epoch's code did after
    (a per-epoch ``scheduler.step()``, an evaluation); a ``save()`` there says that code is
    still to run, and a resume runs it. Call ``save_if_needed()`` after the loop
    (``epochs()`` does). Or any loader with ``state_dict()`` (torchdata's
    ``StatefulDataLoader``, ``loopkit.replayed(loader)``): each rank's place after the
    batches the loop consumed (docs/streaming.md); stop it with ``until(max_updates=)``. A
    loader with no state is refused, as is one in ``extra=`` with several processes.

    ``async_save=True``: a save copies the state to host memory and returns; a thread
    writes it (a sharded model's through DCP's ``async_save``) and renames it once complete.
    The next save, a resume, ``wait()`` and ``loopkit.distributed.teardown`` wait for it.

    ``pieces`` maps each file key to the piece that saves and restores it. An object in
    ``extra=`` that has ``check_state_dict``, ``snapshot`` and ``restore`` besides
    ``state_dict``/``load_state_dict`` is such a piece: its checks run before anything loads.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Stateful | None = None,
        step: _compose.step | _group.steps | _accumulate.accumulate | None = None,
        amp: autocast_step | None = None,
        loader: EpochLoader | Stateful | None = None,
        extra: Mapping[str, Stateful] | None = None,
        keep: int = 3,
        async_save: bool = False,
    ) -> None:
        if not isinstance(directory, (str, os.PathLike)):
            raise TypeError(f"directory must be a path, got {type(directory).__name__}")
        extra = dict(extra or {})
        self.pieces: dict[str, StatePiece] = pieces_for(
            model, optimizer, scheduler, step, amp, loader, extra
        )
        if not is_int_at_least(keep, 1):
            raise ValueError(f"keep must be an int >= 1 (checkpoints kept on disk), got {keep!r}")
        if not isinstance(async_save, bool):
            raise TypeError(f"async_save must be True or False, got {async_save!r}")
        self.directory = Path(directory)
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.step, self.amp, self.extra = step, amp, extra
        # The epoch machinery (ckpt.epochs, a save deferred to the next pass) follows a
        # distributed.loader; a loader that saves its own place (a stream) is only saved.
        self.loader = loader if isinstance(loader, EpochLoader) else None
        self.stream_loader = None if isinstance(loader, EpochLoader) else loader
        self.keep = keep
        self.last_saved_update: int | None = None
        self._saved_windows: int | None = None  # windows closed at the last save or resume
        self._saves = 0  # checkpoints written in this run's lineage (names them without step=)
        self._deferred = DeferredSave(self.loader, lambda: _write_now(self, before_code=False))
        self._epoch_code = EpochCode(self.loader)
        stepper = self.pieces.get("step")
        self._acc = stepper.clock if isinstance(stepper, (StepState, StepsState)) else None
        self._used = False  # a save or a resume happened: the set of pieces is fixed
        self._background = Background() if async_save else None
        self._standing = _standing.Standing()
        self.damaged: list[tuple[Path, str]] = []  # what resume(skip_damaged=True) skipped

    @property
    def standing(self) -> str | None:
        """Where the run stands after ``resume()`` (logged at INFO to ``loopkit``); or None."""
        return self._standing.line

    def check_can_add(self, name: str, piece: object) -> None:
        """Raise what ``add(name, piece)`` would raise; changes nothing."""
        check_can_add(self.pieces, self._used, name, piece)

    def add(self, name: str, piece: StatePiece) -> None:
        """Save and restore ``piece`` under ``name`` as well (before any save or resume).

        Objects that work with a Checkpointer (``loopkit.until``) add themselves.
        """
        self.check_can_add(name, piece)
        self.pieces[name] = piece

    def _updates(self) -> int:
        return self._acc.updates if self._acc is not None else 0

    def _windows_closed(self) -> int:
        """Windows closed so far, skipped updates included (a skip changes the state too)."""
        acc = self._acc
        return 0 if acc is None else acc.updates + int(getattr(acc, "skipped", 0))

    @property
    def clock(self) -> Clock | None:
        """The windows of the ``step=`` this Checkpointer saves (None without ``step=``)."""
        return self._acc

    def ends_pass(self) -> bool:
        """Whether the boundary just reached ends a pass of ``loader=`` (False without it):
        the batches handed out, less those ``iterate`` holds back, reach the pass's length."""
        return self._deferred.pass_is_over(self._acc.lookahead if self._acc is not None else 0)

    def state_dict(self) -> dict[str, Any]:
        """Everything this rank contributes (RNG states are gathered from all ranks on save)."""
        _refuse_mid_window(self._acc)
        state: dict[str, Any] = {
            "format": files.FORMAT,
            "world_size": _ranks.world()[1],
            "saves": self._saves,
        }
        for name, piece in self.pieces.items():
            if not per_rank(piece):
                state[name] = piece.state_dict()
        return state

    # -- writing ------------------------------------------------------------------------------

    def save(self) -> Path | None:
        """Write a checkpoint now; returns its path on rank zero (None on other ranks).

        Also writes (and so cancels) a save that ``maybe_save`` deferred to the next pass.
        On the window that ends a pass of ``loader=``, inside the loop over it (its
        ``iterate``), the file says the epoch's code after the pass is still to run (a resume
        runs it). With ``async_save=True`` it returns once the state is copied to host
        memory, and a thread writes it (the path is complete after ``wait()``); a save still
        in flight is finished first.
        """
        return _write_now(self, before_code=self._epoch_code.in_loop(self._acc, self.ends_pass()))

    def maybe_save(self, every: int) -> Path | None:
        """Save when the optimizer has made a multiple of ``every`` updates since the last save.

        With ``loader=``, the save on the window that ends the loader's pass is deferred:
        it is written when the next pass starts (before its first batch), holding what ran
        after the last window; ``None`` is returned then.
        """
        return maybe_save(self, every)

    @property
    def save_pending(self) -> bool:
        """Whether a save that ``maybe_save`` deferred to the next pass is still unwritten."""
        return self._deferred.update is not None

    def save_at_boundary(self, defer: bool = True) -> Path | None:
        """Save now unless this update is saved already; deferred as ``maybe_save`` defers,
        with or without ``step=`` (what a stop condition calls in the loop). ``defer=False``:
        written now, the file saying that the epoch's code after its last window is still to
        run, which a resumed run then runs."""
        if not defer and self.ends_pass():
            return _write_now(self, before_code=True)
        if self._acc is not None:
            return self.maybe_save(every=1)
        if self.ends_pass():
            self._deferred.defer(self._updates())
            return None
        return self.save()

    def save_if_needed(self) -> Path | None:
        """Save unless the newest checkpoint already holds this state (e.g. after the loop).

        Writes a save that ``maybe_save`` deferred; without ``step=`` it always saves. Waits
        for the background save in flight first (``wait``: it holds this state once written).
        """
        self.wait()
        if self._acc is None or self.save_pending:
            return self.save()
        if holds_state(self):
            _standing.idle_save(self)
            return None
        return self.save()

    def _count_saved(self, saves: int, code_left: bool = False) -> None:
        """After a save or a resume: ``saves`` name the next; no save is due or deferred;
        ``code_left``: the checkpoint's epoch has its code after the pass still to run."""
        self._saves, self.last_saved_update = saves, self._updates()
        self._saved_windows = self._windows_closed()
        self._deferred.cancel()
        self._epoch_code.set(code_left)

    def wait(self) -> None:
        """Wait until the background save in flight is on disk (every rank calls it; so does
        ``distributed.teardown``); raise on every rank if any rank's part failed."""
        if self._background is None:
            return
        try:
            self._background.finish()
        except BaseException:
            self.last_saved_update, self._saved_windows = None, None
            raise

    def checkpoints(self) -> list[Path]:
        """Finished checkpoints of the current lineage in the directory, oldest first."""
        return files.checkpoints(self.directory)

    # -- reading ------------------------------------------------------------------------------

    def resume(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        reseed: bool = False,
        skip_damaged: bool = False,
    ) -> Path | None:
        """Restore the newest checkpoint (or ``path``); None if there is none yet.

        ``reseed=True`` resumes a checkpoint written by another number of processes: the
        model, optimizer, EMA and counters carry over (a sharded model is resharded), the
        loader continues its pass (with the same ``global_batch_size``), and each rank's RNG
        streams start afresh from seeds drawn from the checkpoint; else it is refused.

        Checked against this run first: a resume that raises leaves every object, the RNG
        states and the directory as they were. Every rank calls it. An older checkpoint
        than the newest starts a new lineage (the newer move to ``abandoned-*/``).
        ``standing`` then says where the run stands, ``epochs(E)`` loops over what is left.

        ``skip_damaged=True`` (an unattended requeue): a newest checkpoint that cannot be
        read (truncated, corrupt, a shard missing) is skipped for the newest readable one,
        the skipped moved aside, with a ``ResumeWarning`` naming each and its error (also in
        ``ckpt.damaged``). Refused while another live job owns the directory (docs/clusters.md).
        """
        with _owner.claimed(self.directory, self, create=False):
            return _resumed(self, None if path is None else Path(path), reseed, skip_damaged)

    def close(self) -> None:
        """Wait for the save in flight, then give the directory up: another job may write it
        (``distributed.teardown`` and the process's exit give it up too). Every rank calls it."""
        self.wait()
        _owner.release(self.directory, self)

    def epochs(self, total: int) -> Iterator[int]:
        """The epochs of ``loader=`` left of ``total`` (none for a finished run, none past its
        ``until``'s stop), one pass each; at their end, the final state is saved if it is not."""
        return _standing.epochs(self, total)

    def adopt(self, updates: int, *, epoch: int | None = None) -> None:
        """A job run outside loopkit goes on, ``updates`` in: the step's count, its scheduler
        stepped as many times, the loader at ``epoch`` (docs/resuming.md)."""
        _adopt.adopt(self, updates, epoch)


def _write_now(ckpt: Checkpointer, before_code: bool) -> Path | None:
    """``save()``, refused while another job owns the directory (``_owner``)."""
    with _owner.claimed(ckpt.directory, ckpt):
        return _written_now(ckpt, before_code)


def _written_now(ckpt: Checkpointer, before_code: bool) -> Path | None:
    """``save()``; ``before_code``: taken before the epoch's code after the loader's pass."""
    ckpt.wait()
    _standing.idle_save(ckpt)
    with ckpt._epoch_code.saving(ckpt.pieces, before_code, ckpt.ends_pass()):
        state = ckpt.state_dict()
    ckpt._used = True
    state["saves"] = ckpt._saves + 1
    for name, piece in ckpt.pieces.items():
        if per_rank(piece):
            state[name] = _ranks.gather_objects(piece.state_dict())  # a host-level collective
    number = ckpt._updates() if ckpt.step is not None else ckpt._saves + 1
    path = write(state, ckpt.directory, number, ckpt.keep, ckpt._background)
    ckpt._count_saved(ckpt._saves + 1, code_left=before_code)
    return path


def _refuse_mid_window(acc: Clock | None) -> None:
    if acc is not None and acc.settle():
        raise RuntimeError(
            f"saving mid-window ({acc.micro_step} of {acc.every} micro-steps done) would "
            "drop their gradients: save when acc.micro_step == 0, e.g. right after an update"
        )


def _resumed(
    ckpt: Checkpointer, path: Path | None, reseed: bool, skip_damaged: bool
) -> Path | None:
    """``Checkpointer.resume``: checked, agreed by every rank, then loaded."""
    acc = ckpt._acc
    if acc is not None and acc.settle():
        raise RuntimeError(
            f"resume() in the middle of an accumulation window ({acc.micro_step} of "
            f"{acc.every} micro-steps done): call it before the training loop"
        )
    for name, flag in (("reseed", reseed), ("skip_damaged", skip_damaged)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be True or False, got {flag!r}")
    ckpt.wait()  # a save in flight is what a resume must find
    if _ranks.world()[0] == 0:  # a re-save killed between its renames: the old one back
        files.restore_replaced(ckpt.directory, *([] if path is None else [path.parent]))
    _ranks.barrier()  # before any rank lists the checkpoints
    relaunch = not ckpt._used  # the run starts from it (not a rollback within a run)
    ckpt._used = True  # even a refused resume: pieces added now would miss its checks
    sharded = _sharded.is_sharded(ckpt.model)
    if path is None:
        state, moved, target, skipped = read_readable(
            ckpt.directory, ckpt.checkpoints(), ckpt.pieces, sharded, reseed, skip_damaged
        )
    else:
        state, moved = read_agreed(ckpt.directory, path, ckpt.pieces, sharded=sharded,
                                   reseed=reseed)  # fmt: skip
        target, skipped = path, []
    if _ranks.world()[0] == 0:
        files.remove_stale_temporaries(ckpt.directory)  # a crashed save's leftovers
    if target is None:
        return None
    kept = copy.copy(ckpt._standing)
    try:
        _standing.skipped_damaged(target, skipped)  # a warning made an error: no load
        _standing.announce(ckpt, state, target, relaunch)
        # Checked on every rank: loading fails now only where user code (a hook, an
        # extra's load_state_dict) raises, and then everything loaded is put back.
        load_file(ckpt.pieces, state, target)
    except BaseException:
        files.move_back(moved)
        ckpt._standing = kept  # as before the call
        raise
    _misuse.resumed()  # schedulers moved by a load, not stepped: no step's guard objects
    left = ckpt.loader is not None and _standing.tail_left(ckpt.loader)
    ckpt._count_saved(need(state, "saves", int, "'saves'"), code_left=left)
    ckpt.damaged = skipped
    _standing.watch(ckpt)
    return target
