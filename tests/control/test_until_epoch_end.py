"""until at the end of an epoch: a stop's save waits for the epoch's own code, max_epochs
counted with or without epochs(), in loops with a step, a group or none, with or without
loader=. A stopped and resumed run ends bit-identical to an uninterrupted one."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_bit_equal
from torch import nn

import loopkit
from loopkit import distributed

BATCHES = 6  # per epoch: 24 samples in batches of 4


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return torch.randn(24, 3, generator=g), torch.randn(24, 1, generator=g)


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(model(x), y)


def _run(directory: Path, kind: str, with_loader: bool, signal_at: tuple[int, int] | None,
         every: int = 2) -> dict[str, Any]:  # fmt: skip
    """3 epochs of 6 batches; dropout; a per-epoch scheduler.step() after each epoch's loop.

    ``kind``: "none" (optimizer.step() by hand), "step" (loopkit.step) or "group" (two
    models, a loopkit.steps group). ``signal_at=(epoch, batch)``: SIGTERM after that batch.
    """
    torch.manual_seed(0)
    x_all, y_all = _data()
    models = [nn.Sequential(nn.Linear(3, 8), nn.Dropout(0.2), nn.Linear(8, 1)) for _ in range(2)]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in models]
    sched = torch.optim.lr_scheduler.StepLR(opts[0], step_size=1, gamma=0.5)
    steps = [loopkit.step(m, o, accumulate=every) for m, o in zip(models, opts, strict=True)]
    clock: Any = {"none": None, "step": steps[0], "group": None}[kind]
    if kind == "group":
        clock = loopkit.steps(*steps)
    loader = None
    if with_loader:
        data = torch.utils.data.TensorDataset(x_all, y_all)
        loader = distributed.loader(data, batch_size=4, num_workers=0, seed=1)
    ckpt = loopkit.Checkpointer(
        directory, model=nn.ModuleList(models), optimizer=opts[0], scheduler=sched, step=clock,
        loader=loader, extra={"opt1": opts[1]}, keep=10,
    )  # fmt: skip
    stop = loopkit.until(clock, max_epochs=3, check_every=1, checkpointer=ckpt)
    ckpt.resume()
    held = steps[0].accumulator if kind == "step" else clock  # what iterate holds back
    epochs = []
    for epoch in stop.epochs(loader):
        epochs.append(epoch)
        source: Any = loader if loader is not None else [
            (x_all[i : i + 4], y_all[i : i + 4]) for i in range(0, 24, 4)
        ]  # fmt: skip
        if clock is not None:
            source = clock.iterate(source)
        for batch, (x, y) in enumerate(source, start=1):
            if kind == "none":
                opts[0].zero_grad()
                _loss(models[0], x, y).backward()
                opts[0].step()
            else:
                for m, s in zip(models, steps[: 2 if kind == "group" else 1], strict=False):
                    with s as micro:
                        micro.backward(_loss(m, x, y))
            if loader is not None:
                batch = loader.position - (held.lookahead if held is not None else 0)
            if (epoch, batch) == signal_at:
                os.kill(os.getpid(), signal.SIGTERM)
            if stop.check():
                break
        sched.step()  # the epoch's own code, after its last window
    return {
        "weights": [p.detach().clone() for m in models for p in m.parameters()],
        "epochs": epochs,
        "reason": stop.reason,
        "saved": [p.name for p in ckpt.checkpoints()],
    }


CASES = [("none", True), ("step", True), ("group", True), ("step", False), ("group", False)]


IDS = [f"{k}-{'loader' if w else 'no_loader'}" for k, w in CASES]


@pytest.mark.parametrize(("kind", "with_loader"), CASES, ids=IDS)
def test_a_stop_on_an_epochs_last_batch_saves_after_its_code_and_resumes_exactly(
    tmp_path: Path, kind: str, with_loader: bool
) -> None:
    """SIGTERM on epoch 0's last batch: the newest checkpoint, once epochs() ends, holds the
    epoch's scheduler step and the next epoch; the resumed run trains epochs 1 and 2 and
    ends bit-identical. With a loader, the stop wrote one at once first, saying the epoch's
    code was still to run (the same file with a step: the same update).

    Without a step (a loader's count) and without a loader (the step's iterate) alike.
    """
    whole = _run(tmp_path / "whole", kind, with_loader, None)
    first = _run(tmp_path / "parts", kind, with_loader, (0, BATCHES))
    assert first["reason"] == "SIGTERM" and first["epochs"] == [0]
    assert len(first["saved"]) == (2 if kind == "none" and with_loader else 1)
    saved = loopkit.load_checkpoint(tmp_path / "parts" / first["saved"][-1])
    assert saved["scheduler"]["last_epoch"] == 1  # written after the epoch's code
    if with_loader:
        assert saved["loader"]["next_epoch"] == 1 and saved["loader"]["position"] == BATCHES
        assert "epoch_open" not in saved["loader"]
    else:
        assert saved["until"]["epoch"] == 1
    second = _run(tmp_path / "parts", kind, with_loader, None)
    assert second["reason"] == "max_epochs" and second["epochs"] == [1, 2]
    assert whole["epochs"] == [0, 1, 2]
    assert_bit_equal(whole["weights"], second["weights"])


@pytest.mark.parametrize("kind", ["none", "group"])
def test_a_mid_epoch_stop_with_a_loader_resumes_exactly(tmp_path: Path, kind: str) -> None:
    """SIGTERM after batch 4 of epoch 1: saved at once, the resumed run continues the pass."""
    whole = _run(tmp_path / "whole", kind, True, None)
    first = _run(tmp_path / "parts", kind, True, (1, 4))
    saved = loopkit.load_checkpoint(tmp_path / "parts" / first["saved"][0])
    assert saved["scheduler"]["last_epoch"] == 1  # before epoch 1's code
    assert (saved["loader"]["epoch"], saved["loader"]["position"]) == (1, 4)
    second = _run(tmp_path / "parts", kind, True, None)
    assert second["epochs"] == [1, 2]
    assert_bit_equal(whole["weights"], second["weights"])


@pytest.mark.parametrize("kind", ["step", "none"])
def test_without_a_loader_a_stop_not_known_to_end_the_pass_saves_at_once(
    tmp_path: Path, kind: str
) -> None:
    """No loader: mid-pass (or, without a step's iterate, anywhere) the stop saves at its
    boundary, before the epoch's code, with the epoch it stopped in (the resumed run starts
    that epoch over: without loader= only epoch boundaries resume exactly)."""
    at = (1, 3) if kind == "step" else (1, BATCHES)
    first = _run(tmp_path, kind, False, at)
    assert first["reason"] == "SIGTERM" and len(first["saved"]) == 1
    saved = loopkit.load_checkpoint(tmp_path / first["saved"][0])
    assert saved["until"]["epoch"] == 1 and saved["scheduler"]["last_epoch"] == 1


def _epoch_limited(tmp_path: Path, with_step: bool) -> tuple[Any, Any, Any, Any]:
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    step = loopkit.step(model, opt, accumulate=4) if with_step else None
    x_all, y_all = _data()
    loader = distributed.loader(torch.utils.data.TensorDataset(x_all, y_all), batch_size=4,
                                num_workers=0, seed=1)  # fmt: skip
    ckpt = loopkit.Checkpointer(tmp_path, model=model, optimizer=opt, scheduler=sched,
                                step=step, loader=loader)  # fmt: skip
    return model, opt, (step, sched), (loader, ckpt)


@pytest.mark.parametrize("with_step", [True, False], ids=["step", "no_step"])
def test_max_epochs_without_epochs_stops_where_the_last_pass_ends(
    tmp_path: Path, with_step: bool
) -> None:
    """until(max_epochs=2), a loop of its own (no epochs()), the Checkpointer's loader: check()
    stops on the window that ends epoch 1's pass, and the save, written there (the loop may
    run epoch 1's code after the stop or break past it), says that code is still to run."""
    model, opt, (step, sched), (loader, ckpt) = _epoch_limited(tmp_path, with_step)
    answers = []
    with loopkit.until(step, max_epochs=2, signals=(), checkpointer=ckpt) as stop:
        for _ in range(4):  # bounded: a limit that is ignored would loop for ever
            if stop.reason is not None:
                break
            for x, y in step.iterate(loader) if step is not None else loader:
                if step is not None:
                    with step as s:
                        s.backward(_loss(model, x, y))
                else:
                    opt.zero_grad()
                    _loss(model, x, y).backward()
                    opt.step()
                answers.append(stop.check())
                if answers[-1]:
                    break
            sched.step()
    assert stop.reason == "max_epochs" and loader.epoch == 2 and loader.position == BATCHES
    assert len(answers) == 2 * BATCHES and answers.count(True) == 1
    assert stop.stopped_at == (4 if with_step else 2 * BATCHES)  # windows of 4, the last of 2
    (path,) = ckpt.checkpoints()
    saved = loopkit.load_checkpoint(path)
    assert saved["scheduler"]["last_epoch"] == 1 and saved["loader"]["epoch_open"] is True
    assert (saved["loader"]["epoch"], saved["loader"]["position"]) == (1, BATCHES)


