"""loopkit.evaluate: exact distributed evaluation, every sample counted once.

``DistributedSampler`` pads each rank's shard with duplicates of the first samples so every
rank gets as many (accelerate#575: padded duplicates bias the metrics), and nanoGPT
evaluates on rank 0 only. Here every rank evaluates its shard, the padded duplicates are
dropped by position (the sampler appends them after the real samples, so on each rank they
are the last ones), and the ranks' float64 sums and counts are pooled in one exchange at
the end, summed in rank order on every rank alike.

The forward runs under ``torch.inference_mode()`` (``no_grad`` for FSDP2) and evaluate's
own precision (the step's, or ``precision=``: fp32 by default) wherever it is called: an
enclosing autocast (a step's,
entered by ``with step as s:`` until ``s.backward``) is off for the call and on again after
it. It runs on the module inside DDP (so no reducer state is touched, and ranks may run
different numbers of batches), with every submodule in eval mode and, under several
processes, rank 0's buffers on every rank (``_rank_zero_buffers``: the metric is that of
rank 0's model, whatever DDP's ``broadcast_buffers``); the modes, each rank's own buffers
and the RNG states (python, numpy, torch) are put back afterwards, so an evaluation never
changes the training that follows it.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler

from .. import _ranks
from .._checkpoint import _rng
from .._data._epoch_loader import EpochLoader
from .._data._to_device import to_device
from .._devices import model_device, resolve_device
from .._parallel._grad_sync import reshard, sync_kind, unwrap
from .._precision import resolve_precision
from .._step import _compose
from .._sync_points import expected_sync
from .._types import DeviceLike, PrecisionLike
from ._prepared import accelerate_shard
from ._rank_zero_buffers import RankZeroBuffers

Metrics = Mapping[str, torch.Tensor]
EvalFn = Callable[[nn.Module, Any], Metrics]

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class Evaluation(Mapping[str, float]):
    """Sample-weighted means by name (``result["loss"]``), with ``sums`` and ``samples``.

    ``result[name]`` is a mean **per sample** (per document, per image): for a per-token
    metric such as a language model's loss, return each sample's sum and its token count
    and read ``result.ratio("nll", "tokens")``.
    """

    def __init__(self, sums: dict[str, float], samples: int) -> None:
        self.sums = sums
        """Each metric's sum over every sample of the data set (float64)."""
        self.samples = samples
        """Samples evaluated: the data set's size, each counted once."""
        self.means = {k: v / samples for k, v in sums.items()}

    def __getitem__(self, name: str) -> float:
        return self.means[name]

    def ratio(self, numerator: str, denominator: str) -> float:
        """``sums[numerator] / sums[denominator]``: a ratio of exact totals (NLL per token)."""
        for name in (numerator, denominator):
            if name not in self.sums:
                raise KeyError(
                    f"ratio: no metric {name!r}; fn returned {sorted(self.sums)} (return "
                    "both the numerator and the denominator per sample)"
                )
        if self.sums[denominator] == 0:
            raise ZeroDivisionError(f"ratio: the sum of {denominator!r} over the data set is 0")
        return self.sums[numerator] / self.sums[denominator]

    def __iter__(self) -> Iterator[str]:
        return iter(self.means)

    def __len__(self) -> int:
        return len(self.means)

    def __repr__(self) -> str:
        said = ", ".join(f"{k}={v:.6g}" for k, v in self.means.items())
        return f"Evaluation({said}, samples={self.samples})"


def real_samples(rank: int, world: int, dataset_length: int) -> int:
    """Samples of ``DistributedSampler``'s shard of ``rank`` that are not padded duplicates."""
    return len(range(rank, dataset_length, world))


