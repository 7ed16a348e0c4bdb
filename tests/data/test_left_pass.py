"""A loop over ``step.iterate(loader)`` left mid-pass (a hand-written limit and ``break``, an
error the script stops on) and saved after the loop: the save holds the place after the
batches the loop trained, not after the one ``iterate`` had taken ahead, so the relaunch
trains every sample of the uninterrupted run once, in its order, to the same weights."""

from __future__ import annotations

import importlib.util
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_bit_equal
from torch import nn
from torch.utils.data import TensorDataset

import loopkit
from loopkit import distributed

DATA = TensorDataset(torch.arange(40.0)[:, None])  # batches of 4: 10 per pass
needs_torchdata = pytest.mark.skipif(
    importlib.util.find_spec("torchdata") is None, reason="needs torchdata: pip install torchdata"
)


class _Stop(Exception):
    """The script's own check stopping the run."""


def _run(directory: Path, limit: int, loader_kind: str, leave: str, every: int) -> tuple[
    list[int], list[torch.Tensor]
]:  # fmt: skip
    """Train until ``limit`` updates, leaving the loop by ``leave`` once there, then save."""
    torch.manual_seed(0)
    if loader_kind == "distributed.loader":
        loader = distributed.loader(DATA, batch_size=4, shuffle=True, seed=1, num_workers=0)
    else:
        from torchdata.stateful_dataloader import StatefulDataLoader

        loader = StatefulDataLoader(DATA, batch_size=4, shuffle=True)
    net = nn.Linear(1, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    step = loopkit.step(net, opt, accumulate=every)
    ckpt = loopkit.Checkpointer(directory, model=net, optimizer=opt, step=step, loader=loader)
    ckpt.resume()
    seen: list[int] = []
    try:
        for _ in range(3):
            for (x,) in step.iterate(loader):
                seen += x[:, 0].long().tolist()
                with step as s:
                    s.backward(net(x / 40).pow(2).mean())
                if step.updates >= limit and step.micro_step == 0:
                    if leave == "raise":
                        raise _Stop
                    break
            if step.updates >= limit:
                break
    except _Stop:
        pass
    ckpt.save()
    return seen, [p.detach().clone() for p in net.parameters()]


@pytest.mark.parametrize(
    "loader_kind", ["distributed.loader", pytest.param("stateful", marks=needs_torchdata)]
)
@pytest.mark.parametrize("leave", ["break", "raise"])
@pytest.mark.parametrize(
    ("every", "first", "last"),
    [(1, 3, 7), (1, 9, 12), (2, 2, 6), (1, 10, 13)],
    ids=["mid-pass", "last-batch-taken-ahead", "windows-of-2", "at-the-pass-end"],
)
def test_a_loop_left_mid_pass_and_saved_after_it_resumes_at_the_next_batch(
    tmp_path: Path, loader_kind: str, leave: str, every: int, first: int, last: int
) -> None:
    """Stopped at ``first`` updates and relaunched to ``last``: the samples trained and the
    weights are the uninterrupted run's. (0.3.0 saved a distributed.loader's place after the
    batch taken ahead: one batch was never trained, or a pass left on its second-to-last
    batch was saved as ended.)"""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torchdata's own deprecation notices
        whole, weights = _run(tmp_path / "a", last, loader_kind, leave, every)
        head, _ = _run(tmp_path / "b", first, loader_kind, leave, every)
        tail, resumed = _run(tmp_path / "b", last, loader_kind, leave, every)
    assert head + tail == whole
    assert_bit_equal(resumed, weights)


class _Failing(torch.utils.data.Dataset[tuple[torch.Tensor]]):
    """DATA, whose sample ``fail_at`` raises once (a transient read error) while ``armed``."""

    def __init__(self, fail_at: int) -> None:
        self.fail_at, self.armed = fail_at, True

    def __len__(self) -> int:
        return len(DATA)

    def __getitem__(self, i: int) -> tuple[torch.Tensor]:
        if self.armed and i == self.fail_at:
            self.armed = False
            raise OSError(f"sample {i}: a read error")
        return DATA[i]  # type: ignore[no-any-return]


@pytest.mark.parametrize("batch", [1, 2, 6])
@pytest.mark.parametrize("workers", [0, 2])
def test_a_pass_the_data_set_stops_resumes_at_the_first_batch_not_handed_out(
    tmp_path: Path, batch: int, workers: int
) -> None:
    """The data set raises while iterate takes batch ``batch`` ahead (the second of the pass
    included, before any was handed out but one): the script stops, saving; the relaunch
    trains from the first batch the loop never had, and the whole matches a run with no error
    (0.3.0 saved the place after the batch being taken: one batch was never trained)."""
    order = list(
        distributed.loader(DATA, batch_size=4, shuffle=True, seed=1, num_workers=0).batches
    )
    failing = _Failing(fail_at=order[batch][0])

    def run(directory: Path, data: Any) -> list[int]:
        torch.manual_seed(0)
        loader = distributed.loader(data, batch_size=4, shuffle=True, seed=1, num_workers=workers)
        net = nn.Linear(1, 1)
        opt = torch.optim.SGD(net.parameters(), lr=0.01)
        step = loopkit.step(net, opt)
        ckpt = loopkit.Checkpointer(directory, model=net, optimizer=opt, step=step, loader=loader)
        ckpt.resume()
        seen: list[int] = []
        try:
            for (x,) in step.iterate(loader):
                seen += x[:, 0].long().tolist()
                with step as s:
                    s.backward(net(x / 40).pow(2).mean())
        except OSError:
            pass
        ckpt.save()
        return seen

    whole = run(tmp_path / "a", DATA)
    head = run(tmp_path / "b", failing)
    assert len(head) == 4 * (batch - 1)  # the batch before the failing one was taken ahead
    assert head + run(tmp_path / "b", DATA) == whole  # relaunched: the read works again


def test_a_state_loaded_after_the_loop_was_left_keeps_its_place(tmp_path: Path) -> None:
    """A loop left early with its iterate kept (``it = step.iterate(loader)``), then a state
    loaded (``ckpt.resume(path)``, saved further on by another run) before ``it`` goes: the
    loaded place stands when ``it`` is dropped later (a pass begun before a load no longer
    sets it)."""

    def train(directory: Path, batches: int) -> tuple[Any, loopkit.Checkpointer, Any]:
        loader = distributed.loader(DATA, batch_size=4, shuffle=True, seed=1, num_workers=0)
        net = nn.Linear(1, 1)
        opt = torch.optim.SGD(net.parameters(), lr=0.01)
        step = loopkit.step(net, opt)
        ckpt = loopkit.Checkpointer(directory, model=net, optimizer=opt, step=step, loader=loader)
        it = step.iterate(loader)
        for i, (x,) in enumerate(it):
            with step as s:
                s.backward(net(x / 40).pow(2).mean())
            if i + 1 == batches:
                break
        return loader, ckpt, it

    _, further, _ = train(tmp_path / "a", 8)
    path = further.save()
    loader, ckpt, it = train(tmp_path / "b", 3)
    ckpt.resume(path)
    assert loader.position == 8
    del it  # the pass left before the load closes now
    assert loader.position == 8
