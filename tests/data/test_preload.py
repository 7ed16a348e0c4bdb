"""preload: built once, mapped by all, never stale, never half-built; batches in one index."""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import ROOT, deep, launch_env
from torch import nn

import loopkit
from loopkit import distributed


class Images(torch.utils.data.Dataset[tuple[torch.Tensor, int]]):
    """uint8 "images" and int labels, a pure function of the index (and of ``salt``)."""

    def __init__(self, n: int = 50, salt: int = 0) -> None:
        self.n, self.salt, self.calls = n, salt, 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        self.calls += 1
        g = torch.Generator().manual_seed(i * 7919 + self.salt)
        return torch.randint(0, 256, (3, 4, 4), generator=g, dtype=torch.uint8), i % 10


class Tokens(torch.utils.data.Dataset[torch.Tensor]):
    """Token sequences whose length varies with the index."""

    def __len__(self) -> int:
        return 30

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.arange(i % 7 + 1, dtype=torch.int32) + i


def test_items_are_stored_exactly_in_their_dtype(tmp_path: Path) -> None:
    """Each item comes back equal, uint8 stays uint8, and the file holds N items' bytes."""
    data = Images()
    cache = loopkit.preload(data, tmp_path)
    assert cache.built and len(cache) == 50
    assert cache.tensors[0].dtype == torch.uint8 and cache.tensors[0].shape == (50, 3, 4, 4)
    assert cache.nbytes == 50 * 48 + 50 * 8
    for i in range(50):
        x, y = cache[i]
        assert torch.equal(x, data[i][0]) and int(y) == data[i][1]


def test_a_second_call_opens_without_building(tmp_path: Path) -> None:
    """The same data set again: opened, no item transformed beyond the fingerprint sample."""
    loopkit.preload(Images(), tmp_path)
    data = Images()
    again = loopkit.preload(data, tmp_path)
    assert not again.built and data.calls <= 17  # item 0 and the 16 sampled items


def test_a_changed_data_set_is_never_served_the_old_cache(tmp_path: Path) -> None:
    """Another length, other contents or another key: a new cache, built from the new data."""
    first = loopkit.preload(Images(), tmp_path)
    longer = loopkit.preload(Images(51), tmp_path)
    changed = loopkit.preload(Images(salt=1), tmp_path)
    keyed = loopkit.preload(Images(), tmp_path, key="v2")
    paths = {first.path, longer.path, changed.path, keyed.path}
    assert len(paths) == 4 and longer.built and changed.built and keyed.built
    assert torch.equal(changed[3][0], Images(salt=1)[3][0])


def test_transform_runs_once_per_item(tmp_path: Path) -> None:
    """The transform (decode, resize) is applied at build time; its name keys the cache."""
    calls = []

    def to_float(item: tuple[torch.Tensor, int]) -> tuple[torch.Tensor, int]:
        calls.append(1)
        return item[0].float() / 255, item[1]

    cache = loopkit.preload(Images(), tmp_path, transform=to_float)
    assert cache.tensors[0].dtype == torch.float32 and "to_float" in cache.path.name
    assert len(calls) == 1 + 16 + 50  # item 0, the fingerprint sample, the build


def test_variable_length_items_are_flat_with_offsets(tmp_path: Path) -> None:
    """Token sequences: one flat buffer plus offsets, each item back as it was."""
    cache = loopkit.preload(Tokens(), tmp_path)
    assert cache.fields[0].shape is None and cache.offsets[0] is not None
    assert cache.tensors[0].numel() == sum(i % 7 + 1 for i in range(30))
    for i in range(30):
        assert torch.equal(cache[i], Tokens()[i])
    batch = cache.batch([4, 2])
    assert [t.tolist() for t in batch] == [Tokens()[4].tolist(), Tokens()[2].tolist()]


def test_no_room_is_refused_before_anything_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full disk: OSError naming the bytes needed and the place; the directory stays empty."""
    import shutil

    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=1000))
    with pytest.raises(OSError, match=r"needs 2,800 bytes .* in .* but only 1,000 are free"):
        loopkit.preload(Images(), tmp_path / "c")
    assert list((tmp_path / "c").iterdir()) == []


_SLOW_BUILD = """
import sys, time, torch, loopkit
sys.path[:0] = ["tests", "tests/data"]
from test_preload import Images
def slow(item):
    time.sleep(0.01)
    return item
