"""Tracker sinks against the real libraries (CSV, W&B offline, MLflow file store, TensorBoard
event files): what was written is read back, a resume continues the same run with no point
twice, only rank zero writes, and nothing starts before the first write."""

from __future__ import annotations

import csv
import json
import shutil
import struct
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

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


def _wandb_files(tmp: Path, run_id: str) -> list[Path]:
    """The run files of every start of an offline run, in start order (what `wandb sync` reads;
    a start in the same second as the one before gets a suffix from newer wandb)."""
    folders = [
        *tmp.glob(f"wandb/offline-run-*-{run_id}"),
        *tmp.glob(f"wandb/offline-run-*-{run_id}-*"),
    ]
    return [f for d in sorted(folders) for f in d.glob("run-*.wandb")]


def _wandb_settled(path: Path, timeout: float = 30.0) -> list[Any]:
    """The records of an offline run file once W&B's writer (a process of its own, which
    ``finish()`` does not always wait for under load) has written its exit record."""
    deadline = time.monotonic() + timeout
    while True:
        records = list(_wandb_records(path))
        done = any(r.WhichOneof("record_type") == "exit" for r in records)
        if done or time.monotonic() > deadline:
            return records
        time.sleep(0.05)


def _wandb_history(path: Path) -> list[dict[str, float]]:
    """The metric rows of one offline run file, with their `_step`, in order (the run's own
    bookkeeping, rows without a metric, left out)."""
    rows = []
    for r in _wandb_settled(path):
        if r.WhichOneof("record_type") != "history":
            continue
        items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
        metrics = {k: float(v) for k, v in items.items() if not k.startswith("_")}
        if "_step" in items and metrics:
            rows.append({"_step": float(items["_step"]), **metrics})
    return rows


