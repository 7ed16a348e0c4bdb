"""probe_micro_batch's two-peak search: the extrapolation (pure), the search against a
simulated memory (a CPU has no peak counter to read), and on a real GPU when there is one."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import requires_cuda
from torch import nn

import loopkit
from loopkit._step import _probe
from loopkit._step._probe import extrapolate

FIXED, PER_SAMPLE = 1000.0, 10.0  # the simulated memory: peak = FIXED + PER_SAMPLE * samples


class OOMAbove(nn.Module):
    """Raises CUDA's out-of-memory error above ``limit`` samples; counts the sizes tried."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit, self.tried = limit, []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.tried.append(x.shape[0])
        if x.shape[0] > self.limit:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return x


def test_the_line_through_two_peaks_meets_the_capacity() -> None:
    """Peaks 1040 at 4 and 1080 at 8: 10 per sample over 1000 fixed; a capacity of 1900
    fits 90; clamped to the batch (less one) and to the larger measured size; memory that
    does not grow with the batch leaves the batch as the limit."""
    assert extrapolate(4, 1040.0, 8, 1080.0, 1900.0, 127) == 90
    assert extrapolate(4, 1040.0, 8, 1080.0, 1e9, 127) == 127
    assert extrapolate(4, 1040.0, 8, 1080.0, 1000.0, 127) == 8
    assert extrapolate(4, 1040.0, 8, 1040.0, 1900.0, 127) == 127


def _simulated(monkeypatch: pytest.MonkeyPatch, capacity: float) -> None:
    """The model "on CUDA", with peaks and a capacity read from the simulated memory."""
    monkeypatch.setattr(_probe, "model_device", lambda model: torch.device("cuda"))
    monkeypatch.setattr(_probe, "capacity_bytes", lambda device: capacity)

    def peak(fits: object, m: int, device: torch.device) -> float | None:
        return FIXED + PER_SAMPLE * m if fits(m) else None  # type: ignore[operator]

    monkeypatch.setattr(_probe, "peak_bytes", peak)


def test_two_peaks_finds_a_larger_size_than_halving_with_few_trials(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """128 samples, out of memory above 85 where the line predicts 90 (fragmentation): the
    batch, 16 and 32 measured, 90 refused, 81 fits (halving would stop at 64); every trial
    taken back, bit for bit."""
    _simulated(monkeypatch, capacity=(FIXED + PER_SAMPLE * 90.5) / _probe.CAPACITY_SHARE)
    torch.manual_seed(0)
    gate = OOMAbove(85)
    model = nn.Sequential(gate, nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch = (torch.randn(128, 8), torch.randn(128, 1))
    before = copy.deepcopy(model.state_dict())

    def loss(m: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return nn.functional.mse_loss(m(b[0]), b[1])

    assert loopkit.probe_micro_batch(model, opt, loss, batch, search="two_peaks") == 81
    assert gate.tried == [128, 16, 32, 90, 81]
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert not opt.state and all(p.grad is None for p in model.parameters())
    gate.tried.clear()
    assert loopkit.probe_micro_batch(model, opt, loss, batch) == 64
    assert gate.tried == [128, 64]


def test_two_peaks_falls_back_when_only_the_smaller_size_fits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Out of memory above 20: 16 fits, 32 does not, so 16 (no second point to extrapolate
    from); above 5: 16 and 8 do not, 4 does, its double does not: 4."""
    _simulated(monkeypatch, capacity=1e9)
    for limit, want, tried in ((20, 16, [128, 16, 32]), (5, 4, [128, 16, 8, 4, 8])):
        gate = OOMAbove(limit)
        model = nn.Sequential(gate, nn.Linear(8, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        batch = torch.randn(128, 8)
        got = loopkit.probe_micro_batch(model, opt, lambda m, b: m(b).pow(2).mean(), batch,
                                        search="two_peaks")  # fmt: skip
        assert (got, gate.tried) == (want, tried)


def test_two_peaks_needs_cuda() -> None:
    """On a CPU there is no peak counter: refused, naming the search that works."""
    model = nn.Linear(8, 1)
    with pytest.raises(ValueError, match="use search='halving'"):
        loopkit.probe_micro_batch(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                  lambda m, b: m(b).mean(), torch.randn(4, 8),
                                  search="two_peaks")  # fmt: skip


@requires_cuda
def test_two_peaks_on_a_gpu_fits_what_it_returns() -> None:
    """A real GPU held to 1 GiB: the size found trains without an out-of-memory error, and
    is at least the one halving finds."""
    torch.cuda.set_per_process_memory_fraction(
        2**30 / torch.cuda.get_device_properties(0).total_memory
    )
    try:
        model = nn.Sequential(nn.Linear(4096, 4096), nn.GELU(), nn.Linear(4096, 1)).cuda()
        opt = torch.optim.AdamW(model.parameters())
        batch = torch.randn(16384, 4096, device="cuda", dtype=torch.bfloat16)

        def loss(m: nn.Module, b: torch.Tensor) -> torch.Tensor:
            return m(b.float()).pow(2).mean()

        peaks = loopkit.probe_micro_batch(model, opt, loss, batch, search="two_peaks")
        halving = loopkit.probe_micro_batch(model, opt, loss, batch)
        assert peaks >= halving
        loss(model, batch[:peaks]).backward()
        opt.step()
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
