"""How long a checkpoint stalls the training loop: synchronous saves against background ones.

A model of ``--width`` (default: 24 blocks of 1024 -> about 25M parameters, 100 MB of fp32
weights, 290 MB with AdamW's moments) trains with ``loopkit.step``; a Checkpointer saves
every ``--every`` updates, synchronously (``torch.save`` + fsync, or DCP's ``save`` for a
sharded model) or with ``async_save=True`` (the state copied to host memory, then written by
a thread). Reported per mode, measured side by side in one run (modes interleaved, each
repeated): the loop's stall per save (the time ``maybe_save`` holds the loop, median), the
time per update of the whole loop against the same loop without saves, and the checkpoint's
size. ``--sharded`` runs the same under ``torchrun --nproc-per-node 2`` with FSDP2 (each rank
writes its shards).

    python benchmarks/save_stall.py                 # about a minute
    python benchmarks/save_stall.py --sharded
    python benchmarks/save_stall.py --quick --json  # what the tests run: exact columns only
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

import loopkit
from loopkit import distributed

MODES = ("no saves", "sync", "async")
WARMUP = 2  # updates before the timed ones (no saves): allocation, first touches


def build(width: int, depth: int, sharded: bool) -> nn.Module:
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(depth)]
    model = nn.Sequential(*blocks, nn.Linear(width, 1))
    return distributed.wrap(model, fsdp=nn.Linear if sharded else False)


def measure(mode: str, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    """One run of ``args.updates`` updates in ``mode``: stalls per save, seconds per update."""
    model = build(args.width, args.depth, args.sharded)
    step = loopkit.step(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    ckpt = loopkit.Checkpointer(root, model=model, step=step, async_save=mode == "async", keep=1)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(args.batch, args.width, generator=g), torch.randn(args.batch, 1)
    stalls: list[float] = []
    start = 0.0
    for i in range(WARMUP + args.updates):
        if i == WARMUP:  # the optimizer's state allocated and touched: time from here
            start = time.perf_counter()
        with step as s:
            s.backward(nn.functional.mse_loss(model(x), y))
        if mode != "no saves" and i >= WARMUP and (i + 1 - WARMUP) % args.every == 0:
            t0 = time.perf_counter()
            ckpt.save()  # what the loop waits for: all of it (sync), the copy (async)
            stalls.append(time.perf_counter() - t0)
    ckpt.wait()  # the last background write counts in the loop's time
    elapsed = time.perf_counter() - start
    files = ckpt.checkpoints()
    size = sum(f.stat().st_size for f in files[-1].rglob("*")) if files and files[-1].is_dir() \
        else (files[-1].stat().st_size if files else 0)  # fmt: skip
    return {"stalls": stalls, "per_update": elapsed / args.updates, "bytes": size,
            "saves": len(stalls)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=24)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--updates", type=int, default=12)
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--sharded", action="store_true", help="FSDP2 on 2 ranks (torchrun)")
    parser.add_argument("--quick", action="store_true", help="a tiny model, one repeat")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--dir", help="where checkpoints are written (default: a temp dir)")
    args = parser.parse_args()
    if args.quick:
        args.width, args.depth, args.updates, args.every, args.repeats = 64, 2, 4, 2, 1
    if args.sharded and "RANK" not in os.environ:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "2", *sys.argv]  # fmt: skip
        raise SystemExit(subprocess.call(cmd))
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // (2 if args.sharded else 1)))
    with distributed.setup() as info:
        # One directory for every rank (rank zero's choice): each writes its shards there.
        chosen = [args.dir or (tempfile.mkdtemp(prefix="save_stall-") if info.rank == 0 else "")]
        if info.is_distributed:
            torch.distributed.broadcast_object_list(chosen, src=0)
        base = Path(chosen[0])
        runs: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
        for repeat in range(args.repeats):
            for mode in MODES if repeat % 2 == 0 else MODES[::-1]:  # interleaved
                root = base / f"{mode.replace(' ', '_')}-{repeat}"
                runs[mode].append(measure(mode, args, root))
                if info.rank == 0:
                    shutil.rmtree(root, ignore_errors=True)
        if info.rank == 0:
            report(runs, args)


def report(runs: dict[str, list[dict[str, Any]]], args: argparse.Namespace) -> None:
    base = statistics.median(r["per_update"] for r in runs["no saves"])
    sync_stall = statistics.median(s for r in runs["sync"] for s in r["stalls"])
    rows = []
    for mode in MODES:
        stalls = [s for r in runs[mode] for s in r["stalls"]]
        stall = statistics.median(stalls) if stalls else 0.0
        per_update = statistics.median(r["per_update"] for r in runs[mode])
        rows.append({
            "mode": mode,
            "saves": runs[mode][0]["saves"],
            "checkpoint_mb": round(runs[mode][0]["bytes"] / 2**20, 1),
            "stall_ms": round(1e3 * stall, 1),
            "stall_vs_sync": round(stall / sync_stall, 3) if sync_stall else None,
            "ms_per_update": round(1e3 * per_update, 1),
            "vs_no_saves": round(per_update / base, 3),
        })  # fmt: skip
    if args.json:
        print(json.dumps(rows))
        return
    params = (args.width * args.width + args.width) * args.depth + args.width + 1
    kind = "FSDP2, 2 ranks" if args.sharded else "1 process"
    print(f"{params / 1e6:.1f}M parameters, {kind}, a save every {args.every} updates")
    print(f"{'mode':<10} {'ckpt MB':>8} {'stall ms':>9} {'vs sync':>8} {'ms/update':>10} "
          f"{'vs no saves':>12}")  # fmt: skip
    for r in rows:
        print(f"{r['mode']:<10} {r['checkpoint_mb']:>8} {r['stall_ms']:>9} "
              f"{r['stall_vs_sync'] if r['stall_vs_sync'] is not None else '-':>8} "
              f"{r['ms_per_update']:>10} {r['vs_no_saves']:>12}")  # fmt: skip


if __name__ == "__main__":
    main()
