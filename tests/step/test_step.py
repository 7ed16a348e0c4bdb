"""loopkit.step: the composed loop is bit-identical to the same loop written by hand."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from helpers import assert_bit_equal, batches, loss_fn, mlp, params, twin
from torch import nn

import loopkit

N = 4  # a power of two: loss / N is exact, so the comparison can be bit for bit


def _hand_written(
    model: nn.Module,
    data: list[Any],
    precision: str,
    clip: float | None,
) -> tuple[list[torch.Tensor], float]:
    """The nanoGPT-style loop: autocast forward, loss / N, clip, step, scheduler, zero_grad."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[precision]
    for i, batch in enumerate(data):
        with torch.autocast("cpu", dtype=dtype, enabled=precision != "fp32"):
            loss = loss_fn(model, batch)
        (loss / N).backward()
        if (i + 1) % N == 0:
            if clip is not None:
                nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
    return params(model), sched.get_last_lr()[0]


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
@pytest.mark.parametrize("clip", [None, 0.1])
def test_bit_identical_to_the_hand_written_loop(precision: str, clip: float | None) -> None:
    """Three windows of four micro-batches: the same bits as the hand-written loop."""
    model = mlp()
    ref_model = twin(model)
    data = batches([8] * (3 * N))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
    step = loopkit.step(
        model, opt, precision=precision, accumulate=N, clip_grad_norm=clip, scheduler=sched
    )
    for batch in data:
        with step as s:
            if precision == "bf16":
                assert torch.is_autocast_enabled("cpu")
            loss = loss_fn(model, batch)
            s.backward(loss)
            assert not torch.is_autocast_enabled("cpu")  # backward ran outside autocast
    ref, ref_lr = _hand_written(ref_model, data, precision, clip)
    assert step.updates == 3
    assert_bit_equal(params(model), ref)
    assert sched.get_last_lr()[0] == ref_lr


def test_fp16_bit_identical_to_the_grad_scaler_recipe() -> None:
    """fp16 with accumulation and clipping equals the PyTorch AMP recipe, bit for bit."""
    model = mlp()
    ref_model = twin(model)
    data = batches([8] * (2 * N))
    opt_ref = torch.optim.SGD(ref_model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    for i, batch in enumerate(data):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = loss_fn(ref_model, batch)
        scaler.scale(loss / N).backward()
        if (i + 1) % N == 0:
            scaler.unscale_(opt_ref)
            nn.utils.clip_grad_norm_(ref_model.parameters(), 0.1)
            scaler.step(opt_ref)
            scaler.update()
            opt_ref.zero_grad(set_to_none=True)
    step = loopkit.step(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        precision="fp16",
        accumulate=N,
        clip_grad_norm=0.1,
    )
    for batch in data:
        with step as s:
            s.backward(loss_fn(model, batch))
    assert_bit_equal(params(model), params(ref_model))
    assert step.amp.scaler is not None
    assert step.amp.scaler.get_scale() == scaler.get_scale()


def test_composed_step_makes_no_host_sync_between_log_flushes() -> None:
    """40 fp32 micro-steps, accumulate=4, clipping, log every 10: exactly 4 host reads."""
    model = mlp()
    got: list[dict[str, float]] = []
    # SGD: AdamW's own per-step counter is a host tensor it reads with .item() (no device
    # sync on a GPU, where that counter stays on the host), which a CPU run cannot tell apart.
    step = loopkit.step(
        model,
        torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9),
        accumulate=4,
        clip_grad_norm=1.0,
        log=loopkit.detach_logging(every=10, sink=got.append),
    )
    data = batches([8] * 40)
    with loopkit.count_host_syncs() as syncs:
        for batch in data:
            with step as s:
                loss = loss_fn(model, batch)
                s.backward(loss)
                s.log_metrics(out=loss * 2)
    assert syncs.count == 4, syncs.events
    assert len(got) == 4 and set(got[0]) == {"out", "loss"}
    assert got[0]["out"] == pytest.approx(2 * got[0]["loss"])


def test_iterate_moves_batches_and_closes_the_ragged_window() -> None:
    """step.iterate yields moved batches and makes the last (ragged) window update."""
    model = mlp()
    step = loopkit.step(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        accumulate=4,
        device="cpu",
        channels_last=False,
    )
    data = [{"x": x, "y": y} for x, y in batches([4] * 6)]
    seen = 0
    for batch in step.iterate(data):
        with step as s:
            s.backward(loss_fn(model, (batch["x"], batch["y"])))
        seen += 1
    assert seen == 6 and step.updates == 2 and step.micro_step == 0


