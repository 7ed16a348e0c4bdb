"""Parity with the hand-written loop: a ``loopkit.step`` loop against the loop a port replaces.

A scenario (a JSON-able dict drawn by ``scenarios``) says what trains: a small model with
dropout whose parameters are registered in another order than their names sort in; the
optimizer's parameter groups (one group, minGPT's name-sorted decay/no-decay groups, or a
shuffled split into several groups with their own learning rates); SGD with momentum or
AdamW; clipping or none; a scheduler or none; ``accumulate=k``; and where the batches come
from and where they draw random numbers: a ``Dataset`` drawing from torch, numpy and python
in ``__getitem__`` behind a ``DataLoader`` without workers (shuffled or not), a
``collate_fn`` that draws, an ``IterableDataset`` with a length behind a ``DataLoader``,
a ``Sized`` iterable of the user's that draws as it hands out batches, a plain list of
``(x, y)`` tuples or of stacked tensors, and a ``distributed.loader``.

Both loops start from the same seeds and build the same objects; ``run_loopkit`` trains with
``for x, y in step.iterate(source): with step as s: s.backward(loss)``, ``run_hand`` with
the loop a port is compared against (``hand_update``: a ragged window's gradients scaled by
``k / len(window)``, as loopkit normalizes it, before clipping). ``differences`` lists what
is not bit-identical between the two ``Trace``s.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from hypothesis import strategies as st
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset

import loopkit
from loopkit import distributed

Spec = dict[str, Any]
Batch = tuple[torch.Tensor, torch.Tensor]

D = 4
"""Input and output width (equal, so a stacked tensor of shape (2, b, D) unpacks as x, y)."""
WIDTH = 6

SOURCES = ["map", "collate", "iterable", "sized", "list", "tensors", "dist_loader"]
"""Where the batches come from (and where they draw random numbers): see ``make_source``."""


# -- the model, its optimizer and scheduler ---------------------------------------------------


class Net(nn.Module):
    """Linear, LayerNorm, dropout, linear: registered in another order than names sort."""

    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.w_in = nn.Linear(D, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)
        self.drop = nn.Dropout(dropout)
        self.b_out = nn.Linear(WIDTH, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.b_out(self.drop(torch.tanh(self.norm(self.w_in(x)))))
        return out


def param_groups(spec: Spec, model: nn.Module) -> list[dict[str, Any]]:
    """The optimizer's groups: one, minGPT's name-sorted decay/no-decay, or a shuffled split."""
    named = dict(model.named_parameters())
    if spec["groups"] == "one":
        return [{"params": list(model.parameters())}]
    if spec["groups"] == "mingpt":
        # minGPT's configure_optimizers: Linear weights decay, biases and LayerNorm do not;
        # each group lists its parameters by sorted name.
        decay = sorted(n for n in named if n.endswith("weight") and not n.startswith("norm"))
        no_decay = sorted(set(named) - set(decay))
        return [
            {"params": [named[n] for n in decay], "weight_decay": 0.1},
            {"params": [named[n] for n in no_decay], "weight_decay": 0.0},
        ]
    names = list(named)
    order = [names[i] for i in spec["perm"]]
    cuts = sorted(set(spec["cuts"]))
    bounds = [0, *cuts, len(order)]
    return [
        {"params": [named[n] for n in order[a:b]], "lr_scale": 1.0 + 0.5 * g}
        for g, (a, b) in enumerate(itertools.pairwise(bounds))
        if b > a
    ]


def make_optimizer(spec: Spec, model: nn.Module) -> torch.optim.Optimizer:
    groups = param_groups(spec, model)
    base = 0.1 if spec["optimizer"] == "sgd" else 0.01
    for g in groups:  # a shuffled split gives each group its own learning rate
        g["lr"] = base * g.pop("lr_scale", 1.0)
    if spec["optimizer"] == "sgd":
        return torch.optim.SGD(groups, lr=base, momentum=0.9, weight_decay=0.01)
    return torch.optim.AdamW(groups, lr=base, weight_decay=0.01)


def make_scheduler(spec: Spec, opt: torch.optim.Optimizer) -> Any:
    if spec["scheduler"] == "step":
        return torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    if spec["scheduler"] == "lambda":
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda u: 1.0 / (1.0 + u))
    return None


# -- the data: where it draws random numbers --------------------------------------------------


def _noise(x: torch.Tensor) -> torch.Tensor:
    """Random augmentation from the main process's torch, numpy and python streams."""
    scale = float(np.random.uniform(0.05, 0.15))
    shift = random.gauss(0.0, 0.01)
    return x + scale * torch.randn(x.shape) + shift


