"""Tracker sinks against the real libraries (CSV, W&B offline, MLflow file store, TensorBoard
event files): what was written is read back, a resume continues the same run with no point
twice, only rank zero writes, and nothing starts before the first write."""

from __future__ import annotations

import csv
import json
import struct
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import loopkit
from loopkit import _ranks

Written = dict[int, dict[str, float]]  # step -> values


def _csv(tmp: Path) -> tuple[Callable[[], Any], Callable[[Any], Written]]:
    path = tmp / "run" / "metrics.csv"

    def read(sink: Any) -> Written:
        with path.open(newline="") as f:
            rows = list(csv.DictReader(f))
        steps = [int(r["step"]) for r in rows]
        assert len(steps) == len(set(steps)), steps  # no point twice
        return {
            int(r["step"]): {k: float(v) for k, v in r.items() if k != "step" and v} for r in rows
        }

    return (lambda: loopkit.CSVSink(path)), read


def _wandb_records(path: Path) -> Iterator[Any]:
    """The records of an offline W&B run file (LevelDB log format: 32 KiB blocks)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, chunk = path.read_bytes(), 7, b""
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if length == 0 and kind == 0:
            pos += left
            continue
        chunk += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or the last piece of one
            record = pb.Record()
            record.ParseFromString(chunk)
            chunk = b""
            yield record


def _wandb(
    tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[Callable[[], Any], Callable[[Any], Written]]:
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_MODE", "offline")

    def read(sink: Any) -> Written:
        written: Written = {}
        steps: list[int] = []
        for f in sorted((tmp / "wandb").glob(f"offline-run-*-{sink.run_id}/run-*.wandb")):
            for r in _wandb_records(f):
                if r.WhichOneof("record_type") == "history":
                    items = {
                        i.key or "/".join(i.nested_key): json.loads(i.value_json)
                        for i in r.history.item
                    }
                    if "_step" not in items or not set(items) - {"_step", "_runtime", "_timestamp"}:
                        continue  # the run's own bookkeeping, no metric
                    step = int(items.pop("_step"))
                    steps.append(step)
                    written[step] = {k: float(v) for k, v in items.items() if not k.startswith("_")}
        assert len(steps) == len(set(steps)), steps
        return written

    return (lambda: loopkit.WandbSink("loopkit-test", dir=tmp, mode="offline")), read


def _mlflow(
    tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[Callable[[], Any], Callable[[Any], Written]]:
    pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    uri = (tmp / "mlruns").as_uri()

    def read(sink: Any) -> Written:
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=uri)
        written: Written = {}
        for key in client.get_run(sink.run_id).data.metrics:
            history = client.get_metric_history(sink.run_id, key)
            assert len({m.step for m in history}) == len(history), key
            for m in history:
                written.setdefault(m.step, {})[key] = m.value
        return written

    return (lambda: loopkit.MLflowSink("loopkit-test", tracking_uri=uri)), read


def _tensorboard(tmp: Path) -> tuple[Callable[[], Any], Callable[[Any], Written]]:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    def read(sink: Any) -> Written:
        written: Written = {}
        for events in sorted((tmp / "tb").glob("events.out.tfevents.*")):
            acc = EventAccumulator(str(events))
            acc.Reload()
            for tag in acc.Tags()["scalars"]:
                for e in acc.Scalars(tag):
                    assert tag not in written.get(e.step, {}), (tag, e.step)
                    written.setdefault(e.step, {})[tag] = e.value
        return written

    return (lambda: loopkit.TensorBoardSink(tmp / "tb")), read


@pytest.fixture(params=["csv", "wandb", "mlflow", "tensorboard"])
def tracker(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[Callable[[], Any], Callable[[Any], Written]]:
    """(make a sink, read back what its run holds) for each tracker."""
    if request.param == "csv":
        return _csv(tmp_path)
    if request.param == "wandb":
        return _wandb(tmp_path, monkeypatch)
    if request.param == "mlflow":
        return _mlflow(tmp_path, monkeypatch)
    return _tensorboard(tmp_path)


def _point(step: int) -> dict[str, float]:
    return {"loss": 1.0 / step, "lr": 0.5**step}


def test_a_resumed_run_continues_the_same_run_with_no_point_twice(
    tracker: tuple[Callable[[], Any], Callable[[Any], Written]], tmp_path: Path
) -> None:
    """Steps 1-5 written, the checkpoint taken at 3, a kill after 5: the resumed sink gets the
    run back from the state, drops the replayed 4 and 5 and goes on to 7. Config once."""
    make, read = tracker
    before = set(tmp_path.rglob("*"))
    first = make()
    first.config({"lr": 0.1, "batch": 32})
    assert set(tmp_path.rglob("*")) == before  # nothing starts before the first write
    state = None
    for step in range(1, 6):
        first(_point(step), step=step, axes={"epoch": 0, "samples": 8 * step, "updates": step})
        if step == 3:
            state = first.state_dict()
    first.close()  # what a killed run left behind is on disk
    if isinstance(first, loopkit.WandbSink):
        # W&B names an offline run's folder by the second it starts: a relaunch comes later.
        time.sleep(1.05 - time.time() % 1)
    second = make()
    second.load_state_dict(state)
    second.config({"lr": 0.1})
    for step in range(4, 8):
        second(_point(step), step=step, axes={"epoch": 1, "samples": 8 * step})
    second.close()
    assert second.run_id == first.run_id
    written = read(second)
    assert sorted(written) == list(range(1, 8))
    for step, values in written.items():
        assert values["loss"] == pytest.approx(1.0 / step, rel=1e-6)
        assert values["samples"] == 8 * step
        assert "updates" not in values  # it is the step itself


def test_only_rank_zero_writes(
    tracker: tuple[Callable[[], Any], Callable[[Any], Written]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On another rank every call is a no-op: no run, no file."""
    make, _ = tracker
    before = set(tmp_path.rglob("*"))
    monkeypatch.setattr(_ranks, "world", lambda group=None: (1, 2))
    sink = make()
    sink.config({"lr": 0.1})
    sink({"loss": 1.0}, step=1)
    sink.close()
    assert set(tmp_path.rglob("*")) == before and sink.run_id is None


def test_a_hyperparameter_changed_is_refused_and_a_resume_after_a_write_too(tmp_path: Path) -> None:
    """config() logs once (a new value for a key raises); load_state_dict after a write raises."""
    sink = loopkit.CSVSink(tmp_path / "m.csv")
    sink.config({"lr": 0.1})
    with pytest.raises(ValueError, match="logged once"):
        sink.config({"lr": 0.2, "wd": 0.0})
    sink({"loss": 1.0}, step=1)
    with pytest.raises(RuntimeError, match="before the first log flush"):
        sink.load_state_dict({"run_id": "x", "last_step": 0})
    assert json.loads((tmp_path / "m.csv.config.json").read_text()) == {"lr": 0.1}


def test_a_new_metric_widens_the_csv(tmp_path: Path) -> None:
    """A metric that appears later gets a column; earlier rows keep an empty cell."""
    sink = loopkit.CSVSink(tmp_path / "m.csv")
    sink({"loss": 1.0}, step=1)
    sink({"loss": 0.5, "acc": 0.9}, step=2)
    with (tmp_path / "m.csv").open(newline="") as f:
        assert list(csv.reader(f)) == [
            ["step", "loss", "acc"],
            ["1", "1.0", ""],
            ["2", "0.5", "0.9"],
        ]
