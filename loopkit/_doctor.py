"""doctor: where each step's time goes, how often it stalls the host, and which tip applies.

Per step it times the wait for the loader's next batch (inside ``next()``, when it iterates
the loader), the time spent outside the step otherwise (the user's code between two
steps), the host-to-device copy, forward+backward, the optimizer step, logging and
communication, and it counts host-device syncs on a few sampled steps (counting every op
would slow the loop it measures). On CUDA the phases are timed with CUDA events, resolved
only when a report is made, so the doctor adds no sync of its own.
"""

from __future__ import annotations

import atexit
import os
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from types import TracebackType
from typing import Any, TypeVar

import torch

from ._checks import is_int_at_least
from ._devices import parse_device
from ._host_syncs import _CudaSyncCounter, count_host_syncs

T = TypeVar("T")

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


class _Phase:
    """``with doc.phase(name):`` attributes the time inside to ``name``."""

    __slots__ = ("doc", "name", "previous")

    def __init__(self, doc: doctor, name: str) -> None:
        self.doc, self.name, self.previous = doc, name, ""

    def __enter__(self) -> None:
        self.previous = self.doc._switch(self.name)

    def __exit__(self, *exc: object) -> None:
        self.doc._switch(self.previous)


class doctor:
    """Measure a training loop and say, in plain words, what slows it.

    Alone: ``with doc:`` around each step's body, ``with doc.phase("h2d")``/``("optimizer")``
    around those parts, ``doc.count(samples=..., tokens=...)`` for throughput, and ``for
    batch in doc.iterate(loader)``, which times the loader's ``next()`` (the data wait) and
    counts samples. Time between two steps spent elsewhere is "outside the step" (the
    user's code between steps); without ``doc.iterate`` the data wait is part of it too. In
    ``loopkit.step(..., doctor=doc)`` every phase is timed for you. ``doc.report()``
    returns the report; with ``report_at_exit=True`` it is printed when the program ends.
    """

    def __init__(
        self,
        *,
        loader: Any = None,
        sample_syncs_at: Iterable[int] = (3, 4, 5),
        sample_syncs_every: int | None = 500,
        report_every: int | None = None,
        sink: Callable[[str], object] = print,
        report_at_exit: bool = False,
        device: str | int | torch.device | None = None,
    ) -> None:
        sampled = sorted(set(sample_syncs_at))
        if any(not is_int_at_least(s, 1) for s in sampled):
            raise ValueError(
                f"sample_syncs_at must hold step numbers >= 1 (1 is the first step), got {sampled}"
            )
        for name, value in (
            ("sample_syncs_every", sample_syncs_every),
            ("report_every", report_every),
        ):
            if value is not None and not is_int_at_least(value, 1):
                raise ValueError(f"{name} must be an int >= 1 or None, got {value!r}")
        if not callable(sink):
            raise TypeError(
                f"sink must be callable with the report text (e.g. print), got {sink!r}"
            )
        self.loader = loader
        self.sink = sink
        self.report_every = report_every
        self._sampled = frozenset(sampled)
        self._sample_every = sample_syncs_every
        self._device: torch.device | None = None
        self._cuda = False
        self._inside = False
        self.device = device
        self.steps = 0
        """Steps measured so far."""
        self.samples = 0
        self.tokens = 0
        self.precision: str | None = None
        """Set by loopkit.step: "fp16" on a CPU gets the bf16 tip."""
        self.optimizer: torch.optim.Optimizer | None = None
        """Set by loopkit.step: its host-side step counters are not counted as syncs."""
        self.seconds: dict[str, float] = dict.fromkeys(PHASES, 0.0)
        """Wall seconds per phase over all steps (CUDA phases once resolved by report())."""
        self.syncs: Counter[str] = Counter()
        """The user's host-device syncs on the sampled steps, by operation."""
        self.expected_syncs: Counter[str] = Counter()
        """loopkit's own necessary syncs on the sampled steps, by reason (no tip for them)."""
        self.sync_steps = 0
        self._current = ""
        self._mark = 0.0
        self._last_exit: float | None = None
        self._outside = 0.0  # phase time since the last step (the data wait among it)
        self._iterated = False  # whether doc.iterate has timed the loader's next()
        self._counter: count_host_syncs | _CudaSyncCounter | None = None
        self._events: list[tuple[str, Any, Any]] = []
        self._first: float | None = None
        if report_at_exit:
            atexit.register(self._report_at_exit)

    @property
    def device(self) -> torch.device | None:
        """The training device: as given (loopkit.step sets it), else the optimizer's."""
        if self._device is not None:
            return self._device
        for group in self.optimizer.param_groups if self.optimizer is not None else ():
            for p in group["params"]:
                return p.device  # type: ignore[no-any-return]
        return None

    @device.setter
    def device(self, device: str | int | torch.device | None) -> None:
        if self._inside:
            raise RuntimeError("the doctor's device can change between steps, not inside one")
        dev = None if device is None else parse_device(device)
        self._device = dev
        self._cuda = dev is not None and dev.type == "cuda" and torch.cuda.is_available()

    # -- steps and phases ---------------------------------------------------------------------

    def __enter__(self) -> doctor:
        if self._inside:
            raise RuntimeError("doctor is already inside a step: enter it once per step")
        now = time.perf_counter()
        if self._last_exit is not None:
            # What no phase claimed since the last step (the data wait is claimed by
            # doc.iterate) was the user's code between the steps.
            self.seconds["between"] += max(0.0, now - self._last_exit - self._outside)
        if self._first is None:
            self._first = now
        self._outside = 0.0
        self._inside = True
        self._current = "compute"
        self._mark = now
        if self._cuda:
            self._events.append(("compute", _cuda_event(), None))
        number = self.steps + 1
        if number in self._sampled or (self._sample_every and number % self._sample_every == 0):
            self._start_sync_count()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._switch("")
        self._stop_sync_count()
        self._inside = False
        self._last_exit = time.perf_counter()
        if exc_type is None:
            self.steps += 1
            if self.report_every and self.steps % self.report_every == 0:
                self.sink(self.report())

    def phase(self, name: str) -> _Phase:
        """Attribute the time inside ``with doc.phase(name):`` to one of PHASES."""
        if name not in PHASES:
            raise ValueError(f"unknown phase {name!r}: use one of {', '.join(PHASES)}")
        return _Phase(self, name)

    def _switch(self, name: str) -> str:
        now = time.perf_counter()
        previous = self._current
        if previous and self._first is not None:  # measured from the first step on
            spent = now - self._mark
            if not (self._cuda and self._inside):  # in-step CUDA phases are timed by events
                self.seconds[previous] += spent
            if not self._inside:
                self._outside += spent
        if self._cuda and self._inside:
            # Device time: an event per phase boundary, read when the report is made.
            end = _cuda_event()
            if self._events and self._events[-1][2] is None:
                label, start, _ = self._events.pop()
                self._events.append((label, start, end))
            if name:
                self._events.append((name, end, None))
        self._current, self._mark = name, now
        return previous

    def count(self, samples: int | None = None, tokens: int | None = None) -> None:
        """Add this step's samples (and tokens) to the throughput."""
        for label, v in (("samples", samples), ("tokens", tokens)):
            if v is not None and not is_int_at_least(v, 0):
                raise ValueError(f"{label} must be an int >= 0, got {v!r}")
        self.samples += samples or 0
        self.tokens += tokens or 0

    def iterate(self, iterable: Iterable[T]) -> Iterator[T]:
        """Yield the batches, timing each ``next()`` as the data wait and counting samples.

        Samples are the first tensor's first dimension. Only the time inside the loader's
        ``next()`` is a data wait; the rest of the time between two steps is "outside the
        step".
        """
        if self.loader is None:
            self.loader = iterable
        return self._iterate(iter(iterable))

    def _iterate(self, it: Iterator[T]) -> Iterator[T]:
        self._iterated = True
        while True:
            previous = self._switch("data")
            try:
                batch = next(it)
            except StopIteration:
                return
            finally:
                self._switch(previous)
            self.samples += _batch_size(batch)
            yield batch

    def watch(self, model: Any) -> bool:
        """Time a DDP model's gradient all-reduces (they overlap backward); False if it cannot.

        Registers DDP's default all-reduce as a comm hook with a clock around it, so it must
        be called before the first forward and only on a model without a comm hook.
        """
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
        from torch.nn.parallel import DistributedDataParallel

        from ._grad_sync import unwrap

        ddp = unwrap(model)
        if not isinstance(ddp, DistributedDataParallel):
            return False

        def timed(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks annotations
            start = time.perf_counter()

            def done(fut: Any) -> Any:
                self.seconds["communication"] += time.perf_counter() - start
                return fut.value()

            return allreduce_hook(state, bucket).then(done)

        try:
            ddp.register_comm_hook(None, timed)
        except RuntimeError:
            return False  # a hook is already there, or training has started
        return True

    # -- host syncs ---------------------------------------------------------------------------

    def _start_sync_count(self) -> None:
        counter: count_host_syncs | _CudaSyncCounter
        if self._cuda:
            # The driver-level view: every synchronizing CUDA call warns.
            counter = _CudaSyncCounter()
        else:
            counter = count_host_syncs(ignore=self._host_resident())
        counter.__enter__()
        self._counter = counter

    def _host_resident(self) -> frozenset[int]:
        # Optimizers keep their step counters on the host even in a GPU run (unless
        # capturable) and read them with .item(): no device sync there, so not counted.
        opt = self.optimizer
        if opt is None:
            return frozenset()
        return frozenset(
            id(v)
            for state in opt.state.values()
            for k, v in state.items()
            if k == "step" and isinstance(v, torch.Tensor) and v.device.type == "cpu"
        )

    def _stop_sync_count(self) -> None:
        counter, self._counter = self._counter, None
        if counter is not None:
            counter.__exit__(None, None, None)
            self.syncs.update(counter.user_events)
            self.expected_syncs.update(counter.expected)
            self.sync_steps += 1

    # -- the report ---------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """The numbers behind the report."""
        if self._cuda and self._events:
            torch.cuda.synchronize()  # the one sync, at report time only
            for label, start, end in self._events:
                if end is not None:
                    self.seconds[label] += start.elapsed_time(end) / 1e3
            self._events = [e for e in self._events if e[2] is None]
        # Communication overlaps backward: it is reported beside the phases, not within them.
        total = sum(v for k, v in self.seconds.items() if k != "communication")
        wall = (
            self._last_exit - self._first
            if self._last_exit is not None and self._first is not None
            else 0.0
        )
        return {
            "steps": self.steps,
            "seconds": dict(self.seconds),
            "share": {k: (v / total if total else 0.0) for k, v in self.seconds.items()},
            "samples_per_s": self.samples / wall if wall and self.samples else None,
            "tokens_per_s": self.tokens / wall if wall and self.tokens else None,
            "syncs_per_step": (
                sum(self.syncs.values()) / self.sync_steps if self.sync_steps else None
            ),
            "sync_ops": dict(self.syncs),
            "expected_syncs_per_step": {
                reason: n / self.sync_steps for reason, n in self.expected_syncs.items()
            },
        }

    def report(self) -> str:
        """A plain-words report: throughput, phase shares, syncs, and the tips that apply."""
        s = self.stats()
        if not s["steps"]:
            return "loopkit doctor: no step measured yet"
        per_step = sum(v for k, v in s["seconds"].items() if k != "communication") / s["steps"]
        head = f"loopkit doctor: {s['steps']} steps, {1e3 * per_step:.2f} ms per step"
        if s["samples_per_s"]:
            head += f", {s['samples_per_s']:,.0f} samples/s"
        if s["tokens_per_s"]:
            head += f", {s['tokens_per_s']:,.0f} tokens/s"
        lines = [head]
        for name in PHASES:
            if s["seconds"][name] or name == "compute" or (name == "data" and self._iterated):
                lines.append(
                    f"  {_LABELS[name]:<22} {100 * s['share'][name]:5.1f}%  "
                    f"{1e3 * s['seconds'][name] / s['steps']:8.3f} ms/step"
                )
        if s["syncs_per_step"] is not None:
            ops = ", ".join(f"{op} x{n}" for op, n in Counter(s["sync_ops"]).most_common(4))
            lines.append(
                f"  host-device syncs      {s['syncs_per_step']:.1f} per step "
                f"(sampled on {self.sync_steps} steps){': ' + ops if ops else ''}"
            )
        if s["expected_syncs_per_step"]:
            needed = "; ".join(
                f"{n:.1f} per step needed by {reason}"
                for reason, n in sorted(s["expected_syncs_per_step"].items(), key=lambda x: -x[1])
            )
            lines.append(f"  loopkit's own syncs    {needed}")
        tips = self.tips(s)
        lines.append("Tips:" if tips else "Nothing stands out: no tip applies.")
        lines += [f"  - {t}" for t in tips]
        return "\n".join(lines)

    def tips(self, s: dict[str, Any] | None = None) -> list[str]:
        """The guides' advice that the measurements call for, most costly first."""
        s = s or self.stats()
        share = s["share"]
        found: list[tuple[float, str]] = []
        if self.precision == "fp16" and (dev := self.device) is not None and dev.type == "cpu":
            # A configuration that costs more than anything measured here: first.
            found.append((2.0, _FP16_CPU_TIP))
        if share["data"] > 0.2:
            found.append((share["data"], self._data_tip(share["data"])))
        if share["between"] > 0.2:
            text = f"{100 * share['between']:.0f}% of each step {_BETWEEN_TIP}"
            if not self._iterated:
                text += _BETWEEN_UNTIMED_DATA
            found.append((share["between"], text))
        for phase, threshold, text in _PHASE_TIPS:
            if share[phase] > threshold:
                found.append((share[phase], f"{100 * share[phase]:.0f}% of each step {text}"))
        syncs = s["syncs_per_step"]
        if syncs is not None and syncs >= 1:
            ops = ", ".join(op for op, _ in Counter(s["sync_ops"]).most_common(3))
            found.append(
                (
                    min(1.0, 0.1 * syncs),
                    f"{syncs:.1f} host-device syncs per step ({ops}): {_SYNC_TIP}",
                )
            )
        if share["compute"] > 0.6 and self.precision == "fp32":
            found.append((0.05, _BF16_TIP))
        return [tip for _, tip in sorted(found, key=lambda x: -x[0])]

    def _data_tip(self, share: float) -> str:
        workers = getattr(self.loader, "num_workers", None)
        inner = getattr(self.loader, "loader", None)  # a loopkit EpochLoader
        if workers is None and inner is not None:
            workers = getattr(inner, "num_workers", None)
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        now = f"num_workers is {workers}; " if workers is not None else ""
        return (
            f"{100 * share:.0f}% of each step waits for data: {now}try num_workers > 0 (this "
            f"machine has {cores} cores), pin_memory with CUDA, persistent_workers=True "
            "(loopkit.distributed.loader sets all three); or preload the data set to RAM"
        )

    def _report_at_exit(self) -> None:
        if self.steps:
            self.sink(self.report())


def _cuda_event() -> Any:
    ev = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    ev.record()
    return ev


def _batch_size(batch: Any) -> int:
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    if isinstance(batch, dict):
        return next((_batch_size(v) for v in batch.values()), 0)
    if isinstance(batch, (list, tuple)) and batch:
        return _batch_size(batch[0])
    return 0
