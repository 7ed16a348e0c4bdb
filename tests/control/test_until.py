"""until: stops at a window boundary, alike on every rank, saving once; resumes exactly.

The 2-process cases (a SIGTERM to one rank only, clocks skewed per rank) are at the end.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import ROOT, deep
from torch import nn

import loopkit
from loopkit import distributed


class FakeTimer:
    """An injected clock: ``now`` seconds, moved by the test."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _step(every: int = 1) -> tuple[nn.Module, loopkit.step]:
    model = nn.Linear(3, 1)
    return model, loopkit.step(model, torch.optim.SGD(model.parameters(), lr=0.1), accumulate=every)


def _micro(model: nn.Module, step: loopkit.step) -> None:
    with step as s:
        s.backward(model(torch.ones(2, 3)).pow(2).mean())


def test_max_updates_stops_exactly_at_a_boundary() -> None:
    """Windows of 3, max_updates=4: the 12th micro-step is the first check that says stop."""
    model, step = _step(3)
    stop = loopkit.until(step, max_updates=4, signals=())
    answers = []
    for _ in range(15):
        _micro(model, step)
        answers.append(stop.check())
        if answers[-1]:
            break
    assert len(answers) == 12 and answers.count(True) == 1
    assert step.updates == 4 and step.micro_step == 0
    assert stop.reason == "max_updates" and stop.stopped_at == 4 and not stop.preempted


def test_max_epochs_with_and_without_a_loader() -> None:
    """epochs() yields the loader's epochs (or counts its own) and ends at max_epochs."""
    model, step = _step(2)
    data = torch.utils.data.TensorDataset(torch.randn(6, 3))
    loader = distributed.loader(data, batch_size=2, num_workers=0)
    stop = loopkit.until(step, max_epochs=3, signals=())
    seen = []
    for epoch in stop.epochs(loader):
        seen.append(epoch)
        for _ in step.iterate(loader):
            _micro(model, step)
            assert not stop.check()
    assert seen == [0, 1, 2] and stop.reason == "max_epochs" and step.updates == 6
    counting = loopkit.until(max_epochs=2, signals=())
    assert list(counting.epochs()) == [0, 1]


def test_a_signal_stops_at_the_next_checked_boundary_and_the_process_lives() -> None:
    """SIGTERM mid-window with check_every=2: the process is not killed; stop at update 4."""
    before = signal.getsignal(signal.SIGTERM)
    model, step = _step(2)
    with loopkit.until(step, check_every=2) as stop:
        assert signal.getsignal(signal.SIGTERM) != before
        for i in range(1, 20):
            _micro(model, step)
            if i == 5:  # update 2 is done, the third window is half way
                os.kill(os.getpid(), signal.SIGTERM)
            if stop.check():
                break
        assert (stop.reason, stop.stopped_at, step.updates, i) == ("SIGTERM", 4, 4, 8)
        assert stop.preempted
    assert signal.getsignal(signal.SIGTERM) == before


def test_exit_status_says_preempted_only_where_the_scheduler_reads_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """75 after a signal's stop, 0 after a limit's or before any stop; under a torchelastic
    agent (which restarts or fails on a non-zero status) 0, with a warning saying why."""
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    model, step = _step()
    limited = loopkit.until(step, max_updates=1, signals=())
    assert limited.exit_status == 0
    _micro(model, step)
    assert limited.check() and limited.exit_status == 0
    model, step = _step()
    with loopkit.until(step, check_every=1, signals=("SIGUSR1",)) as stop:
        os.kill(os.getpid(), signal.SIGUSR1)
        _micro(model, step)
        assert stop.check() and stop.reason == "SIGUSR1"
    assert stop.exit_status == 75
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    with pytest.warns(UserWarning, match="0 under torchrun.*launch script"):
        assert stop.exit_status == 0


