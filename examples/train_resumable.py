"""A training run that can be killed at any moment and resumed to the same final weights.

    python examples/train_resumable.py --dir runs/demo          # run (or resume) to the end
    # kill it (Ctrl-C, SIGKILL, a lost node), run the same command again: it resumes

Checkpoints are written every --save-every optimizer updates (atomically: a crash during a
save leaves the previous ones intact) and hold the model, optimizer, scheduler, step
counters, GradScaler, RNG states and the position in the epoch. With --out, the final
weights are saved there, bit-identical to an uninterrupted run.

    python examples/train_resumable.py --dir runs/aug --augment --workers 2 --checkpointed

--augment trains on a data set that augments at random in __getitem__ (python, numpy and
torch RNGs) and has a random number of valid "tokens" per sample, weighted by that count:
resuming is exact there too, and with another --workers than the run started with.
"""

from __future__ import annotations

import argparse
import random
from typing import Any

import numpy as np
import torch
from torch import nn

import loopkit
from loopkit import distributed


class Payload:
    """Extra user state (here only ballast, to make saves take measurable time)."""

    def __init__(self, megabytes: int) -> None:
        self.data = torch.zeros(megabytes * 2**18)  # float32: 4 bytes each

    def state_dict(self) -> dict[str, Any]:
        return {"data": self.data}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.data = state["data"]


class Augmented(torch.utils.data.Dataset[tuple[torch.Tensor, ...]]):
    """Random augmentation drawn from python, numpy and torch, as real pipelines draw it."""

    def __init__(self, n: int) -> None:
        self.x, self.y = torch.randn(n, 16), torch.randn(n, 16)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, ...]:
        x = self.x[i].flip(0) if random.random() < 0.5 else self.x[i]
        x = x + torch.from_numpy(np.random.normal(0, 0.1, 16).astype(np.float32))
        x = x + 0.05 * torch.randn(16)
        valid = (torch.arange(16) < torch.randint(4, 17, ())).float()  # "tokens" in use
        return x, self.y[i], valid


class Block(nn.Sequential):
    def __init__(self) -> None:
        super().__init__(nn.Linear(64, 64), nn.GELU(), nn.Dropout(0.1))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", required=True, help="checkpoint directory")
    parser.add_argument("--precision", default="fp32", choices=["bf16", "fp16", "fp32"])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--save-every", type=int, default=3)
    parser.add_argument("--payload-mb", type=int, default=0)
    parser.add_argument("--out", help="save the final weights here")
    parser.add_argument("--augment", action="store_true", help="random augmentation, weights")
    parser.add_argument("--workers", type=int, default=0, help="data loader workers")
    parser.add_argument("--checkpointed", action="store_true", help="recompute the blocks")
    args = parser.parse_args(argv)

    with distributed.setup():
        torch.manual_seed(0)
        data: torch.utils.data.Dataset[Any]
        if args.augment:
            data = Augmented(512)
            model = nn.Sequential(nn.Linear(16, 64), Block(), Block(), nn.Linear(64, 16))
        else:
            data = torch.utils.data.TensorDataset(torch.randn(512, 16), torch.randn(512, 1))
            model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Dropout(0.1), nn.Linear(64, 1))
        loader = distributed.loader(data, batch_size=16, num_workers=args.workers, seed=1)
        if args.checkpointed:
            loopkit.checkpointed(model, blocks=Block)
        model = distributed.wrap(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.9)
        step = loopkit.step(
            model,
            optimizer,
            precision=args.precision,
            accumulate=4,
            clip_grad_norm=1.0,
            scheduler=scheduler,
            skip_nonfinite=args.precision != "fp16",
        )
        ckpt = loopkit.Checkpointer(
            args.dir,
            model=model,
            optimizer=optimizer,
            scheduler=scheduler,
            step=step,
            loader=loader,
            extra={"payload": Payload(args.payload_mb)},
            keep=2,
        )
        resumed = ckpt.resume()
        if resumed is not None:
            print(f"resumed from {resumed.name} at update {step.updates}", flush=True)
        for _ in range(loader.epoch, args.epochs):
            for batch in step.iterate(loader):
                with step as s:
                    if args.augment:  # a mean over the valid tokens, weighted by their count
                        x, y, valid = batch
                        err = (model(x).float() - y).pow(2) * valid
                        s.backward(err.sum() / valid.sum(), weight=valid.sum())
                    else:
                        x, y = batch
                        s.backward(nn.functional.mse_loss(model(x), y))
                saved = ckpt.maybe_save(every=args.save_every)
                if saved is not None:
                    print(f"saved {saved.name}", flush=True)
        # maybe_save defers a save that falls on an epoch's last window to the start of the
        # next pass (so it holds what ran after that window); no pass follows the last
        # epoch, so the final state is saved here.
        ckpt.save()
        if args.out and distributed.is_rank_zero():
            inner = getattr(model, "module", model)
            torch.save({k: v.detach().clone() for k, v in inner.state_dict().items()}, args.out)
        print(f"finished at update {step.updates}", flush=True)


if __name__ == "__main__":
    main()
