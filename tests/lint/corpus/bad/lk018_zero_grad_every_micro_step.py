# expect: LK018
"""Accumulation that does nothing: the gradients are cleared on every micro-step."""
N = 4


def train(model, loader, optimizer, loss_fn):
    for i, (x, y) in enumerate(loader):
        optimizer.zero_grad()  # <- LK018
        loss = loss_fn(model(x), y) / N
        loss.backward()
        if (i + 1) % N == 0 or i + 1 == len(loader):
            optimizer.step()
