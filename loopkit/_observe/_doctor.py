"""doctor: where each step's time goes, how often it stalls the host, and which tip applies.

Per step it times the wait for the loader's next batch (inside ``next()``, when it iterates
the loader), the time spent outside the step otherwise (the user's code between two
steps), the host-to-device copy, forward+backward, the optimizer step, logging and
communication, and it counts host-device syncs on a few sampled steps (counting every op
would slow the loop it measures), and torch.compile's graph breaks and recompiles. On CUDA
the phases are timed with CUDA events, resolved only when a report is made, so the doctor
adds no sync of its own. The clock is in ``_phase_clock``, the sampled sync counts in
``_sync_sampler``, the words in ``_report``.
"""

from __future__ import annotations

import atexit
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from types import TracebackType
from typing import TypeVar

import torch
from torch import nn

from .._checks import is_int_at_least
from .._devices import model_device, parse_device
from .._parallel._grad_sync import unwrap
from .._precision import resolve_precision
from .._types import DeviceLike, PrecisionLike
from ._compile_events import CompileWatch
from ._phase_clock import PhaseClock
from ._report import PHASES, Context, Stats, as_metrics, report_text, tips_for
from ._sync_sampler import SyncSampler
from ._throughput import FlopCount, check_peak, hardware

T = TypeVar("T")


class _Phase:
    """``with doc.phase(name):`` attributes the time inside to ``name``."""

    __slots__ = ("clock", "name", "previous")

    def __init__(self, clock: PhaseClock, name: str) -> None:
        self.clock, self.name, self.previous = clock, name, ""

    def __enter__(self) -> None:
        self.previous = self.clock.switch(self.name)

    def __exit__(self, *exc: object) -> None:
        self.clock.switch(self.previous)


