"""Per-step host overhead: loopkit against a hand-written loop, Accelerate and Lightning Fabric.

The same training (model, data, seed, accumulation of 4, optional clipping) written five
ways, run interleaved in one process on one CPU thread: median microseconds per
micro-step over repeated rounds, and each contender's ratio to the hand-written loop: the
median over rounds of the two runs' ratio in the same round. The loopkit runs must end
with parameters bit-identical to the hand-written run (checked before timing; a mismatch
aborts). Two pairs clip at CLIP whatever ``--clip`` (``loopkit.step, clipped`` against
``hand-written, clipped``; the whole stack against the same stack by hand), and the step's
log call is timed where it runs in the loop; the last lines say which goals are met.

    python benchmarks/overhead.py [--quick] [--json] [--clip]

Accelerate and Fabric rows need them installed (``pip install -e ".[bench]"``); missing
ones are reported as skipped.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import itertools
import json
import math
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

import loopkit

N = 4  # micro-batches per update
Batch = tuple[torch.Tensor, torch.Tensor]
MODELS = {
    # One 1x1 linear layer: almost no compute, so the difference is the host work added.
    "null": {"batch": 1, "sizes": (1, 1)},
    "tiny": {"batch": 32, "sizes": (16, 64, 64, 1)},
    "medium": {"batch": 64, "sizes": (256, 1024, 1024, 1)},
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def build(model_name: str) -> nn.Module:
    torch.manual_seed(0)
    sizes = MODELS[model_name]["sizes"]
    layers: list[nn.Module] = []
    for a, b in itertools.pairwise(sizes):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1]) if len(layers) > 2 else layers[0]


def make_data(model_name: str, n: int = 16) -> list[Batch]:
    g = torch.Generator().manual_seed(1)
    b, d = MODELS[model_name]["batch"], MODELS[model_name]["sizes"][0]
    return [(torch.randn(b, d, generator=g), torch.randn(b, 1, generator=g)) for _ in range(n)]


Runner = Callable[[nn.Module, list[Batch], int, str, float | None], None]


def feed(data: list[Batch], steps: int) -> Sequence[Batch]:
    """The run's ``steps`` batches, cycling through ``data``, for loops that take them as a
    whole (``step.iterate``): a list, or read lazily from paced data (``--paired``)."""
    if isinstance(data, Paced):
        return _Lazy(data, steps)
    return [data[i % len(data)] for i in range(steps)]


def hand(model: nn.Module, data: list[Batch], steps: int, prec: str, clip: float | None) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    dtype = DTYPES[prec]
    for i in range(steps):
        x, y = data[i % len(data)]
        # What a user writes: no autocast at all in fp32.
        with torch.autocast("cpu", dtype=dtype) if prec != "fp32" else contextlib.nullcontext():
            loss = nn.functional.mse_loss(model(x), y)
        (loss / N).backward()
        if (i + 1) % N == 0:
            if clip is not None:
                nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            opt.zero_grad(set_to_none=True)


def loopkit_pieces(
    model: nn.Module, data: list[Batch], steps: int, prec: str, clip: float | None
) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    amp = loopkit.autocast_step(prec, device_type="cpu")
    acc = loopkit.accumulate(model, opt, every=N, clip_grad_norm=clip, amp=amp)
    for i in range(steps):
        x, y = data[i % len(data)]
        with acc:
            with amp:
                loss = nn.functional.mse_loss(model(x), y)
            acc.backward(loss)


def loopkit_step(
    model: nn.Module,
    data: list[Batch],
    steps: int,
    prec: str,
    clip: float | None,
    with_doctor: bool = False,
    with_loop_control: bool = False,
) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    # The doctor's default: host syncs counted on steps 3, 4, 5 and every 500th.
    doc = loopkit.doctor() if with_doctor else None
    step = loopkit.step(model, opt, precision=prec, accumulate=N, clip_grad_norm=clip, doctor=doc)
    if not with_loop_control:
        for i in range(steps):
            x, y = data[i % len(data)]
            with step as s:
                s.backward(nn.functional.mse_loss(model(x), y))
        return
    # A preemptible run with a time limit and a validation cadence (whose evaluation is
    # not timed: only the checks are loop control's cost), stopping on a limit never hit.
    # The calls are also timed where they run (a whole-loop ratio cannot resolve 1% on a
    # shared CPU): their seconds per micro-step, less an empty timing's, go to CONTROL_SECONDS.
    spent = 0.0
    clock = time.perf_counter
    with loopkit.until(step, max_time="99:00:00", max_updates=10**9, check_every=10) as stop:
        validate = loopkit.cadence(step, updates=50)
        for i in range(steps):
            x, y = data[i % len(data)]
            with step as s:
                s.backward(nn.functional.mse_loss(model(x), y))
            t0 = clock()
            t1 = clock()  # the timer's own cost (cold after a step): subtracted below
            validate.due()
            done = stop.check()
            spent += (clock() - t1) - (t1 - t0)
            if done:
                break
    CONTROL_SECONDS.append(spent / steps)


CONTROL_SECONDS: list[float] = []
"""Seconds per micro-step spent in until.check() and cadence.due(), one entry per run."""


_RECORD, _RECORD_ONE = loopkit.detach_logging.record, loopkit.detach_logging._record_one
_KEEP = loopkit.detach_logging._keep


_SPENT = [0.0]  # not a class attribute: writing one would bump the class's version each
# call and turn off the interpreter's attribute caches for the log being timed


class TimedLog(loopkit.detach_logging):
    """A detach_logging whose work is timed where it runs, into ``_SPENT``, less the clock's
    own cost (two clock reads with nothing between, timed alike): what the step's backward
    keeps of the loss for it (``_keep``), the step's per-micro-step record (or ``record``)
    and the flushes they make."""

    @staticmethod
    def _keep(loss: torch.Tensor, known: Any) -> torch.Tensor:
        clock = time.perf_counter
        t0 = clock()
        t1 = clock()
        kept = _KEEP(loss, known)
        _SPENT[0] += (clock() - t1) - (t1 - t0)
        return kept

    def record(self, metrics: Any) -> None:
        clock = time.perf_counter
        t0 = clock()
        t1 = clock()
        _RECORD(self, metrics)
        _SPENT[0] += (clock() - t1) - (t1 - t0)

    def _record_one(self, name: str, v: torch.Tensor, known: Any = None) -> None:
        clock = time.perf_counter
        t0 = clock()
        t1 = clock()
        _RECORD_ONE(self, name, v, known)
        _SPENT[0] += (clock() - t1) - (t1 - t0)


LOG_SECONDS: list[float] = []
"""Seconds per micro-step the log took (the loss kept, the record, the flushes)."""
FULL_LOG_SECONDS: dict[str, list[float]] = {}
"""In the whole stacks, seconds per micro-step the log took, timed where it runs: loopkit's
(as LOG_SECONDS, its CSV sink's writes included) and the hand stack's (its running sum, and
every LOG_EVERY micro-steps its read and CSV row), by contender."""


def loopkit_logged(
    model: nn.Module,
    data: list[Batch],
    steps: int,
    prec: str,
    clip: float | None,
    tracked: bool = False,
    logged: bool = True,
) -> None:
    """loopkit.step over step.iterate with its loss logged every 50 micro-steps; ``tracked``
    adds a CSV tracker sink and the progress display (tqdm, drawn to /dev/null);
    ``logged=False``: the same loop without ``log=`` (what iterate costs alone)."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    with tempfile.TemporaryDirectory() as tmp, open(os.devnull, "w") as null:
        sink = loopkit.CSVSink(os.path.join(tmp, "m.csv")) if tracked else None
        log = TimedLog(every=50, sink=sink) if logged else None
        _SPENT[0] = 0.0
        step = loopkit.step(model, opt, precision=prec, accumulate=N, clip_grad_norm=clip, log=log)
        batches = feed(data, steps)
        with contextlib.redirect_stderr(null):
            for x, y in step.iterate(batches, progress=tracked):
                with step as s:
                    s.backward(nn.functional.mse_loss(model(x), y))
        if logged and not tracked:
            LOG_SECONDS.append(_SPENT[0] / steps)


def accelerate_loop(
    model: nn.Module, data: list[Batch], steps: int, prec: str, clip: float | None
) -> None:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    accelerator = Accelerator(
        cpu=True, mixed_precision="no" if prec == "fp32" else prec, gradient_accumulation_steps=N
    )
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    model, opt = accelerator.prepare(model, opt)
    for i in range(steps):
        x, y = data[i % len(data)]
        with accelerator.accumulate(model):
            loss = nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            if clip is not None and accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            opt.zero_grad(set_to_none=True)


def fabric_loop(
    model: nn.Module, data: list[Batch], steps: int, prec: str, clip: float | None
) -> None:
    try:
        from lightning.fabric import Fabric
    except ImportError:
        from lightning_fabric import Fabric

    fabric = Fabric(
        accelerator="cpu", devices=1, precision="32-true" if prec == "fp32" else "bf16-mixed"
    )
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    model, opt = fabric.setup(model, opt)
    for i in range(steps):
        x, y = data[i % len(data)]
        accumulating = (i + 1) % N != 0
        with fabric.no_backward_sync(model, enabled=accumulating):
            loss = nn.functional.mse_loss(model(x), y)
            fabric.backward(loss / N)
        if not accumulating:
            if clip is not None:
                fabric.clip_gradients(model, opt, max_norm=clip, error_if_nonfinite=False)
            opt.step()
            opt.zero_grad(set_to_none=True)


EMA_DECAY, LOG_EVERY, CLIP = 0.999, 50, 1.0


def hand_full(
    model: nn.Module, data: list[Batch], steps: int, prec: str, clip: float | None
) -> None:
    """Everything a real run turns on, by hand: clipping (at CLIP, whatever ``clip``), a
    scheduler, an EMA loop over the parameters, the loss read with .item() every 50
    micro-steps into a CSV file, a tqdm bar, a time limit and a validation cadence checked
    every micro-step (never firing)."""
    import csv

    clip = CLIP if clip is None else clip

    from tqdm import tqdm

    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=100, gamma=0.9)
    params = list(model.parameters())
    ema = [p.detach().clone() for p in params]
    dtype = DTYPES[prec]
    deadline, updates, total = time.monotonic() + 99 * 3600, 0, torch.zeros(())
    # The log is timed in whole runs only: the goal's runs in turns (paced data) run as written.
    clock, spent, timed = time.perf_counter, 0.0, not isinstance(data, Paced)
    with tempfile.TemporaryDirectory() as tmp, open(os.devnull, "w") as null, \
            open(os.path.join(tmp, "m.csv"), "w", newline="") as f:  # fmt: skip
        rows = csv.writer(f)
        bar = tqdm(range(steps), file=null)
        for i in bar:
            x, y = data[i % len(data)]
            with torch.autocast("cpu", dtype=dtype) if prec != "fp32" else contextlib.nullcontext():
                loss = nn.functional.mse_loss(model(x), y)
            (loss / N).backward()
            if timed:
                t0 = clock()
                t1 = clock()
            total += loss.detach()
            if timed:
                spent += (clock() - t1) - (t1 - t0)
            if (i + 1) % N == 0:
                if clip is not None:
                    nn.utils.clip_grad_norm_(model.parameters(), clip)
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
                with torch.no_grad():
                    for e, p in zip(ema, params, strict=True):
                        e.lerp_(p, 1 - EMA_DECAY)
                updates += 1
                if updates % 50 == 0:
                    pass  # validation would run here
            if (i + 1) % LOG_EVERY == 0:
                t0 = clock()
                t1 = clock()
                rows.writerow([updates, (total / LOG_EVERY).item()])  # one host read
                total.zero_()
                spent += (clock() - t1) - (t1 - t0)  # (once per 50: timed in every run)
            if time.monotonic() > deadline:
                break
    if timed:
        FULL_LOG_SECONDS.setdefault(HAND_FULL, []).append(spent / steps)