loopkit.preload(Images(400), sys.argv[1], transform=slow)
"""


def test_a_killed_build_leaves_no_usable_cache_and_the_next_run_rebuilds(tmp_path: Path) -> None:
    """SIGKILL mid-build: only a temporary directory is left; the next call builds afresh."""
    proc = subprocess.Popen([sys.executable, "-c", _SLOW_BUILD, str(tmp_path)], cwd=ROOT)
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob(".*.tmp-*/field0.bin")):
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.02)
    time.sleep(0.3)  # in the middle of writing items
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    left = sorted(p.name for p in tmp_path.iterdir())  # the temporary directory and its lock
    assert len(left) == 2 and left[0].endswith(".lock") and ".tmp-" in left[1]

    def slow(item: Any) -> Any:
        return item

    slow.__qualname__ = "slow"  # the same key as the killed run's transform
    cache = loopkit.preload(Images(400), tmp_path, transform=slow)
    assert cache.built and [p.name for p in tmp_path.iterdir()] == [cache.path.name]
    assert all(torch.equal(cache[i][0], Images(400)[i][0]) for i in range(400))


def test_the_loader_batches_by_one_index_and_resumes_exactly(tmp_path: Path) -> None:
    """distributed.loader over a cache: the batches of the data set, one index per field;
    killed mid-epoch and resumed, training ends at the uninterrupted weights, bit for bit."""
    cache = loopkit.preload(Images(), tmp_path / "cache")
    loader = distributed.loader(cache, batch_size=8, seed=4)
    assert loader.loader.num_workers == 0
    x, y = next(iter(loader))
    assert x.shape == (8, 3, 4, 4) and x.dtype == torch.uint8 and y.shape == (8,)

    def train(directory: Path, stop_after: int | None) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Flatten(), nn.Linear(48, 10))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        step = loopkit.step(model, opt, accumulate=2)
        loader = distributed.loader(cache, batch_size=8, seed=4)
        ckpt = loopkit.Checkpointer(directory, model=model, optimizer=opt, step=step, loader=loader)
        ckpt.resume()
        for _ in range(loader.epoch, 2):
            for x, y in step.iterate(loader):
                with step as s:
                    s.backward(nn.functional.cross_entropy(model(x.float() / 255), y))
                ckpt.maybe_save(every=1)
                if step.updates == stop_after:
                    return []
        return [p.detach().clone() for p in model.parameters()]

    whole = train(tmp_path / "a", None)
    train(tmp_path / "b", stop_after=2)
    resumed = train(tmp_path / "b", None)
    assert all(torch.equal(a, b) for a, b in zip(whole, resumed, strict=True))


_TWO_RANKS = """
import datetime, hashlib, sys, time, torch, loopkit
from loopkit import distributed
sys.path[:0] = ["tests", "tests/data"]
from test_preload import Images

def slow(item):  # decoding: the build (~5 s) outlasts the process group's 4 s timeout
    time.sleep(0.02)
    return item

def broken(item):  # only rank 0 fails (as one flaky disk would): the others must learn it
    if item[1] == 7 and torch.distributed.get_rank() == 0:
        raise ValueError("item 7 cannot be decoded")
    return item

with distributed.setup(timeout=datetime.timedelta(seconds=4)) as info:
    cache = loopkit.preload(Images(250), sys.argv[1], transform=slow)
    digest = hashlib.sha256(b"".join(t.numpy().tobytes() for t in cache.tensors)).hexdigest()
    x, _ = next(iter(distributed.loader(cache, batch_size=16, seed=2)))
    try:
        loopkit.preload(Images(30, salt=1), sys.argv[1], transform=broken)
        failed = ""
    except Exception as err:
        failed = f"{type(err).__name__}: {err}"
    open(f"{sys.argv[1]}/a-file", "w").close()
    try:  # local rank 0 cannot create the root (a file is in its path): every rank learns it
        loopkit.preload(Images(8), f"{sys.argv[1]}/a-file/cache")
        no_root = ""
    except Exception as err:
        no_root = f"{type(err).__name__}: {err}"
    # Two nodes (each rank its node's only one): node 0 finds its cache, node 1 builds for
    # longer than the timeout; node 0 must wait for it outside any collective.
    import os, shutil
    os.environ.update(LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    node_root = sys.argv[1] if info.rank == 0 else f"{sys.argv[1]}/node1"
    other = loopkit.preload(Images(250), node_root, transform=slow)
    nodes = (other.built, len(other))
    if info.rank == 1:
        shutil.rmtree(node_root)
    torch.save({"built": cache.built, "digest": digest, "first": x, "failed": failed,
                "no_root": no_root, "nodes": nodes}, f"{sys.argv[1]}/rank{info.rank}.pt")
"""


@deep
def test_under_torchrun_one_build_and_both_ranks_read_the_same_bytes(tmp_path: Path) -> None:
    """Two ranks on one node: local rank 0 builds, rank 1 waits (longer than the process
    group's timeout: it polls, not in a collective) and maps the same files; the loader
    shards the cache. A build that fails on rank 0 is raised on both ranks, so is a root it
    cannot create; on two nodes, one finding its cache waits (outside any collective) for
    the other's build, however long."""

    script = tmp_path / "two.py"
    script.write_text(_TWO_RANKS)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(script), str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=launch_env(),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    a, b = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1))
    assert (a["built"], b["built"]) == (True, False)
    assert a["digest"] == b["digest"]
    assert not torch.equal(a["first"], b["first"])
    assert a["failed"] == "ValueError: item 7 cannot be decoded"
    assert b["failed"] == (
        "RuntimeError: preload: local rank 0 could not build or open the cache: "
        "ValueError: item 7 cannot be decoded"
    )
    for said in (a["no_root"], b["no_root"]):
        assert f"preload: cannot use the cache root {tmp_path}/a-file/cache" in said
    assert (a["nodes"], b["nodes"]) == ((False, 250), (True, 250))
    (tmp_path / "a-file").unlink()
    builds = [p for p in tmp_path.iterdir() if p.is_dir()]
    assert len(builds) == 1 and not list(tmp_path.glob(".*"))  # no lock, temporary, handoff


