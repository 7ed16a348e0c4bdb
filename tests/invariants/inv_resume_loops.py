"""Generated legitimate resume loops: saves on an epoch's last window, the epoch's own code
after the pass, kills and a preemption signal at drawn points, several launches.

A drawn ``Plan`` is a run (epochs, batches per pass, ``accumulate``, one step or a
``loopkit.steps`` group, the loop over ``step.iterate`` or over the loader itself, the epoch
loop: ``ckpt.epochs(E)``, ``range(loader.epoch, E)``, ``stop.epochs(loader)`` or
``stop.epochs()``, in ``with until`` or not), its saves (``save()`` every N updates,
``maybe_save``, a ``loopkit.cadence`` of N updates or of every epoch driving ``save()``, in
the background or not, an epoch-end ``save()``) and the epoch's code after the pass (a
per-epoch scheduler step, an evaluation that draws random numbers and counts its runs).
``play`` runs it as a job relaunched after each interruption: a kill (an exception that
drops every object of the launch, so nothing more is written) or a SIGUSR1 caught by
``until(signals=)``; each launch builds fresh objects and calls ``ckpt.resume()``.
"""

from __future__ import annotations

import contextlib
import math
import signal
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from hypothesis import strategies as st
from torch import nn

import loopkit
from loopkit import distributed

LOOPS = ("ckpt_epochs", "range", "until_epochs", "until_self")
SAVERS = ("save", "maybe_save", "cadence", "cadence_epochs", "none")
_X = torch.randn(13, 3, generator=torch.Generator().manual_seed(0))
_Y = torch.randn(13, 1, generator=torch.Generator().manual_seed(1))


@dataclass(frozen=True)
class Kill:
    """Where a launch dies: ``window`` after update ``at``'s window (and its saves, and the
    stop's check); ``code`` in epoch ``at``'s code after its scheduler step, before its
    evaluation; ``after`` right after that code, before the epoch-end save; ``saved`` after
    it."""

    kind: str
    at: int


@dataclass(frozen=True)
class Stop:
    """SIGUSR1 raised after update ``at``'s window: ``until`` stops the launch there."""

    at: int


@dataclass(frozen=True)
class Leave:
    """The loop's own limit: ``break`` out of the pass and the epoch loop after update
    ``at``'s window (not a pass's last: its epoch's code would be skipped), then
    ``ckpt.save()`` after the loop; the next launch goes on from there."""

    at: int


@dataclass(frozen=True)
class Plan:
    epochs: int
    samples: int
    batch: int
    drop_last: bool
    accumulate: int
    group: bool  # a loopkit.steps group of two steps (two models)
    plain: bool  # `for x, y in loader:` (one step, accumulate=1), else step.iterate(loader)
    loop: str  # LOOPS
    with_until: bool  # the epoch loop inside `with until(...) as stop:`
    break_on_stop: bool  # `if stop.reason: break` right after the pass (else the epoch's code
    # runs after a stop, its epoch-end save left out: the stop may have cut the pass short)
    saver: str  # SAVERS
    every: int
    async_save: bool
    epoch_save: bool  # ckpt.save() at the end of each epoch's code
    launches: tuple[Kill | Stop | Leave, ...]  # the interruption of each launch but the last

    def updates_per_epoch(self) -> int:
        batches = self.samples // self.batch if self.drop_last else -(-self.samples // self.batch)
        return math.ceil(batches / self.accumulate)


@st.composite
def plans(draw: st.DrawFn) -> Plan:
    """A legitimate loop and its interruptions, drawn toward the epochs' last windows."""
    plain = draw(st.integers(0, 3)) == 0
    accumulate = 1 if plain else draw(st.integers(1, 3))
    epochs = draw(st.integers(2, 3))
    samples, batch = draw(st.integers(5, 13)), draw(st.integers(2, 4))
    drop_last = draw(st.booleans()) and samples % batch != 0
    # A plain loop's save() on its pass's last window is inside the pass's loop while the
    # loader's pass has not run out: every saver, as with iterate.
    saver = draw(st.sampled_from(SAVERS))
    plan = Plan(
        epochs=epochs, samples=samples, batch=batch, drop_last=drop_last, accumulate=accumulate,
        group=not plain and draw(st.booleans()), plain=plain, loop=draw(st.sampled_from(LOOPS)),
        with_until=draw(st.booleans()), break_on_stop=draw(st.booleans()), saver=saver,
        every=draw(st.integers(1, 4)), async_save=draw(st.booleans()),
        epoch_save=draw(st.booleans()), launches=(),
    )  # fmt: skip
    per_epoch = plan.updates_per_epoch()
    last_windows = [per_epoch * (e + 1) for e in range(epochs)]
    anywhere = st.integers(1, per_epoch * epochs)
    update = st.one_of(st.sampled_from(last_windows), anywhere)
    epoch = st.integers(0, epochs - 1)
    inner = [u for u in range(1, per_epoch * epochs + 1) if u not in last_windows]
    interruption = st.one_of(
        st.builds(Kill, st.just("window"), update),
        st.builds(Kill, st.sampled_from(("code", "after", "saved")), epoch),
        st.builds(Stop, update),
        *([st.builds(Leave, st.sampled_from(inner))] if inner else []),
    )
    return Plan(**{**plan.__dict__, "launches": tuple(draw(st.lists(interruption, max_size=3)))})


