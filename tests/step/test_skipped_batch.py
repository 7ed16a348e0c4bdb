"""A batch the loop skips by catching its micro-step's exception, at a window's last
micro-step: where the loop then asks loop control (``until.check()``, ``cadence.due()``, a
save), the window ends there, its place (the mean of its micro-steps that made a backward),
so the windows after it stay on the loader's positions; a loop that goes on at once
(``continue``) has that window take its next micro-step too, as a hand loop with
``continue`` does, and loop control sees that window's end."""

from __future__ import annotations

import tempfile
import warnings

import pytest
import torch
from torch import nn

import loopkit
from loopkit import distributed


class _BadBatch(Exception):
    """The loop's own check rejecting a batch."""


def _data(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        (torch.randn(4, 3, generator=g, dtype=torch.float64),
         torch.randn(4, 1, generator=g, dtype=torch.float64))
        for _ in range(n)
    ]  # fmt: skip


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(3, 1).double()


def _reference(
    data: list[tuple[torch.Tensor, torch.Tensor]], every: int, bad: set[int]
) -> list[torch.Tensor]:
    """By hand: windows of ``every`` positions (the last ragged), each the mean of its good
    batches' gradients, no update for a window with none."""
    spans = [range(start, min(start + every, len(data))) for start in range(0, len(data), every)]
    goods = [[i for i in span if i not in bad] for span in spans]
    return _reference_windows(data, [good for good in goods if good])


def _micro_step(step: loopkit.step, model: nn.Module, x: torch.Tensor, y: torch.Tensor,
                bad: bool) -> bool:  # fmt: skip
    """One micro-step, its batch rejected before the forward if ``bad`` (the loop catches
    it); whether it trained."""
    try:
        with step as s:
            if bad:
                raise _BadBatch
            s.backward(nn.functional.mse_loss(model(x), y))
    except _BadBatch:
        return False
    return True


def _checked_micro_step(
    step: loopkit.step, net: nn.Module, x: torch.Tensor, y: torch.Tensor, bad: bool
) -> bool:
    """One micro-step whose check after the backward rejects its batch if ``bad`` (the loop
    catches it); whether it was rejected."""
    try:
        with step as s:
            s.backward(nn.functional.mse_loss(net(x), y))
            if bad:
                raise _BadBatch
    except _BadBatch:
        return True
    return False


def _windows_before(i: int, n: int, every: int, bad: set[int]) -> int:
    """Updates made by windows that end before position ``i`` (those with a good batch)."""
    ends = [e for e in range(n) if (e + 1) % every == 0 or e == n - 1]
    return sum(
        1 for e in ends if e < i and any(j not in bad for j in range(e - (e % every), e + 1))
    )


CASES = [(2, {1}), (2, {0}), (3, {2, 3}), (3, {6}), (2, {5, 6}), (3, {1, 2}), (1, {3})]