def test_a_pickled_cache_maps_the_files_again(tmp_path: Path) -> None:
    """What a spawned loader worker receives: the path, mapped again, not a copy of the data."""
    import pickle

    cache = loopkit.preload(Images(), tmp_path)
    blob = pickle.dumps(cache)
    assert len(blob) < 1000  # the path, not 2,800 bytes of items
    again = pickle.loads(blob)
    assert again.path == cache.path and torch.equal(again.tensors[0], cache.tensors[0])


class Ragged(Images):
    """Item 1 (which the 16-item fingerprint sample of 50 does not include) is larger."""

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        x, y = super().__getitem__(i)
        return (torch.cat([x, x], 1) if i == 1 else x), y


def test_a_shape_the_sample_did_not_show_is_refused_and_nothing_is_left(tmp_path: Path) -> None:
    """A fixed-shape field with an odd item: a clear error, and no cache or temporary left."""
    with pytest.raises(ValueError, match=r"field 0 of item 1 has shape \(3, 8, 4\)"):
        loopkit.preload(Ragged(), tmp_path)
    assert list(tmp_path.iterdir()) == []


class Numbers(torch.utils.data.Dataset[torch.Tensor]):
    """``n`` one-element items, ``i`` at index i, but ``last`` at the last index."""

    def __init__(self, n: int, last: float) -> None:
        self.n, self.last = n, last

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([self.last if i == self.n - 1 else float(i)])


class Growing(torch.utils.data.Dataset[torch.Tensor]):
    """``n`` items of sizes 1, 1, ..., 1 and ``n`` at the last index."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.zeros(self.n if i == self.n - 1 else 1)


@pytest.mark.parametrize("n", [2, 3, 10, 16])
def test_every_item_of_a_small_data_set_is_sampled(tmp_path: Path, n: int) -> None:
    """At most 16 items: a changed last item gets a new cache, a last item's size is seen."""
    loopkit.preload(Numbers(n, last=-1.0), tmp_path, key="numbers")
    changed = loopkit.preload(Numbers(n, last=99.0), tmp_path, key="numbers")
    assert changed.built and changed[n - 1].item() == 99.0
    ragged = loopkit.preload(Growing(n), tmp_path, key="growing")
    assert ragged.fields[0].shape is None and ragged[n - 1].shape == (n,)


def test_the_sample_spans_the_data_set_whatever_its_length() -> None:
    """min(n, 16) distinct indices, the first and the last included, all of them up to 16."""
    from loopkit._data._fields import SAMPLED, spread

    for n in range(1, 100):
        picks = spread(n)
        assert len(picks) == min(n, SAMPLED) and picks == sorted(set(picks))
        assert picks[0] == 0 and picks[-1] == n - 1
        if n <= SAMPLED:
            assert picks == list(range(n))
        gaps = [b - a for a, b in itertools.pairwise(picks)]
        assert max(gaps, default=0) <= (n - 1) / (SAMPLED - 1) + 1  # the even step, rounded


class Strided(torch.utils.data.Dataset[tuple[Any, ...]]):
    """Fields laid out with odd strides: empty ones with stride 0, expanded, size-1 dims."""

    def __len__(self) -> int:
        return 3

    def __getitem__(self, i: int) -> tuple[Any, ...]:
        return (np.random.default_rng(i).normal(size=(i,)),  # item 0: empty, strides (0,)
                torch.zeros(1).expand(0) if i == 0 else torch.full((i,), float(i)),
                torch.empty_strided((2, 0, 3), (0, 0, 0)),
                torch.full((i + 1,), float(i)).expand(2, i + 1),  # its sizes vary
                torch.tensor([[float(i)]]).as_strided((1, 1), (0, 5)),
                torch.tensor(float(i)).expand(2, 3))  # fmt: skip


def test_empty_and_zero_stride_fields_are_stored_with_their_values(tmp_path: Path) -> None:
    """Empty fields (stride 0), expanded tensors, size-1 dims of any stride: back as they were."""
    data = Strided()
    cache = loopkit.preload(data, tmp_path)
    for i in range(3):
        for got, want in zip(cache[i], data[i], strict=True):
            want = torch.as_tensor(want)
            assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)
    batch = cache.batch([2, 0])
    assert batch[2].shape == (2, 2, 0, 3) and torch.equal(batch[5][0], data[2][5])


def test_worker_batches_equal_main_process_batches(tmp_path: Path) -> None:
    """With 2 workers (batches built in shared memory) the loader gives the same batches."""
    cache = loopkit.preload(Images(), tmp_path)
    main = list(distributed.loader(cache, batch_size=8, seed=1))
    workers = list(distributed.loader(cache, batch_size=8, seed=1, num_workers=2))
    assert len(main) == len(workers) == 7
    for (a, b), (c, d) in zip(main, workers, strict=True):
        assert torch.equal(a, c) and torch.equal(b, d)


