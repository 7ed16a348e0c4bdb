"""torch.compile over a whole micro-step (``with step as s: ... s.backward(loss)``) under
autocast: the step's entry points run eagerly, so autocast entered in ``__enter__`` is left
in ``backward`` outside any graph (shared/repros/edges3/r3_16)."""

from __future__ import annotations

import torch
from torch import nn

import loopkit


def _run(compiled: bool) -> tuple[int, list[torch.Tensor]]:
    torch.manual_seed(0)
    data = [(torch.randn(4, 8), torch.randn(4, 1)) for _ in range(4)]
    model = nn.Linear(8, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = loopkit.step(model, opt, precision="bf16", accumulate=2)

    def micro(x: torch.Tensor, y: torch.Tensor) -> None:
        with step as s:
            s.backward(nn.functional.mse_loss(model(x), y))

    fn = torch.compile(micro, backend="eager") if compiled else micro
    for x, y in step.iterate(data):
        fn(x, y)
    return step.updates, [p.detach().clone() for p in model.parameters()]


def test_a_compiled_bf16_micro_step_trains_as_the_eager_one() -> None:
    """Dynamo traces the micro-step (the eager backend: the tracing is what matters); the
    updates and weights equal the uncompiled loop's, bit for bit."""
    torch._dynamo.reset()
    updates, got = _run(compiled=True)
    ref_updates, ref = _run(compiled=False)
    assert updates == ref_updates == 2
    assert all(torch.equal(a, b) for a, b in zip(got, ref, strict=True))


def _run_accumulate(compiled: bool) -> tuple[int, list[torch.Tensor]]:
    torch.manual_seed(0)
    data = [(torch.randn(4, 8), torch.randn(4, 1)) for _ in range(4)]
    model = nn.Linear(8, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    amp = loopkit.autocast_step("bf16", device_type="cpu")
    acc = loopkit.accumulate(model, opt, every=2, amp=amp)

    def micro(x: torch.Tensor, y: torch.Tensor) -> None:
        with acc:
            with amp:
                out = model(x)
            acc.backward(nn.functional.mse_loss(out.float(), y))

    fn = torch.compile(micro, backend="eager") if compiled else micro
    for x, y in acc.iterate(data):
        fn(x, y)
    return acc.updates, [p.detach().clone() for p in model.parameters()]


def test_a_compiled_micro_step_of_the_pieces_trains_as_the_eager_one() -> None:
    """The same with ``accumulate`` and ``autocast_step`` used alone (each asks dynamo itself
    whether it is traced: ``accumulate.backward`` and the autocast's enter and exit)."""
    torch._dynamo.reset()
    updates, got = _run_accumulate(compiled=True)
    ref_updates, ref = _run_accumulate(compiled=False)
    assert updates == ref_updates == 2
    assert all(torch.equal(a, b) for a, b in zip(got, ref, strict=True))
