"""Known, deliberate habits, silenced on their line."""  # clean: LK001, LK002, LK003
import torch
from torch import nn


def train(model, loader, optimizer, device):
    losses = []
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        print(loss.item())  # loopkit: ignore
        losses.append(loss)  # loopkit: ignore[LK001]
        torch.cuda.empty_cache()  # loopkit: ignore[LK003, LK002]
    return losses
