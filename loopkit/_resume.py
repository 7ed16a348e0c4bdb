"""Checkpointer: atomic loop-state checkpoints and bit-identical resume.

One file holds everything a resumed loop needs: model, optimizer, scheduler, the step's
counters and GradScaler, every rank's RNG states (python, numpy, torch CPU and CUDA), the
epoch and the position within it (with the loader's generator state, so the same batches
come next), and any user object with ``state_dict``/``load_state_dict``.

Writes are atomic: a hidden temporary file in the same directory, flushed and fsynced,
then renamed over the final name (and the directory fsynced). Only finished files carry
the ``ckpt-*.pt`` name, so a crash during a save leaves the previous checkpoints as they
were. Loading uses ``torch.load(weights_only=True)``: nothing in a file can run code.
"""

from __future__ import annotations

import os
import pickle
import random
import re
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from ._accumulate import accumulate
from ._core import is_int_at_least
from ._precision import autocast_step
from ._step import step as Step
from ._sync import sync_kind, unwrap
from .distributed import EpochLoader

FORMAT = "loopkit-checkpoint-1"
_NAME = re.compile(r"^ckpt-(\d{10})\.pt$")


class CheckpointError(RuntimeError):
    """A checkpoint file that cannot be used: unreadable, unsafe, or for another setup."""


@runtime_checkable
class Stateful(Protocol):
    """Anything a checkpoint can carry: it gives and takes a state dict."""

    def state_dict(self) -> Any: ...
    def load_state_dict(self, state: Any, /) -> Any: ...


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
        if not torch.cuda.is_available():
            raise CheckpointError(
                "the checkpoint holds CUDA RNG states but this machine has no GPU: resume on "
                "the kind of machine that wrote it"
            )
        torch.cuda.set_rng_state_all(state["cuda"])


