"""distributed.loader and its EpochLoader, single-process: seeds, refusals, resumable state."""

from __future__ import annotations

import gc
import random
import re
import time
from typing import Any

import numpy as np
import pytest
import torch
from helpers import StreamWithLen
from torch import nn

import loopkit
from loopkit import distributed


def _data(n: int = 20) -> torch.utils.data.TensorDataset:
    return torch.utils.data.TensorDataset(torch.arange(n))


def _order(loader: distributed.EpochLoader) -> list[int]:
    """One training pass (a pass that counts from its start, as a step's iterate runs it)."""
    return [int(i) for (batch,) in loader.training_pass() for i in batch]


def _internal(loader: distributed.EpochLoader) -> tuple[Any, ...]:
    generator = loader.loader.generator
    assert generator is not None
    return (
        loader.epoch,
        loader.position,
        loader._progress.resume_at,
        loader._progress.pass_epoch,
        generator.get_state(),
    )


def _same(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    return all(
        torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
        for x, y in zip(a, b, strict=True)
    )


@pytest.mark.parametrize(
    ("bad", "hint"),
    [
        ({"generator": torch.zeros(3, dtype=torch.uint8)}, "'generator' is not a valid state"),
        ({"generator": [1, 2]}, "'generator' must be a uint8 tensor"),
        ({"position": -1}, "'position' must be an int >= 0"),
        ({"position": 99}, "past the end of a pass of 5 batches"),
        ({"dataset_length": 21}, "the data set has 20 samples but the state was saved with 21"),
        ({"batch_size": 8}, "batch size is 4 but the state was saved with 8"),
        ({"epoch": None}, "'epoch' must be an int >= 0"),
    ],
    ids=["generator_size", "generator_type", "negative", "past_end", "length", "batch", "epoch"],
)
def test_a_refused_loader_state_changes_nothing(bad: dict[str, Any], hint: str) -> None:
    """load_state_dict checks everything first: a bad state raises and leaves epoch, position."""
    source = distributed.loader(_data(), batch_size=4, num_workers=0, seed=1)
    _order(source)
    it = source.training_pass()
    next(it)
    state = {**source.state_dict(), **bad}
    loader = distributed.loader(_data(), batch_size=4, num_workers=0, seed=1)
    _order(loader)  # one pass done: its state is not a fresh one
    before = _internal(loader)
    with pytest.raises(ValueError, match=re.escape(hint)):
        loader.load_state_dict(state)
    assert _same(before, _internal(loader))


def test_seed_takes_any_64_bit_integer_numpy_included() -> None:
    """numpy ints give the int's order; the int64 range works; a seed's old stream is kept."""
    orders = {}
    for seed in (5, np.int64(5), np.uint8(5), np.int32(5)):
        loader = distributed.loader(_data(), batch_size=4, num_workers=0, seed=seed)
        orders[repr(seed)] = [_order(loader), _order(loader)]
    assert len({str(o) for o in orders.values()}) == 1
    loader = distributed.loader(_data(), batch_size=4, num_workers=0, seed=5)
    assert loader.loader.generator is not None
    assert loader.loader.generator.initial_seed() == 5000  # seed * 1000 + rank, as before
    for seed in (-(2**63), 2**63 - 1, np.int64(-1)):
        loader = distributed.loader(_data(), batch_size=4, num_workers=0, seed=seed)
        first, second = _order(loader), _order(loader)
        assert sorted(first) == sorted(second) == list(range(20))


@pytest.mark.parametrize(
    ("seed", "exc"),
    [(None, TypeError), (1.5, TypeError), (True, TypeError), ("1", TypeError),
     (2**63, ValueError), (-(2**63) - 1, ValueError), (np.uint64(2**63), ValueError)],
)  # fmt: skip
def test_a_bad_seed_is_named_with_its_range(seed: Any, exc: type[Exception]) -> None:
    """None, floats, bools, strings, out-of-range ints: an error naming seed and its range."""
    with pytest.raises(exc, match=r"seed must be .*\[-2\*\*63, 2\*\*63 - 1\]"):
        distributed.loader(_data(), batch_size=4, num_workers=0, seed=seed)


def test_an_iterable_dataset_with_len_is_refused_clearly() -> None:
    """An IterableDataset with __len__: loader() refuses it, not DataLoader's sampler check."""
    with pytest.raises(TypeError, match=r"map-style dataset .* an IterableDataset has not"):
        distributed.loader(StreamWithLen(), batch_size=4, num_workers=0)


def _passes(loader: distributed.EpochLoader, n: int) -> list[int]:
    return [i for _ in range(n) for i in _order(loader)]


@pytest.mark.parametrize("taken", [2, 5], ids=["mid_pass", "pass_finished"])
def test_a_loaded_state_continues_the_same_batches_and_round_trips(taken: int) -> None:
    """Loaded mid-pass or after a pass: the same batches follow; a re-saved state does too."""
    source = distributed.loader(_data(), batch_size=4, num_workers=0, seed=3)
    _order(source)  # epoch 0
    it = source.training_pass()
    for _ in range(taken):  # 5 batches: the pass of epoch 1 is over, epoch 2 comes next
        next(it)
    state = source.state_dict()
    rest = [int(i) for (batch,) in it for i in batch] + _order(source)  # ... and epoch 2
    passes = 2 if taken == 2 else 1
    loader = distributed.loader(_data(), batch_size=4, num_workers=0, seed=3)
    loader.load_state_dict(state)
    again = loader.state_dict()  # taken before the next pass starts (a save right after resume)
    assert _passes(loader, passes) == rest
    fresh = distributed.loader(_data(), batch_size=4, num_workers=0, seed=3)
    fresh.load_state_dict(again)
    assert _passes(fresh, passes) == rest
    for done in (loader, fresh):  # the generator (workers' seeds) followed the same draws
        assert done.epoch == source.epoch == 3
        assert done.loader.generator is not None and source.loader.generator is not None
        assert torch.equal(done.loader.generator.get_state(), source.loader.generator.get_state())


# -- data randomness as a pure function of (seed, epoch, rank, batch index) (issue 12) -----


class Augmenting(torch.utils.data.Dataset[torch.Tensor]):
    """Draws from python's, numpy's and torch's global RNGs in __getitem__, as pipelines do."""

    def __len__(self) -> int:
        return 30

    def __getitem__(self, i: int) -> torch.Tensor:
        flip = random.random()
        noise = float(np.random.normal())
        return torch.stack([torch.tensor(float(i)), torch.tensor(flip), torch.tensor(noise),
                            torch.rand(())])  # fmt: skip


def _noisy_collate(items: list[torch.Tensor]) -> torch.Tensor:
    """A collate_fn that draws too (MixUp-like): it runs under the batch's key as well."""
    return torch.stack(items) + torch.rand(len(items), 1)


def _stream(num_workers: int, epochs: int = 2, **kw: Any) -> list[torch.Tensor]:
    loader = distributed.loader(Augmenting(), batch_size=4, num_workers=num_workers, seed=9,
                                collate_fn=_noisy_collate, **kw)  # fmt: skip
    return [batch for _ in range(epochs) for batch in loader.training_pass()]


def _acc(every: int) -> loopkit.accumulate:
    model = nn.Linear(1, 1)
    return loopkit.accumulate(model, torch.optim.SGD(model.parameters(), lr=0.1), every)


def _rng_states() -> tuple[Any, ...]:
    return random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state()


def _same_rng(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    return a[0] == b[0] and bool((a[1] == b[1]).all()) and torch.equal(a[2], b[2])


@pytest.mark.parametrize(
    ("workers", "persistent"), [(1, True), (2, True), (2, False)], ids=["1", "2", "2-fresh"]
)
def test_augmented_batches_do_not_depend_on_the_workers(workers: int, persistent: bool) -> None:
    """Random augmentation (and a random collate) gives the same batches with 0, 1, 2 workers."""
    plain = _stream(0)
    assert not torch.equal(plain[0][:, 1:], plain[8][:, 1:])  # epochs draw anew
    for a, b in zip(plain, _stream(workers, persistent_workers=persistent), strict=True):
        assert torch.equal(a, b)


def test_the_loader_leaves_the_training_rngs_untouched() -> None:
    """num_workers=0: fetching batches (lookahead included) draws nothing from the global RNGs."""
    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    acc = _acc(2)
    loader = distributed.loader(Augmenting(), batch_size=4, num_workers=0, seed=9)
    before = _rng_states()
    for _ in acc.iterate(loader):
        pass
    assert _same_rng(before, _rng_states())


@pytest.mark.parametrize("workers", [0, 2])
def test_dropout_masks_are_the_same_whatever_the_workers(workers: int) -> None:
    """The training side's dropout draws the same masks with 0 or 2 loader workers."""

    def masks(num_workers: int) -> list[torch.Tensor]:
        torch.manual_seed(0)
        drop = nn.Dropout(0.5)
        loader = distributed.loader(Augmenting(), batch_size=4, num_workers=num_workers, seed=9)
        return [drop(torch.ones(4, 16)) for _ in loader]

    assert all(torch.equal(a, b) for a, b in zip(masks(0), masks(workers), strict=True))


def test_a_resumed_pass_draws_the_same_augmentation() -> None:
    """A state taken mid-pass (with iterate's lookahead) resumes into the same augmented batches."""
    whole = _stream(0)
    source = distributed.loader(Augmenting(), batch_size=4, num_workers=0, seed=9,
                                collate_fn=_noisy_collate)  # fmt: skip
    acc = _acc(1)
    for k, _ in enumerate(acc.iterate(source)):
        if k == 2:  # 3 batches handed out, a 4th held back by the lookahead
            state = source.state_dict(consumed=source.position - acc.lookahead)
            break
    resumed = distributed.loader(Augmenting(), batch_size=4, num_workers=2, seed=9,
                                 collate_fn=_noisy_collate)  # fmt: skip
    resumed.load_state_dict(state)
    rest = [b for _ in range(2) for b in resumed.training_pass()]
    assert len(rest) == len(whole) - 3
    assert all(torch.equal(a, b) for a, b in zip(whole[3:], rest, strict=True))


def test_sampler_arguments_are_refused() -> None:
    """loader() shards, batches and seeds itself: sampler, batch_sampler, ... are refused."""
    for name in ("sampler", "batch_sampler", "generator"):
        with pytest.raises(TypeError, match=f"sets {name} itself"):
            distributed.loader(_data(), batch_size=4, num_workers=0, **{name: None})


def test_a_world_size_change_is_refused(tmp_path: Any) -> None:
    """A checkpoint written by 2 processes, resumed by 1 without reseed=True:
    CheckpointError naming it, nothing loaded."""
    model = nn.Linear(2, 1)
    ckpt = loopkit.Checkpointer(tmp_path, model=model,
                                loader=distributed.loader(_data(), 4, num_workers=0))  # fmt: skip
    path = ckpt.save()
    assert path is not None
    state = torch.load(path, weights_only=True)
    state["world_size"], state["rng"] = 2, state["rng"] * 2
    torch.save(state, path)
    with pytest.raises(loopkit.CheckpointError, match=r"resumed by 1.*resume\(reseed=True\)"):
        ckpt.resume()


@pytest.mark.parametrize(
    ("other", "named"),
    [({"seed": 2}, "seed=1"), ({"shuffle": False}, "shuffle=True"),
     ({"seed": 2, "shuffle": False}, "seed=1, shuffle=True")],
    ids=["seed", "shuffle", "both"],
)  # fmt: skip
def test_a_mid_pass_resume_in_another_order_is_refused(
    tmp_path: Any, other: dict[str, Any], named: str
) -> None:
    """Saved mid-pass with seed=1, resumed by a loader with another seed or shuffle:
    CheckpointError naming what differs, raised before anything is loaded."""
    model = nn.Linear(1, 1)
    source = distributed.loader(_data(40), batch_size=4, num_workers=0, seed=1)
    ckpt = loopkit.Checkpointer(tmp_path, model=model, loader=source)
    it = source.training_pass()
    for _ in range(5):
        next(it)
    ckpt.save()
    with torch.no_grad():
        model.weight.add_(1.0)
    before = model.weight.detach().clone()
    kwargs = {"seed": 1, **other}
    resumed = distributed.loader(_data(40), batch_size=4, num_workers=0, **kwargs)
    state = _internal(resumed)
    again = loopkit.Checkpointer(tmp_path, model=model, loader=resumed)
    with pytest.raises(loopkit.CheckpointError, match=f"mid-pass .* by a loader with {named}"):
        again.resume()
    assert torch.equal(model.weight, before) and _same(state, _internal(resumed))


def test_another_order_is_accepted_at_a_pass_boundary() -> None:
    """A state saved when a pass had ended resumes into a loader with another seed."""
    source = distributed.loader(_data(), batch_size=4, num_workers=0, seed=1)
    _order(source)
    state = source.state_dict()
    other = distributed.loader(_data(), batch_size=4, num_workers=0, seed=7)
    other.load_state_dict(state)
    assert other.epoch == 1 and sorted(_order(other)) == list(range(20))


class _Handles(torch.utils.data.Dataset[torch.Tensor]):
    """Reads a per-worker "handle" that worker_init_fn opens (as with an HDF5 file)."""

    handle: int | None = None

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> torch.Tensor:
        assert _Handles.handle is not None, "worker_init_fn did not run"
        return torch.tensor([i, _Handles.handle])


def _open_handle(worker_id: int) -> None:
    # What loopkit seeded before: the draw is the same in every run with the same seed.
    _Handles.handle = 100 + worker_id + 1000 * random.randrange(1, 9)


def test_worker_init_fn_runs_in_every_worker_after_the_seeding() -> None:
    """worker_init_fn is accepted and runs in each worker, after loopkit seeded the RNGs there
    (its draws repeat from run to run); the batches are those of the data set."""
    runs = []
    for _ in range(2):
        loader = distributed.loader(
            _Handles(), batch_size=2, num_workers=2, shuffle=False, worker_init_fn=_open_handle
        )
        runs.append(torch.cat(list(loader)))
    rows = runs[0]
    assert rows[:, 0].tolist() == list(range(8))
    assert {h % 1000 for h in rows[:, 1].tolist()} == {100, 101}
    assert torch.equal(runs[0], runs[1])
    with pytest.raises(TypeError, match="worker_init_fn must be callable"):
        distributed.loader(_Handles(), batch_size=2, worker_init_fn=3)


class _InstanceHandles(torch.utils.data.Dataset[torch.Tensor]):
    """Reads a handle opened on the instance through get_worker_info().dataset."""

    def __init__(self) -> None:
        self.handle: int | None = None

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> torch.Tensor:
        assert self.handle is not None, "worker_init_fn opened nothing on this dataset"
        return torch.tensor([i, self.handle])


def _open_on_worker_dataset(worker_id: int) -> None:
    info = torch.utils.data.get_worker_info()
    assert info is not None
    info.dataset.handle = 100 + worker_id  # PyTorch's documented per-worker pattern


def test_worker_init_fn_sees_the_users_dataset_in_get_worker_info() -> None:
    """get_worker_info().dataset in worker_init_fn is the dataset given to loader(), not
    loopkit's wrapper: a handle opened on it is what __getitem__ reads, in each worker."""
    loader = distributed.loader(
        _InstanceHandles(), batch_size=2, num_workers=2, shuffle=False,
        worker_init_fn=_open_on_worker_dataset,
    )  # fmt: skip
    rows = torch.cat(list(loader))
    assert rows[:, 0].tolist() == list(range(8))
    assert rows[:, 1].tolist() == [100, 100, 101, 101, 100, 100, 101, 101]


def test_persistent_workers_stop_at_once_when_a_loader_in_a_cycle_is_collected(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A loader with persistent workers, held by a Checkpointer (a reference cycle) and
    collected by the garbage collector, stops its workers through their queues: the
    collection does not wait for torch's status-check timeout per worker (set to 30 s here,
    so the stall, which this test once measured at 2 x 5 s, cannot pass for slowness)."""
    from torch.utils.data import _utils

    monkeypatch.setattr(_utils, "MP_STATUS_CHECK_INTERVAL", 30.0)  # the parent's join
    monkeypatch.setattr(_utils.worker, "MP_STATUS_CHECK_INTERVAL", 30.0)  # the workers' wait
    data = torch.utils.data.TensorDataset(torch.randn(16, 3), torch.randn(16, 1))

    def run() -> list[Any]:
        loader = distributed.loader(data, batch_size=4, num_workers=2, seed=0)
        net = nn.Linear(3, 1)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        step = loopkit.step(net, opt)
        loopkit.Checkpointer(tmp_path, model=net, optimizer=opt, step=step, loader=loader)
        for _ in range(2):
            for x, y in loader:
                with step as s:
                    s.backward(nn.functional.mse_loss(net(x), y))
        workers = list(loader.loader._iterator._workers)  # type: ignore[union-attr]
        assert all(w.is_alive() for w in workers)
        return workers

    enabled = gc.isenabled()
    gc.disable()  # collected below, by the cycle collector, not when run() returns
    try:
        workers = run()
        start = time.perf_counter()
        gc.collect()
        took = time.perf_counter() - start
    finally:
        if enabled:
            gc.enable()
    assert not any(w.is_alive() for w in workers)
    assert [w.exitcode for w in workers] == [0, 0]
    assert took < 15.0, f"collecting the loader waited {took:.1f} s for its workers"
