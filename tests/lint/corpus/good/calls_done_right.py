"""Functions called from the loop, done right."""  # clean: LK002, LK004, LK008, LK016, LK017, LK021
import time

import numpy as np
import torch

cuda = torch.cuda.is_available()
Tensor = torch.cuda.FloatTensor if cuda else torch.FloatTensor


def log_metrics(metrics, step):
    print(step, {k: v.item() for k, v in metrics.items()})  # called on `step % 100` only


def labels(n, device):
    return torch.ones(n, 1, device=device)  # built on the device


def evaluate(model, loader, device):
    total = torch.zeros((), device=device)
    for x, y in loader:
        total += torch.nn.functional.cross_entropy(model(x.to(device)), y.to(device))
    return total


def timed(fn):
    torch.cuda.synchronize()  # times one call, once, outside the loop
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def train(model, loader, val_loader, optimizer, accelerator, device, epochs):
    history = np.zeros(epochs)
    for epoch in range(epochs):
        for step, (x, y) in enumerate(loader):
            valid = labels(x.size(0), device)
            ones = Tensor(x.size(0), 1).fill_(1.0)  # on a GPU run: on the device already
            loss = torch.nn.functional.mse_loss(model(x.to(device)), valid * ones)
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
            if np.isnan(history).any() or any(h > 1e9 for h in history):
                break
            if step % 100 == 0:
                log_metrics({"loss": loss}, step)
        model.eval()
        with torch.no_grad():
            history[epoch] = evaluate(model, val_loader, device).item()
        model.train()
    print(timed(lambda: model(torch.zeros(1, 8, device=device))))
