"""Generated training loops for the misuse guards: legitimate ones, and the same with one misuse.

A drawn ``Loop`` is a world (a tiny model with its normalization, the data and its layout,
a scheduler, an ema, a Checkpointer variant, a probe head trained by hand, maybe
``torch.compile``) and a few ``Phase``s run one after the other on it, each with its own
loop shape and step settings. ``Run`` plays a loop, the way a user would write it, and
injects at most one ``Misuse`` where the twin asks for it. It keeps its own ledger of where
the step-owned scheduler and ema must stand (one step per real update, from where they were
last restored), which the legitimate-loop test compares with the objects.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import re
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from hypothesis import strategies as st
from inv_budget import DEEP
from torch import nn
from torch.utils.data import Dataset, default_collate

import loopkit
from loopkit import distributed

SHAPES_SINGLE = ("epochs", "iteration", "until_epochs", "plain", "plain_loader")
SHAPES_GROUP = ("gan", "pair")
MISUSES = (
    "optimizer_step", "scheduler_step", "zero_grad", "hand_clip", "foreign_backward",
    "ema_update", "bn_micro_batch", "plain_no_flush", "spanning",
)  # fmt: skip

_RAISED, _WARNED = RuntimeError, loopkit.OpenWindowWarning
CAUGHT: dict[str, tuple[type[Exception], str]] = {
    "optimizer_step": (_RAISED, r"optimizer\.step\(\) was called by your code.*Remove that line"),
    "scheduler_step": (_RAISED, r"also stepped by your code.*Remove the scheduler\.step\(\) line"),
    "zero_grad": (_RAISED, r"were dropped by code outside.*Remove the zero_grad"),
    "hand_clip": (_RAISED, r"were changed by code outside.*hand-written clip.*clip_grad_norm="),
    "foreign_backward": (
        _RAISED,
        r"were changed by code outside.*loopkit\.steps\(d_step, g_step\) with frozen=",
    ),
    "ema_update": (_RAISED, r"already counted.*remove the ema\.update\(\) call"),
    "bn_micro_batch": (_RAISED, r"BatchNorm.*with GroupNorm or LayerNorm.*eval mode"),
    "plain_no_flush": (_WARNED, r"never became an update.*call step\.flush\(\) after the loop"),
    "spanning": (_WARNED, r"spans two passes.*Loop over step\.iterate\(loader\)"),
}
"""What catches each misuse, and the message naming its fix (searched with re.DOTALL)."""


@dataclass(frozen=True)
class Phase:
    """One stretch of training with one loop shape (and one step, or one group)."""

    shape: str  # SHAPES_SINGLE or SHAPES_GROUP
    accumulate: int
    micro_batch: int | None
    precision: str
    clip: float | None
    new_step: bool  # build a new loopkit.step (same model, optimizer, ema, scheduler)
    step_back: bool  # use again the step of the phase before the last one (if not new_step)
    length: int  # passes (epochs, plain, plain_loader, groups) or updates (iteration)
    evaluate: (
        str | None
    )  # None, "cadence"/"per_epoch" (after micro-steps), "in_step" (before backward)
    swapped: bool  # evaluations under ema.swapped()
    raise_at: int | None  # the micro-step whose body raises (a bad batch), caught by the loop
    raise_after: bool  # ... after its backward (else before its forward)
    drop_raised: bool  # ... and, on a window's last micro-step, the handler drops its gradients
    leave_at: int | None  # epochs: leave the first pass after this micro-step (break)
    zero_grad_top: bool  # optimizer.zero_grad() at the top of the micro-steps that open windows
    nan_at: int | None  # the micro-step whose loss is NaN (its update skipped: skip_nonfinite)
    hand_after: bool  # a hand-written phase on the model after this one (its own optimizer)
    ckpt_ops: tuple[str, ...]  # "save_before", "resume_before", "maybe_save", "rollback_mid"
    restore_to: int | None  # scheduler.load_state_dict(...) by hand before training: the
    # state of a scheduler stepped that many times
    flush: bool  # plain loops: step.flush() after the loop (plain_loader: after each pass)


@dataclass(frozen=True)
class Loop:
    """The world the phases share, and the phases."""

    seed: int
    norm: str  # "none", "layer", "group", "bn_eval", "bn_train"
    layout: str  # "tuple" or "dict" (with a per-sample list of names)
    source: str  # "loader" (a distributed.loader) or "list"
    samples: int
    batch: int
    optimizer: str  # "adamw" or "sgd"
    scheduler: str | None  # None, "steplr", "lambda"
    sched_given: bool  # the scheduler is given to the steps (else the loop steps it by hand)
    ema: bool  # an ema of the model given to every step of it
    ema_every: int  # it averages every that many updates
    skip_nonfinite: bool  # the model's steps skip non-finite updates
    ckpt: str | None  # None, "step*" (one per step: the scheduler through it, under
    # scheduler= or extra=), "scheduler" or "extra" (one for the run, no step=)
    ckpt_loader: bool  # the step's Checkpointer gets loader=
    ckpt_optimizer: bool  # the step's Checkpointer gets optimizer= (else step= saves it)
    compiled: bool  # the steps train torch.compile(model)
    probe: str  # "none", "between" (after each phase), "each" (after every micro-step) or
    # "trunk" (after each phase, its loss back-propagated through the model's first layers)
    phases: tuple[Phase, ...]
    final_save: bool

    def batches_per_pass(self) -> int:
        return math.ceil(self.samples / self.batch)


@dataclass(frozen=True)
class Misuse:
    """One misuse drawn into a loop: its kind and the phase it goes into."""

    kind: str
    phase: int
    late: bool = False  # after the loop's other work on that micro-step (a probe's step)


# -- strategies ----------------------------------------------------------------------------


def legalize(loop: Loop) -> Loop:
    """The loop with every phase made legitimate for its world (and each other)."""
    phases: list[Phase] = []
    for i, ph in enumerate(loop.phases):
        single = ph.shape in SHAPES_SINGLE
        shape = ph.shape
        if shape == "plain_loader" and loop.source != "loader":
            shape = "plain"
        if shape == "until_epochs" and loop.source != "loader":
            shape = "epochs"
        after_group = i > 0 and loop.phases[i - 1].shape in SHAPES_GROUP
        new = i == 0 or not single or after_group or ph.new_step
        plain = shape in ("plain", "plain_loader")
        micro = None if plain or loop.norm == "bn_train" else ph.micro_batch
        ops = tuple(
            op for op in ph.ckpt_ops
            if single and loop.ckpt is not None
            and (op != "maybe_save" or loop.ckpt.startswith("step"))
            and (op != "rollback_mid" or not loop.ckpt_loader)
        )  # fmt: skip
        phases.append(
            dataclasses.replace(
                ph,
                shape=shape,
                new_step=new,
                step_back=ph.step_back and not new and i >= 2,
                micro_batch=micro,
                swapped=ph.swapped and loop.ema,
                evaluate=_evaluation(ph, loop, shape, single),
                raise_at=ph.raise_at if single else None,
                drop_raised=ph.drop_raised and single and ph.raise_after,
                leave_at=ph.leave_at if shape == "epochs" else None,
                zero_grad_top=ph.zero_grad_top and single,
                # A skipped window is one update fewer: another pass (or until) makes one.
                nan_at=ph.nan_at
                if loop.skip_nonfinite and (shape == "iteration" or (single and ph.length > 1))
                else None,
                ckpt_ops=ops,
                restore_to=ph.restore_to if loop.scheduler is not None else None,
                flush=True,
            )
        )
    # BatchNorm in training mode cannot normalize a batch of one sample (torch raises).
    ragged_one = loop.norm == "bn_train" and loop.samples % loop.batch == 1
    return dataclasses.replace(
        loop,
        samples=loop.samples + 1 if ragged_one else loop.samples,
        sched_given=loop.sched_given and loop.scheduler is not None,
        ckpt_loader=loop.ckpt_loader
        and (loop.ckpt or "").startswith("step")
        and loop.source == "loader",
        phases=tuple(phases),
    )


def _evaluation(ph: Phase, loop: Loop, shape: str, single: bool) -> str | None:
    """The phase's evaluation, fitted: ``in_step`` in a single step only; ``per_epoch`` (a
    cadence at pass positions) in a single step's passes over the loader, not left early."""
    if ph.evaluate == "in_step" and not single:
        return "cadence"
    if ph.evaluate == "per_epoch":
        passes = shape == "until_epochs" or (shape == "epochs" and ph.leave_at is None)
        return "per_epoch" if single and passes and loop.source == "loader" else "cadence"
    return ph.evaluate


