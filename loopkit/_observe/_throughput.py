"""Throughput against the hardware: FLOPs per step, achieved FLOP/s and model FLOPs utilization.

A step's FLOPs are counted once, on one step (the second: the first may build lazy state),
with ``torch.utils.flop_counter.FlopCounterMode`` over the micro-step's forward and
backward (the optimizer's element-wise update is not counted: it is O(parameters), small
beside the matmuls), or taken from the user (``doctor(flops_per_step=...)``). MFU is the
achieved FLOP/s over the device's dense peak for the run's precision: from the table below
for common GPUs, or ``doctor(peak_flops=...)``. A CPU has no entry: FLOP/s is reported,
MFU only with a peak given.
"""

from __future__ import annotations

from typing import Any

import torch

# Dense (no sparsity) peak FLOP/s from the vendors' data sheets, by precision. fp32 is the
# plain fp32 rate (not TF32). Matched against torch.cuda.get_device_name(), first hit wins.
PEAKS: tuple[tuple[str, dict[str, float]], ...] = (
    ("H200", {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12}),  # H200 SXM
    ("H100 PCIe", {"bf16": 756e12, "fp16": 756e12, "fp32": 51e12}),
    ("H100", {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12}),  # H100 SXM
    ("A100", {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12}),
    ("L4", {"bf16": 121e12, "fp16": 121e12, "fp32": 30.3e12}),
    ("A10", {"bf16": 125e12, "fp16": 125e12, "fp32": 31.2e12}),
    ("V100", {"fp16": 125e12, "fp32": 15.7e12}),  # no bf16 tensor cores
    ("RTX 4090", {"bf16": 165.2e12, "fp16": 165.2e12, "fp32": 82.6e12}),
    ("RTX 3090", {"bf16": 71e12, "fp16": 71e12, "fp32": 35.6e12}),
)


def peak_for(device_name: str, precision: str | None) -> tuple[str, float] | None:
    """(the table's name, peak FLOP/s) for a device name and precision; None if unknown."""
    for name, peaks in PEAKS:
        if name.lower() in device_name.lower():
            peak = peaks.get(precision or "fp32")
            return None if peak is None else (name, peak)
    return None


def device_peak(device: torch.device | None, precision: str | None) -> tuple[str, float] | None:
    """The peak of the device the run is on (CUDA only; a CPU has no table entry)."""
    if device is None or device.type != "cuda" or not torch.cuda.is_available():
        return None
    return peak_for(torch.cuda.get_device_name(device), precision)


class FlopCount:
    """Counts one step's FLOPs (on step ``at``) unless the user gave them."""

    def __init__(self, given: float | None, at: int = 2) -> None:
        if given is not None and (isinstance(given, bool) or not given > 0):
            raise ValueError(f"flops_per_step must be a number > 0 or None, got {given!r}")
        self.per_step: float | None = given
        self.at = at
        self._mode: Any = None

    def start(self, number: int) -> None:
        """Start counting if this is the step to count (and nothing was given)."""
        if self.per_step is not None or number != self.at:
            return
        from torch.utils.flop_counter import FlopCounterMode

        mode: Any = FlopCounterMode(display=False)
        mode.__enter__()
        self._mode = mode

    def stop(self, ok: bool) -> None:
        """Stop counting; keep the count if the step ended without an exception."""
        mode, self._mode = self._mode, None
        if mode is None:
            return
        mode.__exit__(None, None, None)
        if ok:
            self.per_step = float(mode.get_total_flops())
        else:
            self.at += 1  # count the next step instead


def check_peak(peak_flops: object) -> None:
    """Refuse a peak that is not a positive number of FLOP/s."""
    if peak_flops is not None and (
        isinstance(peak_flops, bool) or not isinstance(peak_flops, int | float) or peak_flops <= 0
    ):
        raise ValueError(f"peak_flops must be FLOP/s > 0 or None, got {peak_flops!r}")


def hardware(
    flops: FlopCount,
    steps: int,
    seconds: float,
    peak_flops: float | None,
    device: torch.device | None,
    precision: str | None,
) -> dict[str, Any]:
    """The report's compute figures: FLOP per step, achieved FLOP/s, MFU and its peak."""
    peak = ("given", peak_flops) if peak_flops is not None else device_peak(device, precision)
    out = utilization(flops.per_step, steps, seconds, peak)
    return {
        "flops_per_step": out.get("flops_per_step"),
        "flops_per_s": out.get("flops_per_s"),
        "mfu": out.get("mfu"),
        "peak": None if peak is None or "mfu" not in out else f"{peak[0]}, {peak[1]:.3g}",
    }


def utilization(
    flops_per_step: float | None,
    steps: int,
    seconds: float,
    peak: tuple[str, float] | None,
) -> dict[str, float]:
    """flops_per_s (and mfu, against ``peak``) from a per-step count over ``steps``."""
    if not flops_per_step or not steps or seconds <= 0:
        return {}
    achieved = flops_per_step * steps / seconds
    out = {"flops_per_step": flops_per_step, "flops_per_s": achieved}
    if peak is not None:
        out["mfu"] = achieved / peak[1]
    return out