class Noisy(Dataset[Batch]):
    """Sample i: fixed (x_i, y_i), x augmented from torch, numpy and python in ``__getitem__``."""

    def __init__(self, xs: torch.Tensor, ys: torch.Tensor, augment: bool = True) -> None:
        self.xs, self.ys, self.augment = xs, ys, augment

    def __len__(self) -> int:
        return len(self.xs)

    def __getitem__(self, i: int) -> Batch:
        x = _noise(self.xs[i]) if self.augment else self.xs[i]
        return x, self.ys[i]


class Stream(IterableDataset[Batch]):
    """The same samples as a stream, augmented as they are made, with a length (one without
    is looked ahead: the hand loop's random stream needs a length to count to)."""

    def __init__(self, xs: torch.Tensor, ys: torch.Tensor) -> None:
        self.xs, self.ys = xs, ys

    def __len__(self) -> int:
        return len(self.xs)

    def __iter__(self) -> Iterator[Batch]:
        for x, y in zip(self.xs, self.ys, strict=True):
            yield _noise(x), y


class SizedBatches:
    """A Sized iterable of the user's (no DataLoader): each batch augmented as it is taken."""

    def __init__(self, pairs: list[Batch]) -> None:
        self.pairs = pairs

    def __len__(self) -> int:
        return len(self.pairs)

    def __iter__(self) -> Iterator[Batch]:
        for x, y in self.pairs:
            yield _noise(x), y


def noisy_collate(items: list[Batch]) -> Batch:
    """Stack a batch and augment it in ``collate_fn`` (torch's stream, once per batch)."""
    x = torch.stack([a for a, _ in items])
    return x + 0.1 * torch.randn(x.shape), torch.stack([b for _, b in items])


def make_source(spec: Spec) -> Iterable[Any]:
    """What the loop iterates over, from the samples made now (from the seeded streams)."""
    n, b = spec["samples"], spec["batch_size"]
    xs, ys = torch.randn(n, D), torch.randn(n, D)
    kind, shuffle, drop_last = spec["source"], spec["shuffle"], spec["drop_last"]
    if kind == "map":
        return DataLoader(Noisy(xs, ys), batch_size=b, shuffle=shuffle, drop_last=drop_last)
    if kind == "collate":
        return DataLoader(
            Noisy(xs, ys, augment=False), batch_size=b, shuffle=shuffle, drop_last=drop_last,
            collate_fn=noisy_collate,
        )  # fmt: skip
    if kind == "iterable":
        return DataLoader(Stream(xs, ys), batch_size=b, drop_last=drop_last)
    if kind == "dist_loader":
        return distributed.loader(
            Noisy(xs, ys), batch_size=b, shuffle=shuffle, seed=spec["seed"], drop_last=drop_last,
            num_workers=0,
        )  # fmt: skip
    starts = range(0, n - b + 1 if drop_last else n, b)
    pairs = [(xs[i : i + b], ys[i : i + b]) for i in starts]
    if kind == "sized":
        return SizedBatches(pairs)
    if kind == "tensors":
        return [torch.stack(p) for p in pairs]  # each item (2, b, D): unpacks as x, y
    return pairs


def known_length(source: Iterable[Any]) -> int | None:
    """The batches in a pass, where the source says (an IterableDataset's loader cannot)."""
    try:
        return len(source)  # type: ignore[arg-type]
    except TypeError:
        return None


# -- both loops --------------------------------------------------------------------------------


def seed_all(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)


@dataclasses.dataclass
class Parts:
    """What one run trains: built the same way for both loops, from the same seeds."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    source: Iterable[Any]


def build(spec: Spec) -> Parts:
    seed_all(spec["seed"])
    model = Net(spec["dropout"])
    opt = make_optimizer(spec, model)
    return Parts(model, opt, make_scheduler(spec, opt), make_source(spec))


@dataclasses.dataclass
class Trace:
    """What a run saw and ended with."""

    sums: list[torch.Tensor]
    """x.sum() of each micro-step's batch: which batches were seen, in which order."""
    norms: list[torch.Tensor]
    """The total gradient norm of each update, before clipping."""
    losses: list[torch.Tensor]
    params: list[torch.Tensor]
    optimizer: dict[str, Any]
    lrs: list[float]
    scheduler_epoch: int | None
    rng: tuple[torch.Tensor, Any, Any]
    updates: int