def loopkit_full(
    model: nn.Module, data: list[Batch], steps: int, prec: str, clip: float | None
) -> None:
    """The same with loopkit: step(clip, scheduler, log= with a CSV sink, ema=), iterate
    with progress=True, until (time limit) and cadence, and the misuse guards."""
    clip = CLIP if clip is None else clip
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=100, gamma=0.9)
    average = loopkit.ema(model, decay=EMA_DECAY)
    with tempfile.TemporaryDirectory() as tmp, open(os.devnull, "w") as null:
        # The log is timed in whole runs only (as the hand stack's): paced data is a goal's run.
        timed = not isinstance(data, Paced)
        logs = TimedLog if timed else loopkit.detach_logging
        log = logs(every=LOG_EVERY, sink=loopkit.CSVSink(os.path.join(tmp, "m.csv")))
        _SPENT[0] = 0.0
        step = loopkit.step(model, opt, precision=prec, accumulate=N, clip_grad_norm=clip,
                            scheduler=sched, log=log, ema=average)  # fmt: skip
        batches = feed(data, steps)
        with contextlib.redirect_stderr(null), loopkit.until(step, max_time="99:00:00") as stop:
            validate = loopkit.cadence(step, updates=50)
            for x, y in step.iterate(batches, progress=True):
                with step as s:
                    s.backward(nn.functional.mse_loss(model(x), y))
                validate.due()
                if stop.check():
                    break
    if timed:
        FULL_LOG_SECONDS.setdefault(FULL, []).append(_SPENT[0] / steps)


