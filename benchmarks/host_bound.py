"""The host-bound regime: a step of a few hundred microseconds, against the limit.

A small MLP (batch 64, three hidden layers of 128) whose update is a few hundred
microseconds of device work: the regime of small models, RL and a GPU waiting on the
Python loop, where every microsecond of host work shows. Each contender trains the same
model on the same batches, one update per batch (no accumulation: the host work of an
update is paid every step), interleaved in rounds; the median time per step.

The limit is the fastest the same step can run:

- on a CUDA device, the whole step (forward, backward, optimizer step) captured once in a
  CUDA graph (``torch.cuda.graphs``: static input tensors, warm-up on a side stream, then
  one ``replay()`` per batch after copying the batch in): no Python and no kernel launch
  per op at all;
- on a CPU, where there is no graph to replay, the hand-written loop itself.

    python benchmarks/host_bound.py [--quick] [--json] [--device cpu|cuda] [--bf16] [--compiled]

``--bf16`` runs every contender under bf16 autocast (the graph captures it too);
``--compiled`` adds the same two loops on ``torch.compile(model, mode="reduce-overhead")``
(on CUDA: the forward and backward replayed as CUDA graphs by torch, the optimizer eager).

loopkit's runs end bit-identical to the hand-written loop (checked before timing). The
graph's run is not compared bit for bit (its warm-up steps train the model too); its
first losses are checked to fall as the eager loop's do.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import loopkit

BATCH, WIDTH, DEPTH = 64, 128, 3
Batch = tuple[torch.Tensor, torch.Tensor]


def build(device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(32, WIDTH), nn.ReLU()]
    for _ in range(DEPTH - 1):
        layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(WIDTH, 1)).to(device)


def make_data(device: torch.device, n: int = 16) -> list[Batch]:
    g = torch.Generator().manual_seed(1)
    pairs = [
        (torch.randn(BATCH, 32, generator=g), torch.randn(BATCH, 1, generator=g)) for _ in range(n)
    ]
    return [(x.to(device), y.to(device)) for x, y in pairs]


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)


BF16 = False  # --bf16: every contender under bf16 autocast


def _autocast(model: nn.Module, cache: bool = True) -> contextlib.AbstractContextManager[None]:
    if not BF16:
        return contextlib.nullcontext()
    device = next(model.parameters()).device.type
    return torch.autocast(device, dtype=torch.bfloat16, cache_enabled=cache)


def hand(model: nn.Module, data: list[Batch], steps: int, clip: float | None = None) -> None:
    opt = _sgd(model)
    for i in range(steps):
        x, y = data[i % len(data)]
        with _autocast(model):
            loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        if clip is not None:
            nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad(set_to_none=True)


def with_step(model: nn.Module, data: list[Batch], steps: int, clip: float | None = None) -> None:
    step = loopkit.step(model, _sgd(model), clip_grad_norm=clip,
                        precision="bf16" if BF16 else "fp32")  # fmt: skip
    for i in range(steps):
        x, y = data[i % len(data)]
        with step as s:
            s.backward(nn.functional.mse_loss(model(x), y))


def cuda_graph(model: nn.Module, data: list[Batch], steps: int) -> None:
    """The whole step captured once in a CUDA graph and replayed per batch (the limit)."""
    opt = _sgd(model)
    static_x, static_y = (t.clone() for t in data[0])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up on a side stream, as torch's docs require
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            with _autocast(model, cache=False):
                loss = nn.functional.mse_loss(model(static_x), static_y)
            loss.backward()
            opt.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        # autocast's weight cache off: a cast cached at capture would be replayed stale.
        with _autocast(model, cache=False):
            static_loss = nn.functional.mse_loss(model(static_x), static_y)
        static_loss.backward()
        opt.step()
    LOSSES.append(static_loss)  # read after the run (the graph writes it at each replay)
    for i in range(steps):
        x, y = data[i % len(data)]
        static_x.copy_(x)
        static_y.copy_(y)
        graph.replay()


_COMPILED: dict[str, nn.Module] = {}


def compiled(
    runner: Callable[[nn.Module, list[Batch], int], None], name: str
) -> Callable[[nn.Module, list[Batch], int], None]:
    """``runner`` on one ``torch.compile(mode="reduce-overhead")`` module per contender, its
    weights reset from the run's fresh model (in place: no recompile, the graphs' addresses
    kept)."""

    def run(model: nn.Module, data: list[Batch], steps: int) -> None:
        if name not in _COMPILED:
            _COMPILED[name] = torch.compile(build(data[0][0].device), mode="reduce-overhead")
        target = _COMPILED[name]
        with torch.no_grad():
            for dst, src in zip(target.parameters(), model.parameters(), strict=True):
                dst.copy_(src)
        runner(target, data, steps)

    return run


LOSSES: list[torch.Tensor] = []
CONTENDERS: dict[str, Callable[[nn.Module, list[Batch], int], None]] = {
    "hand-written": hand,
    "loopkit.step": with_step,
    "hand-written, clipped": functools.partial(hand, clip=1.0),
    "loopkit.step, clipped": functools.partial(with_step, clip=1.0),
}


def check_parity(device: torch.device) -> None:
    """loopkit's runs end bit-identical to the hand-written ones."""
    data = make_data(device)
    for ref_name, name in (("hand-written", "loopkit.step"),
                           ("hand-written, clipped", "loopkit.step, clipped")):  # fmt: skip
        ref, model = build(device), build(device)
        CONTENDERS[ref_name](ref, data, 8)
        CONTENDERS[name](model, data, 8)
        pairs = zip(ref.parameters(), model.parameters(), strict=True)
        if not all(torch.equal(a, b) for a, b in pairs):
            raise SystemExit(f"parity broken: {name} differs from {ref_name}")


