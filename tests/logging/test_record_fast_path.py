"""detach_logging.record's common call: no device op, no host read, no tensor made; the
full checks whenever a value is not logged as its metric was, with the same results."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from helpers import AtenOps
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import loopkit


def test_a_repeated_call_runs_no_device_op_and_makes_no_tensor() -> None:
    """Between flushes a value already free of any graph is kept as the very object logged:
    no aten op, no host read; one that requires grad costs one detach; the flush one read."""
    got: list[dict[str, float]] = []
    log = loopkit.detach_logging(every=50, sink=got.append)
    log(loss=torch.tensor(0.5), acc=torch.tensor(1.0))  # the first call: checked in full
    values = [(torch.tensor(i / 4), torch.tensor(1.0)) for i in range(47)]
    with loopkit.count_host_syncs() as syncs, AtenOps() as seen:
        for loss, acc in values:
            log(loss=loss, acc=acc)
    assert seen.ops == [] and syncs.count == 0, (seen.ops, syncs.events)
    assert all(a is b for a, (b, _) in zip(log._values["loss"][1:], values, strict=True))
    grad = torch.tensor(2.0, requires_grad=True) * 1.0
    one = torch.tensor(1.0)
    with AtenOps() as seen:
        log(loss=grad, acc=one)
    assert seen.ops == ["detach"] and log._values["loss"][-1].grad_fn is None
    with loopkit.count_host_syncs() as syncs:
        log(loss=torch.tensor(0.0), acc=torch.tensor(1.0))  # the 50th call: the flush
    assert syncs.count == 1 and len(got) == 1
    expected = math.fsum([0.5, *(i / 4 for i in range(47)), 2.0, 0.0]) / 50
    assert got[0] == {"loss": expected, "acc": 1.0}


def test_a_bad_value_after_appended_ones_records_nothing() -> None:
    """A call whose later value is refused (another device, another kind, a shape) takes
    back the values of that call already appended: the interval is as before the call."""
    log = loopkit.detach_logging(every=None, sink=None)
    for _ in range(2):
        log(x=torch.tensor(1.0), y=torch.tensor(2.0), z=0.5)
    bad: list[tuple[dict[str, Any], type[Exception]]] = [
        ({"x": torch.tensor(3.0), "y": torch.tensor(3.0, device="meta")}, ValueError),
        ({"x": torch.tensor(3.0), "z": torch.tensor(0.5)}, TypeError),
        ({"x": torch.tensor(3.0), "y": torch.ones(2)}, ValueError),
        ({"z": 1.0, "x": 2.0}, TypeError),
    ]
    for metrics, error in bad:
        with pytest.raises(error):
            log.record(metrics)
        assert log.step == 2 and {k: len(v) for k, v in log._values.items()} == {
            "x": 2,
            "y": 2,
            "z": 2,
        }
    assert log.flush() == {"x": 1.0, "y": 2.0, "z": 0.5}


def test_a_flush_that_fails_on_a_repeated_call_leaves_no_trace(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The flushing call of metrics seen before: if the reduction raises, its values, the
    count and the place in the interval are taken back."""
    got: list[dict[str, float]] = []
    log = loopkit.detach_logging(every=3, sink=got.append)
    log(x=torch.tensor(1.0), y=1.0)
    log(x=torch.tensor(2.0), y=2.0)

    def broken(*args: Any) -> dict[str, float]:
        raise RuntimeError("collective timed out")

    monkeypatch.setattr(log, "_reduce", broken)
    with pytest.raises(RuntimeError, match="timed out"):
        log(x=torch.tensor(100.0), y=100.0)
    monkeypatch.undo()
    assert log.step == 2 and log._calls_since_flush == 2 and got == []
    assert [len(v) for v in log._values.values()] == [2, 2]
    log(x=torch.tensor(3.0), y=3.0)
    assert got == [{"x": 2.0, "y": 2.0}]


def test_restoring_a_snapshot_twice_gives_the_same_interval() -> None:
    """A snapshot restored, logged after, then restored again holds only its own values (the
    log appends to its lists, so restore hands it copies)."""
    log = loopkit.detach_logging(every=None, sink=None)
    log(x=torch.tensor(1.0))
    snap = log.snapshot()
    for _ in range(2):
        log.restore(snap)
        log(x=torch.tensor(5.0))
    log.restore(snap)
    assert log.step == 1 and log.flush() == {"x": 1.0}


