"""The checkpoint pieces for what a Checkpointer is given: model, optimizer, step, amp, loader.

Each wraps one object, checks a saved state against it (keys and shapes, parameter
groups, data set and batch size), and loads it; ``pieces_for`` builds them. The step's
pieces are in ``_step_state``, amp's in ``_amp_state``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import nn

from .._data._epoch_loader import EpochLoader, LoaderSnapshot
from .._errors import CheckpointError
from .._parallel._grad_sync import innermost, plain_key, sync_kind
from .._precision import autocast_step
from .._step import _accumulate, _compose, _group
from .._types import Stateful
from ._amp_state import AmpState
from ._contract import ExtraStates, StatePiece, UserState, expect, need
from ._rng import RngStates
from ._step_state import StepsState, StepState
from ._stream_state import StreamState, stream_loader


class ModelState:
    """The model's weights and buffers under the names of the user's own module: no DDP
    ``module.`` prefix and no ``torch.compile`` ``_orig_mod.`` at any level, so a checkpoint
    resumes whatever the wrapping (compiled or not, DDP or one process, in either order)."""

    per_rank = False

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def state_dict(self) -> dict[str, object]:
        return {plain_key(k): v for k, v in innermost(self.model).state_dict().items()}

    def check_state_dict(self, saved: object) -> None:
        _check_model(self.state_dict(), _plain_names(expect(saved, Mapping, "'model'"), self))

    def snapshot(self) -> None:
        # None: the model loads last, after its keys and shapes were checked, so no load
        # after it can fail and need it back; a copy would double the model's memory.
        return None

    def load_state_dict(self, saved: Mapping[str, object]) -> None:
        plain = _plain_names(saved, self)
        module = innermost(self.model)
        module.load_state_dict({k: plain[plain_key(k)] for k in module.state_dict()})

    def restore(self, snapshot: None) -> None:
        """Nothing to put back: see ``snapshot``."""


def _plain_names(saved: Mapping[str, object], piece: ModelState) -> Mapping[str, object]:
    """A saved model state by the names ``ModelState`` saves under. Checkpoints written before
    then carry the wrappers' prefixes: a DDP model's ``module.``, a compiled one's
    ``_orig_mod.``."""
    plain = {plain_key(k): v for k, v in saved.items()}
    here = piece.state_dict()
    if plain.keys() != here.keys() and plain and all(k.startswith("module.") for k in plain):
        stripped = {k[len("module.") :]: v for k, v in plain.items()}
        if stripped.keys() == here.keys():
            return stripped
    return plain


def _check_model(current: Mapping[str, object], saved: Mapping[str, object]) -> None:
    missing = [k for k in current if k not in saved]
    unexpected = [k for k in saved if k not in current]
    not_tensors, shapes = [], []
    for k, v in current.items():
        was = saved.get(k)
        if not isinstance(v, torch.Tensor) or k not in saved:
            continue
        if not isinstance(was, torch.Tensor):
            not_tensors.append(k)
        elif tuple(was.shape) != tuple(v.shape):
            shapes.append(f"{k}: {tuple(was.shape)} saved, {tuple(v.shape)} here")
    parts = []
    if missing:
        parts.append(f"missing keys {missing[:5]}")
    if unexpected:
        parts.append(f"unexpected keys {unexpected[:5]}")
    if shapes:
        parts.append("shape mismatch " + "; ".join(shapes[:5]))
    if not_tensors:
        parts.append(f"not tensors {not_tensors[:5]}")
    if parts:
        raise CheckpointError(
            f"the model does not match the checkpoint ({', '.join(parts)}): build the same "
            "model as the run that saved it"
        )


def param_shapes(optimizer: torch.optim.Optimizer) -> list[list[list[int]]]:
    """The shape of each parameter the optimizer holds, group by group."""
    return [[list(p.shape) for p in group["params"]] for group in optimizer.param_groups]


class OptimizerState(UserState):
    """The optimizer's state; a saved one must have this optimizer's groups and sizes.

    ``optional``: the optimizer of ``step=`` saved without ``optimizer=`` (loopkit adds it):
    a file written before, without it, still loads, leaving the optimizer as it is."""

    def __init__(self, optimizer: torch.optim.Optimizer, optional: bool = False) -> None:
        super().__init__(optimizer)
        self.optimizer = optimizer
        self.optional = optional

    def check_state_dict(self, saved: object) -> None:
        state = expect(saved, Mapping, "'optimizer'")
        need(state, "state", Mapping, "'optimizer.state'")
        groups = need(state, "param_groups", (list, tuple), "'optimizer.param_groups'")
        here = param_shapes(self.optimizer)
        if len(groups) != len(here):
            raise CheckpointError(
                f"the optimizer has {len(here)} parameter group(s) but the checkpoint's has "
                f"{len(groups)}: build the optimizer with the same groups as when saving"
            )
        for i, (group, shapes) in enumerate(zip(groups, here, strict=True)):
            if not isinstance(group, Mapping) or not isinstance(group.get("params"), list):
                raise CheckpointError(
                    f"damaged checkpoint: optimizer param group {i} has no 'params' list"
                )
            if len(group["params"]) != len(shapes):
                raise CheckpointError(
                    f"optimizer param group {i} has {len(shapes)} parameters here but "
                    f"{len(group['params'])} in the checkpoint: build the optimizer with the "
                    "same parameters as when saving"
                )

    def snapshot(self) -> object:
        # Loading replaces the state tensors rather than writing into them: the references
        # in this state_dict are the way back, with no copy.
        return self.optimizer.state_dict()


class ParamShapes:
    """A record of the shapes behind the optimizer's parameter indices (never loaded).

    A resume whose optimizer lists its parameters in another order is refused before the
    optimizer's state is loaded into the wrong ones.
    """

    per_rank = False

    def __init__(self, optimizer: torch.optim.Optimizer, optional: bool = False) -> None:
        self.optimizer = optimizer
        self.optional = optional

    def state_dict(self) -> list[list[list[int]]]:
        return param_shapes(self.optimizer)

    def check_state_dict(self, saved: object) -> None:
        shapes = expect(saved, (list, tuple), "'optimizer_shapes'")
        here = param_shapes(self.optimizer)
        if [[list(s) for s in g] for g in shapes] == here:
            return
        wrong = [
            f"group {g} parameter {i}: {tuple(a)} saved, {tuple(b)} here"
            for g, (sg, hg) in enumerate(zip(shapes, here, strict=False))
            for i, (a, b) in enumerate(zip(sg, hg, strict=False))
            if list(a) != b
        ]
        raise CheckpointError(
            "the optimizer's parameters do not match the checkpoint's "
            f"({'; '.join(wrong[:3]) or 'another layout'}): build the optimizer over "
            "the same parameters, in the same order, as when saving"
        )

    def snapshot(self) -> None:
        """None: a record changes nothing when loaded."""

    def load_state_dict(self, saved: object) -> None:
        """Nothing to load: the optimizer's own piece loads its state."""

    def restore(self, snapshot: None) -> None:
        """Nothing to put back."""


