"""The checkpoint pieces for what a Checkpointer is given: model, optimizer, step, amp, loader.

Each wraps one object, checks a saved state against it (keys and shapes, parameter
groups, accumulation and precision, data set and batch size), and loads it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import nn

from .._data._epoch_loader import EpochLoader, LoaderSnapshot
from .._errors import CheckpointError
from .._parallel._grad_sync import sync_kind, unwrap
from .._precision import autocast_step
from .._step import _accumulate, _compose, _group
from .._types import Clock, Stateful
from ._contract import ExtraStates, StatePiece, UserState, expect, need
from ._rng import RngStates

# The GradScaler.load_state_dict reads these.
_SCALER_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")


class ModelState:
    """The model's weights and buffers, seen through DDP and ``torch.compile`` wrappers."""

    per_rank = False

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def state_dict(self) -> object:
        return unwrap(self.model).state_dict()

    def check_state_dict(self, saved: object) -> None:
        _check_model(unwrap(self.model).state_dict(), expect(saved, Mapping, "'model'"))

    def snapshot(self) -> None:
        # None: the model loads last, after its keys and shapes were checked, so no load
        # after it can fail and need it back; a copy would double the model's memory.
        return None

    def load_state_dict(self, saved: Mapping[str, object]) -> None:
        unwrap(self.model).load_state_dict(saved)

    def restore(self, snapshot: None) -> None:
        """Nothing to put back: see ``snapshot``."""


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
    """The optimizer's state; a saved one must have this optimizer's groups and sizes."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        super().__init__(optimizer)
        self.optimizer = optimizer

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

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

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


class AmpState(UserState):
    """An ``autocast_step``'s GradScaler state; a saved one must be of this precision."""

    def __init__(self, amp: autocast_step, who: str = "amp= state") -> None:
        super().__init__(amp)
        self.amp, self.who = amp, who

    def check_state_dict(self, saved: object) -> None:
        state = expect(saved, Mapping, "'amp'")
        if self.amp.scaler is None and state:
            raise CheckpointError(
                f"the checkpoint's {self.who} holds a GradScaler (it was saved with fp16) but "
                f"this run's precision is {self.amp.precision!r}: resume with precision='fp16'"
            )
        if self.amp.scaler is not None:
            scaler = state.get("scaler")
            if not isinstance(scaler, Mapping):
                raise CheckpointError(
                    f"the checkpoint's {self.who} holds no GradScaler (it was saved with bf16 "
                    "or fp32) but this run's precision is 'fp16': resume with the precision it "
                    "was saved with"
                )
            missing = [k for k in _SCALER_KEYS if k not in scaler]
            if missing:
                raise CheckpointError(
                    f"incomplete checkpoint: the GradScaler state has no {missing}"
                )


class StepState(UserState):
    """A ``loopkit.step``'s or ``accumulate``'s counters (and a step's GradScaler)."""

    def __init__(self, step: _compose.step | _accumulate.accumulate) -> None:
        super().__init__(step)
        self.step = step
        self.accumulator = step.accumulator if isinstance(step, _compose.step) else step
        self.clock: Clock = self.accumulator

    def _counters(self, saved: Mapping[str, object]) -> Mapping[str, object]:
        if isinstance(self.step, _compose.step):
            return need(saved, "accumulate", Mapping, "'step.accumulate'")
        return saved

    def check_state_dict(self, saved: object) -> None:
        state = expect(saved, Mapping, "'step'")
        counters = self._counters(state)
        if isinstance(self.step, _compose.step):
            AmpState(self.step.amp, "step").check_state_dict(
                need(state, "amp", Mapping, "'step.amp'")
            )
        every = need(counters, "every", int, "the step's 'every'")
        if every != self.accumulator.every:
            raise CheckpointError(
                f"saved with accumulate every={every} but this run's step accumulates "
                f"every={self.accumulator.every}: build the step with accumulate={every} to "
                "resume it"
            )
        for key in ("updates", "skipped"):
            if need(counters, key, int, f"the step's {key!r}") < 0:
                raise CheckpointError(f"damaged checkpoint: the step's {key!r} is negative")

    def saved_updates(self, saved: object) -> int:
        """The update count in a checked saved state."""
        updates = self._counters(expect(saved, Mapping, "'step'"))["updates"]
        assert isinstance(updates, int)  # check_state_dict made sure
        return updates


class StepsState(UserState):
    """A ``loopkit.steps`` group: every member's state, and the clock's windows."""

    def __init__(self, group: _group.steps) -> None:
        super().__init__(group)
        self.group = group
        self.clock: Clock = group
        self._members = [StepState(m) for m in group.members]

    def check_state_dict(self, saved: object) -> None:
        state = expect(saved, Mapping, "'step'")
        members = need(state, "steps", list, "'step.steps'")
        if len(members) != len(self._members):
            raise CheckpointError(
                f"saved with {len(members)} steps in the group but this run's group has "
                f"{len(self._members)}: build loopkit.steps(...) with the same steps, in order"
            )
        for piece, member in zip(self._members, members, strict=True):
            piece.check_state_dict(member)
        if need(state, "updates", int, "the group's 'updates'") < 0:
            raise CheckpointError("damaged checkpoint: the group's 'updates' is negative")

    def saved_updates(self, saved: object) -> int:
        """The clock's windows in a checked saved state."""
        updates = expect(saved, Mapping, "'step'")["updates"]
        assert isinstance(updates, int)  # check_state_dict made sure
        return updates


class LoaderState:
    """An ``EpochLoader``'s place in its epoch, less the batches a lookahead holds back."""

    per_rank = False

    def __init__(self, loader: EpochLoader, lookahead: Callable[[], int]) -> None:
        self.loader = loader
        self.lookahead = lookahead

    def state_dict(self) -> object:
        return self.loader.state_dict(consumed=self.loader.position - self.lookahead())

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
    if sync_kind(model) in ("fsdp1", "fsdp2"):
        raise ValueError(
            "the model is sharded (FSDP): its full state lives on no single rank; save "
            "it with torch.distributed.checkpoint instead"
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
    if isinstance(step, _group.steps):
        pieces["step"] = stepper = StepsState(step)
    elif step is not None:
        if not isinstance(step, (_compose.step, _accumulate.accumulate)):
            raise TypeError(
                f"step must be a loopkit.step or loopkit.accumulate (or a loopkit.steps group), "
                f"got {step!r}"
            )
        pieces["step"] = stepper = StepState(step)
    if amp is not None:
        if not isinstance(amp, autocast_step):
            raise TypeError(f"amp must be a loopkit.autocast_step, got {amp!r}")
        pieces["amp"] = AmpState(amp)
    if loader is not None:
        if not isinstance(loader, EpochLoader):
            raise TypeError(
                "loader must be a loopkit.distributed.loader(...) (it can skip to the batch "
                "where the run stopped and draws each batch's random numbers from a key a "
                f"resume reproduces), got {type(loader).__name__}. It takes your dataset and "
                "every DataLoader argument but the sampler (collate_fn, prefetch_factor, ...); "
                "with a DataLoader of your own, leave loader= out: the RNG states are restored, "
                "the position in the epoch and workers' random streams are not"
            )
        clock = stepper.clock if stepper is not None else None
        # The batches iterate() holds back are not consumed: a resume hands them out again.
        pieces["loader"] = LoaderState(loader, lambda: clock.lookahead if clock is not None else 0)
    pieces["extra"] = ExtraStates(extra)
    pieces["rng"] = RngStates()
    return pieces
