# expect: LK008
"""A validation function called every epoch with autograd on (model.eval() is in the caller)."""
import torch


def validate(model, loader, device):
    total = 0.0
    for x, y in loader:
        out = model(x.to(device))  # <- LK008
        total += torch.nn.functional.cross_entropy(out, y.to(device), reduction="sum")
    return total / len(loader.dataset)


def train(model, loader, val_loader, optimizer, device, epochs):
    for epoch in range(epochs):
        model.train()
        for x, y in loader:
            loss = torch.nn.functional.cross_entropy(model(x.to(device)), y.to(device))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        model.eval()
        print(epoch, validate(model, val_loader, device))
