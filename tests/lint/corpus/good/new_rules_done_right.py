"""The same loops written the right way."""  # clean: LK012, LK013, LK015, LK016, LK017, LK018, LK019
import torch

import loopkit

N = 4


def fp16_step(model, optimizer, scaler, x, y):
    scaler.scale(model(x, y)).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(optimizer)
    scaler.update()


def train(model, loader, optimizer, loss_fn):
    total_loss = 0.0
    batches = len(loader)
    step = loopkit.step(model, optimizer, accumulate=N)
    for x, y in step.iterate(loader):
        with step as s:
            loss = loss_fn(model(x), y)
            s.backward(loss)
        total_loss += loss.detach()
    torch.cuda.synchronize()  # once, after the loop, to time it
    return total_loss / batches


def accumulate_by_hand(model, loader, optimizer, loss_fn):
    for i, (x, y) in enumerate(loader):
        loss = loss_fn(model(x), y) / N
        loss.backward()
        if (i + 1) % N == 0 or i + 1 == len(loader):
            optimizer.step()
            optimizer.zero_grad()
