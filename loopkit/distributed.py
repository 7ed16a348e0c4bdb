"""Distributed training on torch.distributed, launched by ``torchrun`` or ``accelerate launch``.

loopkit never launches processes or moves bytes itself: the launcher starts one process
per device and sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and
``MASTER_PORT``; ``setup()`` reads them. Without them everything here is a no-op, so the
same script runs single-process unchanged.

The public namespace only: each name is defined in the module of its capability.
"""

from __future__ import annotations

from ._data._build_loader import default_num_workers, loader
from ._data._epoch_loader import EpochLoader
from ._job import DistInfo, info, is_rank_zero, rank_zero_only, setup, teardown
from ._parallel._materialize import materialize
from ._parallel._wrap import wrap

__all__ = [
    "DistInfo",
    "EpochLoader",
    "default_num_workers",
    "info",
    "is_rank_zero",
    "loader",
    "materialize",
    "rank_zero_only",
    "setup",
    "teardown",
    "wrap",
]
