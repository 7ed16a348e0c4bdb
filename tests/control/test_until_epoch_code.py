"""until and the epoch's own code after the pass: a stop or a save on an epoch's last window,
whatever the loop does after it, resumes with that code run exactly once; until's own epoch
count, and a relaunch that only has that code left, agree with the loader."""

from __future__ import annotations

import signal
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_bit_equal
from torch import nn

import loopkit
from loopkit import distributed

BATCHES = 4  # per epoch


class _Killed(Exception):
    """The job dies here: nothing more is written."""


def _world(directory: Path, max_epochs: int | None = None) -> dict[str, Any]:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(3)
    data = torch.utils.data.TensorDataset(torch.randn(8, 3, generator=g),
                                          torch.randn(8, 1, generator=g))  # fmt: skip
    loader = distributed.loader(data, batch_size=2, num_workers=0, seed=4)
    model = nn.Sequential(nn.Linear(3, 4), nn.Dropout(0.3), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.5)  # stepped per epoch
    step = loopkit.step(model, opt)
    ckpt = loopkit.Checkpointer(directory, model=model, optimizer=opt, scheduler=sched,
                                step=step, loader=loader, keep=100)  # fmt: skip
    stop = loopkit.until(step, max_epochs=max_epochs, signals=("SIGUSR1",), check_every=1,
                         checkpointer=ckpt)  # fmt: skip
    return {"model": model, "step": step, "loader": loader, "ckpt": ckpt, "sched": sched,
            "stop": stop}  # fmt: skip


def _micro_step(run: dict[str, Any], x: torch.Tensor, y: torch.Tensor) -> None:
    with run["step"] as s:
        s.backward(nn.functional.mse_loss(run["model"](x), y))


def _state(run: dict[str, Any]) -> list[torch.Tensor]:
    weights = [p.detach().clone() for p in run["model"].parameters()]
    return [*weights, torch.tensor(run["sched"].get_last_lr()), torch.get_rng_state()]


def _with_until_run(directory: Path, signal_at: int | None) -> dict[str, Any]:
    """The c08 loop inside `with until`: a stop breaks out past the epoch's code."""
    run = _world(directory)
    with run["stop"] as stop:
        run["ckpt"].resume()
        for _ in run["ckpt"].epochs(3):
            for x, y in run["step"].iterate(run["loader"]):
                _micro_step(run, x, y)
                if run["step"].updates == signal_at:
                    signal.raise_signal(signal.SIGUSR1)
                if stop.check():
                    break
            if stop.reason is not None:
                break
            run["sched"].step()
            torch.rand(3)  # an evaluation's random numbers
    return run


def test_with_until_a_stop_on_a_last_window_that_breaks_past_the_epochs_code_resumes_it(
    tmp_path: Path,
) -> None:
    """`with until` and a loop that breaks on stop.reason before the epoch's code: the stop's
    checkpoint, written at once, says that code is still to run; the relaunch runs it (the
    per-epoch lr, the evaluation's draws) and ends bit-identical."""
    whole = _with_until_run(tmp_path / "whole", None)
    stopped = _with_until_run(tmp_path / "run", BATCHES)  # epoch 0's last window
    assert stopped["stop"].reason == "SIGUSR1"
    saved = loopkit.load_checkpoint(stopped["ckpt"].checkpoints()[-1])
    assert saved["loader"]["epoch_open"] is True and saved["scheduler"]["last_epoch"] == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error", loopkit.ResumeWarning)
        resumed = _with_until_run(tmp_path / "run", None)
    assert resumed["sched"].last_epoch == 3
    assert_bit_equal(_state(whole), _state(resumed))


def test_a_stop_whose_epochs_loop_is_left_by_break_past_the_epochs_code_resumes_it(
    tmp_path: Path,
) -> None:
    """stop.epochs(loader) left by `break` on stop.reason, past the epoch's code, after a stop
    on the pass's last window: the stop's checkpoint says that code is still to run, and a
    save_if_needed() after the loop finds nothing to write (a save waiting for the epoch's
    end would have been written there as if the code had run)."""
    run = _world(tmp_path, max_epochs=3)
    for _ in run["stop"].epochs(run["loader"]):
        for x, y in run["step"].iterate(run["loader"]):
            _micro_step(run, x, y)
            if run["step"].updates == 2 * BATCHES:
                signal.raise_signal(signal.SIGUSR1)
            if run["stop"].check():
                break
        if run["stop"].reason is not None:
            break
        run["sched"].step()
    assert run["stop"].reason == "SIGUSR1" and not run["ckpt"].save_pending
    assert run["ckpt"].save_if_needed() is None
    saved = loopkit.load_checkpoint(run["ckpt"].checkpoints()[-1])
    assert saved["loader"]["epoch_open"] is True and saved["scheduler"]["last_epoch"] == 1
    assert (saved["loader"]["epoch"], saved["loader"]["position"]) == (1, BATCHES)


