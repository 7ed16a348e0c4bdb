"""The parameters an optimizer updates, as one list kept in step with its param groups.

The list is in the model's ``parameters()`` order (the optimizer's own parameters that the
model does not hold come last): a total gradient norm sums per-tensor norms in list order,
so clipping equals the hand loop's ``clip_grad_norm_(model.parameters(), ...)`` bit for
bit whatever order the optimizer's groups list them in.
"""

from __future__ import annotations

import torch
from torch import nn


def in_model_order(model: nn.Module, params: list[torch.Tensor]) -> list[torch.Tensor]:
    """``params`` reordered as ``model.parameters()`` lists them; the others after, as given."""
    rank = {id(p): i for i, p in enumerate(model.parameters())}
    last = len(rank)
    return sorted(params, key=lambda p: rank.get(id(p), last))  # stable: the rest keep order


class OptimizerParams:
    """The optimizer's parameters (re-read when a param group is added), and their gradients."""

    __slots__ = ("_groups", "_params", "model", "optimizer")

    def __init__(self, optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
        self.optimizer = optimizer
        self.model = model
        self._groups = len(optimizer.param_groups)
        self._params = self._read()

    def _read(self) -> list[torch.Tensor]:
        return in_model_order(
            self.model, [p for g in self.optimizer.param_groups for p in g["params"]]
        )

    def current(self) -> list[torch.Tensor]:
        """The parameters now (``add_param_group`` after the step was built included)."""
        groups = self.optimizer.param_groups
        if len(groups) != self._groups:
            self._params = self._read()
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