@st.composite
def phases(draw: st.DrawFn) -> Phase:
    """One phase, before ``legalize`` fits it to its world."""
    # Single-step shapes three times as often as groups (which have fewer features).
    shape = draw(st.sampled_from(SHAPES_SINGLE * 3 + SHAPES_GROUP * 2))
    return Phase(
        shape=shape,
        accumulate=draw(st.integers(1, 3)),
        micro_batch=draw(st.sampled_from([None, None, 1, 2])),
        precision=draw(st.sampled_from(["fp32", "fp32", "bf16"])),
        clip=draw(st.sampled_from([None, 0.5])),
        new_step=draw(st.booleans()),
        step_back=draw(st.booleans()),
        length=draw(st.integers(1, 2) if shape != "iteration" else st.integers(2, 5)),
        evaluate=draw(st.sampled_from([None, "cadence", "in_step", "per_epoch"])),
        swapped=draw(st.booleans()),
        raise_at=draw(st.one_of(st.none(), st.integers(0, 4))),
        raise_after=draw(st.booleans()),
        drop_raised=draw(st.booleans()),
        leave_at=draw(st.one_of(st.none(), st.integers(0, 3))),
        zero_grad_top=draw(st.booleans()),
        nan_at=draw(st.one_of(st.none(), st.integers(0, 4))),
        hand_after=draw(st.booleans()),
        ckpt_ops=tuple(
            draw(
                st.lists(
                    st.sampled_from(["save_before", "resume_before", "maybe_save", "rollback_mid"]),
                    unique=True,
                    max_size=3,
                )
            )
        ),
        restore_to=draw(st.one_of(st.none(), st.integers(0, 4))),
        flush=True,
    )


