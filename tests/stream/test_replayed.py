"""loopkit.replayed: a loader with no state of its own, resumed by reading its pass again.

Invariant: a run stopped after any update and resumed from its checkpoint trains on the
same batches, with the same random augmentation (drawn in loader workers from torch's
global RNG) and the same dropout, as the uninterrupted run: weights bit for bit. The replay
says what it cost. A stateless loader given as it is to ``Checkpointer(loader=)`` is refused.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset

import loopkit

UPDATES = 10


class Noisy(IterableDataset[tuple[torch.Tensor, torch.Tensor, int]]):
    """A fixed-order stream whose samples carry noise drawn from torch's global RNG (where it
    runs in workers: in the loop's process a replay does not reproduce such draws)."""

    def __init__(self, noise: float = 0.1) -> None:
        self.noise = noise

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, int]]:
        info = torch.utils.data.get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        for i in range(worker, 48, workers):
            x = torch.full((4,), i / 48)
            yield (
                (x + self.noise * torch.randn(4) if self.noise else x),
                torch.tensor([i % 3 / 3]),
                i,
            )


def _run(
    directory: Path, workers: int, stop_at: int | None = None
) -> tuple[list[int], torch.Tensor]:
    torch.manual_seed(0)
    noise = 0.1 if workers else 0.0
    loader = loopkit.replayed(DataLoader(Noisy(noise), batch_size=4, num_workers=workers))
    net = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.2), nn.Linear(8, 1))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    step = loopkit.step(net, opt, accumulate=2)
    ckpt = loopkit.Checkpointer(directory, model=net, optimizer=opt, step=step, loader=loader)
    ckpt.resume()
    seen: list[int] = []
    while step.updates < UPDATES:  # 6 updates a pass: a stop at 9 is in the second pass
        for x, y, i in step.iterate(loader):
            seen += i.tolist()
            with step as s:
                s.backward(nn.functional.mse_loss(net(x), y))
            if step.updates == stop_at:
                ckpt.save()
                return seen, net[0].weight.detach().clone()
            if step.updates == UPDATES:
                break
    return seen, net[0].weight.detach().clone()


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize(("stop_at", "replayed"), [(2, 4), (9, 6)])
def test_a_replayed_resume_trains_as_the_uninterrupted_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], workers: int, stop_at: int, replayed: int
) -> None:
    """Stopped at ``stop_at`` (in the first or the second pass), resumed by replaying the
    pass's first ``replayed`` batches: the same samples and weights bit for bit; the
    replay's cost is printed."""
    whole, w_whole = _run(tmp_path / "a", workers)
    head, _ = _run(tmp_path / "b", workers, stop_at)
    capsys.readouterr()
    tail, w_tail = _run(tmp_path / "b", workers)
    assert head + tail == whole and len(whole) == UPDATES * 8
    assert torch.equal(w_tail, w_whole)
    assert f"read {replayed} batches again" in capsys.readouterr().err


def test_a_loader_without_state_is_refused_naming_the_fixes(tmp_path: Path) -> None:
    """A plain DataLoader over an IterableDataset as loader= is refused before training."""
    net = nn.Linear(4, 1)
    with pytest.raises(TypeError, match=r"StatefulDataLoader.*replayed"):
        loopkit.Checkpointer(tmp_path, model=net, loader=DataLoader(Noisy(), batch_size=4))


def test_a_stateful_loader_is_not_replayed() -> None:
    """replayed() of a loader that saves its own place is refused: it resumes at once."""
    stateful = pytest.importorskip("torchdata.stateful_dataloader").StatefulDataLoader
    with pytest.raises(TypeError, match="saves its own place"):
        loopkit.replayed(stateful(Noisy(), batch_size=4))


