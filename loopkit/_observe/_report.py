"""What the doctor says: the report text and the tips, as pure functions of its numbers."""

from __future__ import annotations

import os
from collections import Counter
from typing import TypedDict

from ._compile_events import CompileStats, compile_lines, compile_tips

PHASES = ("data", "between", "h2d", "compute", "optimizer", "logging", "communication")
_LABELS = {
    "data": "waiting for data",
    "between": "outside the step",
    "h2d": "host-to-device copy",
    "compute": "forward + backward",
    "optimizer": "optimizer step",
    "logging": "logging",
    "communication": "communication (overlaps)",
}


class Stats(TypedDict):
    """The numbers behind a report (``doctor.stats()``)."""

    steps: int
    seconds: dict[str, float]
    share: dict[str, float]
    samples_per_s: float | None
    tokens_per_s: float | None
    syncs_per_step: float | None
    sync_ops: dict[str, int]
    expected_syncs_per_step: dict[str, float]
    syncs_between_per_step: float | None  # of syncs_per_step: in the user's code after a step
    sync_lines: dict[str, float]  # "file:line (inside|between)" -> syncs per sampled step
    flops_per_step: float | None  # the mean over the steps (one counted, scaled by samples)
    flops_per_s: float | None  # achieved, over the wall time of the measured steps
    mfu: float | None  # flops_per_s over the device's dense peak for the precision
    peak: str | None  # what the peak was: "A100, 3.12e+14", or "given, ..."
    compile: CompileStats  # what torch.compile did while the doctor watched


class Context(TypedDict):
    """What the doctor knows of the loop besides its numbers: it picks the tips."""

    precision: str | None
    device_type: str | None
    iterated: bool  # whether doc.iterate timed the loader's next() on its own
    num_workers: int | None
    sync_steps: int


# (phase, share above which its tip applies, what the tip says after "N% of each step")
_PHASE_TIPS = (
    (
        "h2d",
        0.1,
        "copies the batch to the device: use pin_memory=True with non-blocking "
        "copies (loopkit.to_device does it for pinned batches), and keep images uint8 on the "
        "host (loopkit.to_device(batch, device, uint8_to=torch.float32))",
    ),
    (
        "optimizer",
        0.25,
        "is the optimizer step: use a fused or foreach optimizer "
        "(torch.optim.AdamW(..., fused=True)), or accumulate more micro-batches per update "
        "(loopkit.accumulate(every=N))",
    ),
    (
        "logging",
        0.1,
        "is logging: flush less often (loopkit.detach_logging(every=N) with a larger N)",
    ),
    (
        "communication",
        0.2,
        "communicates: accumulate gradients with "
        "loopkit.accumulate(every=N), which all-reduces once per update",
    ),
)
_SYNC_TIP = (
    "each stalls the host until the device catches up; log with "
    "loopkit.detach_logging(every=N) instead of .item(), and avoid Python branches on tensor "
    "values"
)
_BF16_TIP = (
    "the step is compute-bound in fp32: try precision='bf16' (loopkit.autocast_step), about "
    "2x faster on GPUs and AMX CPUs"
)
_FP16_CPU_TIP = (
    "precision is fp16 on a CPU: CPUs have no fast fp16 kernels, so fp16 autocast runs far "
    "slower than fp32 there (over 100x measured on a 2-core Xeon); use precision='bf16' "
    "(fast on CPUs with AVX512-BF16 or AMX, and it needs no loss scaling) or 'fp32'"
)
_BETWEEN_TIP = (
    "is spent outside the step, in your code between two steps (prints, evaluation, "
    "checkpoints, another model's step): do that work every N steps instead of every step, "
    "or give another model's step its own doctor"
)
_BETWEEN_UNTIMED_DATA = (
    "; the loader's next() is in there too, untimed: iterate with doc.iterate(loader) (or "
    "loopkit.step(...).iterate(loader)) to time the data wait on its own"
)


def _si(value: float) -> str:
    """``12.3 T``-style: three significant digits and an SI prefix."""
    for prefix, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if value >= scale:
            return f"{value / scale:.3g} {prefix}"
    return f"{value:.3g} "


def as_metrics(s: Stats) -> dict[str, float]:
    """The throughput figures known, as numbers a log's sinks take."""
    figures = {
        "samples_per_s": s["samples_per_s"],
        "tokens_per_s": s["tokens_per_s"],
        "flops_per_s": s["flops_per_s"],
        "mfu": s["mfu"],
    }
    return {k: float(v) for k, v in figures.items() if v is not None}


