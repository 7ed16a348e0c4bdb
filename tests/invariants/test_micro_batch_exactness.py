"""Invariant: micro-batching changes no update.

For generated batch sizes (ragged), chunk sizes, windows, weights (none or samples),
optimizers, clipping and passes, ``loopkit.step(micro_batch=m)`` ends within float32
rounding of the same step run on whole batches (whose own updates test_update_exactness
checks against a float64 reference), with the same number of updates and samples seen.
"""

from __future__ import annotations

from typing import Any

import torch
from hypothesis import given
from hypothesis import strategies as st
from inv_budget import examples
from torch import nn

import loopkit


def _train(spec: dict[str, Any], micro_batch: int | None) -> tuple[list[torch.Tensor], Any]:
    torch.manual_seed(spec["seed"])
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    opt: torch.optim.Optimizer = (
        torch.optim.AdamW(model.parameters(), lr=1e-2)
        if spec["optimizer"] == "adamw"
        else torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    )
    step = loopkit.step(model, opt, accumulate=spec["every"], clip_grad_norm=spec["clip"],
                        micro_batch=micro_batch)  # fmt: skip
    g = torch.Generator().manual_seed(spec["seed"])
    data = [(torch.randn(n, 4, generator=g), torch.randn(n, 2, generator=g)) for n in spec["sizes"]]
    for _ in range(spec["epochs"]):
        for x, y in step.iterate(data):
            with step as s:
                loss = nn.functional.mse_loss(model(x), y)
                s.backward(loss, weight=len(x) if spec["weight"] == "samples" else None)
    return [p.detach().clone() for p in model.parameters()], step


@examples(8)
@given(
    spec=st.fixed_dictionaries(
        {
            "sizes": st.lists(st.integers(1, 9), min_size=1, max_size=6),
            "every": st.integers(1, 3),
            "weight": st.sampled_from([None, "samples"]),
            "optimizer": st.sampled_from(["sgd", "adamw"]),
            "clip": st.sampled_from([None, 0.5]),
            "epochs": st.integers(1, 2),
            "seed": st.integers(0, 2**16),
        }
    ),
    micro_batch=st.integers(1, 5),
)
def test_micro_batches_change_no_update(spec: dict[str, Any], micro_batch: int) -> None:
    """Chunks of ``micro_batch`` samples: the whole batches' weights, updates and samples."""
    whole, a = _train(spec, None)
    split, b = _train(spec, micro_batch)
    assert (a.updates, a.seen.samples) == (b.updates, b.seen.samples)
    for p, q in zip(whole, split, strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=2e-6)