def test_building_the_step_inside_the_loop_is_refused() -> None:
    """`with loopkit.step(...)` rebuilt per iteration would drop accumulation: it raises."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = batches([4] * 3)
    with pytest.raises(RuntimeError, match="once, before the loop"):
        for batch in data:
            with loopkit.step(model, opt, accumulate=2) as s:
                s.backward(loss_fn(model, batch))


def test_building_inside_the_loop_without_accumulation_is_the_same_loop() -> None:
    """With accumulate=1 nothing spans iterations, so a step built per iteration is exact."""
    model = mlp()
    ref_model = twin(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.1)
    for batch in batches([4] * 3):
        with loopkit.step(model, opt) as s:
            s.backward(loss_fn(model, batch))
        loss_fn(ref_model, batch).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    assert_bit_equal(params(model), params(ref_model))


def test_middlewares_keep_their_semantics_inside_step() -> None:
    """Autocast covers the forward only; no_sync, weights and flush behave as alone."""
    model = mlp()
    ref_model = twin(model)
    data = batches([3, 5, 2])
    step = loopkit.step(model, torch.optim.SGD(model.parameters(), lr=0.1), accumulate=4)
    for batch in data:
        with step as s:
            assert s.ends_window is False
            s.backward(loss_fn(model, batch), weight=len(batch[0]))
    assert step.flush() is True and step.updates == 1
    acc = loopkit.accumulate(ref_model, torch.optim.SGD(ref_model.parameters(), lr=0.1), every=4)
    for batch in data:
        with acc:
            acc.backward(loss_fn(ref_model, batch), weight=len(batch[0]))
    acc.flush()
    assert_bit_equal(params(model), params(ref_model))


def test_state_dict_round_trip() -> None:
    """Counters and the fp16 scaler state travel together."""
    model = mlp()
    step = loopkit.step(
        model, torch.optim.SGD(model.parameters(), lr=0.1), precision="fp16", accumulate=2
    )
    for batch in batches([4] * 4):
        with step as s:
            s.backward(loss_fn(model, batch))
    state = step.state_dict()
    other = mlp()
    fresh = loopkit.step(
        other, torch.optim.SGD(other.parameters(), lr=0.1), precision="fp16", accumulate=2
    )
    fresh.load_state_dict(state)
    assert fresh.updates == 2 and fresh.state_dict() == state


@pytest.mark.parametrize(
    ("kwargs", "exc", "hint"),
    [
        ({"device": "meta"}, ValueError, "move the model first"),
        ({"log": 0}, ValueError, "int >= 1"),
        ({"precision": "int8"}, ValueError, "'bf16', 'fp16' or 'fp32'"),
        ({"accumulate": 0}, ValueError, "accumulate= must be an int >= 1"),
    ],
)
def test_bad_arguments_are_refused(kwargs: dict[str, Any], exc: type[Exception], hint: str) -> None:
    """Wrong arguments raise at construction, naming the fix."""
    model = mlp()
    with pytest.raises(exc) as info:
        loopkit.step(model, torch.optim.SGD(model.parameters(), lr=0.1), **kwargs)
    assert hint in str(info.value)


def test_log_metrics_needs_a_log() -> None:
    """s.log_metrics without log= is an error, not a silent drop."""
    model = mlp()
    step = loopkit.step(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(RuntimeError, match="log="), step as s:
        s.log_metrics(acc=1.0)


@pytest.mark.parametrize("micro_batch", [None, 2])
def test_log_metrics_loss_is_what_the_log_holds_beside_a_total_backward(
    micro_batch: int | None,
) -> None:
    """``s.log_metrics(loss=data_loss)`` next to ``s.backward(data_loss + penalty)``: the
    log holds the user's loss, not the total (the step's own record gave way to it), with
    micro_batch= too (each batch's chunks' data losses, combined); without log_metrics the
    total is logged."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    for own in (True, False):
        log = loopkit.detach_logging(every=None, sink=None)
        step = loopkit.step(
            model, torch.optim.SGD(model.parameters(), lr=0.0), micro_batch=micro_batch, log=log
        )
        data_losses, totals = [], []
        for xb, yb in step.iterate([(x, y)]):
            with step as s:
                data = nn.functional.mse_loss(model(xb), yb)
                total = data + 10.0 * model.weight.pow(2).sum()
                s.backward(total)
                if own:
                    s.log_metrics(loss=data)
            data_losses.append(data.item())
            totals.append(total.item())
        got = log.flush()["loss"]
        expected = data_losses if own else totals
        assert got == pytest.approx(math.fsum(expected) / len(expected), rel=1e-6)
        assert not own or not math.isclose(got, math.fsum(totals) / len(totals))


