"""Checkpointer(async_save=True): the loop goes on while a thread writes the checkpoint.

The write is held on an event here, so what the thread does while training goes on is
decided by the test, not by timing: the save returns while its file is still unwritten,
the file then holds the state as it was at the save, a second save waits for the first,
and a failed write is raised by the next wait on every rank, with no file left.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import elastic
import pytest
import torch
from torch import nn

import loopkit
from loopkit._checkpoint import _files


class HeldWrites:
    """``atomic_save`` replaced: each write waits for ``release``; the order is recorded."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, fail: bool = False) -> None:
        self.release = threading.Event()
        self.events: list[str] = []
        real = _files.atomic_save

        def held(state: object, path: Path) -> None:
            self.events.append(f"start {path.name}")
            assert self.release.wait(30), "never released"
            if fail:
                raise OSError("disk full")
            real(state, path)
            self.events.append(f"end {path.name}")

        monkeypatch.setattr(_files, "atomic_save", held)


def _train(model: nn.Module, step: loopkit.step, n: int) -> None:
    g = torch.Generator().manual_seed(step.updates)
    for _ in range(n):
        with step as s:
            s.backward(model(torch.randn(4, 8, generator=g)).pow(2).mean())


def _build(root: Path) -> tuple[nn.Module, loopkit.step, loopkit.Checkpointer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    step = loopkit.step(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    return model, step, loopkit.Checkpointer(root, model=model, step=step, async_save=True)


def test_the_loop_goes_on_while_the_save_is_written_and_the_file_holds_the_saved_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """save() returns with the write held: no checkpoint carries the name yet; training 3
    more updates; released and waited for, the file holds the weights and optimizer state
    of update 2, not those of update 5."""
    writes = HeldWrites(monkeypatch)
    model, step, ckpt = _build(tmp_path)
    _train(model, step, 2)
    at_save = {k: v.clone() for k, v in model.state_dict().items()}
    moments = [s["exp_avg"].clone() for s in step.optimizer.state.values()]
    path = ckpt.save()
    assert path is not None and not path.exists() and ckpt.checkpoints() == []
    _train(model, step, 3)
    assert not torch.equal(model.state_dict()["0.weight"], at_save["0.weight"])
    writes.release.set()
    ckpt.wait()
    assert ckpt.checkpoints() == [path] and writes.events == [f"start {path.name}",
                                                              f"end {path.name}"]  # fmt: skip
    saved = loopkit.load_checkpoint(path)
    assert all(torch.equal(saved["model"][k], v) for k, v in at_save.items())
    optimizer = saved["step"]["optimizer"] if "optimizer" in saved["step"] else saved["optimizer"]
    got = [s["exp_avg"] for s in optimizer["state"].values()]
    assert all(torch.equal(a, b) for a, b in zip(got, moments, strict=True))


def test_a_save_waits_for_the_one_in_flight(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A second save while the first is held: it starts writing only after the first has
    ended (one save in flight at a time)."""
    writes = HeldWrites(monkeypatch)
    model, step, ckpt = _build(tmp_path)
    _train(model, step, 1)
    first = ckpt.save()
    _train(model, step, 1)
    threading.Timer(0.2, writes.release.set).start()
    second = ckpt.save()  # blocks until the first is written
    ckpt.wait()
    assert first is not None and second is not None
    assert writes.events == [f"start {first.name}", f"end {first.name}",
                             f"start {second.name}", f"end {second.name}"]  # fmt: skip


def test_a_failed_background_write_is_raised_by_the_next_wait_and_saved_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The thread's OSError is raised by wait() naming the save; no checkpoint, no
    temporary; save_if_needed() then saves the same update again."""
    writes = HeldWrites(monkeypatch, fail=True)
    writes.release.set()
    model, step, ckpt = _build(tmp_path)
    _train(model, step, 2)
    ckpt.save()
    said = r"background save of \S*/ckpt-0000000002.pt failed.*disk"  # its path, the cause
    with pytest.raises(RuntimeError, match=said):
        ckpt.wait()
    assert ckpt.checkpoints() == [] and not list(tmp_path.glob(".ckpt-*"))
    monkeypatch.undo()
    assert ckpt.save_if_needed() is not None
    ckpt.wait()
    assert [p.name for p in ckpt.checkpoints()] == ["ckpt-0000000002.pt"]


def test_a_resume_waits_for_the_save_in_flight(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """resume() right after an async save, its write still held, finds that save: it waits
    for it first, then restores update 3 (the weights trained after it are undone)."""
    writes = HeldWrites(monkeypatch)
    model, step, ckpt = _build(tmp_path)
    _train(model, step, 3)
    at_save = [p.detach().clone() for p in model.parameters()]
    path = ckpt.save()
    _train(model, step, 2)
    threading.Timer(0.2, writes.release.set).start()
    assert ckpt.resume() == path and step.updates == 3
    assert all(torch.equal(a, p) for a, p in zip(at_save, model.parameters(), strict=True))


def test_async_saves_resume_bit_identically(tmp_path: Path) -> None:
    """A run saving in the background every 2 updates, stopped at 5 and resumed (in the
    background too), ends bit-identical to a run saving synchronously; each checkpoint of
    the background run holds the synchronous run's state at that update."""
    sync = elastic.run(tmp_path / "sync")
    background = elastic.run(tmp_path / "async", async_save=True)
    elastic.run(tmp_path / "cut", async_save=True, stop=5)
    resumed = elastic.run(tmp_path / "cut", async_save=True)
    for run in (background, resumed):
        assert all(torch.equal(a, b) for a, b in zip(sync.weights, run.weights, strict=True))
        assert all(torch.equal(a, b) for a, b in zip(sync.ema, run.ema, strict=True))
    names = [p.name for p in sorted((tmp_path / "sync").glob("ckpt-*"))]
    assert names == [p.name for p in sorted((tmp_path / "async").glob("ckpt-*"))]
    for name in names:
        a = loopkit.load_checkpoint(tmp_path / "sync" / name)
        b = loopkit.load_checkpoint(tmp_path / "async" / name)
        assert _same(a, b, skip={"saves", "time"}), name


def _same(a: Any, b: Any, skip: set[str]) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        keys = set(a) - skip
        return keys == set(b) - skip and all(_same(a[k], b[k], skip) for k in keys)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y, skip) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def test_async_save_must_be_a_bool(tmp_path: Path) -> None:
    """async_save=1 is refused before anything is built."""
    with pytest.raises(TypeError, match="async_save must be True or False"):
        loopkit.Checkpointer(tmp_path, model=nn.Linear(1, 1), async_save=1)  # type: ignore[arg-type]


def test_a_sharded_model_saves_in_the_background_bit_identically(
    dist_results: dict[str, Any],
) -> None:
    """FSDP2 on 2 ranks: shards written by DCP's async_save while training goes on; the run,
    and one stopped and resumed, end bit-identical to synchronous saves, and each
    checkpoint's weights and EMA (exported) equal the synchronous run's."""
    for r in dist_results["sharded_async_save"]:
        assert r["names"] == ["ckpt-0000000002", "ckpt-0000000004", "ckpt-0000000006"]
        assert r["same_files"] and r["same"] == [True, True]