def _self_counted_run(directory: Path, kill_at: int | None) -> dict[str, Any]:
    """stop.epochs() counting the epochs itself; an epoch-end save after the epoch's code."""
    run = _world(directory, max_epochs=3)
    run["ckpt"].resume()
    run["epochs"] = []
    for epoch in run["stop"].epochs():
        run["epochs"].append(epoch)
        for x, y in run["step"].iterate(run["loader"]):
            _micro_step(run, x, y)
        run["sched"].step()
        run["ckpt"].save()
        if run["step"].updates == kill_at:
            raise _Killed
    return run


def test_until_counting_its_epochs_saves_an_epoch_done_once_its_pass_is(tmp_path: Path) -> None:
    """A save in stop.epochs()'s body after the pass's loop counts the epoch done (as the
    loader does): the relaunch goes on with the next epoch, not the same one again."""
    whole = _self_counted_run(tmp_path / "whole", None)
    with pytest.raises(_Killed):
        _self_counted_run(tmp_path / "run", BATCHES)  # after epoch 0's save
    saved = loopkit.load_checkpoint(sorted((tmp_path / "run").glob("ckpt-*.pt"))[-1])
    assert saved["until"]["epoch"] == 1 and saved["loader"]["next_epoch"] == 1
    resumed = _self_counted_run(tmp_path / "run", None)
    assert resumed["epochs"] == [1, 2] and resumed["sched"].last_epoch == 3
    assert_bit_equal(_state(whole), _state(resumed))


def _limited_run(directory: Path, kill: bool, counted_by_loader: bool) -> dict[str, Any]:
    """until(max_epochs=2) over stop.epochs; save() on each epoch's last window; a loop that
    breaks on stop.reason after the pass, as the docs' loops do."""
    run = _world(directory, max_epochs=2)
    run["ckpt"].resume()
    run["code_runs"] = 0
    for epoch in run["stop"].epochs(run["loader"] if counted_by_loader else None):
        for x, y in run["step"].iterate(run["loader"]):
            _micro_step(run, x, y)
            if run["loader"].position == BATCHES:
                run["ckpt"].save()
        if run["stop"].reason is not None:
            break
        run["sched"].step()
        run["code_runs"] += 1
        if kill and epoch == 1:
            raise _Killed
    return run


@pytest.mark.parametrize("counted_by_loader", [True, False], ids=["loader", "self"])
def test_killed_in_the_last_epochs_code_the_relaunch_runs_it_unwarned(
    tmp_path: Path, counted_by_loader: bool
) -> None:
    """until(max_epochs=2), a save on the last epoch's last window, killed in that epoch's
    code: the relaunch is no finished run's (no ResumeWarning, stop.reason None while the code
    runs), runs it and saves the end; the relaunch after that is a finished run's."""
    whole = _limited_run(tmp_path / "whole", False, counted_by_loader)
    with pytest.raises(_Killed):
        _limited_run(tmp_path / "run", True, counted_by_loader)
    with warnings.catch_warnings():
        warnings.simplefilter("error", loopkit.ResumeWarning)
        relaunch = _limited_run(tmp_path / "run", False, counted_by_loader)
    assert relaunch["code_runs"] == 1 and relaunch["stop"].reason == "max_epochs"
    assert_bit_equal(_state(whole), _state(relaunch))
    saved = loopkit.load_checkpoint(relaunch["ckpt"].checkpoints()[-1])
    assert "epoch_open" not in saved["loader"] and saved["scheduler"]["last_epoch"] == 2
    with pytest.warns(loopkit.ResumeWarning, match="nothing is left to train"):
        finished = _limited_run(tmp_path / "run", False, counted_by_loader)
    assert finished["code_runs"] == 0


def test_without_a_loader_an_epoch_end_save_in_epochs_counts_the_epoch_done(
    tmp_path: Path,
) -> None:
    """No loader= (until counts the epochs; the step's iterate shows where a pass ends): a
    save in stop.epochs()'s body after the pass's loop resumes at the next epoch; a save
    inside the pass, on its last batch, at the same epoch."""
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    step = loopkit.step(model, torch.optim.SGD(model.parameters(), lr=0.1))
    ckpt = loopkit.Checkpointer(tmp_path, model=model, step=step)
    stop = loopkit.until(step, max_epochs=2, signals=(), checkpointer=ckpt)
    batches = [(torch.randn(2, 3), torch.randn(2, 1)) for _ in range(3)]
    saved_epochs = []
    for _ in stop.epochs():
        for x, y in step.iterate(batches):
            with step as s:
                s.backward(nn.functional.mse_loss(model(x), y))
            stop.check()
            if step.updates % 3 == 0:
                ckpt.save()  # inside the pass, on its last batch
                saved_epochs.append(loopkit.load_checkpoint(ckpt.checkpoints()[-1])["until"])
        ckpt.save()  # the epoch's end, after its pass's loop
        saved_epochs.append(loopkit.load_checkpoint(ckpt.checkpoints()[-1])["until"])
    assert [s["epoch"] for s in saved_epochs] == [0, 1, 1, 2]