def test_exit_status_is_0_under_accelerate_launch_without_torchrun(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`accelerate launch` with one process (no torchrun: TORCHELASTIC_RUN_ID unset, but
    ACCELERATE_MIXED_PRECISION set as in every mode) fails on 75: exit_status 0, warning why."""
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")
    model, step = _step()
    with loopkit.until(step, check_every=1, signals=("SIGUSR1",)) as stop:
        os.kill(os.getpid(), signal.SIGUSR1)
        _micro(model, step)
        assert stop.check() and stop.preempted
    with pytest.warns(UserWarning, match="0 under accelerate launch.*trapped"):
        assert stop.exit_status == 0
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION")
    assert stop.exit_status == 75


def test_max_time_counts_from_the_injected_clock() -> None:
    """max_time 1 minute, checked every 3 updates: the first check past 60 s stops."""
    model, step = _step()
    timer = FakeTimer(100.0)
    stop = loopkit.until(step, max_time="00:01:00", check_every=3, signals=(), timer=timer)
    while not stop.check():
        _micro(model, step)
        timer.now += 13  # 13 s per update: past 60 s at update 5, checked at update 6
    assert (stop.reason, step.updates) == ("max_time", 6)


def test_an_early_stop_decision_stops_at_that_boundary() -> None:
    """until(early_stop=es): the boundary after es decided is the one that stops."""
    model, step = _step()
    es = loopkit.early_stop(step, "loss", patience=1)
    stop = loopkit.until(step, early_stop=es, signals=(), check_every=100)
    for value in [1.0, 2.0, 0.5]:
        _micro(model, step)
        es.observe({"loss": value})
        if stop.check():
            break
    assert (stop.reason, step.updates) == ("early_stop", 2)


def test_a_legacy_loop_counts_its_checks() -> None:
    """Without a loopkit step each check() follows one optimizer step."""
    stop = loopkit.until(max_updates=3, signals=())
    assert [stop.check() for _ in range(4)] == [False, False, True, True]


def _train(directory: Path, signal_at: tuple[int, int] | None) -> dict[str, Any]:
    """3 epochs of 10 batches, windows of 3, dropout, a per-epoch scheduler, an EMA of the
    weights (saved with the step), a Checkpointer.

    ``signal_at=(epoch, batch)``: SIGTERM to this process after that batch.
    """
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), nn.Dropout(0.2), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    average = loopkit.ema(model, decay=0.8, warmup=True)
    step = loopkit.step(model, opt, accumulate=3, ema=average)
    data = torch.utils.data.TensorDataset(torch.randn(20, 3), torch.randn(20, 1))
    loader = distributed.loader(data, batch_size=2, num_workers=0, seed=3)
    ckpt = loopkit.Checkpointer(directory, model=model, optimizer=opt, scheduler=sched,
                                step=step, loader=loader)  # fmt: skip
    stop = loopkit.until(step, max_epochs=3, check_every=1, checkpointer=ckpt)
    ckpt.resume()
    for epoch in stop.epochs(loader):
        for x, y in step.iterate(loader):
            with step as s:
                s.backward(nn.functional.mse_loss(model(x), y))
            if (epoch, loader.position - step.accumulator.lookahead) == signal_at:
                os.kill(os.getpid(), signal.SIGTERM)
            if stop.check():
                break
        sched.step()  # the epoch's own code after its last window
    return {
        "weights": [p.detach().clone() for p in model.parameters()],
        "ema": [t.clone() for t in average.shadow] + [average.updates],
        "reason": stop.reason,
        "updates": step.updates,
        "saved": [p.name for p in ckpt.checkpoints()],
        "lr": sched.get_last_lr(),
    }


@pytest.mark.parametrize(
    ("signal_at", "stopped_at"),
    [((1, 5), 6), ((0, 10), 4)],  # mid-pass (stop after batch 6), the end of epoch 0
    ids=["mid-pass", "end-of-pass"],
)
def test_preempted_and_resumed_run_ends_bit_identical(
    tmp_path: Path, signal_at: tuple[int, int], stopped_at: int
) -> None:
    """One checkpoint at the stop's boundary, and the resumed run ends at the same weights
    and the same EMA of them, bit for bit.

    At an epoch's last window the save waits for the epoch's own code (its scheduler step).
    """
    whole = _train(tmp_path / "whole", None)
    first = _train(tmp_path / "parts", signal_at)
    assert first["reason"] == "SIGTERM" and first["updates"] == stopped_at
    assert first["saved"] == [f"ckpt-{stopped_at:010d}.pt"]
    saved = loopkit.load_checkpoint(tmp_path / "parts" / first["saved"][0])
    assert saved["scheduler"]["last_epoch"] == 1  # epoch 0's scheduler step is in it
    second = _train(tmp_path / "parts", None)
    assert second["reason"] == "max_epochs" and second["updates"] == whole["updates"] == 12
    for a, b in zip(whole["weights"], second["weights"], strict=True):
        assert torch.equal(a, b)
    assert whole["ema"][-1] == second["ema"][-1] == 12
    for a, b in zip(whole["ema"][:-1], second["ema"][:-1], strict=True):
        assert torch.equal(a, b)
    assert whole["lr"] == second["lr"]


def test_elapsed_time_is_saved_and_counts_across_resumes(tmp_path: Path) -> None:
    """40 s trained, saved; the resumed run goes on from 40 s and stops at max_time."""
    model, step = _step()
    timer = FakeTimer()
    ckpt = loopkit.Checkpointer(tmp_path, model=model, step=step)
    stop = loopkit.until(step, max_time=60, check_every=1, signals=(), timer=timer,
                         checkpointer=ckpt)  # fmt: skip
    for _ in range(4):
        _micro(model, step)
        timer.now += 10
        assert not stop.check()
    ckpt.save()
    model2, step2 = _step()
    timer2 = FakeTimer(1000.0)  # another machine's clock
    ckpt2 = loopkit.Checkpointer(tmp_path, model=model2, step=step2)
    stop2 = loopkit.until(step2, max_time=60, check_every=1, signals=(), timer=timer2,
                          checkpointer=ckpt2)  # fmt: skip
    ckpt2.resume()
    assert stop2.elapsed == 40
    while not stop2.check():
        _micro(model2, step2)
        timer2.now += 10
    assert (stop2.reason, step2.updates) == ("max_time", 6)


@pytest.mark.parametrize(
    ("kwargs", "error", "says"),
    [
        ({"signals": ("SIGNOPE",)}, ValueError, "unknown signal"),
        ({"signals": ("SIGKILL",)}, ValueError, "cannot be caught"),
        ({"signals": "SIGTERM"}, TypeError, "a sequence"),
        ({"check_every": 0}, ValueError, "check_every"),
        ({"max_updates": 0}, ValueError, "max_updates"),
        ({"max_time": "1:2"}, ValueError, "HH:MM:SS"),
        ({"early_stop": 3}, TypeError, "early_stop"),
        ({"timer": 5}, TypeError, "timer"),
    ],
)
def test_bad_arguments_change_nothing(
    kwargs: dict[str, Any], error: type[Exception], says: str
) -> None:
    """A bad argument is named, and no signal handler is installed."""
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(error, match=says):
        loopkit.until(**kwargs)
    assert signal.getsignal(signal.SIGTERM) == before


def test_refused_after_a_resume_and_outside_the_main_thread(tmp_path: Path) -> None:
    """Joining a Checkpointer that already resumed, or handlers off the main thread: refused."""
    before = signal.getsignal(signal.SIGTERM)
    model, step = _step()
    ckpt = loopkit.Checkpointer(tmp_path, model=model, step=step)
    ckpt.resume()
    with pytest.raises(RuntimeError, match="before the first resume"):
        loopkit.until(step, checkpointer=ckpt)
    assert signal.getsignal(signal.SIGTERM) == before and "until" not in ckpt.pieces
    errors: list[BaseException] = []

    def build() -> None:
        try:
            loopkit.until(step)
        except BaseException as err:
            errors.append(err)

    t = threading.Thread(target=build)
    t.start()
    t.join()
    assert len(errors) == 1 and "main thread" in str(errors[0])


def test_a_failed_loop_puts_the_handlers_back_without_saving(tmp_path: Path) -> None:
    """An exception out of `with until(...)`: handlers restored, no checkpoint written."""
    before = signal.getsignal(signal.SIGTERM)
    model, step = _step()
    ckpt = loopkit.Checkpointer(tmp_path, model=model, step=step)
    stop = loopkit.until(step, checkpointer=ckpt, max_updates=1)
    with pytest.raises(ZeroDivisionError), stop:
        _micro(model, step)
        assert stop.check()  # saves at the stop
        1 / 0  # noqa: B018
    assert signal.getsignal(signal.SIGTERM) == before
    assert [p.name for p in ckpt.checkpoints()] == ["ckpt-0000000001.pt"]


# -- 2 processes: SIGTERM sent from outside to one worker of a training run ------------------

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
EXAMPLE = ["examples/train_resumable.py", "--save-every", "3", "--check-every", "2", "--ema",
           "0.9"]  # fmt: skip


def _worker_of_rank(torchrun_pid: int, rank: int) -> int:
    """The pid of torchrun's worker with RANK=rank (read from /proc)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            env = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == torchrun_pid and f"RANK={rank}".encode() in env:
            return int(entry.name)
    raise AssertionError(f"no worker of rank {rank} under torchrun {torchrun_pid}")


@deep
def test_sigterm_to_rank_1_only_stops_both_saves_once_exits_0_and_resumes_exactly(
    tmp_path: Path,
) -> None:
    """examples/train_resumable.py under torchrun; SIGTERM to the rank-1 process alone.

    Both ranks stop at the same update, the newest checkpoint is at that update, torchrun
    exits 0; run again, it resumes and ends at an uninterrupted run's weights and EMA of
    them (validated through swapped()), bit for bit.
    """
    from helpers import launch_env

    whole, parts = tmp_path / "whole.pt", tmp_path / "parts.pt"
    done = subprocess.run(
        [*TORCHRUN, *EXAMPLE, "--dir", str(tmp_path / "a"), "--out", str(whole)],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=launch_env(),
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    run = [*TORCHRUN, *EXAMPLE, "--dir", str(tmp_path / "b"), "--out", str(parts)]
    proc = subprocess.Popen(
        [*run, "--slow", "0.05"],
        cwd=ROOT, env=launch_env(), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout or []), daemon=True)
    reader.start()
    deadline = time.monotonic() + 120
    while not any(line.startswith("saved") for line in lines):  # training is under way
        assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)
        time.sleep(0.02)
    os.kill(_worker_of_rank(proc.pid, 1), signal.SIGTERM)
    assert proc.wait(timeout=120) == 0
    reader.join(timeout=10)
    # The example prints once per job (rank zero); both ranks exited 0, so both stopped.
    stops = re.findall(r"preempted at update (\d+) by SIGTERM", "".join(lines))
    assert len(stops) == 1, "".join(lines)
    update = int(stops[0])
    assert update < 24 and update % 2 == 0  # before the end, at a check (every 2 updates)
    newest = sorted(p.name for p in (tmp_path / "b").glob("ckpt-*.pt"))[-1]
    assert newest == f"ckpt-{update:010d}.pt"
    assert not parts.exists()
    resumed = subprocess.run(run, cwd=ROOT, capture_output=True, text=True, timeout=300,
                             env=launch_env())  # fmt: skip
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    assert f"resumed from ckpt-{update:010d}.pt at update {update}" in resumed.stdout
    a, b = torch.load(whole, weights_only=True), torch.load(parts, weights_only=True)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(k.startswith("ema.") for k in a)


