"""Loss histories that hold no graph, and a scheduler stepped once per epoch."""  # clean: LK001, LK005
import torch
from torch import nn


def train(model, loader, optimizer, scheduler, loss_fn, epochs: int):
    history = []
    loss_fns = [loss_fn]
    for epoch in range(epochs):
        for x, y in loader:
            loss = loss_fn(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            history.append(loss.detach())
            loss_fns.append(loss_fn)
        scheduler.step()
    return torch.stack(history)


def validation_losses(model, loader):
    losses = []
    with torch.inference_mode():
        model.eval()
        for x, y in loader:
            loss = nn.functional.mse_loss(model(x), y)
            losses.append(loss)
    return losses


def float_losses(model, loader, optimizer):
    values = []
    for x, y in loader:
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        loss = loss.detach()
        values.append(loss)
    return values


def evaluate_batch(model, x, y) -> float:
    return nn.functional.mse_loss(model(x), y).item()


def epoch_losses(model, loader):
    per_batch = []
    with torch.inference_mode():
        for x, y in loader:
            batch_loss = evaluate_batch(model, x, y)
            per_batch.append(batch_loss)
    return per_batch


def snapshot_every_n(model, loader, optimizer, device):
    for step, (x, y) in enumerate(loader):
        x = x.cuda()
        nn.functional.mse_loss(model(x), y.cuda()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 500 == 0:
            torch.save(x.cpu(), f"batch_{step}.pt")
