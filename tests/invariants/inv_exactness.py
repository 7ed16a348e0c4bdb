"""Update exactness: loopkit's updates equal a float64 reference computed by hand.

A scenario (a JSON-able dict drawn by ``SCENARIOS``) says how a loop trains: one
``loopkit.step``, a bare ``loopkit.accumulate`` (with its own ``autocast_step``) or a
``loopkit.steps`` group of two members (two independent models, or a GAN: a critic and a
generator trained through the critic with ``frozen=[critic]``); ``accumulate=k``; sample,
tensor or token ``weight=``; one or two backward passes per micro-step (two losses from one
forward with ``retain_graph``, or two forwards); clipping; a scheduler per member; members
entered, skipped or entered without backward per batch; ``iterate()`` over one or two
epochs (optionally left by ``break``) or a manual loop closed by ``flush()``; fp32, bf16 or
fp16 (GradScaler). Under DDP (2 gloo ranks): ``find_unused_parameters`` on/off, branches
chosen per batch or per rank, and no comm hook, a Python hook or a built-in C++ hook.

The reference replays the documented semantics in float64 with plain autograd, one member
at a time, in the loop's order: each micro-step contributes ``w * L`` (``w`` its weight, 1
without weights; ``L`` the sum of its losses, at the parameters current when it ran), every
rank's micro-steps included; at a window's end the member's gradient is the sum over the
window divided by the sum of the ``w`` of its micro-steps with a backward (for equal
unweighted micro-batches: the gradient of the concatenated batch's mean loss), clipped by
its total norm, then one optimizer step and one scheduler step. A window ends on every
``k``-th batch of a pass and on its last batch (``iterate``), or every ``k`` micro-steps and
at ``flush()``; a member entered on a window's last batch updates as it leaves its
micro-step, one not entered is closed after the batch. A window without any backward makes
no update; a parameter no micro-step reached keeps ``grad=None`` (no weight decay).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from hypothesis import strategies as st
from torch import nn

import loopkit

Spec = dict[str, Any]

# Relative tolerance on the parameters' displacement (|w - w_ref| <= rtol * max|w_ref - w_0|
# + ATOL), by the precision of the forward/backward, against the float64 reference. Measured
# over 1945 single-process examples (error / displacement): fp32 median 5e-7, p99 2e-5 (where
# ATOL dominates: small displacements), worst margin to the bound 10x; fp16 (11 mantissa bits,
# loss scaled) median 4e-4, max 1.8e-3 -> 1e-2; bf16 (8 mantissa bits, relative 4e-3 per
# rounded product) median 3.6e-3, max 2.4e-2 -> 6e-2. fp16 compression of the all-reduce
# (fp16_compress_hook) rounds each gradient to fp16: at least fp16's tolerance. A ragged
# window normalized by k/every, a rank's gradient counted twice or not at all, or a loss
# scale not undone moves the update by 25% or more, far above these; a weighting mistake
# (samples vs tokens) moves it by ~10%: caught in fp32 and fp16, not always in bf16.
RTOL = {"fp32": 1e-5, "bf16": 6e-2, "fp16": 1e-2}
ATOL = 1e-6
"""Absolute floor: float32 storage of the weights rounds each update by ~3e-8."""

D_IN, WIDTH, D_OUT = 4, 8, 3


# -- the models -------------------------------------------------------------------------------


class Branchy(nn.Module):
    """Two branches and a head; the branch is picked per call (DDP's unused parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(D_IN, WIDTH), nn.Linear(D_IN, WIDTH)
        self.head = nn.Linear(WIDTH, D_OUT)

    def forward(self, x: torch.Tensor, use_a: bool = True) -> torch.Tensor:
        return self.head(torch.tanh(self.a(x) if use_a else self.b(x)))


def _mlp(d_in: int = D_IN, d_out: int = D_OUT) -> nn.Module:
    return nn.Sequential(nn.Linear(d_in, WIDTH), nn.Tanh(), nn.Linear(WIDTH, d_out))


def build_models(spec: Spec) -> list[nn.Module]:
    """The members' float32 models, initialized from fixed seeds (the same on every rank)."""
    out: list[nn.Module] = []
    if spec["mode"] == "steps" and spec["members"] == "gan":
        torch.manual_seed(11)
        critic = nn.Linear(D_OUT, 2)
        torch.manual_seed(12)
        return [critic, _mlp()]
    n = 2 if spec["mode"] == "steps" else 1
    for k in range(n):
        torch.manual_seed(21 + k)
        out.append(Branchy() if spec["model"] == "branchy" else _mlp())
    return out


def make_optimizer(spec: Spec, params: Sequence[nn.Parameter]) -> torch.optim.Optimizer:
    if spec["optimizer"] == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01)
    # A large eps keeps Adam sensitive to the gradient's scale (with eps=1e-8 it would hide
    # a normalization factor) and bounds how much it amplifies rounding in tiny gradients.
    return torch.optim.AdamW(params, lr=0.01, eps=0.1, weight_decay=0.01)