def test_the_default_place_is_dev_shm_unless_it_has_no_room(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No cache=: /dev/shm when it has room, else the temporary directory; then found again."""
    import tempfile

    from loopkit._data import _cache_files, _cache_trust

    shm, tmp = tmp_path / "shm", tmp_path / "tmp"
    shm.mkdir()
    tmp.mkdir()
    monkeypatch.setattr(_cache_trust, "SHM", shm)
    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp))
    name = f"loopkit-preload-{os.getuid()}"
    in_ram = loopkit.preload(Images(), key="ram")
    assert in_ram.path.parent == shm / name
    monkeypatch.setattr(
        _cache_files, "free_bytes", lambda d: 10 if d.is_relative_to(shm) else 10**12
    )
    on_disk = loopkit.preload(Images(), key="disk")
    assert on_disk.path.parent == tmp / name and on_disk.built
    assert not loopkit.preload(Images(), key="ram").built  # found where it was built


# -- edge cases of round 2: shapes, dtypes, concurrent builds, workers, trust --------------


class Boxes(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor, int]]):
    """A [T, 3] field (T boxes per item) and a [3, H, W] field whose H and W both vary."""

    def __len__(self) -> int:
        return 20

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        t, h, w = 1 + i % 4, 1 + i % 3, 2 + i % 5
        boxes = torch.arange(t * 3, dtype=torch.float32).reshape(t, 3) + i
        return boxes, torch.full((3, h, w), i, dtype=torch.uint8), i


def test_a_field_whose_sizes_vary_keeps_its_trailing_dimensions(tmp_path: Path) -> None:
    """[T, 3] and [3, H, W] fields come back in their shapes: items, batches, loader batches."""
    data = Boxes()
    cache = loopkit.preload(data, tmp_path)
    assert [f.shape for f in cache.fields[:2]] == [None, None]
    for i in range(20):
        assert all(torch.equal(a, b) for a, b in zip(cache[i][:2], data[i][:2], strict=True))
    boxes, images, _ = cache.batch([5, 3])
    assert [tuple(b.shape) for b in boxes] == [(2, 3), (4, 3)]
    assert [tuple(x.shape) for x in images] == [(3, 3, 2), (3, 1, 5)]
    batch = next(iter(distributed.loader(cache, batch_size=4, shuffle=False)))
    for k in range(4):
        assert torch.equal(batch[0][k], data[k][0]) and torch.equal(batch[1][k], data[k][1])


class Mixed(torch.utils.data.Dataset[tuple[Any, ...]]):
    """Python and numpy numbers of many dtypes, as a data set may return them."""

    def __len__(self) -> int:
        return 6

    def __getitem__(self, i: int) -> tuple[Any, ...]:
        import numpy as np

        return ([0.1, 16777217.0, 1 / 3][i % 3], 2**40 + i, i % 2 == 0, np.float16(i / 3),
                np.uint16(60000 + i), np.array(i - 3, dtype=np.int8), np.bool_(i % 3 == 0),
                np.full(2, i / 7, dtype=np.float64), np.array([i, 1], dtype=np.uint32))  # fmt: skip


def test_fields_keep_the_dtype_default_collate_gives(tmp_path: Path) -> None:
    """Python floats stay float64 (0.1 exact), ints int64, bools bool, numpy keeps its dtype:
    the preloaded loader's batch equals default_collate's over the data set, dtype included."""
    plain = next(iter(distributed.loader(Mixed(), batch_size=6, shuffle=False, num_workers=0)))
    cache = loopkit.preload(Mixed(), tmp_path)
    pre = next(iter(distributed.loader(cache, batch_size=6, shuffle=False)))
    assert len(plain) == len(pre) == 9
    for a, b in zip(plain, pre, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), (a, b)
    assert pre[0].tolist() == [Mixed()[i][0] for i in range(6)]


class BigEndian(torch.utils.data.Dataset[Any]):
    """A big-endian array (as read from some file formats) and a 0-d array."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> Any:
        import numpy as np

        return np.arange(3, dtype=">f4") + i, np.array(i, dtype=np.int16)


def test_big_endian_and_0_d_arrays_keep_their_values_and_shapes(tmp_path: Path) -> None:
    """A '>f4' array comes back with its values (in native order), a 0-d array with shape ()."""
    cache = loopkit.preload(BigEndian(), tmp_path)
    x, y = cache[2]
    assert x.dtype == torch.float32 and x.tolist() == [2.0, 3.0, 4.0]
    assert y.shape == () and y.dtype == torch.int16 and int(y) == 2


class Exotic(torch.utils.data.Dataset[tuple[torch.Tensor, ...]]):
    """bf16, float8 and complex fields (no numpy equivalent for the first two), one ragged."""

    def __len__(self) -> int:
        return 10

    def __getitem__(self, i: int) -> tuple[torch.Tensor, ...]:
        g = torch.Generator().manual_seed(i)
        bits = torch.randint(0, 2**16, (5,), generator=g, dtype=torch.int32).to(torch.int16)
        return (bits.view(torch.bfloat16),  # every bit pattern, NaN payloads included
                torch.randn(3, generator=g).to(torch.float8_e4m3fn),
                torch.randn(2, generator=g, dtype=torch.complex64),
                torch.randn(1 + i % 3, generator=g).to(torch.bfloat16))  # fmt: skip


def test_dtypes_without_a_numpy_equivalent_are_stored_bit_for_bit(tmp_path: Path) -> None:
    """bfloat16, float8 and complex fields (fixed and ragged) come back with the same bytes."""
    data = Exotic()
    cache = loopkit.preload(data, tmp_path)
    assert [f.dtype for f in cache.fields] == ["bfloat16", "float8_e4m3fn", "complex64",
                                               "bfloat16"]  # fmt: skip
    for i in range(10):
        for got, want in zip(cache[i], data[i], strict=True):
            assert got.dtype == want.dtype and got.shape == want.shape
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    batch = cache.batch([3, 1])
    assert torch.equal(batch[0].view(torch.uint8), torch.stack([data[3][0], data[1][0]]).view(
        torch.uint8))  # fmt: skip


class Slow(Images):
    """Images whose decoding takes ``delay`` seconds (not part of the items: one cache)."""

    def __init__(self, delay: float) -> None:
        super().__init__(120)
        self.delay = delay

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        time.sleep(self.delay)
        return super().__getitem__(i)


def test_a_second_builder_waits_for_the_first_and_removes_nothing_live(tmp_path: Path) -> None:
    """Two independent builders of one cache (two jobs): the second waits on the lock, leaves
    the first's live temporary directory alone, then opens the finished cache."""
    import threading

    results: dict[str, Any] = {}

    def job(label: str, delay: float) -> None:
        try:
            results[label] = loopkit.preload(Slow(delay), tmp_path)
        except Exception as err:  # reported by the assertions below
            results[label] = err

    first = threading.Thread(target=job, args=("first", 0.01))
    first.start()
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob(".*.tmp-*")):
        assert time.monotonic() < deadline and first.is_alive()
        time.sleep(0.01)
    job("second", 0.0)
    first.join()
    a, b = results["first"], results["second"]
    assert isinstance(a, loopkit.Preloaded) and isinstance(b, loopkit.Preloaded), results
    assert a.built and not b.built and a.path == b.path
    assert torch.equal(b.tensors[0], torch.stack([Images(120)[i][0] for i in range(120)]))
    assert [p.name for p in tmp_path.iterdir()] == [a.path.name]  # no lock, no temporary


