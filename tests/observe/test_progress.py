"""step.iterate(progress=...): updates of a true total, rates and ETA, no host sync, rank zero."""

from __future__ import annotations

import contextlib
import io
import tempfile
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import ResumableLoader
from torch import nn

import loopkit
from loopkit import _ranks, distributed
from loopkit._observe._progress import ProgressDisplay, eta, rate
from loopkit._step import _feed


class _Watched:
    updates = 0


def test_the_status_line_shows_updates_epoch_rate_eta_and_metrics() -> None:
    """With a fake clock: 10 of 40 updates in 5 s -> ETA 0:00:15; tokens/s over samples/s."""
    now = [0.0]
    watched = _Watched()
    axes = {"samples": 0.0, "tokens": 0.0, "epoch": 0.0}
    display = ProgressDisplay(
        watched, lambda: dict(axes), lambda: {"loss": 0.123456}, 40, use_tqdm=False,
        file=io.StringIO(), interval=1.0, clock=lambda: now[0],
    )  # fmt: skip
    watched.updates, now[0] = 10, 5.0
    axes.update(samples=640.0, tokens=64_000.0, epoch=1.0)
    display.tick()
    assert display.lines == ["update 10/40 | epoch 1 | 12.8k tokens/s | ETA 0:00:15 | loss 0.1235"]
    now[0] = 5.5  # within the interval: nothing printed
    display.tick()
    assert len(display.lines) == 1


def test_rates_and_eta_are_pure_arithmetic() -> None:
    """rate() scales with k/M/G; eta() uses this run's pace and is None when unknown."""
    assert rate(1500, 1.0) == "1.5k" and rate(3e9, 1.5) == "2G" and rate(5, 0) == "0"
    assert eta(30, 100, 10, 20.0) == "0:01:10"
    assert eta(10, None, 0, 5.0) is None and eta(10, 100, 10, 5.0) is None


def test_tqdm_draws_the_bar_with_the_status_as_postfix() -> None:
    """The tqdm path: n advances by the updates made; the postfix holds the status."""
    out = io.StringIO()
    watched = _Watched()
    display = ProgressDisplay(
        watched, lambda: {"samples": 100.0}, dict, 8, use_tqdm=True, file=out, interval=0.0
    )
    watched.updates = 3
    display.tick()
    assert display._bar.n == 3
    display.close()
    text = out.getvalue()
    assert "3/8" in text and "samples/s" in text


@pytest.mark.parametrize("total", [None, 0])
def test_the_bar_of_an_unknown_or_empty_total_refreshes_at_the_bar_pace(total: int | None) -> None:
    """A stream with no len() (tqdm's bool() raises) or none left: the bar is built and the
    status refreshed each half second, not every ten."""
    watched, out = _Watched(), io.StringIO()
    display = ProgressDisplay(watched, dict, dict, total, use_tqdm=True, file=out)
    assert display.interval == 0.5
    watched.updates = 2
    display.close()
    assert "2update" in out.getvalue().replace(" ", "")


def test_iterate_over_a_stream_with_no_length_shows_the_bar() -> None:
    """step.iterate(generator, progress=True): the updates drawn, the loop's results kept."""
    model = nn.Linear(3, 1)
    step = loopkit.step(model, torch.optim.SGD(model.parameters(), lr=0.1), accumulate=2)
    out = io.StringIO()
    stream = (torch.randn(4, 3) for _ in range(6))
    with contextlib.redirect_stderr(out):
        for x in step.iterate(stream, progress=True):
            with step as s:
                s.backward(model(x).pow(2).mean())
    assert step.updates == 3 and "3update" in out.getvalue().replace(" ", "")


