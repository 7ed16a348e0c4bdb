"""probe_micro_batch's two-peak search: the extrapolation (pure), the search against a
simulated memory (a CPU has no peak counter to read), and on a real GPU when there is one;
every trial taken back, gradients and what DDP and FSDP2 keep between backwards included
(on 2 ranks: ``dist_worker.py``'s ``probe_taken_back``)."""

from __future__ import annotations

import copy
import itertools
from typing import Any

import pytest
import torch
from helpers import deep, requires_cuda
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


@deep
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


def _mse(m: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return nn.functional.mse_loss(m(b[0]), b[1])


def test_gradients_stand_as_before_the_probe() -> None:
    """A gradient accumulated by hand before the probe is the same tensor with the same values
    after it; a parameter outside the optimizer gets no gradient from the trials."""
    torch.manual_seed(0)
    model = nn.Sequential(OOMAbove(40), nn.Linear(8, 4), nn.Tanh(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model[1].parameters(), lr=0.1)  # model[3] is trained elsewhere
    model[1].weight.grad = held = torch.ones(4, 8)
    batch = (torch.randn(128, 8), torch.randn(128, 1))
    assert loopkit.probe_micro_batch(model, opt, _mse, batch) == 32
    assert model[1].weight.grad is held and torch.equal(held, torch.ones(4, 8))
    assert model[1].bias.grad is None
    assert model[3].weight.grad is None and model[3].bias.grad is None


class _OOMInBackward(torch.autograd.Function):
    """The identity, whose backward runs out of memory above 4 samples."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.samples = len(x)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        if ctx.samples > 4:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return grad


def _probed_run(probe: bool, oom: str | None, shard: bool = True) -> list[torch.Tensor]:
    """FSDP2 over each Linear (or no wrapping), AdamW, a probe or none, then 2 updates of
    accumulate=2: the weights and AdamW's state. ``oom``: the probe's 8-sample trial dies in
    its "forward" or its "backward" (between the two Linears)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    gate = OOMAbove(4 if oom == "forward" else 8)
    model = nn.Sequential(nn.Linear(8, 16), gate, nn.Tanh(), nn.Linear(16, 2))
    if oom == "backward":
        gate.forward = _OOMInBackward.apply  # type: ignore[method-assign]
    # The mesh named: on a machine with a GPU, fully_shard's default mesh would be on it.
    mesh = init_device_mesh("cpu", (1,)) if shard else None
    for layer in (model[0], model[3], model) if shard else ():
        fully_shard(layer, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    if probe:
        big = (torch.randn(8, 8) * 10, torch.randn(8, 2) * 10)
        assert loopkit.probe_micro_batch(model, opt, _mse, big) == (8 if oom is None else 4)
    g = torch.Generator().manual_seed(1)
    step = loopkit.step(model, opt, accumulate=2)
    for _ in range(4):
        with step as s:
            x, y = torch.randn(4, 8, generator=g), torch.randn(4, 2, generator=g)
            s.backward(_mse(model, (x, y)))
    moments = [v for state in opt.state.values() for v in state.values()]
    return [t.full_tensor() if hasattr(t, "full_tensor") else t
            for t in (*model.parameters(), *moments)]  # fmt: skip


def test_the_updates_after_a_probe_are_those_without_it(process_group: None) -> None:
    """FSDP2 (one rank) and one unwrapped process: the trials' gradients (FSDP2 keeps them
    unreduced inside, from their backward without sync) are not added to the first update;
    a trial cut short by an out-of-memory error in its forward or its backward leaves no
    half-done iteration: the run ends as without the probe, bit for bit."""
    for shard, oom in itertools.product((True, False), (None, "forward", "backward")):
        probed, plain = _probed_run(True, oom, shard), _probed_run(False, oom, shard)
        assert len(probed) == len(plain) == 16  # 4 parameters, 3 AdamW entries each
        assert all(torch.equal(a, b) for a, b in zip(probed, plain, strict=True))


def test_a_probe_leaves_ddp_fsdp2_and_hsdp_as_if_it_never_ran(
    dist_results: dict[str, Any],
) -> None:
    """2 ranks, FSDP2, HSDP, DDP (find_unused_parameters, BatchNorm) and FSDP2 whose largest
    trial dies in its backward: right after the probe the weights, gradients and RNG are as
    before; after 2 updates the weights, statistics, gradients and AdamW's state are those
    of the run without the probe, bit for bit."""
    for rank in dist_results["probe_taken_back"]:
        for kind, fits in (("fsdp", 8), ("hsdp", 8), ("ddp", 8), ("fsdp_oom", 4)):
            assert rank[f"{kind}_fits"] == fits
            assert rank[f"{kind}_right_after"] and rank[kind], kind
