"""micro_batch=: batches in chunks that fit, the update unchanged; probe_micro_batch finds the
size on injected out-of-memory errors and takes every trial back."""

from __future__ import annotations

import collections
import copy
import dataclasses
import importlib
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
from helpers import batches, deep, mlp, params
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import loopkit
from loopkit import distributed
from loopkit._step import _micro_batch as micro_batch
from loopkit._step._micro_batch import chunks


class OOMAbove(nn.Module):
    """Raises CUDA's out-of-memory error for batches over ``limit`` (none is caught on a CPU)."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > self.limit:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return x


def test_chunks_of_a_ragged_batch_and_their_shares() -> None:
    """128 in chunks of 48: 48, 48, 32 with shares 3/8, 3/8, 1/4; structure kept; tensors of
    another leading size (a per-batch value) pass through whole."""
    Pair = collections.namedtuple("Pair", "x y")
    batch = {"pair": Pair(torch.arange(128), torch.zeros(128, 2)), "scale": torch.ones(3)}
    parts = chunks(batch, 48)
    assert [share for _, share in parts] == [0.375, 0.375, 0.25]
    assert [len(c["pair"].x) for c, _ in parts] == [48, 48, 32]
    assert all(isinstance(c["pair"], Pair) and c["scale"].shape == (3,) for c, _ in parts)
    assert torch.equal(torch.cat([c["pair"].x for c, _ in parts]), torch.arange(128))
    assert chunks(batch, 128) == [(batch, 1.0)]


def _train(micro_batch: int | None, tmp: Path, updates: int | None = None,
           resume: bool = False) -> tuple[list[torch.Tensor], loopkit.step]:  # fmt: skip
    """2 epochs of batches of 16 (the last of 8), accumulate=2, AdamW."""
    torch.manual_seed(0)
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = loopkit.step(model, opt, accumulate=2, micro_batch=micro_batch)
    data = torch.utils.data.TensorDataset(torch.randn(56, 8), torch.randn(56, 1))
    loader = distributed.loader(data, batch_size=16, seed=0, num_workers=0)
    ckpt = loopkit.Checkpointer(tmp, model=model, optimizer=opt, step=step, loader=loader)
    stop = loopkit.until(step, max_epochs=2, max_updates=updates, checkpointer=ckpt)
    if resume:
        ckpt.resume()
    for _ in stop.epochs(loader):
        for x, y in step.iterate(loader):
            assert micro_batch is None or len(x) <= micro_batch
            with step as s:
                s.backward(nn.functional.mse_loss(model(x), y))
            if stop.check():
                break
    return params(model), step


@pytest.mark.parametrize("micro_batch", [6, 8, 5])
def test_micro_batches_make_the_whole_batches_update(micro_batch: int, tmp_path: Path) -> None:
    """Split into chunks of 6 (16 -> 6, 6, 4), 8 (even) or 5: the same updates, the same
    weights within 1e-6, the same samples seen."""
    whole, a = _train(None, tmp_path / "whole")
    split, b = _train(micro_batch, tmp_path / "split")
    assert a.updates == b.updates == 4 and a.seen.samples == b.seen.samples == 112
    for p, q in zip(whole, split, strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)


def test_a_resume_mid_training_with_micro_batches_is_bit_identical(tmp_path: Path) -> None:
    """Stopped after update 3 and resumed: the weights are the uninterrupted run's, bit for bit."""
    whole, _ = _train(6, tmp_path / "whole")
    _, stopped = _train(6, tmp_path / "parts", updates=3)
    assert stopped.updates == 3
    resumed, step = _train(6, tmp_path / "parts", resume=True)
    assert step.updates == 4
    assert all(torch.equal(p, q) for p, q in zip(whole, resumed, strict=True))


def _probe_setup(
    limit: int,
) -> tuple[nn.Module, torch.optim.Optimizer, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    model = nn.Sequential(OOMAbove(limit), nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = torch.randn(128, 8), torch.randn(128, 1)
    nn.functional.mse_loss(model(x[:1]), y[:1]).backward()
    opt.step()  # the optimizer has state (Adam's moments) that a trial must not change
    opt.zero_grad()
    return model, opt, (x, y)


def _loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return nn.functional.mse_loss(model(batch[0]), batch[1])


def test_probe_halves_to_the_largest_size_that_fits_and_takes_every_trial_back() -> None:
    """Out of memory above 40 samples: 128 -> 64 -> 32 fits; weights, Adam's state, the RNG
    are as before, bit for bit, and no gradient is left."""
    model, opt, batch = _probe_setup(40)
    step = loopkit.step(model, opt)  # a step owns the optimizer: the probe's step still runs
    with step as s:
        s.backward(_loss(model, (batch[0][:4], batch[1][:4])))
    before = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()),
              torch.get_rng_state())  # fmt: skip
    assert loopkit.probe_micro_batch(model, opt, _loss, batch) == 32
    assert all(torch.equal(v, before[0][k]) for k, v in model.state_dict().items())
    assert str(opt.state_dict()) == str(before[1])
    assert torch.equal(torch.get_rng_state(), before[2])
    assert all(p.grad is None for p in model.parameters())