def evaluate(
    model: nn.Module,
    loader: Iterable[Any],
    fn: EvalFn,
    *,
    step: _compose.step | None = None,
    precision: PrecisionLike | None = None,
    device: DeviceLike | None = None,
    disjoint: bool = False,
) -> Evaluation:
    """Evaluate ``fn(model, batch)`` over ``loader``; the sample-weighted means, exactly.

    ``fn`` returns ``{name: values}`` with one value per sample of the batch (a loss with
    ``reduction="none"``, ``(pred == y).float()``). Under DDP each rank takes its shard:
    ``loader`` is a ``loopkit.distributed.loader`` or a DataLoader with a
    ``DistributedSampler`` (``drop_last=False``), or ``disjoint=True`` says the loader
    already gives every sample to exactly one rank (an IterableDataset sharded by rank).
    ``step=`` takes its precision, device and transfer options; else ``precision=``
    (default fp32) and ``device=`` (default the model's). That precision holds wherever it
    is called: inside ``with step as s:`` before ``s.backward`` the step's autocast is
    off for the evaluation (fp32) or replaced by evaluate's, and on again after it. Every
    rank must call it; each gets the same result: the metric of rank 0's model (all its
    buffers, such as BatchNorm's running statistics, on every rank for the call). One host
    read and one exchange (``all_gather_object``) per call; a model with buffers adds, under
    several processes, one exchange of their shapes and a broadcast of each.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if not callable(fn):
        raise TypeError("fn must be callable: fn(model, batch) -> {name: per-sample values}")
    if step is not None and not isinstance(step, _compose.step):
        raise TypeError(f"step must be a loopkit.step, got {type(step).__name__}")
    if step is not None and (precision is not None or device is not None):
        raise TypeError("pass step= or precision=/device=, not both (the step has its own)")
    if not isinstance(disjoint, bool):
        raise TypeError(f"disjoint must be a bool, got {disjoint!r}")
    autocast = _autocast(model, step, precision, device)
    move = step.to_device if step is not None else _mover(model, device)
    batches, keep = _shard(loader, disjoint)
    forward = _forward_module(model)
    # Rank 0's model (its buffers) on every rank: checked alike everywhere before anything changes.
    rank_zero = RankZeroBuffers(forward)

    modes = [(m, m.training) for m in model.modules()]
    names: list[str] | None = None
    kept: list[list[torch.Tensor]] = []  # per metric, this rank's real samples' values
    count, taken = 0, 0
    error: BaseException | None = None
    parts: list[list[float]] = []
    try:
        model.eval()
        with _rng.kept(), rank_zero, _grad_off(model), autocast:
            for batch in batches:
                out = fn(forward, move(batch))
                values, size = _per_sample(out, names)
                if names is None:
                    names = list(values)
                    kept = [[] for _ in names]
                # The padded duplicates are the shard's last samples: keep those before them.
                n = size if keep is None else max(0, min(size, keep - taken))
                taken += size
                count += n
                for chunks, v in zip(kept, values.values(), strict=True):
                    chunks.append(v[:n].to(torch.float64))
        if kept:
            with expected_sync("evaluate's result"):
                local = torch.stack([torch.cat(c) for c in kept]).tolist()  # host sync: one
            parts = [exact_parts(v) for v in local]
    except Exception as err:
        error = err
    finally:
        # Through train(): a module whose train() does something (LoRA merging its weights)
        # must hear of it. In order, parents first: a parent's call resets its children,
        # which are set again after it.
        for module, mode in modes:
            if module.training != mode:
                module.train(mode)
        # As it found it: FSDP2 modules that keep their parameters after a forward (the root)
        # would hold them gathered after this backward-free pass.
        reshard(model)
    # Every rank learns every rank's sums, and whether one failed, in one exchange.
    with expected_sync("evaluate's exchange"):
        reports = _ranks.gather_objects(
            (names, parts, count, None if error is None else f"{type(error).__name__}: {error}")
        )
    if error is not None:
        raise error
    return _pooled(reports)


def _grad_off(model: nn.Module) -> Any:
    """``inference_mode``, or ``no_grad`` for FSDP2: the buffers it gathers parameters into
    are made at its first forward and kept, and made under ``inference_mode`` they refuse
    every later forward outside it (an evaluation before any training: resumed, say)."""
    if sync_kind(model) == "fsdp2":
        return torch.no_grad()
    return torch.inference_mode()


def exact_parts(values: list[float]) -> list[float]:
    """Floats whose exact sum is the exact sum of ``values`` (or ``[inf/nan]`` if it has none).

    Pooling such parts from any split of the values and rounding once (``math.fsum``) gives
    the correctly rounded total: the same bits however the samples were split over ranks
    and batches, and in whatever order. Each round is one ``math.fsum`` over the values
    (C speed); two or three rounds are typical.
    """
    if not all(map(math.isfinite, values)):
        return [sum(values)]  # inf or nan: the total is that, whatever the order
    parts: list[float] = []
    try:
        while True:
            rest = math.fsum(itertools.chain(values, (-p for p in parts)))
            if rest == 0.0:  # fsum is correctly rounded: 0 only when nothing is left
                return parts
            parts.append(rest)
    except OverflowError:  # a total beyond float64's range
        return [sum(values)]


Report = tuple[list[str] | None, list[list[float]], int, str | None]
"""One rank's report: its metric names, exact parts per metric, samples, and its error."""


