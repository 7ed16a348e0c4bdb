"""Throughput against the hardware: FLOPs per step, achieved FLOP/s and model FLOPs utilization.

A step's FLOPs are counted once, on one step (the second: the first may build lazy state),
with ``torch.utils.flop_counter.FlopCounterMode`` over the micro-step's forward and
backward (the optimizer's element-wise update is not counted: it is O(parameters), small
beside the matmuls), or taken from the user (``doctor(flops_per_step=...)``). Steps differ
in size (``micro_batch=`` cuts 32 samples into 24 + 8, a pass ends on a ragged batch), so a
counted step is scaled by samples where every step's samples are known: the run's FLOPs are
the counted step's per sample times the samples of all the steps measured (else its count
times the steps). MFU is the
achieved FLOP/s over the device's dense peak for the run's precision: from the table below
for common GPUs, or ``doctor(peak_flops=...)``. A CPU has no entry: FLOP/s is reported,
MFU only with a peak given.
"""

from __future__ import annotations

from typing import Any

import torch

from .._tracing import EagerStance

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
    """The run's FLOPs: one step's counted (on step ``at``) unless the user gave them, scaled
    by the samples of every step measured where they are known."""

    def __init__(self, given: float | None, at: int = 2) -> None:
        if given is not None and (isinstance(given, bool) or not given > 0):
            raise ValueError(f"flops_per_step must be a number > 0 or None, got {given!r}")
        self.given = given
        self.per_step: float | None = given
        """The counted step's FLOPs (or the given ones)."""
        self.per_sample: float | None = None
        """The counted step's FLOPs over its samples; None if they were not known."""
        self.at = at
        self.steps = 0
        self.samples = 0
        """Samples of the steps measured (their sum; meaningful while ``all_known``)."""
        self.all_known = True
        """Whether every step measured said its samples (> 0)."""
        self.told: int | None = None
        """The next step's samples as ``loopkit.step`` says them (its chunk, after the
        lookahead); else a step's are the samples counted since the last one ended."""
        self._counted_before = 0  # the doctor's sample count as the last step ended
        self._mode: Any = None
        self._eager = EagerStance()

    def start(self, number: int) -> None:
        """Start counting if this is the step to count (and nothing was given)."""
        if self.per_step is not None or number != self.at:
            return
        from torch.utils.flop_counter import FlopCounterMode

        self._eager.__enter__()  # compiled code, eagerly: its ops are counted
        mode: Any = FlopCounterMode(display=False)
        mode.__enter__()
        self._mode = mode

    def stop(self, ok: bool, counted: int) -> None:
        """Stop counting; a step that ended without an exception counts, with its samples
        (0: not known), and gives its FLOPs if it was the one counted. ``counted``: the
        samples the doctor has counted so far (``doc.iterate``, ``doc.count``)."""
        told, self.told = self.told, None
        samples = told if told is not None else counted - self._counted_before
        self._counted_before = counted
        mode, self._mode = self._mode, None
        if mode is not None:
            mode.__exit__(None, None, None)
            self._eager.__exit__()
            if not ok:
                self.at += 1  # count the next step instead
            else:
                self.per_step = float(mode.get_total_flops())
                self.per_sample = self.per_step / samples if samples > 0 else None
        if ok:
            self.steps += 1
            self.samples += samples
            self.all_known = self.all_known and samples > 0

    def total(self) -> float | None:
        """The FLOPs of the steps measured; None before one was counted."""
        if self.per_step is None or not self.steps:
            return None
        if self.given is None and self.per_sample is not None and self.all_known:
            return self.per_sample * self.samples
        return self.per_step * self.steps


def check_peak(peak_flops: object) -> None:
    """Refuse a peak that is not a positive number of FLOP/s."""
    if peak_flops is not None and (
        isinstance(peak_flops, bool) or not isinstance(peak_flops, int | float) or peak_flops <= 0
    ):
        raise ValueError(f"peak_flops must be FLOP/s > 0 or None, got {peak_flops!r}")


def hardware(
    flops: FlopCount,
    seconds: float,
    peak_flops: float | None,
    device: torch.device | None,
    precision: str | None,
) -> dict[str, Any]:
    """The report's compute figures: FLOP per step (the mean), achieved FLOP/s, MFU, its peak."""
    peak = ("given", peak_flops) if peak_flops is not None else device_peak(device, precision)
    out = utilization(flops.total(), flops.steps, seconds, peak)
    return {
        "flops_per_step": out.get("flops_per_step"),
        "flops_per_s": out.get("flops_per_s"),
        "mfu": out.get("mfu"),
        "peak": None if peak is None or "mfu" not in out else f"{peak[0]}, {peak[1]:.3g}",
    }


def utilization(
    flops: float | None,
    steps: int,
    seconds: float,
    peak: tuple[str, float] | None,
) -> dict[str, float]:
    """The mean flops_per_step, flops_per_s (and mfu, against ``peak``) from the ``flops`` of
    ``steps`` steps over ``seconds``."""
    if not flops or not steps or seconds <= 0:
        return {}
    achieved = flops / seconds
    out = {"flops_per_step": flops / steps, "flops_per_s": achieved}
    if peak is not None:
        out["mfu"] = achieved / peak[1]
    return out
