"""Train from a preloaded cache: decode once, then every batch is one index operation.

    python examples/train_preloaded.py --cache /tmp/loopkit-cache     # builds, then trains
    python examples/train_preloaded.py --cache /tmp/loopkit-cache     # opens it, trains

The data set "decodes" a small image per item (here: draws it from the item's index, the
way a PNG decode turns a file into pixels). loopkit.preload runs that once into uint8
tensors mapped from the cache directory (under torchrun, once per node); the loader
batches them with one index operation and draws which images to flip (batch-level
augmentation, a function of the seed, epoch and batch index); the step turns the uint8
pixels into normalized floats on the device, where the flips are applied.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

import loopkit
from loopkit import distributed


class Shapes(torch.utils.data.Dataset[tuple[torch.Tensor, int]]):
    """4,000 16x16 RGB images of a bright square whose corner is the label."""

    def __len__(self) -> int:
        return 4000

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        g = torch.Generator().manual_seed(i)
        label = i % 4
        img = torch.randint(0, 60, (3, 16, 16), generator=g, dtype=torch.uint8)
        r, c = divmod(label, 2)
        img[:, r * 8 : r * 8 + 8, c * 8 : c * 8 + 8] += 150
        return img, label


def draw_flips(batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """The augmentation's random draws, made in the loader under the batch's RNG key (so a
    function of seed, epoch and batch index); they are applied on the device, in the loop."""
    x, y = batch
    return x, y, torch.rand(len(x)) < 0.5


def flipped(x: torch.Tensor, y: torch.Tensor, flip: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Flip the drawn images up-down (on the device, after normalization) and relabel them."""
    x = torch.where(flip[:, None, None, None], x.flip(2), x)
    return x, torch.where(flip, (y + 2) % 4, y)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--cache", help="cache directory (default: /dev/shm/loopkit-preload-<uid>, private to you)"
    )
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--precision", default="bf16", choices=["bf16", "fp32"])
    args = parser.parse_args(argv)

    with distributed.setup() as info:
        cache = loopkit.preload(Shapes(), args.cache, key="shapes-16px")
        if info.is_rank_zero:
            print(f"{'built' if cache.built else 'opened'} {cache}", flush=True)
        loader = distributed.loader(cache, batch_size=64, seed=0, collate_fn=draw_flips)
        torch.manual_seed(0)
        model = distributed.wrap(nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
            nn.Flatten(), nn.Linear(32, 4),
        ))  # fmt: skip
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        step = loopkit.step(
            model,
            optimizer,
            precision=args.precision,
            uint8_to=torch.float32,  # on the device: uint8 -> float in [0, 1] ...
            normalize=([0.3] * 3, [0.3] * 3),  # ... then (x - mean) / std
        )
        accuracy = 0.0
        for epoch in range(args.epochs):
            right = seen = 0
            for batch in step.iterate(loader):
                x, y = flipped(*batch)  # on the device: x is normalized float already
                with step as s:
                    out = model(x)
                    s.backward(nn.functional.cross_entropy(out.float(), y))
                right += int((out.argmax(1) == y).sum())  # a host read: fine for a demo
                seen += len(y)
            accuracy = right / seen
            if info.is_rank_zero:
                print(f"epoch {epoch}: train accuracy {accuracy:.3f}", flush=True)
        if info.is_rank_zero:
            print(f"final accuracy {accuracy:.3f}", flush=True)


if __name__ == "__main__":
    main()