@pytest.mark.parametrize(("every", "bad"), CASES)
def test_windows_stay_on_the_loaders_positions_when_a_batch_raises(
    every: int, bad: set[int]
) -> None:
    """At the top of every batch, ``step.updates`` counts the windows that ended before it
    (a skipped batch at a window's end no longer pushes every later window one batch on),
    and the weights are the hand loop's: each window the mean of its good batches."""
    data = _data(7)
    model = _model()
    step = loopkit.step(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                        accumulate=every)  # fmt: skip
    stop = loopkit.until(step, max_updates=100)
    for i, (x, y) in enumerate(step.iterate(data)):
        assert step.updates == _windows_before(i, len(data), every, bad), i
        _micro_step(step, model, x, y, bad=i in bad)
        assert not stop.check()  # where the docs ask: after the micro-step
    assert step.updates == _windows_before(len(data), len(data), every, bad)
    assert step.micro_step == 0
    for ours, ref in zip(model.parameters(), _reference(data, every, bad), strict=True):
        torch.testing.assert_close(ours.detach(), ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(("every", "bad"), CASES)
def test_a_plain_loop_counting_windows_keeps_them_on_multiples(every: int, bad: set[int]) -> None:
    """Without ``iterate`` (windows counted), loop control asked after each micro-step: the
    window closes there, and the updates are the hand loop's on windows of ``every``."""
    data = _data(7)
    model = _model()
    step = loopkit.step(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                        accumulate=every)  # fmt: skip
    validate = loopkit.cadence(step, updates=1)
    for i, (x, y) in enumerate(data):
        trained = _micro_step(step, model, x, y, bad=i in bad)
        if not trained and (i + 1) % every == 0:  # overdue: the next micro-step would end it
            assert step.ends_window
        validate.due()
        if (i + 1) % every == 0:  # its window ended there, asked: the next opens one
            assert step.micro_step == 0 and step.ends_window == (every == 1)
    step.flush()
    assert step.updates == _windows_before(len(data), len(data), every, bad)
    for ours, ref in zip(model.parameters(), _reference(data, every, bad), strict=True):
        torch.testing.assert_close(ours.detach(), ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("bad", [1, 3, 9])
def test_a_per_epoch_cadence_takes_a_loop_that_skips_a_batch(bad: int) -> None:
    """cadence(per_epoch=2) over a pass of 10 batches (accumulate 2) with one batch skipped
    at a window's end fires where it fires without the skip; it refused the loop ("a window
    ended 3 batches into the pass") once the windows had moved by one batch."""

    def fired(skip: int | None) -> list[int]:
        data = torch.utils.data.TensorDataset(torch.randn(80, 4), torch.randn(80, 1))
        torch.manual_seed(1)
        model = nn.Linear(4, 1)
        loader = distributed.loader(data, batch_size=8, shuffle=False, num_workers=0)
        step = loopkit.step(model, torch.optim.SGD(model.parameters(), lr=0.1), accumulate=2)
        validate = loopkit.cadence(step, per_epoch=2, loader=loader)
        at = []
        for i, (x, y) in enumerate(step.iterate(loader)):
            try:
                with step as s:
                    if i == skip:
                        raise _BadBatch(i)
                    s.backward(nn.functional.mse_loss(model(x), y))
            except _BadBatch:
                pass
            if validate.due():
                at.append(i)
        assert step.updates == 5
        return at

    assert fired(bad) == fired(None)


def test_a_save_after_the_raise_closes_the_window_first() -> None:
    """A save in the loop's handler of a window's failed last micro-step makes that window's
    update first (its good micro-steps), then saves at the boundary; it was refused as a save
    mid-window."""
    data = _data(4)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = loopkit.step(model, opt, accumulate=2)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = loopkit.Checkpointer(tmp, model=model, optimizer=opt, step=step)
        for i, (x, y) in enumerate(step.iterate(data)):
            try:
                with step as s:
                    s.backward(nn.functional.mse_loss(model(x), y))
                    if i == 1:
                        raise _BadBatch(i)  # after its backward: that stays in the window
            except _BadBatch:
                ckpt.save()
                assert step.updates == 1 and step.micro_step == 0
                saved = [p.detach().clone() for p in model.parameters()]
            else:
                if i == 3:
                    assert step.updates == 2
        fresh = _model()
        opt2 = torch.optim.SGD(fresh.parameters(), lr=0.1)
        again = loopkit.step(fresh, opt2, accumulate=2)
        loopkit.Checkpointer(tmp, model=fresh, optimizer=opt2, step=again).resume()
        assert again.updates == 1
        assert all(torch.equal(a, b) for a, b in zip(saved, fresh.parameters(), strict=True))


@pytest.mark.parametrize("after", [False, True])
@pytest.mark.parametrize("every", [1, 2, 3])
def test_a_loop_that_continues_past_the_error_keeps_its_limits_exact(
    every: int, after: bool
) -> None:
    """``except: continue`` (loop control not asked for the failed micro-step): the window
    takes the next micro-step too and closes in it, so ``until(max_updates=2)`` stops at 2
    exactly, once, and ``cadence(updates=2)`` fires at 2 (the window closed when the next
    batch was handed out, unseen, and the limit was passed: 3)."""
    data = _data(12)
    model = _model()
    step = loopkit.step(model, torch.optim.SGD(model.parameters(), lr=0.1), accumulate=every)
    stop = loopkit.until(step, max_updates=2)
    every_two = loopkit.cadence(step, updates=2)
    fired = []
    for i, (x, y) in enumerate(step.iterate(data)):
        try:
            with step as s:
                if i == every - 1 and not after:
                    raise _BadBatch(i)
                s.backward(nn.functional.mse_loss(model(x), y))
                if i == every - 1:
                    raise _BadBatch(i)
        except _BadBatch:
            continue
        if every_two.due():
            fired.append(step.updates)
        if stop.check():
            break
    assert step.updates == 2 and fired == [2]


def test_maybe_save_counts_the_update_it_closes() -> None:
    """``maybe_save(every=2)`` asked right after a failed window (accumulate=1, its backward
    made): the window's update, made there, is the one due, and it is saved (the count was
    read before the window closed: update 2 was never saved)."""
    data = _data(6)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = loopkit.step(model, opt)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = loopkit.Checkpointer(tmp, model=model, optimizer=opt, step=step, keep=10)
        saved = []
        for i, (x, y) in enumerate(step.iterate(data)):
            try:
                with step as s:
                    s.backward(nn.functional.mse_loss(model(x), y))
                    if i == 1:
                        raise _BadBatch(i)
            except _BadBatch:
                pass
            if ckpt.maybe_save(every=2) is not None:
                saved.append(step.updates)
        assert saved == [2, 4, 6]


def test_a_group_members_failed_window_closes_where_loop_control_asks() -> None:
    """In a loopkit.steps group (accumulate=1), D's micro-step raises after its backward, the
    loop goes on to G and asks ``until.check()``: D's window closes there, and the limit and
    cadence see the update (they saw D mid-window: the stop came at 3)."""
    torch.manual_seed(0)
    gen, critic = nn.Linear(2, 3), nn.Linear(3, 1)
    d_step = loopkit.step(critic, torch.optim.SGD(critic.parameters(), lr=0.1))
    g_step = loopkit.step(gen, torch.optim.SGD(gen.parameters(), lr=0.1), frozen=[critic])
    group = loopkit.steps(d_step, g_step)
    stop = loopkit.until(group, max_updates=2)
    every_two = loopkit.cadence(group, updates=2)
    fired = []
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(4, 3, generator=g), torch.randn(4, 2, generator=g)) for _ in range(6)]
    for i, (real, noise) in enumerate(group.iterate(batches)):
        try:
            with d_step as s:
                s.backward(critic(real).mean() - critic(gen(noise).detach()).mean())
                if i == 1:
                    raise _BadBatch(i)
        except _BadBatch:
            pass
        with g_step as s:
            s.backward(-critic(gen(noise)).mean())
        if every_two.due():
            fired.append(group.updates)
        if stop.check():
            break
    assert group.updates == 2 and fired == [2]