def time_once(name: str, device: torch.device, data: list[Batch], steps: int) -> float:
    model = build(device)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    CONTENDERS[name](model, data, steps)
    if device.type == "cuda":
        torch.cuda.synchronize()  # the device's work done: the time of the whole run
    return (time.perf_counter() - start) / steps * 1e6


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps and rounds")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast in every contender")
    parser.add_argument("--compiled", action="store_true",
                        help='add both loops on torch.compile(mode="reduce-overhead")')  # fmt: skip
    args = parser.parse_args(argv)
    global BF16
    BF16 = args.bf16
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)
    names = list(CONTENDERS)
    limit = "hand-written"
    if device.type == "cuda":
        CONTENDERS["CUDA graph (the limit)"] = cuda_graph
        names.append("CUDA graph (the limit)")
        limit = "CUDA graph (the limit)"
    if args.compiled:
        for base in ("hand-written", "loopkit.step"):
            CONTENDERS[f"{base}, compiled"] = compiled(CONTENDERS[base], base)
            names.append(f"{base}, compiled")
    check_parity(device)
    steps, rounds = (100, 3) if args.quick else (1000, 9)
    data = make_data(device)
    for name in names:  # warm-up
        time_once(name, device, data, 20)
    samples: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            samples[name].append(time_once(name, device, data, steps))
    rows = []
    for name in names:
        per_round = [a / b for a, b in zip(samples[name], samples[limit], strict=True)]
        rows.append({
            "device": device.type, "precision": "bf16" if BF16 else "fp32", "contender": name,
            "us_per_step": round(statistics.median(samples[name]), 2),
            "ratio_to_limit": round(statistics.median(per_round), 4),
            "limit": limit,
        })  # fmt: skip
    if LOSSES:  # the graph trained: its loss after the run is finite
        next(r for r in rows if r["contender"] == limit)["last_loss"] = float(LOSSES[-1].detach())
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(f"torch {torch.__version__}, {device}, {'bf16' if BF16 else 'fp32'}, batch "
              f"{BATCH}, {DEPTH} hidden layers of {WIDTH}, one update per batch; the limit: "
              f"{limit}\n")  # fmt: skip
        print("| contender | us / step | ratio to the limit |")
        print("|---|---|---|")
        for r in rows:
            print(f"| {r['contender']} | {r['us_per_step']:.1f} | {r['ratio_to_limit']:.3f} |")
    return rows


if __name__ == "__main__":
    main()
