"""The x-axis sinks receive: optimizer updates under a step, log calls alone; resumed alike."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import loopkit
from loopkit import distributed


class Recorder:
    """A sink that keeps every call: metrics, step and axes."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, dict[str, float], dict[str, float]]] = []
        self.params: dict[str, Any] = {}
        self.run_id = "run-1"

    def __call__(self, metrics: dict[str, float], *, step: int, axes: dict[str, float]) -> None:
        self.calls.append((step, axes, metrics))

    def config(self, params: dict[str, Any]) -> None:
        self.params.update(params)

    def state_dict(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "last": self.calls[-1][0] if self.calls else 0}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.run_id = state["run_id"]


def _train(tmp: Path, updates: int | None, sink: Recorder, resume: bool = False) -> loopkit.step:
    """10 batches of 4 per epoch, accumulate=4 (3 updates an epoch), log every 2 micro-steps."""
    torch.manual_seed(0)
    model = nn.Linear(6, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    log = loopkit.detach_logging(every=2, sink=sink)
    step = loopkit.step(model, opt, accumulate=4, log=log)
    data = torch.utils.data.TensorDataset(torch.randn(40, 6), torch.randn(40, 1))
    loader = distributed.loader(data, batch_size=4, seed=0, num_workers=0)
    ckpt = loopkit.Checkpointer(
        tmp, model=model, optimizer=opt, step=step, loader=loader, extra={"log": log}
    )
    stop = loopkit.until(step, max_epochs=2, max_updates=updates, checkpointer=ckpt)
    if resume:
        ckpt.resume()
    for _ in stop.epochs(loader):
        for x, y in step.iterate(loader, tokens=lambda b: b[0].shape[0] * 3):
            with step as s:
                s.backward(nn.functional.mse_loss(model(x), y))
            if stop.check():
                break
    return step


def test_sinks_plot_against_updates_with_epoch_samples_and_tokens(tmp_path: Path) -> None:
    """Under loopkit.step, step= is the update count at the flush, not the log calls."""
    sink = Recorder()
    step = _train(tmp_path, None, sink)
    assert step.updates == 6
    steps = [c[0] for c in sink.calls]
    axes = [c[1] for c in sink.calls]
    assert steps == [a["updates"] for a in axes]
    assert steps == sorted(steps) and steps[-1] == 6 and len(steps) == 10  # 20 micro-steps / 2
    # Flushes fall every 2 micro-steps: the first after batch 2 (no update yet), then 2.
    assert steps[:3] == [0, 1, 1]
    assert [a["samples"] for a in axes] == [8 * (i + 1) for i in range(10)]
    assert [a["tokens"] for a in axes] == [24 * (i + 1) for i in range(10)]
    assert [a["epoch"] for a in axes] == [0] * 5 + [1] * 5


def test_a_resumed_run_continues_the_same_axis_and_run(tmp_path: Path) -> None:
    """Stopped at update 4 and resumed: the axis goes on from the checkpoint, the sink's run
    id comes back, and the resumed points are the uninterrupted run's."""
    whole = Recorder()
    _train(tmp_path / "whole", None, whole)
    first = Recorder()
    first.run_id = "run-7"
    _train(tmp_path / "parts", 4, first)
    second = Recorder()
    second.run_id = "fresh"
    _train(tmp_path / "parts", None, second, resume=True)
    assert second.run_id == "run-7"
    assert second.calls[0][0] >= 4
    assert len(first.calls) == 7 and first.calls + second.calls == whole.calls


def test_standalone_detach_logging_counts_its_calls() -> None:
    """Without a step, step= is the number of log calls (as before)."""
    sink = Recorder()
    log = loopkit.detach_logging(every=3, sink=sink)
    for i in range(9):
        log(x=float(i))
    assert [c[0] for c in sink.calls] == [3, 6, 9]
    assert all(c[1] == {} for c in sink.calls)
    restored = loopkit.detach_logging(every=3, sink=Recorder())
    restored.load_state_dict(log.state_dict())
    assert restored.step == 9


def test_a_failing_sink_is_reported_once_and_the_others_keep_receiving() -> None:
    """A sink that raises (a tracker's network error) never stops the loop or the others."""
    calls = 0

    def broken(metrics: dict[str, float]) -> None:
        nonlocal calls
        calls += 1
        raise ConnectionError("tracker unreachable")

    good = Recorder()
    log = loopkit.detach_logging(every=1, sink=[broken, good])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(4):
            log(loss=torch.tensor(float(i)))
    failed = [w for w in caught if w.category is loopkit.SinkFailedWarning]
    assert len(failed) == 1 and "tracker unreachable" in str(failed[0].message)
    assert calls == 4 and [c[2]["loss"] for c in good.calls] == [0.0, 1.0, 2.0, 3.0]


def test_config_goes_to_the_trackers_and_a_wrong_state_changes_nothing() -> None:
    """log.config(...) reaches sinks with config(); a state for other sinks is refused first."""
    sink = Recorder()
    log = loopkit.detach_logging(every=1, sink=[sink, print])
    log.config(lr=0.1, batch=32)
    assert sink.params == {"lr": 0.1, "batch": 32}
    log(x=1.0)
    with pytest.raises(ValueError, match="same sinks, in the same order"):
        log.load_state_dict({"calls": 50, "sinks": [None]})
    with pytest.raises(ValueError, match="same sinks, in the same order"):
        log.load_state_dict({"calls": 50, "sinks": [None, None]})
    assert log.step == 1 and sink.run_id == "run-1"


def test_clock_must_count_updates() -> None:
    """clock= takes a step (its updates), and says so otherwise."""
    with pytest.raises(TypeError, match="clock must be a loopkit"):
        loopkit.detach_logging(clock=object())
