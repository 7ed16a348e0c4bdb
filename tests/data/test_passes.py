"""Passes over a distributed.loader outside training (a peek, an evaluation pass) change
nothing of the training run; the training passes count, through iterate or a plain loop."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_bit_equal
from torch import nn

import loopkit
from loopkit import distributed

N = 24  # samples: 6 batches of 4 per pass


class Samples(torch.utils.data.Dataset[Any]):
    """Sample i, drawn with a random augmentation (the batch's key decides it)."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.tensor([i % 5 / 5.0, i % 3 / 3.0, 1.0]) + 0.01 * torch.rand(3)
        return x, torch.tensor([float(i % 2)])


def _loader(workers: int = 0) -> distributed.EpochLoader:
    return distributed.loader(Samples(), batch_size=4, seed=5, num_workers=workers)


def _state(loader: distributed.EpochLoader) -> tuple[Any, ...]:
    """Everything of the loader's place: its state and its generator."""
    state = loader.state_dict()
    generator = state.pop("generator")
    return tuple(sorted(state.items())), generator.tolist()


def _train(
    directory: Path,
    loop: str,
    outside: bool,
    workers: int = 0,
    stop_at: int | None = None,
    reseed: bool = False,
) -> tuple[list[torch.Tensor], list[list[float]], int]:
    """Three epochs (resumed from ``directory``), accumulate=2; ``outside``: a peek before
    the loop and at each epoch's start, an evaluation pass over the training loader at each
    epoch's end. Stops (a kill after a save) at update ``stop_at``. Returns the weights, the
    first feature of every batch trained on and the updates."""
    torch.manual_seed(0)
    loader = _loader(workers)
    net = nn.Sequential(nn.Linear(3, 4), nn.Dropout(0.2), nn.Linear(4, 1))
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    step = loopkit.step(net, opt, accumulate=2)
    ckpt = loopkit.Checkpointer(directory, model=net, optimizer=opt, step=step, loader=loader)
    ckpt.resume(reseed=reseed)
    seen: list[list[float]] = []
    if outside:
        next(iter(loader))
    epochs = ckpt.epochs(3) if loop.endswith("epochs") else range(loader.epoch, 3)
    for _ in epochs:
        if outside:
            next(iter(loader))
        batches = step.iterate(loader) if loop.startswith("iterate") else loader
        for x, y in batches:
            seen.append(x[:, 0].tolist())
            with step as s:
                s.backward(nn.functional.mse_loss(net(x), y))
            if step.updates == stop_at and step.accumulator.micro_step == 0:
                ckpt.save()
                return [], seen, step.updates
        if outside:
            net.eval()
            with torch.no_grad():
                for x, _ in loader:  # an evaluation pass over the training loader
                    net(x)
            net.train()
    return [p.detach().clone() for p in net.parameters()], seen, step.updates


@pytest.mark.parametrize(
    ("loop", "workers"),
    [("iterate, ckpt.epochs", 0), ("plain, ckpt.epochs", 0), ("iterate, range", 2),
     ("plain, range", 2)],
)  # fmt: skip
def test_peeks_and_evaluation_passes_change_nothing(tmp_path: Path, loop: str,
                                                    workers: int) -> None:  # fmt: skip
    """Three epochs with a peek and an evaluation pass over the training loader each:
    12 updates, the same batches and bit-identical weights as without them."""
    ref_w, ref_seen, ref_updates = _train(tmp_path / "ref", loop, outside=False, workers=workers)
    w, seen, updates = _train(tmp_path / "outside", loop, outside=True, workers=workers)
    assert updates == ref_updates == 3 * N // 4 // 2
    assert seen == ref_seen
    assert_bit_equal(w, ref_w)


@pytest.mark.parametrize("reseed", [False, True])
@pytest.mark.parametrize("loop", ["iterate, ckpt.epochs", "plain, range"])
def test_passes_outside_training_after_a_mid_epoch_resume(tmp_path: Path, loop: str,
                                                          reseed: bool) -> None:  # fmt: skip
    """Killed after a save mid-epoch, resumed (reseed or not) with peeks and evaluation
    passes: the rest of the run is the uninterrupted one's."""
    ref_w, ref_seen, _ = _train(tmp_path / "ref", loop, outside=False)
    _, first, _ = _train(tmp_path / "run", loop, outside=True, stop_at=4)
    w, rest, _ = _train(tmp_path / "run", loop, outside=True, reseed=reseed)
    assert first + rest == ref_seen
    assert_bit_equal(w, ref_w)


def test_a_peek_leaves_the_loader_as_it_was() -> None:
    """next(iter(loader)) gives the batch training gets next and leaves the loader's
    state (epoch, place, generator) as it was, also mid-pass after a load."""
    loader = _loader()
    before = _state(loader)
    peeked = next(iter(loader))
    assert _state(loader) == before and loader.epoch == 0
    assert torch.equal(next(loader.training_pass())[0], peeked[0])
    trained = loader.training_pass()
    for _ in range(2):
        next(trained)
    state = loader.state_dict()
    resumed = _loader()
    resumed.load_state_dict(state)
    before = _state(resumed)
    peeks = [next(iter(resumed))[0] for _ in range(2)]  # the resumed place is not used up
    assert _state(resumed) == before
    third = next(trained)[0]
    assert_bit_equal([*peeks, next(resumed.training_pass())[0]], [third] * 3)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_peek_inside_a_training_pass_leaves_its_batches(workers: int) -> None:
    """A peek in the middle of a training pass (persistent workers too): the training
    pass's batches (their order and augmentation) are those of a pass without it."""
    ref = [x for x, _ in _loader(workers).training_pass()]
    loader = _loader(workers)
    got = []
    for i, (x, _) in enumerate(loader.training_pass()):
        got.append(x)
        if i == 2:
            next(iter(loader))
    assert_bit_equal(got, ref)
    assert loader.epoch == 1 and loader.position == N // 4


def test_a_hand_loop_without_a_loopkit_step_counts_its_passes() -> None:
    """for x, y in loader: with a plain optimizer: each pass is a new epoch (its update
    counts it); an evaluation pass after each is not."""
    loader = _loader()
    net = nn.Linear(3, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    orders = []
    for _ in range(3):
        order = []
        for x, y in loader:
            order.append(x[:, 0].tolist())
            opt.zero_grad()
            nn.functional.mse_loss(net(x), y).backward()
            opt.step()
        orders.append(order)
        for _ in loader:  # evaluation
            pass
    assert loader.epoch == 3 and len({str(o) for o in orders}) == 3
    expected = _loader()
    assert orders == [[x[:, 0].tolist() for x, _ in expected.training_pass()] for _ in range(3)]


def test_a_save_deferred_to_the_next_pass_waits_for_the_training_pass(tmp_path: Path) -> None:
    """maybe_save on a pass's last window is written when the next training pass starts,
    not at an evaluation pass over the training loader in the epoch's code."""
    loader = _loader()
    net = nn.Linear(3, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    step = loopkit.step(net, opt)
    ckpt = loopkit.Checkpointer(tmp_path, model=net, optimizer=opt, step=step,
                                scheduler=sched, loader=loader)  # fmt: skip
    for epoch in ckpt.epochs(2):
        for x, y in step.iterate(loader):
            with step as s:
                s.backward(nn.functional.mse_loss(net(x), y))
            ckpt.maybe_save(every=N // 4)
        for _ in loader:  # evaluation over the training loader
            pass
        if epoch == 0:
            assert ckpt.save_pending and not ckpt.checkpoints()
        sched.step()  # the epoch's code after the evaluation
    saved = torch.load(ckpt.checkpoints()[0], weights_only=True)
    assert saved["scheduler"]["last_epoch"] == 1  # the epoch's code is in it
    assert saved["loader"]["next_epoch"] == 1 and saved["loader"]["position"] == N // 4


@pytest.mark.parametrize("workers", [0, 2])
def test_a_peek_at_a_plain_passs_first_batch_leaves_the_pass_counting(workers: int) -> None:
    """`for x, y in loader:` with a peek at the loader before the first micro-step: the
    training pass still counts (3 epochs, new orders), as without the peek, bit for bit."""

    def run(peek: bool) -> tuple[list[list[float]], int, list[torch.Tensor]]:
        torch.manual_seed(0)
        loader, net = _loader(workers), nn.Linear(3, 1)
        step = loopkit.step(net, torch.optim.SGD(net.parameters(), lr=0.1))
        seen = []
        for _ in range(3):
            for i, (x, y) in enumerate(loader):
                if peek and i == 0:
                    next(iter(loader))
                seen.append(x[:, 0].tolist())
                with step as s:
                    s.backward(nn.functional.mse_loss(net(x), y))
        return seen, loader.epoch, [p.detach().clone() for p in net.parameters()]

    ref, got = run(False), run(True)
    assert got[1] == ref[1] == 3 and got[0] == ref[0]
    assert_bit_equal(got[2], ref[2])


@pytest.mark.parametrize("every", [None, 4])
def test_an_update_after_the_pass_ran_out_counts_it(every: int | None) -> None:
    """A full-batch update after the loop (``every=None``), or hand accumulation whose
    remainder is stepped after it: each pass is an epoch of its own order."""
    loader, net = _loader(), nn.Linear(3, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    orders = []
    for _ in range(3):
        order = []
        for i, (x, y) in enumerate(loader):
            order.append(x[:, 0].tolist())
            nn.functional.mse_loss(net(x), y).backward()
            if every is not None and (i + 1) % every == 0:
                opt.step()
                opt.zero_grad()
        opt.step()  # the update (or the remainder) after the loop
        opt.zero_grad()
        orders.append(order)
    expected = _loader()
    assert loader.epoch == 3
    assert orders == [[x[:, 0].tolist() for x, _ in expected.training_pass()] for _ in range(3)]


def test_a_save_waiting_for_a_plain_pass_holds_the_rngs_it_started_with(tmp_path: Path) -> None:
    """maybe_save on a pass's last window in a plain loop, written as the next pass's first
    micro-step opens, after the loop body drew random numbers: killed after it, the resumed
    run ends bit-identical (the save holds the RNGs as the pass started)."""

    def run(directory: Path, kill_at: int | None) -> tuple[list[torch.Tensor], list[Any]]:
        torch.manual_seed(0)
        loader, net = _loader(), nn.Sequential(nn.Linear(3, 4), nn.Dropout(0.2), nn.Linear(4, 1))
        opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
        step = loopkit.step(net, opt)
        ckpt = loopkit.Checkpointer(directory, model=net, optimizer=opt, step=step, loader=loader)
        ckpt.resume()
        seen = []
        for _ in ckpt.epochs(3):
            for x, y in loader:
                x = x + 0.1 * torch.randn_like(x)  # augmentation in the loop body
                seen.append(x[:, 0].tolist())
                with step as s:
                    s.backward(nn.functional.mse_loss(net(x), y))
                if step.updates == kill_at:  # the save deferred from update 6 is written
                    return [], seen
                ckpt.maybe_save(every=3)
        return [p.detach().clone() for p in net.parameters()], seen

    ref_w, ref_seen = run(tmp_path / "ref", None)
    run(tmp_path / "run", 7)  # killed after the deferred save
    assert sorted(p.name for p in (tmp_path / "run").iterdir())[-1] == "ckpt-0000000006.pt"
    w, rest = run(tmp_path / "run", None)
    assert rest == ref_seen[len(ref_seen) - len(rest) :] and len(rest) == 12
    assert_bit_equal(w, ref_w)


def test_passes_read_whole_where_nothing_trains_are_epochs() -> None:
    """A loop reading the data only (or updating with no optimizer): each pass read whole is
    an epoch of its own order; an evaluation under no_grad before training is not, nor a peek."""
    loader = _loader()
    next(iter(loader))  # a peek
    with torch.no_grad():
        for _ in loader:  # an evaluation pass before training
            pass
    assert loader.epoch == 0
    orders = [[x[:, 0].tolist() for x, _ in loader] for _ in range(3)]
    expected = _loader()
    assert loader.epoch == 3
    assert orders == [[x[:, 0].tolist() for x, _ in expected.training_pass()] for _ in range(3)]
