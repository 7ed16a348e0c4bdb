"""A job that ran outside loopkit (model.pt, opt.pt, ema_*.pt, an update count) continues
under it as if loopkit had run it all along: ckpt.adopt and ema.adopt."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

import loopkit
from loopkit import distributed

DATA = torch.utils.data.TensorDataset(
    torch.randn(24, 3, generator=torch.Generator().manual_seed(0)),
    torch.randn(24, 1, generator=torch.Generator().manual_seed(1)),
)
BATCHES = 6  # per epoch
JOB = 2 * BATCHES  # the updates the job made by hand (two epochs)
TOTAL = 4 * BATCHES - 3  # until(max_updates=): the run ends in its fourth epoch
DECAY = 0.8


class Parts:
    """The run's objects, built the same way by the job, the reference and the adopter."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(3, 8), nn.BatchNorm1d(8), nn.Tanh(),
                                   nn.Linear(8, 1))  # fmt: skip
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=0.05)
        self.sched = torch.optim.lr_scheduler.CosineAnnealingLR(self.opt, T_max=TOTAL)
        self.loader = distributed.loader(DATA, batch_size=4, num_workers=0, seed=3)
        self.lrs: list[float] = []  # the lr after each update

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.model(x), y)


def _under_loopkit(parts: Parts, directory: Path, average: loopkit.ema) -> tuple[
    loopkit.step, loopkit.Checkpointer, loopkit.until
]:  # fmt: skip
    step = loopkit.step(parts.model, parts.opt, scheduler=parts.sched, ema=average)
    ckpt = loopkit.Checkpointer(directory, model=parts.model, step=step, loader=parts.loader)
    stop = loopkit.until(step, max_updates=TOTAL, signals=(), checkpointer=ckpt)
    return step, ckpt, stop


def _train(parts: Parts, step: loopkit.step, stop: loopkit.until) -> int:
    """The loop under loopkit; the updates it made."""
    start = step.updates
    for _ in stop.epochs(parts.loader):
        for x, y in step.iterate(parts.loader):
            with step as s:
                s.backward(parts.loss(x, y))
            parts.lrs.append(parts.opt.param_groups[0]["lr"])
            if stop.check():
                break
    return step.updates - start


