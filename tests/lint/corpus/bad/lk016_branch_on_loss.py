# expect: LK016
"""Keeping the best checkpoint by comparing the loss tensor every step."""
import torch


def train(model, loader, optimizer, loss_fn, best: float = float("inf")):
    model.cuda()
    for x, y in loader:
        optimizer.zero_grad()
        loss = loss_fn(model(x.cuda()), y.cuda())
        loss.backward()
        optimizer.step()
        if loss < best:  # <- LK016
            best = loss
            torch.save(model.state_dict(), "best.pt")