class doctor:
    """Measure a training loop and say, in plain words, what slows it.

    Alone: ``doc.attach(model, optimizer, precision, device)`` once, ``with doc:`` around
    each step's body, ``with doc.phase("h2d")``/``("optimizer")`` around those parts,
    ``doc.count(samples=..., tokens=...)`` for throughput, and ``for batch in
    doc.iterate(loader)``, which times the loader's ``next()`` (the data wait) and counts
    samples. Time between two steps spent elsewhere is "outside the step" (the user's code
    between steps); without ``doc.iterate`` the data wait is part of it too. In
    ``loopkit.step(..., doctor=doc)`` the step attaches it and times every phase for you.
    ``doc.report()`` returns the report; with ``report_at_exit=True`` it is printed when
    the program ends.

    Host syncs are counted on steps ``sample_syncs_at`` (1 the first) and every
    ``sample_syncs_every``-th step (None: no more); ``report_every=N`` hands the report to
    ``sink`` (``print``) every N steps; ``loader``: the loader whose workers the report
    judges (default: the one ``doc.iterate`` is given).
    ``flops_per_step``: one step's FLOPs (else counted on step 2); ``peak_flops``: the
    device's peak FLOP/s, for the MFU where the built-in table has none (a CPU).
    """

    def __init__(
        self,
        *,
        loader: object = None,
        sample_syncs_at: Iterable[int] = (3, 4, 5),
        sample_syncs_every: int | None = 500,
        report_every: int | None = None,
        sink: Callable[[str], object] = print,
        report_at_exit: bool = False,
        device: DeviceLike | None = None,
        flops_per_step: float | None = None,
        peak_flops: float | None = None,
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
        check_peak(peak_flops)
        self._flops = FlopCount(flops_per_step)
        self.peak_flops = peak_flops
        self.loader = loader
        self.sink = sink
        self.report_every = report_every
        self._sampler = SyncSampler(frozenset(sampled), sample_syncs_every)
        self._clock = PhaseClock()
        self._device: torch.device | None = None
        self.device = device
        self.steps = 0
        """Steps measured so far."""
        self.samples = 0
        self.tokens = 0
        self.precision: str | None = None
        """Set by ``attach``: "fp16" on a CPU gets the bf16 tip."""
        self.optimizer: torch.optim.Optimizer | None = None
        """Set by ``attach``: its host-side step counters are not counted as syncs."""
        self._iterated = False  # whether doc.iterate has timed the loader's next()
        self._compiles = CompileWatch()  # torch.compile's graphs, breaks, recompiles from now
        if report_at_exit:
            atexit.register(self._report_at_exit)

    @property
    def device(self) -> torch.device | None:
        """The training device: as given (``attach`` sets it), else the optimizer's."""
        return self._device if self._device is not None else _params_device(self.optimizer)

    @device.setter
    def device(self, device: DeviceLike | None) -> None:
        if self._clock.inside:
            raise RuntimeError("the doctor's device can change between steps, not inside one")
        self._set_device(None if device is None else parse_device(device))

    def _set_device(self, dev: torch.device | None) -> None:
        self._device = dev
        self._clock.cuda = dev is not None and dev.type == "cuda" and torch.cuda.is_available()

    @property
    def seconds(self) -> dict[str, float]:
        """Wall seconds per phase over all steps (CUDA phases once resolved by report())."""
        return self._clock.seconds

    @property
    def syncs(self) -> Counter[str]:
        """The user's host-device syncs on the sampled steps, by operation."""
        return self._sampler.user

    @property
    def expected_syncs(self) -> Counter[str]:
        """loopkit's own necessary syncs on the sampled steps, by reason (no tip for them)."""
        return self._sampler.expected

    @property
    def sync_steps(self) -> int:
        """Steps on which host syncs were counted."""
        return self._sampler.steps

    def attach(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        precision: PrecisionLike | None = None,
        device: DeviceLike | None = None,
    ) -> None:
        """Tell the doctor about the loop it measures; ``loopkit.step(doctor=...)`` calls it.

        ``precision`` picks the precision tips (None: give none); ``device`` (by default
        the model's) makes a CUDA run time its phases with CUDA events; the optimizer's
        host-side step counters are not counted as syncs; a DDP model's all-reduces are
        timed (see ``watch``). Call it between steps, before the first forward.
        """
        if self._clock.inside:
            raise RuntimeError("attach the doctor between steps, not inside one")
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
            )
        # Everything is checked before anything changes: a bad argument leaves it as it was.
        resolved = None if precision is None else resolve_precision(precision)
        dev = model_device(unwrap(model)) if device is None else parse_device(device)
        self.precision, self.optimizer = resolved, optimizer
        self._set_device(dev if dev is not None else _params_device(optimizer))
        self.watch(model)

    # -- steps and phases ---------------------------------------------------------------------

    def __enter__(self) -> doctor:
        if self._clock.inside:
            raise RuntimeError("doctor is already inside a step: enter it once per step")
        self._clock.begin_step()
        self._sampler.start(self.steps + 1, self._clock.cuda, self.optimizer)
        self._flops.start(self.steps + 1)  # one step's FLOPs, counted once
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._clock.switch("")
        self._flops.stop(exc_type is None, self.samples)
        self._sampler.stop(keep_counting=self._iterated and exc_type is None)
        self._clock.end_step()
        if exc_type is None:
            self.steps += 1
            if self.report_every and self.steps % self.report_every == 0:
                self.sink(self.report())

    def phase(self, name: str) -> _Phase:
        """Attribute the time inside ``with doc.phase(name):`` to one of PHASES."""
        if name not in PHASES:
            raise ValueError(f"unknown phase {name!r}: use one of {', '.join(PHASES)}")
        return _Phase(self._clock, name)

    def count(self, samples: int | None = None, tokens: int | None = None) -> None:
        """Add this step's samples (and tokens) to the throughput."""
        for label, v in (("samples", samples), ("tokens", tokens)):
            if v is not None and not is_int_at_least(v, 0):
                raise ValueError(f"{label} must be an int >= 0, got {v!r}")
        self.samples += samples or 0
        self.tokens += tokens or 0

    def step_samples(self, samples: int) -> None:
        """The next step's samples on this rank (``loopkit.step`` says each chunk's): FLOPs
        scale by them; else by those ``iterate``/``count`` counted since the last step."""
        if not is_int_at_least(samples, 0):
            raise ValueError(f"samples must be an int >= 0, got {samples!r}")
        self._flops.told = samples

    def iterate(self, iterable: Iterable[T]) -> Iterator[T]:
        """Yield the batches, timing each ``next()`` as the data wait and counting samples.

        Samples are the first tensor's first dimension. Only the time inside the loader's
        ``next()`` is a data wait; the rest of the time between two steps is "outside the
        step".
        """
        if self.loader is None:
            self.loader = iterable
        self._iterated = True
        return _timed_batches(self, iter(iterable))

    def watch(self, model: nn.Module) -> bool:
        """Time a DDP model's gradient all-reduces (they overlap backward); False if it cannot.

        Registers DDP's default all-reduce as a comm hook with a clock around it, so it must
        be called before the first forward and only on a model without a comm hook.
        """
        return _time_all_reduces(model, self._clock.seconds)

    # -- the report ---------------------------------------------------------------------------

    def stats(self) -> Stats:
        """The numbers behind the report."""
        self._sampler.stop_between()
        seconds = self._clock.resolve()
        # Communication overlaps backward: it is reported beside the phases, not within them.
        total = sum(v for k, v in seconds.items() if k != "communication")
        wall = self._clock.wall
        n = self.sync_steps
        compute = hardware(self._flops, wall, self.peak_flops, self.device, self.precision)
        return {
            "steps": self.steps,
            "seconds": dict(seconds),
            "share": {k: (v / total if total else 0.0) for k, v in seconds.items()},
            "samples_per_s": self.samples / wall if wall and self.samples else None,
            "tokens_per_s": self.tokens / wall if wall and self.tokens else None,
            "syncs_per_step": sum(self.syncs.values()) / n if n else None,
            "sync_ops": dict(self.syncs),
            "syncs_between_per_step": sum(self._sampler.between.values()) / n if n else None,
            "sync_lines": {f"{w} ({at})": c / n for (w, at), c in self._sampler.lines.items()},
            "expected_syncs_per_step": {r: c / n for r, c in self.expected_syncs.items()},
            "compile": self._compiles.stats(),
            **compute,  # type: ignore[typeddict-item]
        }

    def metrics(self) -> dict[str, float]:
        """Throughput as numbers for a log's sinks: samples/s, tokens/s, FLOP/s, MFU (known)."""
        return as_metrics(self.stats())

    def report(self) -> str:
        """A plain-words report: throughput, phase shares, syncs, and the tips that apply."""
        return report_text(self.stats(), _context(self))

    def tips(self, s: Stats | None = None) -> list[str]:
        """The guides' advice that the measurements call for, most costly first."""
        return tips_for(s or self.stats(), _context(self))

    def _report_at_exit(self) -> None:
        if self.steps:
            self.sink(self.report())


