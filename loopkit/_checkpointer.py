"""Checkpointer: atomic loop-state checkpoints and bit-identical resume.

One file holds everything a resumed loop needs: model, optimizer, scheduler, the step's
counters and GradScaler, every rank's RNG states (python, numpy, torch CPU and CUDA), the
epoch and the position within it (with the loader's generator state, so the same batches
come next), and any user object with ``state_dict``/``load_state_dict``.

Writes are atomic: a hidden temporary file in the same directory, flushed and fsynced,
then renamed over the final name (and the directory fsynced). Only finished files carry
the ``ckpt-*.pt`` name, so a crash during a save leaves the previous checkpoints as they
were. Each writer's temporary has its own name (host, pid, random suffix) and is held
under an exclusive ``flock`` while it is written, so the clean-up of a crashed save's
leftovers never deletes a live writer's file (another process saving into the same
directory). Loading uses ``torch.load(weights_only=True)``: nothing in a file can run code.

A resume checks the whole file against the run first (structure, model, optimizer,
counters, precision, data) and only then changes anything; if loading still fails,
everything already loaded is put back.
"""

from __future__ import annotations

import copy
import os
import pickle
import random
import re
import secrets
import socket
import sys
import time
import zipfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from . import _ranks
from ._accumulate import accumulate
from ._checks import is_int_at_least
from ._errors import CheckpointError
from ._grad_sync import sync_kind, unwrap
from ._precision import autocast_step
from ._step import step as Step
from ._types import Stateful
from .distributed import EpochLoader

if sys.platform != "win32":
    import fcntl

FORMAT = "loopkit-checkpoint-1"
_NAME = re.compile(r"^ckpt-(\d{10})\.pt$")
_TEMPORARIES = ".ckpt-*.tmp*"
# The GradScaler.load_state_dict reads these.
_SCALER_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")


def _rng_state() -> dict[str, Any]:
    np_state: Any = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        # numpy's state holds an ndarray, which weights_only loading refuses: keep a tensor.
        "numpy": (np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: Mapping[str, Any]) -> None:
    random.setstate(_as_tuple(state["python"]))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])