def _wandb(
    tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[Callable[[], Any], Callable[[Any], Written]]:
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_MODE", "offline")

    def read(sink: Any) -> Written:
        rows = [row for f in _wandb_files(tmp, sink.run_id) for row in _wandb_history(f)]
        steps = [int(row.pop("_step")) for row in rows]
        assert len(steps) == len(set(steps)), steps  # no point twice
        return dict(zip(steps, rows, strict=True))

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
    second = make()  # at once: W&B's folder of a start in the same second is not reused
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


Points = list[tuple[int, float]]  # (step, loss) of every point the run holds, in order


def _csv_points(tmp: Path) -> tuple[Callable[[], Any], Callable[[Any], Points]]:
    path = tmp / "m.csv"

    def read(sink: Any) -> Points:
        with path.open(newline="") as f:
            return [(int(r["step"]), float(r["loss"])) for r in csv.DictReader(f)]

    return (lambda: loopkit.CSVSink(path)), read


def _mlflow_points(
    tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[Callable[[], Any], Callable[[Any], Points]]:
    make, _ = _mlflow(tmp, monkeypatch)

    def read(sink: Any) -> Points:
        from mlflow.tracking import MlflowClient

        history = MlflowClient(tracking_uri=(tmp / "mlruns").as_uri()).get_metric_history(
            sink.run_id, "loss"
        )
        return [(m.step, m.value) for m in history]

    return make, read


def _tensorboard_points(tmp: Path) -> tuple[Callable[[], Any], Callable[[Any], Points]]:
    make, _ = _tensorboard(tmp)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    def read(sink: Any) -> Points:
        points: Points = []
        for events in sorted((tmp / "tb").glob("events.out.tfevents.*")):
            acc = EventAccumulator(str(events))
            acc.Reload()
            if "loss" in acc.Tags()["scalars"]:  # a resumed start may write nothing new
                points += [(e.step, e.value) for e in acc.Scalars("loss")]
        return points

    return make, read


@pytest.fixture(params=["csv", "mlflow", "tensorboard"])
def ordered(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[Callable[[], Any], Callable[[Any], Points]]:
    """(make a sink, read every point its run holds) for the trackers that keep each point."""
    if request.param == "csv":
        return _csv_points(tmp_path)
    if request.param == "mlflow":
        return _mlflow_points(tmp_path, monkeypatch)
    return _tensorboard_points(tmp_path)


# Two points per step, as a log flushing every micro-step of accumulate=2 writes them.
SHARED = [0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5]


@pytest.mark.parametrize(
    ("saved", "killed"),
    [(5, 5), (5, 6), (5, 8), (6, 9), (3, 3), (0, 10)],
    ids=lambda n: str(n),
)
def test_a_resume_writes_every_point_once_when_points_share_a_step(
    ordered: tuple[Callable[[], Any], Callable[[Any], Points]], saved: int, killed: int
) -> None:
    """Points sharing steps, the state saved after point `saved`, the run killed after point
    `killed`: the resumed sink replays from the save and the run holds each point once, in
    order, at the same steps as an uninterrupted run."""
    make, read = ordered
    first = make()
    state = None
    for i, step in enumerate(SHARED[: killed + 1]):
        first({"loss": float(i)}, step=step)
        if i == saved:
            state = first.state_dict()
    first.close()
    second = make()
    second.load_state_dict(state)
    for i in range(saved + 1, len(SHARED)):
        second({"loss": float(i)}, step=SHARED[i])
    second.close()
    assert read(second) == [(step, float(i)) for i, step in enumerate(SHARED)]
    assert second.state_dict()["last_step"] == 5 and second.state_dict()["count"] == 2


def test_a_state_saved_without_the_count_drops_its_whole_step(tmp_path: Path) -> None:
    """An older checkpoint's tracker state (no count): every point up to its step is taken as
    held, as before counts were kept; the later steps are written."""
    make, read = _csv_points(tmp_path)
    first = make()
    for i, step in enumerate(SHARED[:6]):
        first({"loss": float(i)}, step=step)
    state = first.state_dict()
    first.close()
    del state["count"]
    second = make()
    second.load_state_dict(state)
    for i in range(4, len(SHARED)):
        second({"loss": float(i)}, step=SHARED[i])
    second.close()
    assert read(second) == [(step, float(i)) for i, step in enumerate(SHARED) if i != 6]


def test_wandb_resumes_writing_the_points_of_a_shared_step_it_does_not_hold(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """W&B keeps one row per step: the resumed start logs the second point of the saved step
    (its side-car counts one point there), not dropping it as already held."""
    make, _ = _wandb(tmp_path, monkeypatch)
    first = make()
    for i, step in enumerate(SHARED[:6]):  # the save after point 5, the first at step 3
        first({"loss": float(i)}, step=step)
    state = first.state_dict()
    first.close()
    second = make()
    second.load_state_dict(state)
    for i in range(6, len(SHARED)):
        second({"loss": float(i)}, step=SHARED[i])
    second.close()
    resumed = _wandb_history(_wandb_files(tmp_path, second.run_id)[-1])
    assert [(int(r["_step"]), r["loss"]) for r in resumed] == [(3, 6.0), (4, 8.0), (5, 10.0)]


def test_two_starts_of_a_wandb_run_within_one_second_keep_both(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """W&B names a start's folder by its second; with a wandb that reuses a taken name (older
    releases; the installed one's suffix turned off) a resumed start in the same second
    overwrote the first start's data. Every point of both starts is in the offline files."""
    pytest.importorskip("wandb")
    from wandb.sdk import wandb_init

    monkeypatch.setattr(wandb_init._WandbInit, "set_sync_dir_suffix", lambda self, s: None)
    make, read = _wandb(tmp_path, monkeypatch)
    for _ in range(3):  # a start that took over a second cannot collide: try again
        for leftover in tmp_path.iterdir():
            shutil.rmtree(leftover) if leftover.is_dir() else leftover.unlink()
        time.sleep(1.02 - time.time() % 1)  # the first start just after a second begins
        first = make()
        first_start = time.time()  # the first start is at its first write
        for step in range(1, 4):
            first(_point(step), step=step)
        state = first.state_dict()
        first.close()
        second = make()
        second.load_state_dict(state)
        relaunched = time.time()  # the second start is at its first write
        for step in range(4, 6):
            second(_point(step), step=step)
        second.close()
        if int(relaunched) == int(first_start):
            break
    assert int(relaunched) == int(first_start), "no try started twice within one second"
    assert sorted(read(second)) == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("stop_at", [3, 5])
def test_a_csv_closed_after_a_stop_resumes_into_the_uninterrupted_rows(
    tmp_path: Path, stop_at: int
) -> None:
    """A stop between two flushes, then log.close() at the script's end (a partial row from
    values the checkpoint still holds unflushed): the resumed run rewrites the rows past the
    checkpoint, so the CSV equals the uninterrupted run's, row for row."""
    from loopkit import distributed

    def run(directory: Path, max_updates: int) -> None:
        torch.manual_seed(0)
        g = torch.Generator().manual_seed(0)
        data = torch.utils.data.TensorDataset(torch.randn(96, 8, generator=g),
                                              torch.randn(96, 1, generator=g))  # fmt: skip
        model = nn.Linear(8, 1)
        loader = distributed.loader(data, batch_size=8, seed=0, num_workers=0)
        log = loopkit.detach_logging(every=4, sink=[loopkit.CSVSink(directory / "m.csv")])
        step = loopkit.step(model, torch.optim.SGD(model.parameters(), lr=0.05), accumulate=2,
                            log=log)  # fmt: skip
        ckpt = loopkit.Checkpointer(directory / "ck", model=model, step=step, loader=loader)
        with loopkit.until(step, max_updates=max_updates, signals=(), checkpointer=ckpt) as stop:
            ckpt.resume()
            for _ in range(loader.epoch, 2):
                for x, y in step.iterate(loader):
                    with step as s:
                        s.backward(nn.functional.mse_loss(model(x), y))
                    if stop.check():
                        break
                if stop.reason:
                    break
        log.close()

    run(tmp_path / "a", 12)
    run(tmp_path / "b", stop_at)
    run(tmp_path / "b", 12)
    whole = (tmp_path / "a" / "m.csv").read_text()
    assert (tmp_path / "b" / "m.csv").read_text() == whole
    assert len(whole.splitlines()) == 7  # a header and 6 rows
