"""loopkit.stream_shards: a stream over shard files that resumes exactly and splits itself
again on another number of processes.

Invariants: over all ranks and workers each sample of an epoch is read once; a loader
resumed from the state after any batch hands out what the uninterrupted one did after it
(epoch boundaries included); from the states of every worker of every rank, what is left of
the pass, dealt to another number of ranks, is every unread sample once.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import loopkit
from loopkit import CheckpointError, _ranks
from loopkit._checkpoint._stream_state import StreamState
from loopkit._stream import _shards

StatefulDataLoader = pytest.importorskip("torchdata.stateful_dataloader").StatefulDataLoader

SIZES = [5, 9, 1, 7, 4, 8, 6, 3]  # samples per shard: 43 in all


def read(shard: int) -> Iterator[dict[str, Any]]:
    """Shard ``shard``'s samples: ids 100 * shard + k."""
    for k in range(SIZES[shard]):
        yield {"id": 100 * shard + k, "x": torch.full((2,), float(k))}


ALL = sorted(100 * s + k for s, n in enumerate(SIZES) for k in range(n))


def noisy(sample: dict[str, Any]) -> dict[str, Any]:
    return {**sample, "x": sample["x"] + torch.randn(2)}


def _stream(**kwargs: Any) -> loopkit.stream_shards[int, Any]:
    return loopkit.stream_shards(list(range(len(SIZES))), read, seed=3, transform=noisy, **kwargs)


def _ids(loader: Any, limit: int | None = None) -> list[int]:
    return [i for b in itertools.islice(loader, limit) for i in b["id"].tolist()]


def as_rank(monkeypatch: pytest.MonkeyPatch, rank: int, world: int) -> None:
    """Make this process rank ``rank`` of ``world`` for the data set (and its workers)."""
    monkeypatch.setattr(_ranks, "world", lambda group=None: (rank, world))
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", str(world))


def test_plan_share_and_remaining_are_pure() -> None:
    """The plan is a permutation of the shards; shares are disjoint and cover it; what is
    left of synthetic worker states is each unfinished item from its place, in plan order."""
    items = _shards.plan(8, seed=3, epoch=0, shuffle=True)
    assert sorted(s for s, _ in items) == list(range(8)) and items != _shards.plan(8, 3, 1, True)
    shares = [_shards.share(items, r, 2, w, 2) for r in range(2) for w in range(2)]
    assert sorted(x for part in shares for x in part) == sorted(items)
    base = {"epoch": 0, "seed": 3, "n_shards": 8, "shuffle": True, "plan": None, "world": 2,
            "end": 1}  # fmt: skip
    states = [
        {**base, "rank": 0, "worker": 0, "workers": 2, "at": 1, "place": 2},  # 1 done, 2 read
        {**base, "rank": 0, "worker": 1, "workers": 2, "at": 2, "place": None},  # both done
    ]  # rank 1: no state, all of its items left
    epoch, left, end = _shards.remaining(states, 2)
    mine = _shards.share(items, 0, 2, 0, 2)
    expected = [(mine[1][0], 2), *_shards.share(items, 1, 2, 0, 1)]
    assert epoch == 0 and end == 1 and sorted(left) == sorted(expected)
    assert [items.index((s, 0)) for s, _ in left] == sorted(items.index((s, 0)) for s, _ in left)


