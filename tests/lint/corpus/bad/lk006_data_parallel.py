# expect: LK006
"""Multi-GPU the old way: nn.DataParallel."""
import torch
from torch import nn


def build(num_classes: int) -> nn.Module:
    model = nn.Sequential(nn.Flatten(), nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, num_classes))
    if torch.cuda.device_count() > 1:
        model = nn.DataParallel(model)  # <- LK006
    return model.cuda()


def build_encoder() -> nn.Module:
    encoder = nn.Linear(512, 128)
    return torch.nn.DataParallel(encoder, device_ids=[0, 1])  # <- LK006


def unwrap(model: nn.Module) -> nn.Module:
    # a type check, not a wrap: not flagged
    return model.module if isinstance(model, nn.DataParallel) else model
