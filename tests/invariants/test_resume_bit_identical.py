"""Invariant 2, resume: a stopped-and-resumed run ends bit-identical to an uninterrupted one.

A run (``World``) is built from a drawn scenario: one ``loopkit.step``, a ``steps`` group
of two members, or a GAN-shaped group (the generator trained through the critic with
``frozen=``), schedulers per member, ``accumulate``, ``micro_batch=`` (with an
out-of-memory error at a drawn batch, redone in halved chunks), a precision, models with
dropout, python/numpy randomness in the loop, a ``distributed.loader`` (0 or 1 worker,
shuffled or not, over an augmenting data set or over a ``loopkit.preload`` cache with an
augmenting ``collate_fn``), ``detach_logging`` into a ``CSVSink`` (saved with the step, or
under ``extra=``; flushing every 1 to 3 calls, so checkpoints fall anywhere between
flushes), ``until`` (``max_epochs``/``max_updates``, a ``check_every``), ``early_stop`` fed
by ``evaluate`` at a ``cadence`` (of the members' EMA through ``swapped()`` when they keep
one or several), and a Checkpointer saving every few updates. Optimizers: AdamW, SGD with
momentum over two param groups, SGD without, Adagrad; each member's step compiled
(``compile_optimizer=``) or not, the same in every segment (a compiled update differs from an
eager one in the last bits), possibly with a parameter that first gets a gradient mid-run.
The epoch's own code after its pass (a per-epoch scheduler given as ``scheduler=``, an
evaluation's random draws, a count of its runs under ``extra=``) runs inside
``for epoch in stop.epochs(loader)``, and ``save()`` may fall on a pass's last window, inside
the loop over ``step.iterate``: every N updates, or at a ``cadence`` of every epoch; a
``save()`` right after ``maybe_save`` re-saves the same update; saves in the background
(``async_save=True``). The interrupted run stops at a drawn point (SIGUSR1 caught by
``until``, a ``max_updates`` stop, an abrupt crash that drops the objects after the last
checkpoint, in a window, in the epoch's code or right after it), possibly twice; each resume
builds fresh objects and calls ``ckpt.resume()``. A drawn background save finds the disk
full: the loop must raise it (naming the checkpoint and ``ENOSPC``) at the latest where
loopkit next waits for it (the next save, the stop's, the end's), with nothing written
after it and the checkpoints before it on disk as they were; the process dies there, and
the run resumed from what is on disk ends as the others.

Compared bit for bit at the end: every parameter, the optimizers' states, the schedulers'
states and lr, the EMAs (averages, buffers, counters), the counters (updates, skipped, the
group's windows), the python/numpy/torch random states, the updates at which the cadence
fired, the tracker's CSV (every row, after the killed runs' rows and the replays), and the
newest checkpoint's content (the loader's place and generator, every piece) but its save
count and wall-clock time, and the runs of each epoch's code. A drawn "alternate" run
compiles its models in place (``distributed.wrap(compile=)``) in segments 0 and 2 and runs
segment 1 eagerly: a compiled
run's checkpoint resumes into an eager one and back, bit for bit. A resume whose
configuration changed (accumulate, precision, members, schedulers, an EMA, batch size; the
loader's seed or shuffle when it stopped mid-pass: at a pass's boundary another order may
start) is refused with
``CheckpointError`` before anything loads: every object and random state as it was."""

from __future__ import annotations

import contextlib
import math
import os
import random
import signal
import tempfile
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch._dynamo
from hypothesis import example, given
from hypothesis import strategies as st
from inv_budget import DEEP, prop
from inv_full_disk import FullDisk, exit_reports
from torch import nn

import loopkit
from loopkit import distributed

Spec = dict[str, Any]
D_IN, D_OUT = 4, 3
# distributed.wrap(compile=) with dynamo's eager backend: dynamo's graphs run op by op, so a
# compiled segment computes the eager bits and the resume is compared bit for bit.
COMPILED = {"backend": "eager"}


class Killed(Exception):
    """The process dies here: nothing after the last checkpoint survives."""


