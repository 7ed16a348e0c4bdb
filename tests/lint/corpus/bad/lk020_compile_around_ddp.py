# expect: LK020
"""Compiling a model after wrapping it: Accelerate's and Fabric's order, in several spellings."""
import torch
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

import loopkit
from loopkit.distributed import wrap


def build(model: torch.nn.Module, local_rank: int) -> torch.nn.Module:
    model = DDP(model, device_ids=[local_rank])
    model = torch.compile(model)  # <- LK020
    return model


def build_inline(model: torch.nn.Module) -> torch.nn.Module:
    return torch.compile(loopkit.distributed.wrap(model), mode="max-autotune")  # <- LK020


def build_sharded(model: torch.nn.Module) -> torch.nn.Module:
    torch.distributed.fsdp.fully_shard(model)
    return torch.compile(model)  # <- LK020


def build_in_place(model: torch.nn.Module) -> torch.nn.Module:
    ddp = DDP(model).to("cuda")
    ddp.compile()  # <- LK020
    return ddp


class Trainer:
    def __init__(self, model: torch.nn.Module) -> None:
        self.model = wrap(model)
        self.model = torch.compile(self.model)  # <- LK020


async def build_async(model: torch.nn.Module) -> torch.nn.Module:
    model = DDP(model)
    return torch.compile(model)  # <- LK020
