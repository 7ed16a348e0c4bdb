"""Compiled first, then wrapped: no graph break at the wrapper's hooks."""  # clean: LK020
import torch
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.nn.parallel import DistributedDataParallel as DDP

import loopkit


def build(model: torch.nn.Module, local_rank: int) -> torch.nn.Module:
    model = torch.compile(model)
    return DDP(model, device_ids=[local_rank])


def build_loopkit(model: torch.nn.Module) -> torch.nn.Module:
    return loopkit.distributed.wrap(model, compile=True)


def rewrap(model: torch.nn.Module) -> torch.nn.Module:
    model = DDP(model)
    model = model.module  # unwrapped again: compiling it is fine
    return DDP(torch.compile(model))


def one_or_the_other(model: torch.nn.Module, world: int) -> torch.nn.Module:
    if world > 1:
        model = DDP(model)
    else:
        model = torch.compile(model)  # never the DDP model: another branch
    return model


def fsdp1(model: torch.nn.Module) -> torch.nn.Module:
    # FSDP1's own recipe compiles the wrapped model (use_orig_params=True).
    return torch.compile(FSDP(model, use_orig_params=True))


def compile_the_inner_module(model: torch.nn.Module) -> torch.nn.Module:
    ddp = DDP(model)
    ddp.module.compile()
    return ddp
