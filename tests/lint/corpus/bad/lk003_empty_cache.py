# expect: LK003
"""Emptying the CUDA cache after every step "to save memory"."""
import torch


def train(model, loader, optimizer):
    model.cuda()
    for x, y in loader:
        x, y = x.cuda(non_blocking=True), y.cuda(non_blocking=True)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        del loss
        torch.cuda.empty_cache()  # <- LK003