def _context(doc: doctor) -> Context:
    """What the tips need to know besides the measurements: precision, device, loader."""
    workers = getattr(doc.loader, "num_workers", None)
    inner = getattr(doc.loader, "loader", None)  # a loopkit EpochLoader
    if workers is None and inner is not None:
        workers = getattr(inner, "num_workers", None)
    dev = doc.device
    return {
        "precision": doc.precision,
        "device_type": None if dev is None else dev.type,
        "iterated": doc._iterated,
        "num_workers": workers,
        "sync_steps": doc.sync_steps,
    }


def _timed_batches(doc: doctor, it: Iterator[T]) -> Iterator[T]:
    """doc.iterate's generator: each next() timed as the data wait, samples counted."""
    sampler, clock = doc._sampler, doc._clock
    try:
        while True:
            sampler.stop_between()  # the code after the last step ends here
            previous = clock.switch("data")
            try:
                batch = next(it)
            except StopIteration:
                return
            finally:
                clock.switch(previous)
            doc.samples += _batch_size(batch)
            yield batch
    finally:
        sampler.stop_between()


def _time_all_reduces(model: nn.Module, seconds: dict[str, float]) -> bool:
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel

    ddp = unwrap(model)
    if not isinstance(ddp, DistributedDataParallel):
        return False

    def timed(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks annotations
        start = time.perf_counter()

        def done(fut: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
            seconds["communication"] += time.perf_counter() - start
            return fut.value()

        return allreduce_hook(state, bucket).then(done)

    try:
        ddp.register_comm_hook(None, timed)
    except RuntimeError:
        return False  # a hook is already there, or training has started
    return True


def _params_device(opt: torch.optim.Optimizer | None) -> torch.device | None:
    for group in opt.param_groups if opt is not None else ():
        for p in group["params"]:
            if isinstance(p, torch.Tensor):
                return p.device
    return None


def _batch_size(batch: object) -> int:
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    if isinstance(batch, dict):
        return next((_batch_size(v) for v in batch.values()), 0)
    if isinstance(batch, (list, tuple)) and batch:
        return _batch_size(batch[0])
    return 0
