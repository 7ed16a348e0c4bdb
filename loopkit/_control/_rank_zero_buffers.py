"""evaluate's model is rank 0's: its buffers on every rank for the evaluation, then put back.

Parameters are the same on every rank (DDP keeps them so), buffers need not be: a DDP model
with ``broadcast_buffers=True`` broadcasts rank 0's at the start of a synchronized forward,
then each rank's forward updates them with its own batch (BatchNorm's running statistics);
with ``broadcast_buffers=False``, under FSDP or in a model trained without DDP they drift
apart freely. Each rank evaluating its shard with its own buffers would pool the metric of
no model at all. The model a checkpoint saves is rank 0's, so every rank evaluates with
rank 0's buffers, and gets its own back afterwards, bit for bit: an evaluation never
changes the training that follows. All of them: the persistent ones (those ``state_dict``
holds) and the non-persistent ones (``register_buffer(..., persistent=False)``: a running
statistic kept out of checkpoints, a cache), which a forward reads just the same. Tensor
subclasses (DTensor shards) are left alone.
"""

from __future__ import annotations

import torch
from torch import nn

from .. import _ranks


def plain_buffers(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every buffer of ``module``, persistent or not, by name, each tensor once (no subclass)."""
    # named_buffers: in registration order (the same on every rank), shared ones once.
    # A DTensor or another subclass is its own business.
    return [(name, buf) for name, buf in module.named_buffers() if type(buf) is torch.Tensor]


class RankZeroBuffers:
    """A model's buffers set to rank 0's while it is evaluated, then put back."""

    def __init__(self, module: nn.Module) -> None:
        self._buffers = plain_buffers(module) if _ranks.is_multi_rank() else []
        self._own: list[torch.Tensor] | None = None
        if self._buffers:
            self._check_alike()

    def _check_alike(self) -> None:
        """Raise ValueError on every rank if the ranks' buffers differ in name, shape or dtype.

        One host-level exchange; nothing has changed yet.
        """
        mine = [(name, tuple(t.shape), str(t.dtype)) for name, t in self._buffers]
        everyone = _ranks.gather_objects(mine)
        for rank, theirs in enumerate(everyone):
            if theirs != everyone[0]:
                differ = sorted(set(theirs) ^ set(everyone[0]))[:3]
                raise ValueError(
                    f"evaluate: the model's buffers differ between rank 0 and rank {rank} "
                    f"({differ}): every rank must evaluate the same model (rank 0's, the one "
                    "a checkpoint saves); build it alike on every rank"
                )

    def __enter__(self) -> RankZeroBuffers:
        """Every rank takes rank 0's buffers (a collective), keeping its own to put back."""
        if self._buffers:
            if _ranks.world()[0] != 0:
                self._own = [t.detach().clone() for _, t in self._buffers]
            try:
                _ranks.broadcast_([t for _, t in self._buffers])
            except BaseException:
                self.__exit__()  # a broadcast that failed half-way leaves nothing changed
                raise
        return self

    def __exit__(self, *exc: object) -> None:
        """Every rank gets its own buffers back (rank 0's never changed)."""
        own, self._own = self._own, None
        if own is not None:
            with torch.no_grad():
                for (_, t), kept in zip(self._buffers, own, strict=True):
                    t.copy_(kept)
