"""detach_logging: one host read per flush, nothing kept alive, exact reductions."""

from __future__ import annotations

import gc
import logging
import math
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


def test_tensorboard_sink_needs_its_directory_said() -> None:
    """No default directory (it was ./runs of wherever the script started): refused, saying
    how; log_dir and writer= together are refused too."""
    with pytest.raises(TypeError, match=r"needs the directory to write to: TensorBoardSink\("):
        loopkit.TensorBoardSink()
    with pytest.raises(TypeError, match="log_dir or writer=, not both"):
        loopkit.TensorBoardSink("runs/x", writer=object())  # type: ignore[arg-type]


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
        (lambda: loopkit.detach_logging(sink=None).record({1: 1.0}), TypeError, "must be str"),
        (lambda: loopkit.detach_logging(sink=None)(n=10**400), ValueError, "too large"),
        (lambda: loopkit.LoggingSink(print), TypeError, "logging.getLogger(__name__)"),
        (lambda: loopkit.LoggingSink(None), TypeError, "or a logger name"),
        (lambda: loopkit.LoggingSink(level="INFO"), TypeError, "such as logging.INFO"),
        (lambda: loopkit.LoggingSink(level=True), TypeError, "such as logging.INFO"),
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


def test_integer_and_float64_counters_sum_exactly() -> None:
    """int64/float64 tensors and Python ints are summed in float64: 16777219, not 16777216."""
    log = loopkit.detach_logging(every=None, sink=None, reduce="sum")
    for n in (16_777_217, 1, 1):
        log(i64=torch.tensor(n), f64=torch.tensor(float(n), dtype=torch.float64), py=n)
    assert log.flush() == {"i64": 16_777_219.0, "f64": 16_777_219.0, "py": 16_777_219.0}


def test_a_metric_logged_in_two_dtypes_is_not_rounded_to_the_narrower() -> None:
    """int64 then float32 values of one metric: each is widened alone (stack would use float32)."""
    log = loopkit.detach_logging(every=None, sink=None, reduce="sum")
    log(x=torch.tensor(16_777_217))
    log(x=torch.tensor(1.0))
    assert log.flush() == {"x": 16_777_218.0}


def test_mean_of_integers_and_bools() -> None:
    """Integer and bool tensors (and Python ints) average as real numbers."""
    log = loopkit.detach_logging(every=None, sink=None)
    for i, b in ((1, True), (2, False), (2, True), (2, True)):
        log(i=torch.tensor(i), b=torch.tensor(b), py=i)
    assert log.flush() == {"i": 1.75, "b": 0.75, "py": 1.75}


@pytest.mark.parametrize("how", ["max", "min", "mean", "sum"])
@pytest.mark.parametrize("where", [0, 1, 2])
@pytest.mark.parametrize("as_tensor", [False, True])
def test_nan_surfaces_for_every_input_type(how: str, where: int, as_tensor: bool) -> None:
    """A NaN anywhere in the interval gives NaN, for Python floats and tensors alike."""
    vals = [1.0, 2.0, -3.0]
    vals[where] = math.nan
    log = loopkit.detach_logging(every=None, sink=None, reduce=how)  # type: ignore[arg-type]
    for v in vals:
        log(x=torch.tensor(v) if as_tensor else v)
    assert math.isnan(log.flush()["x"])


@pytest.mark.parametrize(
    "vals",
    [[math.inf, -math.inf], [1e308, 1e308], [math.inf, 1.0], [-math.inf, math.nan], [5.0]],
)
@pytest.mark.parametrize("how", ["mean", "sum", "max", "min", "last"])
def test_python_numbers_reduce_like_float64_tensors(vals: list[float], how: str) -> None:
    """inf - inf, overflow, inf and NaN: Python floats give what float64 tensors give."""
    results = []
    for wrap in (float, lambda v: torch.tensor(v, dtype=torch.float64)):
        log = loopkit.detach_logging(every=None, sink=None, reduce=how)  # type: ignore[arg-type]
        for v in vals:
            log(x=wrap(v))
        results.append(log.flush()["x"])
    py, tensor = results
    assert py == tensor or (math.isnan(py) and math.isnan(tensor)), (py, tensor)