class Killed(Exception):
    """The job dies here (a SIGKILL): nothing of the launch is written after it."""


class EpochLog:
    """The epoch's code's own record, saved under ``extra=``: the runs of each epoch's code
    and what its evaluations drew."""

    def __init__(self) -> None:
        self.runs: dict[int, int] = {}
        self.draws: list[float] = []

    def evaluate(self, epoch: int) -> None:
        self.runs[epoch] = self.runs.get(epoch, 0) + 1
        self.draws.append(float(torch.rand(())))  # an evaluation's random numbers

    def state_dict(self) -> dict[str, Any]:
        return {"runs": dict(self.runs), "draws": list(self.draws)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.runs, self.draws = dict(state["runs"]), list(state["draws"])


class World:
    """The objects of one launch, built as the job's script builds them."""

    def __init__(self, plan: Plan, directory: Path) -> None:
        torch.manual_seed(0)
        self.plan = plan
        self.models = [
            nn.Sequential(nn.Linear(3, 4), nn.Dropout(0.25), nn.Linear(4, 1))
            for _ in range(2 if plan.group else 1)
        ]
        self.opts = [torch.optim.SGD(m.parameters(), lr=0.02, momentum=0.9) for m in self.models]
        self.sched = torch.optim.lr_scheduler.StepLR(self.opts[0], step_size=1, gamma=0.5)
        self.steps = [loopkit.step(m, o, accumulate=plan.accumulate)
                      for m, o in zip(self.models, self.opts, strict=True)]  # fmt: skip
        self.clock: Any = loopkit.steps(*self.steps) if plan.group else self.steps[0]
        self.acc: Any = self.clock if plan.group else self.steps[0].accumulator
        data = torch.utils.data.TensorDataset(_X[: plan.samples], _Y[: plan.samples])
        self.loader = distributed.loader(data, batch_size=plan.batch, drop_last=plan.drop_last,
                                         num_workers=0, seed=1)  # fmt: skip
        self.log = EpochLog()
        self.ckpt = loopkit.Checkpointer(
            directory, model=nn.ModuleList(self.models), scheduler=self.sched, step=self.clock,
            loader=self.loader, extra={"log": self.log}, keep=1000, async_save=plan.async_save,
        )  # fmt: skip
        self.cadence = None
        if plan.saver == "cadence":
            self.cadence = loopkit.cadence(self.clock, updates=plan.every, checkpointer=self.ckpt)
        elif plan.saver == "cadence_epochs":  # fires on each epoch's last window
            self.cadence = loopkit.cadence(self.clock, epochs=1, loader=self.loader,
                                           checkpointer=self.ckpt)  # fmt: skip
        counted = plan.loop in ("until_epochs", "until_self")
        self.stop = loopkit.until(self.clock, max_epochs=plan.epochs if counted else None,
                                  signals=("SIGUSR1",), check_every=1,
                                  checkpointer=self.ckpt)  # fmt: skip
        self.last = 0  # the update whose window the loop saw close last
        self.left = False  # the launch was left by the loop's own limit (Leave)

    def epoch_loop(self) -> Iterable[int]:
        plan, loop = self.plan, self.plan.loop
        if loop == "ckpt_epochs":
            return self.ckpt.epochs(plan.epochs)
        if loop == "range":
            return range(self.loader.epoch, plan.epochs)
        return self.stop.epochs(self.loader if loop == "until_epochs" else None)

    def train(self, x: torch.Tensor, y: torch.Tensor) -> None:
        for model, step in zip(self.models, self.steps, strict=True):
            with step as s:
                s.backward(nn.functional.mse_loss(model(x), y))

    def state(self) -> dict[str, Any]:
        """What must equal the uninterrupted run's, bit for bit."""
        return {
            "weights": [p.detach().clone() for m in self.models for p in m.parameters()],
            "momentum": [o.state_dict()["state"] for o in self.opts],
            "updates": self.acc.updates,
            "lr_epochs": self.sched.last_epoch,
            "runs": dict(self.log.runs),
            "draws": list(self.log.draws),
            "rng": torch.get_rng_state(),
        }


def launch(world: World, interruption: Kill | Stop | Leave | None) -> None:
    """One launch: resume, then the loop the way the docs write it, interrupted as drawn."""
    plan, ckpt, stop = world.plan, world.ckpt, world.stop
    left = False

    def kill_point(kind: str, at: int) -> None:
        if interruption == Kill(kind, at):
            raise Killed

    ckpt.resume()
    with stop if plan.with_until else contextlib.nullcontext():
        for epoch in world.epoch_loop():
            if stop.reason is not None and plan.loop == "range":
                break  # a stop ends the range loop after the stopped epoch's code
            for x, y in world.loader if plan.plain else world.clock.iterate(world.loader):
                world.train(x, y)
                if world.cadence is not None and world.cadence.due():
                    ckpt.save()
                if plan.saver == "maybe_save":
                    ckpt.maybe_save(every=plan.every)
                updates = world.acc.updates
                boundary = world.acc.settle() == 0 and updates != world.last
                if boundary:
                    world.last = updates
                    if plan.saver == "save" and updates % plan.every == 0:
                        ckpt.save()
                    if interruption == Stop(updates):
                        signal.raise_signal(signal.SIGUSR1)  # the preemption notice
                stopped = stop.check()
                if boundary:
                    kill_point("window", updates)
                    left = interruption == Leave(updates)
                if stopped or left:
                    break
            if left or (stop.reason is not None and plan.break_on_stop):
                break
            world.sched.step()  # the epoch's own code after its pass
            kill_point("code", epoch)
            world.log.evaluate(epoch)
            kill_point("after", epoch)
            if plan.epoch_save and stop.reason is None:  # (a stopped epoch may be partial)
                ckpt.save()
                kill_point("saved", epoch)
        if plan.loop == "range" and not left:
            ckpt.save_if_needed()  # the end state (epochs() writes it itself)
    if left:
        ckpt.save()  # where the loop's own limit left it, mid-pass
    world.left = left
    ckpt.wait()


def play(plan: Plan, directory: Path) -> tuple[World, list[str]]:
    """The job: a launch per drawn interruption (until one runs to the end), then one more."""
    said = []
    for interruption in plan.launches:
        world = World(plan, directory)
        try:
            launch(world, interruption)
        except Killed:
            world.ckpt.wait()  # SIGKILL after the background write (a kill mid-write: others)
            said.append(f"killed at {interruption}")
            if finished_on_disk(plan, directory):  # killed after its final save: done
                return world, said
            continue
        if world.left:  # (a Leave at an update the resumed run was past ran to the end)
            said.append(f"left at {interruption}")
            continue
        complete = world.acc.updates == plan.updates_per_epoch() * plan.epochs
        if not world.stop.preempted or (complete and len(world.log.runs) == plan.epochs):
            # (a stop on the last window that the loop let run its last epoch's code: the
            # run is complete, and its relaunch is a finished run's)
            return world, [*said, f"finished ({world.stop.reason})"]
        said.append(f"stopped at update {world.stop.stopped_at}")
    world = World(plan, directory)
    launch(world, None)
    return world, [*said, "finished"]


def newest_holds_code_left(directory: Path) -> bool:
    """Whether the newest checkpoint was saved on an epoch's last window before its code."""
    newest = sorted(directory.glob("ckpt-*.pt"))[-1]
    return bool(loopkit.load_checkpoint(newest)["loader"].get("epoch_open"))


def finished_on_disk(plan: Plan, directory: Path) -> bool:
    """Whether the newest checkpoint holds the end of the run: its last epoch and its code."""
    found = sorted(directory.glob("ckpt-*.pt"))
    loader = loopkit.load_checkpoint(found[-1])["loader"] if found else {}
    done = bool(found) and loader["position"] >= loader["batches"]
    return done and loader["next_epoch"] >= plan.epochs and not loader.get("epoch_open")