def rng_states() -> tuple[torch.Tensor, Any, Any]:
    return torch.get_rng_state(), np.random.get_state(), random.getstate()


def finish(parts: Parts, trace: dict[str, Any], updates: int) -> Trace:
    opt, sched = parts.optimizer, parts.scheduler
    return Trace(
        sums=trace["sums"], norms=trace["norms"], losses=trace["losses"],
        params=[p.detach().clone() for p in parts.model.parameters()],
        optimizer=opt.state_dict(), lrs=[g["lr"] for g in opt.param_groups],
        scheduler_epoch=None if sched is None else sched.last_epoch,
        rng=rng_states(), updates=updates,
    )  # fmt: skip


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(model(x), y)


def hand_update(
    model: nn.Module, opt: torch.optim.Optimizer, sched: Any, every: int, window: int,
    clip: float | None, after_step: Callable[[], object] | None = None,
) -> torch.Tensor:  # fmt: skip
    """The hand loop's update after ``window`` micro-steps of ``(loss / every).backward()``.

    A ragged window (``window < every``) scales its summed gradients by ``every / window``
    before clipping, so that they are its mean gradient: the normalization loopkit makes
    (``_normalize.boundary_factor``, one multiply of the summed gradients). Returns the total
    norm before clipping, summed in ``model.parameters()`` order.
    """
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if window != every:
        for g in grads:
            g.mul_(every / window)
    if clip is not None:
        norm = nn.utils.clip_grad_norm_(model.parameters(), clip)
    else:
        norm = nn.utils.get_total_norm(grads)
    opt.step()
    if after_step is not None:
        after_step()
    if sched is not None:
        sched.step()
    opt.zero_grad()
    return norm


def run_hand(spec: Spec, *, lookahead: bool = False, ragged_by_every: bool = False) -> Trace:
    """The hand-written loop. ``lookahead``/``ragged_by_every``: classic mistakes instead (the
    next batch taken before this one's micro-step; a ragged window left divided by every)."""
    parts = build(spec)
    model, opt, sched = parts.model, parts.optimizer, parts.scheduler
    k, clip = spec["accumulate"], spec["clip"]
    trace: dict[str, Any] = {"sums": [], "norms": [], "losses": []}
    updates = 0
    for _ in range(spec["epochs"]):
        last = known_length(parts.source)
        window = 0
        batches = _ahead(parts.source) if lookahead else iter(parts.source)
        for i, (x, y) in enumerate(batches):
            trace["sums"].append(x.sum())
            loss = loss_of(model, x, y)
            (loss / k).backward()
            trace["losses"].append(loss.detach())
            window += 1
            if window == k or (last is not None and i + 1 == last):
                size = k if ragged_by_every else window
                trace["norms"].append(hand_update(model, opt, sched, k, size, clip))
                updates, window = updates + 1, 0
        if window:  # a stream without a length: its ragged window closes after the loop
            size = k if ragged_by_every else window
            trace["norms"].append(hand_update(model, opt, sched, k, size, clip))
            updates += 1
    return finish(parts, trace, updates)


def _ahead(source: Iterable[Any]) -> Iterator[Any]:
    """The batches, each taken before the previous one is used (a one-batch lookahead)."""
    it = iter(source)
    try:
        cur = next(it)
    except StopIteration:
        return
    for nxt in it:
        yield cur
        cur = nxt
    yield cur


def run_loopkit(spec: Spec) -> Trace:
    """The port: ``for x, y in step.iterate(source): with step as s: s.backward(loss)``."""
    parts = build(spec)
    model = parts.model
    step = loopkit.step(
        model, parts.optimizer, accumulate=spec["accumulate"], clip_grad_norm=spec["clip"],
        scheduler=parts.scheduler, measure_grad_norm=True,
    )  # fmt: skip
    trace: dict[str, Any] = {"sums": [], "norms": [], "losses": []}

    def note() -> None:  # an update happened (inside a micro-step, or when the items ended)
        if step.updates > len(trace["norms"]):
            assert step.grad_norm is not None
            trace["norms"].append(step.grad_norm)

    for _ in range(spec["epochs"]):
        for x, y in step.iterate(parts.source):
            trace["sums"].append(x.sum())
            with step as s:
                loss = loss_of(model, x, y)
                s.backward(loss)
            trace["losses"].append(loss.detach())
            note()
        note()
    return finish(parts, trace, step.updates)


