"""Modules a step trains through but does not update (``frozen=``): a GAN's discriminator
in the generator's step gets no gradient and no DDP all-reduce inside its micro-steps."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from .._parallel._grad_sync import no_sync, sync_kind


class Frozen:
    """Modules a step trains through but does not update, frozen for each micro-step."""

    def __init__(self, modules: Sequence[nn.Module], optimizer: torch.optim.Optimizer) -> None:
        if isinstance(modules, nn.Module) or not all(isinstance(m, nn.Module) for m in modules):
            raise TypeError(
                f"frozen must be a list of nn.Modules, e.g. frozen=[discriminator], got {modules!r}"
            )
        own = {id(p) for g in optimizer.param_groups for p in g["params"]}
        params = list({id(p): p for m in modules for p in m.parameters()}.values())
        clash = [p for p in params if id(p) in own]
        if clash:
            raise ValueError(
                f"frozen modules hold {len(clash)} parameter(s) this step's optimizer updates: "
                "a step cannot freeze what it trains; freeze only the other model's modules"
            )
        self.params = params
        self._syncs = [no_sync(m) for m in modules if sync_kind(m) != "none"]
        self._saved: list[bool] | None = None

    def freeze(self) -> None:
        if not self.params:
            return
        self._saved = [p.requires_grad for p in self.params]
        for p in self.params:
            p.requires_grad_(False)
        for s in self._syncs:  # a frozen DDP model's forward must not prepare a reduction
            s.__enter__()

    def thaw(self) -> None:
        saved, self._saved = self._saved, None
        if saved is None:
            return
        try:
            for s in reversed(self._syncs):
                s.__exit__(None, None, None)
        finally:
            for p, flag in zip(self.params, saved, strict=True):
                p.requires_grad_(flag)
