"""What torch.compile did while the doctor watched: graphs compiled, graph breaks, recompiles.

Read from dynamo's own records (its graph-break counter and its compilation metrics, kept
for the last 64 compilations by default) when a report is made: nothing runs per step and
no host-device sync is added. A pure function turns each reason into the tip that fixes it.
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from typing import Any, TypedDict


class CompileStats(TypedDict):
    """torch.compile's work since the doctor was built."""

    graphs: int  # frames compiled, first compilations and recompilations
    compile_seconds: float
    recompiles: list[str]  # "where: reason", one per recompilation
    graph_breaks: dict[str, int]  # reason (its first lines) -> times


def _dynamo_utils() -> Any:
    """``torch._dynamo.utils`` if dynamo is loaded (importing it would cost about a second)."""
    return sys.modules.get("torch._dynamo.utils")


class CompileWatch:
    """Snapshots dynamo's records at construction; ``stats()`` is what came after."""

    __slots__ = ("_breaks", "_since_us")

    def __init__(self) -> None:
        utils = _dynamo_utils()
        self._breaks: Counter[str] = Counter(
            dict(utils.counters["graph_break"]) if utils is not None else {}
        )
        self._since_us = time.time_ns() // 1000  # compilation metrics carry epoch times

    def stats(self) -> CompileStats:
        """Compilations, recompiles and graph breaks since construction."""
        utils = _dynamo_utils()
        if utils is None:
            return {"graphs": 0, "compile_seconds": 0.0, "recompiles": [], "graph_breaks": {}}
        entries = [
            e for e in utils.get_compilation_metrics() if (e.start_time_us or 0) >= self._since_us
        ]
        recompiles = [
            f"{e.co_name} ({_short(e.co_filename)}:{e.co_firstlineno}): "
            f"{_first_line(e.recompile_reason)}"
            for e in entries
            if e.recompile_reason
        ]
        now = Counter(dict(utils.counters["graph_break"]))
        breaks = {_summary(k): n - self._breaks.get(k, 0) for k, n in now.items()}
        return {
            "graphs": len(entries),
            "compile_seconds": sum(e.entire_frame_compile_time_s or 0.0 for e in entries),
            "recompiles": recompiles,
            "graph_breaks": {k: n for k, n in breaks.items() if n > 0},
        }


def _short(path: str | None) -> str:
    return "/".join((path or "?").split("/")[-2:])


def _first_line(text: str) -> str:
    line = text.strip().splitlines()[0] if text.strip() else text
    return " ".join(line.split("#")[0].split())  # dynamo's guard text: no source comment


def _summary(reason: str) -> str:
    """A graph break's reason in a line: its title and, if any, its explanation."""
    lines = [ln.strip() for ln in reason.strip().splitlines() if ln.strip()]
    title = lines[0] if lines else reason
    explanation = next((ln for ln in lines[1:] if ln.startswith("Explanation:")), "")
    return f"{title} ({explanation.removeprefix('Explanation: ')})" if explanation else title


# Reasons that need no fix: a graph per case, compiled once, no cost after the first steps
# (blocks of one class whose first input needs no grad and the next ones' do), and breaks
# written on purpose (torch.optim's step has two, around its no_grad, by design).
_BENIGN = ("requires_grad mismatch", "Call to `torch._dynamo.graph_break()`")
# (words found in a reason, the tip): the first match wins.
_RECOMPILE_TIPS = (
    (("size mismatch", "stride mismatch"),
     "a batch of another shape recompiles: drop the ragged last batch (drop_last=True on "
     "the loader), or mark the varying dimension dynamic before the call "
     "(torch._dynamo.mark_dynamic(x, 0)), or pad to a few fixed lengths"),
    (("['lr']", "param_groups"),
     "the learning rate is a Python float that the scheduler changes: "
     "loopkit.step(..., compile_optimizer=True) compiles the optimizer step with tensor lrs"),
    ((".training",),
     "a train()/eval() switch: each mode compiles once; evaluate through loopkit.evaluate "
     "or a separately compiled model so the switch does not recur inside the loop"),
    ((" == ",),
     "a Python number that changes between calls is baked into the graph: pass it as a "
     "tensor (torch.tensor(x)), so the graph takes it as an input"),
)  # fmt: skip
_BREAK_TIPS = (
    (("DistributedDataParallel", "_DDPSink", "ddp", "fsdp", "FSDP"),
     "the model was compiled around its DDP/FSDP wrapper: compile first, then wrap "
     "(loopkit.distributed.wrap(model, compile=True))"),
    (("lr_scheduler",),
     "optimizer.step() compiled through the scheduler's wrapper: "
     "loopkit.step(..., compile_optimizer=True) compiles the class's step instead"),
    (("item()", "data-dependent", "Data-dependent"),
     "a host read (.item(), a branch on a tensor) inside compiled code: move it out (log "
     "with loopkit.detach_logging), or set torch._dynamo.config.capture_scalar_outputs = True"),
    (("print", "logging"),
     "a print or log call inside compiled code: move it out of the compiled function"),
)  # fmt: skip


def _tip(reason: str, table: tuple[tuple[tuple[str, ...], str], ...]) -> str | None:
    return next((tip for words, tip in table if any(w in reason for w in words)), None)


def compile_tips(s: CompileStats, steps: int) -> list[tuple[float, str]]:
    """The tips for what compile did, each with a weight (how costly it looks)."""
    found: dict[str, float] = {}
    for reason in s["recompiles"]:
        if any(b in reason for b in _BENIGN):
            continue
        tip = _tip(reason, _RECOMPILE_TIPS) or (
            "recompiles: find the guard that fails in the reason above (TORCH_LOGS=recompiles)"
        )
        found[tip] = found.get(tip, 0.0) + 1.0 / max(steps, 1)
    for reason, n in s["graph_breaks"].items():
        if any(b in reason for b in _BENIGN):
            continue
        tip = _tip(reason, _BREAK_TIPS) or (
            "graph breaks: each splits the compiled code in two (see the reason above; "
            "TORCH_LOGS=graph_breaks shows the line)"
        )
        found[tip] = found.get(tip, 0.0) + 0.5 * n / max(steps, 1)
    return [(min(1.0, 0.3 + w), f"torch.compile: {t}") for t, w in found.items()]


def compile_lines(s: CompileStats) -> list[str]:
    """The report's lines for torch.compile (none when nothing was compiled)."""
    if not s["graphs"] and not s["graph_breaks"]:
        return []
    breaks = sum(s["graph_breaks"].values())
    lines = [
        f"  torch.compile          {s['graphs']} graph(s) compiled in "
        f"{s['compile_seconds']:.1f} s, {breaks} graph break(s), "
        f"{len(s['recompiles'])} recompile(s)"
    ]
    lines += [f"    recompiled {r}" for r in s["recompiles"][:3]]
    lines += [f"    break x{n}: {r}" for r, n in Counter(s["graph_breaks"]).most_common(3)]
    return lines
