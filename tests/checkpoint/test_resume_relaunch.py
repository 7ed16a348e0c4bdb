"""Relaunches of resumable loops: a finished run trains nothing, the epochs() loop keeps its final
state, and loops that are no epoch trap are not warned about."""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

import loopkit
from loopkit import distributed

DATA = torch.utils.data.TensorDataset(
    torch.randn(24, 3, generator=torch.Generator().manual_seed(0)),
    torch.randn(24, 1, generator=torch.Generator().manual_seed(1)),
)
BATCHES = 6  # per epoch: 24 samples, batch_size=4


class Run:
    """Fresh objects for one process of the run (what a relaunch builds)."""

    def __init__(
        self,
        directory: Path,
        every: int = 1,
        accumulate: int = 1,
        max_updates: int | None = None,
        max_epochs: int | None = None,
    ) -> None:
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1))
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.05, momentum=0.9)
        self.loader = distributed.loader(DATA, batch_size=4, num_workers=0, seed=3)
        self.step = loopkit.step(self.model, self.opt, accumulate=accumulate)
        self.ckpt = loopkit.Checkpointer(directory, model=self.model, optimizer=self.opt,
                                         step=self.step, loader=self.loader)  # fmt: skip
        self.stop = loopkit.until(self.step, max_updates=max_updates, max_epochs=max_epochs,
                                  signals=(), checkpointer=self.ckpt)  # fmt: skip
        self.every = every
        self.trained = 0  # micro-steps this process trained

    def batch(self, x: torch.Tensor, y: torch.Tensor) -> None:
        with self.step as s:
            s.backward(nn.functional.mse_loss(self.model(x), y))
        self.trained += 1
        self.ckpt.maybe_save(every=self.every)

    def weights(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.model.parameters()]


def _ckpt_epochs(run: Run) -> None:
    for _ in run.ckpt.epochs(3):
        for x, y in run.step.iterate(run.loader):
            run.batch(x, y)
            if run.stop.check():
                break
        if run.stop.reason:
            break
    run.ckpt.save_if_needed()


def _range_from_loader(run: Run) -> None:
    for _ in range(run.loader.epoch, 5):
        for x, y in run.step.iterate(run.loader):
            run.batch(x, y)
            if run.stop.check():
                break
        if run.stop.reason:
            break
    run.ckpt.save_if_needed()


def _ckpt_epochs_no_break(run: Run) -> None:
    for _ in run.ckpt.epochs(4):  # ends where the until stopped
        for x, y in run.step.iterate(run.loader):
            run.batch(x, y)
            if run.stop.check():
                break


def _stop_epochs(run: Run) -> None:
    for _ in run.stop.epochs(run.loader):
        for x, y in run.step.iterate(run.loader):
            run.batch(x, y)
            if run.stop.check():
                break


LOOPS: dict[str, Callable[[Run], None]] = {
    "ckpt.epochs": _ckpt_epochs,
    "range(loader.epoch, E)": _range_from_loader,
    "ckpt.epochs, no break": _ckpt_epochs_no_break,
    "stop.epochs": _stop_epochs,
}
# Limits that end the run on an epoch's last window (saved before the epoch's code after it, in
# a loop that until's epochs() does not end) and in the middle of an epoch.
LIMITS = [("max_epochs", 2, 2 * BATCHES), ("max_updates", 2 * BATCHES, 2 * BATCHES),
          ("max_updates", 8, 8)]  # fmt: skip


