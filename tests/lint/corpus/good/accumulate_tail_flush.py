"""Hand-written accumulation that does step the ragged last window."""  # clean: LK009, LK010
import torch
from torch import nn

N = 4


def train_flush_after(model, loader, optimizer):
    for i, (x, y) in enumerate(loader):
        loss = nn.functional.mse_loss(model(x), y) / N
        loss.backward()
        if (i + 1) % N == 0:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    if (i + 1) % N != 0:  # the ragged tail: step it too
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def train_last_batch_clause(model, loader, optimizer, accum_steps: int):
    for i, (x, y) in enumerate(loader):
        loss = nn.functional.mse_loss(model(x), y)
        loss /= accum_steps
        loss.backward()
        if (i + 1) % accum_steps == 0 or (i + 1) == len(loader):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)


def train_last_flag(model, loader, optimizer, accum_steps: int, n_batches: int):
    for i, (x, y) in enumerate(loader):
        is_last_batch = i == n_batches - 1
        (nn.functional.mse_loss(model(x), y) / accum_steps).backward()
        if (i + 1) % accum_steps == 0 or is_last_batch:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)


def train_no_division(model, loader, optimizer):
    # Every 4 steps, but the loss is not divided: a plain "step every k" loop, not accumulation.
    for i, (x, y) in enumerate(loader):
        nn.functional.mse_loss(model(x), y).backward()
        if i % 4 == 0:
            optimizer.step()
            optimizer.zero_grad()