def _as_tuple(x: Any) -> Any:
    return tuple(_as_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x


def _copy(state: Any) -> Any:
    """A copy of a small object's state dict that its later loads cannot change."""
    try:
        return copy.deepcopy(state)
    except Exception:  # an uncopyable user state: the reference is the best there is
        return state


class Checkpointer:
    """Save and resume a training loop; keeps the last ``keep`` checkpoints in ``directory``.

    ``ckpt.resume()`` before the loop restores the newest checkpoint (if any);
    ``ckpt.save()`` at a window boundary writes one (rank zero writes, every rank takes
    part); ``ckpt.maybe_save(every=N)`` saves each N-th optimizer update. Pass the same
    objects when resuming as when saving.

    Checkpoints are named by the step's update count, or (without ``step=``) by the
    Checkpointer's own count of saves, which a checkpoint carries so numbering continues
    after a resume. With ``loader=``, a ``maybe_save`` on the window that ends a pass of the
    loader is deferred to the start of the next pass, so the checkpoint holds what the
    epoch's own code did after its last window (a per-epoch ``scheduler.step()``, an
    evaluation, the RNG it used); call ``save()`` after the loop to keep the final state.
    ``resume(older_path)`` starts a new lineage: checkpoints newer than the one restored
    are moved to an ``abandoned-<update>-<time>/`` subdirectory, kept but never resumed
    from or counted by ``keep``.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any = None,
        step: Step | accumulate | None = None,
        amp: autocast_step | None = None,
        loader: EpochLoader | None = None,
        extra: Mapping[str, Stateful] | None = None,
        keep: int = 3,
    ) -> None:
        if not isinstance(directory, (str, os.PathLike)):
            raise TypeError(f"directory must be a path, got {type(directory).__name__}")
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        if sync_kind(model) in ("fsdp1", "fsdp2"):
            raise ValueError(
                "the model is sharded (FSDP): its full state lives on no single rank; save "
                "it with torch.distributed.checkpoint instead"
            )
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {optimizer!r}")
        if scheduler is not None and not isinstance(scheduler, Stateful):
            raise TypeError("scheduler must have state_dict() and load_state_dict()")
        if step is not None and not isinstance(step, (Step, accumulate)):
            raise TypeError(f"step must be a loopkit.step or loopkit.accumulate, got {step!r}")
        if amp is not None and not isinstance(amp, autocast_step):
            raise TypeError(f"amp must be a loopkit.autocast_step, got {amp!r}")
        if loader is not None and not isinstance(loader, EpochLoader):
            raise TypeError(
                "loader must be a loopkit.distributed.loader(...) (it can skip to the batch "
                "where the run stopped and draws each batch's random numbers from a key a "
                f"resume reproduces), got {type(loader).__name__}. It takes your dataset and "
                "every DataLoader argument but the sampler (collate_fn, prefetch_factor, ...); "
                "with a DataLoader of your own, leave loader= out: the RNG states are restored, "
                "the position in the epoch and workers' random streams are not"
            )
        extra = dict(extra or {})
        for name, obj in extra.items():
            if not isinstance(obj, Stateful):
                raise TypeError(
                    f"extra[{name!r}] has no state_dict()/load_state_dict(): wrap it in an "
                    "object that has them"
                )
        if not is_int_at_least(keep, 1):
            raise ValueError(f"keep must be an int >= 1 (checkpoints kept on disk), got {keep!r}")
        self.directory = Path(directory)
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.step = step
        self.amp = amp
        self.loader = loader
        self.extra = extra
        self.keep = keep
        self.last_saved_update: int | None = None
        self._saves = 0  # checkpoints written in this run's lineage (names them without step=)
        self._deferred: int | None = None  # the update whose save waits for the next pass

    # -- what is saved --------------------------------------------------------------------

    def _accumulate(self) -> accumulate | None:
        s = self.step
        return s.accumulate if isinstance(s, Step) else s

    def _updates(self) -> int:
        acc = self._accumulate()
        return acc.updates if acc is not None else 0

    def state_dict(self) -> dict[str, Any]:
        """Everything this rank contributes (RNG states are gathered from all ranks on save)."""
        acc = self._accumulate()
        if acc is not None and acc.micro_step:
            raise RuntimeError(
                f"saving mid-window ({acc.micro_step} of {acc.every} micro-steps done) would "
                "drop their gradients: save when acc.micro_step == 0, e.g. right after an update"
            )
        state: dict[str, Any] = {
            "format": FORMAT,
            "model": unwrap(self.model).state_dict(),
            "world_size": _ranks.world()[1],
            "saves": self._saves,
        }
        if self.optimizer is not None:
            state["optimizer"] = self.optimizer.state_dict()
            # The shapes behind the optimizer's parameter indices: a resume whose optimizer
            # lists its parameters in another order is refused before its state is loaded.
            state["optimizer_shapes"] = _param_shapes(self.optimizer)
        if self.scheduler is not None:
            state["scheduler"] = self.scheduler.state_dict()
        if self.step is not None:
            state["step"] = self.step.state_dict()
        if self.amp is not None:
            state["amp"] = self.amp.state_dict()
        if self.loader is not None:
            lookahead = acc.lookahead if acc is not None else 0
            state["loader"] = self.loader.state_dict(consumed=self.loader.position - lookahead)
        state["extra"] = {name: obj.state_dict() for name, obj in self.extra.items()}
        return state

    # -- writing ------------------------------------------------------------------------------

    def save(self) -> Path | None:
        """Write a checkpoint now; returns its path on rank zero (None on other ranks).

        Also writes (and so cancels) a save that ``maybe_save`` deferred to the next pass.
        """
        state = self.state_dict()
        state["saves"] = self._saves + 1
        state["rng"] = _ranks.gather_objects(_rng_state())  # one host-level collective
        rank = _ranks.world()[0]
        number = self._updates() if self.step is not None else self._saves + 1
        path, error = None, None
        if rank == 0:
            path = self.directory / f"ckpt-{number:010d}.pt"
            try:
                _atomic_save(state, path)
                self._prune()
            except Exception as err:
                error = err
        # Every rank learns whether the file was written (no rank may read or prune before
        # it is complete, and none goes on as if it were saved when it is not).
        failed = _ranks.gather_objects(None if error is None else repr(error))[0]
        if error is not None:
            raise error
        if failed is not None:
            raise RuntimeError(f"rank 0 could not write the checkpoint: {failed}")
        self._saves += 1
        self.last_saved_update = self._updates()
        self._cancel_deferred()
        return path

    def maybe_save(self, every: int) -> Path | None:
        """Save when the optimizer has made a multiple of ``every`` updates since the last save.

        With ``loader=``, the save on the window that ends the loader's pass is deferred:
        it is written when the next pass starts (before its first batch), holding what ran
        after the last window; ``None`` is returned then.
        """
        if not is_int_at_least(every, 1):
            raise ValueError(f"every must be an int >= 1 (updates between saves), got {every!r}")
        acc = self._accumulate()
        if acc is None:
            raise RuntimeError("maybe_save needs step= (to count updates); call save() instead")
        updates = acc.updates
        if (
            not updates
            or acc.micro_step
            or updates % every
            or updates in (self.last_saved_update, self._deferred)
        ):
            return None
        loader = self.loader
        if loader is not None and loader.position - acc.lookahead >= len(loader):
            # The pass is over but the epoch's code after it (a per-epoch scheduler step,
            # an evaluation) has not run yet: a checkpoint now would resume without it.
            self._cancel_deferred()
            self._deferred = updates
            loader._before_next_pass.append(self._write_deferred)
            return None
        return self.save()

    def _write_deferred(self) -> None:
        if self._deferred is not None:
            self._deferred = None
            self.save()

    def _cancel_deferred(self) -> None:
        self._deferred = None
        if self.loader is not None and self._write_deferred in self.loader._before_next_pass:
            self.loader._before_next_pass.remove(self._write_deferred)

    def checkpoints(self) -> list[Path]:
        """Finished checkpoints of the current lineage in the directory, oldest first."""
        if not self.directory.is_dir():
            return []
        return sorted(p for p in self.directory.iterdir() if _NAME.match(p.name))

    def _prune(self) -> None:
        for old in self.checkpoints()[: -self.keep]:
            old.unlink(missing_ok=True)
        self._remove_stale_temporaries()

    def _remove_stale_temporaries(self) -> None:
        """Delete temporaries of saves that died; never one a live writer is writing."""
        if not self.directory.is_dir() or sys.platform == "win32":
            # Without flock a live writer's temporary cannot be told from a dead one's:
            # leave them (hidden files; they never carry a checkpoint's name).
            return
        for tmp in self.directory.glob(_TEMPORARIES):
            try:
                fd = os.open(tmp, os.O_RDONLY)
            except OSError:
                continue  # renamed or removed meanwhile
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError:
                    continue  # a live writer holds it
                # Its writer is gone (the kernel drops a dead process's lock). The name must
                # still be this inode: a finished save has renamed its file away.
                try:
                    same = os.stat(tmp).st_ino == os.fstat(fd).st_ino
                except FileNotFoundError:
                    continue
                if same:
                    tmp.unlink(missing_ok=True)  # while locked: see _atomic_save
            finally:
                os.close(fd)

    # -- reading ------------------------------------------------------------------------------

    def resume(self, path: str | os.PathLike[str] | None = None) -> Path | None:
        """Restore the newest checkpoint (or ``path``); None if there is none yet.

        The checkpoint is checked against this run first; a resume that raises leaves
        every object, the RNG states and the directory as they were. Under DDP every rank
        calls it; all resume from the same file or all raise. Restoring a checkpoint older
        than the newest in the directory starts a new lineage: the newer ones are moved to
        an ``abandoned-<update>-<time>/`` subdirectory.
        """
        acc = self._accumulate()
        if acc is not None and acc.micro_step:
            raise RuntimeError(
                f"resume() in the middle of an accumulation window ({acc.micro_step} of "
                f"{acc.every} micro-steps done): call it before the training loop"
            )
        rank = _ranks.world()[0]
        target: Path | None
        if path is None:
            found = self.checkpoints()
            target = found[-1] if found else None
        else:
            target = Path(path)
        error: Exception | None = None
        moved: list[tuple[Path, Path]] = []
        state: Mapping[str, Any] = {}
        try:
            if target is not None:
                state = load_checkpoint(target)
                self._check(state, target)
                if rank == 0:
                    moved = self._abandon_newer(target, _number(state, self.step))
        except CheckpointError as err:
            error = err
        except Exception as err:  # damaged past what _check names, or the move aside failed
            error = CheckpointError(f"{target}: cannot resume from it: {err!r}")
            error.__cause__ = err
        # Every rank must take the same decision: a rank that went on alone would hang or
        # train from other weights. (One host-level collective per resume.)
        reports = _ranks.gather_objects(
            (None if target is None else str(target), None if error is None else str(error))
        )
        if error is None:
            error = _disagreement(reports, target)
        if error is not None:
            _move_back(moved)
            raise error
        if rank == 0:
            self._remove_stale_temporaries()  # a crashed save's leftovers (the first one's too)
        if target is None:
            return None
        try:
            # Checked on every rank: loading fails now only where user code (a hook, an
            # extra's load_state_dict) raises, and then everything loaded is put back.
            self._load(state, target)
        except BaseException:
            _move_back(moved)
            raise
        self._saves = state["saves"]
        self.last_saved_update = self._updates()
        self._cancel_deferred()
        return target

    def _check(self, state: Mapping[str, Any], path: Path) -> None:
        """Raise CheckpointError if ``state`` cannot be loaded into this run; changes nothing."""
        rank, world = _ranks.world()

        def fail(what: str) -> CheckpointError:
            return CheckpointError(f"{path}: {what}")

        def need(where: Mapping[str, Any], key: str, kind: Any, label: str) -> Any:
            if key not in where:
                raise fail(f"incomplete checkpoint: {label} is missing")
            if not isinstance(where[key], kind) or isinstance(where[key], bool):
                raise fail(
                    f"damaged checkpoint: {label} is a {type(where[key]).__name__}, not "
                    f"{getattr(kind, '__name__', 'the expected type')}"
                )
            return where[key]

        saved_world = need(state, "world_size", int, "'world_size'")
        if saved_world != world:
            raise fail(
                f"written by {saved_world} process(es), resumed by {world}: resume with the "
                "same number of processes (the data shards and RNG streams depend on it)"
            )
        if need(state, "saves", int, "'saves'") < 0:
            raise fail("damaged checkpoint: 'saves' is negative")
        _check_model(
            unwrap(self.model).state_dict(), need(state, "model", Mapping, "'model'"), path
        )
        for key, present in (
            ("optimizer", self.optimizer),
            ("scheduler", self.scheduler),
            ("step", self.step),
            ("amp", self.amp),
            ("loader", self.loader),
        ):
            if (key in state) != (present is not None):
                have = "has" if key in state else "has no"
                raise fail(
                    f"the checkpoint {have} {key} state but the Checkpointer was built "
                    f"{'without' if key in state else 'with'} one: pass the same objects as "
                    "when saving"
                )
        if self.optimizer is not None:
            self._check_optimizer(state, need, fail)
        if self.step is not None:
            saved_step = need(state, "step", Mapping, "'step'")
            if isinstance(self.step, Step):
                acc_state = need(saved_step, "accumulate", Mapping, "'step.accumulate'")
                amp_state = need(saved_step, "amp", Mapping, "'step.amp'")
                _check_amp(self.step.amp, amp_state, "step", fail)
            else:
                acc_state = saved_step
            acc = self._accumulate()
            assert acc is not None
            every = need(acc_state, "every", int, "the step's 'every'")
            if every != acc.every:
                raise fail(
                    f"saved with accumulate every={every} but this run's step accumulates "
                    f"every={acc.every}: build the step with accumulate={every} to resume it"
                )
            for key in ("updates", "skipped"):
                if need(acc_state, key, int, f"the step's {key!r}") < 0:
                    raise fail(f"damaged checkpoint: the step's {key!r} is negative")
        if self.amp is not None:
            _check_amp(self.amp, need(state, "amp", Mapping, "'amp'"), "amp= state", fail)
        if self.loader is not None:
            try:
                self.loader._check_state(state["loader"])
            except ValueError as err:
                raise fail(f"does not fit this run's loader: {err}") from err
        extra = need(state, "extra", Mapping, "'extra'")
        differ = set(self.extra) ^ set(extra)
        if differ:
            raise fail(
                f"extra objects differ ({sorted(differ)}): pass the same extra= as when saving"
            )
        rngs = need(state, "rng", (list, tuple), "'rng'")
        if len(rngs) != world:
            raise fail(f"damaged checkpoint: 'rng' holds {len(rngs)} states for {world} ranks")
        _check_rng(rngs[rank], rank, fail)

    def _check_optimizer(
        self, state: Mapping[str, Any], need: Callable[..., Any], fail: Callable[[str], Exception]
    ) -> None:
        assert self.optimizer is not None
        saved = need(state, "optimizer", Mapping, "'optimizer'")
        need(saved, "state", Mapping, "'optimizer.state'")
        groups = need(saved, "param_groups", (list, tuple), "'optimizer.param_groups'")
        here = _param_shapes(self.optimizer)
        if len(groups) != len(here):
            raise fail(
                f"the optimizer has {len(here)} parameter group(s) but the checkpoint's has "
                f"{len(groups)}: build the optimizer with the same groups as when saving"
            )
        for i, (group, shapes) in enumerate(zip(groups, here, strict=True)):
            if not isinstance(group, Mapping) or not isinstance(group.get("params"), list):
                raise fail(f"damaged checkpoint: optimizer param group {i} has no 'params' list")
            if len(group["params"]) != len(shapes):
                raise fail(
                    f"optimizer param group {i} has {len(shapes)} parameters here but "
                    f"{len(group['params'])} in the checkpoint: build the optimizer with the "
                    "same parameters as when saving"
                )
        saved_shapes = need(state, "optimizer_shapes", (list, tuple), "'optimizer_shapes'")
        if [[list(s) for s in g] for g in saved_shapes] != here:
            wrong = [
                f"group {g} parameter {i}: {tuple(a)} saved, {tuple(b)} here"
                for g, (sg, hg) in enumerate(zip(saved_shapes, here, strict=False))
                for i, (a, b) in enumerate(zip(sg, hg, strict=False))
                if list(a) != b
            ]
            raise fail(
                "the optimizer's parameters do not match the checkpoint's "
                f"({'; '.join(wrong[:3]) or 'another layout'}): build the optimizer over "
                "the same parameters, in the same order, as when saving"
            )

    def _load(self, state: Mapping[str, Any], path: Path) -> None:
        """Load a checked ``state``; if anything fails, put back what was already loaded."""
        rank = _ranks.world()[0]
        undo: list[Callable[[], None]] = []

        def load(obj: Any, saved: Any, snapshot: Any) -> None:
            # The way back is recorded before the load: a load that fails half-way is undone.
            undo.append(lambda: obj.load_state_dict(snapshot))
            obj.load_state_dict(saved)

        try:
            # The objects whose loading runs user code, and which have cheap copies, first;
            # the model last (it has no cheap copy, and its keys and shapes were checked).
            for name, obj in self.extra.items():
                load(obj, state["extra"][name], _copy(obj.state_dict()))
            if self.scheduler is not None:
                load(self.scheduler, state["scheduler"], _copy(self.scheduler.state_dict()))
            if self.step is not None:
                load(self.step, state["step"], _copy(self.step.state_dict()))
            if self.amp is not None:
                load(self.amp, state["amp"], _copy(self.amp.state_dict()))
            if self.loader is not None:
                loader, snapshot = self.loader, self.loader._snapshot()
                undo.append(lambda: loader._restore(snapshot))
                loader.load_state_dict(state["loader"])
            if self.optimizer is not None:
                # Loading replaces the state tensors rather than writing into them: the
                # references in this state_dict are the way back, with no copy.
                load(self.optimizer, state["optimizer"], self.optimizer.state_dict())
            rng = _rng_state()
            undo.append(lambda: _set_rng_state(rng))
            _set_rng_state(state["rng"][rank])
            unwrap(self.model).load_state_dict(state["model"])
        except BaseException as err:
            for back in reversed(undo):
                back()
            if isinstance(err, (ValueError, KeyError, RuntimeError, TypeError, IndexError)):
                raise CheckpointError(
                    f"{path}: does not fit this run: {err} (nothing was restored)"
                ) from err
            raise

    def _abandon_newer(self, target: Path, number: int) -> list[tuple[Path, Path]]:
        """Move the checkpoints newer than ``target`` out of the lineage; returns the moves."""
        newer = [
            p
            for p in self.checkpoints()
            if _number_of_name(p) > number and not (target.exists() and p.samefile(target))
        ]
        if not newer:
            return []
        stamp = time.strftime("%Y%m%d-%H%M%S")
        aside = self.directory / f"abandoned-{number:010d}-{stamp}"
        n = 1
        while aside.exists():
            n += 1
            aside = self.directory / f"abandoned-{number:010d}-{stamp}-{n}"
        aside.mkdir()
        moved: list[tuple[Path, Path]] = []
        try:
            for p in newer:
                os.replace(p, aside / p.name)
                moved.append((p, aside / p.name))
            _fsync_dir(self.directory)
        except BaseException:
            _move_back(moved)
            raise
        return moved


def _number(state: Mapping[str, Any], step: Step | accumulate | None) -> int:
    """The number a checked checkpoint state is named by: updates, or saves without step."""
    if step is None:
        return int(state["saves"])
    saved = state["step"]
    return int((saved["accumulate"] if isinstance(step, Step) else saved)["updates"])


def _number_of_name(path: Path) -> int:
    match = _NAME.match(path.name)
    assert match is not None  # checkpoints() lists only such names
    return int(match.group(1))


def _move_back(moved: list[tuple[Path, Path]]) -> None:
    for original, aside in reversed(moved):
        os.replace(aside, original)
    if moved:
        aside_dir = moved[0][1].parent
        if not any(aside_dir.iterdir()):
            aside_dir.rmdir()


def _disagreement(
    reports: list[tuple[str | None, str | None]], target: Path | None
) -> Exception | None:
    """The error every rank raises when the ranks' resume attempts differ; None if they agree."""
    targets = {t for t, _ in reports}
    if len(targets) > 1:
        listing = ", ".join(f"rank {r}: {t or 'none'}" for r, (t, _) in enumerate(reports))
        return CheckpointError(
            f"the ranks found different checkpoints to resume from ({listing}): every rank "
            "must see the same directory (a shared filesystem) and pass the same path"
        )
    for r, (_, err) in enumerate(reports):
        if err is not None:
            return CheckpointError(f"{target}: rank {r} cannot resume from it: {err}")
    return None


def _param_shapes(optimizer: torch.optim.Optimizer) -> list[list[list[int]]]:
    return [[list(p.shape) for p in group["params"]] for group in optimizer.param_groups]


def _check_amp(
    amp: autocast_step, saved: Mapping[str, Any], who: str, fail: Callable[[str], Exception]
) -> None:
    if amp.scaler is None and saved:
        raise fail(
            f"the checkpoint's {who} holds a GradScaler (it was saved with fp16) but this "
            f"run's precision is {amp.precision!r}: resume with precision='fp16'"
        )
    if amp.scaler is not None:
        scaler = saved.get("scaler")
        if not isinstance(scaler, Mapping):
            raise fail(
                f"the checkpoint's {who} holds no GradScaler (it was saved with bf16 or fp32) "
                "but this run's precision is 'fp16': resume with the precision it was saved with"
            )
        missing = [k for k in _SCALER_KEYS if k not in scaler]
        if missing:
            raise fail(f"incomplete checkpoint: the GradScaler state has no {missing}")


def _check_rng(rng: Any, rank: int, fail: Callable[[str], Exception]) -> None:
    label = f"'rng' of rank {rank}"
    if not isinstance(rng, Mapping):
        raise fail(f"damaged checkpoint: {label} is a {type(rng).__name__}, not a dict")
    for key in ("python", "numpy", "torch"):
        if key not in rng:
            raise fail(f"incomplete checkpoint: {label} has no {key!r} state")
    python, numpy_state, torch_state = rng["python"], rng["numpy"], rng["torch"]
    if not isinstance(python, (list, tuple)) or len(python) != 3:
        raise fail(f"damaged checkpoint: {label}'s python state is not random.getstate()'s")
    if (
        not isinstance(numpy_state, (list, tuple))
        or len(numpy_state) != 5
        or not isinstance(numpy_state[1], torch.Tensor)
    ):
        raise fail(f"damaged checkpoint: {label}'s numpy state is not a 5-tuple with a tensor")
    if not isinstance(torch_state, torch.Tensor) or torch_state.dtype != torch.uint8:
        raise fail(f"damaged checkpoint: {label}'s torch state is not a uint8 tensor")
    if "cuda" in rng:
        if not torch.cuda.is_available():
            raise fail(
                "the checkpoint holds CUDA RNG states but this machine has no GPU: resume on "
                "the kind of machine that wrote it"
            )
        if len(rng["cuda"]) > torch.cuda.device_count():
            raise fail(
                f"the checkpoint holds the RNG states of {len(rng['cuda'])} GPUs but this "
                f"process sees {torch.cuda.device_count()}: resume with the same GPUs visible"
            )


def _check_model(current: Mapping[str, Any], saved: Mapping[str, Any], path: Path) -> None:
    missing = [k for k in current if k not in saved]
    unexpected = [k for k in saved if k not in current]
    not_tensors = [
        k
        for k, v in current.items()
        if k in saved and isinstance(v, torch.Tensor) and not isinstance(saved[k], torch.Tensor)
    ]
    shapes = [
        f"{k}: {tuple(saved[k].shape)} saved, {tuple(v.shape)} here"
        for k, v in current.items()
        if k in saved
        and isinstance(v, torch.Tensor)
        and isinstance(saved[k], torch.Tensor)
        and tuple(saved[k].shape) != tuple(v.shape)
    ]
    if missing or unexpected or shapes or not_tensors:
        parts = []
        if missing:
            parts.append(f"missing keys {missing[:5]}")
        if unexpected:
            parts.append(f"unexpected keys {unexpected[:5]}")
        if shapes:
            parts.append("shape mismatch " + "; ".join(shapes[:5]))
        if not_tensors:
            parts.append(f"not tensors {not_tensors[:5]}")
        raise CheckpointError(
            f"{path}: the model does not match the checkpoint ({', '.join(parts)}): build the "
            "same model as the run that saved it"
        )


_HOST = re.sub(r"[^A-Za-z0-9_.]", "_", socket.gethostname()) or "host"


def _atomic_save(state: Any, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    # The temporary is named for its writer (host, pid, random) and locked while it lives:
    # _remove_stale_temporaries deletes only temporaries whose lock it can take.
    while True:
        tmp = path.with_name(f".{path.name}.tmp-{_HOST}-{os.getpid()}-{secrets.token_hex(4)}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        if sys.platform == "win32":
            break
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:
            break  # a filesystem without locks: clean-ups cannot lock it either, so they skip it
        if os.fstat(fd).st_nlink:
            break
        # A clean-up locked and deleted it between our open and our lock: start afresh.
        os.close(fd)
    f = os.fdopen(fd, "wb")
    try:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
        os.replace(tmp, path)  # atomic on POSIX: the name points at the old or the new file
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        f.close()  # releases the lock, after the rename
    _fsync_dir(path.parent)


def _fsync_dir(directory: Path) -> None:
    if sys.platform == "win32":
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)  # make renames in it durable
    finally:
        os.close(fd)


def load_checkpoint(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a checkpoint safely (no code runs); raise CheckpointError saying what is wrong."""
    p = Path(path)
    if not p.is_file():
        raise CheckpointError(f"{p}: no such checkpoint file")
    try:
        state = torch.load(p, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        raise CheckpointError(
            f"{p}: refused: the file holds objects other than tensors and plain containers "
            f"(loading it could run code), or is not a checkpoint: {str(err).splitlines()[0]}"
        ) from err
    except (RuntimeError, EOFError, zipfile.BadZipFile, OSError, ValueError) as err:
        raise CheckpointError(f"{p}: unreadable (truncated or corrupt): {err}") from err
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        found = state.get("format") if isinstance(state, dict) else type(state).__name__
        raise CheckpointError(f"{p}: not a loopkit checkpoint (found {found!r}, not {FORMAT!r})")
    return state