def loopkit_ema(
    model: nn.Module, data: list[Batch], steps: int, prec: str, clip: float | None
) -> None:
    """loopkit.step with ema= (the average's own cost, against loopkit.step)."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    step = loopkit.step(model, opt, precision=prec, accumulate=N, clip_grad_norm=clip,
                        ema=loopkit.ema(model, decay=EMA_DECAY))  # fmt: skip
    for i in range(steps):
        x, y = data[i % len(data)]
        with step as s:
            s.backward(nn.functional.mse_loss(model(x), y))


def clipped(runner: Runner) -> Runner:
    """``runner`` clipping at CLIP whatever the run's ``clip`` (the clipped pair's rows)."""

    def run(model: nn.Module, data: list[Batch], steps: int, prec: str, _: float | None) -> None:
        runner(model, data, steps, prec, CLIP)

    return run


LOOP_CONTROL = "loopkit.step + until + cadence"
HAND_CLIPPED, STEP_CLIPPED = "hand-written, clipped", "loopkit.step, clipped"
ITERATED = "loopkit.step + iterate"
LOGGED, TRACKED = "loopkit.step + iterate + log", "loopkit.step + iterate + log + CSV + progress"
HAND_FULL, FULL = "hand-written, full stack", "loopkit, full stack"
CONTENDERS: dict[str, Runner] = {
    "hand-written": hand,
    "loopkit pieces": loopkit_pieces,
    "loopkit.step": loopkit_step,
    HAND_CLIPPED: clipped(hand),
    STEP_CLIPPED: clipped(loopkit_step),
    "loopkit.step + doctor": functools.partial(loopkit_step, with_doctor=True),
    LOOP_CONTROL: functools.partial(loopkit_step, with_loop_control=True),
    ITERATED: functools.partial(loopkit_logged, logged=False),
    LOGGED: loopkit_logged,
    TRACKED: functools.partial(loopkit_logged, tracked=True),
    "loopkit.step + ema": loopkit_ema,
    HAND_FULL: hand_full,
    FULL: loopkit_full,
    "accelerate": accelerate_loop,
    "fabric": fabric_loop,
}
PAIRS = {"loopkit.step": "hand-written", STEP_CLIPPED: HAND_CLIPPED, FULL: HAND_FULL}
"""The goals' contenders, each timed in turns with its reference (paired())."""
GOAL_ROWS = {*PAIRS, *PAIRS.values(), LOGGED}
"""What ``--goals`` runs."""
LOOPKIT = ("loopkit pieces", "loopkit.step", "loopkit.step + doctor", LOOP_CONTROL, ITERATED,
           LOGGED, TRACKED, "loopkit.step + ema")  # fmt: skip


