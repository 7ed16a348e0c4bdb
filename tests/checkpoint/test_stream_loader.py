"""Checkpointer(loader=) with a loader that saves its own place (torchdata's StatefulDataLoader),
and such a loader under extra=.

Invariant (an independent reference: the same loop run without a stop): stopped after any
update (mid-pass, or on the window that ends a pass) and resumed, the run trains on the same
samples and ends with the same weights bit for bit, dropout included: the loaded pass's
iterator draws nothing from the RNG the checkpoint restored. Loops read through
``step.iterate`` and plain ``for`` loops; 0 and 2 workers; map-style (shuffled) and iterable
data sets.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import deep
from torch import nn
from torch.utils.data import IterableDataset, TensorDataset

import loopkit
from loopkit import _ranks

StatefulDataLoader = pytest.importorskip("torchdata.stateful_dataloader").StatefulDataLoader

UPDATES = 9  # 4 updates a pass (8 batches, accumulate=2): passes end at 4 and 8


class Stream(IterableDataset[tuple[torch.Tensor, torch.Tensor]]):
    """32 samples with their index as the last feature, and a place of its own in each
    worker (as an HF stream has)."""

    def __init__(self) -> None:
        self.next, self.start = 0, 0

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        info = torch.utils.data.get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        first, self.start = self.start or worker, 0
        for i in range(first, 32, workers):
            self.next = i + workers
            yield torch.tensor([i / 32, (i % 5) / 5, float(i)]), torch.tensor([float(i % 2)])
        self.next = 32

    def state_dict(self) -> dict[str, int]:
        return {"next": self.next}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.start = state["next"]


def _data(kind: str) -> Any:
    if kind == "stream":
        return Stream()
    g = torch.Generator().manual_seed(1)
    x = torch.cat([torch.randn(32, 2, generator=g), torch.arange(32.0)[:, None]], 1)
    return TensorDataset(x, torch.randn(32, 1, generator=g))


@contextlib.contextmanager
def _closed(loader: Any) -> Iterator[None]:
    """Stop the loader's workers as the loop is left, not when the garbage collector gets to
    them: a worker forked for the next run would inherit the old iterator, and its collection
    there (torchdata's __del__ in a child) stalls the parent's join for seconds."""
    try:
        yield
    finally:
        iterator = getattr(loader, "_iterator", None)
        if iterator is not None and hasattr(iterator, "_shutdown_workers"):
            iterator._shutdown_workers()


def _run(
    directory: Path, kind: str, workers: int, how: str, stop_at: int | None = None,
    save_first: bool = False,
) -> tuple[list[int], torch.Tensor]:  # fmt: skip
    torch.manual_seed(0)
    loader = StatefulDataLoader(_data(kind), batch_size=4, num_workers=workers,
                                shuffle=True if kind == "map" else None)  # fmt: skip
    net = nn.Sequential(nn.Linear(2, 8), nn.Dropout(0.3), nn.Linear(8, 1))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    step = loopkit.step(net, opt, accumulate=2)
    where = {"extra": {"data": loader}} if how.endswith("extra") else {"loader": loader}
    ckpt = loopkit.Checkpointer(directory, model=net, optimizer=opt, step=step, **where)
    ckpt.resume()
    seen: list[int] = []
    if save_first:  # a relaunch killed right after its first save, before its first batch
        ckpt.save()
        return seen, net[0].weight.detach().clone()
    while step.updates < UPDATES:
        # A pass left mid-way is closed at once (its workers stop now, not when collected).
        batches = step.iterate(loader) if how.startswith("iterate") else iter(loader)
        with _closed(loader):
            for x, y in batches:
                seen += x[:, 2].long().tolist()
                with step as s:
                    s.backward(nn.functional.mse_loss(net(x[:, :2]), y))
                if step.updates == stop_at and step.updated:
                    ckpt.save()
                    return seen, net[0].weight.detach().clone()
                if step.updates == UPDATES:
                    break
    return seen, net[0].weight.detach().clone()


# CI runs six of the 24: every loop shape, every kind and worker count, each stop place.
_CI_RESUMES = {("iterate-extra", "stream", 2, 3), ("iterate-extra", "map", 2, 4),
               ("iterate", "stream", 0, 4), ("iterate", "map", 2, 3),
               ("plain", "map", 0, 3), ("plain", "stream", 2, 4)}  # fmt: skip


@pytest.mark.parametrize(
    ("how", "kind", "workers", "stop_at"),
    [
        pytest.param(*c, marks=() if c in _CI_RESUMES else deep)
        for c in itertools.product(
            ["iterate", "plain", "iterate-extra"], ["stream", "map"], [0, 2], [3, 4]
        )
    ],
)
def test_a_stopped_run_resumes_to_the_uninterrupted_weights(
    tmp_path: Path, how: str, kind: str, workers: int, stop_at: int
) -> None:
    """Stopped mid-pass (3) or on the pass's last window (4), resumed: same samples, same
    weights bit for bit (the model has dropout: the RNG stream carries over too)."""
    whole, w_whole = _run(tmp_path / "a", kind, workers, how)
    head, _ = _run(tmp_path / "b", kind, workers, how, stop_at)
    tail, w_tail = _run(tmp_path / "b", kind, workers, how)
    assert len(whole) == UPDATES * 8 and head + tail == whole
    assert torch.equal(w_tail, w_whole)


@pytest.mark.parametrize(
    ("kind", "workers", "how"),
    [("stream", 0, "iterate"), ("map", 0, "iterate"), ("stream", 2, "iterate"),
     ("stream", 0, "iterate-extra")],
)  # fmt: skip
def test_a_save_right_after_a_resume_holds_the_resumed_place(
    tmp_path: Path, kind: str, workers: int, how: str
) -> None:
    """A relaunch that resumes and saves before its first batch (then is killed) saves the
    place it resumed at: the next relaunch goes on from there, bit-identical. torchdata's
    loader, loaded and not iterated, reported its iterable data set's start, and the next
    relaunch trained the stream's first samples again."""
    whole, w_whole = _run(tmp_path / "a", kind, workers, how)
    head, _ = _run(tmp_path / "b", kind, workers, how, stop_at=3)
    _run(tmp_path / "b", kind, workers, how, save_first=True)
    tail, w_tail = _run(tmp_path / "b", kind, workers, how)
    assert head + tail == whole
    assert torch.equal(w_tail, w_whole)


class _Lines(IterableDataset[torch.Tensor]):
    """docs/streaming.md's ``Lines`` on 10 numbers: a loaded place skips what was handed out
    when the next pass runs (batches of 4: a pass of 4, 4 and 2)."""

    def __init__(self) -> None:
        self.skip, self.done = 0, 0

    def __iter__(self) -> Iterator[torch.Tensor]:
        self.done, self.skip = self.skip, 0
        for i in range(self.done, 10):
            self.done += 1
            yield torch.tensor([float(i), i / 10])

    def state_dict(self) -> dict[str, int]:
        return {"done": self.done}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.skip = state["done"]


def _lines_run(directory: Path, stop_at: int | None) -> tuple[list[int], list[torch.Tensor]]:
    torch.manual_seed(0)
    loader = StatefulDataLoader(_Lines(), batch_size=4)
    net = nn.Sequential(nn.Linear(1, 8), nn.Dropout(0.5), nn.Linear(8, 1))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    step = loopkit.step(net, opt, accumulate=2)
    ckpt = loopkit.Checkpointer(directory, model=net, optimizer=opt, step=step, loader=loader)
    ckpt.resume()
    seen: list[int] = []
    while step.updates < 6:
        for x in step.iterate(loader):
            seen += x[:, 0].long().tolist()
            with step as s:
                s.backward(net(x[:, 1:]).pow(2).mean())
            if step.updates == stop_at and step.updated:
                ckpt.save()
                return seen, [p.detach().clone() for p in net.parameters()]
    return seen, [p.detach().clone() for p in net.parameters()]


@pytest.mark.parametrize("stop_at", [2, 4, 3])
def test_an_iterable_pass_saved_as_it_ended_resumes_with_one_empty_pass(
    tmp_path: Path, stop_at: int
) -> None:
    """A user's stateful stream whose last batch is short, saved on the window that ends a
    pass (2, 4; 3 mid-pass): resumed, the same samples and weights bit for bit, dropout
    included. The loaded pass had ended: torchdata hands out nothing for it, and the data set,
    given the pass's end as its place, made the next pass a second empty one, drawing a seed
    the saved run did not."""
    whole, w_whole = _lines_run(tmp_path / "a", None)
    head, _ = _lines_run(tmp_path / "b", stop_at)
    tail, w_tail = _lines_run(tmp_path / "b", None)
    assert head + tail == whole
    assert all(torch.equal(a, b) for a, b in zip(w_tail, w_whole, strict=True))


def _samplers(data: Any) -> list[dict[str, Any]]:
    random = torch.utils.data.RandomSampler(data)
    return [
        {"sampler": random},
        {"sampler": torch.utils.data.SubsetRandomSampler(range(8))},
        {"sampler": torch.utils.data.WeightedRandomSampler([1.0] * 8, 8)},
        {"batch_sampler": torch.utils.data.BatchSampler(random, 4, drop_last=False)},
    ]


@pytest.mark.parametrize("case", range(4))
@pytest.mark.parametrize("where", ["loader", "extra"])
def test_torchs_random_samplers_in_a_stateful_loader_are_refused(
    tmp_path: Path, case: int, where: str
) -> None:
    """A StatefulDataLoader over torch's RandomSampler (Subset, Weighted, or in a
    BatchSampler) cannot save its order: torchdata resumed its pass in a new order (samples
    repeated and skipped). Refused as the Checkpointer is built, naming shuffle=True, which
    is accepted."""
    data = _data("map")
    net = nn.Linear(2, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    kwargs = {"batch_size": 4} if "sampler" in _samplers(data)[case] else {}
    loader = StatefulDataLoader(data, **kwargs, **_samplers(data)[case])
    given = {"loader": loader} if where == "loader" else {"extra": {"data": loader}}
    with pytest.raises(TypeError, match=r"cannot save its order.*shuffle=True"):
        loopkit.Checkpointer(tmp_path, model=net, optimizer=opt, **given)
    ok = StatefulDataLoader(data, batch_size=4, shuffle=True)
    given = {"loader": ok} if where == "loader" else {"extra": {"data": ok}}
    loopkit.Checkpointer(tmp_path, model=net, optimizer=opt, **given)


def test_extra_refuses_a_loader_when_ranks_read_their_own_parts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With 2 ranks, extra= (one state for all ranks) refuses a loader and names loader=."""
    monkeypatch.setattr(_ranks, "world", lambda group=None: (0, 2))
    loader = StatefulDataLoader(Stream(), batch_size=4)
    with pytest.raises(TypeError, match=r"Checkpointer\(loader=\.\.\.\)"):
        loopkit.Checkpointer(tmp_path, model=nn.Linear(2, 1), extra={"data": loader})


def test_epochs_and_a_stateful_non_loader_are_refused(tmp_path: Path) -> None:
    """ckpt.epochs() needs a distributed.loader's epochs; loader= must be iterable."""
    ckpt = loopkit.Checkpointer(tmp_path, model=nn.Linear(2, 1),
                                loader=StatefulDataLoader(Stream(), batch_size=4))  # fmt: skip
    with pytest.raises(ValueError, match="until"):
        next(iter(ckpt.epochs(2)))
    with pytest.raises(TypeError, match="must be iterable"):
        loopkit.Checkpointer(tmp_path, model=nn.Linear(2, 1), loader=torch.optim.SGD(
            nn.Linear(2, 1).parameters(), lr=0.1))  # fmt: skip


class Tokens:
    """A streaming library's loader, duck-typed: batches of a token stream and its own place
    (no DataLoader underneath, as MosaicML's or LitData's loaders carry theirs)."""

    def __init__(self) -> None:
        self.place, self.start = 0, 0

    def __iter__(self) -> Iterator[torch.Tensor]:
        self.place, self.start = self.start, 0
        while self.place < 40:
            self.place += 1
            yield torch.arange(self.place * 3, self.place * 3 + 3, dtype=torch.float32)

    def state_dict(self) -> dict[str, int]:
        return {"place": self.place}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.start = state["place"]


@pytest.mark.parametrize("stop_at", [1, 7])
def test_a_duck_typed_streaming_loader_resumes_after_the_batches_consumed(
    tmp_path: Path, stop_at: int
) -> None:
    """A loader that is only iterable with state_dict/load_state_dict, read through iterate
    (which takes a batch ahead): the resumed run trains on the batches after the last one
    consumed, none lost, and ends bit for bit."""

    def run(directory: Path, stop: int | None = None) -> tuple[list[float], torch.Tensor]:
        torch.manual_seed(0)
        loader = Tokens()
        net = nn.Sequential(nn.Linear(3, 4), nn.Dropout(0.2), nn.Linear(4, 1))
        opt = torch.optim.SGD(net.parameters(), lr=0.01)
        step = loopkit.step(net, opt, accumulate=2)
        ckpt = loopkit.Checkpointer(directory, model=net, optimizer=opt, step=step, loader=loader)
        ckpt.resume()
        seen = []
        for batch in step.iterate(loader):
            seen.append(batch[0].item())
            with step as s:
                s.backward(net(batch / 100).pow(2).mean())
            if step.updated and step.updates == stop:
                ckpt.save()
                break
        return seen, net[0].weight.detach().clone()

    whole, w_whole = run(tmp_path / "a")
    head, _ = run(tmp_path / "b", stop_at)
    tail, w_tail = run(tmp_path / "b")
    assert head + tail == whole and len(whole) == 40
    assert torch.equal(w_tail, w_whole)


def _shuffled(generator: torch.Generator | None = None) -> Any:
    return StatefulDataLoader(_data("map"), batch_size=4, shuffle=True, generator=generator)


def test_a_loaders_own_generator_is_saved(tmp_path: Path) -> None:
    """StatefulDataLoader(generator=g): the passes after the resumed one have the
    uninterrupted run's order (g's state is saved and the resumed pass leaves it alone)."""

    def run(directory: Path, stop: int | None = None) -> list[int]:
        torch.manual_seed(0)
        loader = _shuffled(torch.Generator().manual_seed(5))
        ckpt = loopkit.Checkpointer(directory, model=nn.Linear(2, 1), loader=loader)
        ckpt.resume()
        seen: list[int] = []
        for _ in range(3):
            for x, _y in loader:
                seen += x[:, 2].long().tolist()
                if stop is not None and len(seen) == stop:
                    ckpt.save()
                    return seen
        return seen

    whole = run(tmp_path / "a")
    head = run(tmp_path / "b", stop=12)
    assert head + run(tmp_path / "b") == whole


def test_a_failed_resume_leaves_the_loader_as_it_was(tmp_path: Path) -> None:
    """A resume that fails after the loader loaded (a later piece refuses its state) puts the
    loader back: its next pass is a fresh one, its class and RNG draws its own."""

    class Refusing:
        def __init__(self, version: int) -> None:
            self.version = version

        def state_dict(self) -> dict[str, int]:
            return {"version": self.version}

        def load_state_dict(self, state: dict[str, int]) -> None:
            if state["version"] != self.version:
                raise ValueError("saved with another configuration")

    def make(version: int) -> tuple[Any, loopkit.Checkpointer]:
        torch.manual_seed(0)
        loader = _shuffled()
        extra = {"meta": Refusing(version)}
        return loader, loopkit.Checkpointer(tmp_path, model=nn.Linear(2, 1), loader=loader,
                                            extra=extra)  # fmt: skip

    loader, ckpt = make(1)
    it = iter(loader)
    for _ in range(5):
        next(it)
    ckpt.save()
    loader, ckpt = make(2)
    with pytest.raises(loopkit.CheckpointError, match="another configuration"):
        ckpt.resume()
    got, draw = next(iter(loader))[0], torch.rand(1)
    fresh, _ = make(2)
    want, want_draw = next(iter(fresh))[0], torch.rand(1)
    assert type(loader) is StatefulDataLoader and "_get_iterator" not in vars(loader)
    assert torch.equal(got, want) and torch.equal(draw, want_draw)


def test_a_resumed_loader_keeps_its_type_and_pickles(tmp_path: Path) -> None:
    """Between a resume and the loaded pass's first batch the loader is still exactly a
    StatefulDataLoader and can be pickled."""
    import pickle

    loader = _shuffled()
    ckpt = loopkit.Checkpointer(tmp_path, model=nn.Linear(2, 1), loader=loader)
    it = iter(loader)
    next(it)
    ckpt.save()
    resumed = _shuffled()
    loopkit.Checkpointer(tmp_path, model=nn.Linear(2, 1), loader=resumed).resume()
    assert type(resumed) is StatefulDataLoader
    pickle.dumps(resumed)


def test_an_iterable_data_set_without_a_state_is_refused_as_loader(tmp_path: Path) -> None:
    """torchdata would re-read such a data set (and read too far on a second resume): refused,
    naming the data set's state_dict and loopkit.replayed."""

    class Stateless(IterableDataset[int]):
        def __iter__(self) -> Iterator[int]:
            return iter(range(8))

    loader = StatefulDataLoader(Stateless(), batch_size=2)
    with pytest.raises(TypeError, match=r"without state_dict.*loopkit\.replayed"):
        loopkit.Checkpointer(tmp_path, model=nn.Linear(2, 1), loader=loader)


def test_extra_keeps_iterable_states_that_are_not_a_ranks_data(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On 2 ranks extra= still takes a distributed.loader (its state is the job's) and a
    user's iterable Stateful that is no loader."""
    monkeypatch.setattr(_ranks, "world", lambda group=None: (0, 2))

    class History(list[float]):
        def state_dict(self) -> dict[str, list[float]]:
            return {"losses": list(self)}

        def load_state_dict(self, state: dict[str, list[float]]) -> None:
            self[:] = state["losses"]

    aux = loopkit.distributed.loader(_data("map"), batch_size=2, seed=0)
    extra = {"history": History(), "aux": aux}
    ckpt = loopkit.Checkpointer(tmp_path, model=nn.Linear(2, 1), extra=extra)
    assert set(ckpt.pieces["extra"].pieces) == {"history", "aux"}  # type: ignore[attr-defined]


def test_a_place_saved_by_other_workers_is_refused_naming_num_workers(tmp_path: Path) -> None:
    """A state saved by 2 loader workers, resumed into a loader with 1: refused at resume
    (torchdata would fail at the first batch with a bare assertion), nothing loaded."""
    loader = StatefulDataLoader(Stream(), batch_size=4, num_workers=2)
    with _closed(loader):
        it = iter(loader)
        next(it), next(it)
        loopkit.Checkpointer(tmp_path, model=nn.Linear(2, 1), loader=loader).save()
    other = StatefulDataLoader(Stream(), batch_size=4, num_workers=1)
    ckpt = loopkit.Checkpointer(tmp_path, model=nn.Linear(2, 1), loader=other)
    with pytest.raises(loopkit.CheckpointError, match="num_workers=2"):
        ckpt.resume()
    assert other.next_iter_state is None


def _epochs_run(
    tmp: Path, save_at: int | None, resume: bool, passes: int, batches: int = 6,
    micro_batch: int | None = None,
) -> list[Any]:  # fmt: skip
    """``passes`` passes of a StatefulDataLoader (``batches`` of 4, accumulate=2), saved and
    left at update ``save_at``: after each micro-step, the update and the log's epoch axis."""
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = loopkit.step(model, opt, accumulate=2, micro_batch=micro_batch)
    loader = StatefulDataLoader(TensorDataset(torch.randn(4 * batches, 3)), batch_size=4)
    ckpt = loopkit.Checkpointer(tmp, model=model, optimizer=opt, step=step, loader=loader)
    if resume:
        ckpt.resume()
    seen: list[Any] = []
    for _ in range(passes):
        for (x,) in step.iterate(loader):
            with step as s:
                s.backward(model(x).pow(2).mean())
            seen.append((step.updates, step.seen.axes()["epoch"]))
            if step.updates == save_at and step.accumulator.micro_step == 0:
                ckpt.save()
                return seen
    return seen


@pytest.mark.parametrize(("batches", "micro_batch"), [(6, None), (5, None), (5, 2)])
@pytest.mark.parametrize("save_at", [1, 2, 3, 4])
def test_the_epoch_axis_goes_on_with_the_resumed_pass(
    tmp_path: Path, save_at: int, batches: int, micro_batch: int | None
) -> None:
    """Saved part-way through a pass (or after its last batch: update 3), resumed: every
    micro-step's update and epoch axis are the uninterrupted run's (the resumed pass was
    counted anew). With 5 batches a pass each pass ends on a window of one batch: the
    resumed loader hands out what it has left and its ``len()`` is the whole pass's, so the
    count goes on from the batches done and that window closes in its own micro-step (it
    closed once the loop asked past it, one update late in that micro-step)."""
    run = functools.partial(_epochs_run, batches=batches, micro_batch=micro_batch)
    whole = run(tmp_path / "whole", None, False, 3)
    first = run(tmp_path / "run", save_at, False, 3)
    # Resumed after a pass's last batch, the loader's next pass hands out nothing.
    rest = run(tmp_path / "run", None, True, 3 - (save_at - 1) // 3)
    assert first + rest == whole


class _DrawingItems(torch.utils.data.Dataset[torch.Tensor]):
    """A map-style data set that draws a random number here as it makes each item."""

    def __len__(self) -> int:
        return 18

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i / 100, torch.rand(()).item(), 1.0])


class _LeftSampler(torch.utils.data.Sampler[int]):
    """A user's resumable sampler whose ``len()`` counts the indices it has left."""

    def __init__(self, n: int) -> None:
        self.n, self.start, self.at = n, 0, 0

    def __len__(self) -> int:
        return self.n - self.start

    def __iter__(self) -> Iterator[int]:
        first, self.start = self.start, 0
        for i in range(first, self.n):
            self.at = i + 1
            yield i
        self.at = 0

    def state_dict(self) -> dict[str, int]:
        return {"at": self.at}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.start = state["at"]


def _drawn_run(
    tmp: Path, sampler: bool, save_at: int | None, resume: bool, passes: int
) -> tuple[list[Any], list[torch.Tensor]]:
    """A StatefulDataLoader (18 items drawing random numbers, batches of 4, no workers; a
    ``_LeftSampler`` or its own), a dropout model, accumulate=2: after each micro-step the
    update and the batch, and the weights at the end."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), nn.Dropout(0.5), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    step = loopkit.step(model, opt, accumulate=2)
    order = _LeftSampler(18) if sampler else None
    loader = StatefulDataLoader(_DrawingItems(), batch_size=4, sampler=order)
    ckpt = loopkit.Checkpointer(tmp, model=model, optimizer=opt, step=step, loader=loader)
    if resume:
        ckpt.resume()
    seen: list[Any] = []
    for _ in range(passes):
        for x in step.iterate(loader):
            with step as s:
                s.backward(model(x).pow(2).mean())
            seen.append((step.updates, x.tolist()))
            if step.updates == save_at and step.accumulator.micro_step == 0:
                ckpt.save()
                return seen, [p.detach().clone() for p in model.parameters()]
    return seen, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("sampler", [False, True], ids=["own sampler", "user's sampler"])
@pytest.mark.parametrize("save_at", [1, 2, 4])
def test_a_resumed_pass_takes_no_batch_before_the_loop_asks(
    tmp_path: Path, sampler: bool, save_at: int
) -> None:
    """A StatefulDataLoader whose items draw random numbers here, resumed part-way: its own
    samplers' ``len()`` is the whole pass's (counted on from the batches done, the ragged last
    window closed in its micro-step); a user's resumable sampler's may count what is left (a
    DataLoader is not enough to know: counted from the resume). Either way no batch is taken
    before the loop asks, so the data's draws and dropout's interleave as uninterrupted:
    every update and batch, and the weights, are the uninterrupted run's."""
    whole, weights = _drawn_run(tmp_path / "whole", sampler, None, False, 2)
    first, _ = _drawn_run(tmp_path / "run", sampler, save_at, False, 2)
    rest, resumed = _drawn_run(tmp_path / "run", sampler, None, True, 2 - save_at // 3)
    assert first + rest == whole
    for a, b in zip(weights, resumed, strict=True):
        assert torch.equal(a, b)
