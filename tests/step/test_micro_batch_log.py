"""micro_batch= with log=: a batch's record holds its own chunks' values only, combines them
as the log reduces (wide, NaN and inf as IEEE says), and refuses what the log refuses."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn

import loopkit
from loopkit._step import _micro_batch as micro_batch


def _zero_model() -> tuple[nn.Module, torch.optim.Optimizer]:
    """A model that stays at zero (lr 0): every chunk of batch b has loss (10 b)^2 exactly."""
    model = nn.Linear(4, 1)
    nn.init.zeros_(model.weight)
    nn.init.zeros_(model.bias)
    return model, torch.optim.SGD(model.parameters(), lr=0.0)


def _batches(n: int, size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(size, 4, generator=g), torch.full((size, 1), 10.0 * b)) for b in range(n)]


@pytest.mark.parametrize(
    ("size", "chunk", "failing"), [(8, 4, 1), (9, 2, 4), (6, 3, 0), (12, 5, 2)]
)
def test_a_batch_whose_chunk_raised_leaves_nothing_in_the_next_batchs_record(
    size: int, chunk: int, failing: int
) -> None:
    """A chunk of batch 0 raises (the loop skips it): batch 0 logs nothing if that was its
    last chunk (else its other chunks' values), and every later batch logs its own loss
    alone (the failed batch's earlier chunks were averaged into the next batch's record)."""
    model, opt = _zero_model()
    got: list[float] = []
    log = loopkit.detach_logging(every=1, sink=lambda d: got.append(d["loss"]))
    step = loopkit.step(model, opt, micro_batch=chunk, log=log)
    for i, (x, y) in enumerate(step.iterate(_batches(3, size))):
        try:
            with step as s:
                s.backward(nn.functional.mse_loss(model(x), y))
                if i == failing:
                    raise KeyError("a bad sample")
        except KeyError:
            pass
    step.flush()
    last_of_first = failing == -(-size // chunk) - 1
    assert got == ([] if last_of_first else [0.0]) + [100.0, 400.0]


@pytest.mark.parametrize("sits_out", [0, 1, 2])
def test_a_group_member_that_sits_out_a_chunk_logs_no_other_batchs_values(sits_out: int) -> None:
    """In a loopkit.steps group sharing micro_batch=, a member that sits out one chunk of
    batch 0 logs batch 0 not at all (its last chunk skipped) or whole, and batch 1 alone."""
    (a, opt_a), (b, opt_b) = _zero_model(), _zero_model()
    got_a: list[float] = []
    got_b: list[float] = []
    log_a = loopkit.detach_logging(every=1, sink=lambda d: got_a.append(d["loss"]))
    log_b = loopkit.detach_logging(every=1, sink=lambda d: got_b.append(d["loss"]))
    step_a = loopkit.step(a, opt_a, micro_batch=4, log=log_a)
    step_b = loopkit.step(b, opt_b, micro_batch=4, log=log_b)
    for i, (x, y) in enumerate(loopkit.steps(step_a, step_b).iterate(_batches(2, 12))):
        with step_a as s:
            s.backward(nn.functional.mse_loss(a(x), y))
        if i != sits_out:
            with step_b as s:
                s.backward(nn.functional.mse_loss(b(x), y))
    assert got_a == [0.0, 100.0]
    assert got_b == ([0.0, 100.0] if sits_out < 2 else [100.0])


def test_chunks_combine_wide_so_counters_and_float64_losses_stay_exact() -> None:
    """Tensors combine in float64: an int64 counter past float32's 2**24 sums exactly, and
    a float64 loss's weighted mean is float64's (before: float32, 33554432 for 33554434)."""
    how = {"count": "sum"}.get
    parts: list[tuple[Any, dict[str, Any]]] = [
        (0.5, {"count": torch.tensor(2**25, dtype=torch.int64),
               "loss": torch.tensor(2.5577407153, dtype=torch.float64)}),
        (0.5, {"count": torch.tensor(2, dtype=torch.int64),
               "loss": torch.tensor(2.5577407151, dtype=torch.float64)}),
    ]  # fmt: skip
    out = micro_batch.combined(parts, lambda n: how(n, "mean"))
    assert int(out["count"]) == 2**25 + 2
    assert float(out["loss"]) == pytest.approx(2.5577407152, abs=1e-15)


@pytest.mark.parametrize("how", ["max", "min"])
@pytest.mark.parametrize("as_tensor", [False, True])
def test_a_nan_in_any_chunk_shows_in_its_batchs_max_and_min(how: str, as_tensor: bool) -> None:
    """max/min of a batch's chunks is NaN when any chunk's value is, wherever it comes (the
    built-in max of Python numbers dropped a NaN that came after a number)."""
    for values in ([1.0, math.nan], [math.nan, 1.0], [0.5, math.nan, 2.0]):
        parts = [(1.0, {"m": torch.tensor(v) if as_tensor else v}) for v in values]
        assert math.isnan(float(micro_batch.combined(parts, lambda n: how)["m"]))


@pytest.mark.parametrize(("values", "summed", "mean"), [
    ([math.inf, -math.inf], math.nan, math.nan), ([1e308, 1e308], math.inf, 1e308),
    ([math.inf, 1.0], math.inf, math.inf),
])  # fmt: skip
def test_infinite_numbers_combine_as_ieee_says(
    values: list[float], summed: float, mean: float
) -> None:
    """Python numbers with inf, -inf or an overflowing sum combine to inf or NaN, as the
    log's own reduction gives, instead of raising after the update (math.fsum's errors)."""
    parts = [(0.5, {"m": v}) for v in values]
    for how, expected in (("sum", summed), ("mean", mean)):
        got = micro_batch.combined(parts, lambda n, how=how: how)["m"]
        assert (math.isnan(got) and math.isnan(expected)) or got == expected


def test_chunks_refuse_what_the_log_refuses_before_combining() -> None:
    """A non-scalar tensor, a complex one, a metric a tensor in one chunk and a number in
    another: the log's own messages, not torch's reshape error."""
    with pytest.raises(ValueError, match=r"metric 'acc' has shape \(2,\)"):
        micro_batch.combined([(1.0, {"acc": torch.ones(2)})], lambda n: "mean")
    with pytest.raises(ValueError, match="complex"):
        micro_batch.combined([(1.0, {"z": torch.tensor(1j)})], lambda n: "mean")
    mixed: list[tuple[Any, dict[str, Any]]] = [(0.5, {"m": 1.0}), (0.5, {"m": torch.tensor(2.0)})]
    with pytest.raises(TypeError, match="the same way every call"):
        micro_batch.combined(mixed, lambda n: "mean")


@pytest.mark.parametrize("chunked", [None, 4])
def test_log_metrics_refuses_a_non_scalar_before_the_update(chunked: int | None) -> None:
    """``s.log_metrics(acc=<2 values>)`` raises the log's message inside the micro-step, so
    the window's update is not made (it used to raise at exit, after the update; under
    micro_batch= it was torch's reshape error)."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    before = [p.detach().clone() for p in model.parameters()]
    step = loopkit.step(model, torch.optim.SGD(model.parameters(), lr=0.1),
                        micro_batch=chunked, log=loopkit.detach_logging(every=1))  # fmt: skip
    with pytest.raises(ValueError, match=r"metric 'acc' has shape \(2,\)"):
        for x, y in step.iterate(_batches(1, 8)):
            with step as s:
                s.backward(nn.functional.mse_loss(model(x), y))
                s.log_metrics(acc=torch.ones(2))
    assert step.updates == 0
    assert all(torch.equal(p, q) for p, q in zip(before, model.parameters(), strict=True))