def _pooled(reports: list[Report]) -> Evaluation:
    """The ranks' parts rounded once per metric: the same floats on every rank, any split."""
    for r, (_, _, _, failed) in enumerate(reports):
        if failed is not None:
            raise RuntimeError(f"evaluate failed on rank {r}: {failed}")
    named = [(r, names) for r, (names, _, _, _) in enumerate(reports) if names is not None]
    if not named:
        raise ValueError("evaluate: the loader gave no batch on any rank: nothing to evaluate")
    first = named[0][1]
    for r, names in named:
        if names != first:
            raise ValueError(
                f"fn returned metrics {names} on rank {r} but {first} on rank {named[0][0]}: "
                "return the same names for every batch on every rank"
            )
    samples = sum(count for _, _, count, _ in reports)
    if samples == 0:
        raise ValueError("evaluate: every sample was a padded duplicate: nothing to evaluate")
    sums = {}
    for i, name in enumerate(first):
        parts = [p for _, pr, _, _ in reports if pr for p in pr[i]]
        try:
            sums[name] = math.fsum(parts)
        except (ValueError, OverflowError):  # inf - inf, or beyond float64: nan or inf
            sums[name] = sum(parts)
    return Evaluation(sums, samples)


def _per_sample(out: object, names: list[str] | None) -> tuple[dict[str, torch.Tensor], int]:
    """``fn``'s output checked: the same names each batch, one value per sample, same count."""
    if not isinstance(out, Mapping) or not out:
        raise TypeError(
            "fn must return a non-empty dict {name: per-sample values}, e.g. "
            '{"loss": F.cross_entropy(model(x), y, reduction="none")}; got '
            f"{type(out).__name__}"
        )
    values: dict[str, torch.Tensor] = {}
    size: int | None = None
    for name, v in out.items():
        if not isinstance(name, str) or not isinstance(v, torch.Tensor):
            raise TypeError(f"fn's output must map str names to tensors; {name!r} is not")
        if v.dim() != 1:
            raise ValueError(
                f"fn's {name!r} has shape {tuple(v.shape)}: return one value per sample (a 1-D "
                "tensor, e.g. reduction='none'); evaluate weights by samples and drops "
                "DistributedSampler's padded duplicates, which needs per-sample values"
            )
        if size is not None and len(v) != size:
            raise ValueError(f"fn's values have different lengths ({size} and {len(v)})")
        size = len(v)
        values[name] = v
    if names is not None and list(values) != names:
        raise ValueError(f"fn returned metrics {list(values)} after {names}: return the same names")
    assert size is not None
    return values, size


