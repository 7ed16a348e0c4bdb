"""Invariant: the EMA is the float64 closed form over the real updates, whatever the loop.

For generated batch sizes (ragged), windows, precisions (fp16 with an inf window that the
scaler skips, bf16, fp32), skip_nonfinite, micro_batch chunks, ``every=``, warm-up, decays,
parameter dtypes (fp32, bf16) and optimizers, the average after training equals
``s <- d_k s + (1 - d_k) p_k`` in float64 over the parameters ``p_k`` after each update that
ran, counting only every ``every``-th, with ``d_k`` from the warm-up's own count; its updates
are the real updates // every, its buffers the model's at the last average.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from inv_budget import examples
from torch import nn

import loopkit
from loopkit._ema._decay import decay_at


class Counting(nn.Module):
    """A buffer the forward changes (as BatchNorm's statistics), for any batch size."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("samples", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.samples += x.shape[0]
        return x


@pytest.mark.filterwarnings("ignore:fp16 autocast on a CPU")
@examples(10)
@given(
    spec=st.fixed_dictionaries(
        {
            "sizes": st.lists(st.integers(1, 7), min_size=1, max_size=9),
            "accumulate": st.integers(1, 3),
            "precision": st.sampled_from(["fp32", "bf16", "fp16"]),
            "inf_at": st.none() | st.integers(0, 8),
            "micro_batch": st.none() | st.integers(1, 4),
            "every": st.integers(1, 3),
            "warmup": st.booleans(),
            "decay": st.sampled_from([0.0, 0.5, 0.9, 0.999]),
            "weights": st.sampled_from(["fp32", "bf16"]),
            "optimizer": st.sampled_from(["sgd", "adamw"]),
            "seed": st.integers(0, 2**16),
        }
    )
)
def test_the_average_is_the_closed_form_of_the_real_updates(spec: dict[str, Any]) -> None:
    """Averages = real updates // every, each the float64 recurrence (fp32 average)."""
    torch.manual_seed(spec["seed"])
    model = nn.Sequential(nn.Linear(4, 8), Counting(), nn.Tanh(), nn.Linear(8, 2))
    if spec["weights"] == "bf16":
        model[3].to(torch.bfloat16)  # a mixed model: the last layer in bf16
    opt: torch.optim.Optimizer = (
        torch.optim.AdamW(model.parameters(), lr=1e-2)
        if spec["optimizer"] == "adamw"
        else torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    )
    average = loopkit.ema(model, decay=spec["decay"], warmup=spec["warmup"], every=spec["every"])
    step = loopkit.step(model, opt, accumulate=spec["accumulate"], precision=spec["precision"],
                        skip_nonfinite=spec["precision"] != "fp16",
                        micro_batch=spec["micro_batch"], ema=average)  # fmt: skip
    start = [p.detach().double() for p in model.parameters()]
    g = torch.Generator().manual_seed(spec["seed"])
    data = [(torch.randn(n, 4, generator=g), torch.randn(n, 2, generator=g))
            for n in spec["sizes"]]  # fmt: skip
    after: list[list[torch.Tensor]] = []
    buffers: list[torch.Tensor] = []
    for i, (x, y) in enumerate(step.iterate(data)):
        updates = step.updates
        with step as s:
            out = model[3](model[2](model[1](model[0](x))).to(model[3].weight.dtype))
            loss = nn.functional.mse_loss(out.float(), y)
            s.backward(loss * float("inf") if i == spec["inf_at"] else loss)
        if step.updates > updates:  # a real update (a skipped one leaves the count)
            after.append([p.detach().double() for p in model.parameters()])
            if len(after) % spec["every"] == 0:
                buffers = [b.clone() for b in model.buffers()]
    assert average.seen == step.updates == len(after)
    assert average.updates == len(after) // spec["every"]
    shadow = start
    for k, params in enumerate(after[spec["every"] - 1 :: spec["every"]], start=1):
        d = decay_at(k, spec["decay"], spec["warmup"], 1.0, 2 / 3)
        shadow = [d * s + (1 - d) * p for s, p in zip(shadow, params, strict=True)]
    for got, want in zip(average.shadow, shadow, strict=True):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)
    if average.updates:
        for got, want in zip(average.buffers, buffers, strict=True):
            assert torch.equal(got, want)
