"""A loader with its own state_dict under Checkpointer(extra=), read through step.iterate:
saved at the place after the batches the loop consumed, whatever iterate took ahead."""

from __future__ import annotations

import importlib.util
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_bit_equal
from torch import nn

import loopkit
from loopkit import distributed

N = 24  # samples; batches of 4: 6 per pass
HAS_TORCHDATA = importlib.util.find_spec("torchdata") is not None
needs_torchdata = pytest.mark.skipif(
    not HAS_TORCHDATA, reason="needs torchdata (its StatefulDataLoader): pip install torchdata"
)


def _sample(i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    return torch.tensor([i % 7 / 7.0, i % 3 / 3.0, 1.0]), torch.tensor([float(i % 2)]), i


class Samples(torch.utils.data.Dataset[Any]):
    """Map-style: sample i is a function of i (its index comes back with it)."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return _sample(i)


class Stream(torch.utils.data.IterableDataset[Any]):
    """A stream of N samples, dealt over the loader's workers (as a sharded web data set)."""

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, int]]:
        info = torch.utils.data.get_worker_info()
        first, step = (0, 1) if info is None else (info.id, info.num_workers)
        return (_sample(i) for i in range(first, N, step))


class DuckLoader:
    """A loader of its own: batches of 4 in an order drawn per epoch, its place in its
    state_dict (``live``: its own dict, which later batches change)."""

    def __init__(self, live: bool = False) -> None:
        self.place = {"epoch": 0, "batch": 0}
        self.live = live
        self.calls = 0

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        order = torch.randperm(N, generator=torch.Generator().manual_seed(self.place["epoch"]))
        while self.place["batch"] < N // 4:
            at = self.place["batch"] * 4
            self.place["batch"] += 1
            items = [_sample(int(i)) for i in order[at : at + 4]]
            yield (torch.stack([a for a, _, _ in items]), torch.stack([b for _, b, _ in items]),
                   torch.tensor([i for _, _, i in items]))  # fmt: skip
        self.place = {"epoch": self.place["epoch"] + 1, "batch": 0}

    def state_dict(self) -> dict[str, int]:
        self.calls += 1
        return self.place if self.live else dict(self.place)

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.place = dict(state)


class SizedDuckLoader(DuckLoader):
    """With a length: iterate counts to it instead of looking ahead (but at the last batch)."""

    def __len__(self) -> int:
        return N // 4


class RebuiltDuckLoader(DuckLoader):
    """Its live state dict made afresh as each pass hands out its first batch (nothing of
    it is shared with the state read before the pass)."""

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        self.place = dict(self.place)
        yield from super().__iter__()


class Epochs:
    """The user's own epoch count, saved with the run (a loader of its own does not count)."""

    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict[str, int]:
        return {"n": self.n}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.n = state["n"]


def _torchdata(kind: str, workers: int) -> Callable[[], Any]:
    def make() -> Any:
        from torchdata.stateful_dataloader import StatefulDataLoader

        if kind == "map":
            return StatefulDataLoader(Samples(), batch_size=4, shuffle=True, num_workers=workers)
        return StatefulDataLoader(Stream(), batch_size=4, num_workers=workers)

    return make


LOADERS: dict[str, Callable[[], Any]] = {
    "duck": DuckLoader,
    "duck sized": SizedDuckLoader,
    "duck live state": lambda: DuckLoader(live=True),
    "duck live state rebuilt": lambda: RebuiltDuckLoader(live=True),
    "distributed.loader": lambda: distributed.loader(
        Samples(), batch_size=4, seed=3, num_workers=0
    ),
}


