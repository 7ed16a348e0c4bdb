"""Shared fixtures: deterministic, single-threaded torch so results compare bit for bit.

Two tiers: ``python -m pytest`` (CI) runs every test not marked ``deep``; ``LOOPKIT_DEEP=1
python -m pytest`` runs them all (and draws more examples, kills more runs). Each file's
tests run on one xdist worker (``--dist loadfile``), so a module-scoped launch runs once.
"""

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


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "deep: a slower variant CI leaves to LOOPKIT_DEEP=1 (helpers.deep)"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselect the deep tier unless LOOPKIT_DEEP is set."""
    from helpers import DEEP

    for item in items:
        names = getattr(item, "fixturenames", ())
        if item.get_closest_marker("dist_group") or {"dist_results", "dist4_results"} & set(names):
            # The session-wide launches (2 and 4 ranks, every scenario of every file, two
            # minutes on 2 cores) are deep. CI's processes are the module-scoped launches of
            # test_accumulate_ddp.py and test_loop_control_ddp.py (DDP on 2 gloo ranks).
            item.add_marker(pytest.mark.deep)
    if DEEP:
        return
    deep = [item for item in items if item.get_closest_marker("deep")]
    if deep:
        config.hook.pytest_deselected(items=deep)
        items[:] = [item for item in items if not item.get_closest_marker("deep")]


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def dist_out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the 4-rank and the 2-rank workers write (the 4-rank's under ``four/``)."""
    return tmp_path_factory.mktemp("dist")


@pytest.fixture(scope="session")
def dist4_results(dist_out: Path) -> dict[str, Any]:
    """Every scenario of dist4_worker.py (HSDP on a 2x2 mesh), run once by four processes.

    Before it: a 1-process run stopped after a save, whose checkpoints the 4-rank and the
    2-rank workers resume (on another number of processes)."""
    import elastic
    from helpers import launch_scenarios

    elastic.run(dist_out / "one" / "cut", stop=5)
    (dist_out / "four").mkdir()
    return launch_scenarios("tests/dist4_worker.py", dist_out / "four", world=4)


@pytest.fixture(scope="session")
def dist_results(dist_out: Path, dist4_results: dict[str, Any]) -> dict[str, Any]:
    """Every scenario of dist_worker.py, run once by two processes, for every test file.

    Before it: the 4-rank worker, and its 1-process run stopped after a save, whose
    checkpoints the 2-rank worker resumes too (on another number of processes).
    """
    from helpers import launch_scenarios

    return launch_scenarios("tests/dist_worker.py", dist_out)


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