def test_workers_send_batches_of_a_field_whose_sizes_vary(tmp_path: Path) -> None:
    """A ragged field with 1 or 2 workers: the batches of 0 workers (no hang, no fd error)."""
    cache = loopkit.preload(Boxes(), tmp_path)

    def epoch(workers: int) -> list[Any]:
        wait = {"timeout": 60} if workers else {}  # a hang fails instead of blocking the run
        loader = distributed.loader(cache, batch_size=3, seed=2, num_workers=workers, **wait)
        return [([b.tolist() for b in boxes], [x.tolist() for x in images], labels.tolist())
                for boxes, images, labels in loader]  # fmt: skip

    main = epoch(0)
    assert len(main) == 7
    assert epoch(1) == main and epoch(2) == main


def test_changing_a_batch_in_place_leaves_the_cache_unchanged(tmp_path: Path) -> None:
    """A collate_fn (or the loop) writing into items and batches: later epochs, items and a
    fresh process's mapping still hold the data set's values."""
    data = Boxes()
    cache = loopkit.preload(data, tmp_path)

    def scribble(batch: Any) -> Any:
        for part in (*batch[0], *batch[1]):
            part.fill_(0)
        batch[2].fill_(0)
        return batch

    for _ in distributed.loader(cache, batch_size=4, seed=0, collate_fn=scribble):
        pass
    item = cache[3]
    for part in item:
        part.fill_(0)
    for row in cache.__getitems__([1, 2]):
        for part in row:
            part.fill_(0)
    for i in range(20):
        assert all(torch.equal(a, b) for a, b in zip(cache[i][:2], data[i][:2], strict=True))
        assert int(cache[i][2]) == i
    fresh = loopkit.Preloaded(cache.path, built=False)
    assert torch.equal(fresh.tensors[0], cache.tensors[0])
    assert torch.equal(fresh.tensors[2], torch.arange(20))


def test_a_plain_dataloader_gives_the_data_sets_batches(tmp_path: Path) -> None:
    """torch's DataLoader over the cache (0 or 1 workers): the batches it gives over the data."""
    cache = loopkit.preload(Images(), tmp_path)
    want = list(torch.utils.data.DataLoader(Images(), batch_size=8))
    for workers in (0, 1):
        got = list(torch.utils.data.DataLoader(cache, batch_size=8, num_workers=workers))
        assert len(got) == len(want) == 7
        for (a, b), (c, d) in zip(got, want, strict=True):
            assert torch.equal(a, c) and torch.equal(b, d) and b.dtype == d.dtype


def test_an_empty_data_set_is_refused_clearly(tmp_path: Path) -> None:
    """len 0: a ValueError saying so (not an IndexError from item 0), nothing written."""
    with pytest.raises(ValueError, match="empty data set"):
        loopkit.preload(torch.utils.data.TensorDataset(torch.zeros(0, 3)), tmp_path / "c")
    assert not (tmp_path / "c").exists()