@pytest.mark.parametrize(("world", "workers"), [(1, 0), (2, 0), (2, 2), (3, 2)])
def test_every_sample_once_over_ranks_and_workers(
    monkeypatch: pytest.MonkeyPatch, world: int, workers: int
) -> None:
    """Each rank's loader (with ``workers``) reads its shards; together, every sample once."""
    seen = []
    for rank in range(world):
        as_rank(monkeypatch, rank, world)
        seen += _ids(StatefulDataLoader(_stream(), batch_size=2, num_workers=workers))
    assert sorted(seen) == ALL


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("cut", [1, 6, 13, 25])
def test_a_resumed_loader_hands_out_the_same_batches(workers: int, cut: int) -> None:
    """passes=2 (two epochs, each in its own order, in one loader pass): resumed after
    ``cut`` batches, also across the epoch boundary, the same ids and augmentation follow."""

    def batches(loader: Any, limit: int | None = None) -> list[tuple[list[int], torch.Tensor]]:
        return [(b["id"].tolist(), b["x"]) for b in itertools.islice(loader, limit)]

    whole = batches(StatefulDataLoader(_stream(passes=2), batch_size=3, num_workers=workers))
    first = StatefulDataLoader(_stream(passes=2), batch_size=3, num_workers=workers)
    head = batches(first, cut)
    resumed = StatefulDataLoader(_stream(passes=2), batch_size=3, num_workers=workers)
    resumed.load_state_dict(first.state_dict())
    tail = batches(resumed)
    assert [b for b, _ in head + tail] == [b for b, _ in whole]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(head + tail, whole, strict=True))
    ids = [i for b, _ in whole for i in b]
    assert sorted(ids) == sorted(ALL * 2) and ids[: len(ALL)] != ids[len(ALL) :]


@pytest.mark.parametrize(("saved", "resumed", "workers"), [(2, 1, 2), (2, 3, 0), (3, 2, 1)])
def test_what_is_left_is_split_again_among_another_number_of_ranks(
    monkeypatch: pytest.MonkeyPatch, saved: int, resumed: int, workers: int
) -> None:
    """``saved`` ranks read part of the pass and save; the states, re-split for ``resumed``
    ranks by the loader piece (what resume(reseed=True) does), give every unread sample once,
    and the same augmentation each sample had in the uninterrupted pass."""
    whole: dict[int, torch.Tensor] = {}
    for rank in range(saved):
        as_rank(monkeypatch, rank, saved)
        for b in StatefulDataLoader(_stream(), batch_size=2, num_workers=workers):
            whole.update(zip(b["id"].tolist(), b["x"], strict=True))
    read_before, states = [], []
    for rank in range(saved):
        as_rank(monkeypatch, rank, saved)
        loader = StatefulDataLoader(_stream(), batch_size=2, num_workers=workers)
        read_before += _ids(loader, 2 + rank)
        states.append(StreamState(loader).state_dict())
    read_after = []
    for rank in range(resumed):
        as_rank(monkeypatch, rank, resumed)
        loader = StatefulDataLoader(_stream(), batch_size=2, num_workers=1)
        piece = StreamState(loader)
        piece.load_state_dict(piece.reseeded(states, resumed)[rank])
        for b in loader:
            read_after += b["id"].tolist()
            assert all(
                torch.equal(whole[i], x) for i, x in zip(b["id"].tolist(), b["x"], strict=True)
            )
    assert sorted(read_before + read_after) == ALL
    assert not set(read_before) & set(read_after)


def test_a_stream_that_cannot_split_again_is_refused_with_the_reason() -> None:
    """A loader over another data set, or over a shuffle_buffer, is refused on reseed."""
    plain = StatefulDataLoader([1, 2, 3], batch_size=1)
    with pytest.raises(CheckpointError, match="cannot split its data"):
        StreamState(plain).reseeded([{"loader": plain.state_dict()}] * 2, 1)
    buffered = loopkit.shuffle_buffer(_stream(), 4)
    loader = StatefulDataLoader(buffered, batch_size=2)
    _ids(loader, 2)
    with pytest.raises(CheckpointError, match="shuffle_buffer holds samples"):
        StreamState(loader).reseeded([StreamState(loader).state_dict()] * 2, 1)


