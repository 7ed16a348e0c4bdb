"""``compile_optimizer=``: the optimizer's step compiled once, its learning rates as tensors.

Dynamo guards on each param group's float ``lr``: a scheduler that changes it makes a
compiled ``optimizer.step`` recompile at the next update (and, past the recompile limit,
fall back to running eagerly). Here each group's ``lr`` is a 0-d tensor only during the
compiled call, filled from the group's float (an in-place fill on the host, no host-device
sync); outside it the groups hold their floats as before, so a scheduler, ``state_dict``,
a checkpoint and a log see exactly what an eager run shows. An update that creates
optimizer state (the first, and a parameter's first gradient) runs eagerly, every other
one compiled: decided from the optimizer's state alone, so a resumed run (or one whose state
was loaded by hand) runs each update as the uninterrupted run did, bit for bit.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

import torch

from .._tracing import EagerStance

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep

# torch.optim's optimizers whose step takes a tensor lr under torch.compile (checked on
# torch 2.13: each one's compiled updates equal its eager ones within float rounding).
_TAKE_TENSOR_LR = (
    "Adam", "AdamW", "SGD", "RMSprop", "Adagrad", "Adamax", "NAdam", "RAdam", "ASGD",
    "Adadelta", "Rprop",
)  # fmt: skip


def _schedulers(scheduler: object) -> list[object]:
    """``scheduler`` and those it chains (SequentialLR, ChainedScheduler)."""
    inner = getattr(scheduler, "_schedulers", None)
    if isinstance(inner, (list, tuple)):
        return [scheduler, *[s for i in inner for s in _schedulers(i)]]
    return [scheduler]


def _in_torch(fn: object) -> bool:
    """Whether ``fn``'s code is torch's own (functools-style wrappers copy the name and
    module of what they wrap, not their code)."""
    code = getattr(fn, "__code__", None)
    return code is not None and code.co_filename.startswith(_TORCH_DIR)


def _unwrapped(step: Callable[..., Any]) -> Callable[..., Any]:
    """``step`` without torch's wrappers around it: the profiling hook that the first
    optimizer built of each class puts on that class's step (so whether it is there depends
    on what was built before), ``no_grad`` and the like. Another wrapper is kept: it is code
    of the user's that may read a float lr."""
    while _in_torch(step) and callable(getattr(step, "__wrapped__", None)):
        step = step.__wrapped__  # type: ignore[attr-defined]
    return step


def _own_step(cls: type) -> Callable[..., Any] | None:
    """The step ``cls`` runs when it is not one of torch.optim's (its own, or a subclass's
    override), else None; the same whatever optimizers were built before."""
    step = _unwrapped(cls.step)  # type: ignore[attr-defined]
    torch_steps = {_unwrapped(getattr(torch.optim, n).step) for n in _TAKE_TENSOR_LR}
    return None if step in torch_steps else step


def check_compilable(optimizer: torch.optim.Optimizer, scheduler: object) -> None:
    """Refuse, with why, an optimizer or scheduler a compiled step cannot serve."""
    name = type(optimizer).__name__
    own = _own_step(type(optimizer))
    if own is not None:  # another optimizer, or a subclass's own step
        where = getattr(own, "__qualname__", name).split("<locals>.")[-1]
        raise TypeError(
            f"compile_optimizer= compiles the steps of torch.optim's optimizers, which take a "
            f"tensor learning rate ({', '.join(_TAKE_TENSOR_LR)}); {name}'s step may need a float "
            f"lr (it runs {where}, not theirs): leave compile_optimizer out (or compile its "
            "step yourself); a subclass that only sets its own defaults is accepted"
        )
    for group in optimizer.param_groups:
        if group.get("fused"):
            raise ValueError(
                f"{name}(fused=True) is one fused kernel already, which torch.compile does "
                "not trace: compile_optimizer= would add nothing. Keep fused=True and leave "
                "compile_optimizer out, or build the optimizer without fused=True"
            )
        if (
            isinstance(optimizer, torch.optim.Adam)
            and group.get("foreach")
            and not group.get("capturable")
        ):
            raise ValueError(
                f"{name}(foreach=True) takes no tensor lr unless capturable=True: build it "
                "with foreach=None (the default; compiled, it is fused anyway) or "
                "capturable=True"
            )
    for sched in _schedulers(scheduler):
        if getattr(sched, "cycle_momentum", False):
            raise ValueError(
                f"{type(sched).__name__}(cycle_momentum=True) changes the optimizer's momentum "
                "(betas) at every update, which recompiles a compiled step each time: build it "
                "with cycle_momentum=False, or leave compile_optimizer out"
            )