def _job_by_hand(directory: Path, save_scheduler: bool) -> list[float]:
    """JOB updates of a hand-written loop that keeps its own EMA and saves its own files."""
    parts = Parts()
    shadow = {n: p.detach().clone() for n, p in parts.model.named_parameters()}
    updates = 0
    for _ in range(JOB // BATCHES):
        for x, y in parts.loader:
            parts.opt.zero_grad()
            parts.loss(x, y).backward()
            parts.opt.step()
            parts.sched.step()
            updates += 1
            parts.lrs.append(parts.opt.param_groups[0]["lr"])
            for name, p in parts.model.named_parameters():
                shadow[name].lerp_(p.detach(), 1 - DECAY)
    ema_state = {**parts.model.state_dict(), **shadow}  # the average as a model state_dict
    directory.mkdir()
    torch.save(parts.model.state_dict(), directory / "model.pt")
    torch.save(parts.opt.state_dict(), directory / "opt.pt")
    torch.save(ema_state, directory / f"ema_{DECAY}.pt")
    torch.save({"step": updates}, directory / "progress.pt")
    if save_scheduler:
        torch.save(parts.sched.state_dict(), directory / "sched.pt")
    return parts.lrs


@pytest.mark.parametrize("save_scheduler", [False, True])
def test_an_adopted_job_ends_as_the_uninterrupted_run(tmp_path: Path, save_scheduler: bool) -> None:
    """Weights, optimizer, EMA, each update's lr and until's count equal the whole run's."""
    ref = Parts()
    ref_average = loopkit.ema(ref.model, decay=DECAY)
    ref_step, _, ref_stop = _under_loopkit(ref, tmp_path / "ref", ref_average)
    assert _train(ref, ref_step, ref_stop) == TOTAL

    job_lrs = _job_by_hand(tmp_path / "job", save_scheduler)
    job = tmp_path / "job"
    parts = Parts()
    average = loopkit.ema(parts.model, decay=DECAY)
    step, ckpt, stop = _under_loopkit(parts, tmp_path / "run", average)
    assert ckpt.resume() is None  # the first launch under loopkit: adopt the job's files
    parts.model.load_state_dict(torch.load(job / "model.pt", weights_only=True))
    parts.opt.load_state_dict(torch.load(job / "opt.pt", weights_only=True))
    if save_scheduler:
        parts.sched.load_state_dict(torch.load(job / "sched.pt", weights_only=True))
    done = torch.load(job / "progress.pt", weights_only=True)["step"]
    average.adopt(torch.load(job / f"ema_{DECAY}.pt", weights_only=True), updates=done)
    ckpt.adopt(updates=done, epoch=done // BATCHES)
    assert parts.opt.param_groups[0]["lr"] == job_lrs[-1]

    assert _train(parts, step, stop) == TOTAL - JOB  # until counts the adopted updates
    assert step.updates == TOTAL and stop.reason == "max_updates"
    assert job_lrs + parts.lrs == ref.lrs
    for a, b in zip(parts.model.state_dict().values(), ref.model.state_dict().values(),
                    strict=True):  # fmt: skip
        assert torch.equal(a, b)
    for a, b in zip(average.shadow + average.buffers, ref_average.shadow + ref_average.buffers,
                    strict=True):  # fmt: skip
        assert torch.equal(a, b)
    assert (average.updates, average.seen) == (ref_average.updates, ref_average.seen)
    mine, theirs = parts.opt.state_dict()["state"], ref.opt.state_dict()["state"]
    assert all(torch.equal(mine[i]["exp_avg"], theirs[i]["exp_avg"]) for i in theirs)
    # The run goes on in loopkit's own checkpoints, numbered by the whole run's updates.
    assert ckpt.checkpoints()[-1].name == f"ckpt-{TOTAL:010d}.pt"


def test_adopt_refuses_a_moved_scheduler_and_changes_nothing(tmp_path: Path) -> None:
    """A scheduler neither fresh nor at the job's update is refused before any change."""
    parts = Parts()
    step = loopkit.step(parts.model, parts.opt, scheduler=parts.sched)
    ckpt = loopkit.Checkpointer(tmp_path, model=parts.model, step=step, loader=parts.loader)
    parts.sched.step()
    parts.sched.step()
    with pytest.raises(ValueError, match="scheduler is at step 2"):
        ckpt.adopt(updates=7, epoch=1)
    assert (step.updates, parts.loader.epoch, parts.sched.last_epoch) == (0, 0, 2)


def test_adopt_after_training_is_refused(tmp_path: Path) -> None:
    """adopt() belongs before the loop: a step that already updated is refused."""
    parts = Parts()
    step = loopkit.step(parts.model, parts.opt)
    ckpt = loopkit.Checkpointer(tmp_path, model=parts.model, step=step)
    with step as s:
        s.backward(parts.loss(*DATA[:4]))
    with pytest.raises(RuntimeError, match="call it before the training loop"):
        ckpt.adopt(updates=3)
    assert step.updates == 1


def _raise_past(limit: int) -> object:
    def factor(step: int) -> float:
        if step > limit:
            raise ValueError(f"this schedule ends at step {limit}")
        return 1.0 - step / (limit + 1)

    return factor


SCHEDULES = {
    "OneCycleLR": lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=10),
    "LambdaLR": lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, _raise_past(7)),
}


@pytest.mark.parametrize("kind", list(SCHEDULES))
def test_a_scheduler_that_cannot_reach_the_job_s_update_changes_nothing(
    tmp_path: Path, kind: str
) -> None:
    """Stepped past its end it raises half-way: loopkit's refusal, then every state as before."""
    parts = Parts()
    sched = SCHEDULES[kind](parts.opt)
    step = loopkit.step(parts.model, parts.opt, scheduler=sched)
    ckpt = loopkit.Checkpointer(tmp_path, model=parts.model, step=step, loader=parts.loader)
    assert ckpt.resume() is None
    before = (copy.deepcopy(parts.opt.state_dict()), copy.deepcopy(sched.state_dict()))
    with pytest.raises(ValueError, match=rf"adopt\(updates=50\) steps the step's {kind} 50 times"):
        ckpt.adopt(updates=50, epoch=2)
    assert (step.updates, parts.loader.epoch, ckpt.last_saved_update) == (0, 0, None)
    assert parts.opt.state_dict() == before[0] and sched.state_dict() == before[1]
    # Refused, then adopted within the schedule: the lrs of a scheduler stepped 5 times.
    ckpt.adopt(updates=5)
    ref = Parts()
    ref_sched = SCHEDULES[kind](ref.opt)
    for _ in range(5):
        ref.opt.step()
        ref_sched.step()
    assert step.updates == 5 and sched.state_dict() == ref_sched.state_dict()
    assert parts.opt.param_groups[0]["lr"] == ref.opt.param_groups[0]["lr"]