@st.composite
def loops(draw: st.DrawFn) -> Loop:
    """A legitimate loop: a world and one to three phases (see the module docstring)."""
    loop = Loop(
        seed=draw(st.integers(0, 2**16)),
        norm=draw(st.sampled_from(["none", "layer", "group", "bn_eval", "bn_train"])),
        layout=draw(st.sampled_from(["tuple", "dict"])),
        source=draw(st.sampled_from(["loader", "list"])),
        samples=draw(st.integers(6, 13)),
        batch=draw(st.integers(2, 4)),
        optimizer=draw(st.sampled_from(["adamw", "sgd"])),
        scheduler=draw(st.sampled_from([None, "steplr", "lambda"])),
        sched_given=draw(st.booleans()),
        ema=draw(st.booleans()),
        ema_every=draw(st.integers(1, 2)),
        skip_nonfinite=draw(st.booleans()),
        ckpt=draw(
            st.sampled_from([None, "step", "step_scheduler", "step_extra", "scheduler", "extra"])
        ),
        ckpt_loader=draw(st.booleans()),
        ckpt_optimizer=draw(st.booleans()),
        # Compiling takes seconds on a CPU: CI compiles in its one explicit example only.
        compiled=draw(st.integers(0, 19).map(lambda i: i == 19)) if DEEP else False,
        probe=draw(st.sampled_from(["none", "between", "each", "trunk"])),
        phases=tuple(draw(st.lists(phases(), min_size=1, max_size=3))),
        final_save=draw(st.booleans()),
    )
    return legalize(loop)