def _stateless(optimizer: torch.optim.Optimizer, group: Mapping[str, Any]) -> bool:
    """Whether ``optimizer`` keeps no state for ``group``'s parameters (SGD, no momentum)."""
    return isinstance(optimizer, torch.optim.SGD) and not group.get("momentum")


def _layout(optimizer: torch.optim.Optimizer) -> tuple[object, ...]:
    """What changes when state or parameters come or go: the state's identity (a
    ``load_state_dict`` replaces it) and size, and each group's parameter list."""
    groups = optimizer.param_groups
    lists = tuple((id(g["params"]), len(g["params"]), _stateless(optimizer, g)) for g in groups)
    return (id(optimizer.state), len(optimizer.state), id(groups), lists)


class StateWatch:
    """Whether the next ``optimizer.step()`` creates state: a parameter with a gradient has
    none yet (the first update; a parameter's first gradient; a group added since). Read
    from the optimizer alone, so a resumed run (or one whose state was loaded by hand)
    answers as the uninterrupted run did at that update."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self._covered: tuple[object, ...] | None = None  # a layout where all had state

    def creates_state(self) -> bool:
        """The answer for the next step (no device work, no host sync)."""
        opt = self.optimizer
        layout = _layout(opt)
        if layout == self._covered:  # every parameter has its state: nothing to create
            return False
        # A pass over the parameters (once, and while some have no state: frozen or unused).
        have = {id(p) for p, s in opt.state.items() if s}
        missing = [
            p
            for g in opt.param_groups
            if not _stateless(opt, g)
            for p in g["params"]
            if id(p) not in have
        ]
        if not missing:
            self._covered = layout
        return any(p.grad is not None for p in missing)


class CompiledOptimizerStep:
    """Calls ``optimizer.step()`` compiled, the groups' lrs passed as tensors."""

    def __init__(self, optimizer: torch.optim.Optimizer, options: Mapping[str, Any]) -> None:
        self.optimizer = optimizer
        self._lrs: list[torch.Tensor] = []
        self._state = StateWatch(optimizer)
        # Dynamo guards on the optimizer's identity: every optimizer's step would count
        # against one cache's recompile limit (8), past which the 9th of a process (a sweep,
        # a GAN's second member) runs eagerly. Each step gets its own cache.
        self._compiled = torch.compile(self._step, **{"isolate_recompiles": True, **options})

    def _step(self) -> None:
        # The class's step, not the instance's: an LR scheduler wraps the instance's step to
        # count calls, and that wrapper is one dynamo does not trace (a graph break).
        type(self.optimizer).step(self.optimizer)

    def __call__(self) -> None:
        if EagerStance.active() or self._state.creates_state():
            # An update that creates the optimizer's state runs eagerly, so the graph
            # compiled at the next is the steady one (no recompile when the state appears;
            # dynamo fails outright on SGD's first momentum step with two groups). Decided
            # from the state, never from "the first call of this process": compiled and
            # eager updates differ in the last bits, and a resumed run must make each update
            # as the uninterrupted run did. A step the doctor measures runs eagerly too, with
            # float lrs (a tensor lr read eagerly is a host read per group).
            self._step()
            self.optimizer._opt_called = True  # type: ignore[attr-defined]
            return
        groups = self.optimizer.param_groups
        while len(self._lrs) < len(groups):  # a group added since: its own tensor
            # float64, as the eager step's Python float is: the same lr value.
            self._lrs.append(torch.zeros((), dtype=torch.float64))
        floats = [g["lr"] for g in groups]
        for group, lr, value in zip(groups, self._lrs, floats, strict=False):
            if not isinstance(value, torch.Tensor):  # a tensor lr the user set: as it is
                lr.fill_(value)  # a host tensor: no host-device sync
                group["lr"] = lr
        try:
            self._compiled()
        finally:
            for group, value in zip(groups, floats, strict=True):
                group["lr"] = value
        # What the scheduler's wrapper of optimizer.step would have recorded: a scheduler
        # stepped after this update is not "before optimizer.step()".
        self.optimizer._opt_called = True  # type: ignore[attr-defined]