def _run(
    loader: Any,
    directory: Path,
    accumulate: int,
    stop_at: int | None = None,
    how: str = "save",
    epochs: int = 2,
) -> tuple[list[int], list[torch.Tensor], int]:
    """Train ``epochs`` passes (resumed from ``directory``); at update ``stop_at`` stop as
    ``how`` says. Returns the samples seen, the weights and how many samples the save held."""
    torch.manual_seed(0)
    net = nn.Linear(3, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    step = loopkit.step(net, opt, accumulate=accumulate)
    count = Epochs()
    ckpt = loopkit.Checkpointer(directory, model=net, optimizer=opt, step=step,
                                extra={"data": loader, "epochs": count})  # fmt: skip
    limit = stop_at if how == "until" and stop_at is not None else 10**6
    until = loopkit.until(step, max_updates=limit, checkpointer=ckpt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torchdata's fast-forward notice on a resume
        ckpt.resume()
    seen: list[int] = []
    saved = -1
    # distributed.loader counts its epochs (a save on a pass's last batch says it is done).
    for epoch in range(getattr(loader, "epoch", count.n), epochs):
        for x, y, i in step.iterate(loader):
            seen += i.tolist()
            with step as s:
                s.backward(nn.functional.mse_loss(net(x), y))
            at_stop = step.updates == stop_at and step.accumulator.micro_step == 0
            if how == "until" and until.check():
                saved = len(seen)
                return seen, [p.detach().clone() for p in net.parameters()], saved
            if at_stop and how in ("save", "crash"):
                ckpt.save()
                saved = len(seen)
                if how == "save":
                    return seen, [p.detach().clone() for p in net.parameters()], saved
            if at_stop and how == "break":
                break
            if how == "crash" and saved >= 0 and len(seen) >= saved + 8:
                return seen, [], saved  # killed two batches after the save
        else:
            count.n = epoch + 1
            continue
        ckpt.save()  # after the loop, left by break
        return seen, [p.detach().clone() for p in net.parameters()], len(seen)
    return seen, [p.detach().clone() for p in net.parameters()], saved


def _check_resumes(make: Callable[[], Any], tmp_path: Path, accumulate: int, how: str,
                   stops: list[int]) -> None:  # fmt: skip

    def made() -> Any:
        torch.manual_seed(1)  # a loader that draws its order's seed as it is built
        return make()

    ref_seen, ref_w, _ = _run(made(), tmp_path / "ref", accumulate)
    assert sorted(ref_seen) == sorted(list(range(N)) * 2)
    for stop in stops:
        directory = tmp_path / f"{how}-{stop}"
        first, _, saved = _run(made(), directory, accumulate, stop_at=stop, how=how)
        assert saved > 0
        rest, w, _ = _run(made(), directory, accumulate)
        assert first[:saved] + rest == ref_seen, (stop, first[:saved], rest)
        assert_bit_equal(w, ref_w)


@pytest.mark.parametrize("how", ["save", "break", "until", "crash"])
@pytest.mark.parametrize("loader", sorted(LOADERS))
def test_a_duck_typed_loader_resumes_every_sample_once(tmp_path: Path, loader: str,
                                                      how: str) -> None:  # fmt: skip
    """Stopped at every update of two passes (accumulate=2; a save inside the loop, a break
    then a save, until's stop, a kill after a save): every sample once, the same weights."""
    _check_resumes(LOADERS[loader], tmp_path, 2, how, stops=list(range(1, 7)))


@needs_torchdata
@pytest.mark.parametrize(
    ("kind", "workers", "accumulate"),
    [("iterable", 0, 1), ("map", 0, 2), ("iterable", 2, 2), ("map", 2, 1)],
)
def test_a_stateful_dataloader_resumes_every_sample_once(
    tmp_path: Path, kind: str, workers: int, accumulate: int
) -> None:  # fmt: skip
    """torchdata's StatefulDataLoader (map-style or iterable, 0 or 2 workers) under extra=,
    stopped mid-pass and on a pass's last window: every sample once, the same weights."""
    last = 6 // accumulate
    _check_resumes(_torchdata(kind, workers), tmp_path, accumulate, "save", stops=[2, last])
    if workers == 0:
        _check_resumes(_torchdata(kind, workers), tmp_path, accumulate, "break", stops=[3])


def test_a_loader_moved_after_the_loop_is_saved_where_it_stands(tmp_path: Path) -> None:
    """A loop left by break, then the loader read by hand: a save holds the loader's own
    state; without that read, the place after the loop's last batch."""
    loader = DuckLoader()
    net = nn.Linear(3, 1)
    step = loopkit.step(net, torch.optim.SGD(net.parameters(), lr=0.1))
    ckpt = loopkit.Checkpointer(tmp_path, model=net, step=step, extra={"data": loader})
    for x, y, _ in step.iterate(loader):
        with step as s:
            s.backward(nn.functional.mse_loss(net(x), y))
        if step.updates == 2:
            break
    assert loader.place["batch"] == 3  # iterate took the third ahead
    assert ckpt.state_dict()["extra"]["data"] == {"epoch": 0, "batch": 2}
    for _ in loader:  # the rest of the pass, read by hand
        pass
    assert ckpt.state_dict()["extra"]["data"] == {"epoch": 1, "batch": 0}


def test_a_loader_no_checkpointer_saves_costs_nothing_per_batch(tmp_path: Path) -> None:
    """iterate never calls state_dict of a loader no Checkpointer saves; one it saves is read
    before each batch it takes ahead, and before it finds the pass over."""
    net = nn.Linear(3, 1)
    step = loopkit.step(net, torch.optim.SGD(net.parameters(), lr=0.1))
    alone, saved = DuckLoader(), DuckLoader()
    loopkit.Checkpointer(tmp_path, model=net, step=step, extra={"data": saved})
    for loader in (alone, saved):
        for x, y, _ in step.iterate(loader):
            with step as s:
                s.backward(nn.functional.mse_loss(net(x), y))
    assert alone.calls == 0
    assert saved.calls == N // 4