class LoaderState:
    """An ``EpochLoader``'s place in its epoch, less the batches a lookahead holds back."""

    per_rank = False

    def __init__(self, loader: EpochLoader, lookahead: Callable[[], int]) -> None:
        self.loader = loader
        self.lookahead = lookahead
        self.epoch_open = False
        """Set while a save on a pass's last window is written before the epoch's own code."""

    def state_dict(self) -> object:
        consumed = self.loader.position - self.lookahead()
        return self.loader.state_dict(consumed=consumed, epoch_open=self.epoch_open)

    def check_state_dict(self, saved: object) -> None:
        try:
            self.loader._check_state(saved)
        except ValueError as err:
            raise CheckpointError(f"does not fit this run's loader: {err}") from err

    def snapshot(self) -> LoaderSnapshot:
        return self.loader._snapshot()

    def load_state_dict(self, saved: Mapping[str, object]) -> None:
        self.loader.load_state_dict(saved)

    def restore(self, snapshot: LoaderSnapshot) -> None:
        self.loader._restore(snapshot)


def _steps_optimizers(step: object) -> list[tuple[str, torch.optim.Optimizer]]:
    """The optimizers a ``step=`` updates, by the file key each is saved under by default."""
    if isinstance(step, _group.steps):
        return [(f"optimizer.{k}", m.optimizer) for k, m in enumerate(step.members)]
    if isinstance(step, (_compose.step, _accumulate.accumulate)):
        return [("optimizer", step.optimizer)]
    return []


