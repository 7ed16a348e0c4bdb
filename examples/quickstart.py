"""Train a small MLP on synthetic regression data on the CPU with loopkit.

The loop is an ordinary ``for`` loop around ``loopkit.step``, which adds bf16 autocast, the
batch transfer, the update and logging that reads the device once every 50 steps instead of
calling ``.item()`` each step.

    python examples/quickstart.py [--steps 300] [--precision bf16] [--progress plain]
        [--csv runs/quickstart.csv]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
from torch import nn

import loopkit


def main(argv: list[str] | None = None) -> tuple[float, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--precision", default="bf16", choices=["bf16", "fp16", "fp32"])
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--csv", help="also write the logged metrics here (loopkit.CSVSink)")
    parser.add_argument(
        "--progress", choices=["off", "plain", "tqdm"], default="off",
        help="show updates, samples/s, an ETA and the last loss (rank zero)",
    )  # fmt: skip
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    device = torch.device("cpu")
    # Synthetic data: y = sin(x @ w) plus noise, kept in host memory like a real data set.
    w_true = 0.2 * torch.randn(32, 1)
    inputs = torch.randn(args.steps * args.batch_size, 32)
    targets = torch.sin(inputs @ w_true) + 0.05 * torch.randn(len(inputs), 1)
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(inputs, targets), batch_size=args.batch_size, shuffle=True
    )

    model = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 1)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    history: list[float] = []

    def report(metrics: dict[str, float], *, step: int) -> None:
        history.append(metrics["loss"])
        print(f"step {step:4d}  loss {metrics['loss']:.4f}")

    sinks: list[Callable[..., object]] = [report]
    if args.csv:
        sinks.append(loopkit.CSVSink(args.csv))  # step = optimizer updates, + epoch, samples
    log = loopkit.detach_logging(every=50, sink=sinks)
    # One object composes autocast, the transfer of each batch, the update and the logging.
    step = loopkit.step(model, optimizer, precision=args.precision, device=device, log=log)
    progress = False if args.progress == "off" else args.progress
    for x, y in step.iterate(loader, progress=progress):
        with step as s:
            s.backward(nn.functional.mse_loss(model(x), y))  # logged detached: no host sync
    log.close()
    first, last = history[0], history[-1]
    print(f"loss went from {first:.4f} to {last:.4f} in {log.step} steps ({args.precision})")
    return first, last


if __name__ == "__main__":
    main()