def test_the_default_root_is_private_and_a_planted_one_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No cache=: the root is named per user with mode 0700; one open to others is refused."""
    import stat
    import tempfile

    from loopkit._data import _cache_trust

    shm = tmp_path / "shm"
    shm.mkdir()
    monkeypatch.setattr(_cache_trust, "SHM", shm)
    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path))
    cache = loopkit.preload(Images(), key="private")
    root = cache.path.parent
    st = root.stat()
    assert root == shm / f"loopkit-preload-{os.getuid()}"
    assert st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) == 0o700
    root.chmod(0o777)  # as if another user had made it, for everyone
    with pytest.raises(PermissionError, match=r"default cache root .* open to group or others"):
        loopkit.preload(Images(), key="private")
    with pytest.raises(PermissionError):  # trusting a team cache does not make it ours
        loopkit.preload(Images(), key="private", trust_shared_cache=True)


def _poison(path: Path) -> None:
    """Change item 3's bytes of field 0 in place, as another user with write access could."""
    field = path / "field0.bin"
    field.chmod(0o644)
    data = bytearray(field.read_bytes())
    data[48 * 3 : 48 * 4] = bytes(48)
    field.write_bytes(bytes(data))


@pytest.mark.parametrize("what", ["root", "cache", "file"])
def test_a_cache_others_can_write_is_refused_unless_trusted(tmp_path: Path, what: str) -> None:
    """A root, cache directory or file writable by others: PermissionError naming the opt-in;
    trust_shared_cache=True opens it, and then checks every file's sha256 by default."""
    built = loopkit.preload(Images(), tmp_path / "team")
    _poison(built.path)
    target = {"root": tmp_path / "team", "cache": built.path, "file": built.path / "meta.json"}
    target[what].chmod(0o777 if target[what].is_dir() else 0o666)
    with pytest.raises(PermissionError, match="trust_shared_cache=True"):
        loopkit.preload(Images(), tmp_path / "team")
    with pytest.raises(RuntimeError, match=r"field0\.bin does not match the checksum"):
        loopkit.preload(Images(), tmp_path / "team", trust_shared_cache=True)
    opened = loopkit.preload(Images(), tmp_path / "team", trust_shared_cache=True, verify=False)
    assert not opened.built  # the caller said so: read as it is


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to give the cache to another user")
def test_a_cache_another_user_owns_is_refused(tmp_path: Path) -> None:
    """A cache directory owned by another user (mode 0755): PermissionError naming the owner."""
    built = loopkit.preload(Images(), tmp_path)
    os.chown(built.path, 65534, 65534)
    with pytest.raises(PermissionError, match="owned by uid 65534"):
        loopkit.preload(Images(), tmp_path)


def test_checksums_are_checked_with_verify_and_sizes_always(tmp_path: Path) -> None:
    """A changed byte: caught by verify=True (not by default in a private cache); a truncated
    file: refused on every open."""
    built = loopkit.preload(Images(), tmp_path)
    _poison(built.path)
    assert not loopkit.preload(Images(), tmp_path).built
    with pytest.raises(RuntimeError, match="does not match the checksum"):
        loopkit.preload(Images(), tmp_path, verify=True)
    field = built.path / "field1.bin"
    field.write_bytes(field.read_bytes()[:-8])
    with pytest.raises(RuntimeError, match=r"damaged: field1\.bin has 392 bytes, not 400"):
        loopkit.preload(Images(), tmp_path)


@pytest.mark.skipif(not os.path.exists("/proc/self/ns/pid"), reason="needs /proc (pids)")
def test_a_waiter_raises_when_the_builder_ended_without_finishing(tmp_path: Path) -> None:
    """The handoff file of local rank 0 names a pid that is gone: the waiter raises, not hangs;
    a file that says 'failed' is raised with the builder's error."""
    import json

    from loopkit._data import _cache_handoff

    announcer = _cache_handoff.Announcer(tmp_path, "data", "tok", 0)
    announcer.say("working")
    said = json.loads(announcer.path.read_text())
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    announcer.path.write_text(json.dumps({**said, "pid": gone.pid}))
    with pytest.raises(RuntimeError, match=f"pid {gone.pid}\\) ended without finishing"):
        _cache_handoff.wait_for(tmp_path, "data", "tok", 0)
    announcer.say("failed", error="ValueError: item 7 is broken")
    with pytest.raises(RuntimeError, match="could not build or open the cache: ValueError: item 7"):
        _cache_handoff.wait_for(tmp_path, "data", "tok", 0)


def test_a_posted_failure_is_raised_while_the_handoff_file_still_says_working(
    tmp_path: Path,
) -> None:
    """Local rank 0 (alive) could not rewrite its file: the error it posted in the store is
    raised at the first poll, not after a wait."""
    import threading

    from loopkit._data import _cache_handoff

    announcer = _cache_handoff.Announcer(tmp_path, "data", "tok", 0)
    announcer.say("working")
    # Bounds a waiter that reads only the file: after 3 s the file says something else.
    late = threading.Timer(3, announcer.say, ("failed",), {"error": "read from the file"})
    late.start()
    start = time.monotonic()
    try:
        with pytest.raises(RuntimeError, match=r"the cache: OSError: \[Errno 28\] full$"):
            _cache_handoff.wait_for(tmp_path, "data", "tok", 0, lambda: "OSError: [Errno 28] full")
    finally:
        late.cancel()
        late.join()
    assert time.monotonic() - start < 0.5