def test_max_epochs_that_until_cannot_see_is_refused_at_the_first_check(tmp_path: Path) -> None:
    """No epochs() and no loader=: the first check() raises (the limit would be ignored),
    before it counts anything; with epochs() the same until counts them."""
    model = nn.Linear(3, 1)
    ckpt = loopkit.Checkpointer(tmp_path, model=model)
    stop = loopkit.until(max_epochs=2, signals=(), checkpointer=ckpt)
    with pytest.raises(RuntimeError, match=r"cannot see this loop's epochs.*stop\.epochs\("):
        stop.check()
    assert stop.state_dict()["calls"] == 0 and stop.reason is None
    assert [e for e in stop.epochs() if not stop.check()] == [0, 1]
    assert stop.reason == "max_epochs"


@pytest.mark.parametrize("given", ["until_only", "checkpointer_only", "different"])
def test_until_and_its_checkpointer_must_follow_the_same_step(tmp_path: Path, given: str) -> None:
    """A stop's checkpoint must hold the counters until stopped at: another step is refused
    before a handler is installed or the Checkpointer changed."""
    before = signal.getsignal(signal.SIGTERM)
    model = nn.Linear(3, 1)
    a = loopkit.step(model, torch.optim.SGD(model.parameters(), lr=0.1))
    other = nn.Linear(3, 1)
    b = loopkit.step(other, torch.optim.SGD(other.parameters(), lr=0.1))
    saved_step, until_step = {"until_only": (None, a), "checkpointer_only": (a, None),
                              "different": (b, a)}[given]  # fmt: skip
    ckpt = loopkit.Checkpointer(tmp_path, model=model, step=saved_step)
    with pytest.raises(ValueError, match="pass the same step to both"):
        loopkit.until(until_step, checkpointer=ckpt)
    assert "until" not in ckpt.pieces and signal.getsignal(signal.SIGTERM) == before


