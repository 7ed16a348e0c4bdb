# expect: LK010
"""Zeroing gradients by writing zeros into them, every step."""
import torch


def train(model, loader, optimizer):
    for x, y in loader:
        optimizer.zero_grad(set_to_none=False)  # <- LK010
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()


def finetune(model, loader, optimizer):
    for x, y in loader:
        model.zero_grad(False)  # <- LK010
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