def test_one_host_read_per_flush_with_mixed_dtypes() -> None:
    """int64, float64, bf16, bool tensors and a Python float: still a single host read."""
    log = loopkit.detach_logging(every=4, sink=None, reduce={"n": "sum", "peak": "max"})
    with loopkit.count_host_syncs() as syncs:
        for i in range(8):
            log(
                n=torch.tensor(i),
                peak=torch.tensor(float(i), dtype=torch.float64),
                loss=torch.tensor(0.5, dtype=torch.bfloat16),
                hit=torch.tensor(i % 2 == 0),
                lr=0.1,
            )
    assert syncs.count == 2, syncs.events
    assert log.last == {"n": 22.0, "peak": 7.0, "loss": 0.5, "hit": 0.5, "lr": 0.1}


def test_logging_sink_accepts_a_logger_adapter_and_a_level() -> None:
    """LoggingSink takes a LoggerAdapter and an int level, and logs at that level."""
    records: list[tuple[int, str]] = []

    class Handler(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append((record.levelno, record.getMessage()))

    logger = logging.getLogger("loopkit.test.adapter")
    logger.addHandler(Handler())
    logger.setLevel(logging.DEBUG)
    sink = loopkit.LoggingSink(logging.LoggerAdapter(logger, {}), level=logging.WARNING)
    sink({"loss": 1.5}, step=3)
    assert records == [(logging.WARNING, "step 3 | loss 1.5")]


def test_sync_ranks_in_a_single_process_reduces_locally() -> None:
    """sync_ranks=True with no process group: the same script runs, values reduce locally."""
    got: list[dict[str, float]] = []
    log = loopkit.detach_logging(every=2, sink=got.append, sync_ranks=True)
    with loopkit.count_host_syncs() as syncs:
        for v in (1.0, 2.0, 3.0, 5.0):
            log(x=torch.tensor(v))
    assert got == [{"x": 1.5}, {"x": 4.0}] and syncs.count == 2


def test_a_flush_that_fails_inside_log_leaves_no_trace(monkeypatch: pytest.MonkeyPatch) -> None:
    """If the reduction raises, the call's values are taken back and the next flush is right."""
    got: list[dict[str, float]] = []
    log = loopkit.detach_logging(every=2, sink=got.append)
    log(x=torch.tensor(1.0))

    def broken(*args: Any) -> dict[str, float]:
        raise RuntimeError("collective timed out")

    monkeypatch.setattr(log, "_reduce", broken)
    with pytest.raises(RuntimeError, match="timed out"):
        log(x=torch.tensor(100.0), new=torch.tensor(5.0))
    monkeypatch.undo()
    assert log.step == 1 and list(log._values) == ["x"] and got == []
    log(x=torch.tensor(3.0))
    assert got == [{"x": 2.0}] and log.step == 2


def test_a_metric_moving_to_another_device_is_refused() -> None:
    """A metric logged from another device than before raises at once and records nothing."""
    log = loopkit.detach_logging(every=None, sink=None)
    log(x=torch.tensor(1.0))
    with pytest.raises(ValueError, match="same device"):
        log(x=torch.tensor(2.0, device="meta"), y=torch.tensor(1.0))
    assert log.step == 1 and log.flush() == {"x": 1.0}


def test_cross_rank_logger_does_not_flush_while_an_exception_propagates() -> None:
    """sync_ranks=True: leaving `with log:` on an error attempts no collective, keeps values."""
    log = loopkit.detach_logging(every=None, sink=None, sync_ranks=True)
    with pytest.raises(KeyError, match="boom"), log:
        log(x=1.0)
        raise KeyError("boom")
    assert log.step == 1 and log._values == {"x": [1.0]}
