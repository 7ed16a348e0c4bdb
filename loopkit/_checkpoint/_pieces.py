"""The checkpoint pieces for what a Checkpointer is given: model, optimizer, step, amp, loader.

Each wraps one object, checks a saved state against it (keys and shapes, parameter
groups, accumulation and precision, data set and batch size), and loads it.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Collection, Mapping

import torch
from torch import nn

from .._data._epoch_loader import EpochLoader, LoaderSnapshot
from .._errors import CheckpointError
from .._parallel._grad_sync import innermost, plain_key, sync_kind
from .._precision import autocast_step
from .._step import _accumulate, _compose, _group
from .._types import Clock, Stateful
from ._contract import ExtraStates, StatePiece, UserState, copied, expect, need
from ._rng import RngStates

# The GradScaler.load_state_dict reads these.
_SCALER_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")


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


class AmpState(UserState):
    """An ``autocast_step``'s GradScaler state and precision; a saved one must be this one's."""

    def __init__(self, amp: autocast_step, who: str = "amp= state") -> None:
        super().__init__(amp)
        self.amp, self.who = amp, who

    def state_dict(self) -> dict[str, object]:
        return {**self.amp.state_dict(), "precision": self.amp.precision}

    def check_state_dict(self, saved: object) -> None:
        state = expect(saved, Mapping, "'amp'")
        if self.amp.scaler is None and any(k != "precision" for k in state):
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
        check_precision(state.get("precision"), self.amp.precision, self.who)

    def load_state_dict(self, saved: object) -> None:
        state = expect(saved, Mapping, "'amp'")
        self.amp.load_state_dict({k: v for k, v in state.items() if k != "precision"})


def check_precision(saved: object, here: str | None, who: str) -> None:
    """Refuse a resume in another precision than the one saved (unknown on either side: pass).

    A checkpoint written before precisions were recorded has none; an ``accumulate``
    without ``amp=`` has none either (its autocast, if any, is the Checkpointer's ``amp=``).
    """
    if saved is None or here is None or saved == here:
        return
    raise CheckpointError(
        f"the checkpoint's {who} was saved with precision {saved!r} but this run's is "
        f"{here!r}: resume with precision={saved!r} (a run resumed in another precision "
        "does not continue the one that was saved)"
    )


class StepState(UserState):
    """A ``loopkit.step``'s or ``accumulate``'s counters, its GradScaler, precision and own
    scheduler (the one given to the step, unless the Checkpointer saves it under
    ``scheduler=`` or ``extra=``); an ``accumulate``'s ``amp=`` likewise; a step's own
    ``log=`` (its cadence, unflushed values and trackers' runs), unless under ``extra=``.

    The log is not training state, so its entry is lenient both ways: a checkpoint without
    it resumes with the log afresh, and one with it where the step has no log ignores it;
    a log state for other sinks is refused before anything loads."""

    def __init__(
        self,
        step: _compose.step | _accumulate.accumulate,
        elsewhere: Collection[int] = (),
        who: str = "step",
    ) -> None:
        super().__init__(step)
        self.step, self.who = step, who
        self.accumulator = step.accumulator if isinstance(step, _compose.step) else step
        log = step.log if isinstance(step, _compose.step) else None
        # The step's own log (it plots against this step), unless extra= saves it.
        own_log = log is not None and log.clock is step and id(log) not in elsewhere
        self.log = log if own_log else None
        self.clock: Clock = self.accumulator
        amp = step.amp if isinstance(step, _compose.step) else self.accumulator.amp
        self.precision = None if amp is None else amp.precision
        # What the step owns that no other piece saves (``elsewhere``: ids of those objects).
        own_amp = amp if isinstance(step, _accumulate.accumulate) else None
        self.amp = None if own_amp is None or id(own_amp) in elsewhere else own_amp
        scheduler = self.accumulator._rule.scheduler
        if scheduler is not None and not isinstance(scheduler, Stateful):
            # loopkit.step takes any object with step(); one whose lr is a function of what
            # the checkpoint restores (the optimizer's step count) needs no state of its own.
            warnings.warn(
                f"the {who}'s scheduler ({type(scheduler).__name__}) has no state_dict() and "
                "load_state_dict(), so checkpoints do not hold it: if it keeps state of its "
                "own (a step count), give it those two methods or a resumed run restarts it",
                stacklevel=4,
            )
            scheduler = None
        self.scheduler: Stateful | None = (
            None if scheduler is None or id(scheduler) in elsewhere else scheduler
        )
        # The step's ema= (one, or several decays), unless saved under extra=.
        self.emas = [e for e in self.accumulator._rule.emas if id(e) not in elsewhere]

    def _counters(self, saved: Mapping[str, object]) -> Mapping[str, object]:
        if isinstance(self.step, _compose.step):
            return need(saved, "accumulate", Mapping, "'step.accumulate'")
        return saved

    def owned_state(self) -> dict[str, object]:
        """The precision and what the step owns beyond its counters and GradScaler."""
        state: dict[str, object] = {}
        if self.log is not None:
            state["log"] = self.log.state_dict()
        if self.precision is not None:
            state["precision"] = self.precision
        if self.scheduler is not None:
            state["scheduler"] = self.scheduler.state_dict()
        if self.amp is not None:
            state["amp"] = self.amp.state_dict()
        if self.emas:  # one average saved as itself (as before several were taken)
            states = [e.state_dict() for e in self.emas]
            state["ema"] = states[0] if len(states) == 1 else states
        return state

    def state_dict(self) -> dict[str, object]:
        return {**self.step.state_dict(), **self.owned_state()}

    def check_state_dict(self, saved: object) -> None:
        state = expect(saved, Mapping, "'step'")
        counters = self._counters(state)
        amp = self.step.amp if isinstance(self.step, _compose.step) else self.amp
        if amp is not None:
            AmpState(amp, self.who).check_state_dict(need(state, "amp", Mapping, "'step.amp'"))
        elif "amp" in state:
            raise CheckpointError(
                f"the checkpoint's {self.who} holds an amp= state but this run's accumulate "
                "has none (or the Checkpointer saves it under amp=): build it as when saving"
            )
        check_precision(state.get("precision"), self.precision, self.who)
        if self.log is not None and "log" in state:
            self.log.check_state_dict(state["log"])  # its sinks: the same as when saving
        self._check_owned(state, "scheduler", self.scheduler, "scheduler=/extra=")
        self._check_owned(state, "ema", self.emas or None, "extra=")
        if self.emas:
            saved_emas = _ema_states(state["ema"])
            if len(saved_emas) != len(self.emas):
                raise CheckpointError(
                    f"the checkpoint's {self.who} holds {len(saved_emas)} ema(s) but this run's "
                    f"has {len(self.emas)}: give the step the same averages (ema=[...]) as when "
                    "saving"
                )
            for average, saved_ema in zip(self.emas, saved_emas, strict=True):
                average.check_state_dict(saved_ema)
        every = need(counters, "every", int, "the step's 'every'")
        if every != self.accumulator.every:
            raise CheckpointError(
                f"saved with accumulate every={every} but this run's {self.who} accumulates "
                f"every={self.accumulator.every}: build the step with accumulate={every} to "
                "resume it"
            )
        for key in ("updates", "skipped"):
            if need(counters, key, int, f"the step's {key!r}") < 0:
                raise CheckpointError(f"damaged checkpoint: the step's {key!r} is negative")

    def _check_owned(self, state: Mapping[str, object], key: str, piece: object,
                     elsewhere: str) -> None:  # fmt: skip
        """Refuse a checkpoint that has the step's ``key`` (scheduler, ema) where this run's
        step has none, or the other way round; ``elsewhere``: where else it could be saved."""
        if piece is not None and key not in state:
            raise CheckpointError(
                f"this run's {self.who} is built with {key}= but the checkpoint holds no "
                f"state for it (saved without one, or under the Checkpointer's {elsewhere}): "
                "build the step and the Checkpointer as when saving"
            )
        if piece is None and key in state:
            raise CheckpointError(
                f"the checkpoint holds the {self.who}'s {key} but this run's {self.who} has "
                f"none (or the Checkpointer saves it under {elsewhere}): build the step and "
                "the Checkpointer as when saving"
            )

    def snapshot(self) -> object:
        return copied(self.state_dict())

    def load_state_dict(self, saved: object) -> None:
        state = expect(saved, Mapping, "'step'")
        self.step.load_state_dict(state)  # reads its own entries only
        self.load_owned(state)

    def load_owned(self, saved: Mapping[str, object]) -> None:
        """Load what ``owned_state`` saved (the step's own entries are loaded apart)."""
        log_state = saved.get("log")
        if self.log is not None and isinstance(log_state, Mapping):
            self.log.load_state_dict(log_state)
        if self.scheduler is not None:
            self.scheduler.load_state_dict(saved["scheduler"])
        if self.amp is not None:
            amp_state = saved["amp"]
            assert isinstance(amp_state, Mapping)  # check_state_dict made sure
            self.amp.load_state_dict(amp_state)
        if self.emas:  # check_state_dict made sure they fit
            for average, ema_state in zip(self.emas, _ema_states(saved["ema"]), strict=True):
                average.load_state_dict(ema_state)

    def restore(self, snapshot: object) -> None:
        self.load_state_dict(snapshot)

    def saved_updates(self, saved: object) -> int:
        """The update count in a checked saved state."""
        updates = self._counters(expect(saved, Mapping, "'step'"))["updates"]
        assert isinstance(updates, int)  # check_state_dict made sure
        return updates


def _ema_states(saved: object) -> list[Mapping[str, object]]:
    """A step's saved averages as a list (one average is saved as itself)."""
    if isinstance(saved, Mapping):
        return [saved]
    if isinstance(saved, list) and all(isinstance(e, Mapping) for e in saved):
        return saved
    raise CheckpointError(f"damaged checkpoint: the step's ema state is a {type(saved).__name__}")


class StepsState(UserState):
    """A ``loopkit.steps`` group: each member's state (as a single step's), the clock's windows."""

    def __init__(self, group: _group.steps, elsewhere: Collection[int] = ()) -> None:
        super().__init__(group)
        self.group = group
        self.clock: Clock = group
        self._members = [
            StepState(m, elsewhere, f"group's step {i}") for i, m in enumerate(group.members)
        ]

    def state_dict(self) -> dict[str, object]:
        state = dict(self.group.state_dict())
        state["steps"] = [
            {**saved, **piece.owned_state()}
            for saved, piece in zip(state["steps"], self._members, strict=True)
        ]
        return state

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

    def snapshot(self) -> object:
        return copied(self.state_dict())

    def load_state_dict(self, saved: object) -> None:
        state = expect(saved, Mapping, "'step'")
        self.group.load_state_dict(state)  # every member's own entries, and the clock
        members = state["steps"]
        assert isinstance(members, list)  # check_state_dict made sure
        for piece, member in zip(self._members, members, strict=True):
            piece.load_owned(member)

    def restore(self, snapshot: object) -> None:
        self.load_state_dict(snapshot)

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
