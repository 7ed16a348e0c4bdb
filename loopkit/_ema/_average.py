"""ema: an fp32 moving average of a model's trainable parameters, one update per real update.

The shadow is a list of fp32 tensors beside the model (never a deep copy of the model, so a
bf16 model still gets an fp32 average: a bf16 shadow at decay 0.9999 rounds most updates
away). Each update is one ``torch._foreach_lerp_`` over the shadow (bf16/fp16 parameters: a
``_foreach_mul_`` and a mixed-dtype ``_foreach_add_``); buffers (BatchNorm statistics) are
copied, not averaged. Under DDP every rank's parameters are the same after an update, so
their shadows are too, with no communication; under FSDP2 each rank averages its own shard
(the local tensor of each DTensor parameter), with no gather.

Given to ``loopkit.step(..., ema=)`` or ``accumulate(..., ema=)`` it is updated by the step
after each optimizer step that ran: never on a micro-step, never on an update skipped for
inf/nan. On its own, call ``ema.update()`` after ``optimizer.step()``.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from .._errors import CheckpointError
from .._parallel._grad_sync import plain_key, reshard, sync_kind, unwrap
from . import _export
from ._decay import check_settings, decay_at
from ._tensors import _as_param, _local, registered


def _inner(model: nn.Module) -> nn.Module:
    """The module whose parameter names the user knows: torch.compile and DDP peeled."""
    if sync_kind(model) == "fsdp1":
        raise ValueError(
            "an ema of an FSDP1 model (flat parameters) is not supported: shard it with FSDP2 "
            "(torch.distributed.fsdp.fully_shard), whose parameters the ema averages per shard"
        )
    reshard(model)  # its shards, not the whole parameters a no-grad forward left gathered
    module = unwrap(model)
    if isinstance(module, nn.parallel.DistributedDataParallel):
        module = module.module
    return unwrap(module)


class ema:
    """An exponential moving average of ``model``'s trainable parameters, kept in fp32.

    ``decay`` is the weight the average keeps at each of its updates; ``warmup=True`` ramps
    it as timm's ModelEmaV3 (``1 - (1 + k / warmup_gamma) ** -warmup_power`` at the
    (k+1)-th update, the first copying the weights); ``every=N`` averages on every N-th
    optimizer update. ``with ema.swapped():`` evaluates with the average.
    """

    def __init__(
        self,
        model: nn.Module,
        decay: float = 0.9999,
        *,
        warmup: bool = False,
        warmup_gamma: float = 1.0,
        warmup_power: float = 2 / 3,
        every: int = 1,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        check_settings(decay, every, warmup, warmup_gamma, warmup_power)
        module = _inner(model)
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError(
                "the model has no trainable parameters (requires_grad=True) to average"
            )
        self.model = model
        self._module = module
        self.decay, self.every, self.warmup = float(decay), int(every), warmup
        self.warmup_gamma, self.warmup_power = float(warmup_gamma), float(warmup_power)
        # Names without torch.compile's _orig_mod levels: a checkpoint resumes whether a
        # block is compiled or not (the first raw name finds the parameter again).
        self._names = [plain_key(n) for n, _ in named]
        self._first = named[0][0]
        self._params: list[torch.Tensor] = [p for _, p in named]
        # No DTensor (FSDP2) among them: each is its own local tensor (no to_local per update).
        self._plain = not any(callable(getattr(p, "to_local", None)) for p in self._params)
        self._buffer_names = [plain_key(n) for n, _ in module.named_buffers()]
        self._buffers = [b for _, b in module.named_buffers()]
        with torch.no_grad():
            # clone(): .float() of an fp32 tensor is the tensor itself.
            self.shadow = [_local(p).detach().float().clone() for p in self._params]
            self.buffers = [_local(b).detach().clone() for b in self._buffers]
        self.updates = 0
        """EMA updates made (the warm-up's count)."""
        self.seen = 0
        """Real optimizer updates seen (``every`` counts these)."""
        # The steps given it (weakly: a step rebuilt for a phase takes it on, the old one
        # goes), and the parameters' versions as a step last counted an update.
        self._steps: weakref.WeakSet[Any] = weakref.WeakSet()
        self._counted_at: int | None = None  # the process's optimizer steps then
        self._told = False  # the "never averaged" warning is given once

    # -- updating ------------------------------------------------------------------------------

    def update(self) -> bool:
        """Count one optimizer update (call it after ``optimizer.step()``); average on every
        ``every``-th. Returns whether it averaged."""
        if self._steps and not _stepped_since(self._counted_at, self._params):
            raise RuntimeError(
                "this ema is updated by the loopkit.step (or accumulate) it was given to "
                "(ema=), which already counted the update that made these weights: remove the "
                "ema.update() call"
            )
        return self.advance()

    def given_to(self, step: object) -> None:
        """``step`` counts each of its real updates here (``ema=``; several steps may, one
        after the other: a run's phases, each its own step)."""
        self._steps.add(step)
        self._counted_at = _optimizer_steps()  # these weights are counted already (hooked)

    def advance(self) -> bool:
        """One real optimizer update happened (what a step given this ema calls)."""
        self._check_model()
        self._counted_at = _TOTAL[0]  # these weights are counted (read once a step hooked it)
        self.seen += 1
        if self.seen % self.every:
            return False
        d = decay_at(self.updates + 1, self.decay, self.warmup, self.warmup_gamma,
                     self.warmup_power)  # fmt: skip
        self._average(1.0 - d)
        self.updates += 1
        return True

    def _never_averaged(self) -> None:
        """Warn once where the average is used but never moved while its model trained."""
        if self._told or self.seen or not _trained(self._params, self.shadow):
            return
        self._told = True
        warnings.warn(
            "this loopkit.ema has never been updated, but its model was trained since it was "
            "built: the average is still the initial weights. Give it to the step "
            "(loopkit.step(..., ema=average), or ema=[slow, fast] for several decays), or call "
            "average.update() after each optimizer.step()",
            stacklevel=3,
        )

    def _check_model(self) -> None:
        """Refuse to average tensors the model no longer trains (checked on one: O(1))."""
        first = self._params[0]
        if registered(self._module, self._first) is not first:
            raise RuntimeError(
                "the model's parameters were replaced after its ema was built (a to() that "
                "makes new ones, load_state_dict(assign=True)): build the ema afterwards"
            )
        here, kept = (first if self._plain else _local(first)).device, self.shadow[0].device
        if here != kept:
            raise RuntimeError(
                f"the model is on {here} but its ema was built on {kept}: build the ema "
                "after moving the model (model.to(device), then loopkit.ema(model))"
            )

    @torch.no_grad()
    def _average(self, weight: float) -> None:
        """shadow += weight * (param - shadow), one foreach kernel per dtype; buffers copied.

        ``weight`` is a Python float: a kernel argument, no host-device sync."""
        params = self._params if self._plain else [_local(p) for p in self._params]
        full = [i for i, p in enumerate(params) if p.dtype == torch.float32]
        if len(full) == len(params):
            torch._foreach_lerp_(self.shadow, params, weight)
        else:
            low = [i for i, p in enumerate(params) if p.dtype != torch.float32]
            if full:
                torch._foreach_lerp_([self.shadow[i] for i in full], [params[i] for i in full],
                                     weight)  # fmt: skip
            shadow_low = [self.shadow[i] for i in low]
            torch._foreach_mul_(shadow_low, 1.0 - weight)
            torch._foreach_add_(shadow_low, [params[i] for i in low], alpha=weight)
        if self.buffers:
            torch._foreach_copy_(self.buffers, [_local(b) for b in self._buffers])

    # -- using it ------------------------------------------------------------------------------

    @contextlib.contextmanager
    def swapped(self, model: nn.Module | None = None) -> Iterator[nn.Module]:
        """Put the average (and its buffers) into ``model`` (default: the averaged one) for
        the block; the training weights and buffers come back bit for bit in a ``finally``,
        even when the block raises. The training weights are copied aside meanwhile."""
        chosen = self.model if model is None else model
        params, buffers = self._targets(chosen)  # checked before anything changes
        self._never_averaged()
        targets = [*params, *buffers]
        with torch.no_grad():
            kept = [t.detach().clone() for t in targets]
        try:
            with torch.no_grad():
                torch._foreach_copy_(targets, [*self.shadow, *self.buffers])
            yield chosen
        finally:
            with torch.no_grad():
                torch._foreach_copy_(targets, kept)

    def _targets(self, model: nn.Module) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """``model``'s local parameter and buffer tensors matching the shadow, checked."""
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        module = _inner(model)
        named_params = {plain_key(n): p for n, p in module.named_parameters()}
        named_buffers = {plain_key(n): b for n, b in module.named_buffers()}
        missing = [n for n in self._names if n not in named_params]
        missing += [n for n in self._buffer_names if n not in named_buffers]
        if missing:
            raise ValueError(
                f"the model has no {missing[0]!r} (of {len(missing)} missing): swap the "
                "average into the model it was built on, or one of the same architecture"
            )
        params = [_local(named_params[n]) for n in self._names]
        buffers = [_local(named_buffers[n]) for n in self._buffer_names]
        for name, t, s in zip((*self._names, *self._buffer_names), (*params, *buffers),
                              (*self.shadow, *self.buffers), strict=True):  # fmt: skip
            if t.shape != s.shape:
                raise ValueError(
                    f"{name!r} is {tuple(t.shape)} in the model but {tuple(s.shape)} in the "
                    "average: swap it into a model of the same architecture (and sharding)"
                )
        return params, buffers

    def named_shadow(self) -> dict[str, torch.Tensor]:
        """The average by parameter name (fp32; an FSDP2 rank's shard of each)."""
        self._never_averaged()
        return dict(zip(self._names, self.shadow, strict=True))

    def export(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """The averaged model's whole ``state_dict`` by its keys (``_export``); ``dtype``:
        the averages' (None: each parameter's own). Under FSDP2 every rank calls it."""
        self._never_averaged()
        return _export.export(self, dtype)

    def adopt(self, state: Mapping[str, torch.Tensor], updates: int) -> None:
        """A job's saved average (a model ``state_dict``) as this one, ``updates`` in."""
        _export.adopt(self, state, updates)

    # -- checkpoints ---------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The average, the buffers' copies and the counters (tensors shared, not copied).

        Under FSDP2 each average is a DTensor laid out as its parameter (this rank's shard):
        ``torch.distributed.checkpoint.save({"ema": ema.state_dict()}, ...)`` saves the
        shards, and ``.full_tensor()`` gathers one."""
        self._never_averaged()
        return self._state()

    def _state(self) -> dict[str, Any]:
        return {
            "shadow": {
                n: _as_param(p, s)
                for n, p, s in zip(self._names, self._params, self.shadow, strict=True)
            },
            "buffers": dict(zip(self._buffer_names, self.buffers, strict=True)),
            "updates": self.updates,
            "seen": self.seen,
            "decay": self.decay,
            "every": self.every,
        }

    def check_state_dict(self, state: object) -> None:
        """Raise ``CheckpointError`` saying why ``state`` does not fit; changes nothing."""
        _check_saved(self, state)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what ``state_dict`` returned (checked first: a misfit changes nothing)."""
        self.check_state_dict(state)
        with torch.no_grad():
            for t, n in zip(self.shadow, self._names, strict=True):
                t.copy_(_local(state["shadow"][n]))
            for t, n in zip(self.buffers, self._buffer_names, strict=True):
                t.copy_(state["buffers"][n])
        self.updates, self.seen = int(state["updates"]), int(state["seen"])

    def snapshot(self) -> dict[str, Any]:
        """A copy of the state that later updates cannot change (a Checkpointer's undo)."""
        state = self._state()
        state["shadow"] = {n: t.detach().clone() for n, t in state["shadow"].items()}
        state["buffers"] = {n: t.detach().clone() for n, t in state["buffers"].items()}
        return state

    def restore(self, snapshot: Mapping[str, Any]) -> None:
        """Put back what ``snapshot`` took."""
        self.load_state_dict(snapshot)

    def __repr__(self) -> str:
        return (
            f"loopkit.ema(decay={self.decay}, every={self.every}, warmup={self.warmup}, "
            f"{len(self.shadow)} tensors, {self.updates} updates)"
        )


@torch.no_grad()
def _trained(params: Sequence[torch.Tensor], shadow: Sequence[torch.Tensor]) -> bool:
    """Whether the weights moved since the ema was built (never averaged, the shadow still
    holds them). Host-device sync: only while never averaged, where used."""
    return any(not torch.equal(_local(p).float(), s) for p, s in zip(params, shadow, strict=True))


def _check_saved(self: ema, state: object) -> None:
    """``ema.check_state_dict``: the saved keys, counters, settings, names and shapes."""
    if not isinstance(state, Mapping):
        raise CheckpointError(f"damaged checkpoint: the ema's state is a {type(state).__name__}")
    for key in ("shadow", "buffers", "updates", "seen", "decay", "every"):
        if key not in state:
            raise CheckpointError(f"incomplete checkpoint: the ema's {key!r} is missing")
    for key in ("updates", "seen"):
        value = state[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise CheckpointError(f"damaged checkpoint: the ema's {key!r} is {value!r}")
    if state["every"] != self.every or state["decay"] != self.decay:
        raise CheckpointError(
            f"the ema was saved with decay={state['decay']!r}, every={state['every']!r} but "
            f"this run's has decay={self.decay!r}, every={self.every!r}: build it as when "
            "saving"
        )
    for label, saved, names, mine in (
        ("parameter", state["shadow"], self._names, self.shadow),
        ("buffer", state["buffers"], self._buffer_names, self.buffers),
    ):
        if not isinstance(saved, Mapping) or sorted(saved) != sorted(names):
            raise CheckpointError(
                f"the ema's saved {label}s are not this model's: build the ema on the "
                "model it was saved with (the same trainable parameters)"
            )
        for name, t in zip(names, mine, strict=True):
            got = saved[name]
            if not isinstance(got, torch.Tensor) or _local(got).shape != t.shape:
                raise CheckpointError(
                    f"the ema's saved {label} {name!r} does not fit this model's {tuple(t.shape)}"
                )


# Optimizer steps taken in this process, counted by one global step hook added once an ema
# is given to a step, and the number of each optimizer's last step (weakly): an update()
# right after a step counted one, with no step since of an optimizer holding the ema's
# parameters, counts the same weights twice.
_TOTAL = [0]
_STEPS: weakref.WeakKeyDictionary[torch.optim.Optimizer, int] = weakref.WeakKeyDictionary()
_HOOKED: list[object] = []


def _optimizer_steps() -> int:
    """Optimizer steps so far (fused ones included), the hook added when first needed."""
    if not _HOOKED:
        _HOOKED.append(register_optimizer_step_post_hook(_count_optimizer_step))
    return _TOTAL[0]


def _count_optimizer_step(optimizer: torch.optim.Optimizer, args: object, kwargs: object) -> None:
    _TOTAL[0] += 1
    _STEPS[optimizer] = _TOTAL[0]


def _stepped_since(counted: int | None, params: Sequence[torch.Tensor]) -> bool:
    """Whether an optimizer holding any of ``params`` stepped after step number ``counted``
    (None: ever)."""
    before = counted or 0
    moved = [o for o, last in list(_STEPS.items()) if last > before]
    mine = {id(p) for p in params}
    return any(id(p) in mine for o in moved for g in o.param_groups for p in g["params"])
