"""Resume: atomic checkpoints, bit-identical continuation after SIGKILL, safe loading, guards."""

from __future__ import annotations

import copy
import gc
import os
import pickle
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import ROOT, assert_bit_equal, batches, deep, launch_env, loss_fn, mlp, params
from torch import nn

import loopkit
from loopkit import distributed


def _setup(tmp: Path, precision: str = "fp32") -> dict[str, Any]:
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(96, 8), torch.randn(96, 1))
    loader = distributed.loader(data, batch_size=8, num_workers=0, seed=2)
    model = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Dropout(0.2), nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    step = loopkit.step(
        model, opt, precision=precision, accumulate=3, scheduler=sched, clip_grad_norm=1.0
    )
    ckpt = loopkit.Checkpointer(
        tmp, model=model, optimizer=opt, scheduler=sched, step=step, loader=loader, keep=10
    )
    return {"model": model, "loader": loader, "step": step, "ckpt": ckpt}


def _names(directory: Path) -> list[str]:
    """What ``directory`` holds but the job's owner record (``.loopkit-owner-*``)."""
    return sorted(p.name for p in directory.iterdir() if not p.name.startswith(".loopkit-owner"))


def _train(run: dict[str, Any], epochs: int, save_at: int | None = None) -> None:
    step, loader = run["step"], run["loader"]
    for _ in range(loader.epoch, epochs):
        for x, y in step.iterate(loader):
            with step as s:
                s.backward(nn.functional.mse_loss(run["model"](x), y))
            if save_at is not None and step.updates == save_at and step.accumulator.micro_step == 0:
                run["ckpt"].save()


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_resume_mid_epoch_in_process_is_bit_identical(precision: str, tmp_path: Path) -> None:
    """Saved mid-epoch, resumed by fresh objects: the same weights, scheduler, scaler, data."""
    full = _setup(tmp_path, precision)
    _train(full, epochs=3, save_at=5)  # 12 batches/epoch, every=3: update 5 is mid-epoch 2
    fresh = _setup(tmp_path, precision)
    torch.manual_seed(123)  # a different RNG state, which resume must overwrite
    assert fresh["ckpt"].resume() == tmp_path / "ckpt-0000000005.pt"
    assert fresh["step"].updates == 5 and fresh["loader"].epoch == 1
    _train(fresh, epochs=3)
    assert_bit_equal(params(full["model"]), params(fresh["model"]))
    assert fresh["step"].state_dict() == full["step"].state_dict()


def test_keep_last_k_and_resume_latest(tmp_path: Path) -> None:
    """Only the newest `keep` checkpoints stay; resume picks the newest."""
    run = _setup(tmp_path)
    run["ckpt"].keep = 2
    for _ in range(4):
        for _ in range(3):
            with run["step"] as s:
                s.backward(loss_fn(run["model"], batches([8])[0]))
        run["ckpt"].save()
    assert [p.name for p in run["ckpt"].checkpoints()] == [
        "ckpt-0000000003.pt",
        "ckpt-0000000004.pt",
    ]


def test_saving_mid_window_is_refused(tmp_path: Path) -> None:
    """A save between micro-steps of a window would drop gradients: it raises, writes nothing."""
    run = _setup(tmp_path)
    with run["step"] as s:
        s.backward(loss_fn(run["model"], batches([8])[0]))
    with pytest.raises(RuntimeError, match="mid-window"):
        run["ckpt"].save()
    assert run["ckpt"].checkpoints() == []


