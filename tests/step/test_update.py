"""The update's norm: summed in the model's order (the hand loop's bits), measured unclipped too."""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn

import loopkit


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(16, 48), nn.GELU(), nn.Linear(48, 48), nn.LayerNorm(48), nn.Linear(48, 1)
    )


def _shuffled_groups(model: nn.Module, seed: int) -> torch.optim.Optimizer:
    """AdamW over the parameters in a shuffled order, split in groups (minGPT-style)."""
    named = list(model.named_parameters())
    random.Random(seed).shuffle(named)
    cut = len(named) // 2
    return torch.optim.AdamW(
        [{"params": [p for _, p in named[:cut]], "weight_decay": 0.1},
         {"params": [p for _, p in named[cut:]], "weight_decay": 0.0}], lr=1e-2,
    )  # fmt: skip


def _data(seed: int, n: int, scale: float = 10.0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 16, generator=g) * scale, torch.randn(8, 1, generator=g))
            for _ in range(n)]  # fmt: skip


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("every", [1, 3])
def test_clipping_is_bit_identical_to_the_hand_loop_whatever_the_group_order(
    seed: int, every: int
) -> None:
    """clip_grad_norm= equals clip_grad_norm_(model.parameters()) of the hand loop bit for bit:
    norms and weights, with the optimizer's groups listing the parameters in any order."""
    data = _data(seed, 12)
    model = _model(seed)
    opt = _shuffled_groups(model, seed)
    hand_norms = []
    for i in range(0, len(data), every):
        opt.zero_grad(set_to_none=True)
        for x, y in data[i : i + every]:
            (nn.functional.mse_loss(model(x), y) / every).backward()
        hand_norms.append(nn.utils.clip_grad_norm_(model.parameters(), 0.5))
        opt.step()
    hand = [p.detach().clone() for p in model.parameters()]
    model = _model(seed)
    opt = _shuffled_groups(model, seed)
    step = loopkit.step(model, opt, accumulate=every, clip_grad_norm=0.5)
    norms = []
    for x, y in step.iterate(data):
        with step as s:
            s.backward(nn.functional.mse_loss(model(x), y))
        if step.updated:
            assert step.grad_norm is not None
            norms.append(step.grad_norm.clone())
    assert len(norms) == len(hand_norms)
    assert all(torch.equal(a, b) for a, b in zip(hand_norms, norms, strict=True))
    assert all(torch.equal(a, p) for a, p in zip(hand, model.parameters(), strict=True))


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_the_norm_is_measured_without_clipping(precision: str) -> None:
    """Without clip_grad_norm=, measure_grad_norm=True makes step.grad_norm the window's total
    norm (unscaled under fp16), a device tensor, and the weights are the unclipped updates'."""
    data = _data(5, 8, scale=0.01)  # small enough for fp16's first scale
    model = _model(5)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    step = loopkit.step(model, opt, accumulate=2, precision=precision, measure_grad_norm=True)
    ref_model = _model(5)
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=1e-3)
    got, want = [], []
    for i, (x, y) in enumerate(step.iterate(data)):
        with step as s:
            s.backward(nn.functional.mse_loss(model(x), y))
        if step.updated:
            assert isinstance(step.grad_norm, torch.Tensor)
            got.append(float(step.grad_norm))
        if precision == "fp32":  # the same windows by hand, fp32
            if i % 2 == 0:
                ref_opt.zero_grad()
            (nn.functional.mse_loss(ref_model(x), y) / 2).backward()
            if i % 2 == 1:
                want.append(float(nn.utils.clip_grad_norm_(ref_model.parameters(), float("inf"))))
                ref_opt.step()
    assert len(got) == 4 and all(g > 0 for g in got)
    if precision == "fp32":
        assert got == want
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref_model.parameters(),
                                                      strict=True))  # fmt: skip
    else:  # the norm of true gradients: within autocast's rounding of fp32's
        fp32 = _model(5)
        ref = loopkit.step(fp32, torch.optim.SGD(fp32.parameters(), lr=1e-3), accumulate=2,
                           measure_grad_norm=True)  # fmt: skip
        ref_norms = []
        for x, y in ref.iterate(data):
            with ref as s:
                s.backward(nn.functional.mse_loss(fp32(x), y))
            if ref.updated:
                ref_norms.append(float(ref.grad_norm))  # type: ignore[arg-type]
        assert got == pytest.approx(ref_norms, rel=5e-2)


def test_an_infinite_clip_is_refused_with_the_way_to_read_the_norm() -> None:
    """clip_grad_norm=inf says how to measure the norm without clipping (measure_grad_norm)."""
    model = _model(0)
    with pytest.raises(ValueError, match=r"measure_grad_norm=True: step\.grad_norm"):
        loopkit.step(model, torch.optim.SGD(model.parameters(), lr=0.1),
                     clip_grad_norm=float("inf"))  # fmt: skip
