# expect: LK001
"""Image classification: keeps every step's loss to average it at the end of the epoch."""
import torch
from torch import nn


def train_one_epoch(model: nn.Module, loader, optimizer, device):
    criterion = nn.CrossEntropyLoss()
    losses = []
    model.train()
    for images, labels in loader:
        images = images.to(device, non_blocking=True)
        labels = labels.to(device, non_blocking=True)
        optimizer.zero_grad(set_to_none=True)
        loss = criterion(model(images), labels)
        loss.backward()
        optimizer.step()
        losses.append(loss)  # <- LK001
    return torch.stack(losses).mean()