def _as_tuple(x: Any) -> Any:
    return tuple(_as_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class Checkpointer:
    """Save and resume a training loop; keeps the last ``keep`` checkpoints in ``directory``.

    ``ckpt.resume()`` before the loop restores the newest checkpoint (if any);
    ``ckpt.save()`` at a window boundary writes one (rank zero writes, every rank takes
    part); ``ckpt.maybe_save(every=N)`` saves each N-th optimizer update. Pass the same
    objects when resuming as when saving.
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
                f"where the run stopped), got {type(loader).__name__}"
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
            "world_size": _world()[1],
        }
        if self.optimizer is not None:
            state["optimizer"] = self.optimizer.state_dict()
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
        """Write a checkpoint now; returns its path on rank zero (None on other ranks)."""
        state = self.state_dict()
        rank, world = _world()
        rngs: list[Any] = [None] * world
        if world > 1:
            dist.all_gather_object(rngs, _rng_state())
        else:
            rngs = [_rng_state()]
        state["rng"] = rngs
        path = None
        if rank == 0:
            path = self.directory / f"ckpt-{self._updates():010d}.pt"
            _atomic_save(state, path)
            self._prune()
        if world > 1:
            dist.barrier()  # no rank may read or prune before the file is complete
        self.last_saved_update = self._updates()
        return path

    def maybe_save(self, every: int) -> Path | None:
        """Save when the optimizer has made a multiple of ``every`` updates since the last save."""
        if not is_int_at_least(every, 1):
            raise ValueError(f"every must be an int >= 1 (updates between saves), got {every!r}")
        acc = self._accumulate()
        if acc is None:
            raise RuntimeError("maybe_save needs step= (to count updates); call save() instead")
        updates = acc.updates
        if not updates or acc.micro_step or updates % every or updates == self.last_saved_update:
            return None
        return self.save()

    def checkpoints(self) -> list[Path]:
        """Finished checkpoints in the directory, oldest first."""
        if not self.directory.is_dir():
            return []
        return sorted(p for p in self.directory.iterdir() if _NAME.match(p.name))

    def _prune(self) -> None:
        for old in self.checkpoints()[: -self.keep]:
            old.unlink(missing_ok=True)
        self._remove_stale_temporaries()

    def _remove_stale_temporaries(self) -> None:
        if not self.directory.is_dir():
            return
        for tmp in self.directory.glob(".ckpt-*.tmp*"):
            if not tmp.name.endswith(f".tmp{os.getpid()}"):
                tmp.unlink(missing_ok=True)  # left by a process that died while saving

    # -- reading ------------------------------------------------------------------------------

    def resume(self, path: str | os.PathLike[str] | None = None) -> Path | None:
        """Restore the newest checkpoint (or ``path``); None if there is none yet."""
        if _world()[0] == 0:
            self._remove_stale_temporaries()
        if path is None:
            found = self.checkpoints()
            if not found:
                return None
            target = found[-1]
        else:
            target = Path(path)
        state = load_checkpoint(target)
        self._restore(state, target)
        self.last_saved_update = self._updates()
        return target

    def _restore(self, state: Mapping[str, Any], path: Path) -> None:
        rank, world = _world()
        if state["world_size"] != world:
            raise CheckpointError(
                f"{path}: written by {state['world_size']} process(es), resumed by {world}: "
                "resume with the same number of processes (the data shards and RNG streams "
                "depend on it)"
            )
        target = unwrap(self.model)
        _check_model(target.state_dict(), state["model"], path)
        for key, present in (
            ("optimizer", self.optimizer),
            ("scheduler", self.scheduler),
            ("step", self.step),
            ("amp", self.amp),
            ("loader", self.loader),
        ):
            if (key in state) != (present is not None):
                have = "has" if key in state else "has no"
                raise CheckpointError(
                    f"{path}: the checkpoint {have} {key} state but the Checkpointer was built "
                    f"{'without' if key in state else 'with'} one: pass the same objects as "
                    "when saving"
                )
        missing = set(self.extra) ^ set(state["extra"])
        if missing:
            raise CheckpointError(
                f"{path}: extra objects differ ({sorted(missing)}): pass the same extra= as "
                "when saving"
            )
        try:
            target.load_state_dict(state["model"])
            if self.optimizer is not None:
                self.optimizer.load_state_dict(state["optimizer"])
            if self.scheduler is not None:
                self.scheduler.load_state_dict(state["scheduler"])
            if self.step is not None:
                self.step.load_state_dict(state["step"])
            if self.amp is not None:
                self.amp.load_state_dict(state["amp"])
            if self.loader is not None:
                self.loader.load_state_dict(state["loader"])
            for name, obj in self.extra.items():
                obj.load_state_dict(state["extra"][name])
        except (ValueError, KeyError, RuntimeError) as err:
            raise CheckpointError(f"{path}: does not fit this run: {err}") from err
        _set_rng_state(state["rng"][rank])


def _check_model(current: Mapping[str, Any], saved: Mapping[str, Any], path: Path) -> None:
    missing = [k for k in current if k not in saved]
    unexpected = [k for k in saved if k not in current]
    shapes = [
        f"{k}: {tuple(saved[k].shape)} saved, {tuple(v.shape)} here"
        for k, v in current.items()
        if k in saved and isinstance(v, torch.Tensor) and tuple(saved[k].shape) != tuple(v.shape)
    ]
    if missing or unexpected or shapes:
        parts = []
        if missing:
            parts.append(f"missing keys {missing[:5]}")
        if unexpected:
            parts.append(f"unexpected keys {unexpected[:5]}")
        if shapes:
            parts.append("shape mismatch " + "; ".join(shapes[:5]))
        raise CheckpointError(
            f"{path}: the model does not match the checkpoint ({', '.join(parts)}): build the "
            "same model as the run that saved it"
        )


def _atomic_save(state: Any, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # atomic on POSIX: the name points at the old or the new file
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)  # make the rename itself durable
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