class _LenRaises(torch.utils.data.IterableDataset[torch.Tensor]):
    """Six batches whose ``__len__`` raises ``error`` (not the TypeError of no length)."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    def __iter__(self) -> Any:
        return (torch.randn(4, 3) for _ in range(6))

    def __len__(self) -> int:
        raise self.error


@pytest.mark.parametrize("error", [NotImplementedError("no length"), ValueError("negative")])
@pytest.mark.parametrize("limit", [None, 3])
def test_a_stream_totals_from_until_or_not_at_all(error: Exception, limit: int | None) -> None:
    """A stream whose len() raises (any error, as the look-ahead takes it): the plain display
    totals from until(max_updates=) or shows '?', and the loop trains as without progress."""
    model = nn.Linear(3, 1)
    step = loopkit.step(model, torch.optim.SGD(model.parameters(), lr=0.1), accumulate=2)
    out = io.StringIO()
    with contextlib.redirect_stderr(out), loopkit.until(step, max_updates=limit) as stop:
        for x in step.iterate(_LenRaises(error), progress="plain"):
            with step as s:
                s.backward(model(x).pow(2).mean())
            if stop.check():
                break
    done = 3 if limit is None else limit
    assert step.updates == done
    assert out.getvalue().splitlines()[-1].startswith(f"update {done}/{limit or '?'}")


def _passes_run(
    tmp: Path, loader: Any, save_at: int | None, resume: bool, passes: int,
    micro_batch: int | None = None, saved: bool = True,
) -> list[Any]:  # fmt: skip
    """``passes`` calls of ``step.iterate(loader)`` (accumulate=2), left at update ``save_at``
    after saving (resumed into fresh objects with ``resume``): after each micro-step the
    update and the epoch axis, after each pass the display's last line."""
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = loopkit.step(model, opt, accumulate=2, micro_batch=micro_batch)
    owner = loader if isinstance(loader, ResumableLoader) and saved else None
    ckpt = loopkit.Checkpointer(tmp, model=model, optimizer=opt, step=step, loader=owner)
    if resume:
        ckpt.resume()
    seen: list[Any] = []
    for _ in range(passes):
        out = io.StringIO()
        with contextlib.redirect_stderr(out):
            for x in step.iterate(loader, progress="plain"):
                with step as s:
                    s.backward(model(x).pow(2).mean())
                seen.append((step.updates, step.seen.axes()["epoch"]))
                if step.updates == save_at and step.accumulator.micro_step == 0:
                    ckpt.save()
                    return seen
        if out.getvalue():  # (a pass resumed after its last batch hands out none)
            seen.append(out.getvalue().splitlines()[-1].split(" | ")[0])
    return seen


