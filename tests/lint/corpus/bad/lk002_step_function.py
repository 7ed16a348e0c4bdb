# expect: LK002
"""The step lives in a helper; the loop that calls it every step is a training loop too."""
import torch
from torch import nn


def train_step(model: nn.Module, batch, optimizer) -> float:
    x, y = batch
    optimizer.zero_grad(set_to_none=True)
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    return loss.item()  # <- LK002


def main(model, loader, optimizer):
    for epoch in range(3):
        for batch in loader:
            train_step(model, batch, optimizer)


DEVICE = "cuda"  # the loop runs on a GPU: each read-back waits for it
