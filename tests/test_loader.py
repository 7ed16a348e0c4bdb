"""distributed.loader and its EpochLoader, single-process: seeds, refusals, resumable state."""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest
import torch
from helpers import StreamWithLen

from loopkit import distributed


def _data(n: int = 20) -> torch.utils.data.TensorDataset:
    return torch.utils.data.TensorDataset(torch.arange(n))


def _order(loader: distributed.EpochLoader) -> list[int]:
    return [int(i) for (batch,) in loader for i in batch]


def _internal(loader: distributed.EpochLoader) -> tuple[Any, ...]:
    generator = loader.loader.generator
    assert generator is not None
    return (
        loader.epoch,
        loader.position,
        loader._resume_at,
        loader._pass_epoch,
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
    it = iter(source)
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
    it = iter(source)
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
