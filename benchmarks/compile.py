"""torch.compile in the loop: graphs, graph breaks, recompiles and time per micro-step.

A small GPT (nanoGPT's block: pre-LayerNorm causal self-attention and an MLP; 2 layers of
128, a context of 64 tokens, a vocabulary of 256) trains in bf16 with accumulation of 4,
clipping at 1.0 and AdamW under a cosine lr, written seven ways, each with torch.compile:

- ``hand + compile``: nanoGPT's train.py: ``torch.compile(model)``, the loop by hand;
- ``loopkit + compile``: ``distributed.wrap(model, compile=True)`` and ``loopkit.step``;
- ``loopkit.step + torch.compile(model)``: the step around the hand loop's compiled model;
- ``hand + compiled optimizer``: the hand loop with ``torch.compile(optimizer.step)``;
- ``loopkit + compile_optimizer``: ``loopkit.step(..., compile_optimizer=True)``;
- ``accelerate``: ``Accelerator(dynamo_backend="inductor")``, which compiles in prepare;
- ``fabric``: ``fabric.setup(torch.compile(model))``.

Each contender first trains ``--warmup`` windows from a reset compiler (its graphs, graph
breaks and recompiles counted from dynamo's records, and the wall time of those windows,
compilation included); then all of them are timed interleaved, ``--repeats`` rounds of
``--windows`` windows each (after one untimed round; each round starts with the next
contender), median time per micro-step and its
ratio to ``hand + compile``; recompiles during the timed rounds are counted too. The
inductor caches are off, so every compile time is a cold one.

    python benchmarks/compile.py                 # inductor: several minutes on 2 CPU cores
    python benchmarks/compile.py --quick --json  # what the tests run: dynamo only, tiny GPT
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch._dynamo
from torch import nn
from torch._dynamo.utils import counters, get_compilation_metrics

import loopkit
from loopkit import distributed

K = 4  # micro-batches per update
CLIP = 1.0


class Block(nn.Module):
    """nanoGPT's block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, layers: int, dim: int, context: int, vocab: int) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(context, dim)
        self.blocks = nn.ModuleList(Block(dim, max(1, dim // 32)) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln(x))
        return nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


Batch = tuple[torch.Tensor, torch.Tensor]
Loop = Callable[[int], None]  # runs n micro-steps


def _parts(args: argparse.Namespace) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(0)
    model = GPT(args.layers, args.dim, args.context, args.vocab)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    return model, opt, torch.optim.lr_scheduler.CosineAnnealingLR(opt, 1000)


def _batches(args: argparse.Namespace) -> list[Batch]:
    g = torch.Generator().manual_seed(1)
    shape = (args.batch, args.context)
    return [(torch.randint(args.vocab, shape, generator=g),
             torch.randint(args.vocab, shape, generator=g)) for _ in range(8)]  # fmt: skip


def hand(args: argparse.Namespace, compile_optimizer: bool = False) -> Loop:
    model, opt, sched = _parts(args)
    model = torch.compile(model, **args.compile)
    opt_step = torch.compile(opt.step, **args.compile) if compile_optimizer else opt.step
    data, state = _batches(args), {"i": 0}

    def run(n: int) -> None:
        for _ in range(n):
            i = state["i"]
            x, y = data[i % len(data)]
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(x, y) / K
            loss.backward()
            if (i + 1) % K == 0:
                nn.utils.clip_grad_norm_(model.parameters(), CLIP)
                opt_step()
                sched.step()
                opt.zero_grad(set_to_none=True)
            state["i"] = i + 1

    return run


def with_loopkit(
    args: argparse.Namespace, compile_optimizer: bool = False, by_wrap: bool = True
) -> Loop:
    model, opt, sched = _parts(args)
    if by_wrap:
        model = distributed.wrap(model, compile=args.compile)
    else:  # the hand loop's torch.compile(model): the step's own cost alone
        model = torch.compile(model, **args.compile)
    step = loopkit.step(model, opt, precision="bf16", accumulate=K, clip_grad_norm=CLIP,
                        scheduler=sched,
                        compile_optimizer=args.compile if compile_optimizer else False)  # fmt: skip
    data, state = _batches(args), {"i": 0}

    def run(n: int) -> None:
        for _ in range(n):
            x, y = data[state["i"] % len(data)]
            with step as s:
                s.backward(model(x, y))
            state["i"] += 1

    return run


def accelerate_loop(args: argparse.Namespace) -> Loop:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import TorchDynamoPlugin

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    plugin = TorchDynamoPlugin(backend=args.compile.get("backend", "inductor"))
    accelerator = Accelerator(cpu=True, mixed_precision="bf16", gradient_accumulation_steps=K,
                              dynamo_plugin=plugin)  # fmt: skip
    model, opt, sched = _parts(args)
    model, opt, sched = accelerator.prepare(model, opt, sched)
    data, state = _batches(args), {"i": 0}

    def run(n: int) -> None:
        for _ in range(n):
            x, y = data[state["i"] % len(data)]
            with accelerator.accumulate(model):
                accelerator.backward(model(x, y))
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), CLIP)
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
            state["i"] += 1

    return run


def fabric_loop(args: argparse.Namespace) -> Loop:
    from lightning_fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=1, precision="bf16-mixed")
    model, opt, sched = _parts(args)
    model, opt = fabric.setup(torch.compile(model, **args.compile), opt)
    data, state = _batches(args), {"i": 0}

    def run(n: int) -> None:
        for _ in range(n):
            i = state["i"]
            x, y = data[i % len(data)]
            fabric.backward(model(x, y) / K)
            if (i + 1) % K == 0:
                fabric.clip_gradients(model, opt, max_norm=CLIP, error_if_nonfinite=False)
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
            state["i"] = i + 1

    return run


