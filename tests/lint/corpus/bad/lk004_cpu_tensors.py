# expect: LK004
"""Masks and targets built on the CPU and copied to the GPU, every step and every forward."""
import torch
from torch import nn


class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)
        self.heads = heads

    def forward(self, x):
        b, t, c = x.shape
        positions = torch.arange(t).to(x.device)  # <- LK004
        q, k, v = self.qkv(x).split(c, dim=2)
        mask = positions[None, :] <= positions[:, None]
        return nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def train(model, loader, optimizer, device):
    for tokens in loader:
        tokens = tokens.to(device)
        weights = torch.ones(tokens.shape[0]).cuda()  # <- LK004
        labels = torch.zeros(tokens.shape[0], dtype=torch.long).to(device)  # <- LK004
        loss = nn.functional.cross_entropy(model(tokens), labels, reduction="none")
        (loss * weights).mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