def available() -> dict[str, str | None]:
    """Contender -> None if it can run, else why not."""
    why: dict[str, str | None] = dict.fromkeys(CONTENDERS)
    try:
        import accelerate  # noqa: F401
    except ImportError:
        why["accelerate"] = "skipped: accelerate not installed"
    try:
        import lightning_fabric  # noqa: F401
    except ImportError:
        why["fabric"] = "skipped: pip install lightning-fabric (the bench extra)"
    return why


def check_parity(model_name: str, prec: str, clip: float | None) -> None:
    """loopkit's runs must end bit-identical to the hand-written run (the full stacks: to
    each other)."""
    data = make_data(model_name)
    pairs = [(HAND_FULL, FULL), (HAND_CLIPPED, STEP_CLIPPED)]
    for ref_name, name in pairs:
        ref, model = build(model_name), build(model_name)
        CONTENDERS[ref_name](ref, data, 4 * N, prec, clip)
        CONTENDERS[name](model, data, 4 * N, prec, clip)
        pairs_of = zip(ref.parameters(), model.parameters(), strict=True)
        if not all(torch.equal(a, b) for a, b in pairs_of):
            raise SystemExit(f"parity broken: {name} ({model_name}, {prec}) != {ref_name}")
    ref = build(model_name)
    hand(ref, data, 4 * N, prec, clip)
    for name in LOOPKIT:
        model = build(model_name)
        CONTENDERS[name](model, data, 4 * N, prec, clip)
        for a, b in zip(ref.parameters(), model.parameters(), strict=True):
            if not torch.equal(a, b):
                raise SystemExit(
                    f"parity broken: {name} ({model_name}, {prec}) differs from the "
                    "hand-written loop"
                )


