"""A resumed loop is correct or loud: ckpt.epochs(E), where the run stands, ResumeWarning."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator
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
EPOCHS = 3


class Run:
    """Fresh objects for one process of the run (what a relaunch builds)."""

    def __init__(self, directory: Path, max_updates: int | None = None) -> None:
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(3, 8), nn.Dropout(0.2), nn.Linear(8, 1))
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.05, momentum=0.9)
        self.loader = distributed.loader(DATA, batch_size=4, num_workers=0, seed=3)
        self.step = loopkit.step(self.model, self.opt)
        self.ckpt = loopkit.Checkpointer(directory, model=self.model, optimizer=self.opt,
                                         step=self.step, loader=self.loader)  # fmt: skip
        self.stop = None
        if max_updates is not None:
            self.stop = loopkit.until(self.step, max_updates=max_updates, signals=(),
                                      checkpointer=self.ckpt)  # fmt: skip
        self.trained = 0  # batches this process trained

    def batch(self, x: torch.Tensor, y: torch.Tensor) -> None:
        with self.step as s:
            s.backward(nn.functional.mse_loss(self.model(x), y))
        self.trained += 1
        self.ckpt.maybe_save(every=1)

    def weights(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.model.parameters()]


def _stopped_mid_epoch_1(directory: Path, done_in_epoch_1: int = 2) -> None:
    """A first process that saves every update and dies in epoch 1 (fresh objects follow)."""
    run = Run(directory)
    for epoch in run.ckpt.epochs(EPOCHS):
        for x, y in run.step.iterate(run.loader):
            run.batch(x, y)
            if epoch == 1 and run.trained == BATCHES + done_in_epoch_1 < 2 * BATCHES:
                return
        if epoch == 1:  # the epoch's last save waits for the next pass: written here
            run.ckpt.save_if_needed()
            return


def _uninterrupted(directory: Path) -> list[torch.Tensor]:
    run = Run(directory)
    for _ in run.ckpt.epochs(EPOCHS):
        for x, y in run.step.iterate(run.loader):
            run.batch(x, y)
    assert run.trained == EPOCHS * BATCHES
    return run.weights()


def test_the_recommended_loop_trains_exactly_the_remaining_batches(tmp_path: Path) -> None:
    """`for epoch in ckpt.epochs(E)` after a resume: the batches left, bit-identical weights."""
    reference = _uninterrupted(tmp_path / "whole")
    _stopped_mid_epoch_1(tmp_path / "run")
    run = Run(tmp_path / "run")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the right loop is never warned about
        run.ckpt.resume()
        seen = []
        for epoch in run.ckpt.epochs(EPOCHS):
            seen.append(epoch)
            for x, y in run.step.iterate(run.loader):
                run.batch(x, y)
    assert seen == [1, 2]
    assert run.trained == EPOCHS * BATCHES - (BATCHES + 2)
    for a, b in zip(run.weights(), reference, strict=True):
        assert torch.equal(a, b)


def test_resume_says_where_the_run_stands(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """One line: the file, the update, the epoch and the batches done in it; logged at INFO."""
    _stopped_mid_epoch_1(tmp_path)
    run = Run(tmp_path)
    assert run.ckpt.standing is None
    with caplog.at_level(logging.INFO, logger="loopkit"):
        path = run.ckpt.resume()
    line = run.ckpt.standing
    assert line == (f"resumed {path}: update {BATCHES + 2}, epoch 1 in progress "
                    f"(2 of {BATCHES} batches done)")  # fmt: skip
    assert [r.getMessage() for r in caplog.records if r.name == "loopkit"] == [line]


def test_a_resumed_range_loop_warns_naming_the_fix(tmp_path: Path) -> None:
    """`for epoch in range(E)` after a resume at epoch 1: ResumeWarning naming ckpt.epochs(E)."""
    _stopped_mid_epoch_1(tmp_path)
    run = Run(tmp_path)
    run.ckpt.resume()
    with pytest.warns(loopkit.ResumeWarning) as caught:
        for epoch in range(EPOCHS):
            for x, y in run.step.iterate(run.loader):
                run.batch(x, y)
            if epoch == 0:
                break
    (warning,) = caught
    said = str(warning.message)
    assert "the loop's `epoch` is 0 but the loader resumed at epoch 1" in said
    assert "`for epoch in ckpt.epochs(E):`" in said and "range(loader.epoch, E)" in said
    assert warning.filename == __file__


def _train_one_epoch(run: Run) -> None:
    for x, y in run.step.iterate(run.loader):
        run.batch(x, y)


def test_an_epoch_loop_around_a_function_that_runs_the_pass_warns(tmp_path: Path) -> None:
    """The counter is found in the caller's frame: `for epoch in range(E): train(...)`."""
    _stopped_mid_epoch_1(tmp_path, done_in_epoch_1=BATCHES)  # epoch 1 done: epoch 2 next
    run = Run(tmp_path)
    run.ckpt.resume()
    assert run.ckpt.standing is not None and "epoch 2 next (2 epoch(s) done)" in run.ckpt.standing
    with pytest.warns(loopkit.ResumeWarning, match=r"`epoch` is 0 .* resumed at epoch 2.*2 "):
        for epoch in range(EPOCHS):  # noqa: B007
            _train_one_epoch(run)
            break


