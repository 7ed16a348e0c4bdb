"""Invariant: under torch.compile, a loopkit.step loop is the hand-written loop, bit for bit.

The reference is the loop a port replaces, around its own ``torch.compile`` of an identical
copy of the model: for each batch, the forward under ``torch.autocast`` (bf16) or none
(fp32), ``(loss / k).backward()``; at each window's end (and on the ragged last one, whose
summed gradients are scaled by ``k / len(window)`` first, as loopkit normalizes them)
``clip_grad_norm_(model.parameters(), c)``, ``optimizer.step()``, ``ema.update()``,
``scheduler.step()``, ``optimizer.zero_grad()`` (``inv_parity.hand_update``). Over drawn
``accumulate``, clipping, schedulers, optimizers, precisions, dropout, batch sizes with a
ragged tail (a batch-size recompile), ``log=`` and ``ema=``, ``loopkit.step(torch.compile(
model), ...)`` must give the same losses, per-update gradient norms, weights, optimizer
state, learning rates and EMA weights (``torch.equal``), its log the means of the hand
loop's losses; and, counted with ``torch._dynamo.utils.counters`` and the compilation
metrics after ``torch._dynamo.reset()`` before each run, no more graphs, graph breaks or
recompiles than the hand loop.

And a compiled function around the whole micro-step (``torch.compile(micro)``, ``with step
as s: ... s.backward(loss)`` inside) trains bit for bit as the same micro-step uncompiled,
with no more graphs or recompiles and at most one graph break per step entry point:
dynamo runs the micro-step's own frame eagerly (the step's calls break the graph) and
compiles only the user functions it calls, each as its own frame. The uncompiled
reference therefore compiles that function (``torch.compile(loss_of)``); a forward
written inline from torch's own modules compiles nothing, and its reference is the
plain eager loop.

Compiling is slow on a CPU: CI draws two examples of each besides the explicit ones (tiny
models, derandomized) and compiles with the ``aot_eager`` backend (dynamo's graphs, breaks
and recompiles, AOT autograd, no code generation); ``LOOPKIT_DEEP=1`` draws fifty random
ones and compiles with inductor.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator
from typing import Any, cast

import inv_parity as ip
import pytest
import torch
import torch._dynamo
from helpers import deep
from hypothesis import example, given
from hypothesis import strategies as st
from inv_budget import DEEP, prop, where
from torch import nn
from torch._dynamo.utils import clear_compilation_metrics, counters, get_compilation_metrics

import loopkit

Spec = dict[str, Any]
D = 4
BATCH = 4  # full batches; the tail is smaller (shapes vary only there: few compiles)
EMA_DECAY = 0.9
EXAMPLES = 5 if DEEP else 2
# CI compiles with dynamo and AOT autograd but no code generation (aot_eager: the graphs,
# breaks and recompiles are dynamo's, the same with any backend), a deep run with inductor.
BACKEND = "inductor" if DEEP else "aot_eager"
"""Drawn examples per test: 2 in CI (compiling is slow on a CPU: the file stays well under a
minute), 5 times LOOPKIT_DEEP's factor in a deep run (50 with LOOPKIT_DEEP=1: the compiled
graphs repeat, and the compile caches make most examples cheap)."""

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # inductor's CPU notices


@pytest.fixture(autouse=True)
def _forget_compiled() -> Iterator[None]:
    """The next test (of this file or another) starts with nothing compiled or counted."""
    yield
    fresh_compiler()


def make_model(spec: Spec) -> nn.Module:
    torch.manual_seed(spec["seed"])
    return nn.Sequential(nn.Linear(D, 8), nn.Tanh(), nn.Dropout(spec["dropout"]), nn.Linear(8, D))


def make_data(spec: Spec) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(spec["seed"] + 1)
    sizes = [BATCH] * spec["full"] + ([spec["tail"]] if spec["tail"] else [])
    return [(torch.randn(b, D, generator=g), torch.randn(b, D, generator=g)) for b in sizes]


def make_optimizer(spec: Spec, model: nn.Module) -> torch.optim.Optimizer:
    if spec["optimizer"] == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    return torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01)


def make_scheduler(spec: Spec, opt: torch.optim.Optimizer) -> Any:
    if spec["scheduler"] == "step":
        return torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    return None


def loss_of(model: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> Any:
    return nn.functional.mse_loss(model(x).float(), y)


def compiled_copy(model: nn.Module) -> nn.Module:
    """``torch.compile(model)``: an OptimizedModule, which is an nn.Module."""
    return cast(nn.Module, torch.compile(model, backend=BACKEND))


def fresh_compiler() -> None:
    """Forget every compiled graph and what was counted: each run compiles from nothing."""
    torch._dynamo.reset()
    counters.clear()
    clear_compilation_metrics()


def compiler_counts() -> dict[str, int]:
    """Graphs made, graph breaks and recompiles since ``fresh_compiler``."""
    return {
        "graphs": int(counters["stats"]["unique_graphs"]),
        "graph breaks": sum(counters["graph_break"].values()),
        "recompiles": sum(m.recompile_reason is not None for m in get_compilation_metrics()),
    }


@dataclasses.dataclass
class Run:
    """What a run computed and ended with."""

    losses: list[torch.Tensor]
    norms: list[torch.Tensor]
    params: list[torch.Tensor]
    optimizer: dict[str, Any]
    lrs: list[float]
    ema: list[torch.Tensor] | None
    logged: list[float] | None
    counts: dict[str, int]


def _ended(
    model: nn.Module, opt: torch.optim.Optimizer, trace: dict[str, list[torch.Tensor]],
    ema: loopkit.ema | None, logged: list[float] | None,
) -> Run:  # fmt: skip
    return Run(
        losses=trace["losses"], norms=trace["norms"],
        params=[p.detach().clone() for p in model.parameters()], optimizer=opt.state_dict(),
        lrs=[g["lr"] for g in opt.param_groups],
        ema=None if ema is None else [t.clone() for t in ema.shadow], logged=logged,
        counts=compiler_counts(),
    )  # fmt: skip


def run_hand(spec: Spec) -> Run:
    """The hand loop around a ``torch.compile`` of its own copy of the model."""
    model, data = make_model(spec), make_data(spec)
    compiled = compiled_copy(model)
    opt = make_optimizer(spec, model)
    sched = make_scheduler(spec, opt)
    ema = loopkit.ema(compiled, EMA_DECAY) if spec["ema"] else None
    k, clip = spec["accumulate"], spec["clip"]
    trace: dict[str, list[torch.Tensor]] = {"losses": [], "norms": []}
    fresh_compiler()
    torch.manual_seed(spec["seed"] + 2)  # dropout's stream
    window = 0
    for i, (x, y) in enumerate(data):
        amp: Any = contextlib.nullcontext()
        if spec["precision"] == "bf16":
            amp = torch.autocast("cpu", dtype=torch.bfloat16)
        with amp:
            loss = loss_of(compiled, x, y)
        (loss / k).backward()
        trace["losses"].append(loss.detach())
        window += 1
        if window == k or i + 1 == len(data):
            after = None if ema is None else ema.update
            trace["norms"].append(ip.hand_update(model, opt, sched, k, window, clip, after))
            window = 0
    logged = _hand_log(spec, trace["losses"])
    return _ended(model, opt, trace, ema, logged)


def _hand_log(spec: Spec, losses: list[torch.Tensor]) -> list[float] | None:
    """What ``log=every`` flushes: the mean of each ``every`` losses (and of the rest), in
    float64 as detach_logging reduces."""
    every = spec["log"]
    if every is None:
        return None
    return [
        torch.stack(losses[i : i + every]).double().mean().item()
        for i in range(0, len(losses), every)
    ]


def run_loopkit(spec: Spec) -> Run:
    """``loopkit.step(torch.compile(model), ...)`` over the same batches."""
    model, data = make_model(spec), make_data(spec)
    compiled = compiled_copy(model)
    opt = make_optimizer(spec, model)
    sched = make_scheduler(spec, opt)
    ema = loopkit.ema(compiled, EMA_DECAY) if spec["ema"] else None
    records: list[dict[str, float]] = []
    log = None
    if spec["log"] is not None:
        log = loopkit.detach_logging(every=spec["log"], sink=records.append)
    step = loopkit.step(
        compiled, opt, precision=spec["precision"], accumulate=spec["accumulate"],
        clip_grad_norm=spec["clip"], scheduler=sched, log=log, ema=ema, measure_grad_norm=True,
    )  # fmt: skip
    trace: dict[str, list[torch.Tensor]] = {"losses": [], "norms": []}
    fresh_compiler()
    torch.manual_seed(spec["seed"] + 2)
    for x, y in step.iterate(data):
        with step as s:
            loss = loss_of(compiled, x, y)
            s.backward(loss)
        trace["losses"].append(loss.detach())
        _note(step, trace)
    step.flush()  # the log's last interval
    logged = None if log is None else [r["loss"] for r in records]
    return _ended(model, opt, trace, ema, logged)


def _note(step: loopkit.step, trace: dict[str, list[torch.Tensor]]) -> None:
    if step.updates > len(trace["norms"]):
        assert step.grad_norm is not None
        trace["norms"].append(step.grad_norm)


def run_micro(spec: Spec, compile_micro: bool) -> Run:
    """The loopkit loop over an eager model, its micro-step a function, compiled or not.

    ``spec["inner"]``: the forward and loss written in the micro-step (``"inline"``: torch's
    own modules and functions, nothing for dynamo to compile) or in a user function it calls
    (``"function"``). Dynamo runs the compiled micro-step's own frame eagerly (``with step``
    breaks the graph) but still compiles each user function it calls, as its own frame: the
    uncompiled loop that trains the same way calls ``torch.compile(loss_of)`` there.
    """
    model, data = make_model(spec), make_data(spec)
    opt = make_optimizer(spec, model)
    sched = make_scheduler(spec, opt)
    ema = loopkit.ema(model, EMA_DECAY) if spec["ema"] else None
    records: list[dict[str, float]] = []
    log = None
    if spec["log"] is not None:
        log = loopkit.detach_logging(every=spec["log"], sink=records.append)
    step = loopkit.step(
        model, opt, precision=spec["precision"], accumulate=spec["accumulate"],
        clip_grad_norm=spec["clip"], scheduler=sched, log=log, ema=ema, measure_grad_norm=True,
    )  # fmt: skip
    inline = spec["inner"] == "inline"
    loss_fn = loss_of if compile_micro or inline else torch.compile(loss_of, backend=BACKEND)

    def micro(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with step as s:
            loss = nn.functional.mse_loss(model(x).float(), y) if inline else loss_fn(model, x, y)
            s.backward(loss)
        return loss.detach()

    fn = torch.compile(micro, backend=BACKEND) if compile_micro else micro
    trace: dict[str, list[torch.Tensor]] = {"losses": [], "norms": []}
    fresh_compiler()
    torch.manual_seed(spec["seed"] + 2)
    for x, y in step.iterate(data):
        trace["losses"].append(fn(x, y))
        _note(step, trace)
    step.flush()
    logged = None if log is None else [r["loss"] for r in records]
    return _ended(model, opt, trace, ema, logged)


# -- the comparison ----------------------------------------------------------------------------


def _same(a: list[torch.Tensor] | None, b: list[torch.Tensor] | None) -> bool:
    if a is None or b is None:
        return a is b
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _close(a: list[float] | None, b: list[float] | None) -> bool:
    """The logged means: equal up to float64 rounding (detach_logging reduces in float64)."""
    if a is None or b is None:
        return a is b
    return len(a) == len(b) and all(
        math.isclose(u, v, rel_tol=1e-12) for u, v in zip(a, b, strict=True)
    )


def differences(got: Run, ref: Run) -> list[str]:
    """What is not bit-identical between two runs (the log: to float64 rounding)."""
    problems = [
        f"the {name} differ"
        for name, a, b in [
            ("losses", got.losses, ref.losses),
            ("grad norms", got.norms, ref.norms),
            ("final weights", got.params, ref.params),
            ("EMA weights", got.ema, ref.ema),
        ]
        if not _same(a, b)
    ]
    if not ip.same_state(got.optimizer, ref.optimizer):
        problems.append("the optimizer states differ")
    if got.lrs != ref.lrs:
        problems.append(f"lr {got.lrs}, reference {ref.lrs}")
    if not _close(got.logged, ref.logged):
        problems.append(f"logged losses {got.logged}, reference {ref.logged}")
    return problems


# -- the scenarios ------------------------------------------------------------------------------


@st.composite
def scenarios(draw: Callable[..., Any]) -> Spec:
    """A small compiled training: windows, clipping, schedule, precision, tail, log, ema."""
    return {
        "accumulate": draw(st.integers(1, 3)),
        "full": draw(st.integers(1, 4)),
        "tail": draw(st.sampled_from([0, 1, 2, 3])),
        "clip": draw(st.sampled_from([None, 0.05, 1.0])),
        "scheduler": draw(st.sampled_from([None, "step"])),
        "optimizer": draw(st.sampled_from(["sgd", "adamw"])),
        "precision": draw(st.sampled_from(["fp32", "bf16"])),
        "dropout": draw(st.sampled_from([0.0, 0.3])),
        "log": draw(st.sampled_from([None, 1, 2])),
        "ema": draw(st.booleans()),
        "seed": draw(st.integers(0, 2**16)),
        "inner": draw(st.sampled_from(["inline", "function"])),
    }


RAGGED: Spec = {
    "accumulate": 3, "full": 4, "tail": 2, "clip": 0.05, "scheduler": "step",
    "optimizer": "adamw", "precision": "bf16", "dropout": 0.3, "log": 2, "ema": True, "seed": 3,
    "inner": "function",
}  # fmt: skip
"""A ragged last window of two micro-steps (the second a smaller batch), bf16, log and ema."""


@prop(ci=EXAMPLES)
@example(RAGGED)
@given(scenarios())
def test_step_around_a_compiled_model_is_the_compiled_hand_loop(spec: Spec) -> None:
    """Same values bit for bit as the hand loop's own compiled copy; no extra graph/recompile."""
    got, ref = run_loopkit(spec), run_hand(spec)
    problems = differences(got, ref)
    for what, n in got.counts.items():
        if n > ref.counts[what]:
            problems.append(f"{n} {what}, the hand loop {ref.counts[what]}")
    assert not problems, f"{'; '.join(problems)} ({where()}; {spec})"
    assert ref.counts["graphs"] >= 1, "the model was not compiled at all"


STEP_BREAKS = 3
"""Graph breaks a compiled micro-step may make: one at each of the step's entry points
(``__enter__``, ``backward``, ``__exit__``, run eagerly: ``_tracing``), once for the run."""


@deep
@prop(ci=EXAMPLES)
@example(RAGGED)
@example({**RAGGED, "inner": "inline", "precision": "fp32", "tail": 1, "log": None})
@given(scenarios())
def test_a_compiled_micro_step_trains_as_the_uncompiled_one(spec: Spec) -> None:
    """torch.compile(micro) around `with step as s:` trains bit for bit as micro uncompiled."""
    got, ref = run_micro(spec, compile_micro=True), run_micro(spec, compile_micro=False)
    problems = differences(got, ref)
    for what in ("graphs", "recompiles"):
        if got.counts[what] > ref.counts[what]:
            problems.append(f"{got.counts[what]} {what}, uncompiled micro-step {ref.counts[what]}")
    if got.counts["graph breaks"] > STEP_BREAKS:
        problems.append(f"{got.counts['graph breaks']} graph breaks (at most {STEP_BREAKS})")
    assert not problems, f"{'; '.join(problems)} ({where()}; {spec})"