CORE = min(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 0
CLOCK = time.thread_time  # a block's CPU time in its own thread: another process's not in it
BLOCK = 200  # batches a paired contender runs before handing the CPU to the other (--paired)


class Paced(list[Batch]):
    """A run's data that hands the CPU to the paired contender every BLOCK batches read, and
    times each of its blocks (the hand-over itself is not timed)."""

    def __init__(self, data: list[Batch], pacer: Callable[[], None]) -> None:
        super().__init__(data)
        self.pacer, self.reads = pacer, 0

    def __getitem__(self, i: Any) -> Any:
        if self.reads % BLOCK == 0:
            self.pacer()
        self.reads += 1
        return super().__getitem__(i)


class _Lazy(Sequence[Batch]):
    """``steps`` batches of paced data, each read when the loop reaches it."""

    def __init__(self, data: Paced, steps: int) -> None:
        self.data, self.steps = data, steps

    def __len__(self) -> int:
        return self.steps

    def __getitem__(self, i: Any) -> Any:
        raise TypeError("read in order only")

    def __iter__(self) -> Iterator[Batch]:
        n = len(self.data)
        return (self.data[i % n] for i in range(self.steps))


def paired(
    ref: str, name: str, model_name: str, prec: str, steps: int, rounds: int, clip: float | None
) -> list[float]:
    """``name``'s time over ``ref``'s per pair of adjacent blocks of BLOCK micro-steps: the
    two runs advance in turns in one process (``ref`` in a thread, ``name`` in the main
    thread, where loopkit.until installs its signal handler), so a drift of the machine's
    speed hits both blocks of a pair alike. The first and last blocks of a run (warm-up,
    tear-down) are left out; which run starts alternates by round."""
    data = make_data(model_name)
    ratios: list[float] = []
    for r in range(rounds):
        turn = {ref: threading.Semaphore(0), name: threading.Semaphore(0)}
        other = {ref: name, name: ref}
        blocks: dict[str, list[float]] = {ref: [], name: []}
        done: dict[str, bool] = {ref: False, name: False}
        failed: list[BaseException] = []

        def run(who: str, turn: Any = turn, other: Any = other, blocks: Any = blocks,
                done: Any = done, failed: Any = failed) -> None:  # fmt: skip
            began = [0.0]

            def pacer() -> None:
                now = CLOCK()
                if began[0]:
                    blocks[who].append(now - began[0])
                    if not done[other[who]]:
                        turn[other[who]].release()
                        turn[who].acquire()
                began[0] = CLOCK()

            turn[who].acquire()
            if hasattr(os, "sched_setaffinity"):
                # Both runs on one core: a run per core measured its core, not its code (a
                # hand loop against itself came out 0.96 across two cores, 1.00 on one).
                os.sched_setaffinity(0, {CORE})
            model = build(model_name)
            try:
                CONTENDERS[who](model, Paced(data, pacer), steps, prec, clip)
            except BaseException as err:  # handed to the main thread, which raises it
                failed.append(err)
            finally:
                done[who] = True
                turn[other[who]].release()

        worker = threading.Thread(target=run, args=(ref,), daemon=True)
        worker.start()
        turn[ref if r % 2 == 0 else name].release()
        run(name)
        worker.join()
        if failed:
            raise failed[0]
        # Blocks 1 .. n-1: the last one measured ends at the last hand-over, before tear-down.
        for a, b in zip(blocks[name][1:], blocks[ref][1:], strict=False):
            ratios.append(a / b)
            BLOCKS.append((a, b))
    return ratios


BLOCKS: list[tuple[float, float]] = []
"""Every (contender, reference) block pair paired() timed, in seconds (for other estimates)."""


def time_once(
    name: str, model_name: str, data: list[Batch], steps: int, prec: str, clip: float | None
) -> float:
    model = build(model_name)
    gc.collect()
    start = time.perf_counter()
    CONTENDERS[name](model, data, steps, prec, clip)
    return (time.perf_counter() - start) / steps * 1e6


def bench(
    model_name: str, prec: str, steps: int, repeats: int, clip: float | None, names: list[str]
) -> dict[str, list[float]]:
    """Each contender's microseconds per micro-step, one sample per round (interleaved)."""
    data = make_data(model_name)
    for name in names:  # warm-up
        time_once(name, model_name, data, min(steps, 8 * N), prec, clip)
    # What the warm-up runs timed inside is not a sample (cold, and too short for a flush).
    CONTROL_SECONDS.clear()
    LOG_SECONDS.clear()
    FULL_LOG_SECONDS.clear()
    samples: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(repeats):
        # Interleaved, in a rotating order, so drift in the machine's speed hits all alike.
        order = names[rep % len(names) :] + names[: rep % len(names)]
        for name in order:
            samples[name].append(time_once(name, model_name, data, steps, prec, clip))
    return samples


def ratio(samples: dict[str, list[float]], name: str, ref: str) -> float:
    """The median over rounds of ``name``'s time over ``ref``'s in the same round: a drift of
    the machine's speed between rounds cancels out."""
    return statistics.median(a / b for a, b in zip(samples[name], samples[ref], strict=True))


# The goals (issue 44), each a ratio (or microseconds) and its bound: name -> (row, key, bound)
GOALS = {
    "loopkit.step / hand loop": ("loopkit.step", "paired", 1.00),
    "loopkit.step clipped / hand loop clipped": (STEP_CLIPPED, "paired", 1.02),
    "whole stack / the same by hand": (FULL, "paired", 1.02),
    "log= per micro-step, timed where it runs (us)": (LOGGED, "log_us", 3.0),
}


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps and repeats (< 1 min)")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    parser.add_argument("--clip", action="store_true", help="clip gradients at norm 1.0")
    parser.add_argument("--models", nargs="+", default=["tiny", "medium"], choices=list(MODELS))
    parser.add_argument("--rounds", type=int, help="interleaved rounds (default: per model)")
    parser.add_argument(
        "--goals", action="store_true", help="only the goals' contenders and their references"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if hasattr(os, "sched_setaffinity"):
        # The whole runs on one core too (as each paired run is): a run the scheduler moves
        # between cores finds its caches cold there, and a timed piece of it (the log's
        # record) doubled from run to run so.
        os.sched_setaffinity(0, {CORE})
    clip = 1.0 if args.clip else None
    why = available()
    names = [n for n in CONTENDERS if why[n] is None and (not args.goals or n in GOAL_ROWS)]
    plan = {
        "null": (400, 3) if args.quick else (4000, 9),
        "tiny": (400, 3) if args.quick else (2000, 7),
        # Many short interleaved runs: a medium step is milliseconds, so run-to-run drift
        # of the machine, not loopkit, is what a few long runs would measure.
        "medium": (40, 3) if args.quick else (40, 25),
    }
    rows: list[dict[str, Any]] = []
    for model_name in args.models:
        for prec in DTYPES:
            check_parity(model_name, prec, clip)
            steps, repeats = plan[model_name]
            repeats = args.rounds or repeats
            CONTROL_SECONDS.clear()
            LOG_SECONDS.clear()
            FULL_LOG_SECONDS.clear()
            samples = bench(model_name, prec, steps, repeats, clip, names)
            # The goals' pairs again, in turns of BLOCK micro-steps (see paired()).
            paired_steps, paired_rounds = (1000, 1) if args.quick else (2000, repeats)
            blockwise = {
                name: paired(ref, name, model_name, prec, paired_steps, paired_rounds, clip)
                for name, ref in PAIRS.items()
            }
            us = {name: statistics.median(v) for name, v in samples.items()}
            control_us = statistics.median(CONTROL_SECONDS or [math.nan]) * 1e6
            record_us = statistics.median(LOG_SECONDS) * 1e6
            for name in CONTENDERS:
                if args.goals and name not in GOAL_ROWS:
                    continue
                row: dict[str, Any] = {"model": model_name, "precision": prec, "contender": name}
                if name in us:
                    row |= {
                        "us_per_step": round(us[name], 2),
                        "ratio": round(ratio(samples, name, "hand-written"), 4),
                        "added_us": round(us[name] - us["hand-written"], 2),
                    }
                    if name in blockwise:
                        row["paired"] = round(statistics.median(blockwise[name]), 4)
                        row["paired_blocks"] = len(blockwise[name])
                    if name == TRACKED:  # the tracker and the display: against the same log
                        row["ratio_to_logged"] = round(ratio(samples, name, LOGGED), 4)
                    if name == STEP_CLIPPED:  # against the same clipping by hand
                        row["ratio_to_hand_clipped"] = round(ratio(samples, name, HAND_CLIPPED), 4)
                    if name == LOGGED:
                        row["log_us"] = round(record_us, 3)
                    if name == FULL and ITERATED in us:  # the whole stack, piece by piece
                        row["pieces_us"] = {
                            "iterate": round(us[ITERATED] - us["loopkit.step"], 2),
                            "log": round(us[LOGGED] - us[ITERATED], 2),
                            "log's recording (timed inside)": round(record_us, 3),
                            "CSV + progress": round(us[TRACKED] - us[LOGGED], 2),
                            "ema": round(us["loopkit.step + ema"] - us["loopkit.step"], 2),
                            "until + cadence (timed inside)": round(control_us, 3),
                        }
                    if name in FULL_LOG_SECONDS:  # the stack's log, timed where it runs
                        row["stack_log_us"] = round(
                            statistics.median(FULL_LOG_SECONDS[name]) * 1e6, 3
                        )
                    if name == FULL:  # the whole stack against the same stack by hand
                        row["ratio_to_hand_full"] = round(ratio(samples, name, HAND_FULL), 4)
                    if name == LOOP_CONTROL:  # loop control's own cost: against the same step
                        row["ratio_to_step"] = round(ratio(samples, name, "loopkit.step"), 4)
                        row["control_us"] = round(control_us, 3)
                        row["control_share"] = round(control_us / us["loopkit.step"], 5)
                else:
                    row |= {"us_per_step": None, "ratio": None, "note": why[name]}
                rows.append(row)
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(
            f"torch {torch.__version__}, 1 CPU thread, accumulation {N}"
            f"{', clipping' if clip else ''}; parity: loopkit bit-identical to hand-written\n"
        )
        print(
            "| model | precision | contender | us / micro-step | ratio to hand-written | us added |"
        )
        print("|---|---|---|---|---|---|")
        for r in rows:
            if r["ratio"] is None:
                print(f"| {r['model']} | {r['precision']} | {r['contender']} | {r['note']} | | |")
            else:
                print(
                    f"| {r['model']} | {r['precision']} | {r['contender']} "
                    f"| {r['us_per_step']:.1f} | {r['ratio']:.3f} | {r['added_us']:+.1f} |"
                )
        print(
            "\nuntil + cadence: the calls timed inside the loop, per micro-step, and as a share "
            "of loopkit.step's micro-step; the whole-loop ratio to loopkit.step (noisier)"
        )
        for r in rows:
            if "ratio_to_logged" in r:
                print(
                    f"  {r['model']} {r['precision']}: CSV tracker + progress display over the "
                    f"same logged loop: {r['ratio_to_logged']:.3f}"
                )
        for r in rows:
            if "pieces_us" in r:
                pieces = ", ".join(f"{k} {v:+.2f}" for k, v in r["pieces_us"].items())
                print(
                    f"  {r['model']} {r['precision']}: full stack, loopkit over the same by "
                    f"hand: {r['ratio_to_hand_full']:.3f}; us per micro-step each piece adds "
                    f"to loopkit.step: {pieces}"
                )
        for r in rows:
            if "ratio_to_step" in r:
                print(
                    f"  {r['model']} {r['precision']}: {r['control_us']:.2f} us = "
                    f"{100 * r['control_share']:.2f}%; whole loop {r['ratio_to_step']:.3f}"
                )
        for r in rows:
            if r["contender"] == FULL and "stack_log_us" in r:
                same = (r["model"], r["precision"], HAND_FULL)
                hand_log = next(
                    h["stack_log_us"]
                    for h in rows
                    if (h["model"], h["precision"], h["contender"]) == same
                )
                print(
                    f"  {r['model']} {r['precision']}: the whole stack's log, timed where it runs "
                    f"(us per micro-step): loopkit {r['stack_log_us']:.2f}, by hand "
                    f"{hand_log:.2f} (a running sum, read every {LOG_EVERY})"
                )
        print(
            f"\nthe goals: measured (bound); a ratio is the median over pairs of adjacent "
            f"blocks of {BLOCK} micro-steps run in turns (the whole runs' ratio beside it)"
        )
        for goal, (contender, key, bound) in GOALS.items():
            for r in rows:
                if r["contender"] == contender and r.get(key) is not None:
                    met = "met" if r[key] <= bound else "NOT met"
                    beside = ""
                    if key == "paired":
                        whole = r.get("ratio_to_hand_clipped", r.get("ratio_to_hand_full"))
                        whole = r["ratio"] if whole is None else whole
                        beside = f", {r['paired_blocks']} block pairs; whole runs {whole:.3f}"
                    print(f"  {r['model']} {r['precision']}: {goal}: {r[key]:.3f} "
                          f"({bound:.2f}) {met}{beside}")  # fmt: skip
    return rows


if __name__ == "__main__":
    main()