def report_text(s: Stats, context: Context) -> str:
    """A plain-words report: throughput, phase shares, syncs, and the tips that apply."""
    if not s["steps"]:
        return "loopkit doctor: no step measured yet"
    per_step = sum(v for k, v in s["seconds"].items() if k != "communication") / s["steps"]
    head = f"loopkit doctor: {s['steps']} steps, {1e3 * per_step:.2f} ms per step"
    if s["samples_per_s"]:
        head += f", {s['samples_per_s']:,.0f} samples/s"
    if s["tokens_per_s"]:
        head += f", {s['tokens_per_s']:,.0f} tokens/s"
    lines = [head]
    if s["flops_per_s"]:
        flops = (
            f"  compute                {_si(s['flops_per_s'])}FLOP/s achieved "
            f"({_si(s['flops_per_step'] or 0.0)}FLOP per step)"
        )
        if s["mfu"] is not None:
            flops += f", MFU {100 * s['mfu']:.1f}% of the peak ({s['peak']} FLOP/s)"
        lines.append(flops)
    for name in PHASES:
        if s["seconds"][name] or name == "compute" or (name == "data" and context["iterated"]):
            lines.append(
                f"  {_LABELS[name]:<22} {100 * s['share'][name]:5.1f}%  "
                f"{1e3 * s['seconds'][name] / s['steps']:8.3f} ms/step"
            )
    if s["syncs_per_step"] is not None:
        ops = ", ".join(f"{op} x{n}" for op, n in Counter(s["sync_ops"]).most_common(4))
        between = s["syncs_between_per_step"] or 0.0
        lines.append(
            f"  host-device syncs      {s['syncs_per_step']:.1f} per step "
            f"({s['syncs_per_step'] - between:.1f} inside the step, {between:.1f} between steps; "
            f"sampled on {context['sync_steps']} steps){': ' + ops if ops else ''}"
        )
        for where, n in Counter(s["sync_lines"]).most_common(3):
            lines.append(f"    {n:.1f} per step at {where}")
    if s["expected_syncs_per_step"]:
        needed = "; ".join(
            f"{n:.1f} per step needed by {reason}"
            for reason, n in sorted(s["expected_syncs_per_step"].items(), key=lambda x: -x[1])
        )
        lines.append(f"  loopkit's own syncs    {needed}")
    lines += compile_lines(s["compile"])
    tips = tips_for(s, context)
    lines.append("Tips:" if tips else "Nothing stands out: no tip applies.")
    lines += [f"  - {t}" for t in tips]
    return "\n".join(lines)


def tips_for(s: Stats, context: Context) -> list[str]:
    """The guides' advice that the measurements call for, most costly first."""
    share = s["share"]
    found: list[tuple[float, str]] = []
    if context["precision"] == "fp16" and context["device_type"] == "cpu":
        # A configuration that costs more than anything measured here: first.
        found.append((2.0, _FP16_CPU_TIP))
    if share["data"] > 0.2:
        found.append((share["data"], _data_tip(share["data"], context["num_workers"])))
    if share["between"] > 0.2:
        text = f"{100 * share['between']:.0f}% of each step {_BETWEEN_TIP}"
        if not context["iterated"]:
            text += _BETWEEN_UNTIMED_DATA
        found.append((share["between"], text))
    for phase, threshold, advice in _PHASE_TIPS:
        if share[phase] > threshold:
            found.append((share[phase], f"{100 * share[phase]:.0f}% of each step {advice}"))
    syncs = s["syncs_per_step"]
    if syncs is not None and syncs >= 1:
        ops = ", ".join(op for op, _ in Counter(s["sync_ops"]).most_common(3))
        found.append(
            (
                min(1.0, 0.1 * syncs),
                f"{syncs:.1f} host-device syncs per step ({ops}): {_SYNC_TIP}",
            )
        )
    found += compile_tips(s["compile"], s["steps"])
    if share["compute"] > 0.6 and context["precision"] == "fp32":
        found.append((0.05, _BF16_TIP))
    return [tip for _, tip in sorted(found, key=lambda x: -x[0])]


def _data_tip(share: float, workers: int | None) -> str:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    now = f"num_workers is {workers}; " if workers is not None else ""
    return (
        f"{100 * share:.0f}% of each step waits for data: {now}try num_workers > 0 (this "
        f"machine has {cores} cores), pin_memory with CUDA, persistent_workers=True "
        "(loopkit.distributed.loader sets all three); or preload the data set to RAM"
    )
