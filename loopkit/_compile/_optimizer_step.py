"""``compile_optimizer=``: the optimizer's step compiled once, its learning rates as tensors.

Dynamo guards on each param group's float ``lr``: a scheduler that changes it makes a
compiled ``optimizer.step`` recompile at the next update (and, past the recompile limit,
fall back to running eagerly). Here each group's ``lr`` is a 0-d tensor only during the
compiled call, filled from the group's float (an in-place fill on the host, no host-device
sync); outside it the groups hold their floats as before, so a scheduler, ``state_dict``,
a checkpoint and a log see exactly what an eager run shows. The first update runs eagerly
(it creates the optimizer's state); the graph compiled at the second is the steady one.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from .._tracing import EagerStance

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


def check_compilable(optimizer: torch.optim.Optimizer, scheduler: object) -> None:
    """Refuse, with why, an optimizer or scheduler a compiled step cannot serve."""
    name = type(optimizer).__name__
    steps = {getattr(torch.optim, n).step for n in _TAKE_TENSOR_LR}
    if type(optimizer).step not in steps:  # another optimizer, or a subclass's own step
        raise TypeError(
            f"compile_optimizer= compiles the steps of torch.optim's optimizers, which take a "
            f"tensor learning rate ({', '.join(_TAKE_TENSOR_LR)}); {name}'s step may need a "
            "float lr: leave compile_optimizer out (or compile its step yourself)"
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


class CompiledOptimizerStep:
    """Calls ``optimizer.step()`` compiled, the groups' lrs passed as tensors."""

    def __init__(self, optimizer: torch.optim.Optimizer, options: Mapping[str, Any]) -> None:
        self.optimizer = optimizer
        self._lrs: list[torch.Tensor] = []
        self._warm = False  # whether an update has run (the first runs eagerly)
        # Dynamo guards on the optimizer's identity: every optimizer's step would count
        # against one cache's recompile limit (8), past which the 9th of a process (a sweep,
        # a GAN's second member) runs eagerly. Each step gets its own cache.
        self._compiled = torch.compile(self._step, **{"isolate_recompiles": True, **options})

    def _step(self) -> None:
        # The class's step, not the instance's: an LR scheduler wraps the instance's step to
        # count calls, and that wrapper is one dynamo does not trace (a graph break).
        type(self.optimizer).step(self.optimizer)

    def __call__(self) -> None:
        if not self._warm or EagerStance.active():
            # The first update runs eagerly: it creates the optimizer's state, so the graph
            # compiled from the second on is the steady one (no recompile when the state
            # appears; dynamo fails outright on SGD's first momentum step with two groups).
            # A step the doctor measures runs eagerly too, with float lrs (a tensor lr read
            # eagerly is a host read per group).
            self._warm = True
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
