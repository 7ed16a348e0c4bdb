"""detach_logging's checkpoint state: the unflushed interval (its place in the flush cadence
and its values) resumes bit-identical, with or without extra=, on the CPU or another device."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import loopkit
from loopkit import distributed

# (accumulate, log every, maybe_save every, killed after update): saves between flushes, a
# flush per micro-step (two rows per update count), kills after more flushes than the save.
CADENCES = [(2, 4, 3, 4), (2, 1, 3, 3), (1, 3, 2, 5), (3, 2, 2, 2), (2, 5, 4, 7), (1, 7, 5, 9)]


def _run(out: Path, cadence: tuple[int, int, int, int], where: str, kill: bool) -> None:
    """24 batches of 8 over two epochs; the log reduces a loss, a Python float, an int64
    counter (sum), a bf16 value (max) and the last value; a kill leaves without closing."""
    accumulate, every, save_every, kill_after = cadence
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(96, 8, generator=g),
                                          torch.randn(96, 1, generator=g))  # fmt: skip
    model = nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = distributed.loader(data, batch_size=8, seed=0, num_workers=0)
    log = loopkit.detach_logging(
        every=every, sink=[loopkit.CSVSink(out / "m.csv")],
        reduce={"seen": "sum", "peak": "max", "final": "last"},
    )  # fmt: skip
    step = loopkit.step(model, opt, accumulate=accumulate, log=log)
    extra = {"log": log} if where == "extra" else {}
    ckpt = loopkit.Checkpointer(out / "ck", model=model, optimizer=opt, step=step,
                                loader=loader, extra=extra)  # fmt: skip
    ckpt.resume()
    for _ in range(loader.epoch, 2):
        for x, y in step.iterate(loader):
            with step as s:
                out_ = model(x)
                s.backward(nn.functional.mse_loss(out_, y))
                s.log_metrics(lr=0.05 / (1 + step.updates), seen=torch.tensor(x.shape[0]),
                              peak=out_.max().to(torch.bfloat16), final=out_.mean())  # fmt: skip
            ckpt.maybe_save(every=save_every)
            if kill and step.updates == kill_after and step.micro_step == 0:
                return  # killed: nothing more is written, nothing closed
    ckpt.save()
    log.close()


@pytest.mark.parametrize("where", ["extra", "step"])
@pytest.mark.parametrize(
    "cadence", CADENCES, ids=lambda c: "acc{}_every{}_save{}_kill{}".format(*c)
)
def test_a_resume_between_flushes_writes_the_uninterrupted_csv(
    tmp_path: Path, cadence: tuple[int, int, int, int], where: str
) -> None:
    """Killed after a checkpoint taken between two flushes, resumed (the log under extra= or
    only as the step's log=): the CSV holds the uninterrupted run's rows, bit for bit."""
    _run(tmp_path / "whole", cadence, where, kill=False)
    _run(tmp_path / "parts", cadence, where, kill=True)
    _run(tmp_path / "parts", cadence, where, kill=False)
    whole = (tmp_path / "whole" / "m.csv").read_text().splitlines()
    assert len(whole) > 3
    assert (tmp_path / "parts" / "m.csv").read_text().splitlines() == whole


def _values() -> list[dict[str, Any]]:
    """Five calls of metrics in several dtypes whose float64 sums are exact to the last bit."""
    return [
        {"loss": torch.tensor(0.1 * (i + 1), dtype=torch.float32),
         "tokens": torch.tensor(2**50 + i, dtype=torch.int64),
         "peak": torch.tensor(1.0 + i / 3, dtype=torch.bfloat16),
         "lr": 0.1 / (i + 1), "both": torch.tensor(0.3 * i, dtype=torch.float64)}
        for i in range(5)
    ]  # fmt: skip


def _through_a_file(state: dict[str, Any]) -> Any:
    """The state as a resume reads it: saved, then loaded onto the CPU, weights only."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, map_location="cpu", weights_only=True)


def test_the_unflushed_interval_round_trips_exactly() -> None:
    """Saved after 3 of 5 calls and loaded into a new log: it flushes at the same call, with
    the uninterrupted log's reductions, bit for bit (mean, sum, max, last, Python floats)."""
    how = {"tokens": "sum", "peak": "max", "both": "last"}
    whole: list[dict[str, float]] = []
    log = loopkit.detach_logging(every=5, sink=whole.append, reduce=how)
    for metrics in _values():
        log.record(metrics)
    first: list[dict[str, float]] = []
    part = loopkit.detach_logging(every=5, sink=first.append, reduce=how)
    for metrics in _values()[:3]:
        part.record(metrics)
    resumed: list[dict[str, float]] = []
    again = loopkit.detach_logging(every=5, sink=resumed.append, reduce=how)
    again.load_state_dict(_through_a_file(part.state_dict()))
    again.record(_values()[3])
    assert resumed == [] and again.step == 4
    again.record(_values()[4])
    assert first == [] and len(whole) == 1 and resumed == whole
    assert whole[0]["tokens"] == 5 * 2**50 + 10  # exact: a float32 sum would round it
    assert again.flush() == {}  # the interval was cleared by the flush


def test_a_state_without_the_interval_resumes_an_empty_one() -> None:
    """A state written before the interval was saved ('calls' and 'sinks' only): the log
    continues the count and starts a fresh interval."""
    got: list[dict[str, float]] = []
    log = loopkit.detach_logging(every=3, sink=got.append)
    log(x=100.0)  # replaced by the loaded (empty) interval
    log.load_state_dict({"calls": 7, "sinks": [None]})
    for v in (1.0, 2.0, 3.0):
        log(x=v)
    assert got == [{"x": 2.0}] and log.step == 10


def test_restored_values_follow_the_metric_to_its_device() -> None:
    """Values restored on the CPU move to the device of the metric's next value (here 'meta')
    instead of being refused; a metric logged on another device than its own is still refused."""
    log = loopkit.detach_logging(every=None, sink=None)
    log(x=torch.tensor(1.0), y=torch.tensor(2.0))
    again = loopkit.detach_logging(every=None, sink=None)
    again.load_state_dict(_through_a_file(log.state_dict()))
    again(x=torch.tensor(3.0, device="meta"))
    assert [v.device.type for v in again._values["x"]] == ["meta", "meta"]
    with pytest.raises(ValueError, match="same device"):
        again(x=torch.tensor(4.0))
    assert again.step == 2 and [v.device.type for v in again._values["y"]] == ["cpu"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_interval_restored_on_the_cpu_reduces_on_the_gpu_bit_identical() -> None:
    """Recorded on the GPU, loaded with map_location='cpu', continued on the GPU: the same
    reductions as the uninterrupted log, bit for bit."""
    values = [torch.randn((), device="cuda", dtype=torch.float32) for _ in range(6)]
    whole: list[dict[str, float]] = []
    log = loopkit.detach_logging(every=6, sink=whole.append, reduce={"s": "sum"})
    for v in values:
        log(m=v, s=v)
    # The same sinks as the resumed log (a checkpoint holds one state per sink).
    part = loopkit.detach_logging(every=6, sink=[].append, reduce={"s": "sum"})
    for v in values[:4]:
        part(m=v, s=v)
    resumed: list[dict[str, float]] = []
    again = loopkit.detach_logging(every=6, sink=resumed.append, reduce={"s": "sum"})
    again.load_state_dict(_through_a_file(part.state_dict()))
    for v in values[4:]:
        again(m=v, s=v)
    assert resumed == whole


def test_a_wrong_log_state_in_extra_is_refused_before_anything_loads(tmp_path: Path) -> None:
    """extra={'log': log} built with other sinks than when saving: CheckpointError from the
    checks, the weights untouched; a resume failing after the log loaded puts it back."""

    def build(sinks: list[Any], boom: bool = False) -> tuple[nn.Module, Any, Any]:
        torch.manual_seed(0)
        model = nn.Linear(2, 1)
        log = loopkit.detach_logging(every=3, sink=sinks)
        ckpt = loopkit.Checkpointer(tmp_path, model=model, extra={"log": log, "b": _Boom(boom)})
        return model, log, ckpt

    model, log, ckpt = build([loopkit.CSVSink(tmp_path / "m.csv")])
    log(x=torch.tensor(1.0))
    ckpt.save()
    model, log, ckpt = build([loopkit.CSVSink(tmp_path / "m.csv"), print])
    with torch.no_grad():
        model.weight.add_(1.0)
    before = model.weight.clone()
    with pytest.raises(loopkit.CheckpointError, match="same sinks, in the same order"):
        ckpt.resume()
    assert torch.equal(model.weight, before) and log.step == 0
    _, log, ckpt = build([loopkit.CSVSink(tmp_path / "m.csv")], boom=True)
    log(x=torch.tensor(5.0))
    with pytest.raises(loopkit.CheckpointError, match="boom"):
        ckpt.resume()
    assert log.step == 1 and log.flush() == {"x": 5.0}


class _Boom:
    """An extra= object whose load fails (``fails``) after the log has loaded."""

    def __init__(self, fails: bool) -> None:
        self.fails = fails

    def state_dict(self) -> dict[str, int]:
        return {}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if self.fails:
            self.fails = False  # putting it back afterwards works
            raise RuntimeError("boom")
