# expect: LK015
"""A running loss that sums the loss tensors themselves: every graph stays alive."""


def train(model, loader, optimizer, loss_fn):
    total_loss = 0
    for x, y in loader:
        optimizer.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        total_loss += loss  # <- LK015
    return total_loss / len(loader)