def _shard(loader: Iterable[Any], disjoint: bool) -> tuple[Iterable[Any], int | None]:
    """What to iterate, and how many of this rank's samples are real (None: all of them)."""
    if isinstance(loader, EpochLoader):
        if 0 < loader.position < len(loader):
            raise RuntimeError(
                "evaluate got a loader in the middle of a pass (the training loop's?): "
                "evaluate on a loader of its own, e.g. distributed.loader(val, shuffle=False)"
            )
        sampler: object = loader.batches.base
        if loader.batches.drop_last:
            raise ValueError(_DROPS)
        # Its DataLoader, not the EpochLoader: the loader's epoch and position stay as they are.
        inner: Iterable[Any] = loader.loader
    elif isinstance(loader, DataLoader):
        batch_sampler = loader.batch_sampler
        shards = getattr(batch_sampler, "num_processes", None)  # Accelerate's BatchSamplerShard
        if shards is not None:
            batch_sampler, disjoint, counted = accelerate_shard(batch_sampler, shards, disjoint)
        if isinstance(batch_sampler, BatchSampler) and batch_sampler.drop_last:
            raise ValueError(_DROPS)
        if shards is not None and counted is not None:
            return loader, counted
        sampler = getattr(batch_sampler, "sampler", None)
        inner = loader
    else:
        sampler, inner = None, loader
    if isinstance(sampler, DistributedSampler):
        dl = inner if isinstance(inner, DataLoader) else None
        if dl is not None and not getattr(dl, "in_order", True):
            raise ValueError(
                "the loader hands out batches out of order (in_order=False): evaluate finds "
                "DistributedSampler's padded duplicates by position; build it with in_order=True"
            )
        rank, world = _ranks.world()
        if (sampler.num_replicas, sampler.rank) != (world, rank):
            raise ValueError(
                f"the loader's DistributedSampler is for rank {sampler.rank} of "
                f"{sampler.num_replicas}, but this is rank {rank} of {world}"
            )
        if sampler.drop_last:
            raise ValueError(_DROPS)
        return inner, real_samples(rank, world, len(sampler.dataset))  # type: ignore[arg-type]  # DistributedSampler takes only sized datasets
    if _ranks.is_multi_rank() and not disjoint:
        raise ValueError(
            "under DDP this loader would give every rank every sample (it has no "
            "DistributedSampler): use loopkit.distributed.loader(data, shuffle=False), a "
            "DistributedSampler(drop_last=False), or pass disjoint=True if it already gives "
            "each sample to exactly one rank"
        )
    return inner, None


_DROPS = (
    "the loader drops samples (drop_last=True): evaluate counts every sample exactly once, "
    "build the evaluation loader with drop_last=False"
)


def _forward_module(model: nn.Module) -> nn.Module:
    """The module to run: inside DDP (no reducer, no forward's broadcast); FSDP as it is."""
    inner = unwrap(model)
    if sync_kind(inner) == "ddp":
        module = inner.module
        assert isinstance(module, nn.Module)  # DDP wraps a module
        return module
    return model


def _autocast(
    model: nn.Module,
    step: _compose.step | None,
    precision: PrecisionLike | None,
    device: DeviceLike | None,
) -> contextlib.AbstractContextManager[Any]:
    """evaluate's precision on its device, whatever autocast the call is made under."""
    if step is not None:
        prec, device_type = step.amp.precision, step.device.type
    else:
        prec = resolve_precision("fp32" if precision is None else precision)
        where = resolve_device(device) if device is not None else model_device(unwrap(model))
        device_type = where.type if where is not None else "cpu"
    return _own_precision(prec, device_type)


# The device types whose enclosing autocast is turned off: the evaluation's own is added.
_AUTOCAST_TYPES = ("cpu", "cuda", "xpu", "mps", "hpu")


@contextlib.contextmanager
def _own_precision(prec: str, device_type: str) -> Iterator[None]:
    """``prec`` on ``device_type`` and no autocast elsewhere, for the ``with`` block only.

    Called inside ``with step as s:`` before ``s.backward``, the step's autocast is entered:
    without this the evaluation would silently run in its precision. Each enclosing
    autocast is switched off (``enabled=False``) or, on the evaluation's device under bf16/
    fp16, replaced by evaluate's own; leaving restores the enclosing state as it was.
    """
    types = dict.fromkeys((device_type, *_AUTOCAST_TYPES))
    with contextlib.ExitStack() as stack:
        for kind in types:
            if kind == device_type and prec != "fp32":
                stack.enter_context(torch.autocast(kind, dtype=_DTYPES[prec]))
            elif torch.amp.is_autocast_available(kind) and torch.is_autocast_enabled(kind):
                stack.enter_context(torch.autocast(kind, enabled=False))
        yield


def _mover(model: nn.Module, device: DeviceLike | None) -> Callable[[Any], Any]:
    target = resolve_device(device) if device is not None else model_device(unwrap(model))
    if target is None:
        return lambda batch: batch
    return lambda batch: to_device(batch, target)