# -- the comparison --------------------------------------------------------------------------


def _same_tensors(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def same_state(a: Any, b: Any) -> bool:
    """Whether two nested states (dicts, lists, tensors, arrays, numbers) are bit-identical."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype and torch.equal(a, b)
        )  # fmt: skip
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return bool(np.array_equal(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_state(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _gap(a: list[torch.Tensor], b: list[torch.Tensor]) -> str:
    if len(a) != len(b):
        return f"{len(a)} vs {len(b)} values"
    gaps = [(x.double() - y.double()).abs().max().item() for x, y in zip(a, b, strict=True)]
    return f"max gap {max(gaps, default=0.0):.3e}"


def differences(got: Trace, ref: Trace) -> list[str]:
    """What is not bit-identical between loopkit's run and the hand loop's (empty: parity)."""
    problems = []
    if not _same_tensors(got.sums, ref.sums):
        problems.append(
            f"the batches seen differ (x.sum() per micro-step: {_gap(got.sums, ref.sums)})"
        )
    if not _same_tensors(got.losses, ref.losses):
        problems.append(f"the losses differ ({_gap(got.losses, ref.losses)})")
    if got.updates != ref.updates:
        problems.append(f"updates {got.updates}, hand loop {ref.updates}")
    if not _same_tensors(got.norms, ref.norms):
        problems.append(f"the grad norms differ ({_gap(got.norms, ref.norms)})")
    if not _same_tensors(got.params, ref.params):
        problems.append(f"the final weights differ ({_gap(got.params, ref.params)})")
    if not same_state(got.optimizer, ref.optimizer):
        problems.append("the optimizer states differ")
    if got.lrs != ref.lrs or got.scheduler_epoch != ref.scheduler_epoch:
        problems.append(
            f"lr {got.lrs} (scheduler epoch {got.scheduler_epoch}), hand loop {ref.lrs} "
            f"({ref.scheduler_epoch})"
        )
    for name, a, b in zip(["torch", "numpy", "python"], got.rng, ref.rng, strict=True):
        if not same_state(a, b):
            problems.append(f"the {name} RNG state at the end differs")
    return problems


# -- the scenarios ----------------------------------------------------------------------------

N_PARAMS = 6  # w_in.weight/bias, norm.weight/bias, b_out.weight/bias


@st.composite
def scenarios(draw: Callable[..., Any]) -> Spec:
    """A loop to port: model, groups, optimizer, clipping, schedule, window and data."""
    source = draw(st.sampled_from(SOURCES))
    batch_size = draw(st.integers(1, 4))
    samples = draw(st.integers(1, 13))
    shuffle = source in ("map", "collate", "dist_loader") and draw(st.booleans())
    drop_last = samples >= batch_size and draw(st.sampled_from([False, False, True]))
    groups = draw(st.sampled_from(["one", "mingpt", "shuffled"]))
    return {
        "source": source,
        "samples": samples,
        "batch_size": batch_size,
        "shuffle": shuffle,
        "drop_last": drop_last,
        "epochs": draw(st.integers(1, 2)),
        "accumulate": draw(st.integers(1, 3)),
        "groups": groups,
        "perm": draw(st.permutations(range(N_PARAMS))),
        "cuts": draw(st.lists(st.integers(1, N_PARAMS - 1), max_size=2)),
        "optimizer": draw(st.sampled_from(["sgd", "adamw"])),
        "clip": draw(st.sampled_from([None, 0.05, 1.0])),
        "scheduler": draw(st.sampled_from([None, "step", "lambda"])),
        "dropout": draw(st.sampled_from([0.0, 0.2, 0.5])),
        "seed": draw(st.integers(0, 2**16)),
    }


def spec_of(**changes: Any) -> Spec:
    """A scenario with a ragged last batch and window (7 samples by 2, k=3), with ``changes``."""
    spec: Spec = {
        "source": "map", "samples": 7, "batch_size": 2, "shuffle": True, "drop_last": False,
        "epochs": 2, "accumulate": 3, "groups": "mingpt", "perm": list(range(N_PARAMS)),
        "cuts": [], "optimizer": "adamw", "clip": 0.05, "scheduler": "step", "dropout": 0.5,
        "seed": 5,
    }  # fmt: skip
    spec.update(changes)
    return spec