class Augmented(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Fixed samples plus random augmentation from torch, numpy and python in ``__getitem__``."""

    def __init__(self, n: int, noisy: bool) -> None:
        g = torch.Generator().manual_seed(n)
        self.x, self.y = torch.randn(n, D_IN, generator=g), torch.randn(n, D_OUT, generator=g)
        self.noisy = noisy

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.noisy:
            return self.x[i], self.y[i]
        jitter = 0.01 * (torch.rand(D_IN) + float(np.random.rand()) + random.random())
        return self.x[i] + jitter, self.y[i]


def noisy_collate(items: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """A preloaded batch's augmentation, drawn under the batch's RNG key."""
    x, y = items
    return x + 0.01 * torch.rand_like(x), y


def squared_error(model: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
    x, y = batch
    return {"loss": (model(x) - y).pow(2).mean(dim=1)}


def _model(k: int) -> nn.Module:
    torch.manual_seed(100 + k)
    return nn.Sequential(nn.Linear(D_IN, 8), nn.Dropout(0.2), nn.Tanh(), nn.Linear(8, D_OUT))


def _generator() -> nn.Module:
    torch.manual_seed(99)
    return nn.Sequential(nn.Linear(D_IN, D_IN), nn.Tanh())


def _optimizer(kind: str, model: nn.Module) -> torch.optim.Optimizer:
    """AdamW; SGD with momentum, its first parameter in a group of its own lr; SGD; Adagrad."""
    if kind == "sgd_momentum":
        params = list(model.parameters())
        groups = [{"params": params[:1]}, {"params": params[1:], "lr": 0.02}]
        return torch.optim.SGD(groups, lr=0.01, momentum=0.9)
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.02)
    if kind == "adagrad":
        return torch.optim.Adagrad(model.parameters(), lr=0.05)
    return torch.optim.AdamW(model.parameters(), lr=0.01)


class EpochLog:
    """The epoch's code's record, saved under ``extra=``: its runs per epoch, its evaluation's
    random draws (torch, numpy, python)."""

    def __init__(self) -> None:
        self.runs: dict[int, int] = {}
        self.draws: list[float] = []

    def evaluate(self, epoch: int) -> None:
        self.runs[epoch] = self.runs.get(epoch, 0) + 1
        self.draws += [float(torch.rand(())), float(np.random.rand()), random.random()]

    def state_dict(self) -> dict[str, Any]:
        return {"runs": dict(self.runs), "draws": list(self.draws)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.runs, self.draws = dict(state["runs"]), list(state["draws"])


def _averages(model: nn.Module, kind: object) -> Any:
    """None, one EMA (every= 1 or 2), or two decays as a list."""
    if kind is None:
        return None
    if kind == "two":
        return [loopkit.ema(model, decay=0.9, warmup=True), loopkit.ema(model, decay=0.5, every=2)]
    return loopkit.ema(model, decay=0.9, warmup=True, every=int(kind))  # type: ignore[call-overload]


class World:
    """Every object of the run, built fresh as a (re)started script builds them."""

    def __init__(
        self,
        spec: Spec,
        root: Path,
        change: str | None = None,
        compiled: bool = False,
        disk: FullDisk | None = None,
    ) -> None:
        spec = changed(spec, change)
        self.disk = disk
        self.spec = spec
        torch.manual_seed(0)
        random.seed(0)
        np.random.seed(0)
        n = spec["samples"]
        dataset: Any = Augmented(n, noisy=spec["source"] == "tensors")
        collate = None
        if spec["source"] == "preload":
            dataset = loopkit.preload(Augmented(n, noisy=False), root / "cache", key=f"inv{n}")
            collate = noisy_collate
        self.loader = distributed.loader(
            dataset, batch_size=spec["batch_size"], shuffle=spec["shuffle"],
            seed=spec["loader_seed"], num_workers=spec["workers"], collate_fn=collate,
        )  # fmt: skip
        val = Augmented(5, noisy=False)
        self.val_loader = distributed.loader(val, batch_size=2, shuffle=False, num_workers=0)
        n_members = 1 if spec["shape"] == "step" else 2
        gan = spec["shape"] == "gan"  # models[1] is a generator trained through models[0]
        self.models = [_model(0), _generator()] if gan else [_model(k) for k in range(n_members)]
        if spec.get("late") is not None:  # gets its first gradient at window spec["late"]
            self.models[0].late = nn.Parameter(torch.zeros(D_OUT))
        if compiled:  # compiled in place: the checkpoint must not depend on it
            torch._dynamo.reset()
            for m in self.models:
                distributed.wrap(m, compile=COMPILED)
        self.opts = [_optimizer(spec.get("optimizer", "adamw"), m) for m in self.models]
        compile_opt = spec.get("compile_optimizer") or (False,) * len(self.models)
        self.scheds = [
            torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.7)
            if spec["scheduler"]
            else None
            for o in self.opts
        ]
        # EMAs per member (every= 1 or 2, or two decays), saved with the step; validated
        # through swapped().
        self.averages = [_averages(m, spec.get("ema")) for m in self.models]
        # A tracker writing CSV rows as it flushes: rows a killed run wrote stay on disk.
        self.csv = root / "metrics.csv"
        log_every, log_where = spec["log"] or (None, None)
        self.sink = loopkit.CSVSink(self.csv)
        log = loopkit.detach_logging(every=log_every, sink=[self.sink]) if log_every else None
        self.log = log
        self.steps = [
            loopkit.step(
                m, o, precision=spec["precision"], accumulate=spec["every"], scheduler=s,
                log=log if k == 0 else None, skip_nonfinite=True, ema=self.averages[k],
                micro_batch=spec.get("micro_batch"), frozen=[self.models[0]] if gan and k else (),
                compile_optimizer=COMPILED if compile_opt[k] else False,
            )
            for k, (m, o, s) in enumerate(zip(self.models, self.opts, self.scheds, strict=True))
        ]  # fmt: skip
        extra: dict[str, Any] = {"log": log} if log is not None and log_where == "extra" else {}
        # The epoch's code after its pass: a per-epoch scheduler (the Checkpointer's
        # scheduler=; the members' own schedulers are saved with the step) and an evaluation.
        self.epoch_sched: Any = None
        self.epoch_log = EpochLog()
        if spec.get("epoch_code"):
            self.epoch_sched = torch.optim.lr_scheduler.ExponentialLR(self.opts[0], gamma=0.8)
            extra["epoch_log"] = self.epoch_log
        if change == "members":  # the same models, one member less in the group
            self.clock: Any = loopkit.steps(self.steps[0])
        elif spec["shape"] != "step":
            self.clock = loopkit.steps(*self.steps)
        else:
            self.clock = self.steps[0]
        async_save = bool(spec.get("async_save"))
        if spec["shape"] != "step":
            self.ckpt = loopkit.Checkpointer(
                root / "ckpt", model=nn.ModuleList(self.models), step=self.clock,
                loader=self.loader, scheduler=self.epoch_sched, async_save=async_save,
                extra={**extra, **{f"opt{k}": o for k, o in enumerate(self.opts)}},
            )  # fmt: skip
        else:
            self.ckpt = loopkit.Checkpointer(
                root / "ckpt", model=self.models[0], optimizer=self.opts[0],
                scheduler=self.epoch_sched or self.scheds[0], step=self.clock,
                loader=self.loader, extra=extra, async_save=async_save,
            )  # fmt: skip
        self.early = None
        if spec["early_stop"] is not None:
            self.early = loopkit.early_stop(self.clock, "loss", patience=spec["early_stop"],
                                            min_delta=0.05)  # fmt: skip
        kind, value = spec["cadence"]
        if kind == "per_epoch":
            # A changed configuration (accumulate, batch size) may have fewer windows per pass.
            value = min(value, math.ceil(len(self.loader) / spec["every"]))
            self.cadence = loopkit.cadence(self.clock, per_epoch=value, loader=self.loader,
                                           checkpointer=self.ckpt)  # fmt: skip
        else:
            # checkpointer=: the update it last fired at goes on after a resume
            self.cadence = loopkit.cadence(self.clock, updates=value, checkpointer=self.ckpt)
        # save() at the end of every pass (its last window), on a cadence of its own.
        self.save_cadence = None
        if spec.get("saves") == ("cadence", 1):
            self.save_cadence = loopkit.cadence(self.clock, epochs=1, loader=self.loader,
                                                checkpointer=self.ckpt, name="saving")  # fmt: skip
        self.fired: list[tuple[int, int]] = []  # (update count, windows closed) at each fire
        self.resumed_at = 0
        self.seen = 0  # the windows closed at the last boundary
        self.seen_at_resume = 0
        self.warned: str | None = None

    def until(self, max_updates: int | None) -> loopkit.until:
        spec = self.spec
        return loopkit.until(
            self.clock, max_epochs=spec["epochs"], max_updates=max_updates,
            signals=("SIGUSR1",), check_every=spec["check_every"], early_stop=self.early,
            checkpointer=self.ckpt,
        )  # fmt: skip

    def micro_steps(self, batch: Any) -> None:
        x, y = batch
        noise = random.random() + float(np.random.rand())  # the loop's own randomness
        # (pass, batch) of this micro-step: an inf loss there makes its window skipped.
        clock = self.clock if isinstance(self.clock, loopkit.steps) else self.steps[0].accumulator
        here = [self.loader.epoch - 1, self.loader.position - clock.lookahead - 1]
        if here == list(self.spec["inf_at"] or ()):
            noise = float("inf")
        # An out-of-memory error at a drawn batch, in chunks over half the drawn size: the
        # window is redone in halved chunks (and the chunk size stays halved).
        oom = here == list(self.spec.get("oom_at") or ()) and len(x) > self.spec["micro_batch"] // 2
        # A parameter of the first model that gets its first gradient at a drawn window: the
        # optimizer creates its state there (a compiled step runs that update eagerly).
        late: Any = 0.0
        if self.spec.get("late") is not None and self.windows() >= self.spec["late"]:
            late = self.models[0].late
        if self.spec["shape"] == "gan":
            critic, generator = self.models
            with self.steps[0] as st_:
                real = nn.functional.mse_loss(critic(x).float() + late, y)
                fake = critic(generator(x).detach()).float().pow(2).mean()
                st_.backward((real + 0.1 * fake) * (1 + 1e-3 * noise))
            with self.steps[1] as st_:
                st_.backward(-critic(generator(x)).float().mean() * 0.1)
            return
        for m, s in zip(self.models, self.steps, strict=True):
            with s as st_:
                if oom:
                    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1 GiB")
                out = m(x) + (late if m is self.models[0] else 0.0)
                st_.backward(nn.functional.mse_loss(out.float(), y) * (1 + 1e-3 * noise))

    def segment(self, event: tuple[str, int] | None, max_updates: int | None) -> str:
        """Run (or resume) until the end, a stop, or ``event`` kills it: (kind, micro-step),
        or ("code"/"after", epoch) in that epoch's code or right after it. How it ended:
        "ended" (the end or a stop), "killed", or "failed" (a full disk's error raised).
        ``self.warned``: a ResumeWarning ("a finished run ... trains nothing") given to a
        launch that trained after all (a finished run's relaunch may run the code left of
        an epoch saved on its last window: that is no training)."""
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("ignore")
            warnings.simplefilter("always", loopkit.ResumeWarning)
            ended = self._segment(event, max_updates)
        told = [str(w.message) for w in said if issubclass(w.category, loopkit.ResumeWarning)]
        if told and self.windows() != self.seen_at_resume:
            self.warned = told[0]
        return ended

    def _segment(self, event: tuple[str, int] | None, max_updates: int | None) -> str:
        if event is not None and event[0] == "max_updates":
            max_updates = min(event[1], max_updates or event[1])
        stop = self.until(max_updates)
        handler = signal.getsignal(signal.SIGUSR1)
        # The windows closed at the checkpoint resumed from (-1: none yet, the run starts over).
        self.resumed_at = self.windows() if self.ckpt.resume() is not None else -1
        self.seen = self.windows()
        self.seen_at_resume = self.seen
        micro = 0
        epochs = stop.epochs(self.loader)
        try:
            for epoch in epochs:
                # Whether the pass's loop ran to its last window: a resumed epoch saved on it
                # before its code has no batch left.
                to_the_end = True
                for batch in self.clock.iterate(self.loader):
                    to_the_end = False
                    self.micro_steps(batch)
                    micro += 1
                    if event == ("signal", micro):
                        os.kill(os.getpid(), signal.SIGUSR1)
                    self.validate()
                    # Saved after the boundary's validation, so that a resume from it does
                    # not skip that validation (which no later boundary repeats).
                    saved = self.ckpt.maybe_save(every=self.spec["save_every"])
                    self.saves(saved)
                    if event == ("crash", micro):
                        raise Killed
                    if stop.check():
                        to_the_end = self.ckpt.ends_pass()
                        break
                # A stop that cut the pass short leaves its epoch's code out; one on its last
                # window runs it (its checkpoint says it is to run: a resume from it runs it).
                if stop.reason is not None and not to_the_end:
                    break
                self.epoch_code(epoch, event)
        except Killed:
            epochs.close()  # the handlers go back; nothing is saved
            return "killed"
        except RuntimeError as err:
            disk = self.disk
            if disk is None or disk.failed is None or disk.reported:
                raise
            disk.reported = True  # the process dies of it: nothing more is saved
            disk.found += disk.problems(err)
            epochs.close()
            signal.signal(signal.SIGUSR1, handler)
            return "failed"
        return "ended"

    def validate(self) -> None:
        """The cadence's validation (of the slow EMA if any), fed to early_stop."""
        if self.cadence.due():
            self.fired.append((self.clock.updates, self.windows()))
            average = self.averages[0]
            if isinstance(average, list):
                average = average[0]  # the slow one of two decays
            with average.swapped() if average else contextlib.nullcontext():
                metrics = loopkit.evaluate(self.models[0], self.val_loader, squared_error)
            if self.early is not None:
                self.early.observe(metrics)

    def saves(self, saved: Path | None) -> None:
        """The loop's own save() at a boundary (a window closed, skipped or not): right after
        maybe_save's at the same update, every N updates, or at the save cadence."""
        boundary = False
        if self.ckpt.clock is not None and self.ckpt.clock.settle() == 0:
            # (A group counts a window as its last batch begins: its boundary is settle's.)
            windows = self.windows()
            boundary, self.seen = windows != self.seen, windows
        saves = self.spec.get("saves")
        if saved is not None and self.spec.get("resave"):
            self.ckpt.save()  # the same update again
        on_cadence = self.save_cadence is not None and self.save_cadence.due()
        every_n = boundary and saves is not None and saves[0] == "every"
        if on_cadence or (every_n and self.clock.updates % saves[1] == 0):
            self.ckpt.save()

    def epoch_code(self, epoch: int, event: tuple[str, int] | None) -> None:
        """The epoch's code after its pass: the per-epoch scheduler, an evaluation, an
        epoch-end save() (``"save"``)."""
        if self.epoch_sched is None:
            return
        self.epoch_sched.step()
        if event == ("code", epoch):
            raise Killed
        self.epoch_log.evaluate(epoch)
        if self.spec["epoch_code"] == "save":
            self.ckpt.save()  # the epoch's end: a relaunch that ran the code left is not idle
        if event == ("after", epoch):
            raise Killed

    def exit(self) -> bool:
        """The process exits: the interpreter waits for the background save in flight (a
        killed one is taken to die after it: a kill mid-write is test_checkpointer_crash's);
        whether a failed one was reported there (the process exits with status 1)."""
        try:
            self.ckpt.wait()
        except RuntimeError as err:
            disk = self.disk
            if disk is None or disk.failed is None or disk.reported:
                raise
            disk.reported = True
            disk.found += disk.problems(err)
            return True
        return False

    def end(self, final: bool) -> None:
        """After ``exit``: the CSV file closed (a killed run's unflushed rows are lost: only
        the script's end flushes them), the loader's workers shut down."""
        if final and self.log is not None:
            self.log.close()  # the script's end: the last rows
        self.sink.close()
        self.close()

    def last_checkpoint(self) -> dict[str, Any]:
        """The newest checkpoint's content, less what differs between runs by design.

        ``saves`` counts the writes (a stop writes one more) and ``until.elapsed`` is
        wall-clock time; everything else (model, optimizer, step, loader place and
        generator, RNG states, early_stop's counters) must be the same.
        """
        found = self.ckpt.checkpoints()
        if not found:
            return {}
        state = loopkit.load_checkpoint(found[-1])
        state.pop("saves", None)
        if self.spec["workers"]:
            # The generator draws only the workers' base seed, once per persistent worker
            # set: a resumed run starts new workers, so it draws one more. Batches do not
            # depend on it (each is reseeded from its key; test_loader_coverage checks it).
            state["loader"].pop("generator", None)
        if isinstance(state.get("until"), dict):
            state["until"].pop("elapsed", None)
        return _without_run_ids(state)

    def windows(self) -> int:
        """Windows closed so far, skipped ones included (the update count repeats on a skip)."""
        if isinstance(self.clock, loopkit.steps):
            return int(self.clock.updates)
        return int(self.clock.updates + self.clock.skipped)

    def close(self) -> None:
        """Shut the loader's persistent workers down, as the process's exit would."""
        self.loader.loader._iterator = None  # its __del__ stops the workers

    def state(self) -> dict[str, Any]:
        """Everything that must be bit-identical after a resume."""
        return {
            "params": [p.detach().clone() for m in self.models for p in m.parameters()],
            "optimizers": [o.state_dict() for o in self.opts],
            "schedulers": [s.state_dict() for s in self.scheds if s is not None],
            "lr": [o.param_groups[0]["lr"] for o in self.opts],
            "counters": [(s.updates, s.skipped) for s in self.steps],
            "group": getattr(self.clock, "updates", None),
            "ema": [a.snapshot() for a in _flat(self.averages)],
            "epoch_code": (self.epoch_log.state_dict(), getattr(self.epoch_sched, "last_epoch", 0)),
            "rng": (random.getstate(), np.random.get_state()[1].tolist(), torch.get_rng_state()),
        }


def _flat(averages: list[Any]) -> list[loopkit.ema]:
    """Every member's EMAs (none, one, or a list of decays), in order."""
    return [a for av in averages if av is not None for a in (av if isinstance(av, list) else [av])]


def _without_run_ids(state: Any) -> Any:
    """A checkpoint's state less its trackers' run ids (a run's own directory, by design)."""
    if isinstance(state, dict):
        return {k: _without_run_ids(v) for k, v in state.items() if k != "run_id"}
    if isinstance(state, list):
        return [_without_run_ids(v) for v in state]
    return state


def changed(spec: Spec, change: str | None) -> Spec:
    """``spec`` with one configuration entry changed (``members`` is applied by World)."""
    spec = dict(spec)
    if change == "accumulate":
        spec["every"] += 1
    elif change == "precision":
        spec["precision"] = {"fp32": "bf16", "bf16": "fp16", "fp16": "fp32"}[spec["precision"]]
    elif change == "seed":
        spec["loader_seed"] += 1
    elif change == "shuffle":
        spec["shuffle"] = not spec["shuffle"]
    elif change == "batch_size":
        spec["batch_size"] += 1
    elif change == "scheduler":
        spec["scheduler"] = not spec["scheduler"]
    elif change == "ema":
        spec["ema"] = {None: 1, 1: None, 2: None, "two": 1}[spec.get("ema")]
    return spec


def equal(a: Any, b: Any, where: str = "state") -> list[str]:
    """Where ``a`` and ``b`` differ, bit for bit (tensors by torch.equal)."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b):
            return []
        gap = (a.double() - b.double()).abs().max().item() if a.shape == b.shape else "shape"
        return [f"{where}: differs ({gap})"]
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{where}: keys {sorted(map(str, a))} != {sorted(map(str, b))}"]
        return [d for k in a for d in equal(a[k], b[k], f"{where}.{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{where}: {len(a)} items != {len(b)}"]
        return [
            d
            for i, (x, y) in enumerate(zip(a, b, strict=True))
            for d in equal(x, y, f"{where}[{i}]")
        ]
    return [] if a == b else [f"{where}: {a!r} != {b!r}"]


@st.composite
def runs(draw: Any) -> Spec:
    """A run's configuration, and where to interrupt it."""
    samples = draw(st.integers(5, 14))
    batch_size = draw(st.integers(1, 4))
    every = draw(st.integers(1, 3))
    batches = -(-samples // batch_size)
    windows = -(-batches // every)
    cadence = draw(st.sampled_from(["updates", "per_epoch"]))
    value = (
        draw(st.integers(1, 3)) if cadence == "updates" else draw(st.integers(1, min(2, windows)))
    )
    epochs = draw(st.integers(1, 3))
    max_updates = draw(st.none() | st.integers(1, windows * epochs))
    micro_total = batches * epochs
    event = st.tuples(
        st.sampled_from(["signal", "crash", "max_updates"]), st.integers(1, micro_total)
    )
    shape = draw(st.sampled_from(["step", "step", "steps", "gan"]))
    micro_batch = draw(st.none() | st.integers(1, 3)) if shape != "gan" else None
    oom = shape == "step" and micro_batch is not None and micro_batch >= 2
    epoch_code = draw(st.sampled_from([None, None, "code", "save"]))
    if epoch_code:  # killed in an epoch's code, or right after it
        event = event | st.tuples(st.sampled_from(["code", "after"]), st.integers(0, epochs - 1))
    # save() every N updates (N = the windows of a pass: on every pass's last window), or at
    # a cadence of every epoch (on every pass's last window too).
    every_n = st.tuples(st.just("every"), st.sampled_from(sorted({2, windows})))
    async_save = draw(st.booleans())
    members = 1 if shape == "step" else 2
    # Compiled optimizer steps cost a compilation per optimizer and launch: drawn in deep
    # runs; CI runs the examples below.
    compile_optimizer = st.tuples(*[st.booleans()] * members) if DEEP else st.nothing()
    return {
        "shape": shape,
        "micro_batch": micro_batch,
        "oom_at": draw(
            st.none() | st.tuples(st.integers(0, epochs - 1), st.integers(0, batches - 1))
        )
        if oom
        else None,
        "every": every,
        "precision": draw(st.sampled_from(["fp32", "fp32", "bf16", "fp16"])),
        "samples": samples,
        "batch_size": batch_size,
        "shuffle": draw(st.booleans()),
        "loader_seed": draw(st.integers(0, 5)),
        "workers": draw(st.sampled_from([0, 0, 0, 1])),
        "source": draw(st.sampled_from(["tensors", "tensors", "preload"])),
        "scheduler": draw(st.booleans()),
        "ema": draw(st.sampled_from([None, 1, 2, "two"])),
        "log": draw(st.none() | st.tuples(st.integers(1, 3), st.sampled_from(["step", "extra"]))),
        "early_stop": draw(st.none() | st.integers(1, 2)),
        "cadence": (cadence, value),
        "epochs": epochs,
        "max_updates": max_updates,
        "check_every": draw(st.integers(1, 3)),
        "save_every": draw(st.integers(1, 3)),
        "events": draw(st.lists(event, min_size=1, max_size=2)),
        "inf_at": draw(
            st.none() | st.tuples(st.integers(0, epochs - 1), st.integers(0, batches - 1))
        ),
        "compiled": draw(st.sampled_from([None] * 5 + ["alternate"])),
        "optimizer": draw(st.sampled_from(["adamw", "adamw", "sgd_momentum", "sgd", "adagrad"])),
        "compile_optimizer": draw(st.none() | compile_optimizer),
        "late": draw(st.none() | st.integers(1, windows * epochs)),
        "epoch_code": epoch_code,
        "saves": draw(st.none() | st.none() | every_n | st.just(("cadence", 1))),
        "resave": draw(st.sampled_from([False, False, True])),
        "async_save": async_save,
        "fail_save": draw(st.none() | st.integers(1, 4)) if async_save else None,
    }


def _run(
    spec: Spec,
    root: Path,
    events: list[tuple[str, int]],
    disk: FullDisk | None = None,
    found: list[str] | None = None,
) -> tuple[World, list[tuple[int, int]]]:
    """The run with ``events`` (each ends a segment; the next one resumes with fresh objects);
    a segment that ``disk``'s failed save ends is one more. What goes wrong on the way (a
    false ResumeWarning, a failed save never reported) is added to ``found``."""
    found = [] if found is None else found
    fired: list[tuple[int, int]] = []
    plan: list[tuple[str, int] | None] = [*events, None]
    segment = 0
    while True:
        # "alternate": segments 0 and 2 run compiled, 1 eager (a compiled run's checkpoint
        # resumed eagerly, and back); the uninterrupted run is one compiled segment.
        compiled = spec.get("compiled") == "alternate" and segment % 2 == 0
        world = World(spec, root, compiled=compiled, disk=disk)
        ended = world.segment(plan[segment], spec["max_updates"])
        if world.warned is not None:
            found.append(f"launch {segment} trained on after {world.warned!r}")
        if ended == "ended" and disk is not None and disk.pending() and not exit_reports(world):
            # No loopkit call waited for the failed save since: the exit must report it.
            found.append(f"the failed save of {disk.failed} is never reported")
        failed = world.exit() or ended == "failed"
        if failed and segment == len(plan) - 1:
            plan.append(None)  # relaunched after the failure
        # The fires after the checkpoint resumed from were lost with the process; a fire at
        # its boundary happened before its save (the loop validates, then saves).
        fired = [f for f in fired if f[1] <= world.resumed_at] + world.fired
        segment += 1
        world.end(final=segment == len(plan))
        if segment == len(plan):
            return world, fired


def _case(**changes: Any) -> Spec:
    """A plain run (one step, 3 passes of 4 windows, saved every update), ``changes`` made."""
    plain: Spec = {
        "shape": "step", "every": 1, "precision": "fp32", "samples": 8, "batch_size": 2,
        "shuffle": False, "loader_seed": 0, "workers": 0, "source": "tensors", "scheduler": False,
        "log": None, "early_stop": None, "cadence": ("updates", 1), "epochs": 3,
        "micro_batch": None, "oom_at": None, "ema": None, "max_updates": None, "check_every": 1,
        "save_every": 1, "events": [], "inf_at": None, "compiled": None, "optimizer": "adamw",
        "compile_optimizer": None, "late": None, "epoch_code": None, "saves": None,
        "resave": False, "async_save": False, "fail_save": None,
    }  # fmt: skip
    return {**plain, **changes}


@prop(ci=12, shrink=False)  # each example trains 2-4 runs: report it unshrunk
@given(runs())
# A resume right before a skipped window: the cadence must not fire again at update 1.
@example(
    {"shape": "step", "every": 1, "precision": "fp32", "samples": 8, "batch_size": 2,
     "shuffle": False, "loader_seed": 0, "workers": 0, "source": "tensors", "scheduler": False,
     "log": None, "early_stop": None, "cadence": ("updates", 1), "epochs": 1,
     "micro_batch": None, "oom_at": None, "ema": None,
     "max_updates": None, "check_every": 1, "save_every": 1, "events": [("max_updates", 1)],
     "inf_at": (0, 1)}
)  # fmt: skip
# A compiled run stopped twice: resumed eagerly from its checkpoint, then compiled again.
@example(
    {"shape": "step", "every": 2, "precision": "bf16", "samples": 9, "batch_size": 2,
     "shuffle": True, "loader_seed": 1, "workers": 0, "source": "tensors", "scheduler": True,
     "log": (2, "step"), "early_stop": None, "cadence": ("updates", 2), "epochs": 2,
     "micro_batch": None, "oom_at": None, "ema": 1, "compiled": "alternate",
     "max_updates": None, "check_every": 1, "save_every": 1,
     "events": [("signal", 3), ("crash", 7)], "inf_at": None}
)  # fmt: skip
# A GAN's compiled generator step: killed right after update 1 (the next is the first
# compiled one) and later, each update compiled or eager as in the uninterrupted run.
@example(_case(shape="gan", compile_optimizer=(False, True), epochs=2,
               events=[("crash", 1), ("crash", 6)]))  # fmt: skip
# save() on each pass's last window (every 4 updates), killed in epoch 0's code after it,
# then right after epoch 1's code, in the background; a first gradient mid-run.
@example(_case(epoch_code="code", saves=("every", 4), async_save=True, optimizer="sgd_momentum",
               late=6, events=[("code", 0), ("after", 1)]))  # fmt: skip
# A group's cadence save() on the pass's last window, killed in that epoch's code; the
# relaunch runs it, then its epoch-end save() (which must not warn "a finished run").
@example(_case(shape="steps", epoch_code="save", saves=("cadence", 1), optimizer="adagrad",
               events=[("code", 0)]))  # fmt: skip
# A signal on the pass's last window: the loop runs the epoch's code and its save() after it.
@example(_case(epoch_code="save", events=[("signal", 4)], epochs=2))
# save() right after maybe_save, at the same update; a skipped window then maybe_save
# again at that update number; killed after them.
@example(_case(resave=True, inf_at=(0, 2), async_save=True, epochs=1, events=[("crash", 3)]))
# The run's final save fails in the background (nothing waits for it in the loop): the exit
# reports it; the relaunch resumes from the checkpoint before it.
@example(_case(async_save=True, fail_save=2, save_every=2, epochs=1,
               events=[("max_updates", 2)]))  # fmt: skip
def test_a_resumed_run_ends_bit_identical_to_an_uninterrupted_one(spec: Spec) -> None:
    """Weights, optimizer/scheduler states, counters, loader place, RNG states: bit for bit."""
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        whole, fired_whole = _run(spec, Path(tmp) / "whole", [])
        events = [tuple(e) for e in spec["events"]]
        problems: list[str] = []
        with FullDisk(spec.get("fail_save")) as disk:
            resumed, fired = _run(spec, Path(tmp) / "resumed", events, disk, problems)  # type: ignore[arg-type]
        problems += disk.found
        problems += equal(whole.state(), resumed.state())
        problems += equal(whole.last_checkpoint(), resumed.last_checkpoint(), "checkpoint")
        if fired != fired_whole:
            said = f"cadence fired at (update, windows) {fired}, uninterrupted {fired_whole}"
            problems.append(said)
        if spec["log"] is not None:
            rows, rows_whole = (w.csv.read_text().splitlines() for w in (resumed, whole))
            if rows != rows_whole:
                problems.append(f"the tracker's CSV: {rows[:8]} != uninterrupted {rows_whole[:8]}")
        assert not problems, "; ".join(problems[:6])


CHANGES = ["accumulate", "precision", "seed", "shuffle", "batch_size", "members", "scheduler",
           "ema"]  # fmt: skip


@prop(ci=40, shrink=False)
@given(runs(), st.sampled_from(CHANGES))
def test_a_resume_with_another_configuration_is_refused_before_anything_loads(
    spec: Spec, change: str
) -> None:
    """CheckpointError from ckpt.resume(); every object and RNG state as it was before."""
    if change == "members" and spec["shape"] != "steps":
        change = "accumulate"
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        root = Path(tmp)
        saver = World(spec, root)
        saver.segment(("max_updates", 1), None)  # a checkpoint at the first update
        saver.exit()
        assert saver.ckpt.checkpoints()
        saved = loopkit.load_checkpoint(saver.ckpt.checkpoints()[-1])["loader"]
        world = World(spec, root, change)
        # until adds its piece before resume, as a script builds it
        with world.until(None):
            before = world.state()
            loader_state = world.loader.state_dict()
            if change in ("seed", "shuffle") and saved["position"] in (0, saved["batches"]):
                # At a pass's boundary another order can start: the next pass is drawn anew.
                world.ckpt.resume()
                world.end(final=False)
                saver.end(final=False)
                return
            with pytest.raises(loopkit.CheckpointError):
                world.ckpt.resume()
        problems = equal(before, world.state()) + equal(loader_state, world.loader.state_dict())
        saver.end(final=False)
        world.end(final=False)
        assert not problems, "; ".join(problems[:6])