def test_a_state_of_another_rank_or_worker_count_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A worker state loaded where another rank or worker count reads raises, naming both."""
    loader = StatefulDataLoader(_stream(), batch_size=2, num_workers=0)
    _ids(loader, 1)
    as_rank(monkeypatch, 1, 2)
    other = StatefulDataLoader(_stream(), batch_size=2, num_workers=0)
    other.load_state_dict(loader.state_dict())
    with pytest.raises(ValueError, match="saved by rank 0 of 1"):
        _ids(other)


def _saved(monkeypatch: pytest.MonkeyPatch, world: int, read: list[int], **kw: Any) -> list[Any]:
    """Each of ``world`` ranks reads ``read[rank]`` batches of 1 and saves its loader's state."""
    states = []
    for rank in range(world):
        as_rank(monkeypatch, rank, world)
        loader = StatefulDataLoader(_stream(**kw), batch_size=1)
        _ids(loader, read[rank])
        states.append(StreamState(loader).state_dict())
    return states


def test_a_re_split_is_one_pass_and_keeps_the_streams_end(monkeypatch: pytest.MonkeyPatch) -> None:
    """After a re-split (2 ranks -> 1), the pass after the resumed one reads the whole epoch
    (not the leftover again); with passes=2 saved in epoch 1 the resumed pass reads only what
    was left of epochs 0 and 1 (no third epoch)."""
    states = _saved(monkeypatch, 2, [2, 3])
    as_rank(monkeypatch, 0, 1)
    loader = StatefulDataLoader(_stream(), batch_size=1)
    piece = StreamState(loader)
    piece.load_state_dict(piece.reseeded(states, 1)[0])
    assert len(_ids(loader)) == len(ALL) - 5
    assert sorted(_ids(loader)) == ALL
    full = []  # each rank's whole loader pass (2 epochs); it saves into its second
    for rank in range(2):
        as_rank(monkeypatch, rank, 2)
        full.append(len(_ids(StatefulDataLoader(_stream(passes=2), batch_size=1))))
    half = [n // 2 + 2 for n in full]
    states = _saved(monkeypatch, 2, half, passes=2)
    as_rank(monkeypatch, 0, 1)
    loader = StatefulDataLoader(_stream(passes=2), batch_size=1)
    piece = StreamState(loader)
    piece.load_state_dict(piece.reseeded(states, 1)[0])
    assert len(_ids(loader)) == 2 * len(ALL) - sum(half)


def test_a_transform_leaves_the_loops_random_streams_alone() -> None:
    """With no workers the transform's seeded RNGs are set around the transform only: while
    the loop holds a sample, its own draws continue its stream (as without the stream)."""
    torch.manual_seed(0)
    expected = [torch.rand(1) for _ in range(3)]
    torch.manual_seed(0)
    it = iter(_stream())
    got = []
    for _ in range(3):
        next(it)
        got.append(torch.rand(1))
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))


def _within(seconds: float, make: Any) -> Any:
    """``make()`` run in a thread: its result, or a failure if it has not returned by then
    (a spinning generator: the daemon thread is left behind)."""
    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.append(make()), daemon=True)
    thread.start()
    thread.join(seconds)
    assert out, f"still running after {seconds} s"
    return out[0]


def test_a_rank_with_no_shard_reads_nothing_for_ever(monkeypatch: pytest.MonkeyPatch) -> None:
    """``passes=None`` with fewer shards than ranks: the rank with none reads nothing (its
    pass ends at once), as documented; it spun for ever without yielding (a hung loader,
    and a worker process at 100% CPU that outlived its parent)."""
    as_rank(monkeypatch, 1, 2)
    assert _within(20, lambda: list(loopkit.stream_shards([0], read, passes=None))) == []
    as_rank(monkeypatch, 0, 2)
    endless = iter(loopkit.stream_shards([0], read, passes=None))
    ids = [s["id"] for s in itertools.islice(endless, 10)]  # one shard of 5, each epoch
    assert sorted(ids[:5]) == sorted(ids[5:]) == [0, 1, 2, 3, 4]