def test_a_restored_interval_is_checked_against_its_own_values() -> None:
    """After restore, the next value is checked against the restored values, not against the
    values logged since the snapshot: a tensor where the snapshot holds numbers is refused."""
    log = loopkit.detach_logging(every=None, sink=None)
    log(x=1.0)
    snap = log.snapshot()
    log.flush()
    for v in (2.0, 3.0):
        log(x=torch.tensor(v))
    log.restore(snap)
    with pytest.raises(TypeError, match="Python number before"):
        log(x=torch.tensor(4.0))
    assert log.flush() == {"x": 1.0}


_REDUCE = {"a": "mean", "b": "sum", "c": "max", "d": "min", "e": "last", "q": "mean"}
# Each metric's value as a dyadic number (k / 4; bf16 rounds some to 8 significant bits): its
# sums are exact in float64 in any order, so the flushes must equal the reference exactly.
_VALUE = st.integers(-512, 512).map(lambda k: k / 4)
# How ``q`` is logged in a call: float32, float64 (mixed dtypes are widened), or a float.
_Q_KIND = st.sampled_from(["f32", "f64", "float"])
_CALL = st.tuples(
    st.dictionaries(st.sampled_from(sorted(_REDUCE)), _VALUE, min_size=1),
    _Q_KIND,
    st.booleans(),  # a bad value (shape (2,)) for the call's first metric
)


def _as_logged(name: str, v: float, q_kind: str) -> torch.Tensor | float:
    if name == "b":
        return torch.tensor(int(v * 4))  # int64
    if name == "c":
        return torch.tensor(v, dtype=torch.bfloat16)
    if name == "q":
        if q_kind == "float":
            return v
        return torch.tensor(v, dtype=torch.float32 if q_kind == "f32" else torch.float64)
    return torch.tensor(v, requires_grad=name == "d") * 1.0  # "d" carries a graph


def _reference(values: dict[str, list[float]]) -> dict[str, float]:
    out = {}
    for name, vals in values.items():
        how = _REDUCE[name]
        if how == "mean":
            out[name] = math.fsum(vals) / len(vals)
        elif how == "sum":
            out[name] = math.fsum(vals)
        elif how in ("max", "min"):
            out[name] = max(vals) if how == "max" else min(vals)
        else:
            out[name] = vals[-1]
    return out


@settings(max_examples=60, deadline=None, derandomize=True)
@given(every=st.integers(1, 6), calls=st.lists(_CALL, min_size=1, max_size=30))
def test_flushes_equal_a_float64_reference_whatever_the_calls(
    every: int, calls: list[tuple[dict[str, float], str, bool]]
) -> None:
    """Any sequence of calls (metrics appearing and leaving, int64/bf16/float32 tensors,
    graphs, a metric switching dtype or between tensor and float, refused calls): every
    flush equals the float64 reduction of exactly the values accepted since the last one."""
    got: list[dict[str, float]] = []
    log = loopkit.detach_logging(every=every, sink=got.append, reduce=_REDUCE)  # type: ignore[arg-type]
    pending: dict[str, list[float]] = {}
    q_kind: str | None = None  # tensor or float, as ``q`` was logged in this interval
    expected: list[dict[str, float]] = []
    accepted = 0
    for metrics, kind, bad in calls:
        logged = {name: _as_logged(name, v, kind) for name, v in metrics.items()}
        q_is = "float" if kind == "float" else "tensor"
        if bad:
            logged[next(iter(logged))] = torch.ones(2)
        refused = bad or ("q" in metrics and q_kind not in (None, q_is))
        if refused:
            with pytest.raises((TypeError, ValueError)):
                log.record(logged)
            continue
        log.record(logged)
        accepted += 1
        for name, v in logged.items():  # the value as logged (bf16 rounds some)
            pending.setdefault(name, []).append(
                float(v.detach() if isinstance(v, torch.Tensor) else v)
            )
        q_kind = q_is if "q" in metrics else q_kind
        if log._calls_since_flush == 0:
            expected.append(_reference(pending))
            pending, q_kind = {}, None
    assert got == expected
    assert log.step == accepted and log.flush() == (_reference(pending) if pending else {})


_VARIANTS = ["plain", "float64", "shape_1", "two_backwards", "mixed_backwards", "then_shape_1",
             "user_log", "reload"]  # fmt: skip


@settings(max_examples=40, deadline=None, derandomize=True)
@given(schedule=st.lists(st.sampled_from(_VARIANTS), min_size=1, max_size=12),
       every=st.integers(1, 5))  # fmt: skip
