"""Keep an average of the weights and validate it: loopkit.ema in a bf16 training loop.

    python examples/train_ema.py                     # one process
    torchrun --standalone --nproc-per-node 2 examples/train_ema.py

A small MLP learns a noisy regression with a learning rate high enough that the weights
jitter from update to update; their exponential moving average does not, and validates
better. The average is fp32 although the model trains in bf16 weights (a bf16 copy at decay
0.999 would round most updates away), is updated once per optimizer update (4 micro-batches
here, never per micro-batch), and is validated every few updates with ``swapped()``, which
puts the training weights back bit for bit afterwards. Under DDP each rank keeps the same
average with no communication.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

import loopkit
from loopkit import distributed


def noisy_regression(n: int, seed: int) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g)
    y = x[:, :4].sum(1, keepdim=True).sin() + 0.5 * torch.randn(n, 1, generator=g)
    return torch.utils.data.TensorDataset(x, y)


def squared_error(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> dict[str, torch.Tensor]:
    x, y = batch
    return {"loss": (model(x).float() - y).pow(2).mean(dim=1)}


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--decay", type=float, default=0.98)
    parser.add_argument("--lr", type=float, default=0.3)
    args = parser.parse_args(argv)

    with distributed.setup():
        torch.manual_seed(0)
        model: nn.Module = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 1))
        model = model.to(torch.bfloat16)
        model = distributed.wrap(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
        average = loopkit.ema(model, decay=args.decay, warmup=True)  # fp32 beside bf16
        step = loopkit.step(model, optimizer, precision="bf16", accumulate=4, ema=average)
        loader = distributed.loader(noisy_regression(2048, 0), batch_size=16, seed=0)
        val_loader = distributed.loader(noisy_regression(512, 1), batch_size=128, shuffle=False)
        validate = loopkit.cadence(step, per_epoch=2, loader=loader)
        last: dict[str, float] = {}
        for _ in loopkit.until(step, max_epochs=args.epochs).epochs(loader):
            for x, y in step.iterate(loader):
                with step as s:
                    s.backward(nn.functional.mse_loss(model(x).float(), y))
                if validate.due():
                    raw = loopkit.evaluate(model, val_loader, squared_error, step=step)["loss"]
                    with average.swapped():  # the average in the model, then the weights back
                        ema_eval = loopkit.evaluate(model, val_loader, squared_error, step=step)
                    smooth = ema_eval["loss"]
                    last = {"weights": raw, "ema": smooth}
                    if distributed.is_rank_zero():
                        print(f"update {step.updates:4d}: validation loss {raw:.4f}, "
                              f"its EMA {smooth:.4f} ({average.updates} averages)")  # fmt: skip
        return last


if __name__ == "__main__":
    main()
