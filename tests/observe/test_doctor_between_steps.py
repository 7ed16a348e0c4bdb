"""The doctor counts host syncs over the whole iteration: the user's code after a step too."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

import loopkit
from loopkit import _sync_points


def _line(tag: str) -> str:
    source = Path(__file__).read_text().splitlines()
    (n,) = [i for i, text in enumerate(source, 1) if text.rstrip().endswith(f"# {tag}")]
    return f"{__file__}:{n}"


def _loop(iterate: bool) -> loopkit.doctor:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    doc = loopkit.doctor(sample_syncs_at=(3, 4, 5), sample_syncs_every=None, sink=lambda _: None)
    step = loopkit.step(model, torch.optim.SGD(model.parameters(), lr=0.01), doctor=doc)
    batches = list(torch.randn(8, 2, 4))
    seen = []
    for x in step.iterate(batches) if iterate else batches:
        with step as s:
            loss = model(x).pow(2).mean()
            s.backward(loss)
        seen.append(loss.item())  # after-step
        text = f"{float(loss):.3f}"  # in-print
        if loss > 100:  # branch
            text += "!"
    return doc


def test_syncs_between_steps_are_counted_with_their_lines() -> None:
    """.item() after the step, float(loss) in a print, a branch on a tensor: 3 per step,
    all between steps, each at its line; only the 3 sampled steps are counted."""
    doc = _loop(iterate=True)
    stats = doc.stats()
    assert doc.sync_steps == 3
    assert stats["syncs_per_step"] == 3.0 and stats["syncs_between_per_step"] == 3.0
    assert stats["sync_lines"] == {
        f"{_line(tag)} (between)": 1.0 for tag in ("after-step", "in-print", "branch")
    }
    report = doc.report()
    assert "0.0 inside the step, 3.0 between steps" in report
    assert f"1.0 per step at {_line('after-step')} (between)" in report
    assert "host-device syncs per step" in report  # the tip now applies


def test_without_the_doctor_iterating_only_the_step_is_counted_and_nothing_stays_on() -> None:
    """A plain loop: the count stops with the step (no next batch would stop it later)."""
    doc = _loop(iterate=False)
    assert doc.stats()["syncs_per_step"] == 0.0 and doc.sync_steps == 3
    assert not _sync_points.this_thread_hub().states  # no counter left running
