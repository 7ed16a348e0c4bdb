# expect: LK009
"""Gradient accumulation by hand: the loss is divided by N, the step happens on i % N only."""
import torch
from torch import nn

accum_steps = 4


def train(model, loader, optimizer, epochs: int):
    criterion = nn.MSELoss()
    for epoch in range(epochs):
        for i, (x, y) in enumerate(loader):
            loss = criterion(model(x), y)
            loss = loss / accum_steps
            loss.backward()
            if (i + 1) % accum_steps == 0:  # <- LK009
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