@deep
def test_only_an_out_of_memory_error_means_too_big() -> None:
    """Any other exception propagates unchanged, the state taken back; nothing fitting raises."""
    model, opt, batch = _probe_setup(1000)
    weights = copy.deepcopy(model.state_dict())

    def broken(model: nn.Module, batch: object) -> torch.Tensor:
        raise KeyError("labels")

    with pytest.raises(KeyError, match="labels"):
        loopkit.probe_micro_batch(model, opt, broken, batch)
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())
    small, opt2, batch2 = _probe_setup(1)
    with pytest.raises(RuntimeError, match="no micro-batch of 4 or more samples fits"):
        loopkit.probe_micro_batch(small, opt2, _loss, batch2, smallest=4)


def test_bad_micro_batch_is_refused() -> None:
    """micro_batch= is an int >= 1."""
    model = mlp()
    with pytest.raises(ValueError, match="micro_batch= must be an int >= 1"):
        loopkit.step(model, torch.optim.SGD(model.parameters(), lr=0.1), micro_batch=0)


class SeqModel(nn.Module):
    """Averages over a sequence axis, then an MLP; out of memory when chunk x length > 100."""

    def __init__(self) -> None:
        super().__init__()
        self.net = mlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] * x.shape[1] > 100:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")
        return self.net(x.mean(1))


