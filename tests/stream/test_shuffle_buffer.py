"""loopkit.shuffle_buffer: every sample once, seeded, and the buffer saved with the loader.

The invariant: a pass resumed from the state taken after any number of batches hands out
exactly the batches the uninterrupted pass handed out after them (samples, order and random
augmentation), with 0 and 2 workers; the state grows by the samples the buffer holds.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils.data import IterableDataset

import loopkit

StatefulDataLoader = pytest.importorskip("torchdata.stateful_dataloader").StatefulDataLoader


class Counting(IterableDataset[dict[str, Any]]):
    """A stream of ``n`` samples with a place of its own, split among loader workers."""

    def __init__(self, n: int, width: int = 4) -> None:
        self.n, self.width, self.next, self.start = n, width, 0, 0
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = torch.utils.data.get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        start, self.start, self.next = self.start, 0, 0  # a loaded place, once (as HF's)
        for i in range(start, self.n):
            if i % workers == worker:
                self.next = i + 1
                yield {"id": i + 1000 * self.epoch, "x": torch.full((self.width,), float(i))}
        self.next = self.n

    def state_dict(self) -> dict[str, int]:
        return {"next": self.next}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.start = state["next"]


def noisy(sample: dict[str, Any]) -> dict[str, Any]:
    """Random augmentation from torch's global RNG."""
    return {**sample, "x": sample["x"] + torch.randn(sample["x"].shape)}


def _loader(workers: int, size: int = 8, passes: int | None = 1, n: int = 60) -> Any:
    data = loopkit.shuffle_buffer(Counting(n), size, seed=7, passes=passes, transform=noisy)
    return StatefulDataLoader(data, batch_size=3, num_workers=workers)


def _batches(loader: Any, limit: int | None = None) -> list[tuple[list[int], torch.Tensor]]:
    out = []
    for batch in loader:
        out.append((batch["id"].tolist(), batch["x"]))
        if limit is not None and len(out) == limit:
            break
    return out


def test_every_sample_once_in_a_seeded_order() -> None:
    """Each sample once a pass; the order is shuffled, the same for the same seed."""
    ids = [i for b, _ in _batches(_loader(0)) for i in b]
    assert sorted(ids) == list(range(60))
    assert ids != list(range(60))
    assert ids == [i for b, _ in _batches(_loader(0)) for i in b]


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("cut", [1, 5, 19])
def test_a_resumed_pass_hands_out_the_same_batches(workers: int, cut: int) -> None:
    """Resumed after ``cut`` batches (passes=2: the cut at 19 is in the second epoch), the
    loader hands out what the uninterrupted one did after them, augmentation included."""
    whole = _batches(_loader(workers, passes=2))
    first = _loader(workers, passes=2)
    head = _batches(first, cut)
    state = first.state_dict()
    resumed = _loader(workers, passes=2)
    resumed.load_state_dict(state)
    tail = _batches(resumed)
    assert [b for b, _ in head + tail] == [b for b, _ in whole]
    for (_, a), (_, b) in zip(head + tail, whole, strict=True):
        assert torch.equal(a, b)
    assert len(whole) == 40  # 120 samples (2 epochs), 3 a batch


def test_the_state_grows_by_the_samples_the_buffer_holds() -> None:
    """The saved state of a buffer of 64 is larger than one of 1 by about 63 samples."""

    def saved_bytes(size: int) -> int:
        loader = _loader(0, size=size, n=200)
        _batches(loader, 3)
        buf = io.BytesIO()
        torch.save(loopkit._data._consumed.state_of(loader, loader.state_dict), buf)
        return buf.getbuffer().nbytes

    sample = io.BytesIO()
    torch.save({"id": torch.tensor(0), "x": torch.zeros(4)}, sample)
    grown = saved_bytes(64) - saved_bytes(1)
    per_sample = grown / 63
    assert 0 < per_sample < sample.getbuffer().nbytes, (grown, sample.getbuffer().nbytes)


def test_a_source_that_cannot_save_its_place_is_refused() -> None:
    """A source without state_dict is refused at once, naming what to use."""
    with pytest.raises(TypeError, match="no state_dict"):
        loopkit.shuffle_buffer(range(10), 4)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"size": 0}, "size must be"), ({"size": 2, "seed": 1.5}, "seed must be"),
     ({"size": 2, "passes": 0}, "passes must be"), ({"size": 2, "transform": 3}, "callable")],
)  # fmt: skip
def test_bad_arguments_are_refused(kwargs: dict[str, Any], match: str) -> None:
    """Each bad argument names itself."""
    with pytest.raises((TypeError, ValueError), match=match):
        loopkit.shuffle_buffer(Counting(4), **kwargs)


def test_a_foreign_state_is_refused_before_anything_changes() -> None:
    """load_state_dict of something else raises and the next pass starts afresh."""
    data = loopkit.shuffle_buffer(Counting(10), 4)
    with pytest.raises(ValueError, match=r"not a loopkit\.shuffle_buffer state"):
        data.load_state_dict({"next": 3})
    assert sorted(s["id"] for s in data) == list(range(10))


def test_samples_a_checkpoint_cannot_hold_are_refused_at_once() -> None:
    """A numpy sample is refused as the pass starts, naming the fix (a checkpoint of it would
    save and never load: checkpoints are read with weights_only)."""
    np = pytest.importorskip("numpy")

    class Arrays(Counting):
        def __iter__(self) -> Iterator[dict[str, Any]]:
            for sample in super().__iter__():
                yield {"id": sample["id"], "x": np.zeros(2)}

    with pytest.raises(TypeError, match=r"numpy\.ndarray.*with_format\('torch'\)"):
        next(iter(loopkit.shuffle_buffer(Arrays(8), 4)))


def test_a_transform_that_edits_its_sample_leaves_a_saved_buffer_alone() -> None:
    """A transform changing the sample dict it is given in place: the state taken before
    keeps the sample as the source gave it, so the resumed pass is the uninterrupted one."""

    def in_place(sample: dict[str, Any]) -> dict[str, Any]:
        sample["x"] += torch.randn(sample["x"].shape)
        return sample

    def make() -> Any:
        return loopkit.shuffle_buffer(Counting(30), 6, seed=2, transform=in_place)

    whole = [s["x"] for s in make()]
    first = make()
    it = iter(first)
    head = [next(it)["x"] for _ in range(5)]
    state = first.state_dict()
    next(it)  # taken after the state, as iterate's look-ahead takes it
    again = make()
    again.load_state_dict(state)
    tail = [s["x"] for s in again]
    assert all(torch.equal(a, b) for a, b in zip(head + tail, whole, strict=True))


def test_a_workers_state_carries_the_buffer_as_one_bytes_object() -> None:
    """With workers the buffer crosses to the main process as bytes (no shared-memory file
    per buffered tensor, which ran out of file descriptors), and resumes alike."""
    loader = _loader(2, size=8)
    _batches(loader, 4)
    state = loader.state_dict()
    workers = state["_snapshot"]["_worker_snapshots"].values()
    buffers = [w["dataset_state"]["buffer"] for w in workers]
    assert len(buffers) == 2 and all(isinstance(b, bytes) and b for b in buffers)