def make_scheduler(spec: Spec, opt: torch.optim.Optimizer) -> Any:
    if spec["scheduler"] == "step":
        return torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    if spec["scheduler"] == "lambda":
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda u: 1.0 / (1.0 + u))
    return None


# -- the data -----------------------------------------------------------------------------------


def batch(spec: Spec, rank: int, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Micro-batch ``index`` of ``rank``: inputs, targets and a token mask (>= 1 valid)."""
    n = spec["sizes"][rank][index]
    g = torch.Generator().manual_seed(spec["seed"] * 1000 + rank * 100 + index)
    x = torch.randn(n, D_IN, generator=g)
    y = torch.randn(n, D_OUT, generator=g)
    mask = torch.rand(n, D_OUT, generator=g) < 0.6
    mask[0, 0] = True  # the first column is in every loss: at least one valid token
    return x, y, mask


def use_a(spec: Spec, rank: int, index: int) -> bool:
    """Branchy's branch for this micro-batch: per batch, or per rank (DDP's hard case)."""
    return (index + (rank if spec["branch"] == "rank" else 0)) % 2 == 0


def losses(
    out: torch.Tensor, y: torch.Tensor, mask: torch.Tensor, spec: Spec
) -> tuple[list[torch.Tensor], Any]:
    """The micro-step's losses (one, or the same loss split in two) and its weight.

    The loss is the mean squared error over the batch (or, with token weights, over the
    valid tokens of the mask); split in two it is the first columns' part and the last
    column's part, each over the same denominator, so the two add up to the one loss.
    """
    if out.dtype in (torch.bfloat16, torch.float16):
        out = out.float()  # the loss in float32, as autocast computes mse_loss
    d = out.shape[1]
    y, mask = y[:, :d].to(out.dtype), mask[:, :d]
    sq = (out - y).pow(2)
    kind = spec["weight"]
    if kind == "tokens":
        m = mask.to(sq.dtype)
        sq, den = sq * m, mask.sum()
    else:
        den = torch.tensor(sq.numel())
    weight: Any = None
    if kind == "samples":
        weight = out.shape[0]
    elif kind == "samples_tensor":
        weight = torch.tensor(out.shape[0])
    elif kind == "tokens":
        weight = mask.sum()
    if spec["backwards"] == 1:
        return [sq.sum() / den], weight
    return [sq[:, :-1].sum() / den, sq[:, -1:].sum() / den], weight


# -- the loop with loopkit ------------------------------------------------------------------


def epochs_batches(spec: Spec) -> list[list[int]]:
    """The batch indices each pass runs: all of them, or up to ``break_at`` in pass 0."""
    n = spec["n_batches"]
    passes = [list(range(n)) for _ in range(spec["epochs"])]
    if spec["break_at"] is not None:
        passes[0] = passes[0][: spec["break_at"] + 1]
    return passes


def entries(spec: Spec, index: int) -> list[int]:
    """Per member on batch ``index``: 0 not entered, 1 entered with backward, 2 without."""
    return list(spec["enter"][index])


def _wrap(spec: Spec, model: nn.Module) -> nn.Module:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    ddp = nn.parallel.DistributedDataParallel(model, find_unused_parameters=spec["find_unused"])
    hook = spec["hook"]
    if hook == "allreduce":
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    elif hook == "fp16_compress":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif hook == "builtin_allreduce":
        ddp._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)
    elif hook == "builtin_fp16":
        ddp._register_builtin_comm_hook(dist.BuiltinCommHookType.FP16_COMPRESS)
    return ddp


def _small_scale(amp: loopkit.autocast_step) -> None:
    """fp16: start the GradScaler at 2**8, so no start-up back-off skips an update."""
    if amp.scaler is not None:
        amp.load_state_dict({"scaler": torch.amp.GradScaler("cpu", init_scale=256.0).state_dict()})


class _Run:
    """One rank's loop with loopkit for ``spec``; what it ends with."""

    def __init__(self, spec: Spec, rank: int, world: int) -> None:
        self.spec, self.rank, self.world = spec, rank, world
        self.models = build_models(spec)
        self.initial = [flat(m) for m in self.models]
        self.wrapped = [_wrap(spec, m) if world > 1 else m for m in self.models]
        self.opts = [make_optimizer(spec, list(w.parameters())) for w in self.wrapped]
        self.scheds = [make_scheduler(spec, o) for o in self.opts]
        prec, every, clip = spec["precision"], spec["every"], spec["clip"]
        gan = spec["mode"] == "steps" and spec["members"] == "gan"
        self.amp: loopkit.autocast_step | None = None
        self.steps: list[Any] = []
        if spec["mode"] == "accumulate":
            if prec != "fp32":
                self.amp = loopkit.autocast_step(prec, device_type="cpu")
                _small_scale(self.amp)
            self.steps = [
                loopkit.accumulate(
                    self.wrapped[0], self.opts[0], every, scheduler=self.scheds[0],
                    clip_grad_norm=clip, amp=self.amp,
                )
            ]  # fmt: skip
        else:
            for k, (w, o, s) in enumerate(zip(self.wrapped, self.opts, self.scheds, strict=True)):
                frozen = [self.wrapped[0]] if gan and k == 1 else []
                st_ = loopkit.step(
                    w, o, precision=prec, accumulate=every, clip_grad_norm=clip, scheduler=s,
                    frozen=frozen,
                )  # fmt: skip
                _small_scale(st_.amp)
                self.steps.append(st_)
        self.group = loopkit.steps(*self.steps) if spec["mode"] == "steps" else None

    def micro_step(self, k: int, index: int, fake: torch.Tensor | None) -> torch.Tensor | None:
        """Member ``k``'s micro-step on batch ``index``; returns a generator output to share.

        Forwards and backward passes alternate (forward, backward, forward, backward), as
        the DCGAN loop does: DDP prepares each backward's all-reduce at its forward.
        """
        spec, s = self.spec, self.steps[k]
        x, y, mask = batch(spec, self.rank, index)
        gan = spec["mode"] == "steps" and spec["members"] == "gan"
        offered = None
        with s:
            if entries(spec, index)[k] == 2:
                return None
            if gan and k == 0:
                # fake = G(noise) inside the critic's step, as the DCGAN loop has it; offered
                # to the generator's step when it will back-propagate through it.
                share = spec["g_forward"] == "shared" and entries(spec, index)[1] == 1
                with torch.enable_grad() if share else torch.no_grad():
                    fake_in = self.wrapped[1](x)
                offered = fake_in if share else None
            for j in range(2 if spec["backwards"] == "two_forwards" else 1):
                if gan and k == 0:
                    # float(): a second forward runs after backward left autocast.
                    out = self._amp(lambda: self.wrapped[0](fake_in.detach().float()))
                elif gan:
                    src = fake if fake is not None and j == 0 else None
                    out = self._amp(
                        lambda s_=src: self.wrapped[0](s_ if s_ is not None else self.wrapped[1](x))
                    )
                else:
                    out = self._amp(lambda: self._model_forward(k, x, index))
                parts, weight = losses(out, y, mask, spec)
                if spec["backwards"] == "two_forwards":
                    s.backward(parts[j], weight=weight if j == 0 else None)
                else:
                    for i, loss in enumerate(parts):
                        more = i + 1 < len(parts)
                        s.backward(loss, weight=weight if i == 0 else None, retain_graph=more)
        return offered

    def _amp(self, forward: Callable[[], torch.Tensor]) -> torch.Tensor:
        """A bare accumulate's forward runs under its own autocast_step (a step has its own)."""
        if self.amp is None:
            return forward()
        with self.amp:
            return forward()

    def _model_forward(self, k: int, x: torch.Tensor, index: int) -> torch.Tensor:
        model = self.wrapped[k]
        if self.spec["model"] == "branchy":
            return model(x, use_a(self.spec, self.rank, index))
        return model(x)

    def train(self) -> None:
        spec = self.spec
        loop = self.group if self.group is not None else self.steps[0]
        every_batch = list(range(spec["n_batches"]))
        for p in range(spec["epochs"]):
            it: Any = iter(every_batch) if spec["loop"] == "flush" else loop.iterate(every_batch)
            for index in it:
                fake = None
                for k in range(len(self.steps)):
                    if entries(spec, index)[k]:
                        out = self.micro_step(k, index, fake)
                        fake = out if k == 0 else None
                if p == 0 and index == spec["break_at"]:
                    break  # leaves iterate early: the next pass (or flush) closes the window
        loop.flush()

    def result(self) -> dict[str, Any]:
        return {
            "params": [flat(m) for m in self.models],
            "updates": [s.updates for s in self.steps],
            "skipped": [s.skipped for s in self.steps],
            "lr": [o.param_groups[0]["lr"] for o in self.opts],
            "group_updates": None if self.group is None else self.group.updates,
        }


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])


