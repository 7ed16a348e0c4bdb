"""cadence: fires on a schedule of shared counts, only where a window has just closed."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import loopkit
from loopkit import distributed
from loopkit._control._cadence import per_epoch_marks


@pytest.mark.parametrize(
    ("batches", "every", "times", "marks"),
    [
        (10, 1, 4, (3, 5, 8, 10)),
        (10, 4, 2, (8, 10)),
        (10, 3, 3, (6, 9, 10)),
        (7, 2, 1, (7,)),
        (12, 4, 3, (4, 8, 12)),
    ],
)
def test_per_epoch_marks(batches: int, every: int, times: int, marks: tuple[int, ...]) -> None:
    """Evenly spread, moved on to their window's end, the last ending the pass."""
    got = per_epoch_marks(batches, every, times)
    assert got == marks
    assert all(m % every == 0 or m == batches for m in got) and got[-1] == batches


def _run(every: int, n: int, passes: int, **kw: object) -> list[tuple[int, int, int]]:
    """(epoch, batches taken, update) at each firing, over ``passes`` passes of n batches."""
    model = nn.Linear(2, 1)
    step = loopkit.step(model, torch.optim.SGD(model.parameters(), lr=0.1), accumulate=every)
    data = torch.utils.data.TensorDataset(torch.randn(n, 2), torch.randn(n, 1))
    loader = distributed.loader(data, batch_size=1, num_workers=0)
    if "updates" not in kw:
        kw["loader"] = loader
    val = loopkit.cadence(step, **kw)  # type: ignore[arg-type]
    fired = []
    for epoch in range(passes):
        for taken, (x, y) in enumerate(step.iterate(loader), start=1):
            with step as s:
                s.backward(nn.functional.mse_loss(model(x), y))
            if val.due():
                assert step.micro_step == 0  # never mid-window
                fired.append((epoch, taken, step.updates))
            assert not val.due()  # once per boundary, however often it is asked
    return fired


def test_every_n_updates() -> None:
    """updates=2 with windows of 3 over a 10-batch pass (4 windows each): every 2nd update."""
    fired = _run(3, 10, 2, updates=2)
    assert [u for _, _, u in fired] == [2, 4, 6, 8]
    assert [(e, t) for e, t, _ in fired] == [(0, 6), (0, 10), (1, 6), (1, 10)]


def test_k_times_per_epoch() -> None:
    """per_epoch=3 with windows of 2 over 10 batches: after batches 4, 8 and 10, each pass."""
    fired = _run(2, 10, 2, per_epoch=3)
    assert [(e, t) for e, t, _ in fired] == [(0, 4), (0, 8), (0, 10), (1, 4), (1, 8), (1, 10)]


def test_every_e_epochs() -> None:
    """epochs=2: at the end of the 2nd and 4th passes only."""
    fired = _run(3, 5, 4, epochs=2)
    assert [(e, t) for e, t, _ in fired] == [(1, 5), (3, 5)]


def test_legacy_loop_counts_calls() -> None:
    """Without a loopkit step, each due() call is one optimizer update."""
    val = loopkit.cadence(updates=3)
    assert [val.due() for _ in range(7)] == [False, False, True, False, False, True, False]


def test_bad_arguments() -> None:
    """No schedule, two schedules, per_epoch without a keyed loader, or too many: refused."""
    model = nn.Linear(2, 1)
    step = loopkit.step(model, torch.optim.SGD(model.parameters(), lr=0.1), accumulate=4)
    data = torch.utils.data.TensorDataset(torch.randn(8, 2))
    with pytest.raises(TypeError, match="exactly one"):
        loopkit.cadence(step)
    with pytest.raises(TypeError, match="exactly one"):
        loopkit.cadence(step, updates=2, epochs=1)
    with pytest.raises(ValueError, match="updates must be an int >= 1"):
        loopkit.cadence(step, updates=0)
    with pytest.raises(TypeError, match=r"distributed\.loader"):
        plain = torch.utils.data.DataLoader(data)
        loopkit.cadence(step, per_epoch=2, loader=plain)  # type: ignore[arg-type]
    loader = distributed.loader(data, batch_size=1, num_workers=0)
    with pytest.raises(ValueError, match="only 2 windows"):
        loopkit.cadence(step, per_epoch=3, loader=loader)
    with pytest.raises(TypeError, match=r"takes a loopkit\.step"):
        loopkit.cadence(model, updates=2)


def test_a_skipped_update_still_ends_its_window() -> None:
    """The pass's last window skipped (a NaN loss, skip_nonfinite): epochs=1 still fires."""
    x = torch.randn(8, 2)
    x[7] = float("nan")
    data = torch.utils.data.TensorDataset(x, torch.randn(8, 1))
    loader = distributed.loader(data, batch_size=1, shuffle=False, num_workers=0)
    model = nn.Linear(2, 1)
    step = loopkit.step(model, torch.optim.SGD(model.parameters(), lr=0.1), accumulate=2,
                        skip_nonfinite=True)  # fmt: skip
    val = loopkit.cadence(step, epochs=1, loader=loader)
    fired = []
    for xb, yb in step.iterate(loader):
        with step as s:
            s.backward(nn.functional.mse_loss(model(xb), yb))
        fired.append(val.due())
    assert step.skipped == 1 and fired == [False] * 7 + [True]


def test_windows_not_aligned_with_passes_are_refused() -> None:
    """Looping over the loader itself (not step.iterate), windows straddle passes: refused."""
    data = torch.utils.data.TensorDataset(torch.randn(5, 2), torch.randn(5, 1))
    loader = distributed.loader(data, batch_size=1, shuffle=False, num_workers=0)
    model = nn.Linear(2, 1)
    step = loopkit.step(model, torch.optim.SGD(model.parameters(), lr=0.1), accumulate=2)
    val = loopkit.cadence(step, per_epoch=2, loader=loader)
    with pytest.raises(RuntimeError, match=r"loop over step\.iterate\(loader\)"):
        for _ in range(2):
            for xb, yb in loader:
                with step as s:
                    s.backward(nn.functional.mse_loss(model(xb), yb))
                val.due()


@pytest.mark.parametrize("kind", [{"per_epoch": 1}, {"epochs": 1}])
def test_a_group_not_entered_on_a_passs_first_batch_fires_at_the_passs_end(
    kind: dict[str, int],
) -> None:
    """Both members start on batch 1: no window has closed at the first due(), so no false
    boundary at update 0 (refused as misaligned before); one fire per pass, at its end."""
    A, B = nn.Linear(4, 1), nn.Linear(4, 1)
    steps = [loopkit.step(m, torch.optim.SGD(m.parameters(), lr=0.01), accumulate=2)
             for m in (A, B)]  # fmt: skip
    group = loopkit.steps(*steps)
    data = torch.utils.data.TensorDataset(torch.randn(4, 4))
    loader = distributed.loader(data, batch_size=1, shuffle=False, num_workers=0)
    val = loopkit.cadence(group, **kind, loader=loader)  # type: ignore[arg-type]
    fired = []
    for epoch in range(2):
        for i, (x,) in enumerate(group.iterate(loader)):
            if i:  # no member trains on a pass's first batch
                for s, m in zip(steps, (A, B), strict=True):
                    with s as st:
                        st.backward(m(x).pow(2).mean())
            if val.due():
                fired.append((epoch, i, group.updates))
    assert fired == [(0, 3, 2), (1, 3, 4)]