def test_a_run_resumed_past_max_time_stops_at_its_first_boundary(tmp_path: Path) -> None:
    """Requeued after a max_time stop: the first boundary pools the clocks and stops."""
    model, step = _step()
    timer = FakeTimer()
    ckpt = loopkit.Checkpointer(tmp_path, model=model, step=step)
    stop = loopkit.until(step, max_time=30, check_every=5, signals=(), timer=timer,
                         checkpointer=ckpt)  # fmt: skip
    while not stop.check():
        _micro(model, step)
        timer.now += 10
    assert (stop.reason, step.updates) == ("max_time", 5)
    model2, step2 = _step()
    ckpt2 = loopkit.Checkpointer(tmp_path, model=model2, step=step2)
    stop2 = loopkit.until(step2, max_time=30, check_every=5, signals=(), timer=FakeTimer(),
                          checkpointer=ckpt2)  # fmt: skip
    ckpt2.resume()
    _micro(model2, step2)
    assert stop2.check() and (stop2.reason, step2.updates) == ("max_time", 6)
    model3, step3 = _step()
    ckpt3 = loopkit.Checkpointer(tmp_path, model=model3, step=step3)
    stop3 = loopkit.until(step3, max_time=30, check_every=5, signals=(), timer=FakeTimer(),
                          checkpointer=ckpt3)  # fmt: skip
    ckpt3.resume()
    assert list(stop3.epochs()) == [] and stop3.reason == "max_time"  # before any training
    assert step3.updates == 6 and ckpt3.checkpoints()[-1].name == "ckpt-0000000006.pt"