def run_loopkit(spec: Spec, rank: int = 0, world: int = 1) -> dict[str, Any]:
    """Train ``spec`` with loopkit on this rank; the members' weights, counters and lr."""
    run = _Run(spec, rank, world)
    run.train()
    return {**run.result(), "initial": run.initial}


# -- the float64 reference --------------------------------------------------------------------


class _Member:
    """One member in float64: its window's summed gradient, total weight and optimizer."""

    def __init__(self, spec: Spec, model: nn.Module, mistake: str | None = None) -> None:
        self.mistake, self.every = mistake, spec["every"]
        self.model = copy.deepcopy(model).double()
        self.params = list(self.model.parameters())
        self.opt = make_optimizer(spec, self.params)
        self.sched = make_scheduler(spec, self.opt)
        self.clip = spec["clip"]
        self.updates = 0
        self._reset()

    def _reset(self) -> None:
        self.grads: list[torch.Tensor | None] = [None] * len(self.params)
        self.total = 0.0
        self.backwards = 0
        self.micro = 0

    def add(self, loss: torch.Tensor, weight: float) -> None:
        if self.mistake == "unweighted":
            weight = 1.0
        got = torch.autograd.grad(weight * loss, self.params, allow_unused=True, retain_graph=True)
        for i, g in enumerate(got):
            if g is not None:
                self.grads[i] = g if self.grads[i] is None else self.grads[i] + g
        self.total += weight
        self.backwards += 1

    def close(self) -> None:
        """The window ends: one clipped optimizer step on its mean gradient (if any backward)."""
        if self.backwards:
            total = self.total
            if self.mistake == "ragged_by_every":  # the hand-written loop's ragged window
                total *= self.every / self.backwards
            for p, g in zip(self.params, self.grads, strict=True):
                p.grad = None if g is None else g / total
            if self.clip is not None and self.mistake != "no_clip":
                nn.utils.clip_grad_norm_([p for p in self.params if p.grad is not None], self.clip)
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            if self.sched is not None:
                self.sched.step()
            self.updates += 1
        self._reset()


