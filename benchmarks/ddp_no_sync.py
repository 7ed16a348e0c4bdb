"""Worker for speedups.py: time per accumulation window under DDP, with and without no_sync.

    torchrun --standalone --nproc-per-node 2 benchmarks/ddp_no_sync.py [--windows 10]

Rank zero prints one JSON line: bucket all-reduces and milliseconds per window for loopkit's
accumulate (no_sync on 3 of 4 micro-steps) and for the same loop without no_sync.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP

import loopkit
from loopkit import distributed

N = 4


def counted(model: nn.Module) -> tuple[DDP, list[int]]:
    ddp = DDP(model)
    calls: list[int] = []

    def hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks annotations
        calls.append(1)
        return allreduce_hook(state, bucket)

    ddp.register_comm_hook(None, hook)
    return ddp, calls


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1)
    )


def run(use_loopkit: bool, windows: int, data: list[Any]) -> tuple[float, int]:
    ddp, calls = counted(model())
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    acc = loopkit.accumulate(ddp, opt, every=N) if use_loopkit else None
    times, reduces = [], []
    for w in range(windows + 1):  # the first window warms up (DDP rebuilds its buckets)
        dist.barrier()
        before = len(calls)
        start = time.perf_counter()
        for i in range(N):
            x, y = data[(w * N + i) % len(data)]
            if acc is not None:
                with acc:
                    acc.backward(nn.functional.mse_loss(ddp(x), y))
            else:
                (nn.functional.mse_loss(ddp(x), y) / N).backward()
                if i == N - 1:
                    opt.step()
                    opt.zero_grad(set_to_none=True)
        if w:
            times.append(time.perf_counter() - start)
            reduces.append(len(calls) - before)
    return 1e3 * statistics.median(times), int(statistics.median(reduces))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--windows", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with distributed.setup() as info:
        g = torch.Generator().manual_seed(info.rank)
        data = [
            (torch.randn(64, 256, generator=g), torch.randn(64, 1, generator=g)) for _ in range(8)
        ]
        without_ms, without_calls = run(False, args.windows, data)
        with_ms, with_calls = run(True, args.windows, data)
        if info.is_rank_zero:
            print(
                json.dumps(
                    {
                        "world_size": info.world_size,
                        "params": sum(p.numel() for p in model().parameters()),
                        "with": {"ms_per_window": with_ms, "all_reduces_per_window": with_calls},
                        "without": {
                            "ms_per_window": without_ms,
                            "all_reduces_per_window": without_calls,
                        },
                    }
                )
            )


if __name__ == "__main__":
    main()
