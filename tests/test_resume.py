"""Resume: atomic checkpoints, bit-identical continuation after SIGKILL, safe loading, guards."""

from __future__ import annotations

import os
import pickle
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_bit_equal, batches, launch_env, loss_fn, mlp, params
from torch import nn

import loopkit
from loopkit import distributed

ROOT = Path(__file__).resolve().parent.parent
# 48 updates, a save every 2: enough left to kill 10 times; the payload makes saves slow
# enough (tens of ms with fsync) to be caught in the middle.
EXAMPLE = ["examples/train_resumable.py", "--epochs", "6", "--save-every", "2",
           "--payload-mb", "16"]  # fmt: skip


def _all_checkpoints_readable(directory: Path) -> list[str]:
    names = []
    for path in sorted(directory.glob("ckpt-*.pt")):
        loopkit.load_checkpoint(path)  # raises if any finished checkpoint is unreadable
        names.append(path.name)
    return names


def _start(cmd: list[str]) -> tuple[subprocess.Popen[str], list[str]]:
    """Start a run; its stdout lines are collected by a thread as they come."""
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=launch_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    lines: list[str] = []

    def read() -> None:
        assert proc.stdout is not None
        lines.extend(iter(proc.stdout.readline, ""))

    threading.Thread(target=read, daemon=True).start()
    return proc, lines


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_sigkill_at_ten_points_then_resume_is_bit_identical(precision: str, tmp_path: Path) -> None:
    """Killed 10 times (3 of them mid-save) and resumed each time: the uninterrupted weights."""
    ref = tmp_path / "ref.pt"
    subprocess.run(
        [
            sys.executable,
            *EXAMPLE,
            "--precision",
            precision,
            "--dir",
            str(tmp_path / "ref_run"),
            "--out",
            str(ref),
        ],
        cwd=ROOT,
        env=launch_env(),
        check=True,
        capture_output=True,
        timeout=300,
    )
    run_dir = tmp_path / "run"
    cmd = [sys.executable, *EXAMPLE, "--precision", precision, "--dir", str(run_dir)]
    rng = random.Random(f"kills-{precision}")
    mid_save, resumed = 0, 0
    for kill in range(10):
        proc, lines = _start(cmd)
        during_save = kill % 3 == 1  # kills 1, 4, 7: while a save is being written
        # The others: a random moment after the run has made its first save.
        extra = rng.uniform(0.0, 0.15)
        deadline = time.monotonic() + 120
        saved_at = None
        while time.monotonic() < deadline and proc.poll() is None:
            if during_save and any(run_dir.glob(f".ckpt-*.tmp{proc.pid}")):
                break
            if not during_save and saved_at is None and any("saved" in x for x in lines):
                saved_at = time.monotonic()
            if saved_at is not None and time.monotonic() > saved_at + extra:
                break
            time.sleep(0.001)
        if proc.poll() is not None:
            pytest.fail(f"the run finished after only {kill} kills: make it longer")
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
        mid_save += during_save and any(run_dir.glob(f".ckpt-*.tmp{proc.pid}"))
        resumed += any("resumed from" in x for x in lines)
        _all_checkpoints_readable(run_dir)  # never a corrupt checkpoint on disk
    final = tmp_path / "final.pt"
    proc2 = subprocess.run(
        [*cmd, "--out", str(final)],
        cwd=ROOT,
        env=launch_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc2.returncode == 0, proc2.stderr[-2000:]
    assert mid_save == 3, "a kill meant for the middle of a save missed it"
    assert resumed == 9  # every run after the first continued from a checkpoint
    a, b = torch.load(ref, weights_only=True), torch.load(final, weights_only=True)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not list(run_dir.glob(".ckpt-*.tmp*"))  # leftovers of the killed saves are gone
    assert len(list(run_dir.glob("ckpt-*.pt"))) == 2  # keep=2


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


def _train(run: dict[str, Any], epochs: int, save_at: int | None = None) -> None:
    step, loader = run["step"], run["loader"]
    for _ in range(loader.epoch, epochs):
        for x, y in step.iterate(loader):
            with step as s:
                s.backward(nn.functional.mse_loss(run["model"](x), y))
            if save_at is not None and step.updates == save_at and step.accumulate.micro_step == 0:
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
    run["step"].accumulate.updates += 1  # a new name, as after another update
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