def test_a_pass_of_an_epoch_the_checkpoint_finished_warns(tmp_path: Path) -> None:
    """loader.set_epoch(epoch) from a loop restarting at 0: the pass repeats a finished epoch."""
    _stopped_mid_epoch_1(tmp_path, done_in_epoch_1=BATCHES)
    run = Run(tmp_path)
    run.ckpt.resume()
    run.loader.set_epoch(0)
    with pytest.warns(loopkit.ResumeWarning, match="runs epoch 0, which the checkpoint had"):
        next(iter(run.step.iterate(run.loader)))


def test_a_relaunch_of_a_finished_epochs_loop_says_so(tmp_path: Path) -> None:
    """ckpt.epochs(E) of a finished run yields nothing and warns, once."""
    _uninterrupted(tmp_path)
    run = Run(tmp_path)
    run.ckpt.resume()
    with pytest.warns(loopkit.ResumeWarning, match="all 3 epochs of ckpt.epochs\\(3\\) are done"):
        assert list(run.ckpt.epochs(EPOCHS)) == []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run.ckpt.save_if_needed()  # told once already


def test_a_relaunch_that_trains_nothing_says_so_at_its_save(tmp_path: Path) -> None:
    """`range(loader.epoch, E)` of a finished run, then ckpt.save(): nothing was trained."""
    _uninterrupted(tmp_path)
    run = Run(tmp_path)
    run.ckpt.resume()
    for _ in range(run.loader.epoch, EPOCHS):
        _train_one_epoch(run)
    with pytest.warns(loopkit.ResumeWarning, match="nothing was trained since ckpt.resume()"):
        run.ckpt.save()
    assert run.trained == 0


def _finished_by_until(directory: Path) -> None:
    first = Run(directory, max_updates=8)
    assert first.stop is not None
    for _ in first.stop.epochs(first.loader):
        for x, y in first.step.iterate(first.loader):
            first.batch(x, y)
            if first.stop.check():
                break
    assert first.step.updates == 8


def test_a_relaunch_past_until_s_limit_says_finished_at_resume(tmp_path: Path) -> None:
    """until(max_updates=) reached: the resume line says finished and a ResumeWarning says so."""
    _finished_by_until(tmp_path)
    run = Run(tmp_path, max_updates=8)
    with pytest.warns(loopkit.ResumeWarning, match=r"finished \(until\(max_updates=8\) reached"):
        run.ckpt.resume()
    assert run.ckpt.standing is not None and run.ckpt.standing.endswith(
        "finished (until(max_updates=8) reached at update 8)"
    )


def test_a_rollback_within_a_run_and_a_fresh_run_are_not_warned_about(tmp_path: Path) -> None:
    """Legitimate loops: a fresh run's range(E), a rollback mid-run followed by more epochs."""
    run = Run(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert run.ckpt.resume() is None
        for _ in range(2):
            _train_one_epoch(run)
        older = run.ckpt.checkpoints()[0]
        run.ckpt.resume(older)  # a rollback: this run's own loop goes on as it means to
        for _ in range(2):
            _train_one_epoch(run)


def test_epochs_refuses_bad_input_and_a_body_without_a_pass(tmp_path: Path) -> None:
    """A total that is not an int >= 1, no loader=, an epoch that runs no pass: said so."""
    run = Run(tmp_path)
    with pytest.raises(ValueError, match="an int >= 1"):
        run.ckpt.epochs(0)
    bare = loopkit.Checkpointer(tmp_path / "bare", model=run.model, step=run.step)
    with pytest.raises(ValueError, match=r"loader=loopkit\.distributed\.loader"):
        bare.epochs(2)
    epochs: Iterator[int] = run.ckpt.epochs(2)
    assert next(epochs) == 0
    with pytest.raises(RuntimeError, match="ran no pass of the Checkpointer's loader"):
        next(epochs)


def test_a_finished_warning_made_an_error_leaves_the_run_as_it_was(tmp_path: Path) -> None:
    """ResumeWarning as an error: resume() raises before it loads anything."""
    _finished_by_until(tmp_path)
    run = Run(tmp_path, max_updates=8)
    with warnings.catch_warnings():
        warnings.simplefilter("error", loopkit.ResumeWarning)
        with pytest.raises(loopkit.ResumeWarning, match="finished"):
            run.ckpt.resume()
    assert (run.step.updates, run.loader.epoch, run.ckpt.standing) == (0, 0, None)
    assert [p.name for p in run.ckpt.checkpoints()][-1] == "ckpt-0000000008.pt"