def test_a_steps_vouched_loss_kind_is_trusted_no_further_than_it_was_checked(
    schedule: list[str], every: int
) -> None:
    """A step tells its log the kind its backward found the loss to be (0-d, floating, its
    dtype and device), and the log then appends without reading the loss. Losses off that
    path (another dtype, a (1,)-shaped loss, two backwards of different kinds, the user
    logging the same metric another way, a reloaded interval) are checked in full: every
    flush equals the exact reduction of the values the loop logged."""
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    got: list[dict[str, float]] = []
    log = loopkit.detach_logging(every=every, sink=got.append)
    step = loopkit.step(model, torch.optim.SGD(model.parameters(), lr=0.0), accumulate=1, log=log)
    pending: list[float] = []
    expected: list[dict[str, float]] = []

    def logged(value: float) -> None:
        pending.append(value)
        if log._calls_since_flush == 0:
            expected.append({"loss": math.fsum(pending) / len(pending)})
            pending.clear()

    for variant in schedule:
        if variant == "user_log":
            log(loss=torch.tensor(0.25, dtype=torch.float64))
            logged(0.25)
            continue
        if variant == "reload":
            log.load_state_dict(log.state_dict())
            continue
        loss = model(torch.randn(4, 3)).pow(2).mean()
        with step as s:
            if variant == "float64":
                loss = loss.double()
            if variant == "shape_1":
                loss = loss.reshape(1)
            s.backward(loss)
            total = float(loss.detach().sum())
            if variant in ("two_backwards", "mixed_backwards", "then_shape_1"):
                more = model(torch.randn(4, 3)).abs().mean()
                more = more.double() if variant == "mixed_backwards" else more
                more = more.reshape(1) if variant == "then_shape_1" else more
                s.backward(more)
                total = float((loss.detach() + more.detach()).sum())
        logged(total)
    assert got == expected
    assert all(v.ndim == 0 for v in log._values.get("loss", []))


def test_a_flush_knows_its_values_share_one_dtype_without_reading_each() -> None:
    """The log knows the dtypes it kept since the last flush (its metrics' kinds), so a flush
    of one dtype reads no value's dtype (a pass over cold tensors, the costliest part of a
    flush in a loop); values of two dtypes, the second logged through the fast path after a
    flush, are still widened each (an int64 count past bf16's precision stays exact)."""
    log = loopkit.detach_logging(every=None, sink=None, reduce={"n": "sum"})
    for i in range(50):
        log(loss=torch.tensor(i / 4))
    with _Getters() as seen:
        assert log.flush() == {"loss": math.fsum(i / 4 for i in range(50)) / 50}
    assert seen.count < 5, seen.count  # the stack (and its read), not a dtype per value
    log(n=torch.tensor(1), q=torch.tensor(0.5, dtype=torch.bfloat16))
    log.flush()
    # Both metrics now take the fast path (their kinds are known): two dtypes in one flush.
    log(n=torch.tensor(2**40 + 1), q=torch.tensor(0.25, dtype=torch.bfloat16))
    log(n=torch.tensor(2), q=torch.tensor(0.75, dtype=torch.bfloat16))
    assert log.flush() == {"n": float(2**40 + 3), "q": 0.5}


def test_a_metric_of_another_dtype_logged_long_ago_costs_later_flushes_nothing() -> None:
    """What the flush knows comes from the metrics it holds: an int64 metric logged once, and
    flushed, does not make every later float32 flush look at each value again."""
    log = loopkit.detach_logging(every=None, sink=None)
    log(epoch=torch.tensor(0), loss=torch.tensor(1.0))
    log.flush()
    for _ in range(3):
        for i in range(20):
            log(loss=torch.tensor(i / 2))
        with _Getters() as seen:
            assert log.flush() == {"loss": math.fsum(i / 2 for i in range(20)) / 20}
        assert seen.count < 5, seen.count


def test_a_metric_switching_dtype_mid_interval_keeps_its_earlier_values_exact() -> None:
    """A metric logged float32 through the fast path (its kind from an earlier interval), then
    as an int64 count in the same interval: the flush widens each dtype apart (stacked
    together, the count would be rounded to float32)."""
    log = loopkit.detach_logging(every=None, sink=None, reduce="sum")
    log(m=torch.tensor(0.5))
    log.flush()
    log(m=torch.tensor(0.25))  # the fast path: m's kind is float32 since the last interval
    log(m=torch.tensor(2**40 + 1))  # checked: m's kind becomes int64
    assert log.flush() == {"m": 2**40 + 1.25}


class _Getters(torch.overrides.TorchFunctionMode):
    """Counts the torch functions and tensor attribute reads run under it."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.count += 1
        return func(*args, **(kwargs or {}))