_FAILURES_AND_NODES = """
import datetime, errno, os, signal, sys, time, torch, loopkit
import torch.distributed as dist
from pathlib import Path
from torch.distributed import distributed_c10d
from loopkit import distributed
from loopkit._data import _preload
from loopkit._data._fields import spread
sys.path[:0] = ["tests", "tests/data"]
from test_preload import Images

out = Path(sys.argv[1])
UNSAMPLED = next(i for i in range(60) if i not in spread(60))  # not in the fingerprint's sample
tokens = []  # every call's store token, to look for its keys afterwards
_draw = _preload.job_token

def _recorded(local_rank):
    handoff = _draw(local_rank)
    tokens.append(handoff.token)
    return handoff

_preload.job_token = _recorded

def hung(signum, frame):
    raise TimeoutError("preload did not return within its bound: it hung")

signal.signal(signal.SIGALRM, hung)

def keys_left():
    '''The store keys of the calls so far that it still holds (as preload names them).'''
    store = distributed_c10d._get_default_store()
    return [k for t in tokens for k in (*(f"loopkit/preload/{t}/outcome/{r}" for r in range(2)),
                                        f"loopkit/preload/{t}/read") if store.check([k])]

left = []  # what each call left in the store as it returned, before any barrier

def call(dataset, root, key):
    '''preload bounded in time (a hang ends as a TimeoutError): (error or None, seconds).'''
    signal.alarm(10 if dist.get_rank() else 20)  # rank 0 outlives a hanging rank 1
    start = time.monotonic()
    try:
        loopkit.preload(dataset, root, key=key)
        return None, time.monotonic() - start
    except Exception as err:
        return err, time.monotonic() - start
    finally:
        signal.alarm(0)
        left.extend(keys_left())

raised = {}  # what rank 0's data set raised, to compare with what preload raised

class Flaky(Images):
    '''Rank `builder` only: item UNSAMPLED (read by the build, after the sample) raises.'''
    def __init__(self, full_disk, key="full-disk", builder=0):
        super().__init__(60)
        self.full_disk, self.key, self.builder = full_disk, key, builder
    def __getitem__(self, i):
        if i == UNSAMPLED and dist.get_rank() == self.builder:
            if self.full_disk:  # the disk is full: the builder cannot rewrite its handoff file
                handoff, = Path(sys.argv[1]).glob(f".{self.key}.job-*")
                os.mkdir(f"{handoff}.{os.getpid()}")
                raised["err"] = OSError(errno.ENOSPC, "No space left on device")
            else:
                raised["err"] = ValueError(f"item {i} cannot be decoded")
            raise raised["err"]
        return super().__getitem__(i)

class OneOff(Images):
    '''Rank 1's copy differs from rank 0's in one item the fingerprint does not sample.'''
    def __getitem__(self, i):
        x, y = super().__getitem__(i)
        return (x + 1 if i == UNSAMPLED and dist.get_rank() == 1 else x), y

def said(err):
    return "" if err is None else f"{type(err).__name__}: {err}"

with distributed.setup(timeout=datetime.timedelta(seconds=30)) as info:
    store = distributed_c10d._get_default_store()
    dist.barrier()
    keys_before = store.num_keys()
    result = {}
    for case, full_disk in (("raises", False), ("full_disk", True)):
        err, seconds = call(Flaky(full_disk), out, case.replace("_", "-"))
        result[case] = {"said": said(err), "seconds": seconds,
                        "original": err is not None and err is raised.get("err")}
    # A node whose ranks are numbered apart (as `srun -m cyclic` numbers them): rank 1 is local
    # rank 0 and builds; rank 0 waits for it, and learns of its failure with a full disk.
    os.environ.update(LOCAL_RANK=str(1 - info.rank))
    err, seconds = call(Images(60), out, "reversed")
    result["reversed"] = {"said": said(err), "seconds": seconds}
    err, seconds = call(Flaky(True, "reversed-full", builder=1), out, "reversed-full")
    result["reversed_full"] = {"said": said(err), "seconds": seconds,
                               "original": err is not None and err is raised.get("err")}
    os.environ.update(LOCAL_RANK=str(info.rank))
    # Two nodes (each rank its node's only one, LOCAL_RANK 0), each with its own root and
    # its own copy of the data: different salts (other fingerprints), one item the sample
    # misses (the same fingerprint), the same data.
    os.environ.update(LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    node = out / f"node{info.rank}"
    for case, data in (("salted", Images(60, salt=info.rank)), ("one_item", OneOff(60)),
                       ("same", Images(60))):
        err, _ = call(data, node, case)
        names = sorted(p.name for p in node.glob(case + "-*"))
        result[case] = {"said": said(err), "names": names}
    os.environ.update(LOCAL_RANK=str(info.rank), LOCAL_WORLD_SIZE="2")
    dist.barrier()  # every rank is out of every call: the last reader has deleted the keys
    result["keys"] = (keys_before, store.num_keys())
    result["calls"] = len(tokens)
    result["left"] = (left, keys_left())
    torch.save(result, out / f"rank{info.rank}.pt")
"""