@pytest.mark.parametrize(
    ("loop", "limit", "value", "updates"),
    [
        (loop, *limit)
        for loop in LOOPS
        for limit in LIMITS
        # A plain loop asks until only after its first micro-step (docs/resuming.md): it stops
        # before one only where the run ended with an epoch, at `if stop.reason: break`.
        if loop != "range(loader.epoch, E)" or limit[2] % BATCHES == 0
    ],
)
def test_a_relaunch_of_a_run_a_limit_ended_trains_nothing(
    tmp_path: Path, loop: str, limit: str, value: int, updates: int
) -> None:
    """Relaunched: 0 updates trained, one ResumeWarning, `finished` said, the stop's reason back."""
    body = LOOPS[loop]
    first = Run(tmp_path, **{limit: value})  # type: ignore[arg-type]
    body(first)
    assert (first.step.updates, first.stop.reason) == (updates, limit)
    again = Run(tmp_path, **{limit: value})  # type: ignore[arg-type]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        again.ckpt.resume()
        body(again)
    said = [str(w.message) for w in caught if w.category is loopkit.ResumeWarning]
    assert (again.trained, again.step.updates) == (0, updates)
    assert len(said) == 1 and "nothing is left to train" in said[0]
    assert again.ckpt.standing is not None and ": finished (until(" in again.ckpt.standing
    assert (again.stop.reason, again.stop.stopped_at) == (limit, updates)
    assert all(torch.equal(a, b) for a, b in zip(again.weights(), first.weights(), strict=True))
    assert again.ckpt.checkpoints()[-1] == first.ckpt.checkpoints()[-1]  # nothing new written


