"""preload: built once, mapped by all, never stale, never half-built; batches in one index."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import ROOT, launch_env
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
    batch = cache.__getitems__([4, 2])
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
    assert [p.name.startswith(".") for p in tmp_path.iterdir()] == [True]  # only the temporary

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
import hashlib, sys, torch, loopkit
from loopkit import distributed
sys.path[:0] = ["tests", "tests/data"]
from test_preload import Images
with distributed.setup() as info:
    cache = loopkit.preload(Images(300), sys.argv[1])
    digest = hashlib.sha256(b"".join(t.numpy().tobytes() for t in cache.tensors)).hexdigest()
    x, _ = next(iter(distributed.loader(cache, batch_size=16, seed=2)))
    torch.save({"built": cache.built, "digest": digest, "first": x},
               f"{sys.argv[1]}/rank{info.rank}.pt")
"""


def test_under_torchrun_one_build_and_both_ranks_read_the_same_bytes(tmp_path: Path) -> None:
    """Two ranks on one node: local rank 0 builds, rank 1 waits and maps the same files;
    the loader shards the cache (the ranks' first batches differ)."""

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
    builds = [p for p in tmp_path.iterdir() if p.is_dir()]
    assert len(builds) == 1 and not list(tmp_path.glob(".*tmp*"))


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

    from loopkit._data import _preload

    shm, tmp = tmp_path / "shm", tmp_path / "tmp"
    shm.mkdir()
    tmp.mkdir()
    monkeypatch.setattr(_preload, "_SHM", shm)
    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp))
    in_ram = loopkit.preload(Images(), key="ram")
    assert in_ram.path.parent == shm / "loopkit-preload"
    monkeypatch.setattr(_preload, "_free", lambda d: 10 if d.is_relative_to(shm) else 10**12)
    on_disk = loopkit.preload(Images(), key="disk")
    assert on_disk.path.parent == tmp / "loopkit-preload" and on_disk.built
    assert not loopkit.preload(Images(), key="ram").built  # found where it was built