def _weight_value(weight: Any) -> float:
    return 1.0 if weight is None else float(weight)


def reference(spec: Spec, world: int = 1, mistake: str | None = None) -> dict[str, Any]:
    """The float64 updates of ``spec`` over every rank's micro-batches, by hand.

    ``mistake`` computes a classic wrong answer instead, to show the comparison tells them
    apart: ``"ragged_by_every"`` (a ragged window divided by ``every``), ``"unweighted"``
    (weights ignored), ``"no_clip"``.
    """
    members = [_Member(spec, m, mistake) for m in build_models(spec)]
    n = len(members)
    every, gan = spec["every"], spec["mode"] == "steps" and spec["members"] == "gan"
    group_updates = 0
    passes = epochs_batches(spec)
    for p, passed in enumerate(passes):
        for pos, index in enumerate(passed):
            last_of_pass = index == spec["n_batches"] - 1
            how = entries(spec, index)
            if spec["loop"] == "flush":
                ends = [members[k].micro + 1 >= every for k in range(n)]
            else:
                ends = [(pos + 1) % every == 0 or last_of_pass] * n
            if spec["mode"] == "steps" and ends[0]:
                group_updates += 1
            for k in range(n):
                if not how[k]:
                    continue
                m = members[k]
                m.micro += 1
                if how[k] == 1:
                    for r in range(world):
                        _contribute(spec, members, k, r, index, gan)
                if ends[k]:
                    m.close()
            if spec["mode"] == "steps" and ends[0]:
                for k in range(n):
                    if not how[k] and members[k].micro:
                        members[k].close()
        is_break = p == 0 and spec["break_at"] is not None
        if is_break or p == len(passes) - 1:
            # iterate's next pass (or the final flush) closes a window left open.
            stepped = any(m.micro and m.backwards for m in members)
            for m in members:
                if m.micro:
                    m.close()
            if stepped and spec["mode"] == "steps":
                group_updates += 1
    return {
        "params": [torch.cat([p.detach().reshape(-1) for p in m.params]) for m in members],
        "updates": [m.updates for m in members],
        "lr": [m.opt.param_groups[0]["lr"] for m in members],
        "group_updates": group_updates if spec["mode"] == "steps" else None,
    }