def test_a_failed_micro_step_logs_nothing_under_the_next_one() -> None:
    """An error after backward and log_metrics: the next record holds only its own values."""
    model = mlp()
    records: list[dict[str, float]] = []
    step = loopkit.step(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        accumulate=2,
        log=loopkit.detach_logging(every=1, sink=records.append),
    )
    data = batches([4] * 3)
    with step as s:
        s.backward(loss_fn(model, data[0]))
        s.log_metrics(first=1.0)
    with pytest.raises(ValueError, match="boom"), step as s:
        s.backward(loss_fn(model, data[1]) * 0 + 123.0)
        s.log_metrics(bad=7.0)
        raise ValueError("boom")
    with step as s:
        s.log_metrics(acc=0.5)  # no backward: no loss of its own
    assert [set(r) for r in records] == [{"first", "loss"}, {"acc"}]
    assert records[1] == {"acc": 0.5}


def test_a_refused_micro_step_leaves_the_doctor_outside_the_step() -> None:
    """accumulate refuses the entry (two steps of one model): the doctor is not left inside."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    doc = loopkit.doctor()
    body = loopkit.step(model, torch.optim.SGD(model[0].parameters(), lr=0.1))
    head = loopkit.step(model, torch.optim.SGD(model[2].parameters(), lr=0.1), doctor=doc)
    with body, pytest.raises(RuntimeError, match="one optimizer"), head:
        pass
    assert not doc._clock.inside and doc.steps == 0
    with head as s:  # the doctor takes the next step normally
        s.backward(model(torch.ones(2, 8)).sum())
    assert doc.steps == 1


def test_the_accumulate_attribute_is_deprecated_for_accumulator() -> None:
    """step.accumulate (the object) still works, with a DeprecationWarning naming accumulator."""
    model = mlp()
    s = loopkit.step(model, torch.optim.SGD(model.parameters(), lr=0.1), accumulate=2)
    with pytest.warns(DeprecationWarning, match="step.accumulator"):
        assert s.accumulate is s.accumulator


def test_step_decorates_a_micro_step_function() -> None:
    """@step on a micro-step function enters and leaves the step around each call."""
    model, ref_model = mlp(), mlp()
    s = loopkit.step(model, torch.optim.SGD(model.parameters(), lr=0.1), accumulate=2)
    data = batches([4] * 4)

    @s
    def micro_step(batch: Any) -> None:
        s.backward(loss_fn(model, batch))

    for batch in data:
        micro_step(batch)
    ref = loopkit.step(ref_model, torch.optim.SGD(ref_model.parameters(), lr=0.1), accumulate=2)
    for batch in data:
        with ref as r:
            r.backward(loss_fn(ref_model, batch))
    assert s.updates == 2
    assert_bit_equal(params(model), params(ref_model))


def test_updated_says_which_micro_steps_ended_in_an_update() -> None:
    """step.updated (Accelerate's sync_gradients): False inside `with` and mid-window, True
    after a window's last micro-step and after the ragged window iterate closes, False
    after a skipped update; flush() of a partial window sets it; reading it never syncs."""
    model = mlp()
    step = loopkit.step(model, torch.optim.SGD(model.parameters(), lr=0.1), accumulate=2,
                        skip_nonfinite=True)  # fmt: skip
    assert step.updated is False
    seen = []
    data = [b[0] for b in batches([4] * 5)]
    for i, x in enumerate(step.iterate(data)):
        with step as s:
            inside = step.updated
            loss = model(x).pow(2).mean()
            s.backward(loss * float("inf") if i == 3 else loss)
        with loopkit.count_host_syncs() as syncs:
            seen.append((inside, step.updated))
        assert syncs.count == 0
    assert seen == [(False, False), (False, True), (False, False), (False, False), (False, True)]
    assert (step.updates, step.skipped) == (2, 1)
    with step as s:
        s.backward(model(data[0]).pow(2).mean())
    assert step.updated is False
    assert step.flush() is True and step.updated is True
    assert step.accumulator.updated is True  # the same flag on accumulate alone
