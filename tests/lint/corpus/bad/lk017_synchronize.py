# expect: LK017
"""Timing every step by synchronizing the device."""
import time

import torch


def train(model, loader, optimizer, loss_fn):
    for x, y in loader:
        t0 = time.time()
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        optimizer.step()
        torch.cuda.synchronize()  # <- LK017
        print(f"step took {time.time() - t0:.3f}s")