def pieces_for(
    model: object,
    optimizer: object,
    scheduler: object,
    step: object,
    amp: object,
    loader: object,
    extra: Mapping[str, object],
) -> dict[str, StatePiece]:
    """A Checkpointer's objects as pieces by file key; an object that cannot be one is refused."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if sync_kind(model) == "fsdp1" or any(sync_kind(m) == "fsdp1" for m in model.modules()):
        raise ValueError(
            "the model is sharded by FSDP1 (flat parameters), which the Checkpointer does not "
            "save: shard it with FSDP2 (loopkit.distributed.wrap(model, fsdp=Block), or "
            "torch.distributed.fsdp.fully_shard), whose checkpoints every rank writes its part of"
        )
    pieces: dict[str, StatePiece] = {"model": ModelState(model)}
    if optimizer is not None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {optimizer!r}")
        pieces["optimizer"] = OptimizerState(optimizer)
        pieces["optimizer_shapes"] = ParamShapes(optimizer)
    if scheduler is not None:
        if not isinstance(scheduler, Stateful):
            raise TypeError("scheduler must have state_dict() and load_state_dict()")
        pieces["scheduler"] = UserState(scheduler)
    stepper: StepState | StepsState | None = None
    # A step saves what it owns (its scheduler, an accumulate's amp) unless a piece of its
    # own saves that object already.
    elsewhere = {id(obj) for obj in (scheduler, amp, *extra.values()) if obj is not None}
    if isinstance(step, _group.steps):
        pieces["step"] = stepper = StepsState(step, elsewhere)
    elif step is not None:
        if not isinstance(step, (_compose.step, _accumulate.accumulate)):
            raise TypeError(
                f"step must be a loopkit.step or loopkit.accumulate (or a loopkit.steps group), "
                f"got {step!r}"
            )
        pieces["step"] = stepper = StepState(step, elsewhere)
    for name, owned in _steps_optimizers(step):
        # The step's optimizer is saved with it unless optimizer=/extra= holds it: a resume
        # without its state (Adam's moments, momentum) would restart it, silently.
        if id(owned) not in {id(optimizer), *map(id, extra.values())}:
            name = name if name not in pieces else f"step.{name}"  # optimizer= is another
            pieces[name] = OptimizerState(owned, optional=True)
            pieces[f"{name}_shapes"] = ParamShapes(owned, optional=True)
    if amp is not None:
        if not isinstance(amp, autocast_step):
            raise TypeError(f"amp must be a loopkit.autocast_step, got {amp!r}")
        pieces["amp"] = AmpState(amp)
    if isinstance(loader, EpochLoader):
        clock = stepper.clock if stepper is not None else None
        # The batches iterate() holds back are not consumed: a resume hands them out again.
        pieces["loader"] = LoaderState(loader, lambda: clock.lookahead if clock is not None else 0)
    elif loader is not None:
        pieces["loader"] = StreamState(stream_loader(loader))
    pieces["extra"] = ExtraStates(extra)
    pieces["rng"] = RngStates()
    return pieces
