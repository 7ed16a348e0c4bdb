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
one or several), and a Checkpointer saving every few updates. The interrupted run stops
at a drawn point (SIGUSR1 caught by ``until``, a ``max_updates`` stop, or an abrupt crash
that drops the objects after the last checkpoint), possibly twice; each resume builds fresh
objects and calls ``ckpt.resume()``.

Compared bit for bit at the end: every parameter, the optimizers' states, the schedulers'
states and lr, the EMAs (averages, buffers, counters), the counters (updates, skipped, the
group's windows), the python/numpy/torch random states, the updates at which the cadence
fired, the tracker's CSV (every row, after the killed runs' rows and the replays), and the
newest checkpoint's content (the loader's place and generator, every piece) but its save
count and wall-clock time. A drawn "alternate" run compiles its models in place
(``distributed.wrap(compile=)``) in segments 0 and 2 and runs segment 1 eagerly: a compiled
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
from inv_budget import prop
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
        self, spec: Spec, root: Path, change: str | None = None, compiled: bool = False
    ) -> None:
        spec = changed(spec, change)
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
        if compiled:  # compiled in place: the checkpoint must not depend on it
            torch._dynamo.reset()
            for m in self.models:
                distributed.wrap(m, compile=COMPILED)
        self.opts = [torch.optim.AdamW(m.parameters(), lr=0.01) for m in self.models]
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
        log = (
            loopkit.detach_logging(every=log_every, sink=[loopkit.CSVSink(self.csv)])
            if log_every else None
        )  # fmt: skip
        self.log = log
        self.steps = [
            loopkit.step(
                m, o, precision=spec["precision"], accumulate=spec["every"], scheduler=s,
                log=log if k == 0 else None, skip_nonfinite=True, ema=self.averages[k],
                micro_batch=spec.get("micro_batch"), frozen=[self.models[0]] if gan and k else (),
            )
            for k, (m, o, s) in enumerate(zip(self.models, self.opts, self.scheds, strict=True))
        ]  # fmt: skip
        extra: dict[str, Any] = {"log": log} if log is not None and log_where == "extra" else {}
        if change == "members":  # the same models, one member less in the group
            self.clock: Any = loopkit.steps(self.steps[0])
        elif spec["shape"] != "step":
            self.clock = loopkit.steps(*self.steps)
        else:
            self.clock = self.steps[0]
        if spec["shape"] != "step":
            self.ckpt = loopkit.Checkpointer(
                root / "ckpt", model=nn.ModuleList(self.models), step=self.clock,
                loader=self.loader,
                extra={**extra, **{f"opt{k}": o for k, o in enumerate(self.opts)}},
            )  # fmt: skip
        else:
            self.ckpt = loopkit.Checkpointer(
                root / "ckpt", model=self.models[0], optimizer=self.opts[0],
                scheduler=self.scheds[0], step=self.clock, loader=self.loader, extra=extra,
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
        self.fired: list[tuple[int, int]] = []  # (update count, windows closed) at each fire
        self.resumed_at = 0

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
        if self.spec["shape"] == "gan":
            critic, generator = self.models
            with self.steps[0] as st_:
                real = nn.functional.mse_loss(critic(x).float(), y)
                fake = critic(generator(x).detach()).float().pow(2).mean()
                st_.backward((real + 0.1 * fake) * (1 + 1e-3 * noise))
            with self.steps[1] as st_:
                st_.backward(-critic(generator(x)).float().mean() * 0.1)
            return
        for m, s in zip(self.models, self.steps, strict=True):
            with s as st_:
                if oom:
                    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1 GiB")
                out = m(x)
                st_.backward(nn.functional.mse_loss(out.float(), y) * (1 + 1e-3 * noise))

    def segment(self, event: tuple[str, int] | None, max_updates: int | None) -> loopkit.until:
        """Run (or resume) until the end, a stop, or ``event`` = (kind, micro-step) kills it."""
        if event is not None and event[0] == "max_updates":
            max_updates = min(event[1], max_updates or event[1])
        stop = self.until(max_updates)
        # The windows closed at the checkpoint resumed from (-1: none yet, the run starts over).
        self.resumed_at = self.windows() if self.ckpt.resume() is not None else -1
        micro = 0
        epochs = stop.epochs(self.loader)
        try:
            for _ in epochs:
                for batch in self.clock.iterate(self.loader):
                    self.micro_steps(batch)
                    micro += 1
                    if event == ("signal", micro):
                        os.kill(os.getpid(), signal.SIGUSR1)
                    if self.cadence.due():
                        self.fired.append((self.clock.updates, self.windows()))
                        average = self.averages[0]
                        if isinstance(average, list):
                            average = average[0]  # the slow one of two decays
                        with average.swapped() if average else contextlib.nullcontext():
                            metrics = loopkit.evaluate(self.models[0], self.val_loader,
                                                       squared_error)  # fmt: skip
                        if self.early is not None:
                            self.early.observe(metrics)
                    # Saved after the boundary's validation, so that a resume from it does
                    # not skip that validation (which no later boundary repeats).
                    self.ckpt.maybe_save(every=self.spec["save_every"])
                    if event == ("crash", micro):
                        raise Killed
                    if stop.check():
                        break
        except Killed:
            epochs.close()  # the handlers go back; nothing is saved
        return stop

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
    }


