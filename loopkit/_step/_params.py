"""The parameters an optimizer updates, as one list kept in step with its param groups."""

from __future__ import annotations

import torch


class OptimizerParams:
    """The optimizer's parameters (re-read when a param group is added), and their gradients."""

    __slots__ = ("_groups", "_params", "optimizer")

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self._params = [p for g in optimizer.param_groups for p in g["params"]]
        self._groups = len(optimizer.param_groups)

    def current(self) -> list[torch.Tensor]:
        """The parameters now (``add_param_group`` after the step was built included)."""
        groups = self.optimizer.param_groups
        if len(groups) != self._groups:
            self._params = [p for g in groups for p in g["params"]]
            self._groups = len(groups)
        return self._params

    def have_grads(self) -> bool:
        """Whether any of them holds a gradient (no host sync: a host-side attribute)."""
        return any(p.grad is not None for p in self.current())

    def clear_grads(self) -> bool:
        """Set their gradients to None; whether there were any (no host sync)."""
        found = False
        for p in self.current():
            if p.grad is not None:
                p.grad = None
                found = True
        return found
