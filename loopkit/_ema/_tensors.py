"""An average's tensors as each rank holds them: an FSDP2 parameter's local shard, and back."""

from __future__ import annotations

import torch
from torch import nn


def _local(t: torch.Tensor) -> torch.Tensor:
    """A tensor's data on this rank: an FSDP2 DTensor's shard (no gather), else itself."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def _as_param(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` laid out as ``param``: a DTensor of the same mesh and placements for an
    FSDP2 parameter (no communication), else ``local`` itself."""
    mesh = getattr(param, "device_mesh", None)
    if mesh is None:
        return local
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, mesh, param.placements, run_check=False,  # type: ignore[attr-defined]
                              shape=param.shape, stride=param.stride())  # fmt: skip


def registered(module: nn.Module, name: str) -> torch.Tensor:
    """``module.get_parameter(name)``, read from the registries (no Python call per level:
    it runs at every update); a name a wrapper forwards (a block compiled or checkpoint-wrapped
    after the ema was built) is looked up by ``get_parameter`` itself, as are its errors."""
    *owners, leaf = name.split(".")
    found: nn.Module | None = module
    for owner in owners:
        found = found._modules.get(owner) if found is not None else None
    param = None if found is None else found._parameters.get(leaf)
    return param if param is not None else module.get_parameter(name)
