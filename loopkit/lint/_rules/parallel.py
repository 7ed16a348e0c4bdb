"""Rules about using several devices."""

from __future__ import annotations

from collections.abc import Iterator

from .._rule import Hit, rule
from .._script import Script


@rule(
    "LK006",
    theme="parallel",
    flags="`nn.DataParallel(...)`",
    why="nn.DataParallel is one process that replicates the model on every step and whose "
    "threads contend for the GIL",
    fix="model = loopkit.distributed.wrap(model)  # DDP, under torchrun",
)
def data_parallel(script: Script) -> Iterator[Hit]:
    for call in script.calls_to("DataParallel"):
        yield call, "`nn.DataParallel` wraps the model"
