"""The checkpointing tests' shared model: a stack of transformer-like MLP blocks."""

from __future__ import annotations

import torch
from torch import nn

import loopkit

CALLS = {"forward": 0}


class Block(nn.Module):
    """A pre-norm MLP block with dropout and a residual, like a transformer's."""

    def __init__(self, d: int = 64, h: int = 256) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, h)
        self.act = nn.GELU()
        self.drop = nn.Dropout(0.1)
        self.fc2 = nn.Linear(h, d)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        CALLS["forward"] += 1
        return x + scale * self.fc2(self.drop(self.act(self.fc1(self.norm(x)))))


def stack(seed: int = 0) -> nn.Sequential:
    """Eight identical blocks and a head."""
    torch.manual_seed(seed)
    return nn.Sequential(*[Block() for _ in range(8)], nn.Linear(64, 1))


X = torch.randn(32, 64, generator=torch.Generator().manual_seed(3))


def run_model(model: nn.Module, seed: int = 7) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Output and gradients of one forward and backward on ``X``."""
    torch.manual_seed(seed)  # the same dropout masks for every variant
    out = model(X)
    out.sum().backward()
    return out.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


def saved_bytes(model: nn.Module) -> int:
    """Bytes the forward on ``X`` keeps for backward."""
    with loopkit.track_memory() as mem:
        out = model(X).sum()
        kept = mem.live
    out.backward()
    return kept
