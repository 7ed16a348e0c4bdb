# expect: LK013
"""The number of batches taken by loading them all (language_translation's main.py)."""


def train_epoch(model, train_dl, optimizer):
    losses = 0.0
    for src, tgt in train_dl:
        loss = model(src, tgt)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses += loss.detach()
    return losses / len(list(train_dl))  # <- LK013
