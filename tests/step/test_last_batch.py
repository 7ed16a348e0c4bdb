"""iterate takes each batch where a plain loop would when taking it runs the data set here."""

from __future__ import annotations

import random
import tempfile
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import loopkit
from loopkit import distributed
from loopkit._step import _last_batch


class _Noisy(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """A data set drawing from the main process's torch, numpy and python streams."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        jitter = float(np.random.rand()) + random.random()
        return torch.rand(4) + jitter, torch.rand(1)


class _NoisyStream(torch.utils.data.IterableDataset[tuple[torch.Tensor, torch.Tensor]]):
    """An iterable data set of 10 random items; ``length`` is what its __len__ says (none:
    it has no length)."""

    def __init__(self, length: int | None = None) -> None:
        self.length = length

    def __len__(self) -> int:
        if self.length is None:
            raise TypeError("no length")
        return self.length

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for _ in range(10):
            yield torch.rand(4), torch.rand(1)


class _DrawingBatches(torch.utils.data.Sampler[list[int]]):
    """A batch sampler that draws each batch's order from this process's torch stream."""

    def __init__(self, n: int, size: int) -> None:
        self.n, self.size = n, size

    def __len__(self) -> int:
        return -(-self.n // self.size)

    def __iter__(self) -> Iterator[list[int]]:
        for a in range(0, self.n, self.size):
            order = torch.randperm(min(self.size, self.n - a)).tolist()
            yield [a + k for k in order]


def _noisy_collate(items: list[Any]) -> Any:
    x, y = torch.utils.data.default_collate(items)
    return x * torch.rand(()), y  # the collate draws too


def _loaders() -> dict[str, Callable[[], Any]]:
    return {
        "dataset draws": lambda: torch.utils.data.DataLoader(_Noisy(11), batch_size=3),
        "collate draws": lambda: torch.utils.data.DataLoader(
            _Noisy(9), batch_size=2, shuffle=True, collate_fn=_noisy_collate
        ),
        "iterable with its length": lambda: torch.utils.data.DataLoader(
            _NoisyStream(length=10), batch_size=3
        ),
        "a sampler of the user's, workers": lambda: torch.utils.data.DataLoader(
            _Noisy(10), batch_sampler=_DrawingBatches(10, 3), num_workers=1
        ),
    }


def _train(make_loader: Callable[[], Any], how: str, accumulate: int,
           micro_batch: int | None) -> tuple[list[float], list[torch.Tensor], int]:  # fmt: skip
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = make_loader()
    seen: list[float] = []
    if how == "hand":
        step = loopkit.step(model, opt, accumulate=1)
        for x, y in loader:  # one update per batch, as the ports compare them
            opt.zero_grad()
            seen.append(float(x.sum()))
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        return seen, [p.detach().clone() for p in model.parameters()], len(seen)
    step = loopkit.step(model, opt, accumulate=accumulate, micro_batch=micro_batch)
    source = loopkit.steps(step).iterate(loader) if how == "group" else step.iterate(loader)
    for x, y in source:
        with step as s:
            seen.append(float(x.sum()))
            s.backward(nn.functional.mse_loss(model(x), y))
    return seen, [p.detach().clone() for p in model.parameters()], step.updates


@pytest.mark.parametrize("name", list(_loaders()))
@pytest.mark.parametrize("how", ["step", "group"])
def test_iterate_keeps_the_hand_loops_random_stream(name: str, how: str) -> None:
    """Batches and dropout masks equal a plain for loop's, bit for bit, over a DataLoader
    without workers whose data set (or collate) draws random numbers, with or without length."""
    make = _loaders()[name]
    hand, w_hand, n = _train(make, "hand", 1, None)
    got, w_got, updates = _train(make, how, 1, None)
    assert got == hand
    assert updates == n
    assert all(torch.equal(a, b) for a, b in zip(w_hand, w_got, strict=True))


@pytest.mark.parametrize("name", list(_loaders()))
def test_counted_passes_close_their_ragged_window(name: str) -> None:
    """Counting instead of looking ahead still closes every window, the last ragged one too."""
    _, _, n = _train(_loaders()[name], "hand", 1, None)
    for accumulate, micro_batch in ((2, None), (3, None), (2, 1)):
        _, _, updates = _train(_loaders()[name], "step", accumulate, micro_batch)
        assert updates == -(-n // accumulate)


def test_a_length_not_kept_closes_the_window_when_the_batches_end() -> None:
    """An iterable whose len() says more than it yields: its last window closes as it ends."""

    class Short:
        def __len__(self) -> int:
            return 9

        def __iter__(self) -> Iterator[torch.Tensor]:
            return iter([torch.randn(2, 4) for _ in range(5)])

    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    step = loopkit.step(model, torch.optim.SGD(model.parameters(), lr=0.1), accumulate=2)
    for x in step.iterate(Short()):
        with step as s:
            s.backward(model(x).pow(2).mean())
        assert step.accumulator.lookahead == 0
    assert step.updates == 3 and step.micro_step == 0


def test_lookahead_is_kept_where_taking_a_batch_draws_nothing_here() -> None:
    """distributed.loader, workers with torch's samplers, in-memory sequences and iterables
    without a length are looked ahead; the rest counted."""
    data = torch.utils.data.TensorDataset(torch.randn(8, 2))
    assert _last_batch.counted_length(distributed.loader(data, batch_size=2)) is None
    assert _last_batch.counted_length([1, 2, 3]) is None
    with_workers = torch.utils.data.DataLoader(data, batch_size=2, num_workers=1)
    assert _last_batch.counted_length(with_workers) is None
    assert _last_batch.counted_length(torch.utils.data.DataLoader(data, batch_size=3)) == 3
    assert _last_batch.counted_length(iter([1, 2])) is None  # no length: looked ahead
    stream = torch.utils.data.DataLoader(_NoisyStream(), batch_size=3)
    assert _last_batch.counted_length(stream) is None
    drawing = torch.utils.data.DataLoader(data, batch_sampler=_DrawingBatches(8, 3), num_workers=1)
    assert _last_batch.counted_length(drawing) == 3  # its sampler draws here: counted


@pytest.mark.parametrize(
    "source",
    [
        lambda: (torch.randn(2, 4) for _ in range(10)),
        lambda: torch.utils.data.DataLoader(
            _NoisyStream(), batch_size=1, collate_fn=lambda b: b[0][0][None]
        ),
    ],
    ids=["generator", "iterable data set without length"],
)
def test_without_a_length_every_window_ends_inside_the_loop_body(source: Any) -> None:
    """An iterable without a length is looked ahead: loop control sees the pass's last window
    in the loop body (until stops exactly at max_updates, maybe_save saves its update)."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    step = loopkit.step(model, torch.optim.SGD(model.parameters(), lr=0.1), accumulate=3)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = loopkit.Checkpointer(tmp, model=model, step=step)
        stop = loopkit.until(step, max_updates=8, signals=(), checkpointer=ckpt)
        seen = 0
        for _ in range(3):
            for x in step.iterate(source()):
                with step as s:
                    s.backward(model(x).pow(2).mean())
                seen += 1
                ckpt.maybe_save(every=4)
                if stop.check():
                    break
            if stop.reason is not None:
                break
        # passes of 10 batches in windows of 3, 3, 3 and 1: update 8 ends the second pass
        assert step.updates == 8 and seen == 20 and stop.stopped_at == 8
        assert [p.name for p in ckpt.checkpoints()] == ["ckpt-0000000004.pt", "ckpt-0000000008.pt"]


def test_a_length_shorter_than_the_batches_keeps_the_hand_loops_windows() -> None:
    """An iterable of the user's whose __len__ says 7 but yields 10: the windows are the hand
    loop's (no ragged window at the 7th batch), the rest looked ahead. (A DataLoader over an
    IterableDataset is taken at its length's word: torch warns when it is not kept.)"""

    class Lying:
        def __len__(self) -> int:
            return 7

        def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
            return iter([(torch.rand(1, 4), torch.rand(1, 1)) for _ in range(10)])

    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    step = loopkit.step(model, torch.optim.SGD(model.parameters(), lr=0.1), accumulate=3)
    after = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for x, y in step.iterate(Lying()):
            with step as s:
                s.backward(nn.functional.mse_loss(model(x), y))
            after.append(step.updates)
    assert after == [0, 0, 1, 1, 1, 2, 2, 2, 3, 4]  # the last window (1 batch) ragged


class _Refilled:
    """A loader with a length that hands out ONE list, refilled in place for each batch and
    emptied when its pass ends (a reused buffer); ``length`` may say fewer than it yields."""

    def __init__(self, length: int, xs: torch.Tensor, ys: torch.Tensor) -> None:
        self.length, self.xs, self.ys = length, xs, ys

    def __len__(self) -> int:
        return self.length

    def __iter__(self) -> Iterator[list[torch.Tensor]]:
        buf: list[torch.Tensor] = []
        for i in range(len(self.xs)):
            buf[:] = [self.xs[i : i + 1], self.ys[i : i + 1]]
            yield buf
        buf.clear()


@pytest.mark.parametrize("length", [4, 3])
@pytest.mark.parametrize("group", [False, True], ids=["step", "steps"])
def test_a_batch_is_moved_as_it_is_taken_before_the_next_take(length: int, group: bool) -> None:
    """A counted pass takes the batch after the counted last before handing that one out (to
    know whether the length was kept): each batch is moved when taken, so a loader that
    refills one list in place hands out its own batches, not the next one's or an emptied
    list (as step.iterate did for a moment; loopkit.steps before that). The weights are
    those of the same batches as fresh lists."""
    xs, ys = torch.arange(8.0).view(4, 2), torch.arange(4.0).view(4, 1)

    def train(source: Any) -> tuple[list[float], torch.Tensor]:
        torch.manual_seed(0)
        model = nn.Linear(2, 1)
        step = loopkit.step(model, torch.optim.SGD(model.parameters(), lr=0.01), accumulate=2)
        looped = loopkit.steps(step).iterate(source) if group else step.iterate(source)
        seen = []
        for x, y in looped:
            seen.append(float(y))
            with step as s:
                s.backward(nn.functional.mse_loss(model(x), y))
        return seen, model.weight.detach().clone()

    fresh = [(xs[i : i + 1], ys[i : i + 1]) for i in range(4)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a length not kept may be warned about
        seen, weights = train(_Refilled(length, xs, ys))
    want_seen, want_weights = train(fresh)
    assert seen == want_seen == [0.0, 1.0, 2.0, 3.0]
    assert torch.equal(weights, want_weights)


class _LeftCounting:
    """A stateful loader whose ``len()`` counts the batches it has left after a resume (not
    the whole pass, as a DataLoader's does) and draws a random number here as it makes each."""

    def __init__(self, n: int) -> None:
        self.n, self.at = n, 0

    def __len__(self) -> int:
        return self.n - self.at

    def __iter__(self) -> Iterator[torch.Tensor]:
        while self.at < self.n:
            self.at += 1
            yield torch.full((4, 3), 0.1 * self.at) + torch.rand(4, 3)
        self.at = 0

    def state_dict(self) -> dict[str, int]:
        return {"at": self.at}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.at = state["at"]


def _resumed_run(
    tmp: str, save_at: int | None, resume: bool, passes: int = 2
) -> tuple[list[int], list[Any]]:
    """``passes`` passes of five batches (accumulate=2, dropout) of ``_LeftCounting``, saved at
    update ``save_at`` and left: the update after each micro-step, and the weights."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), nn.Dropout(0.5), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = loopkit.step(model, opt, accumulate=2)
    loader = _LeftCounting(5)
    ckpt = loopkit.Checkpointer(tmp, model=model, optimizer=opt, step=step, loader=loader)
    if resume:
        ckpt.resume()
    updates: list[int] = []
    for _ in range(passes):
        for x in step.iterate(loader):
            with step as s:
                s.backward(model(x).pow(2).mean())
            updates.append(step.updates)
            if step.updates == save_at and step.accumulator.micro_step == 0:
                ckpt.save()
                return updates, [p.detach().clone() for p in model.parameters()]
    return updates, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("save_at", [1, 2, 4])
def test_a_resumed_loader_whose_length_counts_what_is_left_is_counted_from_its_start(
    save_at: int,
) -> None:
    """A resumed pass counts on from the batches done only where ``len()`` is the whole
    pass's (a DataLoader over a map-style data set): a stateful loader whose ``len()`` says
    what it has left is counted from its resume, so no batch is taken before the loop asks
    (its random draws stay where the uninterrupted run made them) and the last window closes
    in its micro-step: every update and the final weights are the uninterrupted run's."""
    with tempfile.TemporaryDirectory() as whole_dir, tempfile.TemporaryDirectory() as run_dir:
        whole, weights = _resumed_run(whole_dir, None, False)
        first, _ = _resumed_run(run_dir, save_at, False)
        rest, resumed = _resumed_run(run_dir, None, True, 2 - save_at // 3)
    assert first + rest == whole
    for a, b in zip(weights, resumed, strict=True):
        assert torch.equal(a, b)
