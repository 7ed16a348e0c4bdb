"""Activation checkpointing on a transformer-like stack: memory against time, on the CPU.

For each setting (none, full, every=2, save_matmuls) it measures, in one run:
bytes kept for backward after the forward and the peak bytes of the whole step
(both exact, with loopkit.track_memory), FLOPs of forward+backward
(torch.utils.flop_counter), and the median wall time of a training step.

    python benchmarks/checkpointing.py [--layers 8] [--quick] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import loopkit


class Layer(nn.Module):
    """Pre-norm self-attention and MLP, as in a GPT block."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.norm2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        att = nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(nn.functional.gelu(self.fc1(self.norm2(x))))


def build(layers: int, d: int, heads: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[Layer(d, heads) for _ in range(layers)])


SETTINGS: dict[str, Callable[[nn.Module], nn.Module]] = {
    "none": lambda m: m,
    "full": lambda m: loopkit.checkpointed(m, blocks=Layer),
    "every=2": lambda m: loopkit.checkpointed(m, blocks=Layer, every=2),
    "save_matmuls": lambda m: loopkit.checkpointed(m, blocks=Layer, policy="save_matmuls"),
}


def measure(name: str, args: argparse.Namespace, x: torch.Tensor) -> dict[str, float]:
    model = SETTINGS[name](build(args.layers, args.d, args.heads))
    with loopkit.track_memory() as mem:
        loss = model(x).pow(2).mean()
        saved = mem.live
        loss.backward()
        peak = mem.peak
    model.zero_grad(set_to_none=True)
    with FlopCounterMode(display=False) as flops:
        model(x).pow(2).mean().backward()
    model.zero_grad(set_to_none=True)
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        model(x).pow(2).mean().backward()
        times.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    return {
        "saved_bytes": saved,
        "peak_bytes": peak,
        "flops": flops.get_total_flops(),
        "ms": 1e3 * statistics.median(times),
    }


def main(argv: list[str] | None = None) -> list[dict[str, object]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--d", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="small sizes, 2 repeats")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.quick:
        args.layers, args.d, args.seq, args.batch, args.repeats = 4, 64, 64, 2, 2
    torch.set_num_threads(1)
    x = torch.randn(args.batch, args.seq, args.d, generator=torch.Generator().manual_seed(1))
    results = {name: measure(name, args, x) for name in SETTINGS}
    base = results["none"]
    rows: list[dict[str, object]] = []
    for name, r in results.items():
        rows.append(
            {
                "setting": name,
                "saved_MiB": r["saved_bytes"] / 2**20,
                "saved_ratio": r["saved_bytes"] / base["saved_bytes"],
                "peak_MiB": r["peak_bytes"] / 2**20,
                "peak_ratio": r["peak_bytes"] / base["peak_bytes"],
                "gflops": r["flops"] / 1e9,
                "flops_ratio": r["flops"] / base["flops"],
                "ms_per_step": r["ms"],
                "time_ratio": r["ms"] / base["ms"],
            }
        )
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(
            f"{args.layers} layers, d={args.d}, seq={args.seq}, batch={args.batch}, "
            f"torch {torch.__version__}, 1 CPU thread"
        )
        print()
        print("| setting | saved for backward | peak of the step | FLOPs | time per step |")
        print("|---|---|---|---|---|")
        for row in rows:
            print(
                f"| {row['setting']} | {row['saved_MiB']:.1f} MiB ({row['saved_ratio']:.2f}x) "
                f"| {row['peak_MiB']:.1f} MiB ({row['peak_ratio']:.2f}x) "
                f"| {row['gflops']:.2f} G ({row['flops_ratio']:.2f}x) "
                f"| {row['ms_per_step']:.1f} ms ({row['time_ratio']:.2f}x) |"
            )
    return rows


if __name__ == "__main__":
    main()
