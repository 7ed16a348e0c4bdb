"""A GAN trained with one loopkit.step per optimizer: pytorch/examples' DCGAN loop, kept as is.

    python examples/train_gan.py                                  # one process
    torchrun --standalone --nproc-per-node 2 examples/train_gan.py   # DDP

As in the original, ``fake = G(noise)`` is computed once per batch, D learns from ``real``
and ``fake.detach()`` in two backward passes (the label tensor is refilled in place
between them), and G learns through D. loopkit adds: gradient accumulation whose windows
close on the same batches for both models (``loopkit.steps``), D frozen inside G's step
(no gradient into D, no all-reduce of D), one all-reduce per model per window under DDP,
and bf16 autocast for every forward. The toy data are 2-D points on a ring; the noise
lives in the data set, so one process and two end at the same weights.
"""

from __future__ import annotations

import argparse
import itertools
import math

import torch
from torch import nn

import loopkit
from loopkit import distributed

NZ = 8  # noise dimension


class Ring(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Points on a noisy ring, each with the generator noise for its batch slot."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(0)
        angle = 2 * math.pi * torch.rand(n, generator=g)
        self.points = torch.stack([angle.cos(), angle.sin()], 1) + 0.05 * torch.randn(
            n, 2, generator=g
        )
        self.noise = torch.randn(n, NZ, generator=g)

    def __len__(self) -> int:
        return len(self.points)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.points[i], self.noise[i]


def mlp(sizes: list[int]) -> nn.Sequential:
    layers: list[nn.Module] = []
    for a, b in itertools.pairwise(sizes):
        layers += [nn.Linear(a, b), nn.LeakyReLU(0.2)]
    return nn.Sequential(*layers[:-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--accumulate", type=int, default=2)
    parser.add_argument("--precision", default="bf16", choices=["bf16", "fp16", "fp32"])
    parser.add_argument("--out", help="save both models' final weights here")
    args = parser.parse_args(argv)

    with distributed.setup() as info:
        torch.manual_seed(0)
        netG = distributed.wrap(mlp([NZ, 32, 32, 2]))
        netD = distributed.wrap(mlp([2, 32, 32, 1]))
        optimizerD = torch.optim.Adam(netD.parameters(), lr=2e-4, betas=(0.5, 0.999))
        optimizerG = torch.optim.Adam(netG.parameters(), lr=2e-4, betas=(0.5, 0.999))
        criterion = nn.BCEWithLogitsLoss()
        loader = distributed.loader(Ring(512), global_batch_size=32, num_workers=0, seed=1)

        d_step = loopkit.step(netD, optimizerD, precision=args.precision,
                              accumulate=args.accumulate)  # fmt: skip
        g_step = loopkit.step(netG, optimizerG, precision=args.precision,
                              accumulate=args.accumulate, frozen=[netD])  # fmt: skip
        gan = loopkit.steps(d_step, g_step)
        log = loopkit.detach_logging(every=16, sync_ranks=True)
        for _ in range(args.epochs):
            for real, noise in gan.iterate(loader):
                # (1) Update D: maximize log(D(x)) + log(1 - D(G(z)))
                with d_step as s:
                    label = torch.ones(real.shape[0], 1)
                    errD_real = criterion(netD(real).float(), label)
                    s.backward(errD_real)
                    fake = netG(noise)
                    label.fill_(0.0)  # the original's in-place label reuse
                    errD_fake = criterion(netD(fake.detach()).float(), label)
                    s.backward(errD_fake)
                # (2) Update G: maximize log(D(G(z))), D frozen
                with g_step as s:
                    label.fill_(1.0)
                    errG = criterion(netD(fake).float(), label)
                    s.backward(errG)
                log(loss_d=errD_real + errD_fake, loss_g=errG)
        log.flush()
        if info.is_rank_zero:
            print(f"done on {info.world_size} process(es): D {d_step.updates} updates, "
                  f"G {g_step.updates} updates", flush=True)  # fmt: skip
            if args.out:
                state = {f"{name}.{k}": v.detach().cpu()
                         for name, net in (("G", netG), ("D", netD))
                         for k, v in getattr(net, "module", net).state_dict().items()}  # fmt: skip
                torch.save(state, args.out)


if __name__ == "__main__":
    main()
