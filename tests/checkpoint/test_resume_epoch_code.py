"""A save on an epoch's last window, then the epoch's own code after the pass: the resumed run
runs that code exactly once, and a relaunch that runs it is not warned about."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_bit_equal
from torch import nn

import loopkit
from loopkit import distributed


class _Killed(Exception):
    """The job dies here: nothing more is written."""


def _world(directory: Path, shape: str) -> dict[str, Any]:
    """A run whose save cadence falls on an epoch's last window, in one of several shapes."""
    torch.manual_seed(0)
    samples, batch, accumulate = {"partial_window": (20, 2, 3), "drop_last": (17, 2, 1)}.get(
        shape, (16, 2, 1)
    )  # 8 batches a pass, or 10 in windows of 3 (the last of 1), or 8 kept of 17 samples
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(samples, 3, generator=g),
                                          torch.randn(samples, 1, generator=g))  # fmt: skip
    loader = distributed.loader(data, batch_size=batch, drop_last=shape == "drop_last",
                                num_workers=0, seed=2)  # fmt: skip
    models = [nn.Sequential(nn.Linear(3, 4), nn.Dropout(0.3), nn.Linear(4, 1))
              for _ in range(2 if shape == "group" else 1)]  # fmt: skip
    opts = [torch.optim.AdamW(m.parameters(), lr=0.01) for m in models]
    sched = torch.optim.lr_scheduler.ExponentialLR(opts[0], gamma=0.5)  # stepped per epoch
    steps = [loopkit.step(m, o, accumulate=accumulate) for m, o in zip(models, opts, strict=True)]
    clock: Any = loopkit.steps(*steps) if shape == "group" else steps[0]
    ckpt = loopkit.Checkpointer(directory, model=nn.ModuleList(models), scheduler=sched,
                                step=clock, loader=loader, keep=100,
                                async_save=shape == "async")  # fmt: skip
    cadence = None
    if shape == "cadence":  # fires on each epoch's last window
        cadence = loopkit.cadence(clock, epochs=1, loader=loader, checkpointer=ckpt)
    return {"models": models, "steps": steps, "clock": clock, "loader": loader, "ckpt": ckpt,
            "sched": sched, "cadence": cadence, "drawn": [], "plain": shape == "plain"}  # fmt: skip


def _train(run: dict[str, Any], kill_in_code: int | None = None) -> None:
    """3 epochs; a save every 4 updates (its last window, for each shape); per epoch a
    scheduler step and an evaluation drawing random numbers."""
    ckpt, clock = run["ckpt"], run["clock"]
    ckpt.resume()
    for epoch in ckpt.epochs(3):
        # "plain": `for x, y in loader:` as with a DataLoader (its pass is the loop's too)
        for x, y in run["loader"] if run["plain"] else clock.iterate(run["loader"]):
            for model, step in zip(run["models"], run["steps"], strict=True):
                with step as s:
                    s.backward(nn.functional.mse_loss(model(x), y))
            if run["cadence"] is not None:
                if run["cadence"].due():
                    ckpt.save()
            elif ckpt.clock.settle() == 0 and ckpt.clock.updates % 4 == 0:
                ckpt.save()  # the user's own cadence, on the pass's last window
        run["sched"].step()  # the epoch's own code after its pass
        if kill_in_code == epoch:
            ckpt.wait()
            raise _Killed
        run["drawn"].append(float(torch.rand(())))
    ckpt.wait()


def _state(run: dict[str, Any]) -> list[torch.Tensor]:
    weights = [p.detach().clone() for m in run["models"] for p in m.parameters()]
    return [*weights, torch.tensor(run["sched"].get_last_lr()), torch.get_rng_state()]


@pytest.mark.parametrize("shape", ["save", "cadence", "async", "group", "partial_window",
                                   "drop_last", "plain"])  # fmt: skip
def test_a_save_on_an_epochs_last_window_resumes_before_the_epochs_code(
    tmp_path: Path, shape: str
) -> None:
    """save() (a cadence's, in the background) on an epoch's last window, a group's, with a
    partial last window or a dropped last batch, in a plain loop over the loader; killed in
    that epoch's code: the file says the code is still to run, and the resumed run runs it
    once, ending bit-identical."""
    whole = _world(tmp_path / "whole", shape)
    _train(whole)
    killed = _world(tmp_path / "run", shape)
    with pytest.raises(_Killed):
        _train(killed, kill_in_code=0)
    newest = killed["ckpt"].checkpoints()[-1]
    saved = loopkit.load_checkpoint(newest)
    assert saved["loader"]["epoch_open"] is True and saved["scheduler"]["last_epoch"] == 0
    resumed = _world(tmp_path / "run", shape)
    with warnings.catch_warnings():
        warnings.simplefilter("error", loopkit.ResumeWarning)
        _train(resumed)
    assert resumed["drawn"] == whole["drawn"]  # epoch 0's evaluation ran in the resumed run
    assert_bit_equal(_state(whole), _state(resumed))


def test_a_save_after_the_pass_holds_the_epochs_code(tmp_path: Path) -> None:
    """The epoch-end save after the pass's loop (after its code) says the epoch is done, also
    where the loop's iterate is still referenced after a break on the last window."""
    run = _world(tmp_path, "save")
    ckpt, step, loader = run["ckpt"], run["steps"][0], run["loader"]
    for _ in ckpt.epochs(2):
        batches = step.iterate(loader)  # held in a variable: a break leaves it suspended
        for x, y in batches:
            with step as s:
                s.backward(nn.functional.mse_loss(run["models"][0](x), y))
            if loader.position == len(loader):
                break
        run["sched"].step()
        if ckpt.save() is not None and loader.epoch == 1:
            saved = loopkit.load_checkpoint(ckpt.checkpoints()[-1])
            assert "epoch_open" not in saved["loader"] and saved["scheduler"]["last_epoch"] == 1
    # epochs() wrote no state before the epoch's code: its end found the final one saved
    saved = loopkit.load_checkpoint(ckpt.checkpoints()[-1])
    assert saved["loader"]["next_epoch"] == 2 and "epoch_open" not in saved["loader"]
    assert saved["scheduler"]["last_epoch"] == 2


def test_a_relaunch_that_runs_the_code_its_checkpoint_left_is_not_warned(tmp_path: Path) -> None:
    """Killed in the last epoch's code after a save on its last window: the relaunch runs
    that code and saves the end, unwarned; the relaunch after it is a finished run's."""
    killed = _world(tmp_path, "save")
    with pytest.raises(_Killed):
        _train(killed, kill_in_code=2)
    relaunch = _world(tmp_path, "save")
    with warnings.catch_warnings():
        warnings.simplefilter("error", loopkit.ResumeWarning)
        _train(relaunch)  # its own epoch-end save_if_needed: no "nothing was trained"
    assert relaunch["sched"].last_epoch == 3 and len(relaunch["drawn"]) == 1
    finished = _world(tmp_path, "save")
    with pytest.warns(loopkit.ResumeWarning, match="all 3 epochs of ckpt.epochs"):
        _train(finished)
    assert finished["drawn"] == [] and finished["sched"].last_epoch == 3