def test_a_failed_write_leaves_the_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A save that dies half-way leaves no new file, no temporary, and the old one intact."""
    run = _setup(tmp_path)
    first = run["ckpt"].save()
    assert first is not None
    before = first.read_bytes()
    real_save = torch.save

    def dying_save(obj: Any, f: Any, *a: Any, **k: Any) -> None:
        f.write(b"PK\x03\x04 half a zip")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", dying_save)
    run["step"].accumulator._progress.updates += 1  # a new name, as after another update
    with pytest.raises(OSError, match="disk full"):
        run["ckpt"].save()
    monkeypatch.setattr(torch, "save", real_save)
    assert run["ckpt"].checkpoints() == [first] and first.read_bytes() == before
    assert not list(tmp_path.glob(".ckpt-*"))


class _Evil:
    def __reduce__(self) -> Any:
        return (os.system, (f"touch {_Evil.marker}",))

    marker = ""


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_a_checkpoint_that_runs_code_is_refused(tmp_path: Path) -> None:
    """A pickle crafted to run a command on load is refused and the command never runs."""
    _Evil.marker = str(tmp_path / "pwned")
    path = tmp_path / "ckpt-0000000001.pt"
    torch.save({"format": "loopkit-checkpoint-1", "model": _Evil()}, path)
    with pytest.raises(loopkit.CheckpointError, match="refused") as info:
        loopkit.load_checkpoint(path)
    assert str(path) in str(info.value)
    assert not (tmp_path / "pwned").exists()
    with open(tmp_path / "plain.pt", "wb") as f:
        pickle.dump(_Evil(), f)
    with pytest.raises(loopkit.CheckpointError):
        loopkit.load_checkpoint(tmp_path / "plain.pt")
    assert not (tmp_path / "pwned").exists()


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty", "not_loopkit"])
def test_damaged_files_give_a_clear_error_naming_the_file(damage: str, tmp_path: Path) -> None:
    """Truncated, random, empty or foreign files: CheckpointError with the path and the cause."""
    run = _setup(tmp_path)
    path = run["ckpt"].save()
    assert path is not None
    data = path.read_bytes()
    if damage == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "garbage":
        path.write_bytes(random.Random(0).randbytes(4096))
    elif damage == "empty":
        path.write_bytes(b"")
    else:
        torch.save({"weights": torch.ones(2)}, path)
    with pytest.raises(loopkit.CheckpointError) as info:
        _setup(tmp_path)["ckpt"].resume()
    assert str(path) in str(info.value)


def test_a_truncated_newest_checkpoint_names_the_older_one_to_resume(tmp_path: Path) -> None:
    """The newest file cut short: the error names the older checkpoint and the exact
    ckpt.resume(path) call, and that call resumes it (its weights come back)."""
    run = _setup(tmp_path)
    _train(run, 1)
    older = run["ckpt"].save()
    assert older is not None
    weights = [p.detach().clone() for p in run["model"].parameters()]
    _train(run, 2)
    newest = run["ckpt"].save()
    assert newest is not None and newest != older
    newest.write_bytes(newest.read_bytes()[:100])
    again = _setup(tmp_path)
    with pytest.raises(loopkit.CheckpointError, match="unreadable") as info:
        again["ckpt"].resume()
    assert f"ckpt.resume({str(older)!r})" in str(info.value)
    assert again["ckpt"].resume(older) == older
    assert all(torch.equal(a, b) for a, b in zip(again["model"].parameters(), weights, strict=True))


def test_mismatched_model_or_objects_are_named(tmp_path: Path) -> None:
    """Another model shape, or objects missing on resume: errors that say what differs."""
    run = _setup(tmp_path)
    run["ckpt"].save()
    other = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Dropout(0.2), nn.Linear(16, 1))
    with pytest.raises(loopkit.CheckpointError, match=r"shape mismatch 0\.weight"):
        loopkit.Checkpointer(tmp_path, model=other).resume(run["ckpt"].checkpoints()[-1])
    fresh = _setup(tmp_path / "x")
    bare = loopkit.Checkpointer(tmp_path, model=fresh["model"])
    with pytest.raises(loopkit.CheckpointError, match="optimizer state"):
        bare.resume()


def test_resume_with_nothing_saved_returns_none(tmp_path: Path) -> None:
    """A first run finds no checkpoint and starts from scratch."""
    assert _setup(tmp_path / "empty")["ckpt"].resume() is None


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_non_finite_guard_skips_and_touches_no_weight(precision: str) -> None:
    """A nan loss in a window: update skipped, weights and scheduler unchanged, grads zeroed."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    step = loopkit.step(
        model,
        opt,
        precision=precision,
        accumulate=2,
        scheduler=sched,
        skip_nonfinite=True,
        max_consecutive_skips=3,
    )
    data = batches([4] * 4)
    for batch in data[:2]:
        with step as s:
            s.backward(loss_fn(model, batch))
    before, lr = params(model), opt.param_groups[0]["lr"]
    for i, batch in enumerate(data[2:]):
        with step as s:
            loss = loss_fn(model, batch)
            s.backward(loss * float("nan") if i == 0 else loss)
    assert step.updates == 1 and step.skipped == 1
    assert_bit_equal(before, params(model))
    assert opt.param_groups[0]["lr"] == lr
    assert all(p.grad is None for p in model.parameters())


def test_too_many_consecutive_skips_raise() -> None:
    """max_consecutive_skips=2: the second skipped update in a row raises, naming the cause."""
    model = mlp()
    step = loopkit.step(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        skip_nonfinite=True,
        max_consecutive_skips=2,
    )
    batch = batches([4])[0]
    with step as s:
        s.backward(loss_fn(model, batch) * float("inf"))
    with pytest.raises(RuntimeError, match="2 updates in a row"), step as s:
        s.backward(loss_fn(model, batch) * float("inf"))


def test_non_finite_guard_off_by_default_costs_no_sync() -> None:
    """Without skip_nonfinite a step makes no host read; with it, one per update."""
    model = mlp()
    for guard, expected in ((False, 0), (True, 2)):
        step = loopkit.step(
            model, torch.optim.SGD(model.parameters(), lr=0.1), accumulate=2, skip_nonfinite=guard
        )
        with loopkit.count_host_syncs() as syncs:
            for batch in batches([4] * 4):
                with step as s:
                    s.backward(loss_fn(model, batch))
        assert syncs.count == expected, syncs.events


