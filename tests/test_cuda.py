"""The device paths: each test runs on the CPU here and again on a CUDA GPU where one is.

What only a GPU shows: autocast and GradScaler on "cuda", pinned batches copied ahead
without blocking, the CUDA RNG saved and restored, and host syncs counted by the driver
(``torch.cuda.set_sync_debug_mode``) rather than by loopkit's own CPU counter.
"""

from __future__ import annotations

import contextlib
import functools
import io
import itertools
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_bit_equal, params
from torch import nn

import loopkit
from loopkit import distributed
from loopkit._observe._cuda_sync_warnings import CudaSyncCounter
from loopkit._observe._progress import ProgressDisplay
from loopkit._step import _feed

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
EVERY, LOG_EVERY = 4, 8


def _model(device: str, dropout: float = 0.0) -> nn.Module:
    torch.manual_seed(0)
    layers = [nn.Linear(16, 64), nn.GELU(), nn.Dropout(dropout), nn.Linear(64, 1)]
    return nn.Sequential(*layers).to(device)


def _batches(n: int, device: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(32, 16, generator=g).to(device),
             torch.randn(32, 1, generator=g).to(device)) for _ in range(n)]  # fmt: skip


def _autocast(device: str, precision: str) -> contextlib.AbstractContextManager[Any]:
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device, dtype=torch.bfloat16)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("device", DEVICES)
def test_step_equals_the_hand_loop_bit_for_bit(device: str, precision: str) -> None:
    """Accumulation, clipping and autocast on the device: the hand loop's weights exactly."""
    data = _batches(12, device)
    ref = _model(device)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for i, (x, y) in enumerate(data):
        with _autocast(device, precision):
            loss = nn.functional.mse_loss(ref(x), y)
        (loss / EVERY).backward()
        if (i + 1) % EVERY == 0:
            nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
            opt.step()
            opt.zero_grad(set_to_none=True)
    model = _model(device)
    step = loopkit.step(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                        precision=precision, accumulate=EVERY, clip_grad_norm=0.5)  # fmt: skip
    for x, y in data:
        with step as s:
            s.backward(nn.functional.mse_loss(model(x), y))
    assert step.updates == 3
    assert_bit_equal(params(ref), params(model))


def _count_syncs(device: str) -> Any:
    """The driver's count on CUDA; loopkit's CPU counter (what would stall a GPU) here."""
    return CudaSyncCounter() if device == "cuda" else loopkit.count_host_syncs()


def _syncs(counter: Any) -> int:
    return sum(counter.events.values()) if isinstance(counter, CudaSyncCounter) else counter.count


@pytest.mark.parametrize("device", DEVICES)
def test_a_full_step_syncs_only_at_the_log_flush(
    device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pinned host batches moved by iterate, bf16, accumulation, clipping, a scheduler, an
    EMA, the log and a progress bar redrawn at every micro-step: no host sync on any
    micro-step but the flush's one, none when the pass ends."""
    refreshes: list[int] = []

    class EveryTick(ProgressDisplay):  # the bar redrawn at each tick, each redraw counted
        def _refresh(self, now: float) -> None:
            refreshes.append(self._watched.updates)
            super()._refresh(now)

    monkeypatch.setattr(_feed, "ProgressDisplay", functools.partial(EveryTick, interval=0.0))
    host = [(x.pin_memory(), y.pin_memory()) if device == "cuda" else (x, y)
            for x, y in _batches(8, "cpu")]  # fmt: skip
    model = _model(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    flushed: list[dict[str, float]] = []
    step = loopkit.step(
        model, opt, precision="bf16", accumulate=EVERY, clip_grad_norm=0.5, device=device,
        scheduler=torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5),
        log=loopkit.detach_logging(every=LOG_EVERY, sink=flushed.append),
        ema=loopkit.ema(model, decay=0.9),
    )  # fmt: skip
    counts: list[int] = []
    losses: list[torch.Tensor] = []
    source = itertools.islice(itertools.cycle(host), 3 * LOG_EVERY)
    with contextlib.redirect_stderr(io.StringIO()):
        batches = step.iterate(source, progress=True)
        while True:
            with _count_syncs(device) as counter:
                batch = next(batches, None)
                if batch is not None:
                    x, y = batch
                    assert x.device.type == device
                    with step as s:
                        loss = nn.functional.mse_loss(model(x), y)
                        s.backward(loss)
            counts.append(_syncs(counter))
            if batch is None:  # the pass ended: the bar's last redraw and close
                break
            losses.append(loss.detach().float().cpu())
    # The first micro-step's checks may read; after it, the flush's one read of the log alone.
    flushes = [1 if (i + 1) % LOG_EVERY == 0 else 0 for i in range(1, 3 * LOG_EVERY)]
    assert counts[1:] == [*flushes, 0]
    assert len(refreshes) >= 3 * LOG_EVERY and refreshes[-1] == 3 * LOG_EVERY // EVERY
    assert step.updates == 3 * LOG_EVERY // EVERY and len(flushed) == 3
    expected = [float(torch.stack(losses[i : i + LOG_EVERY]).double().mean())
                for i in range(0, 3 * LOG_EVERY, LOG_EVERY)]  # fmt: skip
    assert [f["loss"] for f in flushed] == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize(
    ("device", "precision"),
    # fp16 on a CPU is slow and warned about (its scaler is tested in tests/checkpoint).
    [(d, p) for d in DEVICES for p in ("fp32", "bf16", "fp16") if (d, p) != ("cpu", "fp16")],
)
def test_resume_on_the_device_is_bit_identical(device: str, precision: str, tmp_path: Path) -> None:
    """Dropout on the device's RNG, the scaler, a pinned loader: saved mid-epoch, resumed by
    fresh objects, the same weights as the run that went on."""

    def setup() -> tuple[nn.Module, Any, Any, Any]:
        data = torch.utils.data.TensorDataset(*_batches(1, "cpu")[0])
        loader = distributed.loader(data, batch_size=4, num_workers=0, seed=2)
        model = _model(device, dropout=0.3)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        step = loopkit.step(model, opt, precision=precision, accumulate=2, clip_grad_norm=1.0)
        ckpt = loopkit.Checkpointer(tmp_path, model=model, optimizer=opt, step=step,
                                    loader=loader)  # fmt: skip
        return model, loader, step, ckpt

    def train(model: nn.Module, loader: Any, step: Any, ckpt: Any, save_at: int = -1) -> None:
        for _ in range(loader.epoch, 3):
            for x, y in step.iterate(loader):
                assert x.device.type == device
                with step as s:
                    s.backward(nn.functional.mse_loss(model(x), y))
                if step.updates == save_at and step.accumulator.micro_step == 0:
                    ckpt.save()

    full = setup()
    train(*full, save_at=5)  # 8 batches an epoch, 4 updates: update 5 is mid-epoch 2
    fresh = setup()
    torch.manual_seed(123)  # other RNG states, which the resume must put back
    if device == "cuda":
        torch.cuda.manual_seed_all(123)
    assert fresh[3].resume() is not None and fresh[2].updates == 5
    train(*fresh)
    assert_bit_equal(params(full[0]), params(fresh[0]))
