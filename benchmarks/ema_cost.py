"""What an EMA of the weights costs: loopkit.ema's update against the loops users write.

Per update, on one model (fp32 and bf16 weights): loopkit.ema (one ``_foreach_lerp_`` over
an fp32 average; bf16 weights: a ``_foreach_mul_`` and a mixed-dtype ``_foreach_add_``),
the hand-written loop over parameters most scripts carry (timm's ModelEmaV2:
``e.mul_(d).add_(p, alpha=1 - d)`` per tensor), and ``torch.optim.swa_utils.AveragedModel``
with ``get_ema_multi_avg_fn`` (a copy of the model in its own dtype). Reported: microseconds
per update (median of interleaved repeats), the ratio to the hand-written loop, the torch
ops one update dispatches (counted by the profiler: exact, not timed), the average's dtype,
and, in a training loop of ``loopkit.step(accumulate=4)``, the time an EMA adds per
optimizer update against the update's own time.

    python benchmarks/ema_cost.py            # a few seconds per row
    python benchmarks/ema_cost.py --quick --json
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import loopkit

DECAY = 0.999
ACCUMULATE = 4


def build(dtype: torch.dtype, width: int = 256, depth: int = 12) -> nn.Module:
    """A transformer-like MLP stack: 3 tensors per block (many small tensors, as real models)."""
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 2 * width), nn.GELU(),
                            nn.Linear(2 * width, width)) for _ in range(depth)]  # fmt: skip
    return nn.Sequential(*blocks, nn.Linear(width, 1)).to(dtype)


def hand_written(model: nn.Module) -> Callable[[], None]:
    """timm ModelEmaV2's update: a Python loop over the tensors, the copy in the model's dtype."""
    shadow = copy.deepcopy(model).requires_grad_(False)

    @torch.no_grad()
    def update() -> None:
        for e, p in zip(shadow.parameters(), model.parameters(), strict=True):
            e.mul_(DECAY).add_(p.detach(), alpha=1 - DECAY)

    return update


def averaged_model(model: nn.Module) -> Callable[[], None]:
    averaged = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(DECAY))
    return lambda: averaged.update_parameters(model)


def loopkit_ema(model: nn.Module) -> Callable[[], None]:
    return loopkit.ema(model, decay=DECAY).update


CONTENDERS = {
    "hand-written loop": hand_written,
    "AveragedModel": averaged_model,
    "loopkit.ema": loopkit_ema,
}
SHADOW_DTYPE = {
    "hand-written loop": lambda dtype: dtype,
    "AveragedModel": lambda dtype: dtype,
    "loopkit.ema": lambda dtype: torch.float32,
}


def ops_per_update(update: Callable[[], None]) -> int:
    """The torch ops one update dispatches (top level of the profile: exact, not timed)."""
    update()  # first call: lazy set-up (AveragedModel copies on its first update)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        update()
    return sum(1 for e in prof.events() if e.name.startswith("aten::") and e.cpu_parent is None)


def time_updates(updates: dict[str, Callable[[], None]], n: int, repeats: int) -> dict[str, float]:
    """Microseconds per update, median over interleaved repeats (drift hits all alike)."""
    samples: dict[str, list[float]] = {k: [] for k in updates}
    for _ in range(repeats):
        for name, update in updates.items():
            t0 = time.perf_counter()
            for _ in range(n):
                update()
            samples[name].append((time.perf_counter() - t0) / n * 1e6)
    return {k: statistics.median(v) for k, v in samples.items()}


def in_training(dtype: torch.dtype, steps: int, repeats: int) -> dict[str, float]:
    """loopkit.step(accumulate=4) with and without ema=: microseconds per optimizer update."""
    x, y = torch.randn(8, 256, dtype=dtype), torch.randn(8, 1, dtype=dtype)

    def run(with_ema: bool) -> Callable[[], None]:
        model = build(dtype)
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)
        average = loopkit.ema(model, decay=DECAY) if with_ema else None
        step = loopkit.step(model, opt, accumulate=ACCUMULATE, ema=average)

        def update() -> None:
            for _ in range(ACCUMULATE):
                with step as s:
                    s.backward(nn.functional.mse_loss(model(x), y))

        return update

    return time_updates({"without": run(False), "with": run(True)}, steps, repeats)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer updates and repeats")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    n, repeats = (20, 3) if args.quick else (200, 9)
    rows: list[dict[str, Any]] = []
    for dtype in (torch.float32, torch.bfloat16):
        model = build(dtype)
        updates = {name: make(model) for name, make in CONTENDERS.items()}
        ops = {name: ops_per_update(u) for name, u in updates.items()}
        us = time_updates(updates, n, repeats)
        training = in_training(dtype, max(n // 4, 5), repeats)
        tensors = sum(1 for _ in model.parameters())
        for name in CONTENDERS:
            rows.append({
                "dtype": str(dtype).removeprefix("torch."),
                "contender": name,
                "tensors": tensors,
                "us_per_update": round(us[name], 1),
                "ratio": round(us[name] / us["hand-written loop"], 3),
                "ops_per_update": ops[name],
                "average_dtype": str(SHADOW_DTYPE[name](dtype)).removeprefix("torch."),
            })  # fmt: skip
        rows.append({
            "dtype": str(dtype).removeprefix("torch."),
            "contender": "loopkit.step(ema=) in training",
            "tensors": tensors,
            "us_per_update": round(training["with"] - training["without"], 1),
            "update_us": round(training["without"], 1),
            "share_of_update": round((training["with"] - training["without"])
                                     / training["without"], 4),
        })  # fmt: skip
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(f"torch {torch.__version__}, 1 CPU thread, decay {DECAY}, accumulate {ACCUMULATE}")
        print("| weights | contender | tensors | us / update | ratio | ops / update | average |")
        print("|---|---|---|---|---|---|---|")
        for r in rows:
            if "ratio" in r:
                print(f"| {r['dtype']} | {r['contender']} | {r['tensors']} | "
                      f"{r['us_per_update']} | {r['ratio']} | {r['ops_per_update']} | "
                      f"{r['average_dtype']} |")  # fmt: skip
            else:
                print(f"| {r['dtype']} | {r['contender']} | {r['tensors']} | "
                      f"{r['us_per_update']} added to {r['update_us']} "
                      f"({100 * r['share_of_update']:.1f}%) | | | |")  # fmt: skip
    return rows


if __name__ == "__main__":
    main()
