"""early_stop: decided at an observation from the state then, never carried past min_updates."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn

import loopkit
from loopkit._control._early_stop import improves


def test_improves_is_strict_by_min_delta() -> None:
    """An improvement must beat the best by more than min_delta, in the mode's direction."""
    assert improves(1.0, None, "min", 0.0)
    assert improves(0.9, 1.0, "min", 0.05) and not improves(0.95, 1.0, "min", 0.05)
    assert not improves(1.0, 1.0, "min", 0.0)
    assert improves(1.1, 1.0, "max", 0.05) and not improves(1.05, 1.0, "max", 0.05)


def _run(values: list[float], **kw: object) -> tuple[loopkit.early_stop, int | None]:
    """Observe ``values`` one per update; the 1-based observation that decided to stop."""
    model = nn.Linear(1, 1)
    step = loopkit.step(model, torch.optim.SGD(model.parameters(), lr=0.1))
    es = loopkit.early_stop(step, "loss", **kw)  # type: ignore[arg-type]
    for i, v in enumerate(values, start=1):
        with step as s:
            s.backward(model(torch.ones(1, 1)).sum())
        assert step.updates == i
        if es.observe({"loss": v}):
            return es, i
    return es, None


def test_patience_three_on_a_scripted_sequence() -> None:
    """Best 3.0 at the 3rd value, then three without improvement: stops at the 6th."""
    es, at = _run([5.0, 4.0, 3.0, 3.5, 3.0, 3.2, 1.0], patience=3)
    assert at == 6 and es.reason == "no improvement" and es.best == 3.0 and es.wait == 3


def test_an_improvement_resets_the_count() -> None:
    """Two bad, one better, two bad: never three in a row, no stop."""
    es, at = _run([5.0, 6.0, 6.0, 4.0, 4.5, 4.5], patience=3)
    assert at is None and es.wait == 2 and es.best == 4.0


def test_min_updates_does_not_lock_in_an_earlier_stop() -> None:
    """Patience runs out before min_updates, the metric then improves: no stop at min_updates.

    Lightning#19966: a stop decided before min_epochs was taken as soon as they were reached.
    """
    es, at = _run([5.0, 6.0, 6.0, 6.0, 6.0, 1.0, 1.5], patience=3, min_updates=6)
    assert at is None and es.best == 1.0 and es.wait == 1


def test_min_updates_first_observation_after_it_decides() -> None:
    """Without an improvement, the first observation at min_updates stops the run."""
    _, at = _run([5.0, 6.0, 6.0, 6.0, 6.0, 6.0], patience=3, min_updates=6)
    assert at == 6


def test_max_mode_and_min_delta() -> None:
    """An accuracy that creeps up by less than min_delta counts as no improvement."""
    es, at = _run([0.5, 0.505, 0.509, 0.508, 0.7], patience=3, mode="max", min_delta=0.01)
    assert at == 4 and es.best == 0.5


def test_nan_stops_at_once_even_before_min_updates() -> None:
    """A NaN metric stops the run at once: no later evaluation can mean anything."""
    es, at = _run([1.0, math.nan], patience=5, min_updates=100)
    assert at == 2 and es.reason == "nan"


def test_nan_raises_when_asked_and_changes_nothing() -> None:
    """on_nan='raise': FloatingPointError, and the record stays as before the NaN."""
    es, _ = _run([1.0, 2.0], patience=5, on_nan="raise")
    before = es.state_dict()
    with pytest.raises(FloatingPointError, match="NaN"):
        es.observe({"loss": torch.tensor(math.nan)})
    assert es.state_dict() == before and not es.stopped


def test_bad_observations_change_nothing() -> None:
    """A missing metric, a vector or a string is refused before the record changes."""
    es, _ = _run([1.0, 2.0], patience=5)
    before = es.state_dict()
    with pytest.raises(KeyError, match="'loss'"):
        es.observe({"acc": 0.5})
    with pytest.raises(ValueError, match="one number"):
        es.observe(torch.ones(3))
    with pytest.raises(TypeError, match="number"):
        es.observe({"loss": "low"})
    assert es.state_dict() == before


@pytest.mark.parametrize(
    ("kwargs", "error", "says"),
    [
        ({"patience": 0}, ValueError, "patience"),
        ({"patience": 2, "mode": "lowest"}, ValueError, "mode"),
        ({"patience": 2, "min_delta": -1}, ValueError, "min_delta"),
        ({"patience": 2, "min_updates": 5}, ValueError, "counts the updates of a step"),
        ({"patience": 2, "on_nan": "ignore"}, ValueError, "on_nan"),
    ],
)
def test_bad_arguments(kwargs: dict[str, object], error: type[Exception], says: str) -> None:
    """Each bad argument is named, with what it must be."""
    with pytest.raises(error, match=says):
        loopkit.early_stop(None, "loss", **kwargs)  # type: ignore[arg-type]


def _train(ckpt_dir: Path, metrics: list[float], stop_after: int | None) -> tuple[int | None, int]:
    """A run that observes metrics[u - 1] after update u; saves every update; may crash."""
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = loopkit.step(model, opt)
    es = loopkit.early_stop(step, "loss", patience=3)
    ckpt = loopkit.Checkpointer(ckpt_dir, model=model, optimizer=opt, step=step,
                                extra={"early_stop": es})  # fmt: skip
    ckpt.resume()
    while step.updates < len(metrics):
        with step as s:
            s.backward(model(torch.ones(2, 3)).pow(2).mean())
        stopped = es.observe(metrics[step.updates - 1])
        ckpt.save()  # after the observation: the checkpoint holds its count
        if stopped:
            return step.updates, es.wait
        if stop_after is not None and step.updates == stop_after:
            return None, es.wait  # "killed" right after the save of this update's state
    return None, es.wait


def test_resume_in_the_middle_of_a_patience_run(tmp_path: Path) -> None:
    """Killed with two bad observations counted: the resumed run stops where one run stops."""
    metrics = [3.0, 2.0, 2.5, 2.4, 2.2, 2.9, 1.0]
    whole, _ = _train(tmp_path / "whole", metrics, None)
    crashed, wait = _train(tmp_path / "parts", metrics, stop_after=4)
    assert crashed is None and wait == 2
    resumed, _ = _train(tmp_path / "parts", metrics, None)
    assert whole == resumed == 5
