"""The loader over a preloaded cache, no workers: gathered batches, buffers reused, no reseed."""

from __future__ import annotations

from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
from test_preload import Boxes, Images
from torch.utils.data import DistributedSampler

import loopkit
from loopkit import distributed
from loopkit._data import _gather_loader, _seeding
from loopkit._data._gather_loader import BufferPool
from loopkit._data._seeding import KeyedBatches, SeededRandomSampler


def _noisy(batch: Any) -> Any:
    """A collate_fn drawing from the three global RNGs the loader seeds."""
    x, y = batch
    noise = torch.randint(0, 9, x.shape, dtype=torch.uint8)
    return x + noise, y, np.random.randint(1 << 30), float(np.float64(torch.rand(())))


def _reference(loader: Any, data: Images) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The batches of the data set itself, in the order the loader's sampler lists them."""
    return [(torch.stack([data[i][0] for i in b]), torch.tensor([data[i][1] for i in b]))
            for b in loader.batches]  # fmt: skip


@pytest.mark.parametrize(("batch_size", "drop_last", "shuffle"),
                         [(8, False, True), (7, True, True), (16, False, False)])  # fmt: skip
def test_kept_batches_are_the_data_sets_and_the_workers_batches(
    tmp_path: Path, batch_size: int, drop_last: bool, shuffle: bool
) -> None:
    """Batches kept in a list over two passes (and views of them) equal the data set's,
    the batches 1 worker gives, and the generator ends in the same state."""
    data = Images(50)
    cache = loopkit.preload(data, tmp_path)
    kw: dict[str, Any] = {"batch_size": batch_size, "drop_last": drop_last, "shuffle": shuffle}
    main = distributed.loader(cache, seed=3, **kw)
    kept, views, want = [], [], []
    for _ in range(2):
        for x, y in main:
            kept.append((x, y))
            views.append(x[0].numpy())  # a view of the batch, not the batch itself
        want += _reference(main, data)  # the order of the pass just run
    assert len(kept) == len(want) == 2 * len(main)
    for (x, y), v, (wx, wy) in zip(kept, views, want, strict=True):
        assert torch.equal(x, wx) and torch.equal(y, wy) and np.array_equal(v, wx[0].numpy())
    worker = distributed.loader(cache, seed=3, num_workers=1, persistent_workers=False, **kw)
    got = [b for _ in range(2) for b in worker]
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
               for a, b in zip(kept, got, strict=True))  # fmt: skip
    assert torch.equal(main.state_dict()["generator"], worker.state_dict()["generator"])


def test_a_collate_fn_draws_under_the_key_and_only_it_reseeds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No collate_fn: no reseed at all; a random collate_fn: one per batch, the batches of 2
    workers and of a resume mid-pass, and the loop's own RNG streams untouched."""
    cache = loopkit.preload(Images(50), tmp_path)
    calls: list[Any] = []
    rng_seeds = _seeding.rng_seeds
    monkeypatch.setattr(_seeding, "rng_seeds", lambda key: calls.append(key) or rng_seeds(key))
    assert len(list(distributed.loader(cache, batch_size=8, seed=1))) == 7
    assert calls == []
    loader = distributed.loader(cache, batch_size=8, seed=1, collate_fn=_noisy)
    it = loader.training_pass()  # consumed by training: its place is the loader's
    main = [next(it) for _ in range(3)]
    state = loader.state_dict()
    main += list(it)
    assert len(calls) == 7
    resumed = distributed.loader(cache, batch_size=8, seed=1, collate_fn=_noisy)
    resumed.load_state_dict(state)
    monkeypatch.setattr(_seeding, "rng_seeds", rng_seeds)
    workers = list(distributed.loader(cache, batch_size=8, seed=1, collate_fn=_noisy,
                                      num_workers=2))  # fmt: skip
    for got in (workers, main[:3] + list(resumed)):
        for a, b in zip(main, got, strict=True):
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and a[2:] == b[2:]


def test_the_loop_rngs_see_their_own_streams(tmp_path: Path) -> None:
    """Drawing between batches (with and without a collate_fn) gives the values drawn with
    no loader at all: the loader leaves the global RNGs as it found them."""
    cache = loopkit.preload(Images(40), tmp_path)
    torch.manual_seed(11)
    np.random.seed(11)
    want = [(torch.rand(()), np.random.rand()) for _ in range(2 * 5)]
    torch.manual_seed(11)
    np.random.seed(11)
    got = []
    for collate in (None, _noisy):
        for _ in distributed.loader(cache, batch_size=8, seed=2, collate_fn=collate):
            got.append((torch.rand(()), np.random.rand()))
    assert got == want


def test_a_pool_buffer_is_handed_out_again_only_once_nothing_holds_it() -> None:
    """A buffer comes back only when no tensor (view, numpy array) on it is alive."""
    pool = BufferPool()
    a = pool(4, 6)
    a_ptr, view = a.data_ptr(), a.view(torch.int16)[1]
    del a
    b = pool(4, 6)
    b_ptr, array = b.data_ptr(), b.numpy()
    del b
    assert b_ptr != a_ptr  # the view holds the first
    c = pool(4, 6)
    assert c.data_ptr() not in (a_ptr, b_ptr)  # the array holds the second
    del view, array
    x, y = pool(4, 6), pool(4, 6)
    assert (x.data_ptr(), y.data_ptr()) == (a_ptr, b_ptr)  # nothing holds them any more
    assert pool(3, 6).shape == (3, 6)  # another shape: another buffer