@pytest.mark.parametrize("micro_batch", [None, 2])
@pytest.mark.parametrize("save_at", [1, 2, 3, 5])
def test_a_stateful_loader_resumed_part_way_keeps_its_epoch_and_total(
    tmp_path: Path, save_at: int, micro_batch: int | None
) -> None:
    """A stateful loader that is not a distributed.loader (as torchdata's): saved part-way
    through a pass (or after its last batch: update 3), resumed by fresh objects, the log's
    epoch axis and the display's totals are the uninterrupted run's."""
    run = partial(_passes_run, micro_batch=micro_batch)
    whole = run(tmp_path / "whole", ResumableLoader(), None, False, 3)
    first = run(tmp_path / "run", ResumableLoader(), save_at, False, 3)
    rest = run(tmp_path / "run", ResumableLoader(), None, True, 3 - (save_at - 1) // 3)
    steps = [r for r in first + rest if isinstance(r, tuple)]
    assert steps == [r for r in whole if isinstance(r, tuple)]
    lines = ["update 3/3", "update 6/6", "update 9/9"]  # the passes the resumed run ends
    assert [r for r in whole if isinstance(r, str)] == lines
    assert [r for r in rest if isinstance(r, str)] == lines[len(lines) - (3 - save_at // 3) :]


@pytest.mark.parametrize("kind", ["list", "a stateful loader no Checkpointer saves"])
def test_a_list_resumed_part_way_starts_that_epoch_again(kind: str) -> None:
    """A list, or a stateful loader left out of the Checkpointer (its pass starts again):
    saved at update 2 of epoch 1, then saved at update 4 in the restarted epoch 1 and resumed
    again: every micro-step of it says epoch 1, the next pass epoch 2, and the display totals
    the restarted pass in full."""

    def data() -> Any:
        return ResumableLoader().data if kind == "list" else ResumableLoader()

    run = partial(_passes_run, saved=False)
    with tempfile.TemporaryDirectory() as tmp:
        first = run(Path(tmp), data(), 5, False, 3)
        again = run(Path(tmp), data(), 7, True, 3)
        last = run(Path(tmp), data(), None, True, 2)
    epoch_0 = [(0, 0), (1, 0), (1, 0), (2, 0), (2, 0), (3, 0), "update 3/3"]
    assert first == [*epoch_0, (3, 1), (4, 1), (4, 1), (5, 1)]
    assert again == [(5, 1), (6, 1), (6, 1), (7, 1)]
    restarted = [(7, 1), (8, 1), (8, 1), (9, 1), (9, 1), (10, 1), "update 10/10"]
    assert last == [
        *restarted,
        (10, 2),
        (11, 2),
        (11, 2),
        (12, 2),
        (12, 2),
        (13, 2),
        "update 13/13",
    ]


@pytest.mark.parametrize(
    ("where", "epoch"),
    [("in the loop", 0), ("after the break", 1), ("after the break, failing", 1),
     ("in the loop, failing", 1), ("by the user, in the loop", 1)],
)  # fmt: skip
def test_a_pass_left_by_break_is_over_unless_saved_while_it_ran(
    tmp_path: Path, where: str, epoch: int
) -> None:
    """A loop that leaves its pass by ``break`` (steps per epoch): its next ``iterate`` is a
    new pass (epoch 1). Saved inside the loop (a stop, a preemption) and resumed, the pass
    goes on (epoch 0); saved after the ``break``, the resumed run's next pass is new, as
    the uninterrupted run's. A failed resume, or the user's own
    ``step.load_state_dict(step.state_dict())`` mid-pass, changes neither."""
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = loopkit.step(model, opt, accumulate=2)
    ckpt = loopkit.Checkpointer(tmp_path, model=model, optimizer=opt, step=step)
    data = ResumableLoader().data
    for x in step.iterate(data):
        with step as s:
            s.backward(model(x).pow(2).mean())
        if step.updates == 1:
            if where.startswith("in the loop"):
                ckpt.save()
            elif where.startswith("by the user"):
                step.load_state_dict(step.state_dict())
            break
    if where.startswith("after the break"):
        ckpt.save()
    if where.endswith("failing"):

        def refuse(*args: Any) -> None:
            raise RuntimeError("this module's own loading hook refuses")

        model.register_load_state_dict_pre_hook(refuse)
        with pytest.raises(loopkit.CheckpointError, match="refuses"):
            ckpt.resume()
    elif not where.startswith("by the user"):
        fresh = nn.Linear(3, 1)
        fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.1)
        step = loopkit.step(fresh, fresh_opt, accumulate=2)
        loopkit.Checkpointer(tmp_path, model=fresh, optimizer=fresh_opt, step=step).resume()
    next(iter(step.iterate(data)))
    assert step.seen.axes()["epoch"] == epoch


def _loop(tmp: Path, progress: str, max_updates: int | None = None,
          resume: bool = False) -> tuple[loopkit.step, list[int]]:  # fmt: skip
    """10 batches of 4, accumulate=3 (4 updates per epoch); records samples seen per step."""
    torch.manual_seed(0)
    model = nn.Linear(5, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = loopkit.step(model, opt, accumulate=3, log=loopkit.detach_logging(every=2, sink=None))
    data = torch.utils.data.TensorDataset(torch.randn(40, 5), torch.randn(40, 1))
    loader = distributed.loader(data, batch_size=4, seed=0, num_workers=0)
    ckpt = loopkit.Checkpointer(tmp, model=model, optimizer=opt, step=step, loader=loader)
    stop = loopkit.until(step, max_epochs=2, max_updates=max_updates, checkpointer=ckpt)
    if resume:
        ckpt.resume()
    seen = []
    for _ in stop.epochs(loader):
        for x, y in step.iterate(loader, progress=progress):
            with step as s:
                s.backward(nn.functional.mse_loss(model(x), y))
            seen.append(step.seen.samples)
            if stop.check():
                break
    return step, seen


def test_iterate_counts_what_the_loop_got_despite_the_lookahead(tmp_path: Path) -> None:
    """Inside the loop, samples seen are the batches handed out so far, not those fetched."""
    step, seen = _loop(tmp_path, "plain")
    assert seen == [4 * (i + 1) for i in range(20)] and step.updates == 8


def test_the_plain_display_totals_from_until_and_ends_on_the_last_update(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """max_epochs=2 x 4 updates per epoch: the last line of each pass says 4/8, then 8/8."""
    _loop(tmp_path, "plain")
    lines = capsys.readouterr().err.splitlines()
    assert [line.split(" | ")[:2] for line in lines] == [
        ["update 4/8", "epoch 0"],
        ["update 8/8", "epoch 1"],
    ]
    assert all("samples/s" in line and "loss" in line for line in lines)


def test_a_resumed_run_starts_the_display_where_it_stopped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Stopped at update 5 (mid epoch 1) and resumed: the display counts on to 8/8."""
    step, _ = _loop(tmp_path, "plain", max_updates=5)
    assert step.updates == 5
    capsys.readouterr()
    step, seen = _loop(tmp_path, "plain", resume=True)
    assert step.updates == 8 and seen[0] == 4 * 14  # stopped after batch 13; 14 comes next
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("update 8/8 | epoch 1")


def test_the_total_is_the_first_limit_until_reaches(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """max_epochs=2 (8 updates) beside max_updates=100 or 5: the run ends at 8 or 5, and
    says so."""
    for limit, end in ((100, 8), (5, 5)):
        step, _ = _loop(tmp_path / str(limit), "plain", max_updates=limit)
        lines = capsys.readouterr().err.splitlines()
        assert step.updates == end
        shown = [line.split(" | ")[0] for line in lines]
        assert shown == [f"update 4/{end}", f"update {end}/{end}"]


def _resumable(tmp: Path, clock: list[float], stop_at: int | None, resume: bool) -> None:
    """No until: 2 passes of 11 batches (accumulate=2: 6 updates each), the clock 2 s per
    micro-step; saved and left at update ``stop_at``, or resumed from that save."""
    torch.manual_seed(0)
    model = nn.Linear(5, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = loopkit.step(model, opt, accumulate=2)
    data = torch.utils.data.TensorDataset(torch.randn(44, 5), torch.randn(44, 1))
    loader = distributed.loader(data, batch_size=4, seed=0, num_workers=0)
    ckpt = loopkit.Checkpointer(tmp, model=model, optimizer=opt, step=step, loader=loader)
    if resume:
        ckpt.resume()
    while loader.epoch < 2:
        for x, y in step.iterate(loader, progress="plain"):
            with step as s:
                s.backward(nn.functional.mse_loss(model(x), y))
            clock[0] += 2.0
            if step.updates == stop_at and step.updated:
                ckpt.save()
                return


def test_a_pass_resumed_mid_way_shows_the_uninterrupted_total_and_an_eta_since_the_resume(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Resumed at update 8 (4 batches into pass 1), no until: the total is the uninterrupted
    run's 12, and the ETA is the 2 updates left at the 2 updates per 10 s since the resume."""
    clock = [0.0]
    monkeypatch.setattr(_feed, "ProgressDisplay", partial(ProgressDisplay, clock=lambda: clock[0]))
    _resumable(tmp_path / "whole", clock, None, False)
    whole = [line.split(" | ")[:2] for line in capsys.readouterr().err.splitlines()]
    assert whole == [
        ["update 2/6", "epoch 0"], ["update 5/6", "epoch 0"], ["update 6/6", "epoch 0"],
        ["update 8/12", "epoch 1"], ["update 11/12", "epoch 1"], ["update 12/12", "epoch 1"],
    ]  # fmt: skip
    _resumable(tmp_path / "parts", clock, 8, False)
    capsys.readouterr()
    clock[0] = 1000.0  # the time before the resume is none of the resumed run's pace
    _resumable(tmp_path / "parts", clock, None, True)
    first, last = capsys.readouterr().err.splitlines()
    # 5 micro-steps (10 s) after the resume: updates 9 and 10 made, 2 left -> 10 s.
    assert first.startswith("update 10/12 | epoch 1 |") and "ETA 0:00:10" in first
    assert last.startswith("update 12/12 | epoch 1 |") and "ETA 0:00:00" in last


def test_the_display_makes_no_host_sync(tmp_path: Path) -> None:
    """The same loop counts the same host syncs with the display on and off."""
    counts = []
    for progress in ("plain", ""):
        with loopkit.count_host_syncs() as syncs:
            _loop(tmp_path / (progress or "off"), progress or False)  # type: ignore[arg-type]
        counts.append(syncs.count)
    assert counts[0] == counts[1]


def test_only_rank_zero_shows_progress(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """On another rank nothing is printed (and nothing is built)."""
    monkeypatch.setattr(_ranks, "world", lambda group=None: (1, 2))
    torch.manual_seed(0)
    model = nn.Linear(5, 1)
    step = loopkit.step(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for x in step.iterate(torch.randn(6, 2, 5), progress="plain"):
        with step as s:
            s.backward(model(x).sum())
    assert capsys.readouterr().err == "" and step.seen.samples == 24  # 6 batches of 2, x2 ranks


def test_bad_progress_and_tokens_are_refused_first() -> None:
    """progress= and tokens= are checked before anything is iterated."""
    model = nn.Linear(5, 1)
    step = loopkit.step(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="progress must be True, False"):
        step.iterate([], progress="yes")
    with pytest.raises(TypeError, match="tokens must be a function"):
        step.iterate([], tokens=3)  # type: ignore[arg-type]
    assert step.seen.passes == 0
