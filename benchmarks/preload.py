"""Preloading: a decode-per-sample image folder against loopkit.preload's mapped uint8 cache.

The benchmark writes its own image folder (N small RGB PNGs, Pillow), then measures, in
one run:

- throughput: samples per second over one epoch after a first (warm) one, batch 256,
  shuffled: a plain DataLoader over a Dataset that decodes each PNG in ``__getitem__`` (at
  its best ``num_workers`` here), ``loopkit.distributed.loader`` over the same, and
  ``distributed.loader`` over ``loopkit.preload`` of it (one index operation per batch);
- memory: the total proportional set size (PSS, from /proc/<pid>/smaps_rollup) of a fresh
  process and its loader workers after an epoch, with 0, 2 and 4 workers, for the mapped
  cache and for the same images held as a Python list of tensors, less that of the same
  processes looping over one image (what the processes cost whatever the data);
- build cost: the time to build the cache, and to open it again (a second run);
- against the floor: the raw gather (one ``index_select`` per field over the same mapped
  cache, a shuffled epoch in batches of 256, nothing else) next to ``distributed.loader``
  over the cache (0 workers, one thread) and the same loader with a pass-through
  ``collate_fn`` (which makes it reseed the RNGs per batch), interleaved and repeated:
  their rates, the ratio to the gather and the microseconds per batch above it.

    python benchmarks/preload.py [--quick] [--json]

Needs Pillow (``pip install -e ".[bench]"``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

import loopkit
from loopkit import distributed

BATCH = 256


class PngFolder(Dataset[tuple[torch.Tensor, int]]):
    """What a user has: one PNG per sample, decoded in __getitem__ (label in the name)."""

    def __init__(self, root: Path) -> None:
        self.files = sorted(root.glob("*.png"))

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        from PIL import Image

        path = self.files[i]
        with Image.open(path) as im:
            pixels = np.array(im.convert("RGB"), dtype=np.uint8)  # a writable copy
        return torch.from_numpy(pixels).permute(2, 0, 1).contiguous(), int(path.stem.split("_")[1])


class TensorList(Dataset[tuple[torch.Tensor, int]]):
    """The usual hand-made preload: every decoded image kept in a Python list."""

    def __init__(self, source: Dataset[tuple[torch.Tensor, int]], n: int) -> None:
        self.items = [source[i] for i in range(n)]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.items[i]


def write_images(root: Path, n: int, size: int) -> None:
    from PIL import Image

    root.mkdir(parents=True, exist_ok=True)
    if len(list(root.glob("*.png"))) == n:
        return
    rng = np.random.default_rng(0)
    for i in range(n):
        # Smooth random images (a gradient plus noise) compress like small photos do.
        base = np.linspace(0, 255, size, dtype=np.float32)[None, :, None]
        img = base + rng.normal(0, 40, (size, size, 3)).astype(np.float32)
        Image.fromarray(img.clip(0, 255).astype(np.uint8)).save(root / f"{i:06d}_{i % 10}.png")


def epoch_rate(loader: Any) -> float:
    """Samples per second over the second of two epochs (the first warms the workers)."""
    rate = 0.0
    for _ in range(2):
        seen = 0
        start = time.perf_counter()
        for x, _ in loader:
            seen += len(x)
        rate = seen / (time.perf_counter() - start)
    return rate


def gather_epoch(cache: Any) -> float:
    """Samples per second of the floor: one index_select per field per shuffled batch."""
    n, fields = len(cache), cache.tensors
    order = torch.randperm(n)
    start = time.perf_counter()
    for at in range(0, n, BATCH):
        idx = order[at : at + BATCH]
        batch = [torch.index_select(f, 0, idx) for f in fields]
    del batch
    return n / (time.perf_counter() - start)


def loader_epoch(loader: Any) -> float:
    """Samples per second of one pass (what the loop sees: the batches, nothing done)."""
    seen = 0
    start = time.perf_counter()
    for x, _ in loader:
        seen += len(x)
    return seen / (time.perf_counter() - start)


def pass_through(batch: Any) -> Any:
    """A collate_fn that only returns the batch: what the per-batch reseed alone costs."""
    return batch


def against_the_gather(cache: Any, repeats: int) -> dict[str, Any]:
    """The gather, the loader and the loader with a collate_fn, interleaved ``repeats``
    times (after one warm pass each): median rates, ratios to the gather, and the
    microseconds per batch each loader spends above it."""
    plain = distributed.loader(cache, batch_size=BATCH, seed=0)
    reseeded = distributed.loader(cache, batch_size=BATCH, seed=0, collate_fn=pass_through)
    runs: dict[str, list[float]] = {"gather": [], "loader": [], "loader + collate_fn": []}
    for r in range(repeats + 1):
        rates = (gather_epoch(cache), loader_epoch(plain), loader_epoch(reseeded))
        if r:  # the first round warms the page cache and the allocator
            for name, rate in zip(runs, rates, strict=True):
                runs[name].append(rate)
    median = {name: float(np.median(rates)) for name, rates in runs.items()}
    per_batch = {name: (BATCH / median[name] - BATCH / median["gather"]) * 1e6
                 for name in runs if name != "gather"}  # fmt: skip
    ratios = {name: [a / g for a, g in zip(rates, runs["gather"], strict=True)]
              for name, rates in runs.items() if name != "gather"}  # fmt: skip
    return {"samples_per_s": median, "runs": runs, "ratio_runs": ratios,
            "ratio": {name: float(np.median(r)) for name, r in ratios.items()},
            "us_per_batch_above_gather": per_batch}  # fmt: skip


def pss_mib(pids: list[int]) -> float:
    """Total proportional set size of ``pids`` in MiB (shared pages split among sharers)."""
    total = 0
    for pid in pids:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                total += int(line.split()[1])
    return total / 1024


def children() -> list[int]:
    pids: list[int] = []
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        text = (task / "children").read_text().split()
        pids += [int(p) for p in text]
    return pids


def memory_after_an_epoch(kind: str, workers: int, images: Path, cache_dir: Path) -> float:
    """Total PSS (MiB) of a fresh process holding the data set one way, and its workers,
    after a full epoch (workers kept alive). A fresh process, so no other data set counts."""
    code = (
        "import sys; sys.path.insert(0, 'benchmarks'); import preload as b; "
        f"print(b._measure({kind!r}, {workers}, {str(images)!r}, {str(cache_dir)!r}))"
    )
    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True,
                         text=True, check=True, env=env)  # fmt: skip
    return float(out.stdout.strip().splitlines()[-1])


def _measure(kind: str, workers: int, images: str, cache_dir: str) -> float:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message=".*worker processes in total")  # 4 on 2 cores
    folder = PngFolder(Path(images))
    loader: Any
    if kind == "preload":
        cache = loopkit.preload(folder, cache_dir)
        loader = distributed.loader(cache, batch_size=BATCH, num_workers=workers,
                                    persistent_workers=workers > 0)  # fmt: skip
    else:
        # "none": the same loop over one image, what the processes cost whatever the data.
        n = len(folder)
        listed: Any = [folder[0]] * n if kind == "none" else TensorList(folder, n)
        loader = DataLoader(listed, batch_size=BATCH, shuffle=True, num_workers=workers,
                            persistent_workers=workers > 0)  # fmt: skip
    for _ in loader:
        pass
    return pss_mib([os.getpid(), *children()])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="2,000 images, not 20,000; memory at 0, 2 workers"
    )
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--size", type=int, default=32, help="image side in pixels")
    parser.add_argument("--dir", help="where to write the images and the cache (kept)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    n = 2000 if args.quick else 20000
    work = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="loopkit-preload-"))
    images = work / f"png-{n}-{args.size}"
    write_images(images, n, args.size)
    folder = PngFolder(images)
    cache_dir = work / "cache"
    shutil.rmtree(cache_dir, ignore_errors=True)

    start = time.perf_counter()
    cache = loopkit.preload(folder, cache_dir)
    build_s = time.perf_counter() - start
    start = time.perf_counter()
    reopened = loopkit.preload(folder, cache_dir)
    open_s = time.perf_counter() - start
    assert cache.built and not reopened.built

    plain = {}
    for workers in (0, 2) if args.quick else (0, 1, 2):
        dl = DataLoader(folder, batch_size=BATCH, shuffle=True, num_workers=workers,
                        persistent_workers=workers > 0)  # fmt: skip
        plain[workers] = epoch_rate(dl)
        del dl
    best = max(plain, key=lambda w: plain[w])
    rates = {
        f"DataLoader, decode per sample ({best} workers)": plain[best],
        f"distributed.loader, decode per sample ({best} workers)": epoch_rate(
            distributed.loader(folder, batch_size=BATCH, num_workers=best)
        ),
        "distributed.loader over preload (0 workers)": epoch_rate(
            distributed.loader(cache, batch_size=BATCH)
        ),
    }
    floor = against_the_gather(cache, 3 if args.quick else 9)
    memory = {}
    for workers in (0, 2) if args.quick else (0, 2, 4):
        bare = memory_after_an_epoch("none", workers, images, cache_dir)
        memory[workers] = {
            "preload": memory_after_an_epoch("preload", workers, images, cache_dir) - bare,
            "list of tensors": memory_after_an_epoch("list", workers, images, cache_dir) - bare,
            "processes": bare,
        }
    result = {
        "images": n,
        "size": args.size,
        "png_mib": sum(p.stat().st_size for p in images.glob("*.png")) / 2**20,
        "cache_mib": cache.nbytes / 2**20,
        "build_s": build_s,
        "open_s": open_s,
        "plain_by_workers": plain,
        "samples_per_s": rates,
        "pss_mib": memory,
        "against_the_gather": floor,
    }
    if not args.dir:
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        print(json.dumps(result, indent=2))
        return result
    base = plain[best]
    print(f"{n} PNG images {args.size}x{args.size} RGB ({result['png_mib']:.1f} MiB of files), "
          f"batch {BATCH}, torch {torch.__version__}, {os.cpu_count()} cores\n")  # fmt: skip
    print("| loader | samples/s | ratio to the DataLoader |\n|---|---|---|")
    for name, rate in rates.items():
        print(f"| {name} | {rate:,.0f} | {rate / base:.2f}x |")
    print("\nplain DataLoader by workers: "
          + ", ".join(f"{w}: {r:,.0f}/s" for w, r in plain.items()))  # fmt: skip
    print(f"build: {build_s:.2f} s for {result['cache_mib']:.1f} MiB; open again: "
          f"{open_s * 1000:.0f} ms\n")  # fmt: skip
    g = floor["samples_per_s"]["gather"]
    print(f"Against the floor (one index_select per field, batch {BATCH}, 0 workers, 1 thread; "
          f"median of {len(floor['runs']['gather'])} interleaved epochs)\n")  # fmt: skip
    print("| contender | samples/s | ratio to the gather | us per batch above it | "
          "ratio in each run |\n|---|---|---|---|---|")  # fmt: skip
    print(f"| raw gather | {g:,.0f} | 1.00 | 0 | |")
    for name, ratio in floor["ratio"].items():
        runs = ", ".join(f"{r:.2f}" for r in floor["ratio_runs"][name])
        print(
            f"| distributed.loader{name[6:]} | {floor['samples_per_s'][name]:,.0f} | "
            f"{ratio:.2f} | {floor['us_per_batch_above_gather'][name]:.0f} | {runs} |"
        )
    print("\nThe collate_fn row pays the per-batch reseed (python's, numpy's and torch's RNGs "
          "saved, seeded from the batch's key and put back: numpy's and python's state copies "
          "are most of it); without a collate_fn a gather draws no random number, so the "
          "loader skips it.\n")  # fmt: skip
    print("PSS of the main process and its workers after an epoch, above the same processes "
          "looping over a single image (MiB)\n")  # fmt: skip
    print("| workers | preload cache | list of tensors | the processes themselves |")
    print("|---|---|---|---|")
    for workers, row in memory.items():
        print(f"| {workers} | {row['preload']:.1f} | {row['list of tensors']:.1f} "
              f"| {row['processes']:.0f} |")  # fmt: skip
    return result


if __name__ == "__main__":
    main()
