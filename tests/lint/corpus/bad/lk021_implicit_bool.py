# expect: LK021
"""Checks on tensors that Python turns into a bool: a host-device sync each, every step."""
import torch


def check_grads(model):
    for p in model.parameters():
        if p.grad is not None and not torch.isfinite(p.grad).all():  # <- LK021
            raise FloatingPointError("a gradient is not finite")


def train(model, loader, optimizer, device):
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        out = model(x)
        assert (out > -1e4).all(), "logits blew up"  # <- LK021
        if torch.isinf(out).any():  # <- LK021
            continue
        loss = torch.nn.functional.cross_entropy(out, y)
        loss.backward()
        check_grads(model)
        optimizer.step()
        optimizer.zero_grad()
        drop = torch.rand(8, device=device) > 0.5
        while drop.all():  # <- LK021
            drop = torch.rand(8, device=device) > 0.5