@pytest.fixture(scope="module")
def failures_and_nodes(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Any]]:
    """One torchrun launch (2 gloo ranks) of _FAILURES_AND_NODES: its root and each rank's say."""
    out = tmp_path_factory.mktemp("preload-ranks")
    script = out / "failures.py"
    script.write_text(_FAILURES_AND_NODES)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(script), str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=120, env=launch_env(),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return out, [torch.load(out / f"rank{r}.pt", weights_only=True) for r in (0, 1)]


@deep
def test_a_failed_build_on_rank_0_reaches_the_waiting_rank_at_once(
    failures_and_nodes: tuple[Path, list[Any]],
) -> None:
    """The data set raises on rank 0 mid-build (with a full disk: no handoff file rewrite):
    rank 0 raises that very exception, rank 1 a RuntimeError naming it within seconds."""
    _, (a, b) = failures_and_nodes
    for case, error in (("raises", "ValueError: item 1 cannot be decoded"),
                        ("full_disk", "OSError: [Errno 28] No space left on device")):  # fmt: skip
        assert a[case]["said"] == error and a[case]["original"]
        assert b[case]["said"] == (
            f"RuntimeError: preload: local rank 0 could not build or open the cache: {error}"
        )
        assert b[case]["seconds"] < 5, b[case]  # not a timeout: it hangs 10 s to fail


def test_a_node_whose_ranks_are_numbered_apart_waits_for_its_own_local_rank_0(
    failures_and_nodes: tuple[Path, list[Any]],
) -> None:
    """Rank 1 is local rank 0 (srun -m cyclic numbers a node's ranks apart): rank 0 waits
    for rank 1's build and maps it, and learns of its failure (full disk) within seconds."""
    _, (a, b) = failures_and_nodes
    assert a["reversed"]["said"] == b["reversed"]["said"] == ""
    error = "OSError: [Errno 28] No space left on device"
    assert b["reversed_full"]["said"] == error and b["reversed_full"]["original"]
    assert a["reversed_full"]["said"] == (
        f"RuntimeError: preload: local rank 0 could not build or open the cache: {error}"
    )
    assert a["reversed_full"]["seconds"] < 5, a["reversed_full"]  # it hangs 10 s to fail


def test_nodes_whose_data_differ_are_refused_on_every_rank(
    failures_and_nodes: tuple[Path, list[Any]],
) -> None:
    """Two simulated nodes (LOCAL_RANK 0 each, own root) build from their own copies: other
    items, even one item the fingerprint misses (one name on both), are refused on both
    ranks, naming each node's cache; the same data is accepted."""
    out, results = failures_and_nodes
    for case in ("salted", "one_item"):
        for r, result in enumerate(results):
            said = result[case]["said"]
            assert said.startswith("RuntimeError: preload: the nodes' caches hold different data")
            for node in (0, 1):
                assert f"{out}/node{node}/{case}-" in said and f"rank {node} read" in said
            assert len(result[case]["names"]) == 1, (r, result[case])
    assert results[0]["one_item"]["names"] == results[1]["one_item"]["names"]
    assert results[0]["salted"]["names"] != results[1]["salted"]["names"]
    assert [r["same"]["said"] for r in results] == ["", ""]


def test_each_call_leaves_no_keys_in_the_store(failures_and_nodes: tuple[Path, list[Any]]) -> None:
    """Seven preload calls (built, failed, refused): as each returns, on either rank, the job's
    store holds none of its keys; at the end it has as many keys as before the first."""
    _, results = failures_and_nodes
    for result in results:
        assert result["calls"] == 7
        assert result["left"] == ([], [])
        before, after = result["keys"]
        assert after == before


@pytest.mark.parametrize("umask", [0o000, 0o077, 0o277])
def test_the_build_lock_is_owner_only_whatever_the_umask(tmp_path: Path, umask: int) -> None:
    """The lock file is mode 0600 under a permissive umask (0o000) and strict ones (0o077,
    0o277, which leaves a created file 0o400), held directly and by a build."""
    import stat

    from loopkit._data import _cache_files

    def lock_mode() -> int:
        (lock,) = tmp_path.glob(".*.lock")
        return stat.S_IMODE(lock.stat().st_mode)

    modes: list[int] = []

    def seen(item: Any) -> Any:  # during the build (under the lock) the lock file exists
        if list(tmp_path.glob(".*.lock")):
            modes.append(lock_mode())
        return item

    old = os.umask(umask)
    try:
        with _cache_files.build_lock(tmp_path, "direct") as locked:
            assert locked and lock_mode() == 0o600
        if not umask & 0o700:  # one taking the owner's bits: the build's mkdtemp is read-only
            cache = loopkit.preload(Images(20), tmp_path, transform=seen)
            assert cache.built
    finally:
        os.umask(old)
    if not umask & 0o700:
        assert len(modes) == 20 and set(modes) == {0o600}