CONTENDERS: dict[str, Callable[[argparse.Namespace], Loop]] = {
    "hand + compile": hand,
    "loopkit + compile": with_loopkit,
    "loopkit.step + torch.compile(model)": lambda a: with_loopkit(a, by_wrap=False),
    "hand + compiled optimizer": lambda a: hand(a, compile_optimizer=True),
    "loopkit + compile_optimizer": lambda a: with_loopkit(a, compile_optimizer=True),
    "accelerate (dynamo_backend)": accelerate_loop,
    "fabric + compile": fabric_loop,
}


def _records() -> tuple[int, int]:
    """How many compilations and graph breaks dynamo has recorded so far."""
    return len(get_compilation_metrics()), sum(counters["graph_break"].values())


def _reason(text: str | None) -> str:
    return (text or "").split("#")[0].strip()[:90]


def _since(before: tuple[int, int]) -> dict[str, Any]:
    entries = get_compilation_metrics()[before[0] :]
    return {
        "graphs": len(entries),
        "graph_breaks": sum(counters["graph_break"].values()) - before[1],
        "recompiles": sum(1 for e in entries if e.recompile_reason),
        "recompile_reasons": sorted(
            {_reason(e.recompile_reason) for e in entries if e.recompile_reason}
        ),
    }


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3, help="windows from a reset compiler")
    parser.add_argument("--windows", type=int, default=4, help="windows per timed round")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--quick", action="store_true", help="eager backend, a tiny GPT, 1 repeat")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.quick:
        args.layers, args.dim, args.context, args.vocab, args.batch = 1, 32, 16, 64, 2
        args.warmup, args.windows, args.repeats, args.backend = 2, 1, 1, "eager"
    args.compile = {"backend": args.backend}
    torch.set_num_threads(1)
    torch._dynamo.config.recompile_limit = 64  # the contenders share the model's code
    import torch._inductor.config as inductor_config

    inductor_config.fx_graph_cache = False  # every compile time a cold one
    inductor_config.autotune_local_cache = False
    rows: dict[str, dict[str, Any]] = {}
    loops: dict[str, Loop] = {}
    for name, make in CONTENDERS.items():
        torch._dynamo.reset()
        before = _records()
        start = time.perf_counter()
        loops[name] = make(args)
        loops[name](args.warmup * K)  # the first window compiles (and the second, the step)
        rows[name] = {"contender": name, "first_windows_s": time.perf_counter() - start,
                      **_since(before)}  # fmt: skip
    for run in loops.values():  # the resets above dropped each other's code: compile again
        run(K)
    times: dict[str, list[float]] = {name: [] for name in loops}
    later = dict.fromkeys(loops, 0)  # recompiles while timed
    names = list(loops)
    for r in range(args.repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:  # rotated each round
            run = loops[name]
            before = _records()
            t0 = time.perf_counter()
            run(args.windows * K)
            times[name].append((time.perf_counter() - t0) / (args.windows * K))
            later[name] += _since(before)["recompiles"]
    base = statistics.median(times["hand + compile"])
    for name, row in rows.items():
        per = statistics.median(times[name])
        row.update(us_per_micro_step=1e6 * per, ratio=per / base,
                   recompiles_while_timed=later[name])  # fmt: skip
    out = list(rows.values())
    if args.json:
        print(json.dumps(out))
    else:
        _print(out, args)
    return out


def _print(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    params = sum(p.numel() for p in GPT(args.layers, args.dim, args.context, args.vocab)
                 .parameters())  # fmt: skip
    print(f"GPT {args.layers}x{args.dim}, {params / 1e6:.2f}M parameters, batch {args.batch}x"
          f"{args.context}, bf16, accumulate {K}, backend {args.backend}")  # fmt: skip
    print(f"{'contender':36} graphs breaks recompiles (timed) first windows (s)  "
          "us/micro-step  ratio")  # fmt: skip
    for r in rows:
        ratio = r["ratio"] if math.isfinite(r["ratio"]) else float("nan")
        recompiles = f"{r['recompiles']} ({r['recompiles_while_timed']})"
        time_s, per = r["first_windows_s"], r["us_per_micro_step"]
        print(f"{r['contender']:36} {r['graphs']:6} {r['graph_breaks']:6} {recompiles:>18} "
              f"{time_s:17.1f} {per:14.0f} {ratio:6.3f}")  # fmt: skip
        for reason in r["recompile_reasons"]:
            print(f"{'':38}recompiled: {reason}")


if __name__ == "__main__":
    main()