@st.composite
def with_misuse(draw: st.DrawFn, kind: str) -> tuple[Loop, Misuse]:
    """A legitimate loop rewritten to host ``kind``, and where the misuse goes."""
    loop = draw(loops())
    n = len(loop.phases)
    target = n - 1 if kind == "plain_no_flush" else draw(st.integers(0, n - 1))
    ph = loop.phases[target]
    world: dict[str, Any] = {}
    change: dict[str, Any] = {"raise_at": None, "leave_at": None, "nan_at": None, "ckpt_ops": ()}
    if ph.shape not in SHAPES_SINGLE:
        change["shape"] = "epochs"
    if kind in ("scheduler_step", "zero_grad", "hand_clip", "foreign_backward"):
        change["accumulate"] = max(ph.accumulate, 2)  # an open window to misuse
    if kind == "scheduler_step":
        world.update(scheduler=loop.scheduler or "steplr", sched_given=True)
    if kind == "ema_update":
        world["ema"] = True
        change["accumulate"] = 1  # an update inside the loop (a plain loop's flush is after it)
    if kind == "bn_micro_batch":
        world["norm"] = "bn_train"
        change.update(shape=draw(st.sampled_from(["epochs", "iteration"])), micro_batch=1)
    if kind in ("plain_no_flush", "spanning"):
        if kind == "spanning":
            world["source"] = "loader"
        passes = draw(st.integers(1, 2)) if kind == "plain_no_flush" else 2
        per = loop.batches_per_pass() if kind == "spanning" else loop.batches_per_pass() * passes
        every = draw(st.sampled_from([a for a in (2, 3, 4, 5) if per % a]))
        change.update(
            shape="plain" if kind == "plain_no_flush" else "plain_loader",
            accumulate=every, length=passes, micro_batch=None,
        )  # fmt: skip
    if kind == "plain_no_flush":
        world["final_save"] = False
        change["hand_after"] = False
    phases_ = list(loop.phases)
    phases_[target] = dataclasses.replace(ph, **change)
    loop = legalize(dataclasses.replace(loop, phases=tuple(phases_), **world))
    # What legalize would make legitimate again on the target: the misuse itself.
    forced: dict[str, Any] = {"new_step": True, "step_back": False}
    if kind == "bn_micro_batch":
        forced["micro_batch"] = 1
    if kind in ("plain_no_flush", "spanning"):
        forced["flush"] = False
    phases_ = list(loop.phases)
    phases_[target] = dataclasses.replace(loop.phases[target], **forced)
    late = kind == "ema_update" and draw(st.booleans())
    if late:
        loop = dataclasses.replace(loop, probe="each")
    return dataclasses.replace(loop, phases=tuple(phases_)), Misuse(kind, target, late)


# -- playing a loop ------------------------------------------------------------------------


class _BadBatch(Exception):
    """What the loop's own check raises for a batch it skips."""


class _Items(Dataset[Any]):
    """The samples, as a tuple (x, y) or a dict with a per-sample name."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, layout: str) -> None:
        self.x, self.y, self.layout = x, y, layout

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> Any:
        if self.layout == "tuple":
            return self.x[i], self.y[i]
        return {"x": self.x[i], "y": self.y[i], "names": f"sample-{i}"}


def xy(batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The inputs and targets of a batch of either layout."""
    if isinstance(batch, dict):
        return batch["x"], batch["y"]
    return batch[0], batch[1]


def _per_sample(model: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
    x, y = xy(batch)
    return {"mse": (model(x).float() - y).pow(2).mean(dim=1)}


def _norm(kind: str) -> nn.Module:
    if kind == "layer":
        return nn.LayerNorm(8)
    if kind == "group":
        return nn.GroupNorm(2, 8)
    if kind.startswith("bn"):
        return nn.BatchNorm1d(8)
    return nn.Identity()


def _make_scheduler(kind: str, opt: torch.optim.Optimizer) -> Any:
    if kind == "steplr":
        return torch.optim.lr_scheduler.StepLR(opt, 2, gamma=0.5)
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1 / (1 + k))


def snapshot(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.detach().clone() for t in tensors]