_KEPT = {
    "untyped storage": lambda b: b.untyped_storage(),
    "typed storage": lambda b: b._typed_storage(),
    "as_strided": lambda b: b.as_strided((2, 3), (6, 1), 1),
    "slice": lambda b: b[1:],
    "unfold": lambda b: b.unfold(0, 2, 1),
    "numpy": lambda b: b.numpy(),
    "dlpack capsule": lambda b: torch.utils.dlpack.to_dlpack(b),
    "numpy from dlpack": lambda b: np.from_dlpack(b),
    "set_ on its storage": lambda b: torch.empty(0, dtype=torch.uint8).set_(b.untyped_storage()),
}


@pytest.mark.parametrize("kept", sorted(_KEPT))
def test_a_pool_buffer_is_not_handed_out_while_anything_can_read_its_storage(kept: str) -> None:
    """A kept storage object, any view or an array on it holds the buffer; dropped, it returns."""
    pool = BufferPool()
    a = pool(4, 6)
    a_ptr, holder = a.data_ptr(), _KEPT[kept](a)
    del a
    b = pool(4, 6)
    assert b.data_ptr() != a_ptr  # the holder can still read the first buffer
    del b, holder
    assert pool(4, 6).data_ptr() == a_ptr  # nothing reads it any more


def test_a_pool_buffer_shared_with_another_process_is_never_handed_out_again() -> None:
    """A batch pickled for a torch.multiprocessing queue (its storage moved to shared
    memory) is dropped by the pool: later buffers are new ones."""
    pool = BufferPool()
    a = pool(4, 6)
    a.fill_(7)
    ForkingPickler.dumps(a)  # what a torch.multiprocessing queue's feeder thread does
    shared = a.data_ptr()
    assert a.is_shared()
    del a
    got = [pool(4, 6) for _ in range(3)]
    assert shared not in {g.data_ptr() for g in got}
    assert shared not in {held.tensor.data_ptr() for held in pool._held}  # let go of


def _receive(batches: Any, got: Any, go: Any, out: Any) -> None:
    """Another process: receive a batch, say so, read it only once told to."""
    x = batches.get()
    got.set()
    go.wait(30)
    out.put(x[:, 0, 0, 0].tolist())


def test_a_batch_sent_to_another_process_is_never_overwritten(tmp_path: Path) -> None:
    """The first batch, put on a torch.multiprocessing queue and dropped here, reads the
    same in the receiving process after the loader made every later batch."""
    cache = loopkit.preload(Images(64), tmp_path)
    loader = distributed.loader(cache, batch_size=8, seed=0, shuffle=False)
    ctx = mp.get_context("fork")
    batches, out, got, go = ctx.Queue(), ctx.Queue(), ctx.Event(), ctx.Event()
    child = ctx.Process(target=_receive, args=(batches, got, go, out))
    child.start()
    try:
        it = iter(loader)
        x, _ = next(it)
        sent = x[:, 0, 0, 0].tolist()
        batches.put(x)
        assert got.wait(30)  # pickled and received: the storage is in shared memory now
        del x
        later = [b[0][:, 0, 0, 0].tolist() for b in it]
        go.set()
        assert out.get(timeout=30) == sent and sent not in later
    finally:
        child.join(30)
        if child.is_alive():
            child.kill()


@pytest.mark.parametrize("base", ["none", "seeded", "distributed"])
@pytest.mark.parametrize(("size", "drop_last"), [(4, False), (7, True), (7, False)])
def test_index_tensors_are_the_batches_iter_gives(base: str, size: int, drop_last: bool) -> None:
    """The gathering loader's tensor batches equal the sampler's lists, keys and skip too."""
    n = 45
    for skip in (0, 2, 50):
        sampler: Any = {
            "none": None,
            "seeded": SeededRandomSampler(n, seed=9),
            "distributed": DistributedSampler(
                range(n), num_replicas=4, rank=1, seed=9, drop_last=drop_last
            ),
        }[base]
        batches = KeyedBatches(sampler, n, size, drop_last, 9, 1)
        batches.set_epoch(3)
        batches.skip = skip
        lists = [(list(b), b.key) for b in batches]
        batches.skip = skip
        tensors = [(t.tolist(), key) for t, key in batches.index_tensors()]
        assert tensors == lists and batches.skip == 0
        assert skip or len(lists) == len(batches)


def test_pinned_batches_are_copies_and_the_buffers_come_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With pin_memory the pinned copy is handed out (of every field, ragged ones too)."""
    cache = loopkit.preload(Boxes(), tmp_path)
    pinned: list[Any] = []

    def pin(batch: Any, device: object) -> Any:  # CPU stand-in for the DataLoader's pinning
        copy = [[t.clone() for t in f] if isinstance(f, list) else f.clone() for f in batch]
        pinned.append(copy)
        return copy

    monkeypatch.setattr(_gather_loader, "pin_memory", pin)
    loader = distributed.loader(cache, batch_size=3, seed=2)
    want = [([b.tolist() for b in boxes], [x.tolist() for x in images], labels.tolist())
            for boxes, images, labels in loader]  # fmt: skip
    it = iter(loader.loader)
    it._pin_memory = True
    got = [([b.tolist() for b in boxes], [x.tolist() for x in images], labels.tolist())
           for boxes, images, labels in it]  # fmt: skip
    assert got == want and len(pinned) == len(want) == 7
