"""Invariant: compile_optimizer=True updates as the eager optimizer does, and compiles once.

The reference is the same ``loopkit.step`` loop with the eager ``optimizer.step()``. Over
drawn optimizers (every one compile_optimizer takes), param groups with their own lrs,
schedulers (step, cosine, lambda, a warm-up chained to a decay, one-cycle without momentum
cycling), ``accumulate``, clipping, precisions (fp32, bf16) and update counts, the compiled
run must end with every weight and optimizer-state tensor within the tolerance below of the
eager run's, the very same lrs (Python floats, outside the compiled call) and scheduler
states, and no recompile caused by a learning rate; the step's frame compiles at most twice
(an update that creates the optimizer's state runs eagerly, the others compiled).

Tolerance: the compiled step computes lr-derived factors as tensors where the eager one
uses Python floats, so the last bits differ: per tensor, ``max|a - b| <= 1e-5 * max|b| +
1e-6`` after at most 7 updates (relative to the tensor's scale: an RMSprop momentum buffer
is a hundred times its weights). Compiled with ``aot_eager`` in CI, inductor deep.
"""

from __future__ import annotations

from typing import Any

import torch
import torch._dynamo
from helpers import deep
from hypothesis import example, given
from hypothesis import strategies as st
from inv_budget import DEEP, prop, where
from torch import nn
from torch._dynamo.utils import clear_compilation_metrics, get_compilation_metrics

import loopkit

Spec = dict[str, Any]
RTOL, ATOL = 1e-5, 1e-6
BACKEND = "inductor" if DEEP else "aot_eager"
OPTIMIZERS = {
    "AdamW": lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.05),
    "Adam": lambda ps: torch.optim.Adam(ps, lr=0.01, amsgrad=True),
    "SGD": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True),
    "RMSprop": lambda ps: torch.optim.RMSprop(ps, lr=0.01, momentum=0.5),
    "Adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.05),
    "Adamax": lambda ps: torch.optim.Adamax(ps, lr=0.01),
    "NAdam": lambda ps: torch.optim.NAdam(ps, lr=0.01),
    "RAdam": lambda ps: torch.optim.RAdam(ps, lr=0.01),
    "ASGD": lambda ps: torch.optim.ASGD(ps, lr=0.05),
    "Adadelta": lambda ps: torch.optim.Adadelta(ps, lr=0.5),
    "Rprop": lambda ps: torch.optim.Rprop(ps, lr=0.01),
}
SCHEDULERS = {
    "none": lambda o: None,
    "step": lambda o: torch.optim.lr_scheduler.StepLR(o, 2, 0.5),
    "cosine": lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, 8),
    "lambda": lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda n: 1 / (1 + n)),
    "warmup+decay": lambda o: torch.optim.lr_scheduler.SequentialLR(
        o, [torch.optim.lr_scheduler.LinearLR(o, 0.1, total_iters=2),
            torch.optim.lr_scheduler.ExponentialLR(o, 0.8)], milestones=[2]),
    "one-cycle": lambda o: torch.optim.lr_scheduler.OneCycleLR(
        o, 0.05, total_steps=12, cycle_momentum=False),
}  # fmt: skip


def _close(a: torch.Tensor, b: torch.Tensor, context: str) -> None:
    gap = (a.double() - b.double()).abs().max().item() if a.numel() else 0.0
    scale = b.double().abs().max().item() if b.numel() else 0.0
    assert gap <= RTOL * scale + ATOL, f"{gap} apart at scale {scale}: {context}"


def _run(spec: Spec, compiled: bool) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 2))
    groups: Any = model.parameters()
    if spec["groups"] == 2:
        groups = [{"params": model[0].parameters(), "lr": 0.02},
                  {"params": model[2].parameters()}]  # fmt: skip
    opt = OPTIMIZERS[spec["optimizer"]](groups)
    sched = SCHEDULERS[spec["scheduler"]](opt)
    step = loopkit.step(
        model, opt, precision=spec["precision"], accumulate=spec["every"], scheduler=sched,
        clip_grad_norm=spec["clip"], compile_optimizer={"backend": BACKEND} if compiled else False,
    )  # fmt: skip
    g = torch.Generator().manual_seed(1)
    for _ in range(spec["updates"] * spec["every"]):
        with step as s:
            x, y = torch.randn(3, 5, generator=g), torch.randn(3, 2, generator=g)
            s.backward(nn.functional.mse_loss(model(x).float(), y))
    return model, opt, sched


@st.composite
def specs(draw: Any) -> Spec:
    return {
        "optimizer": draw(st.sampled_from(sorted(OPTIMIZERS))),
        "scheduler": draw(st.sampled_from(sorted(SCHEDULERS))),
        "groups": draw(st.sampled_from([1, 2])),
        "every": draw(st.integers(1, 3)),
        "clip": draw(st.sampled_from([None, 0.5])),
        "precision": draw(st.sampled_from(["fp32", "bf16"])),
        "updates": draw(st.integers(2, 7)),
    }


@deep
@prop(ci=6)
@given(specs())
@example({"optimizer": "AdamW", "scheduler": "warmup+decay", "groups": 2, "every": 2,
          "clip": 0.5, "precision": "bf16", "updates": 6})  # fmt: skip
@example({"optimizer": "SGD", "scheduler": "one-cycle", "groups": 1, "every": 1,
          "clip": None, "precision": "fp32", "updates": 7})  # fmt: skip
def test_the_compiled_step_updates_as_the_eager_one_and_never_recompiles_for_an_lr(
    spec: Spec,
) -> None:
    """Weights and optimizer state within tolerance, lrs and scheduler state equal, no lr
    recompile, at most two compilations of the step."""
    eager, eager_opt, eager_sched = _run(spec, False)
    torch._dynamo.reset()
    clear_compilation_metrics()
    model, opt, sched = _run(spec, True)
    metrics = [e for e in get_compilation_metrics() if e.co_name == "_step"]
    context = f"{spec} ({where()})"
    assert 1 <= len(metrics) <= 2, context
    assert not [e for e in metrics if "['lr']" in (e.recompile_reason or "")], context
    for p, q in zip(model.parameters(), eager.parameters(), strict=True):
        _close(p.detach(), q.detach(), context)
    for a, b in zip(opt.state.values(), eager_opt.state.values(), strict=True):
        for key in a:
            _close(torch.as_tensor(a[key]), torch.as_tensor(b[key]), f"{key} of {context}")
    assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in eager_opt.param_groups]
    assert all(type(g["lr"]) is float for g in opt.param_groups), context
    if sched is not None:
        assert sched.state_dict() == eager_sched.state_dict(), context