class Run:
    """Plays a ``Loop`` (with ``misuse`` injected, if given) and keeps the ledger."""

    def __init__(self, loop: Loop, directory: Path, misuse: Misuse | None = None) -> None:
        self.loop, self.dir, self.misuse = loop, directory, misuse
        self.injected = False
        self.before_misuse: list[torch.Tensor] | None = None  # what a refusal must leave
        torch.manual_seed(loop.seed)
        model = nn.Sequential(nn.Linear(4, 8), _norm(loop.norm), nn.Tanh(), nn.Linear(8, 2))
        if loop.norm == "bn_eval":
            model[1].eval()  # frozen statistics: legitimate with micro_batch=
        self.model = model
        self.net: nn.Module = torch.compile(model) if loop.compiled else model
        self.opt: torch.optim.Optimizer = (
            torch.optim.AdamW(model.parameters(), lr=1e-2)
            if loop.optimizer == "adamw"
            else torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        )
        self.sched = None if loop.scheduler is None else _make_scheduler(loop.scheduler, self.opt)
        self.ema = loopkit.ema(model, 0.9, every=loop.ema_every) if loop.ema else None
        gen = torch.Generator().manual_seed(loop.seed)
        x, y = (
            torch.randn(loop.samples, 4, generator=gen),
            torch.randn(loop.samples, 2, generator=gen),
        )
        data = _Items(x, y, loop.layout)
        self.loader = distributed.loader(data, batch_size=loop.batch, seed=loop.seed,
                                         num_workers=0)  # fmt: skip
        self.batches = [
            default_collate([data[i] for i in range(a, min(a + loop.batch, loop.samples))])
            for a in range(0, loop.samples, loop.batch)
        ]
        self.val = self.batches[:2]
        self.noise = torch.Generator().manual_seed(loop.seed + 1)
        # Other models and optimizers the user trains by hand or in groups.
        self.probe = nn.Linear(8, 2)
        self.probe_opt = torch.optim.SGD(self.probe.parameters(), lr=0.05)
        self.probe_sched = torch.optim.lr_scheduler.StepLR(self.probe_opt, 3, gamma=0.5)
        self.probe_ema = loopkit.ema(self.probe, 0.8)  # given to no step: updated by hand
        self.hand_opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        self.gen = nn.Linear(3, 4)
        self.gen_opt = torch.optim.Adam(self.gen.parameters(), lr=1e-3)
        self.aux = nn.Linear(4, 2)
        self.aux_opt = torch.optim.SGD(self.aux.parameters(), lr=0.05)
        self.steps: list[loopkit.step] = []  # every step of the model built so far
        self.step: loopkit.step | None = None  # the current one
        self.alone: list[loopkit.step] = []  # those built for single-step phases (no group)
        self.ckpts: dict[int, loopkit.Checkpointer] = {}  # id(step) -> its Checkpointer
        self.shared_ckpt = self._shared_checkpointer()
        self.micro = 0  # micro-steps of the current phase
        self.last_raised = False
        self.rollback: Path | None = None
        self.rollback_at = 0
        self.rolled_back = False
        self.hand_ema_updates = 0
        self.user_sched_steps = 0  # steps of a scheduler given to no step, by the loop
        self._rebase()

    # -- the ledger: the scheduler and ema given to the steps move once per real update ---

    def _rebase(self) -> None:
        """Where the scheduler and ema stand now (a start, a restore) and the steps' counts."""
        self.sched_base = None if self.sched is None else self.sched.last_epoch
        self.ema_base = None if self.ema is None else self.ema.seen
        self.hand_base = self.hand_ema_updates
        self.user_base = self.user_sched_steps
        self.counted = {id(s): s.updates for s in self.steps}

    def _since_base(self) -> int:
        return sum(s.updates - self.counted.get(id(s), 0) for s in self.steps)

    def expected(self) -> dict[str, int | None]:
        """Where the ledger says the scheduler and the ema must stand now."""
        since = self._since_base()
        sched = None
        if self.sched_base is not None:
            by_user = self.user_sched_steps - self.user_base
            sched = self.sched_base + (since if self.loop.sched_given else by_user)
        ema = None
        if self.ema_base is not None:
            ema = self.ema_base + since + self.hand_ema_updates - self.hand_base
        return {"scheduler": sched, "ema": ema}

    def actual(self) -> dict[str, int | None]:
        return {
            "scheduler": None if self.sched is None else int(self.sched.last_epoch),
            "ema": None if self.ema is None else self.ema.seen,
        }

    # -- building ----------------------------------------------------------------------------

    def _shared_checkpointer(self) -> loopkit.Checkpointer | None:
        kind = self.loop.ckpt
        if kind not in ("scheduler", "extra"):
            return None
        extra: dict[str, Any] = {} if self.ema is None else {"ema": self.ema}
        sched: Any = None
        if self.sched is not None and kind == "scheduler":
            sched = self.sched
        elif self.sched is not None:
            extra["sched"] = self.sched
        return loopkit.Checkpointer(self.dir / "shared", model=self.model, optimizer=self.opt,
                                    scheduler=sched, extra=extra)  # fmt: skip

    def _new_step(self, ph: Phase, net: nn.Module | None = None, **more: Any) -> loopkit.step:
        step = loopkit.step(
            self.net if net is None else net, self.opt, accumulate=ph.accumulate,
            micro_batch=ph.micro_batch, precision=ph.precision, clip_grad_norm=ph.clip,
            scheduler=self.sched if self.loop.sched_given else None, ema=self.ema,
            skip_nonfinite=self.loop.skip_nonfinite, **more,
        )  # fmt: skip
        self.steps.append(step)
        return step

    def _checkpointer(self, step: loopkit.step) -> loopkit.Checkpointer | None:
        if self.shared_ckpt is not None:
            return self.shared_ckpt
        kind = self.loop.ckpt
        if kind is None or not kind.startswith("step"):
            return None
        if id(step) not in self.ckpts:
            # step= saves the step's own scheduler= and ema=, unless given here as well.
            sched = self.sched if kind == "step_scheduler" else None
            extra: dict[str, Any] = {}
            if kind == "step_extra":
                extra = {"sched": self.sched, "ema": self.ema}
                extra = {k: v for k, v in extra.items() if v is not None}
            self.ckpts[id(step)] = loopkit.Checkpointer(
                self.dir / f"step{len(self.ckpts)}", model=self.model,
                optimizer=self.opt if self.loop.ckpt_optimizer else None,
                scheduler=sched, step=step, extra=extra,
                loader=self.loader if self.loop.ckpt_loader else None,
            )  # fmt: skip
        return self.ckpts[id(step)]

    def _resume(self, ckpt: loopkit.Checkpointer, path: Path | None = None) -> None:
        if ckpt.resume(path) is not None:
            self._rebase()

    # -- one micro-step and what the loop does after it --------------------------------------

    def _loss(self, net: Callable[[torch.Tensor], torch.Tensor], batch: Any) -> torch.Tensor:
        x, y = xy(batch)
        return nn.functional.mse_loss(net(x).float(), y)

    def _evaluate(self, step: loopkit.step | None, ph: Phase) -> None:
        ema = self.ema
        with ema.swapped() if ph.swapped and ema is not None else contextlib.nullcontext():
            result = loopkit.evaluate(self.model, self.val, _per_sample, step=step)
        assert result.samples == sum(len(xy(b)[0]) for b in self.val)

    def _micro_step(self, step: loopkit.step, ph: Phase, batch: Any) -> None:
        k = self.micro
        self.micro += 1
        self.last_raised = ending = False
        if ph.zero_grad_top and step.micro_step == 0:
            self.opt.zero_grad()  # the old loop's line, where a window opens: harmless
        try:
            with step as s:
                if ph.evaluate == "in_step" and k % 3 == 0:
                    self._evaluate(step, ph)
                bad = k == ph.raise_at
                if bad and not ph.raise_after:
                    raise _BadBatch(f"micro-step {k}: a batch the loop's own check skips")
                loss = self._loss(self.net, batch)
                if k == ph.nan_at:
                    loss = loss * float("nan")  # a diverged batch: the window is skipped
                s.backward(loss)
                if bad:
                    ending = s.ends_window
                    raise _BadBatch(f"micro-step {k}: a check after the backward fails")
        except _BadBatch:
            self.last_raised = not ph.raise_after  # (after it, the backward is in the window)
            if ph.drop_raised and ending:
                self.opt.zero_grad()  # as a hand loop skips the bad batch: its window is gone

    def _after(self, step: loopkit.step, ph: Phase, index: int, due: Any, batch: Any) -> None:
        """What the loop does after each micro-step: the misuse (twin only), checkpoints, a
        cadenced evaluation, a hand step of the probe head."""
        self._maybe_inject(step, ph, index, batch)
        ckpt = self._checkpointer(step)
        if ckpt is not None and step.micro_step == 0:
            if "maybe_save" in ph.ckpt_ops:
                ckpt.maybe_save(every=2)
            if "rollback_mid" in ph.ckpt_ops and step.updated and not self.rolled_back:
                if self.rollback is None:
                    self.rollback, self.rollback_at = ckpt.save(), step.updates
                elif step.updates >= self.rollback_at + 2:
                    self.rolled_back = True
                    self._resume(ckpt, self.rollback)  # a rollback, mid-run
        if due is not None and due.due():
            self._evaluate(step, ph)
        if self.loop.probe == "each":
            self._probe_step(batch)
            self._maybe_inject(step, ph, index, batch, late=True)

    def _probe_step(self, batch: Any, trunk: bool = False) -> None:
        """The probe head trained by hand on detached features (``trunk``: through the
        model's first layers, between windows): its own optimizer, zero_grad, clip,
        scheduler and ema."""
        x, y = xy(batch)
        with contextlib.nullcontext() if trunk else torch.no_grad():
            features = self.model[:3](x)
        self.probe_opt.zero_grad()
        nn.functional.mse_loss(self.probe(features), y).backward()
        nn.utils.clip_grad_norm_(self.probe.parameters(), 1.0)
        self.probe_opt.step()
        self.probe_sched.step()
        self.probe_ema.update()

    def _hand_phase(self) -> None:
        """The model trained by hand with another optimizer, between phases; the ema given
        to the steps is updated by hand after each of its steps."""
        for batch in self.batches[:2]:
            self.hand_opt.zero_grad()
            self._loss(self.model, batch).backward()
            nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.hand_opt.step()
            if self.ema is not None:
                self.ema.update()
                self.hand_ema_updates += 1

    # -- the misuse (twin only) --------------------------------------------------------------

    def _maybe_inject(
        self, step: loopkit.step, ph: Phase, index: int, batch: Any, late: bool = False
    ) -> None:
        misuse = self.misuse
        if misuse is None or self.injected or misuse.phase != index or misuse.late != late:
            return
        kind = misuse.kind
        open_window = step.micro_step > 0 and not self.last_raised
        if kind in ("scheduler_step", "zero_grad", "hand_clip", "foreign_backward"):
            if not open_window:
                return
        elif kind == "ema_update":
            if not step.updated:
                return
        elif kind != "optimizer_step":
            return  # the others are the loop's shape itself
        self.injected = True
        self.before_misuse = snapshot(list(self.model.parameters()))
        if kind == "ema_update":
            assert self.ema is not None
            self.before_misuse = snapshot(self.ema.shadow)
            self.ema.update()
        elif kind == "optimizer_step":
            self.opt.step()
        elif kind == "scheduler_step":
            self.sched.step()  # type: ignore[union-attr]
        elif kind == "zero_grad":
            self.opt.zero_grad()
        elif kind == "hand_clip":
            nn.utils.clip_grad_norm_(self.model.parameters(), 1e-4)
        elif kind == "foreign_backward":
            x, y = xy(batch)
            nn.functional.mse_loss(self.probe(self.model[:3](x)), y).backward()

    # -- the phases --------------------------------------------------------------------------

    def play(self) -> None:
        """Every phase, then the end of the run."""
        for index, ph in enumerate(self.loop.phases):
            self.micro = 0
            self.rollback, self.rolled_back = None, False
            if ph.shape in SHAPES_GROUP:
                self._group_phase(ph)
            else:
                self._single_phase(index, ph)
            if ph.hand_after:
                self._hand_phase()
            if self.loop.probe in ("between", "trunk"):
                for batch in self.batches[:2]:
                    self._probe_step(batch, trunk=self.loop.probe == "trunk")
        if self.loop.final_save and self.shared_ckpt is not None:
            self.shared_ckpt.save()
        if self.ema is not None:
            with self.ema.swapped():
                loopkit.evaluate(self.model, self.val, _per_sample)
        with self.probe_ema.swapped(self.probe):
            pass

    def _single_phase(self, index: int, ph: Phase) -> None:
        if ph.new_step:
            step = self._new_step(ph)
            self.alone.append(step)
        elif ph.step_back and len(self.alone) > 1:  # used again after another step trained
            step = self.alone[-2]
        else:
            step = self.step
        assert step is not None
        self.step = step
        if ph.restore_to is not None:
            self._restore_scheduler_by_hand(ph.restore_to)
        ckpt = self._checkpointer(step)
        if ckpt is not None and "save_before" in ph.ckpt_ops:
            ckpt.save()
        if ckpt is not None and "resume_before" in ph.ckpt_ops:
            self._resume(ckpt)
        misuse = self.misuse
        if misuse is not None and misuse.phase == index and misuse.kind == "bn_micro_batch":
            self.injected = True  # the phase itself is the misuse: its first batch is refused
            self.before_misuse = snapshot(list(self.model.parameters()))
        due = (
            loopkit.cadence(step, updates=2) if ph.evaluate == "cadence"
            else loopkit.cadence(step, loader=self.loader,  # twice a pass where it fits
                                 per_epoch=min(2, -(-len(self.loader) // ph.accumulate)))
            if ph.evaluate == "per_epoch" else None
        )  # fmt: skip
        source: Any = self.loader if self.loop.source == "loader" else self.batches

        def each(batch: Any) -> None:
            self._micro_step(step, ph, batch)
            self._after(step, ph, index, due, batch)

        if ph.shape == "epochs":
            for epoch in range(ph.length):
                for batch in step.iterate(source):
                    each(batch)
                    # Left early (a break): at a window's end, or mid-window where another
                    # pass of iterate follows (it closes the window left open first).
                    leave = ph.leave_at is not None and epoch == 0 and self.micro > ph.leave_at
                    if leave and (step.micro_step == 0 or ph.length > 1):
                        break
        elif ph.shape == "until_epochs":
            stop = loopkit.until(step, max_epochs=self.loader.epoch + ph.length, signals=())
            for _ in stop.epochs(self.loader):
                for batch in step.iterate(self.loader):
                    each(batch)
                    if stop.check():
                        break
        elif ph.shape == "iteration":

            def endless() -> Iterator[Any]:
                while True:
                    yield from source

            with loopkit.until(step, max_updates=step.updates + ph.length, signals=()) as stop:
                for batch in step.iterate(endless()):
                    each(batch)
                    if stop.check():
                        break
        elif ph.shape == "plain":
            for _ in range(ph.length):
                for batch in self.batches:
                    each(batch)
            if ph.flush:
                step.flush()
        else:  # plain_loader: a plain loop over the loader, flushed after each pass
            for _ in range(ph.length):
                for batch in self.loader:
                    each(batch)
                if ph.flush:
                    step.flush()
            if misuse is not None and misuse.kind == "spanning" and misuse.phase == index:
                self.injected = True
                step.flush()  # the loop ends properly: only the span is left to report
        if misuse is not None and misuse.kind == "plain_no_flush" and misuse.phase == index:
            self.injected = True
        if self.sched is not None and not self.loop.sched_given and step.updates:
            self.sched.step()  # a per-phase schedule of the user's: no step was given it
            self.user_sched_steps += 1

    def _restore_scheduler_by_hand(self, position: int) -> None:
        """scheduler.load_state_dict of a scheduler stepped elsewhere (a run's saved state)."""
        assert self.sched is not None and self.loop.scheduler is not None
        dummy = nn.Parameter(torch.zeros(1))
        lr = self.opt.defaults["lr"]
        donor_opt = type(self.opt)([dummy], lr=lr)
        donor = _make_scheduler(self.loop.scheduler, donor_opt)
        for _ in range(position):
            donor_opt.step()
            donor.step()
        self.sched.load_state_dict(copy.deepcopy(donor.state_dict()))
        assert self.sched.last_epoch == position
        self._rebase()

    def _group_phase(self, ph: Phase) -> None:
        """A loopkit.steps group: a GAN (the model as critic, frozen= in the generator's
        step) or two independent members (the model and an auxiliary one)."""
        main = self._new_step(ph, net=self.model)
        self.step = main
        if ph.shape == "gan":
            other = loopkit.step(self.gen, self.gen_opt, accumulate=ph.accumulate,
                                 micro_batch=ph.micro_batch, frozen=[self.model])  # fmt: skip
        else:
            other = loopkit.step(self.aux, self.aux_opt, accumulate=ph.accumulate,
                                 micro_batch=ph.micro_batch)  # fmt: skip
        group = loopkit.steps(main, other)
        due = loopkit.cadence(group, updates=2) if ph.evaluate == "cadence" else None
        source: Any = self.loader if self.loop.source == "loader" else self.batches
        bce = nn.functional.binary_cross_entropy_with_logits

        def critic(x: torch.Tensor) -> torch.Tensor:
            return self.model(x).mean(dim=1, keepdim=True)

        for _ in range(ph.length):
            for batch in group.iterate(source):
                if ph.shape == "pair":
                    with main as s:
                        s.backward(self._loss(self.model, batch))
                    with other as s:
                        s.backward(self._loss(self.aux, batch))
                else:
                    split = ph.micro_batch is not None
                    for part in main.split(batch) if split else [batch]:
                        real = xy(part)[0]
                        z = torch.randn(len(real), 3, generator=self.noise)
                        with main as s:
                            s.backward(bce(critic(real), torch.ones(len(real), 1)))
                            fake = self.gen(z).detach()
                            s.backward(bce(critic(fake), torch.zeros(len(real), 1)))
                    for part in other.split(batch) if split else [batch]:
                        z = torch.randn(len(xy(part)[0]), 3, generator=self.noise)
                        with other as s:
                            s.backward(bce(critic(self.gen(z)), torch.ones(len(z), 1)))
                if due is not None and due.due():
                    self._evaluate(None, ph)
                if self.loop.probe == "each":
                    self._probe_step(batch)
        assert other.updates == main.updates > 0


def message_matches(kind: str, text: str) -> bool:
    """Whether ``text`` is what catches ``kind``, naming its fix."""
    return re.search(CAUGHT[kind][1], text, re.DOTALL) is not None


def temporary_directory() -> contextlib.AbstractContextManager[str]:
    return tempfile.TemporaryDirectory(prefix="loopkit-guards-")
