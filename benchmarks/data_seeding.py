"""What reproducible data randomness costs: loopkit's loader against a plain DataLoader.

A small-image data set (3x32x32 uint8 images in memory) whose ``__getitem__`` augments at
random, as a CIFAR pipeline does: a random horizontal flip (python's ``random``), a random
crop of a 4-pixel padded image (``torch.randint``) and a brightness jitter
(``np.random``). Batches of 256. The same data, batch size, shuffling and collate are read
by a plain ``DataLoader`` and by ``loopkit.distributed.loader``, whose only extra work is
to reseed python, numpy and torch from (seed, epoch, rank, batch index) before each batch
(and, in the main process, to put the training RNGs back after it). Epochs run
interleaved; the script prints the median samples per second of each and their ratio, and,
since a shared machine's epoch times drift by more than the difference, the reseeding's
own time per batch (timed alone over many repetitions) as a share of a batch's time.

    python benchmarks/data_seeding.py [--quick] [--json] [--workers 0 2]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from loopkit import distributed
from loopkit._data._seeding import seeded_rngs


class SmallImages(Dataset[tuple[torch.Tensor, int]]):
    """CIFAR-sized uint8 images with the usual random flip, padded crop and jitter."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.images = torch.randint(0, 256, (n, 3, 32, 32), dtype=torch.uint8, generator=g)
        self.labels = torch.randint(0, 10, (n,), generator=g).tolist()

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        image = self.images[i]
        if random.random() < 0.5:
            image = image.flip(-1)
        padded = torch.nn.functional.pad(image, (4, 4, 4, 4))
        top, left = torch.randint(0, 9, (2,)).tolist()
        image = padded[:, top : top + 32, left : left + 32]
        shift = int(np.random.randint(-16, 17))
        return (image.int() + shift).clamp_(0, 255).to(torch.uint8), self.labels[i]


def _epoch(loader: Any) -> float:
    start = time.perf_counter()
    n = 0
    for images, _ in loader:
        n += images.shape[0]
    return n / (time.perf_counter() - start)


def seeding_us_per_batch(repeats: int = 2000) -> float:
    """The reseed and restore of one batch in the main process, timed alone (median of 5)."""
    times = []
    for _ in range(5):
        start = time.perf_counter()
        for k in range(repeats):
            with seeded_rngs((0, 1, 0, k)):
                pass
        times.append((time.perf_counter() - start) / repeats)
    return 1e6 * statistics.median(times)


def measure(workers: int, n: int, epochs: int) -> dict[str, Any]:
    data = SmallImages(n)
    plain = DataLoader(
        data,
        batch_size=256,
        shuffle=True,
        num_workers=workers,
        persistent_workers=workers > 0,
        generator=torch.Generator().manual_seed(0),
    )
    seeded = distributed.loader(data, batch_size=256, num_workers=workers, seed=0)
    _epoch(plain), _epoch(seeded)  # warm-up: workers started, caches filled
    rates: dict[str, list[float]] = {"plain": [], "seeded": []}
    for _ in range(epochs):  # interleaved, so drift on the machine hits both alike
        rates["plain"].append(_epoch(plain))
        rates["seeded"].append(_epoch(seeded))
    plain_rate = statistics.median(rates["plain"])
    seeded_rate = statistics.median(rates["seeded"])
    seeding = seeding_us_per_batch()
    batch_us = 1e6 * 256 / plain_rate
    return {
        "workers": workers,
        "samples": n,
        "batch": 256,
        "plain_samples_per_s": round(plain_rate),
        "loopkit_samples_per_s": round(seeded_rate),
        "ratio": round(seeded_rate / plain_rate, 4),
        "cost_percent": round(100 * (plain_rate / seeded_rate - 1), 2),
        "seeding_us_per_batch": round(seeding, 1),
        # In a worker the reseed runs beside the main process; with 0 workers it is added.
        "seeding_share_percent": round(100 * seeding / batch_us, 2),
    }


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    n, epochs = (2048, 2) if args.quick else (10240, 11)
    rows = [measure(w, n, epochs) for w in args.workers]
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(f"torch {torch.__version__}, {n} images of 3x32x32, batch 256, median of {epochs}\n")
        print(
            "| workers | plain DataLoader (samples/s) | loopkit loader | ratio | "
            "reseeding per batch | its share of a batch |"
        )
        print("|---|---|---|---|---|---|")
        for r in rows:
            print(
                f"| {r['workers']} | {r['plain_samples_per_s']:,} | "
                f"{r['loopkit_samples_per_s']:,} | {r['ratio']:.3f} | "
                f"{r['seeding_us_per_batch']:.0f} us | {r['seeding_share_percent']:.2f}% |"
            )
    return rows


if __name__ == "__main__":
    main()