@pytest.mark.parametrize("chunk", [2, 3])
def test_a_continue_loop_keeps_whole_batches_in_each_window_with_micro_batch(chunk: int) -> None:
    """micro_batch=, a window's last chunk raises and the loop goes on at once (`continue`):
    the window goes on to the next window's mark (the last chunk of batch 3: no batch split
    between two updates), and until(max_updates=1) stops there (it stopped after batch 2's
    first chunk, half-way through a batch)."""
    data = [(torch.randn(6, 3, dtype=torch.float64), torch.randn(6, 1, dtype=torch.float64))
            for _ in range(6)]  # fmt: skip
    model = _model()
    step = loopkit.step(model, torch.optim.SGD(model.parameters(), lr=0.1), accumulate=2,
                        micro_batch=chunk)  # fmt: skip
    stop = loopkit.until(step, max_updates=1)
    per_batch = -(-6 // chunk)
    ended_at = None
    for k, (x, y) in enumerate(step.iterate(data)):
        try:
            with step as s:
                s.backward(nn.functional.mse_loss(model(x), y))
                if k == 2 * per_batch - 1:
                    raise _BadBatch(k)
        except _BadBatch:
            continue
        if stop.check():
            ended_at = k
            break
    assert ended_at == 4 * per_batch - 1 and step.updates == 1  # batch 3's last chunk


@pytest.mark.parametrize("chunk", [2, 3])
def test_micro_batch_windows_stay_aligned_when_a_last_chunk_raises(chunk: int) -> None:
    """micro_batch=: a window's last batch whose last chunk raises ends its window there too
    (loop control asked after each chunk); the next batch opens a new one."""
    data = [(torch.randn(6, 3, dtype=torch.float64), torch.randn(6, 1, dtype=torch.float64))
            for _ in range(6)]  # fmt: skip
    model = _model()
    step = loopkit.step(model, torch.optim.SGD(model.parameters(), lr=0.1), accumulate=2,
                        micro_batch=chunk)  # fmt: skip
    per_batch = -(-6 // chunk)
    tops = []
    stop = loopkit.until(step, max_updates=100)
    for k, (x, y) in enumerate(step.iterate(data)):
        if k % per_batch == 0:
            tops.append(step.updates)
        try:
            with step as s:
                s.backward(nn.functional.mse_loss(model(x), y))
                if k == 2 * per_batch - 1:  # batch 1's last chunk: the first window's end
                    raise _BadBatch(k)
        except _BadBatch:
            pass
        stop.check()
    assert tops == [0, 0, 1, 1, 2, 2] and step.updates == 3


def _reference_windows(
    data: list[tuple[torch.Tensor, torch.Tensor]], windows: list[list[int]]
) -> list[torch.Tensor]:
    """By hand: one update per window of batch indices, the mean of their gradients."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for window in windows:
        opt.zero_grad()
        for i in window:
            x, y = data[i]
            (nn.functional.mse_loss(model(x), y) / len(window)).backward()
        opt.step()
    return [p.detach() for p in model.parameters()]


@pytest.mark.parametrize("micro_batch", [None, 2])
def test_fsdp2_a_pass_whose_last_batch_raises_trains_on(
    process_group: None, micro_batch: int | None
) -> None:
    """Under FSDP2 a pass whose last micro-step raises before its backward leaves a window
    whose gradients wait for a synced backward (FSDP cannot reduce them by hand): the pass
    ends without refusing it, and the next pass's first micro-step (its first batch's mark,
    with micro_batch=) syncs and closes it, as for any window FSDP carries into a pass."""
    from torch.distributed.fsdp import fully_shard

    data = _data(8)
    model = _model()
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step = loopkit.step(model, opt, accumulate=2, micro_batch=micro_batch)
    # The pass's last batch is rejected (with micro_batch=2: both its chunks, 14 and 15).
    last = 7 if micro_batch is None else 14
    for epoch in range(2):
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            for i, (x, y) in enumerate(step.iterate(data)):
                _micro_step(step, model, x, y, bad=epoch == 0 and i >= last)
        carried = [w for w in said if issubclass(w.category, loopkit.OpenWindowWarning)]
        assert len(carried) == (epoch == 0), [str(w.message) for w in said]
    assert step.flush() is False  # every window closed in the loop
    # The window left open takes pass two's first micro-step (whole batches: its first mark,
    # a window of two batches), then the windows fall on pass two's positions again.
    carried = [6, 0] if micro_batch is None else [6, 0, 1]
    rest = [[1, 2], [3, 4], [5, 6], [7]] if micro_batch is None else [[2, 3], [4, 5], [6, 7]]
    windows = [[0, 1], [2, 3], [4, 5], carried, *rest]
    assert step.updates == len(windows)
    expected = _reference_windows(data, windows)
    got = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()]
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a.detach(), b, rtol=1e-12, atol=1e-12)


def test_fsdp2_the_last_passs_failed_window_is_said_not_to_be_applied(process_group: None) -> None:
    """After the last pass nothing syncs a window FSDP cannot reduce by hand: the pass's end
    says so (OpenWindowWarning) and ``step.flush()`` refuses it, changing nothing; the weights
    are those of the windows before it."""
    from torch.distributed.fsdp import fully_shard

    data = _data(8)
    model = _model()
    fully_shard(model)
    step = loopkit.step(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                        accumulate=2)  # fmt: skip
    with pytest.warns(loopkit.OpenWindowWarning, match="after the last pass it is not applied"):
        for i, (x, y) in enumerate(step.iterate(data)):
            _micro_step(step, model, x, y, bad=i == 7)
    with pytest.raises(RuntimeError, match="without gradient sync"):
        step.flush()
    assert step.updates == 3 and step.micro_step == 2
    expected = _reference_windows(data, [[0, 1], [2, 3], [4, 5]])
    got = [p.full_tensor() for p in model.parameters()]
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a.detach(), b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("every", [1, 2, 3])
@pytest.mark.parametrize(
    ("where", "then"), [("handler", "check"), ("handler", "continue"), ("top", "continue")]
)
def test_a_window_whose_gradients_the_loop_drops_is_skipped_as_by_hand(
    every: int, where: str, then: str
) -> None:
    """A check after the backward fails on a window's last micro-step and the loop drops the
    gradients before loop control is asked, as a hand loop skips a bad batch:
    ``optimizer.zero_grad()`` in its handler, or (a loop that goes on at once) the legacy line
    at the top of the iteration that opens a window. That window is gone (no update, no
    refusal) and the others are the hand loop's, at their positions. (Loop control asked
    first closes the window with its backward, as documented: a zero_grad after it drops
    nothing of it.)"""
    data = _data(9)
    bad = 2 * every - 1  # the second window's last micro-step
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step = loopkit.step(model, opt, accumulate=every)
    stop = loopkit.until(step, max_updates=100)
    for i, (x, y) in enumerate(step.iterate(data)):
        if where == "top" and i % every == 0:
            opt.zero_grad()  # the hand loop's line, where its windows open
        if _checked_micro_step(step, model, x, y, bad=i == bad):
            if where == "handler":
                opt.zero_grad()
            if then == "continue":
                continue
        stop.check()
    windows = [list(range(k, min(k + every, 9))) for k in range(0, 9, every)]
    kept = [w for w in windows if bad not in w]
    assert step.updates == len(kept)
    for a, b in zip(model.parameters(), _reference_windows(data, kept), strict=True):
        torch.testing.assert_close(a.detach(), b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("how", ["one parameter", "mid-window"])
def test_gradients_dropped_in_part_are_still_refused(how: str) -> None:
    """Only a whole overdue window's gradients dropped is a skipped batch: one parameter's
    gradient dropped, or the window's earlier micro-steps' dropped with a failure in its
    middle, is still refused where the window ends (training on would silently lose them)."""
    data = _data(6)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = loopkit.step(model, opt, accumulate=2)
    bad = 1 if how == "one parameter" else 2
    with pytest.raises(RuntimeError, match="were dropped by code outside"):
        for i, (x, y) in enumerate(step.iterate(data)):
            if _checked_micro_step(step, model, x, y, bad=i == bad):
                if how == "one parameter":
                    model.bias.grad = None
                else:
                    opt.zero_grad()


def test_a_dropped_window_ends_where_loop_control_sees_it() -> None:
    """The dropped window ends with no update, as a non-finite one does: ``step.skipped``
    counts it, ``step.updated`` is False after loop control, and ``cadence(per_epoch=)``
    still fires at its points (the one on the dropped window's last batch too)."""
    data = torch.utils.data.TensorDataset(*map(torch.cat, zip(*_data(8), strict=True)))
    loader = distributed.loader(data, batch_size=4, shuffle=False, num_workers=0)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = loopkit.step(model, opt, accumulate=2)
    points = loopkit.cadence(step, per_epoch=2, loader=loader)
    fired, updated = [], []
    for epoch in range(2):
        for i, (x, y) in enumerate(step.iterate(loader)):
            if _checked_micro_step(step, model, x, y, bad=(epoch, i) == (0, 3)):
                opt.zero_grad()
            if points.due():
                fired.append((epoch, i))
            updated.append(step.updated)
    assert fired == [(0, 3), (0, 7), (1, 3), (1, 7)]
    assert step.updates == 7 and step.skipped == 1
    assert updated[3] is False and updated[1] is True


def test_a_window_whose_parameters_got_no_gradient_is_no_dropped_window() -> None:
    """A window whose loss reached none of the optimizer's parameters has no gradient to
    drop: its failed last micro-step closes it as before (an update, the scheduler steps)."""
    model = nn.ModuleDict({"a": nn.Linear(3, 1).double(), "b": nn.Linear(3, 1).double()})
    opt = torch.optim.SGD(model["a"].parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    step = loopkit.step(model, opt, scheduler=sched)
    stop = loopkit.until(step, max_updates=100)
    for i, (x, y) in enumerate(_data(4)):
        _checked_micro_step(step, model["b"] if i == 1 else model["a"], x, y, bad=i == 1)
        stop.check()
    assert step.updates == 4 and sched.last_epoch == 4 and step.skipped == 0


def test_a_scheduler_stepped_in_the_handler_that_drops_the_window_is_refused() -> None:
    """Dropping the window does not let a ``scheduler.step()`` in the same handler through."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    step = loopkit.step(model, opt, scheduler=sched)
    stop = loopkit.until(step, max_updates=100)
    with pytest.raises(RuntimeError, match=r"also stepped by your code"):
        for i, (x, y) in enumerate(_data(4)):
            if _checked_micro_step(step, model, x, y, bad=i == 1):
                opt.zero_grad()
                sched.step()
            stop.check()
