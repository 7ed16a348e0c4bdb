# expect: LK002
"""The tutorial habit: read the loss and the accuracy back to the host on every step."""
import torch
from torch import nn


def train(model: nn.Module, loader, optimizer, device, epochs: int = 10):
    criterion = nn.CrossEntropyLoss()
    for epoch in range(epochs):
        running_loss = 0.0
        correct = 0
        for inputs, targets in loader:
            inputs, targets = inputs.to(device), targets.to(device)
            optimizer.zero_grad()
            outputs = model(inputs)
            loss = criterion(outputs, targets)
            loss.backward()
            optimizer.step()
            running_loss += loss.item()  # <- LK002
            correct += (outputs.argmax(1) == targets).sum().cpu().numpy()  # <- LK002
        # once per epoch: not flagged
        print(f"epoch {epoch}: loss {running_loss / len(loader):.3f} acc {correct}")
