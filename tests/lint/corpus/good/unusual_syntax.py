"""Newer syntax: match, walrus, async for, f-string =, parenthesized with, positional-only."""  # clean: LK002, LK008
import asyncio

import torch
from torch import nn


def make_optimizer(name: str, params) -> torch.optim.Optimizer:
    match name.split(":"):
        case ["sgd", lr]:
            return torch.optim.SGD(params, lr=float(lr))
        case ["adamw"] | ["adam"]:
            return torch.optim.AdamW(params)
        case [other, *_] if other.startswith("lion"):
            raise NotImplementedError(other)
        case _:
            raise ValueError(name)


def train(model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]], every: int = 50):
    optimizer = make_optimizer("adamw", model.parameters())
    log: dict[str, float] = {}
    for step, (x, y) in enumerate(batches):
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if (n := step + 1) % every == 0:
            log[f"{n=}"] = loss.item()
    return log


async def stream_train(model: nn.Module, source, optimizer) -> int:
    seen = 0
    async for x, y in source:
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        seen += 1
    return seen


def evaluate(model: nn.Module, batches, /, *, device: str = "cpu") -> float:
    total = 0.0
    with (
        torch.inference_mode(),
        torch.autocast(device, dtype=torch.bfloat16),
    ):
        model.eval()
        for x, _ in batches:
            total += model(x).float().sum()
    return float(total)


def main() -> None:
    asyncio.run(stream_train(nn.Linear(2, 1), None, None))
