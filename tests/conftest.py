"""Shared fixtures: deterministic, single-threaded torch so results compare bit for bit."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from loopkit import distributed

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def dist_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every scenario of dist_worker.py, run once by two processes, for every test file."""
    from helpers import launch_scenarios

    return launch_scenarios("tests/dist_worker.py", tmp_path_factory.mktemp("dist"))


@pytest.fixture
def process_group(tmp_path: Path) -> Iterator[None]:
    """A one-process gloo group: DDP still runs its all-reduce machinery, so it can be counted.

    The test's DDP models are freed while the group lives, and the group is torn down by
    loopkit.distributed.teardown, which lets gloo's workers drop their finished work (a
    comm hook's Python callback) first: destroying a group whose last reference a DDP
    reducer holds, or while its workers still free Python objects, deadlocks in torch.
    """
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        yield
    finally:
        gc.collect()
        distributed.teardown()