def test_leaving_epochs_early_puts_the_handlers_back() -> None:
    """A break out of the epoch loop (or an exception in it): the SIGTERM handler goes back."""
    before = signal.getsignal(signal.SIGTERM)
    stop = loopkit.until(max_epochs=5)
    for epoch in stop.epochs():
        assert signal.getsignal(signal.SIGTERM) != before
        if epoch == 1:
            break
    assert signal.getsignal(signal.SIGTERM) == before


def test_a_stop_in_a_loop_without_a_step_saves_once(tmp_path: Path) -> None:
    """No step=: the stop's checkpoint is written at the stop, not again when epochs() ends."""
    model = nn.Linear(3, 1)
    ckpt = loopkit.Checkpointer(tmp_path, model=model, keep=5)
    stop = loopkit.until(max_updates=2, signals=(), checkpointer=ckpt)
    for _ in stop.epochs():
        while not stop.check():
            pass
        break
    assert [p.name for p in ckpt.checkpoints()] == ["ckpt-0000000001.pt"]
    for _ in loopkit.until(max_epochs=1, signals=(), checkpointer=loopkit.Checkpointer(
            tmp_path / "b", model=model, keep=5)).epochs():  # fmt: skip
        pass
    assert [p.name for p in (tmp_path / "b").glob("ckpt-*.pt")] == ["ckpt-0000000001.pt"]