@deep
def test_ddp_one_writer_all_ranks_resume(tmp_path: Path) -> None:
    """2 processes: stop at update 8, resume to 12; equal to an uninterrupted 2-process run."""
    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "examples/train_resumable.py",
        "--save-every",
        "4",
    ]

    def run(*args: str) -> None:
        proc = subprocess.run(
            [*torchrun, *args],
            cwd=ROOT,
            env=launch_env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]

    run("--dir", str(tmp_path / "a"), "--epochs", "3", "--out", str(tmp_path / "ref.pt"))
    run("--dir", str(tmp_path / "b"), "--epochs", "2")
    assert [p.name for p in sorted((tmp_path / "b").glob("ckpt-*.pt"))] == [
        "ckpt-0000000004.pt",
        "ckpt-0000000008.pt",
    ]
    run("--dir", str(tmp_path / "b"), "--epochs", "3", "--out", str(tmp_path / "resumed.pt"))
    a = torch.load(tmp_path / "ref.pt", weights_only=True)
    b = torch.load(tmp_path / "resumed.pt", weights_only=True)
    assert all(torch.equal(a[k], b[k]) for k in a)


# -- edge cases: a resume that fails changes nothing; files; numbering; lineages; epochs --------


def _same(a: Any, b: Any) -> bool:
    """Deep equality where tensors and arrays must be bit-identical."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and torch.equal(a, b)
        )
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and np.array_equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


class _Counter:
    """A user object carried in extra=."""

    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.n = state["n"]


def _build(
    tmp: Path,
    *,
    n: int = 96,
    batch_size: int = 8,
    precision: str = "fp32",
    every: int = 3,
    order: str = "same",
    keep: int = 10,
) -> dict[str, Any]:
    """_setup's run with one thing changed, and a user counter in extra=."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(5)
    data = torch.utils.data.TensorDataset(
        torch.randn(n, 8, generator=g), torch.randn(n, 1, generator=g)
    )
    loader = distributed.loader(data, batch_size=batch_size, num_workers=0, seed=2)
    model = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Dropout(0.2), nn.Linear(32, 1))
    ps = list(model.parameters())
    groups: Any = ps
    if order == "swapped":  # the same parameters, listed in another order
        groups = [ps[2], ps[3], ps[0], ps[1]]
    elif order == "two_groups":
        groups = [{"params": ps[:2]}, {"params": ps[2:], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    step = loopkit.step(
        model, opt, precision=precision, accumulate=every, scheduler=sched, clip_grad_norm=1.0
    )
    counter = _Counter()
    ckpt = loopkit.Checkpointer(
        tmp,
        model=model,
        optimizer=opt,
        scheduler=sched,
        step=step,
        loader=loader,
        extra={"counter": counter},
        keep=keep,
    )
    return {"model": model, "loader": loader, "step": step, "ckpt": ckpt, "counter": counter}


def _train_until(run: dict[str, Any], updates: int, save_every: int | None = None) -> None:
    """Train epoch after epoch until `updates` updates; explicit saves every `save_every`."""
    step, loader = run["step"], run["loader"]
    while True:
        for x, y in step.iterate(loader):
            with step as s:
                s.backward(nn.functional.mse_loss(run["model"](x), y))
            if step.accumulator.micro_step == 0:
                run["counter"].n += 1
                if save_every is not None and step.updates % save_every == 0:
                    run["ckpt"].save()
                if step.updates == updates:
                    return


def _everything(run: dict[str, Any], directory: Path) -> dict[str, Any]:
    """All that a resume may touch, copied: weights, optimizer, counters, data, RNG, files."""
    gc.collect()  # an earlier run's Checkpointer, collected, gives its owner record up now
    loader, ckpt = run["loader"], run["ckpt"]
    return {
        "weights": params(run["model"]),
        "optimizer": copy.deepcopy(ckpt.optimizer.state_dict()),
        "scheduler": copy.deepcopy(ckpt.scheduler.state_dict()),
        "lr": [g["lr"] for g in ckpt.optimizer.param_groups],
        "step": copy.deepcopy(run["step"].state_dict()),
        "counter": run["counter"].n,
        "loader": (
            loader.epoch,
            loader.position,
            loader._progress.resume_at,
            loader._progress.pass_epoch,
        ),
        "generator": loader.loader.generator.get_state(),
        "rng": (torch.get_rng_state(), random.getstate(), np.random.get_state()),
        "checkpointer": (ckpt._saves, ckpt.last_saved_update),
        "files": sorted(
            (str(p.relative_to(directory)), p.read_bytes())
            for p in directory.rglob("*")
            if p.is_file()
        ),
    }


def _changed(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    return [k for k in before if not _same(before[k], after[k])]


def _candidate(tmp: Path, **changes: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """A run that has trained a little (its state is not a fresh one), and a copy of it all."""
    run = _build(tmp, **changes)
    _train_until(run, 2)
    torch.manual_seed(77)
    np.random.seed(7)
    random.seed(7)
    return run, _everything(run, tmp)


@pytest.mark.parametrize(
    ("saved", "changes", "hint"),
    [
        ({}, {"every": 4}, "accumulate=3"),
        ({}, {"precision": "fp16"}, "holds no GradScaler"),
        ({"precision": "fp16"}, {"precision": "bf16"}, "holds a GradScaler"),
        ({}, {"order": "swapped"}, "group 0 parameter 0: (1, 32) saved, (32, 8) here"),
        ({}, {"order": "two_groups"}, "2 parameter group(s)"),
        ({}, {"n": 104}, "104 samples but the state was saved with 96"),
        ({}, {"batch_size": 4}, "batch size is 4"),
    ],
    ids=["accumulate", "fp32_to_fp16", "fp16_to_bf16", "param_order", "groups", "data", "batch"],
)
@pytest.mark.filterwarnings("ignore:fp16 autocast on a CPU")
def test_a_refused_resume_changes_nothing(
    saved: dict[str, Any], changes: dict[str, Any], hint: str, tmp_path: Path
) -> None:
    """Another setup: CheckpointError; weights, optimizer, counters, data, RNG, files unchanged."""
    _train_until(_build(tmp_path, **saved, order="swapped" if "order" in changes else "same"), 7, 1)
    if "order" in changes:  # saved with the parameters listed one way, resumed with another
        changes = {"order": "same" if changes["order"] == "swapped" else changes["order"]}
    run, before = _candidate(tmp_path, **changes)
    with pytest.raises(loopkit.CheckpointError) as info:
        # Older than the newest: had it been accepted, ckpt 4..7 would have been moved aside.
        run["ckpt"].resume(tmp_path / "ckpt-0000000003.pt")
    assert hint in str(info.value) and "ckpt-0000000003.pt" in str(info.value)
    assert _changed(before, _everything(run, tmp_path)) == []


def test_a_resume_failing_while_loading_puts_everything_back(tmp_path: Path) -> None:
    """The model's load raises after all else was loaded: everything is put back, bit for bit."""
    _train_until(_build(tmp_path), 7, 1)
    run, before = _candidate(tmp_path)

    def refuse(*args: Any) -> None:
        raise RuntimeError("this module's own loading hook refuses")

    run["model"].register_load_state_dict_pre_hook(refuse)
    with pytest.raises(loopkit.CheckpointError, match="own loading hook refuses"):
        run["ckpt"].resume(tmp_path / "ckpt-0000000003.pt")
    assert _changed(before, _everything(run, tmp_path)) == []


def _delete(state: dict[str, Any], where: tuple[Any, ...]) -> None:
    for key in where[:-1]:
        state = state[key]
    if where[-1] == "*":
        state.clear()
    else:
        del state[where[-1]]


@pytest.mark.parametrize(
    ("where", "named"),
    [
        (("model",), "'model' is missing"),
        (("world_size",), "'world_size' is missing"),
        (("saves",), "'saves' is missing"),
        (("extra",), "'extra' is missing"),
        (("rng",), "'rng' is missing"),
        (("rng", "*"), "'rng' holds 0 states for 1 ranks"),
        (("rng", 0, "torch"), "'rng' of rank 0 has no 'torch' state"),
        (("optimizer", "param_groups"), "'optimizer.param_groups' is missing"),
        (("optimizer_shapes",), "'optimizer_shapes' is missing"),
        (("step", "accumulate", "every"), "the step's 'every' is missing"),
        (("step", "accumulate", "updates"), "the step's 'updates' is missing"),
        (("step", "amp"), "'step.amp' is missing"),
        (("loader", "position"), "no 'position' entry"),
        (("loader", "dataset_length"), "no 'dataset_length' entry"),
    ],
    ids=lambda x: ".".join(map(str, x)) if isinstance(x, tuple) else None,
)
def test_an_incomplete_checkpoint_is_refused_naming_the_piece(
    where: tuple[Any, ...], named: str, tmp_path: Path
) -> None:
    """A valid file missing a key: CheckpointError naming it, raised before anything changes."""
    _train_until(_build(tmp_path / "run"), 5, 5)
    state = torch.load(tmp_path / "run" / "ckpt-0000000005.pt", weights_only=True)
    _delete(state, where)
    damaged = tmp_path / "damaged.pt"
    torch.save(state, damaged)
    run, before = _candidate(tmp_path / "run")
    with pytest.raises(loopkit.CheckpointError) as info:
        run["ckpt"].resume(damaged)
    assert named in str(info.value) and str(damaged) in str(info.value)
    assert _changed(before, _everything(run, tmp_path / "run")) == []


_HOLDER = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_EXCL)
fcntl.flock(fd, fcntl.LOCK_EX)
print("locked", flush=True)
sys.stdin.read()
"""


@pytest.mark.skipif(sys.platform == "win32", reason="flock is POSIX")
def test_a_live_writers_temporary_is_never_deleted(tmp_path: Path) -> None:
    """Another process's temporary, locked while written, survives our saves; a dead one's goes."""
    live = tmp_path / ".ckpt-0000000009.pt.tmp-otherhost-4242-0a0b0c0d"
    dead = tmp_path / ".ckpt-0000000008.pt.tmp-otherhost-4141-01020304"
    dead.write_bytes(b"PK half a checkpoint")  # its writer died: no lock is held on it
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(live)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "locked\n"
        run = _setup(tmp_path)
        run["ckpt"].save()
        assert live.exists() and not dead.exists()
        run["ckpt"].resume()  # resume cleans up too, with the same rule
        assert live.exists()
    finally:
        holder.kill()
        holder.wait(timeout=60)
    run["ckpt"].save()  # the kernel dropped the killed writer's lock: now it is stale
    assert not live.exists()
    assert _names(tmp_path) == ["ckpt-0000000000.pt"]


@pytest.mark.skipif(sys.platform == "win32", reason="flock is POSIX")
def test_a_temporary_removed_before_its_lock_is_taken_is_written_afresh(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A clean-up that deletes our temporary before we lock it: the save starts a new one."""
    import fcntl

    from loopkit._checkpoint import _files as _checkpoint_files

    real_flock = fcntl.flock
    blocking_locks: list[int] = []

    def racing_flock(fd: int, op: int) -> None:
        if op == fcntl.LOCK_EX:  # a writer locking its new temporary
            blocking_locks.append(fd)
            if len(blocking_locks) == 1:
                for tmp in tmp_path.glob(".ckpt-*.tmp*"):
                    tmp.unlink()  # as another process's clean-up would, holding the lock
        real_flock(fd, op)

    monkeypatch.setattr(_checkpoint_files.fcntl, "flock", racing_flock)
    run = _setup(tmp_path)
    path = run["ckpt"].save()
    assert path is not None and len(blocking_locks) == 2  # the first one lost, redone
    loopkit.load_checkpoint(path)
    assert _names(tmp_path) == [path.name]


def test_saves_without_step_are_numbered_by_the_checkpointer(tmp_path: Path) -> None:
    """No step=: saves 1, 2, 3 (keep=2 keeps two); a resume continues the numbering at 4."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt = loopkit.Checkpointer(tmp_path, model=model, optimizer=opt, keep=2)
    for batch in batches([4, 4, 4]):
        loss_fn(model, batch).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        ckpt.save()
    assert [p.name for p in ckpt.checkpoints()] == ["ckpt-0000000002.pt", "ckpt-0000000003.pt"]
    fresh = mlp(seed=1)
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.1)
    again = loopkit.Checkpointer(tmp_path, model=fresh, optimizer=fresh_opt, keep=2)
    assert again.resume() == tmp_path / "ckpt-0000000003.pt"
    assert_bit_equal(params(model), params(fresh))
    assert again.save() == tmp_path / "ckpt-0000000004.pt"


def test_a_rollback_starts_a_new_lineage(tmp_path: Path) -> None:
    """resume(older): newer checkpoints move aside intact; the new run's are kept and resumed."""
    run = _build(tmp_path, keep=3)
    _train_until(run, 7, 1)  # ckpt 5, 6, 7 kept
    abandoned = {p.name: p.read_bytes() for p in run["ckpt"].checkpoints()[1:]}
    rolled = _build(tmp_path, keep=3)
    assert rolled["ckpt"].resume(tmp_path / "ckpt-0000000005.pt") == tmp_path / "ckpt-0000000005.pt"
    (aside,) = tmp_path.glob("abandoned-0000000005-*")
    assert {p.name: p.read_bytes() for p in aside.iterdir()} == abandoned
    assert [p.name for p in rolled["ckpt"].checkpoints()] == ["ckpt-0000000005.pt"]
    torch.manual_seed(1)  # the new lineage differs from the abandoned one
    _train_until(rolled, 8, 1)  # saves 6, 7, 8: none pruned for the abandoned 6 and 7
    names = [p.name for p in rolled["ckpt"].checkpoints()]
    assert names == ["ckpt-0000000006.pt", "ckpt-0000000007.pt", "ckpt-0000000008.pt"]
    assert (tmp_path / "ckpt-0000000007.pt").read_bytes() != abandoned["ckpt-0000000007.pt"]
    after_crash = _build(tmp_path, keep=3)
    assert after_crash["ckpt"].resume() == tmp_path / "ckpt-0000000008.pt"
    assert_bit_equal(params(rolled["model"]), params(after_crash["model"]))


def test_a_changed_data_set_is_refused_before_anything_moves(tmp_path: Path) -> None:
    """Resumed mid-epoch with 4 more samples: refused, naming both lengths; nothing moved."""
    _train_until(_build(tmp_path), 6, 6)  # update 6: mid-epoch 2
    run, before = _candidate(tmp_path, n=100)
    with pytest.raises(
        loopkit.CheckpointError, match="100 samples but the state was saved with 96"
    ):
        run["ckpt"].resume()
    assert _changed(before, _everything(run, tmp_path)) == []


def _per_epoch_run(tmp: Path) -> dict[str, Any]:
    """The mnist example's pattern: StepLR stepped after each epoch, outside the step."""
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(48, 8), torch.randn(48, 1))
    loader = distributed.loader(data, batch_size=4, num_workers=0, seed=3)  # 12 batches
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Dropout(0.1), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
    step = loopkit.step(model, opt, accumulate=3)  # 4 updates per epoch
    ckpt = loopkit.Checkpointer(
        tmp, model=model, optimizer=opt, scheduler=sched, step=step, loader=loader, keep=100
    )
    return {
        "model": model,
        "opt": opt,
        "sched": sched,
        "step": step,
        "loader": loader,
        "ckpt": ckpt,
    }


def _per_epoch_train(run: dict[str, Any], epochs: int, kill: str | None = None) -> bool:
    """Train, saving every update; returns False where `kill` stopped it (objects discarded)."""
    step, loader, model = run["step"], run["loader"], run["model"]
    for epoch in range(loader.epoch, epochs):
        for x, y in step.iterate(loader):
            if kill == "next_pass_started" and epoch == 1:
                return False  # the pass of epoch 1 has started: its first batch is drawn
            with step as s:
                s.backward(nn.functional.mse_loss(model(x), y))
            run["ckpt"].maybe_save(every=1)
        if kill == "epoch_code" and epoch == 0:
            return False  # killed during the evaluation, before the scheduler stepped
        torch.rand(5)  # an evaluation that draws random numbers
        run["sched"].step()
    run["ckpt"].save()  # the end state (a deferred end-of-epoch save would wait for a pass)
    return True


@pytest.mark.parametrize("kill", ["next_pass_started", "epoch_code"])
def test_epoch_end_saves_hold_the_epochs_own_code(kill: str, tmp_path: Path) -> None:
    """Per-epoch scheduler (mnist), killed after an epoch's end: lr and weights bit-identical."""
    ref = _per_epoch_run(tmp_path / "ref")
    assert _per_epoch_train(ref, epochs=3)
    ref_rng = torch.get_rng_state()
    run = _per_epoch_run(tmp_path / "run")
    assert not _per_epoch_train(run, epochs=3, kill=kill)
    resumed = _per_epoch_run(tmp_path / "run")
    torch.manual_seed(99)
    path = resumed["ckpt"].resume()
    if kill == "next_pass_started":
        # The save of update 4 (the window that ended epoch 0) was written when epoch 1's
        # pass started: after the scheduler step and the evaluation's random numbers.
        assert path == tmp_path / "run" / "ckpt-0000000004.pt"
        assert resumed["loader"].epoch == 1 and resumed["sched"].last_epoch == 1
        assert resumed["opt"].param_groups[0]["lr"] == 0.05 * 0.7
    else:  # killed before that: update 4's save was never written; update 3's is newest
        assert path == tmp_path / "run" / "ckpt-0000000003.pt"
        assert resumed["loader"].epoch == 0
    assert _per_epoch_train(resumed, epochs=3)
    assert resumed["opt"].param_groups[0]["lr"] == ref["opt"].param_groups[0]["lr"]
    assert_bit_equal(params(ref["model"]), params(resumed["model"]))
    assert torch.equal(torch.get_rng_state(), ref_rng)  # the evaluations drew the same numbers


def test_save_writes_now_and_cancels_a_deferred_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """maybe_save on an epoch's last window waits; save() then writes once, and nothing later."""
    from loopkit._checkpoint import _files as _checkpoint_files

    written: list[str] = []
    real = _checkpoint_files.atomic_save

    def counted(state: Any, path: Path) -> None:
        written.append(path.name)
        real(state, path)

    monkeypatch.setattr(_checkpoint_files, "atomic_save", counted)
    run = _per_epoch_run(tmp_path)
    step, loader, model = run["step"], run["loader"], run["model"]
    for x, y in step.iterate(loader):
        with step as s:
            s.backward(nn.functional.mse_loss(model(x), y))
        run["ckpt"].maybe_save(every=2)
    assert written == ["ckpt-0000000002.pt"]  # update 4 ended the pass: deferred
    run["sched"].step()
    assert run["ckpt"].save() == tmp_path / "ckpt-0000000004.pt"
    assert written == ["ckpt-0000000002.pt", "ckpt-0000000004.pt"]
    next(iter(step.iterate(loader)))  # the next pass starts: nothing deferred is left
    assert written == ["ckpt-0000000002.pt", "ckpt-0000000004.pt"]
    state = loopkit.load_checkpoint(tmp_path / "ckpt-0000000004.pt")
    assert state["scheduler"]["last_epoch"] == 1


_RANKS_SEE_OTHER_DIRS = """
import shutil, sys, torch
from pathlib import Path
from torch import nn
import loopkit
from loopkit import distributed

with distributed.setup() as info:
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = loopkit.step(model, opt)
    with step as s:
        s.backward(model(torch.ones(2, 4)).sum())
    saved = loopkit.Checkpointer(sys.argv[1], model=model, optimizer=opt, step=step).save()
    if info.rank == 0:  # each rank its own directory (node-local disks): rank 1's is empty
        (Path(sys.argv[1]) / "rank0").mkdir()
        shutil.copy(saved, Path(sys.argv[1]) / "rank0")
    torch.distributed.barrier()
    with step as s:
        s.backward(model(torch.ones(2, 4)).sum())
    ckpt = loopkit.Checkpointer(
        f"{sys.argv[1]}/rank{info.rank}", model=model, optimizer=opt, step=step
    )
    before = [p.detach().clone() for p in model.parameters()]
    try:
        ckpt.resume()
        print(f"rank {info.rank} resumed", flush=True)
    except loopkit.CheckpointError as err:
        same = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
        print(f"rank {info.rank} refused (unchanged={same}): {err}", flush=True)
"""


@deep
def test_ddp_ranks_that_see_different_checkpoints_all_refuse(tmp_path: Path) -> None:
    """2 processes, per-rank directories: both ranks raise, none trains on alone (no hang)."""
    script = tmp_path / "script.py"
    script.write_text(_RANKS_SEE_OTHER_DIRS)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(script), str(tmp_path)],
        cwd=ROOT, env=launch_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    out = proc.stdout
    assert proc.returncode == 0, out[-2000:] + proc.stderr[-2000:]
    for rank in (0, 1):
        assert f"rank {rank} refused (unchanged=True)" in out, out
    assert "ranks found different checkpoints" in out and "rank 1: none" in out


@pytest.mark.parametrize("every", [1, 2])
def test_save_if_needed_saves_a_window_skipped_since_the_last_save(
    tmp_path: Path, every: int
) -> None:
    """A skipped update leaves the count but changes the state (skip counters, the data's
    place): maybe_save (so a stop's save) writes that update's checkpoint again, holding
    the skip (a resume at update 1 then a skip then a stop used to keep the older one);
    save_if_needed then has nothing new to save."""
    torch.manual_seed(0)
    net = nn.Linear(3, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    step = loopkit.step(net, opt, accumulate=every, skip_nonfinite=True)
    ckpt = loopkit.Checkpointer(tmp_path, model=net, optimizer=opt, step=step)
    written = []
    for scale in [1.0] * every + [float("inf")] * every:  # update 1, then a skipped window
        with step as s:
            s.backward(net(torch.randn(2, 3)).pow(2).mean() * scale)
        written.append(ckpt.maybe_save(every=1))
    assert (step.updates, step.skipped) == (1, 1)
    assert [w is not None for w in written] == [False] * (every - 1) + [True] + [False] * (
        every - 1
    ) + [True]
    assert [p.name for p in ckpt.checkpoints()] == ["ckpt-0000000001.pt"]
    saved = torch.load(ckpt.checkpoints()[-1], weights_only=True)
    assert saved["step"]["accumulate"]["skipped"] == 1
    assert ckpt.maybe_save(every=1) is None and ckpt.save_if_needed() is None  # nothing new


class _WithBlock(nn.Module):
    """A model one of whose blocks is compiled on its own (its keys gain ``_orig_mod.``)."""

    def __init__(self, compile_block: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        block = nn.Sequential(nn.Linear(8, 8), nn.GELU())
        self.block = torch.compile(block) if compile_block else block
        self.head = nn.Linear(8, 1)
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(x))  # type: ignore[no-any-return]


def _wrapped(how: str, compile_block: bool = False) -> nn.Module:
    model: nn.Module = _WithBlock(compile_block)
    for layer in how.split("+") if how else []:
        model = (
            torch.compile(model)
            if layer == "compile"
            else nn.parallel.DistributedDataParallel(model)
        )
    return model


@pytest.mark.parametrize(
    "saved_as,resumed_as",
    [("compile", ""), ("", "compile"), ("compile+ddp", ""), ("compile+ddp", "ddp+compile"),
     ("ddp", "compile+ddp"), ("ddp+compile", "")],
)  # fmt: skip
def test_a_checkpoint_does_not_depend_on_the_wrapping(
    saved_as: str, resumed_as: str, tmp_path: Path, process_group: None
) -> None:
    """Saved keys are the user's module's (no module., no _orig_mod. at any level): a model
    saved compiled, under DDP, in either order, or with a compiled block, resumes bit for bit
    into any other wrapping of the same model."""
    for block in (False, True):
        saved = _wrapped(saved_as, compile_block=block)
        with torch.no_grad():
            for p in saved.parameters():
                p.add_(torch.randn_like(p))
        path = loopkit.Checkpointer(tmp_path / f"{saved_as}-{block}", model=saved).save()
        assert path is not None
        keys = loopkit.load_checkpoint(path)["model"].keys()
        assert sorted(keys) == [
            "block.0.bias",
            "block.0.weight",
            "head.bias",
            "head.weight",
            "seen",
        ]
        resumed = _wrapped(resumed_as, compile_block=not block)
        loopkit.Checkpointer(tmp_path / f"{saved_as}-{block}", model=resumed).resume()
        assert_bit_equal(list(resumed.parameters()), list(saved.parameters()))


def test_a_checkpoint_written_with_the_ddp_prefix_still_resumes(
    tmp_path: Path, process_group: None
) -> None:
    """A file from before (keys module.* of a DDP model) resumes into DDP and into one process."""
    saved = _wrapped("ddp")
    ckpt = loopkit.Checkpointer(tmp_path, model=saved)
    path = ckpt.save()
    assert path is not None
    state = torch.load(path, weights_only=True)
    state["model"] = {f"module.{k}": v for k, v in state["model"].items()}
    torch.save(state, path)
    for how in ("ddp", "", "compile+ddp"):
        resumed = _wrapped(how)
        with torch.no_grad():
            for p in resumed.parameters():
                p.zero_()
        loopkit.Checkpointer(tmp_path, model=resumed).resume(path)
        assert_bit_equal(list(resumed.parameters()), list(saved.parameters()))


def _adam_run(directory: Path, stop: int | None, group: bool = False) -> list[nn.Module]:
    """AdamW under a step (or a two-member group) checkpointed with no optimizer=."""
    torch.manual_seed(0)
    models = [mlp(), mlp(seed=1)] if group else [mlp()]
    steps = [loopkit.step(m, torch.optim.AdamW(m.parameters(), lr=1e-2), accumulate=2)
             for m in models]  # fmt: skip
    stepper: Any = loopkit.steps(*steps) if group else steps[0]
    ckpt = loopkit.Checkpointer(directory, model=nn.ModuleList(models), step=stepper)
    ckpt.resume()
    data = batches([4] * 12)[2 * stepper.updates :]
    for batch in stepper.iterate(data):
        for m, s in zip(models, steps, strict=True):
            with s as st:
                st.backward(loss_fn(m, batch))
        ckpt.maybe_save(every=1)
        if stop is not None and stepper.updates == stop:
            break
    return models


@pytest.mark.parametrize("group", [False, True])
def test_the_steps_optimizer_is_saved_without_optimizer_given(tmp_path: Path, group: bool) -> None:
    """Checkpointer(model=, step=) saves the step's optimizer (each member's in a group): a
    resume continues AdamW's moments, bit-identical to the uninterrupted run."""
    whole = _adam_run(tmp_path / "a", None, group)
    _adam_run(tmp_path / "b", 3, group)
    resumed = _adam_run(tmp_path / "b", None, group)
    for a, b in zip(whole, resumed, strict=True):
        assert_bit_equal(list(a.parameters()), list(b.parameters()))


def test_a_file_without_the_steps_optimizer_still_resumes_and_says_so(tmp_path: Path) -> None:
    """A checkpoint written before the step's optimizer was saved by default loads the rest,
    and warns that the optimizer keeps its state."""
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = loopkit.step(model, opt)
    path = loopkit.Checkpointer(tmp_path, model=model, step=step).save()
    assert path is not None
    state = torch.load(path, weights_only=True)
    del state["optimizer"], state["optimizer_shapes"]
    torch.save(state, path)
    fresh = mlp(seed=5)
    step2 = loopkit.step(fresh, torch.optim.AdamW(fresh.parameters(), lr=1e-2))
    with pytest.warns(UserWarning, match="no 'optimizer' state"):
        loopkit.Checkpointer(tmp_path, model=fresh, step=step2).resume()
    assert_bit_equal(list(fresh.parameters()), list(model.parameters()))


def test_another_optimizer_given_beside_the_steps_keeps_both(tmp_path: Path) -> None:
    """optimizer= naming another optimizer than the step's: both are saved and resumed."""
    model, head = mlp(), nn.Linear(1, 1)
    opt_head = torch.optim.SGD(head.parameters(), lr=0.1, momentum=0.9)
    step = loopkit.step(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    for batch in step.iterate(batches([4, 4])):
        with step as s:
            s.backward(loss_fn(model, batch))
        head(torch.ones(1, 1)).sum().backward()
        opt_head.step()
    ckpt = loopkit.Checkpointer(tmp_path, model=model, optimizer=opt_head, step=step)
    path = ckpt.save()
    assert path is not None
    saved = loopkit.load_checkpoint(path)
    assert {"optimizer", "step.optimizer"} <= set(saved)
    assert saved["step.optimizer"]["state"] and saved["optimizer"]["state"]
