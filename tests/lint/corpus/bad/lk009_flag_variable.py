# expect: LK009
"""The nanoGPT-style loop: a `last` flag from i % N, the division inside the scaled backward."""
import torch
from torch import nn

N = 4


def train(model, loader, optimizer, scheduler, scaler, device):
    for i, (x, y) in enumerate(loader):
        x = x.to(device, non_blocking=True)
        y = y.to(device, non_blocking=True)
        last = (i + 1) % N == 0
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = nn.functional.mse_loss(model(x), y)
        scaler.scale(loss / N).backward()
        if last:  # <- LK009
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
        if (i + 1) % 100 == 0:
            print(loss.item() * N)