def test_epochs_of_a_loader_the_checkpointer_does_not_save_is_refused(tmp_path: Path) -> None:
    """epochs(loader) with a Checkpointer built without that loader: a resume would restart."""
    model, step = _step()
    data = torch.utils.data.TensorDataset(torch.randn(6, 3))
    loader = distributed.loader(data, batch_size=2, num_workers=0)
    ckpt = loopkit.Checkpointer(tmp_path, model=model, step=step)
    stop = loopkit.until(step, max_epochs=1, signals=(), checkpointer=ckpt)
    with pytest.raises(ValueError, match=r"Checkpointer\(loader=\.\.\.\) too"):
        stop.epochs(loader)


def test_an_exception_in_the_epoch_loop_saves_nothing(tmp_path: Path) -> None:
    """A stop on a pass's last window is saved at once, before the epoch's code (the file
    says that code is still to run); if that code raises, the half-done epoch is not saved
    (the handlers still go back)."""
    before = signal.getsignal(signal.SIGTERM)
    model, step = _step(2)
    data = torch.utils.data.TensorDataset(torch.randn(4, 3))
    loader = distributed.loader(data, batch_size=1, num_workers=0)
    ckpt = loopkit.Checkpointer(tmp_path, model=model, step=step, loader=loader)
    stop = loopkit.until(step, max_updates=2, checkpointer=ckpt)
    with pytest.raises(ZeroDivisionError):
        for _ in stop.epochs(loader):
            for _ in step.iterate(loader):
                _micro(model, step)
                if stop.check():
                    break
            1 / 0  # noqa: B018  # the epoch's own code fails
    (stop_save,) = ckpt.checkpoints()
    assert loopkit.load_checkpoint(stop_save)["loader"]["epoch_open"] is True
    assert signal.getsignal(signal.SIGTERM) == before
