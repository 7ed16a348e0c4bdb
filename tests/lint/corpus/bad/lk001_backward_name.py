# expect: LK001
"""A regression loop whose objective is not called loss: it is what .backward() is called on."""
import torch


def fit(model, batches, optimizer, steps):
    history = []
    for step in range(steps):
        x, y = batches[step % len(batches)]
        objective = torch.nn.functional.mse_loss(model(x), y)
        objective.backward()
        optimizer.step()
        optimizer.zero_grad()
        history.append(objective)  # <- LK001
    return history