def _contribute(
    spec: Spec, members: list[_Member], k: int, rank: int, index: int, gan: bool
) -> None:
    """Member ``k``'s micro-step on ``rank``'s micro-batch ``index``: ``w * L`` into its window."""
    x, y, mask = (t.double() if t.is_floating_point() else t for t in batch(spec, rank, index))
    if gan:
        critic, gen = members[0].model, members[1].model
        out = critic(gen(x).detach()) if k == 0 else critic(gen(x))
        # The generator's gradient only: the critic is frozen in its step.
        target = members[k]
    else:
        model = members[k].model
        out = model(x, use_a(spec, rank, index)) if spec["model"] == "branchy" else model(x)
        target = members[k]
    parts, weight = losses(out, y, mask, spec)
    target.add(sum(parts[1:], parts[0]), _weight_value(weight))


# -- the comparison -------------------------------------------------------------------------


def tolerance(spec: Spec) -> float:
    rtol = RTOL[spec["precision"]]
    if spec.get("hook") in ("fp16_compress", "builtin_fp16"):
        rtol = max(rtol, RTOL["fp16"])
    return rtol


def compare(spec: Spec, got: dict[str, Any], ref: dict[str, Any]) -> list[str]:
    """What differs between loopkit's run and the reference (empty: the invariant holds)."""
    problems = []
    rtol = tolerance(spec)
    for k, (w, r, w0) in enumerate(zip(got["params"], ref["params"], got["initial"], strict=True)):
        r32 = r.to(torch.float64)
        moved = (r32 - w0.double()).abs().max().item()
        err = (w.double() - r32).abs().max().item()
        bound = rtol * moved + ATOL
        if not err <= bound:  # also catches nan
            problems.append(
                f"member {k}: weights off the float64 reference by {err:.3e} (allowed "
                f"{bound:.3e} = {rtol:g} x the update's size {moved:.3e} + {ATOL:g})"
            )
    if got["updates"] != ref["updates"]:
        problems.append(f"updates {got['updates']}, reference {ref['updates']}")
    if any(got["skipped"]):
        problems.append(f"skipped updates {got['skipped']} (no loss here is inf/nan)")
    for k, (a, b) in enumerate(zip(got["lr"], ref["lr"], strict=True)):
        if not math.isclose(a, b, rel_tol=1e-12):
            problems.append(f"member {k}: lr {a!r}, reference {b!r}")
    if got["group_updates"] != ref["group_updates"]:
        problems.append(f"group.updates {got['group_updates']}, reference {ref['group_updates']}")
    return problems


# -- the scenarios ----------------------------------------------------------------------------


@st.composite
def scenarios(draw: Callable[..., Any], world: int = 1) -> Spec:
    """A loop shape to train, with every feature's combination possible."""
    mode = draw(st.sampled_from(["step", "accumulate", "steps"]))
    every = draw(st.integers(1, 4))
    n_batches = draw(st.integers(1, 7))
    loop = "iterate" if mode == "steps" else draw(st.sampled_from(["iterate", "flush"]))
    epochs = draw(st.integers(1, 2)) if loop == "iterate" else 1
    break_at = None
    if loop == "iterate" and n_batches > 1 and draw(st.booleans()):
        break_at = draw(st.integers(0, n_batches - 2))
    members = draw(st.sampled_from(["pair", "gan"])) if mode == "steps" else "single"
    weight = draw(st.sampled_from([None, "samples", "samples_tensor", "tokens"]))
    model = "mlp"
    if members != "gan":
        model = draw(st.sampled_from(["mlp", "mlp", "branchy"]))
    n_members = 2 if mode == "steps" else 1
    # 0: not entered (groups only), 1: entered with backward, 2: entered without backward.
    choice = st.sampled_from([1, 1, 1, 0, 2] if mode == "steps" else [1, 1, 1, 1, 2])
    enter = [
        draw(st.lists(choice, min_size=n_members, max_size=n_members)) for _ in range(n_batches)
    ]
    sizes = draw(
        st.lists(
            st.lists(st.integers(1, 5), min_size=n_batches, max_size=n_batches),
            min_size=world, max_size=world,
        )
    )  # fmt: skip
    spec: Spec = {
        "mode": mode,
        "members": members,
        "model": model,
        "branch": "batch",
        "every": every,
        "n_batches": n_batches,
        "sizes": sizes,
        "loop": loop,
        "epochs": epochs,
        "break_at": break_at,
        "enter": enter,
        "weight": weight,
        "backwards": draw(st.sampled_from([1, 1, 2, "two_forwards"])),
        "g_forward": draw(st.sampled_from(["inside", "shared"])) if members == "gan" else "inside",
        "precision": draw(st.sampled_from(["fp32", "fp32", "fp32", "bf16", "fp16"])),
        "optimizer": draw(st.sampled_from(["sgd", "adamw"])),
        "clip": draw(st.sampled_from([None, None, 0.05, 1.0])),
        "scheduler": draw(st.sampled_from([None, "step", "lambda"])),
        "seed": draw(st.integers(0, 2**16)),
        "find_unused": False,
        "hook": None,
    }
    if world > 1:
        spec["find_unused"] = model == "branchy" or draw(st.booleans())
        spec["branch"] = draw(st.sampled_from(["batch", "rank"])) if model == "branchy" else "batch"
        spec["hook"] = draw(
            st.sampled_from(
                [None, "allreduce", "fp16_compress", "builtin_allreduce", "builtin_fp16"]
            )
        )
    return spec