def test_a_stream_shorter_than_the_saved_place_raises() -> None:
    """A replay that runs out before the saved place says the loader changed."""
    loader = loopkit.replayed(DataLoader(Noisy(), batch_size=4))
    it = iter(loader)
    for _ in range(5):
        next(it)
    state = loader.state_dict()
    short = loopkit.replayed(DataLoader(list(range(8)), batch_size=4))
    short.load_state_dict(state)
    with pytest.raises(RuntimeError, match="does not give the same batches"):
        next(iter(short))


def test_a_replayed_shuffled_map_loader_in_this_process_replays_its_order(tmp_path: Path) -> None:
    """replayed(DataLoader(shuffle=True)) with no workers: the sampler draws its order as the
    pass's first batch is taken; the replay takes it from the pass's starting states, so the
    resumed run reads the rest of the same permutation, weights bit for bit."""
    x = torch.cat([torch.randn(32, 2, generator=torch.Generator().manual_seed(1)),
                   torch.arange(32.0)[:, None]], 1)  # fmt: skip

    def run(directory: Path, stop: int | None = None) -> tuple[list[int], torch.Tensor]:
        torch.manual_seed(0)
        loader = loopkit.replayed(DataLoader(torch.utils.data.TensorDataset(x), batch_size=4,
                                             shuffle=True))  # fmt: skip
        net = nn.Sequential(nn.Linear(2, 8), nn.Dropout(0.3), nn.Linear(8, 1))
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        step = loopkit.step(net, opt)
        ckpt = loopkit.Checkpointer(directory, model=net, optimizer=opt, step=step, loader=loader)
        ckpt.resume()
        seen: list[int] = []
        for (b,) in step.iterate(loader):
            seen += b[:, 2].long().tolist()
            with step as s:
                s.backward(net(b[:, :2]).pow(2).mean())
            if step.updates == stop:
                ckpt.save()
                break
        return seen, net[0].weight.detach().clone()

    whole, w_whole = run(tmp_path / "a")
    head, _ = run(tmp_path / "b", 3)
    tail, w_tail = run(tmp_path / "b")
    assert head + tail == whole and torch.equal(w_tail, w_whole)


@pytest.mark.parametrize(("samples", "accumulate", "stop_at"), [(10, 2, 1), (14, 3, 1), (9, 2, 2)])
def test_a_resumed_replayed_pass_closes_its_ragged_window_in_its_own_micro_step(
    tmp_path: Path, samples: int, accumulate: int, stop_at: int
) -> None:
    """A replayed loader's len() is its whole pass's, so its resumed pass is counted on from
    the batches done: each micro-step's ``step.updates`` and the log's step axis are the
    uninterrupted run's, the ragged last window included (it closed one micro-step late)."""
    data = torch.utils.data.TensorDataset(torch.arange(float(samples))[:, None])

    def run(directory: Path, stop: int | None) -> tuple[list[tuple[list[int], int]], list[int]]:
        torch.manual_seed(0)
        loader = loopkit.replayed(DataLoader(data, batch_size=2))
        net = nn.Linear(1, 1)
        opt = torch.optim.SGD(net.parameters(), lr=0.01)
        rows: list[int] = []
        log = loopkit.detach_logging(every=1, sink=lambda values, *, step: rows.append(step))
        step = loopkit.step(net, opt, accumulate=accumulate, log=log)
        ckpt = loopkit.Checkpointer(directory, model=net, optimizer=opt, step=step, loader=loader)
        ckpt.resume()
        seen = []
        for (x,) in step.iterate(loader):
            with step as s:
                s.backward(net(x / 10).pow(2).mean())
            seen.append((x[:, 0].long().tolist(), step.updates))
            if step.updates == stop and step.updated:
                ckpt.save()
                break
        return seen, rows

    whole, whole_rows = run(tmp_path / "a", None)
    head, head_rows = run(tmp_path / "b", stop_at)
    tail, tail_rows = run(tmp_path / "b", None)
    assert head + tail == whole
    assert head_rows + tail_rows == whole_rows