def test_a_raised_limit_on_relaunch_trains_on(tmp_path: Path) -> None:
    """The until is stopped again only where its limit holds still: max_epochs 2 -> 3 trains on."""
    _ckpt_epochs(Run(tmp_path, max_epochs=2))
    again = Run(tmp_path, max_epochs=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error", loopkit.ResumeWarning)
        again.ckpt.resume()
        _ckpt_epochs(again)
    assert again.ckpt.standing is not None and "finished" not in again.ckpt.standing
    assert (again.trained, again.step.updates, again.stop.reason) == (
        BATCHES,
        3 * BATCHES,
        "max_epochs",
    )


def test_the_epoch_saved_before_its_code_runs_that_code_then_ends(tmp_path: Path) -> None:
    """A run stopped on an epoch's last window: the relaunch runs the epoch's code, no batch."""
    _ckpt_epochs(Run(tmp_path, max_epochs=2))
    again = Run(tmp_path, max_epochs=2)
    with pytest.warns(loopkit.ResumeWarning):
        again.ckpt.resume()
    assert again.ckpt.standing is not None and "epoch 1's 6 batches done" in again.ckpt.standing
    seen = []
    for epoch in again.ckpt.epochs(3):
        seen.append(epoch)
        for x, y in again.step.iterate(again.loader):
            again.batch(x, y)
    assert seen == [1]  # epoch 1's code runs after its empty pass, then the loop ends
    assert (again.trained, again.step.updates) == (0, 2 * BATCHES)


def _plain_epochs(run: Run, stop_after: int | None = None) -> None:
    """`for epoch in ckpt.epochs(3)` with maybe_save(every=run.every), no save of its own."""
    for _ in run.ckpt.epochs(3):
        for x, y in run.step.iterate(run.loader):
            run.batch(x, y)
            if run.trained == stop_after:
                break
        if run.trained == stop_after:
            break


@pytest.mark.parametrize(("every", "accumulate"), list(itertools.product([4, 5, 7], [1, 4])))
def test_ckpt_epochs_writes_the_final_state_whatever_the_cadence(
    tmp_path: Path, every: int, accumulate: int
) -> None:
    """A completed ckpt.epochs(E) writes its last update; the relaunch trains 0 updates."""
    first = Run(tmp_path, every=every, accumulate=accumulate)
    _plain_epochs(first)
    newest = first.ckpt.checkpoints()[-1]
    assert newest.name == f"ckpt-{first.step.updates:010d}.pt"
    again = Run(tmp_path, every=every, accumulate=accumulate)
    with pytest.warns(loopkit.ResumeWarning, match="all 3 epochs of ckpt.epochs"):
        again.ckpt.resume()
        _plain_epochs(again)
    assert again.trained == 0 and again.ckpt.standing is not None
    assert again.ckpt.standing.endswith("epoch 3 next (3 epoch(s) done)")
    assert all(torch.equal(a, b) for a, b in zip(again.weights(), first.weights(), strict=True))


def test_ckpt_epochs_left_by_a_break_writes_nothing_more(tmp_path: Path) -> None:
    """A break out of ckpt.epochs(E) (or an error) is not the run's end: no save is added."""
    run = Run(tmp_path, every=4)
    _plain_epochs(run, stop_after=BATCHES + 3)
    assert [p.name for p in run.ckpt.checkpoints()][-1] == "ckpt-0000000008.pt"


# -- loops that are no epoch trap ---------------------------------------------------------------


def _saved_mid_epoch_1(directory: Path) -> None:
    run = Run(directory)
    while run.trained < 8:  # 8 micro-steps: epoch 1 in progress
        for x, y in run.step.iterate(run.loader):
            run.batch(x, y)
            if run.trained == 8:
                break
    assert run.ckpt.checkpoints()[-1].name == "ckpt-0000000008.pt"


def _relaunched(directory: Path) -> Run:
    run = Run(directory)
    run.ckpt.resume()
    assert run.loader.epoch == 1
    return run


def _cycle(run: Run) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    while True:
        yield from run.step.iterate(run.loader)


def _until_updates(run: Run, total: int) -> None:
    while run.step.updates < total:
        for x, y in run.step.iterate(run.loader):
            run.batch(x, y)
            if run.step.updates >= total:
                break


def _legit_cycle(directory: Path) -> None:
    run = _relaunched(directory)
    data = _cycle(run)
    for _ in range(20 - run.step.updates):  # the iterations left
        run.batch(*next(data))


def _one_pass(run: Run) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    yield from run.step.iterate(run.loader)  # started by the first next()


def _legit_next_in_range(directory: Path) -> None:
    run = _relaunched(directory)
    data = _one_pass(run)
    for _ in range(3):  # iterations, the pass started by next() inside the range loop
        run.batch(*next(data))


def _legit_sweep(directory: Path) -> None:
    for trial in range(2):  # a caller's loop, around a run counted by its updates
        _saved_mid_epoch_1(directory / f"t{trial}")
    for trial in range(2):
        _until_updates(_relaunched(directory / f"t{trial}"), 20)


def _legit_inner_range(directory: Path) -> None:
    run = _relaunched(directory)
    for _ in range(run.loader.epoch, 3):
        for _repeat in range(1):  # a per-epoch inner loop, no epoch counter
            for x, y in run.step.iterate(run.loader):
                run.batch(x, y)


LEGIT = [_legit_cycle, _legit_next_in_range, _legit_sweep, _legit_inner_range]


@pytest.mark.parametrize("loop", LEGIT, ids=[f.__name__ for f in LEGIT])
def test_loops_that_count_no_epoch_are_not_warned_about(tmp_path: Path, loop: Callable[[Path],
                                                        None]) -> None:  # fmt: skip
    """Iteration loops over a cycle or next(), a caller's sweep, an inner range: no warning."""
    if loop is not _legit_sweep:
        _saved_mid_epoch_1(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error", loopkit.ResumeWarning)
        loop(tmp_path)


def _trap_epoch(run: Run) -> None:
    for x, y in run.step.iterate(run.loader):
        run.batch(x, y)


def test_the_trap_inside_a_range_and_a_caller_s_sweep_still_warns(tmp_path: Path) -> None:
    """`for epoch in range(E)` around an inner range, or called from a sweep: warned, by name."""
    _saved_mid_epoch_1(tmp_path / "inner")
    run = _relaunched(tmp_path / "inner")
    with pytest.warns(
        loopkit.ResumeWarning, match=r"the loop's `epoch` is 0 but the loader resumed"
    ):
        for epoch in range(3):
            for _repeat in range(1):
                _trap_epoch(run)
            if epoch == 0:
                break
    for trial in range(2):  # trial 1 equals the loader's epoch: the sweep's count is not taken
        _saved_mid_epoch_1(tmp_path / f"t{trial}")
        with pytest.warns(loopkit.ResumeWarning, match=r"`epoch` is 0 but the loader resumed"):
            _sweep_trial(_relaunched(tmp_path / f"t{trial}"))


def _sweep_trial(run: Run) -> None:
    for epoch in range(3):
        _trap_epoch(run)
        if epoch == 0:
            return
