# expect: LK008, LK014
"""Validation that switches to eval mode but leaves autograd on."""
import torch
from torch import nn


def evaluate(model: nn.Module, loader, device) -> float:
    model.eval()
    correct = total = 0
    for images, labels in loader:
        images, labels = images.to(device), labels.to(device)
        outputs = model(images)  # <- LK008
        correct += (outputs.argmax(dim=1) == labels).sum().item()  # <- LK014
        total += labels.numel()
    model.train()
    return correct / total


class Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(16, 4)

    def forward(self, x):
        return self.net(x)

    def predict(self, x):
        self.eval()
        return self(x).argmax(-1)  # <- LK008
