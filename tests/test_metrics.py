"""detach_logging: one host read per flush, nothing kept alive, exact reductions."""

from __future__ import annotations

import gc
import logging
import weakref
from typing import Any

import pytest
import torch
from torch import nn

import loopkit


def test_one_host_sync_per_flush_over_100_steps() -> None:
    """100 steps with every=10 and three metrics make exactly 10 host reads."""
    model = nn.Linear(4, 1)
    flushed: list[dict[str, float]] = []
    log = loopkit.detach_logging(every=10, sink=flushed.append)
    data = [torch.randn(8, 4) for _ in range(100)]
    with loopkit.count_host_syncs() as syncs:
        for x in data:
            out = model(x)
            loss = out.pow(2).mean()
            loss.backward()
            log(loss=loss, out_max=out.max(), lr=0.1)
    assert syncs.count == 10, syncs.events
    assert len(flushed) == 10


def test_item_every_step_is_what_the_counter_sees() -> None:
    """The counter is not blind: the .item()-per-step habit makes 100 reads."""
    with loopkit.count_host_syncs() as syncs:
        for _ in range(100):
            torch.randn(3).sum().item()
    assert syncs.count == 100


def test_recorded_values_hold_no_graph() -> None:
    """Values are stored detached: no grad_fn, and the graph they came from is freed."""
    log = loopkit.detach_logging(every=None, sink=None)
    x = torch.randn(4, requires_grad=True)
    h = x * 2
    y = (h * h).sum()  # the graph saves h for backward
    ref = weakref.ref(h)
    log(loss=y)
    stored = log._values["loss"][0]
    assert stored.grad_fn is None and not stored.requires_grad
    del h, y
    gc.collect()
    assert ref() is None  # the graph was not kept alive by the logger


def test_reductions_match_a_hand_computation() -> None:
    """mean/sum/max/min/last over one interval equal the same reductions done by hand."""
    got: list[dict[str, float]] = []
    log = loopkit.detach_logging(
        every=5, sink=got.append, reduce={"s": "sum", "mx": "max", "mn": "min", "l": "last"}
    )
    vals = [torch.tensor(v) for v in (3.0, -1.0, 4.5, 2.0, 0.25)]
    for v in vals:
        log(m=v, s=v, mx=v, mn=v, l=v, py=float(v))
    assert got == [
        {
            "m": pytest.approx(8.75 / 5),
            "s": 8.75,
            "mx": 4.5,
            "mn": -1.0,
            "l": 0.25,
            "py": pytest.approx(8.75 / 5),
        }
    ]
    assert log.last == got[0]


def test_bf16_values_are_reduced_in_float32() -> None:
    """Low-precision metrics are upcast before reducing, so the mean is not rounded to bf16."""
    log = loopkit.detach_logging(every=None, sink=None)
    for v in (1.0, 1.0078125, 1.0078125):  # exact in bf16; their mean is not
        log(x=torch.tensor(v, dtype=torch.bfloat16))
    assert log.flush()["x"] == pytest.approx((1.0 + 2 * 1.0078125) / 3, abs=1e-7)


def test_flush_and_context_exit_send_the_tail() -> None:
    """A partial interval is sent by flush() and by leaving `with log:`."""
    got: list[dict[str, float]] = []
    with loopkit.detach_logging(every=10, sink=got.append) as log:
        for i in range(13):
            log(i=torch.tensor(float(i)))
    assert [d["i"] for d in got] == [4.5, 11.0]
    assert log.flush() == {}  # nothing left


def test_decorator_records_and_returns_unchanged() -> None:
    """@log on a function logs a returned tensor (or dict) and hands it back as it was."""
    got: list[dict[str, float]] = []
    log = loopkit.detach_logging(every=2, sink=got.append)

    @log
    def train_step(x: torch.Tensor) -> torch.Tensor:
        return (x * 2).sum()

    @log
    def metrics(x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"a": x.sum(), "b": x.mean()}

    x = torch.ones(3, requires_grad=True)
    out = train_step(x)
    assert out.grad_fn is not None  # returned as is, still differentiable
    train_step(x)
    assert got == [{"train_step": 6.0}]
    res = metrics(torch.ones(2))
    metrics(torch.ones(2))
    assert set(res) == {"a", "b"} and got[-1] == {"a": 2.0, "b": 1.0}


def test_sinks_receive_the_step() -> None:
    """print_sink and LoggingSink get the step count; a plain callable gets only the dict."""
    records: list[str] = []

    class Handler(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    logger = logging.getLogger("loopkit.test")
    logger.addHandler(Handler())
    logger.setLevel(logging.INFO)
    log = loopkit.detach_logging(every=2, sink=loopkit.LoggingSink(logger))
    for v in (1.0, 3.0):
        log(loss=torch.tensor(v))
    assert records == ["step 2 | loss 2"]


def test_print_sink(capsys: pytest.CaptureFixture[str]) -> None:
    """The default sink prints one line per flush."""
    log = loopkit.detach_logging(every=1)
    log(loss=torch.tensor(0.5))
    assert capsys.readouterr().out == "step 1 | loss 0.5\n"


def test_tensorboard_sink_writes_scalars() -> None:
    """TensorBoardSink forwards each metric with the step to a SummaryWriter-like writer."""
    calls: list[tuple[Any, ...]] = []

    class Writer:
        def add_scalar(self, name: str, value: float, global_step: int) -> None:
            calls.append((name, value, global_step))

        def flush(self) -> None:
            calls.append(("flush",))

    log = loopkit.detach_logging(every=1, sink=loopkit.TensorBoardSink(writer=Writer()))
    log(loss=torch.tensor(2.0))
    assert calls == [("loss", 2.0, 1), ("flush",)]


@pytest.mark.parametrize(
    ("call", "exc", "hint"),
    [
        (lambda: loopkit.detach_logging(every=0), ValueError, "every must be an int >= 1"),
        (lambda: loopkit.detach_logging(every=2.5), ValueError, "every must be an int >= 1"),
        (lambda: loopkit.detach_logging(sink=3), TypeError, "sink must be callable"),
        (lambda: loopkit.detach_logging(reduce="median"), ValueError, "'last'"),
        (lambda: loopkit.detach_logging(reduce={"a": "avg"}), ValueError, "'mean'"),
        (lambda: loopkit.detach_logging(sink=None)(loss=torch.ones(3)), ValueError, "value.mean()"),
        (lambda: loopkit.detach_logging(sink=None)(loss="x"), TypeError, "scalar tensor"),
        (lambda: loopkit.detach_logging(sink=None)(), TypeError, "log(loss=loss"),
        (lambda: loopkit.detach_logging(sink=None)(3), TypeError, "keyword"),
    ],
)
def test_bad_input_is_refused_with_a_fix(call: Any, exc: type[Exception], hint: str) -> None:
    """Bad arguments and bad metric values raise errors that say what to do."""
    with pytest.raises(exc) as info:
        call()
    assert hint in str(info.value)


def test_a_bad_call_records_nothing() -> None:
    """If one metric of a call is bad, none of that call's metrics is stored."""
    log = loopkit.detach_logging(every=None, sink=None)
    with pytest.raises(ValueError):
        log(good=torch.tensor(1.0), bad=torch.ones(2))
    assert log.step == 0 and log.flush() == {}
    log(x=torch.tensor(1.0))
    with pytest.raises(TypeError, match="same way"):
        log(x=1.0)