def test_a_stop_in_a_loop_nothing_ends_is_written_at_once_and_resumes_its_epoch_code(
    tmp_path: Path,
) -> None:
    """No step, no epochs(), no `with until`: a stop on a pass's last batch is written at once
    (a deferred save could never be written), marked as before the epoch's own code; close()
    writes nothing more; a resume runs that code (the scheduler's epoch step) before the next
    pass, so the run continues as the uninterrupted one."""
    model, opt, _, (loader, ckpt) = _epoch_limited(tmp_path, False)
    stop = loopkit.until(max_updates=BATCHES, signals=(), checkpointer=ckpt)
    for _ in loader:
        opt.zero_grad()
        _loss(model, *_data()).backward()
        opt.step()
        if stop.check():
            break
    assert stop.reason == "max_updates" and not ckpt.save_pending
    assert [p.name for p in ckpt.checkpoints()] == ["ckpt-0000000001.pt"]
    stop.close()
    assert [p.name for p in ckpt.checkpoints()] == ["ckpt-0000000001.pt"]
    saved = loopkit.load_checkpoint(ckpt.checkpoints()[0])
    assert saved["scheduler"]["last_epoch"] == 0 and saved["until"]["calls"] == BATCHES
    assert saved["loader"]["epoch_open"] is True
    _, _, (_, sched2), (loader2, ckpt2) = _epoch_limited(tmp_path, False)
    loopkit.until(max_updates=2 * BATCHES, signals=(), checkpointer=ckpt2)
    ckpt2.resume()
    assert loader2.epoch == 0 and list(loader2) == []  # the epoch's pass: no batch left
    sched2.step()  # the epoch's own code runs in the resumed run
    assert loader2.epoch == 1 and sched2.last_epoch == 1


def _unmanaged_run(directory: Path, stop_at: int | None) -> tuple[torch.Tensor, float, list[str]]:
    """A loop with until but neither epochs() nor `with until`: the epoch's code steps the
    scheduler and draws from the RNG after the inner loop."""
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(32, 3), torch.randn(32, 1))
    loader = distributed.loader(data, batch_size=4, num_workers=0, seed=3)
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
    step = loopkit.step(model, opt, accumulate=2)
    ckpt = loopkit.Checkpointer(directory, model=model, optimizer=opt, scheduler=sched,
                                step=step, loader=loader)  # fmt: skip
    stop = loopkit.until(step, max_updates=stop_at or 100, signals=(), checkpointer=ckpt)
    ckpt.resume()
    noise = torch.zeros(1)
    for _ in range(loader.epoch, 3):
        for x, y in step.iterate(loader):
            with step as s:
                s.backward(_loss(model, x, y))
            if stop.check():
                break
        if stop.reason is not None:
            break
        sched.step()
        noise = torch.rand(1)
    names = [p.name for p in ckpt.checkpoints()]
    return model.weight.detach().clone(), float(noise), names


@pytest.mark.parametrize("stop_at", [4, 3, 8])  # a pass's last window, mid-pass, another end
def test_a_stop_in_a_loop_nothing_ends_resumes_bit_identical(tmp_path: Path, stop_at: int) -> None:
    """The stop's checkpoint is written (none was, at a pass's end), and the resumed run ends
    bit-identical to the uninterrupted one, the epoch's code after the stop included."""
    whole = _unmanaged_run(tmp_path / "a", None)
    _, _, names = _unmanaged_run(tmp_path / "b", stop_at)
    assert names == [f"ckpt-{stop_at:010d}.pt"]
    resumed = _unmanaged_run(tmp_path / "b", None)
    assert torch.equal(whole[0], resumed[0]) and whole[1] == resumed[1]
