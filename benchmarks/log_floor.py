"""Keeping every micro-step's loss by hand, timed where it runs: the floor under ``log=``.

The tiny model of ``overhead.py`` (accumulation 4, one CPU thread, pinned to one core)
trained by hand, its loss kept each micro-step in one of the ways a hand loop does it,
timed where the lines run (less two clock reads timed hot), and read every 50 micro-steps
(the read's time included, per micro-step); the rounds interleave the ways. Beside them,
``loopkit.step`` with ``log=`` (the step's keeping of the loss, its record and the flushes,
timed alike: two regions per micro-step, so a clock read slower in the loop than hot counts
against it twice), one ``loss.detach()`` alone (a single dispatched op in the loop) and one
``loss.data`` alone (no op: what touching the loss after its backward costs).

    python benchmarks/log_floor.py [--quick] [--json]

The ways, each with no host read but the one every 50 micro-steps (``.item()`` per
micro-step would be a host-device sync on a GPU, so it is not among them):

- ``running sum``: ``total.add_(loss.detach())``, then ``(total / 50).item()``: two ops per
  micro-step (the hand stack of ``overhead.py``, nanoGPT-style scripts made sync-free);
- ``detach + stack``: ``kept.append(loss.detach())``, then one ``stack`` and ``tolist``;
- ``.data + stack``: the same with ``loss.data`` (no dispatched op): the cheapest way here to
  keep each value and read them all in one transfer.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import loopkit

N, EVERY = 4, 50
Batch = tuple[torch.Tensor, torch.Tensor]
CLOCK = time.perf_counter


def build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                         nn.Linear(64, 1))  # fmt: skip


def make_data() -> list[Batch]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(32, 16, generator=g), torch.randn(32, 1, generator=g)) for _ in range(16)]


def _keeping(way: str) -> tuple[Callable[[torch.Tensor], None], Callable[[], float] | None]:
    """The way's keeping of a loss (each micro-step) and its read (every EVERY; None: no read)."""
    total, kept = torch.zeros(()), []

    def running_sum(loss: torch.Tensor) -> None:
        total.add_(loss.detach())

    def read_sum() -> float:
        mean = (total / EVERY).item()  # host-device sync: one per EVERY micro-steps
        total.zero_()
        return mean

    def read_kept() -> float:
        mean = math.fsum(torch.stack(kept).tolist()) / EVERY  # the same, one read
        kept.clear()
        return mean

    ways: dict[str, tuple[Callable[[torch.Tensor], Any], Callable[[], float] | None]] = {
        "one detach()": (lambda loss: loss.detach(), None),
        "one .data": (lambda loss: loss.data, None),
        "running sum": (running_sum, read_sum),
        "detach + stack": (lambda loss: kept.append(loss.detach()), read_kept),
        ".data + stack": (lambda loss: kept.append(loss.data), read_kept),
    }
    return ways[way]


def by_hand(way: str, steps: int) -> tuple[float, list[float]]:
    """Seconds per micro-step the way took, and the means it read."""
    model, data = build(), make_data()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    keep, read = _keeping(way)
    means: list[float] = []
    spent = 0.0
    for i in range(steps):
        x, y = data[i % len(data)]
        loss = nn.functional.mse_loss(model(x), y)
        (loss / N).backward()
        t0 = CLOCK()
        keep(loss)
        spent += CLOCK() - t0 - CLOCK_PAIR[0]
        if (i + 1) % EVERY == 0 and read is not None:
            t0 = CLOCK()
            means.append(read())
            spent += CLOCK() - t0 - CLOCK_PAIR[0]
        if (i + 1) % N == 0:
            opt.step()
            opt.zero_grad(set_to_none=True)
    return spent / steps, means


CLOCK_PAIR = [0.0]
"""Two clock reads with nothing between, timed hot (subtracted from every timed region: a
region timed cold right after a backward reads its clocks slower, and a correction timed
there would favour whoever has more regions: loopkit's log has two per micro-step)."""


def _calibrate() -> None:
    pairs = []
    for _ in range(20000):
        t0 = CLOCK()
        pairs.append(CLOCK() - t0)
    CLOCK_PAIR[0] = statistics.median(pairs)


_SPENT = [0.0]
_KEEP, _RECORD_ONE = loopkit.detach_logging._keep, loopkit.detach_logging._record_one


class _TimedLog(loopkit.detach_logging):
    """The step's log, its capture of the loss and its record (flushes included) timed, the
    clocks inline as in the hand ways (``_SPENT`` a list: a class attribute written each call
    would turn off the interpreter's attribute caches for this very object)."""

    @staticmethod
    def _keep(loss: torch.Tensor, known: Any) -> torch.Tensor:
        t0 = CLOCK()
        kept = _KEEP(loss, known)
        _SPENT[0] += CLOCK() - t0 - CLOCK_PAIR[0]
        return kept

    def _record_one(self, name: str, v: torch.Tensor, known: Any = None) -> None:
        t0 = CLOCK()
        _RECORD_ONE(self, name, v, known)
        _SPENT[0] += CLOCK() - t0 - CLOCK_PAIR[0]


def with_loopkit(steps: int) -> tuple[float, list[float]]:
    model, data = build(), make_data()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    means: list[float] = []
    log = _TimedLog(every=EVERY, sink=lambda metrics, step: means.append(metrics["loss"]))
    step = loopkit.step(model, opt, accumulate=N, log=log)
    _SPENT[0] = 0.0
    for i in range(steps):
        x, y = data[i % len(data)]
        with step as s:
            s.backward(nn.functional.mse_loss(model(x), y))
    return _SPENT[0] / steps, means


WAYS = ["one detach()", "one .data", "running sum", "detach + stack", ".data + stack",
        "loopkit log="]  # fmt: skip


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps and rounds")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    steps, rounds = (400, 2) if args.quick else (2000, 7)
    _calibrate()
    spent: dict[str, list[float]] = {way: [] for way in WAYS}
    means: dict[str, list[float]] = {}
    for r in range(rounds + 1):  # the first round warms up, untimed
        order = WAYS[r % len(WAYS) :] + WAYS[: r % len(WAYS)]
        for way in order:
            s, m = with_loopkit(steps) if way == "loopkit log=" else by_hand(way, steps)
            if r:
                spent[way].append(s)
            means[way] = m
    # Every way read the same means (the same training, the same values kept).
    ref = means["detach + stack"]
    for way in ("running sum", ".data + stack", "loopkit log="):
        if not all(math.isclose(a, b, rel_tol=1e-6) for a, b in zip(ref, means[way], strict=True)):
            raise SystemExit(f"{way} read other means than detach + stack")
    rows = [{"way": way, "us_per_micro_step": round(statistics.median(v) * 1e6, 3),
             "rounds_us": [round(x * 1e6, 2) for x in v]} for way, v in spent.items()]  # fmt: skip
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(f"torch {torch.__version__}, 1 CPU thread, accumulation {N}, read every {EVERY}\n")
        print("| way of keeping each micro-step's loss | us per micro-step, timed where it runs |")
        print("|---|---|")
        for row in rows:
            print(f"| {row['way']} | {row['us_per_micro_step']:.2f} |")
    return rows


if __name__ == "__main__":
    main()