def _seq_data(lengths: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Batches of 16 sequences of the given lengths (8: a long batch)."""
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(16, n, 8, generator=g), torch.randn(16, 1, generator=g)) for n in lengths]


def _seq_train(micro_batch: int | None, lengths: list[int] | None = None,
               accumulate: int = 2) -> tuple[list[torch.Tensor], loopkit.step]:  # fmt: skip
    """AdamW on sequences of length 4, by default with a long batch (8) opening window 2."""
    torch.manual_seed(0)
    model = SeqModel()
    if micro_batch is None:
        model.forward = lambda x: model.net(x.mean(1))  # type: ignore[method-assign]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = loopkit.step(model, opt, accumulate=accumulate, micro_batch=micro_batch)
    for x, y in step.iterate(_seq_data(lengths or [4, 4, 8, 4, 4])):
        with step as s:
            s.backward(nn.functional.mse_loss(model(x), y))
    return params(model), step


def test_an_out_of_memory_error_in_training_redoes_the_window_in_smaller_chunks() -> None:
    """Chunks of 16 fit length 4 but not the long batch (16 x 8 > 100): its window is dropped
    and handed out again in chunks of 8; the updates equal the whole batches' within 1e-6."""
    whole, a = _seq_train(None)
    split, b = _seq_train(16)
    assert b.chunks.size == 8 and a.updates == b.updates == 3
    assert b.seen.samples == a.seen.samples == 80  # the redone window is counted once
    for p, q in zip(whole, split, strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)


class ExactLinear(nn.Module):
    """A linear map of the sequence mean with weights in {-1, 0, 1}; out of memory when chunk x
    length > ``area``. Trained on data in {-1, 0, 1} with a loss linear in the output, every
    gradient is a short dyadic sum that float32 holds exactly, in any order of addition."""

    def __init__(self, area: int | None = None) -> None:
        super().__init__()
        self.lin, self.area = nn.Linear(8, 1), area
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in self.lin.parameters():
                p.copy_(torch.randint(-1, 2, p.shape, generator=g).to(p.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.area is not None and x.shape[0] * x.shape[1] > self.area:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")
        return self.lin(x.mean(1))


def _exact_train(
    micro_batch: int | None,
    lengths: list[int],
    area: int | None = None,
    dtype: torch.dtype = torch.float32,
) -> tuple[list[torch.Tensor], loopkit.step]:
    """Batches of 16 sequences, accumulate=4 (a power of two: its 1/4 is exact), SGD lr 1/8."""
    model = ExactLinear(area).to(dtype)
    step = loopkit.step(model, torch.optim.SGD(model.parameters(), lr=0.125), accumulate=4,
                        micro_batch=micro_batch)  # fmt: skip
    g = torch.Generator().manual_seed(1)
    data = [(torch.randint(-1, 2, (16, n, 8), generator=g).to(dtype),
             torch.randint(-2, 3, (16, 1), generator=g).to(dtype)) for n in lengths]  # fmt: skip
    for x, y in step.iterate(data):
        with step as s:
            s.backward((model(x) * y).mean())
    return params(model), step


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(p.to(q.dtype), q) for p, q in zip(a, b, strict=True))


def test_a_power_of_two_split_is_bit_identical_where_float32_adds_exactly() -> None:
    """Even, power-of-two splits (16 -> 8+8, 4x4, 8x2, 16x1) leave the weights after 3 updates
    bit-identical to whole batches when every sum is exact (the float32 run equals a float64
    one): loopkit's shares and scaling add no rounding of their own. A chunk of 6 is not
    bit-identical (its mean divides by 6), which shows the check sees a single rounding. On
    general data the batch sum's association differs (~6e-8), as for any split of a matmul."""
    lengths = [1, 2] * 6
    whole, a = _exact_train(None, lengths)
    assert a.updates == 3 and _same(whole, _exact_train(None, lengths, dtype=torch.float64)[0])
    for chunk in (8, 4, 2, 1):
        assert _same(whole, _exact_train(chunk, lengths)[0]), chunk
    assert not _same(whole, _exact_train(6, lengths)[0])


@pytest.mark.parametrize("at", [0, 1, 3])
def test_an_out_of_memory_redo_at_the_first_middle_or_last_micro_step_is_exact(at: int) -> None:
    """The window's micro-step ``at`` (of 4) is a long batch that runs out of memory: the
    window is redone in chunks of 8, bit-identical to whole batches where float32 adds
    exactly, and within 1e-6 on general data (SeqModel, AdamW)."""
    lengths = [1] * 12
    lengths[4 + at] = 2
    whole, a = _exact_train(None, lengths)
    redone, b = _exact_train(16, lengths, area=16)
    assert b.chunks.size == 8 and a.updates == b.updates == 3
    assert a.seen.samples == b.seen.samples == 192
    assert _same(whole, _exact_train(None, lengths, dtype=torch.float64)[0])
    assert _same(whole, redone)
    seq = [4] * 12
    seq[4 + at] = 8
    general, _ = _seq_train(None, seq, accumulate=4)
    split, c = _seq_train(16, seq, accumulate=4)
    assert c.chunks.size == 8
    for p, q in zip(general, split, strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)


def test_out_of_memory_at_one_sample_or_outside_iterate_stands(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Nothing smaller than 1 sample to try, a plain loop, or DDP: the error is raised (under
    DDP with why it cannot be redone on one rank)."""
    model = SeqModel()
    step = loopkit.step(model, torch.optim.SGD(model.parameters(), lr=0.1), micro_batch=1)
    with pytest.raises(torch.OutOfMemoryError):
        for x in step.iterate([torch.randn(1, 200, 8)]):
            with step as s:
                s.backward(model(x).sum())
    plain = loopkit.step(model, torch.optim.SGD(model.parameters(), lr=0.1), micro_batch=8)
    with pytest.raises(torch.OutOfMemoryError), plain as s:
        s.backward(model(torch.randn(16, 8, 8)).sum())
    from loopkit import _ranks

    monkeypatch.setattr(_ranks, "is_multi_rank", lambda group=None: True)
    ddp = loopkit.step(model, torch.optim.SGD(model.parameters(), lr=0.1), micro_batch=16)
    with pytest.raises(RuntimeError, match="under DDP"):
        for x in ddp.iterate([torch.randn(16, 8, 8)]):
            with ddp as s:
                s.backward(model(x).sum())


def test_a_checkpoint_keeps_a_chunk_size_halved_by_an_out_of_memory_redo() -> None:
    """The resumed step splits as the saved one had come to (never larger than it is built)."""
    _, trained = _seq_train(16)
    state = trained.state_dict()
    assert state["micro_batch"] == 8
    other = SeqModel()
    fresh = loopkit.step(other, torch.optim.SGD(other.parameters(), lr=0.1))
    model = SeqModel()
    resumed = loopkit.step(model, torch.optim.AdamW(model.parameters()), accumulate=2,
                           micro_batch=16)  # fmt: skip
    resumed.load_state_dict(state)
    assert resumed.chunks.size == 8 and fresh.chunks.size is None


def _pair(micro_batch: int | None) -> list[torch.Tensor]:
    """Two independent members (actor-critic style, no frozen=) over ragged batches."""
    torch.manual_seed(0)
    a, b = nn.Linear(4, 1), nn.Linear(3, 1)
    a_step = loopkit.step(a, torch.optim.AdamW(a.parameters(), lr=1e-2), accumulate=2,
                          micro_batch=micro_batch)  # fmt: skip
    b_step = loopkit.step(b, torch.optim.AdamW(b.parameters(), lr=1e-2), accumulate=2,
                          micro_batch=micro_batch)  # fmt: skip
    group = loopkit.steps(a_step, b_step)
    gen = torch.Generator().manual_seed(1)
    data = [(torch.randn(n, 4, generator=gen), torch.randn(n, 3, generator=gen))
            for n in (8, 8, 5, 8, 3)]  # fmt: skip
    for x, z in group.iterate(data):
        assert micro_batch is None or len(x) <= micro_batch
        with a_step as s:
            s.backward(a(x).pow(2).mean())
        with b_step as s:
            s.backward((b(z) - 1).pow(2).mean())
    assert group.updates == 3
    return [p.detach().clone() for p in (*a.parameters(), *b.parameters())]


def test_a_group_in_micro_batches_trains_as_on_whole_batches() -> None:
    """Two members in chunks of 3 (8 -> 3, 3, 2): the whole batches' weights within 1e-6."""
    for p, q in zip(_pair(None), _pair(3), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)


def _gan(d_chunk: int | None, g_chunk: int | None, split: bool = True) -> list[torch.Tensor]:
    """A critic and a generator trained through it (frozen=), accumulate=2, ragged batches;
    each member splits the batch itself (step.split) when it has a micro_batch."""
    torch.manual_seed(0)
    d, g = nn.Linear(4, 1), nn.Linear(3, 4)
    d_step = loopkit.step(d, torch.optim.AdamW(d.parameters(), lr=1e-2), accumulate=2,
                          micro_batch=d_chunk)  # fmt: skip
    g_step = loopkit.step(g, torch.optim.AdamW(g.parameters(), lr=1e-2), accumulate=2,
                          micro_batch=g_chunk, frozen=[d])  # fmt: skip
    group = loopkit.steps(d_step, g_step)
    gen = torch.Generator().manual_seed(1)
    data = [(torch.randn(n, 4, generator=gen), torch.randn(n, 3, generator=gen))
            for n in (8, 8, 5, 8, 3)]  # fmt: skip
    for batch in group.iterate(data):
        for real, z in d_step.split(batch) if split else [batch]:
            assert d_chunk is None or len(real) <= d_chunk
            with d_step as s:
                s.backward(d(g(z).detach()).mean() - d(real).mean())
        for _, z in g_step.split(batch) if split else [batch]:
            with g_step as s:
                s.backward(-d(g(z)).mean())
    assert group.updates == 3 and d_step.updates == g_step.updates == 3
    return [p.detach().clone() for p in (*d.parameters(), *g.parameters())]


def test_a_gan_in_micro_batches_trains_as_on_whole_batches() -> None:
    """frozen=[critic]: each member splits the batch itself, all of the critic's chunks (and
    its update) before the generator's, so the weights equal the whole batches' within 1e-6;
    the members may split differently (3 and 2, or one not at all)."""
    whole = _gan(None, None, split=False)
    for sizes in ((3, 3), (3, 2), (None, 2), (4, None)):
        for p, q in zip(whole, _gan(*sizes), strict=True):
            torch.testing.assert_close(p, q, rtol=0, atol=1e-6)


def test_a_gan_member_entered_on_the_whole_batch_is_refused() -> None:
    """micro_batch= beside frozen=: entering any member without step.split raises before the
    micro-step opens, and split is refused outside such a group."""
    d, g = nn.Linear(4, 1), nn.Linear(3, 4)
    d_step = loopkit.step(d, torch.optim.SGD(d.parameters(), lr=0.1), micro_batch=2)
    g_step = loopkit.step(g, torch.optim.SGD(g.parameters(), lr=0.1), micro_batch=2, frozen=[d])
    group = loopkit.steps(d_step, g_step)
    for _ in group.iterate([torch.zeros(4, 4)]):
        for member in (d_step, g_step):
            with pytest.raises(RuntimeError, match=r"step\.split"), member:
                pass
            assert member.micro_step == 0
    alone = loopkit.step(d, torch.optim.SGD(d.parameters(), lr=0.1), micro_batch=2)
    with pytest.raises(RuntimeError, match="splits its batches itself"):
        next(iter(alone.split(torch.zeros(4, 4))))


def test_group_members_must_split_alike() -> None:
    """One clock: members with different micro_batch= are refused."""
    d, g = mlp(), mlp(seed=1)
    members = (
        loopkit.step(d, torch.optim.SGD(d.parameters(), lr=0.1), micro_batch=4),
        loopkit.step(g, torch.optim.SGD(g.parameters(), lr=0.1)),
    )
    with pytest.raises(ValueError, match="split batches differently"):
        loopkit.steps(*members)


# -- what a batch holds: the samples are cut wherever the batch lays them out -----------------


@dataclasses.dataclass
class _Batch:
    x: torch.Tensor
    names: list[str]
    scale: float = 1.0


class _Pair(NamedTuple):
    x: torch.Tensor
    y: torch.Tensor


def _items(n: int, g: torch.Generator) -> list[dict[str, Any]]:
    """``n`` samples: features, a target, a name, an id, a sequence and a detection target."""
    out = []
    for i in range(n):
        k = 1 + (3 * i) % 7  # varied lengths, some equal to a chunk's size by chance
        box = torch.randn(k % 3 + 1, 4, generator=g)
        out.append({"x": torch.randn(4, generator=g), "y": torch.randn(1, generator=g),
                    "name": f"img_{i}", "id": i, "seq": torch.randn(k, generator=g),
                    "target": {"box": box, "label": i}, "fixed": torch.randn(11, generator=g),
                    "img": torch.randn(3, 4 + k, 5 + k, generator=g),
                    "tokens": list(range(k))})  # fmt: skip
    return out


def _stack(items: list[dict[str, Any]], key: str) -> torch.Tensor:
    return torch.stack([it[key] for it in items])


# Each layout collates a list of samples into a batch, as a loader's collate_fn would.
LAYOUTS: dict[str, Callable[[list[dict[str, Any]]], Any]] = {
    "tuple": lambda s: (_stack(s, "x"), _stack(s, "y")),
    "list": lambda s: [_stack(s, "x"), _stack(s, "y")],
    "dict + names + scalars": lambda s: {
        "x": _stack(s, "x"), "y": _stack(s, "y"), "names": [it["name"] for it in s], "t": 0.5,
        "one": torch.tensor(2.0),
    },
    "names first": lambda s: ([it["name"] for it in s], _stack(s, "x"), _stack(s, "y")),
    "nested": lambda s: ((_stack(s, "x"), [_stack(s, "y"), [it["name"] for it in s]]),
                         {"ids": [it["id"] for it in s]}),
    "sequences + targets": lambda s: ([it["seq"] for it in s], _stack(s, "y")),
    "dicts per sample": lambda s: (_stack(s, "x"), [it["target"] for it in s], _stack(s, "y")),
    "namedtuple": lambda s: _Pair(_stack(s, "x"), _stack(s, "y")),
    "dataclass": lambda s: (_Batch(_stack(s, "x"), [it["name"] for it in s], 2.0),
                            _stack(s, "y")),
    # torchvision's detection collate: tuple(zip(*batch)), images of other sizes
    "detection": lambda s: (tuple(it["img"] for it in s), tuple(it["target"] for it in s)),
    "same-length sequences and names": lambda s: ([it["fixed"] for it in s],
                                                  [it["name"] for it in s]),
    "token id lists": lambda s: {"ids": [it["tokens"] for it in s], "y": _stack(s, "y")},
    # default_collate of samples holding a list of two dicts: a list of two collated dicts
    "collated list of dicts": lambda s: {
        "x": _stack(s, "x"),
        "objs": [{"a": torch.tensor([it["id"] for it in s])},
                 {"a": torch.tensor([-it["id"] for it in s])}],
    },
    "defaultdict": lambda s: collections.defaultdict(list, {"x": _stack(s, "x"),
                                                            "y": _stack(s, "y")}),
}  # fmt: skip


def _same_batch(u: Any, v: Any) -> bool:
    if isinstance(u, torch.Tensor):
        return isinstance(v, torch.Tensor) and torch.equal(u, v)
    if isinstance(u, dict):
        return (
            isinstance(v, dict) and u.keys() == v.keys() and all(_same_batch(u[k], v[k]) for k in u)
        )
    if dataclasses.is_dataclass(u) and not isinstance(u, type):
        return type(u) is type(v) and _same_batch(
            [getattr(u, f.name) for f in dataclasses.fields(u)],
            [getattr(v, f.name) for f in dataclasses.fields(u)],
        )
    if isinstance(u, (list, tuple)):
        return (type(u) is type(v) and len(u) == len(v)
                and all(_same_batch(p, q) for p, q in zip(u, v, strict=True)))  # fmt: skip
    return bool(u == v)


@pytest.mark.parametrize("n,micro", [(8, 3), (7, 2), (6, 6), (5, 1), (2, 1)])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_chunks_cut_every_layout_by_its_samples(layout: str, n: int, micro: int) -> None:
    """A batch's chunks are the batches its samples' slices would collate to (per-sample lists
    of names, sequences or dicts cut with the tensors; scalars whole); the shares are exact."""
    collate = LAYOUTS[layout]
    items = _items(n, torch.Generator().manual_seed(n))
    batch = collate(items)
    parts = micro_batch.chunks(batch, micro)
    assert micro_batch.leading_size(batch) == n
    starts = range(0, n, micro) if micro < n else [0]
    want = [collate(items[a : a + micro]) if micro < n else batch for a in starts]
    assert len(parts) == len(want)
    assert all(_same_batch(p, w) for (p, _), w in zip(parts, want, strict=True))
    assert [share for _, share in parts] == [len(items[a : a + micro]) / n for a in starts]


def test_a_batch_whose_parts_disagree_is_read_by_the_loaders_batch_size_or_refused() -> None:
    """A batch whose parts agree equally on two sizes (ids [B, T] and labels beside a mask
    [T, T] and position ids [T]): the loader's batch_size decides, and the ragged last
    batch is cut alike; without a loader's batch size it is refused, naming the parts."""
    t = 6

    def batch(n: int) -> dict[str, torch.Tensor]:
        return {"ids": torch.arange(n * t).reshape(n, t), "labels": torch.ones(n, t),
                "mask": torch.ones(t, t), "pos": torch.arange(t)}  # fmt: skip

    state = micro_batch.Chunks(2)
    parts = chunks(batch(4), 2, state, hint=4)
    assert [len(p["ids"]) for p, _ in parts] == [2, 2]
    assert all(p["mask"].shape == (t, t) and p["pos"].shape == (t,) for p, _ in parts)
    last = chunks(batch(3), 2, state, hint=4)  # 3 samples: the parts cut before decide
    assert [len(p["ids"]) for p, _ in last] == [2, 1]
    with pytest.raises(ValueError, match=r"micro_batch= cannot tell.*'ids'"):
        chunks(batch(4), 2)


def test_a_batch_whose_samples_cannot_be_counted_is_refused() -> None:
    """micro_batch= on a batch of an unknown type (no tensors, no per-sample list) says so."""
    model = mlp()
    step = loopkit.step(model, torch.optim.SGD(model.parameters(), lr=0.1), micro_batch=2)
    with pytest.raises(ValueError, match="cannot tell how many samples a batch of object"):
        for _ in step.iterate([object()]):
            pass
    assert step.updates == 0 and step.micro_step == 0


def test_sequences_in_a_list_train_as_the_whole_batch() -> None:
    """A list of variable-length sequences with targets: micro-batches give the whole batch's
    float64 update (r3_03's layout, other lengths and chunks)."""
    torch.manual_seed(0)
    seqs = [torch.randn(n, dtype=torch.double) for n in (6, 2, 6, 9, 1, 6, 3)]
    y = torch.randn(7, dtype=torch.double)

    def loss(m: nn.Module, s_list: list[torch.Tensor], t: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(torch.stack([m(q[:, None]).mean() for q in s_list]), t)

    results = []
    for chunk in (None, 3, 2):
        torch.manual_seed(1)
        model = nn.Linear(1, 1).double()
        step = loopkit.step(model, torch.optim.SGD(model.parameters(), lr=0.1), micro_batch=chunk)
        for s_list, t in step.iterate([(seqs, y)]):
            with step as s:
                s.backward(loss(model, s_list, t))
        results.append(params(model))
    for other in results[1:]:
        torch.testing.assert_close(other, results[0], rtol=0, atol=1e-12)


class _NormNet(nn.Module):
    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 6), norm, nn.Tanh(), nn.Linear(6, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)  # type: ignore[no-any-return]


@pytest.mark.parametrize("norm", ["BatchNorm1d", "BatchNorm1d without running stats"])
def test_batch_statistics_in_training_are_refused_before_a_chunk_runs(norm: str) -> None:
    """A BatchNorm layer that normalizes by the batch (training mode, or no running statistics)
    refuses a batch that would be cut, before its first chunk: nothing trained, nothing moved."""
    layer = nn.BatchNorm1d(6, track_running_stats=norm == "BatchNorm1d")
    model = _NormNet(layer)
    if norm != "BatchNorm1d":
        model.eval()  # no running statistics: still the batch's
    step = loopkit.step(model, torch.optim.SGD(model.parameters(), lr=0.1), micro_batch=4)
    before = params(model)
    with pytest.raises(RuntimeError, match=r"BatchNorm layers \('body.1'\).*accumulate="):
        for x, y in step.iterate(batches([8, 8])):
            with step as s:
                s.backward(nn.functional.mse_loss(model(x), y))
    assert step.updates == 0 and _same(before, params(model))


def test_batch_statistics_that_are_not_cut_are_fine() -> None:
    """Frozen BatchNorm (eval mode with running statistics), GroupNorm, or batches that fit in
    one chunk: micro_batch= trains as the whole batch."""
    for model, sizes in (
        (_NormNet(nn.BatchNorm1d(6)).eval(), [8, 8]),
        (_NormNet(nn.GroupNorm(2, 6)), [8, 8]),
        (_NormNet(nn.BatchNorm1d(6)), [4, 3]),
    ):
        whole, parts = copy.deepcopy(model), model
        for m, chunk in ((whole, None), (parts, 4)):
            step = loopkit.step(m, torch.optim.SGD(m.parameters(), lr=0.1), micro_batch=chunk)
            for x, y in step.iterate(batches(sizes)):
                with step as s:
                    s.backward(nn.functional.mse_loss(m(x), y))
        torch.testing.assert_close(params(parts), params(whole), rtol=0, atol=1e-6)


def test_a_group_refuses_batch_statistics_too() -> None:
    """A loopkit.steps group cutting batches checks every member's BatchNorm layers."""
    net, head = _NormNet(nn.BatchNorm1d(6)), mlp()
    group = loopkit.steps(
        loopkit.step(head, torch.optim.SGD(head.parameters(), lr=0.1), micro_batch=4),
        loopkit.step(net, torch.optim.SGD(net.parameters(), lr=0.1), micro_batch=4),
    )
    with pytest.raises(RuntimeError, match="BatchNorm"):
        for x, y in group.iterate(batches([8])):
            for m, s in zip((head, net), group.members, strict=True):
                with s as st:
                    st.backward(nn.functional.mse_loss(m(x), y))


# -- what is logged: whole batches, once each --------------------------------------------


def _logged(micro: int | None, sizes: list[int], accumulate: int, area: int | None = None
            ) -> tuple[list[dict[str, float]], loopkit.step]:  # fmt: skip
    rows: list[dict[str, float]] = []
    model = ExactLinear(area)
    log = loopkit.detach_logging(every=1, sink=rows.append)
    step = loopkit.step(model, torch.optim.SGD(model.parameters(), lr=0.125),
                        accumulate=accumulate, micro_batch=micro, log=log)  # fmt: skip
    g = torch.Generator().manual_seed(1)
    data = [(torch.randint(-1, 2, (n, 4 if n != 6 else 12, 8), generator=g).float(),
             torch.randint(-2, 3, (n, 1), generator=g).float()) for n in sizes]  # fmt: skip
    for x, y in step.iterate(data):
        with step as s:
            out = (model(x) * y).mean()
            s.log_metrics(acc=(model(x) > 0).float().mean())
            s.backward(out)
    return rows, step


@pytest.mark.parametrize("accumulate", [1, 3])
def test_the_log_counts_and_averages_whole_batches(accumulate: int) -> None:
    """Under micro_batch= one record per batch, each metric the batch's mean (chunks weighted
    by their share): the whole-batch loop's log, within float rounding."""
    sizes = [16, 10, 16, 7, 16]
    whole, _ = _logged(None, sizes, accumulate)
    parts, step = _logged(4, sizes, accumulate)
    assert len(parts) == len(whole) == 5 and step.updates == -(-5 // accumulate)
    for a, b in zip(whole, parts, strict=True):
        assert a.keys() == b.keys()
        for k in a:
            assert b[k] == pytest.approx(a[k], rel=1e-6, abs=1e-7)


def test_a_redone_window_logs_each_batch_once() -> None:
    """An out-of-memory error in a window's last batch redoes the window in halved chunks:
    its earlier batches are not logged twice, and the log equals the whole batches'."""
    sizes = [16, 16, 6, 16]  # the batch of 6 has length 12: 6 x 12 > 64 runs out of memory
    whole, _ = _logged(None, sizes, 3)
    redone, step = _logged(8, sizes, 3, area=64)
    assert step.chunks.size == 4
    assert len(redone) == len(whole) == 4
    for a, b in zip(whole, redone, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6, abs=1e-7)


class _Refused(Exception):
    """A user's own error, raised inside a micro-batched step."""


@pytest.mark.parametrize("error", [_Refused("bad sample"), RuntimeError("a user's check")])
def test_a_users_error_in_a_micro_batched_step_comes_out_unchanged(
    error: Exception, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Any exception other than out of memory leaves a micro-batched step as it came in, even
    where accelerate cannot be imported."""
    real = importlib.import_module

    def no_accelerate(name: str, *args: Any) -> Any:
        if name.startswith("accelerate"):
            raise ModuleNotFoundError("No module named 'accelerate'")
        return real(name, *args)

    monkeypatch.setattr(importlib, "import_module", no_accelerate)
    model = mlp()
    step = loopkit.step(model, torch.optim.SGD(model.parameters(), lr=0.1), micro_batch=2)
    with pytest.raises(type(error)) as caught:
        for x, y in step.iterate(batches([4])):
            with step as s:
                s.backward(nn.functional.mse_loss(model(x), y))
                raise error
    assert caught.value is error


def test_batch_statistics_are_checked_in_the_mode_the_chunks_run_in() -> None:
    """The mode counts as each chunk's micro-step opens: model.train() at the top of the loop
    body (eval() before it) is refused; BatchNorm frozen (eval) in the body trains as the whole
    batch; a critic's BatchNorm reached through frozen= is checked too."""

    def run(micro: int | None, pre: Any, body: Any) -> list[torch.Tensor] | str:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 6), nn.BatchNorm1d(6), nn.Linear(6, 1))
        step = loopkit.step(model, torch.optim.SGD(model.parameters(), lr=0.1), micro_batch=micro)
        pre(model)
        try:
            for x, y in step.iterate(batches([8, 8])):
                body(model)
                with step as s:
                    s.backward(nn.functional.mse_loss(model(x), y))
                model.eval()  # an evaluation after each batch
        except RuntimeError as err:
            return str(err)
        return params(model)

    def freeze(model: nn.Module) -> None:
        model.train()
        model[1].eval()

    refused = run(4, lambda m: m.eval(), lambda m: m.train())
    assert isinstance(refused, str) and "BatchNorm" in refused
    frozen = run(4, lambda m: m.train(), freeze)
    assert not isinstance(frozen, str)
    whole = run(None, lambda m: m.train(), freeze)
    torch.testing.assert_close(frozen, whole, rtol=0, atol=1e-6)
    critic = nn.Sequential(nn.Linear(1, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))
    gen = nn.Linear(8, 1)
    g_step = loopkit.step(gen, torch.optim.SGD(gen.parameters(), lr=0.1), micro_batch=4,
                          frozen=[critic])  # fmt: skip
    d_step = loopkit.step(critic, torch.optim.SGD(critic.parameters(), lr=0.1), micro_batch=4)
    with pytest.raises(RuntimeError, match=r"frozen\[0\]\.1"):
        for x, _ in loopkit.steps(d_step, g_step).iterate(batches([8])):
            for part in g_step.split(x):
                with g_step as s:
                    s.backward(critic(gen(part)).mean())


def test_a_batchs_record_is_what_the_whole_batch_would_log() -> None:
    """The chunks' records combine by each metric's reduction (pure): a weighted mean (shares
    or weight=), a sum, a max, a min, the last; a constant float comes out exactly itself."""
    how = {"loss": "mean", "correct": "sum", "worst": "max", "best": "min", "seen": "last"}.get
    parts: list[tuple[Any, dict[str, Any]]] = [
        (0.75, {"loss": torch.tensor(2.0), "correct": torch.tensor(3.0),
                "worst": torch.tensor(5.0), "best": 1.0, "seen": 7.0, "lr": 0.0007}),
        (0.25, {"loss": torch.tensor(6.0), "correct": torch.tensor(1.0),
                "worst": torch.tensor(4.0), "best": 0.5, "seen": 8.0, "lr": 0.0007}),
    ]  # fmt: skip
    out = micro_batch.combined(parts, lambda n: how(n, "mean"))
    assert float(out["loss"]) == 3.0 and float(out["correct"]) == 4.0
    assert float(out["worst"]) == 5.0 and out["best"] == 0.5 and out["seen"] == 8.0
    assert out["lr"] == 0.0007
    tokens = [(torch.tensor(10.0), {"loss": torch.tensor(1.0)}),
              (torch.tensor(30.0), {"loss": torch.tensor(3.0)})]  # fmt: skip
    assert float(micro_batch.combined(tokens, lambda n: "mean")["loss"]) == 2.5


@pytest.mark.parametrize("weighted", [False, True])
def test_the_log_of_sums_maxima_and_token_means_is_the_whole_batchs(weighted: bool) -> None:
    """A log with reduce= sum/max and a loss weighted by tokens (weight=): the same values
    as the whole-batch loop's log."""

    def run(chunk: int | None) -> list[dict[str, float]]:
        torch.manual_seed(0)
        emb = nn.Embedding(10, 10)
        rows: list[dict[str, float]] = []
        log = loopkit.detach_logging(every=1, sink=rows.append,
                                     reduce={"correct": "sum", "worst": "max"})  # fmt: skip
        step = loopkit.step(emb, torch.optim.SGD(emb.parameters(), lr=0.1), micro_batch=chunk,
                            log=log)  # fmt: skip
        g = torch.Generator().manual_seed(1)
        lengths = torch.tensor([6, 6, 2, 1, 5, 3, 6, 4])
        ids = torch.randint(0, 10, (8, 6), generator=g)
        mask = torch.arange(6)[None, :] < lengths[:, None]
        for x, m in step.iterate([(ids, mask), (ids.flip(0), mask.flip(0))]):
            with step as s:
                per = nn.functional.cross_entropy(emb(x).reshape(-1, 10), x.reshape(-1),
                                                  reduction="none").reshape(x.shape)  # fmt: skip
                tokens = m.sum()
                loss = (per * m).sum() / tokens if weighted else per.mean()
                s.log_metrics(correct=(emb(x).argmax(-1) == x).sum().float(),
                              worst=per.max())  # fmt: skip
                s.backward(loss, weight=tokens if weighted else None)
        return rows

    whole, chunked = run(None), run(3)
    assert len(whole) == len(chunked) == 2
    for a, b in zip(whole, chunked, strict=True):
        assert b == pytest.approx(a, rel=1e-5)


@pytest.mark.parametrize("n", [1, 5, 32])
def test_a_one_tensor_dataset_batch_counts_and_splits_by_its_rows(n: int) -> None:
    """``TensorDataset(x)`` batches come as ``[x]``: counted as ``len(x)`` samples, not one,
    and ``micro_batch=`` cuts ``x`` into chunks whose update is the whole batch's."""
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(3 * n, 8))
    loader = torch.utils.data.DataLoader(data, batch_size=n)
    ref, model = mlp(), mlp()
    model.load_state_dict(ref.state_dict())
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for (x,) in loader:
        (ref(x).pow(2).mean() / 3).backward()
    ref_opt.step()
    step = loopkit.step(model, torch.optim.SGD(model.parameters(), lr=0.1), accumulate=3,
                        micro_batch=max(1, n // 2))  # fmt: skip
    for (x,) in step.iterate(loader):
        with step as s:
            s.backward(model(x).pow(2).mean())
    assert step.seen.samples == 3 * n and step.updates == 1
    for a, b in zip(ref.parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(a, b)


def test_the_quick_count_agrees_with_the_full_reading() -> None:
    """``quick_size`` (iterate's per-batch count) is the size ``read`` finds, on every layout
    it answers for, and declines the rest."""
    from loopkit._step import _batch_layout

    def t(*shape: int) -> torch.Tensor:
        return torch.zeros(*shape)

    answered = [
        t(5, 3), [t(32, 3)], (t(1, 3),), [t(7, 2), t(7)], (t(2, 5), t(2, 5)), [t(3, 1)] * 3,
        {"x": t(4, 2), "y": t(4)}, {"only": t(9, 9, 9)}, (t(6), t(6, 2), t(6, 3, 3)),
    ]  # fmt: skip
    for batch in answered:
        layout = _batch_layout.read(batch)
        assert layout is not None and _batch_layout.quick_size(batch) == layout.size, batch
    declined = [t(()), [t(5), t(6)], [], {"x": t(3), "n": 3}, ["a", "b"], ((t(2), t(2)),)]
    for batch in declined:
        assert _batch_layout.quick_size(batch) is None, batch


@settings(max_examples=60, deadline=None)
@given(
    size=st.integers(1, 9),
    container=st.sampled_from(["tensor", "tuple", "list", "dict"]),
    trailing=st.lists(st.lists(st.integers(1, 3), max_size=2), min_size=1, max_size=4),
    odd=st.booleans(),
)
def test_the_quick_count_agrees_with_the_full_reading_on_generated_batches(
    size: int, container: str, trailing: list[list[int]], odd: bool
) -> None:
    """Generated batches of tensors (any container, any trailing shapes, one part maybe of
    another first dimension): where ``quick_size`` answers it is ``read``'s size, and it
    answers every batch whose parts share their first dimension."""
    from loopkit._step import _batch_layout

    parts = [torch.zeros(size, *shape) for shape in trailing]
    if odd:
        parts[-1] = torch.zeros(size + 1, *trailing[-1])
    batch: object = {
        "tensor": parts[0], "tuple": tuple(parts), "list": parts,
        "dict": {f"k{i}": p for i, p in enumerate(parts)},
    }[container]  # fmt: skip
    quick = _batch_layout.quick_size(batch)
    shared = container == "tensor" or not odd or len(parts) == 1
    assert (quick is not None) == shared
    if quick is not None:
        layout = _batch_layout.read(batch)
        assert layout is not None and quick == layout.size == int(parts[0].shape[0])
