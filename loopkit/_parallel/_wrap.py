"""``loopkit.distributed.wrap``: DDP, or FSDP2 per block, for the job this process is in."""

from __future__ import annotations

from typing import Any

from torch import nn

from .._blocks import Blocks, select_blocks
from .._job import info
from ._grad_sync import sync_kind


def wrap(
    model: nn.Module,
    *,
    fsdp: bool | Blocks = False,
    **ddp_kwargs: Any,
) -> nn.Module:
    """Wrap ``model`` in DDP (or FSDP2 with ``fsdp=True``/``fsdp=BlockClass``) for this job.

    Moves the model to this process's device first. Single-process it returns the model
    unchanged. ``fsdp=BlockClass`` shards each such block, then the root.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"wrap() takes an nn.Module, got {type(model).__name__}")
    if sync_kind(model) != "none":
        raise ValueError(
            f"the model is already wrapped ({sync_kind(model).upper()}): wrap it once; pass "
            "the unwrapped module to loopkit.distributed.wrap"
        )
    here = info()
    if not here.is_distributed:
        return model
    model = model.to(here.device)
    if fsdp is not False:
        from torch.distributed.fsdp import fully_shard

        if fsdp is not True:
            for block in select_blocks(model, fsdp):
                fully_shard(block)
        fully_shard(model)
        return model
    if here.device.type == "cuda":
        ddp_kwargs.setdefault("device_ids", [here.device.index])
    return nn.parallel.DistributedDataParallel(model, **ddp_kwargs)