def check(spec: Spec) -> None:
    """Raise AssertionError naming what differs, for a single-process run of ``spec``."""
    problems = compare(spec, run_loopkit(spec), reference(spec))
    assert not problems, "; ".join(problems)


def check_on_ranks(spec: Spec, info: Any) -> dict[str, Any]:
    """On each of the ranks: replicas bit-identical, and equal to the all-ranks reference."""
    got = run_loopkit(spec, info.rank, info.world_size)
    problems = []
    for k, p in enumerate(got["params"]):
        replicas = [torch.zeros_like(p) for _ in range(info.world_size)]
        dist.all_gather(replicas, p.contiguous())
        if not all(torch.equal(r, replicas[0]) for r in replicas):
            gap = max((r - replicas[0]).abs().max().item() for r in replicas)
            problems.append(f"member {k}: the replicas differ across ranks (by up to {gap:.3e})")
    problems += compare(spec, got, reference(spec, info.world_size))
    assert not problems, "; ".join(problems)
    return {"updates": got["updates"]}


def _ddp(**changes: Any) -> Spec:
    """A 2-rank scenario of 4 batches for ``EXPLICIT``, with ``changes``."""
    spec: Spec = {
        "mode": "step", "members": "single", "model": "mlp", "branch": "batch", "every": 2,
        "n_batches": 4, "sizes": [[3, 2, 4, 1], [2, 5, 1, 3]], "loop": "iterate", "epochs": 1,
        "break_at": None, "enter": [[1]] * 4, "weight": None, "backwards": 1,
        "g_forward": "inside", "precision": "fp32", "optimizer": "sgd", "clip": None,
        "scheduler": None, "seed": 3, "find_unused": False, "hook": None,
    }  # fmt: skip
    spec.update(changes)
    return spec


EXPLICIT: list[Spec] = [
    # r2_11: accumulate=1, one forward and two backward passes per micro-step.
    _ddp(every=1, backwards=2),
    # ... and a member whose first micro-step with backward ends a window (every=2).
    _ddp(mode="steps", members="gan", enter=[[1, 2], [1, 1], [1, 0], [1, 1]], backwards=2),
    # r2_13: a window ending on a micro-step without backward, built-in C++ comm hooks.
    _ddp(every=3, n_batches=3, enter=[[1], [1], [2]], hook="builtin_allreduce"),
    _ddp(every=3, n_batches=3, enter=[[1], [1], [2]], hook="builtin_fp16", weight="samples"),
    # r2_18: the DCGAN shape, G's forward inside D's step, G back-propagating twice.
    _ddp(mode="steps", members="gan", enter=[[1, 1]] * 4, backwards=2, g_forward="shared"),
    # Rank-dependent branches with find_unused_parameters, a ragged tail closed by flush().
    _ddp(
        model="branchy",
        branch="rank",
        find_unused=True,
        every=3,
        loop="flush",
        weight="tokens",
        hook="allreduce",
    ),
]
"""Known edge shapes (0.2's DDP bugs) run before the drawn examples, every time."""