def _run(
    spec: Spec, root: Path, events: list[tuple[str, int]]
) -> tuple[World, list[tuple[int, int]]]:
    """The run with ``events`` (each ends a segment; the next one resumes with fresh objects)."""
    fired: list[tuple[int, int]] = []
    world = None
    for segment, event in enumerate([*events, None]):
        if world is not None:
            world.close()
        # "alternate": segments 0 and 2 run compiled, 1 eager (a compiled run's checkpoint
        # resumed eagerly, and back); the uninterrupted run is one compiled segment.
        world = World(spec, root, compiled=spec.get("compiled") == "alternate" and segment % 2 == 0)
        world.segment(event, spec["max_updates"])
        # The fires after the checkpoint resumed from were lost with the process; a fire at
        # its boundary happened before its save (the loop validates, then saves).
        fired = [f for f in fired if f[1] <= world.resumed_at] + world.fired
    assert world is not None
    if world.log is not None:
        world.log.close()  # the script's end: the last rows
    return world, fired


@prop(ci=80, shrink=False)  # each example trains 2-4 runs: report it unshrunk
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
def test_a_resumed_run_ends_bit_identical_to_an_uninterrupted_one(spec: Spec) -> None:
    """Weights, optimizer/scheduler states, counters, loader place, RNG states: bit for bit."""
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        whole, fired_whole = _run(spec, Path(tmp) / "whole", [])
        events = [tuple(e) for e in spec["events"]]
        resumed, fired = _run(spec, Path(tmp) / "resumed", events)  # type: ignore[arg-type]
        problems = equal(whole.state(), resumed.state())
        problems += equal(whole.last_checkpoint(), resumed.last_checkpoint(), "checkpoint")
        if fired != fired_whole:
            said = f"cadence fired at (update, windows) {fired}, uninterrupted {fired_whole}"
            problems.append(said)
        if spec["log"] is not None:
            rows, rows_whole = (w.csv.read_text().splitlines() for w in (resumed, whole))
            if rows != rows_whole:
                problems.append(f"the tracker's CSV: {rows[:8]} != uninterrupted {rows_whole[:8]}")
        whole.close()
        resumed.close()
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
                world.close()
                saver.close()
                return
            with pytest.raises(loopkit.CheckpointError):
                world.ckpt.resume()
        problems = equal(before, world.state()) + equal(loader_state, world.loader.state_dict())
        saver.close()
        world.close()
        assert not problems, "; ".join(problems[:6])
