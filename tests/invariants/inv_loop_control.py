"""Loop control: stops, cadences and saves fall on window boundaries, once, alike on every rank.

A scenario: one ``loopkit.step`` or a ``steps`` group of two, ``accumulate=k``, a
``distributed.loader`` of a drawn length and batch size over 1 to 3 epochs, members
entered (with or without backward) or skipped per batch, ``until(max_updates=M)`` (or
none), a ``cadence`` (``updates=N``, ``per_epoch=K`` or ``epochs=E``) and
``Checkpointer.maybe_save(every=S)``. ``due()``, ``maybe_save`` and ``check()`` are asked
once per batch, after the last member's micro-step, as the docs say.

The reference counts the windows by hand: a window ends on every k-th batch of a pass and
on its last batch, and the clock's update count is the number of windows ended so far
(for one step, of windows with a backward). Checked: each answer is given right where a
window ends (every member's ``micro_step`` is 0 there), ``until`` stops at the first
window end whose count reaches M and nowhere else, ``cadence`` fires exactly at its
points (every N-th count; the K marks of the pass moved to their window's end; the end of
every E-th pass), each once, the checkpoints on disk are the multiples of S reached plus
the final state, and under DDP both ranks took the same decisions at the same batches.
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from hypothesis import strategies as st
from torch import nn
from torch.utils.data import TensorDataset

import loopkit
from loopkit import distributed

Spec = dict[str, Any]


def expected(spec: Spec) -> dict[str, Any]:
    """The decisions by hand: per (epoch, batch), whether a window ends, and the count then."""
    batches, every = spec["batches"], spec["every"]
    ends: list[tuple[int, int, int]] = []  # (epoch, batch, updates after it)
    updates = 0
    for e in range(spec["epochs"]):
        for b in range(batches):
            if (b + 1) % every == 0 or b == batches - 1:
                window = range(b - (b % every), b + 1)
                backward = any(1 in spec["enter"][i] for i in window)
                if spec["members"] == 2 or backward:
                    updates += 1
                ends.append((e, b, updates))
    stop = None
    if spec["max_updates"] is not None:
        stop = next(((e, b) for e, b, u in ends if u >= spec["max_updates"]), None)
    if stop is not None:
        ends = ends[: [(e, b) for e, b, _ in ends].index(stop) + 1]
    kind, value = spec["cadence"]
    fired = []
    seen: set[int] = set()
    for e, b, u in ends:
        if kind == "updates":
            hit = u > 0 and u % value == 0 and u not in seen
        elif kind == "per_epoch":  # checked by its properties (problems_of): K per pass
            hit = False
        else:
            hit = b == batches - 1 and (e + 1) % value == 0
        if hit:
            fired.append((e, b))
            seen.add(u)
    final = ends[-1][2] if ends else 0
    saves = {u for _, _, u in ends if u and u % spec["save_every"] == 0} | (
        {final} if final else set()
    )
    return {"stop": stop, "fired": fired, "saves": sorted(saves), "final": final}


def run(spec: Spec, rank: int, world: int, root: Path) -> dict[str, Any]:
    """The loop with loopkit; what it decided where."""
    torch.manual_seed(0)
    n = spec["batches"] * spec["batch_size"] * world
    data = TensorDataset(torch.randn(n, 4), torch.randn(n, 2))
    loader = distributed.loader(data, batch_size=spec["batch_size"], seed=0, num_workers=0)
    assert len(loader) == spec["batches"], (len(loader), spec)
    models = [nn.Linear(4, 2) for _ in range(spec["members"])]
    wrapped = [nn.parallel.DistributedDataParallel(m) if world > 1 else m for m in models]
    steps = [loopkit.step(w, torch.optim.SGD(w.parameters(), lr=0.01), accumulate=spec["every"])
             for w in wrapped]  # fmt: skip
    clock: Any = loopkit.steps(*steps) if spec["members"] == 2 else steps[0]
    ckpt = loopkit.Checkpointer(root, model=nn.ModuleList(models), step=clock, loader=loader,
                                keep=1000)  # fmt: skip
    stop = loopkit.until(clock, max_updates=spec["max_updates"], signals=())
    kind, value = spec["cadence"]
    cad = loopkit.cadence(
        clock, **{kind: value}, **({"loader": loader} if kind != "updates" else {})
    )
    log: list[tuple[Any, ...]] = []
    stopped = None
    for e in range(spec["epochs"]):
        for b, (x, y) in enumerate(clock.iterate(loader)):
            for k, s in enumerate(steps):
                how = spec["enter"][b][k]
                if how == 0:
                    continue
                with s as st_:
                    if how == 1:
                        st_.backward(nn.functional.mse_loss(wrapped[k](x), y))
            # Each member's open micro-steps as each answer is given (0: at a boundary).
            due = cad.due()
            micro = [tuple(s.micro_step for s in steps)]
            last = ckpt.last_saved_update
            ckpt.maybe_save(every=spec["save_every"])  # its path on rank 0 only: not compared
            saved = ckpt.last_saved_update != last
            micro.append(tuple(s.micro_step for s in steps))
            done = stop.check()
            micro.append(tuple(s.micro_step for s in steps))
            log.append((e, b, due, done, saved, tuple(micro), clock.updates))
            if done:
                stopped = (e, b)
                break
        if stopped is not None:
            break
    ckpt.save_if_needed()
    saves = sorted(int(p.stem.split("-")[1]) for p in ckpt.checkpoints())
    return {"log": log, "stopped": stopped, "saves": saves, "reason": stop.reason,
            "updates": clock.updates}  # fmt: skip


def problems_of(spec: Spec, got: dict[str, Any]) -> list[str]:
    want = expected(spec)
    problems = []
    for e, b, due, done, saved, micro, _ in got["log"]:
        for said, what, open_ in ((due, "due()", micro[0]), (saved, "maybe_save", micro[1]),
                                  (done, "check()", micro[2])):  # fmt: skip
            if said and any(open_):
                problems.append(f"epoch {e} batch {b}: {what} inside a window (micro_step {open_})")
    fired = [(e, b) for e, b, due, *_ in got["log"] if due]
    kind, k = spec["cadence"]
    if kind != "per_epoch" and fired != want["fired"]:
        problems.append(f"cadence {spec['cadence']} fired at {fired}, expected {want['fired']}")
    if kind == "per_epoch":
        # K times per pass of the loader, each at a window's end, the last at the pass's end.
        last = spec["batches"] - 1
        passes = {e for e, b, *_ in got["log"] if b == last}  # the passes that ran to the end
        for e in passes:
            here = [b for pe, b in fired if pe == e]
            if len(here) != k or here[-1:] != [last] or len(set(here)) != len(here):
                problems.append(f"cadence per_epoch={k} fired at batches {here} of pass {e}")
    checks = [(e, b) for e, b, _, done, *_ in got["log"] if done]
    if got["stopped"] != want["stop"] or len(checks) != (want["stop"] is not None):
        problems.append(f"until stopped at {checks} ({got['reason']}), expected {want['stop']}")
    if got["updates"] != want["final"]:
        problems.append(f"{got['updates']} updates, expected {want['final']}")
    if got["saves"] != want["saves"]:
        problems.append(f"checkpoints at updates {got['saves']}, expected {want['saves']}")
    return problems


def check_here(spec: Spec) -> None:
    """One process."""
    with tempfile.TemporaryDirectory() as tmp:
        got = run(spec, 0, 1, Path(tmp))
    problems = problems_of(spec, got)
    assert not problems, "; ".join(problems)


def check_on_ranks(spec: Spec, info: Any) -> dict[str, Any]:
    """Both ranks: the reference's decisions, and the same log on every rank."""
    with tempfile.TemporaryDirectory() as tmp:
        # Rank 0 writes the checkpoints; every rank reads the directory of rank 0.
        where = [tmp]
        dist.broadcast_object_list(where, src=0)
        got = run(spec, info.rank, info.world_size, Path(where[0]))
        logs: list[Any] = [None] * info.world_size
        dist.all_gather_object(logs, got["log"])
        dist.barrier()
    problems = problems_of(spec, got)
    if any(log != logs[0] for log in logs):
        problems.append("the ranks took different decisions")
    assert not problems, "; ".join(problems)
    return {}


@st.composite
def scenarios(draw: Callable[..., Any]) -> Spec:
    members = draw(st.sampled_from([1, 2, 2]))
    every = draw(st.integers(1, 3))
    batches = draw(st.integers(1, 7))
    windows = math.ceil(batches / every)
    choice = st.sampled_from([1, 1, 1, 0, 2] if members == 2 else [1, 1, 1, 2])
    enter = [draw(st.lists(choice, min_size=members, max_size=members)) for _ in range(batches)]
    if members == 1:  # one step: every window makes an update (else it is no window to count)
        for start in range(0, batches, every):
            if all(enter[i][0] != 1 for i in range(start, min(start + every, batches))):
                enter[start][0] = 1
    kind = draw(st.sampled_from(["updates", "per_epoch", "epochs"]))
    value = draw(st.integers(1, windows)) if kind == "per_epoch" else draw(st.integers(1, 3))
    return {
        "members": members,
        "every": every,
        "batches": batches,
        "batch_size": draw(st.integers(1, 3)),
        "epochs": draw(st.integers(1, 3)),
        "enter": enter,
        "max_updates": draw(st.none() | st.integers(1, 8)),
        "cadence": (kind, value),
        "save_every": draw(st.integers(1, 3)),
    }
