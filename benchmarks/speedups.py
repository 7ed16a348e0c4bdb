"""What each guide tip buys through loopkit, measured side by side on this machine.

Rows: bf16 autocast against fp32 on a matmul-heavy model; detach_logging against
``.item()`` every step (host reads counted, and time); activation checkpointing (memory
against time); no_sync under 2-process DDP (all-reduces and time per window); pinned
memory with non-blocking copies (CUDA only: skipped without a GPU).

    python benchmarks/speedups.py [--quick] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

import loopkit

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import checkpointing  # noqa: E402


def _median_ms(fn: Callable[[], None], repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def bf16_vs_fp32(quick: bool) -> dict[str, Any]:
    """A 4-block 1024-wide MLP trained through loopkit.step in fp32 and in bf16."""
    width, batch, steps = (512, 64, 4) if quick else (1024, 256, 8)
    data = [(torch.randn(batch, width), torch.randn(batch, 1)) for _ in range(4)]

    def train(precision: str) -> Callable[[], None]:
        torch.manual_seed(0)
        layers: list[nn.Module] = []
        for _ in range(4):
            layers += [nn.Linear(width, width), nn.GELU()]
        model = nn.Sequential(*layers, nn.Linear(width, 1))
        step = loopkit.step(model, torch.optim.AdamW(model.parameters()), precision=precision)

        def run() -> None:
            for i in range(steps):
                x, y = data[i % len(data)]
                with step as s:
                    s.backward(nn.functional.mse_loss(model(x).float(), y))

        return run

    runs = {p: train(p) for p in ("fp32", "bf16")}
    ms = {p: 0.0 for p in runs}
    samples: dict[str, list[float]] = {p: [] for p in runs}
    for _ in range(3 if quick else 5):  # interleaved
        for p, run in runs.items():
            samples[p].append(_median_ms(run, 1) / steps)
    ms = {p: statistics.median(v) for p, v in samples.items()}
    return {
        "tip": "16-bit mixed precision",
        "loopkit": 'loopkit.step(..., precision="bf16")',
        "measure": f"ms per step, 4x{width} MLP, batch {batch}",
        "baseline": round(ms["fp32"], 2),
        "with_loopkit": round(ms["bf16"], 2),
        "result": f"{ms['fp32'] / ms['bf16']:.2f}x faster",
    }


def logging_syncs(quick: bool) -> dict[str, Any]:
    """100 training steps logging the loss with .item() each step vs detach_logging(every=10)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    data = [(torch.randn(32, 64), torch.randn(32, 1)) for _ in range(10)]
    steps = 100

    def item_loop() -> None:
        losses = []
        for i in range(steps):
            x, y = data[i % 10]
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())

    def detached_loop() -> None:
        log = loopkit.detach_logging(every=10, sink=None)
        for i in range(steps):
            x, y = data[i % 10]
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            log(loss=loss)

    counts = {}
    for name, fn in (("item", item_loop), ("detach", detached_loop)):
        with loopkit.count_host_syncs() as syncs:
            fn()
        counts[name] = syncs.count
    ms = {
        "item": _median_ms(item_loop, 3 if quick else 7),
        "detach": _median_ms(detached_loop, 3 if quick else 7),
    }
    return {
        "tip": "no .item() every step",
        "loopkit": "log = loopkit.detach_logging(every=10)",
        "measure": "host syncs in 100 steps (ms for 100 steps)",
        "baseline": f"{counts['item']} ({ms['item']:.1f} ms)",
        "with_loopkit": f"{counts['detach']} ({ms['detach']:.1f} ms)",
        "result": f"{counts['item'] // max(counts['detach'], 1)}x fewer syncs; on a CPU a "
        "sync costs no wait, on a GPU each one stalls the host",
    }


def checkpoint_rows(quick: bool) -> dict[str, Any]:
    """Full activation checkpointing on the GPT-style stack of benchmarks/checkpointing.py."""
    argv = ["--json", "--quick"] if quick else ["--json", "--layers", "4", "--seq", "128"]
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()):
        rows = {r["setting"]: r for r in checkpointing.main(argv)}
    full = rows["full"]
    return {
        "tip": "gradient checkpointing",
        "loopkit": "loopkit.checkpointed(model, blocks=Layer)",
        "measure": "bytes kept for backward (peak of the step), time per step",
        "baseline": f"{rows['none']['saved_MiB']:.1f} MiB ({rows['none']['peak_MiB']:.1f} MiB), "
        f"{rows['none']['ms_per_step']:.0f} ms",
        "with_loopkit": f"{full['saved_MiB']:.1f} MiB ({full['peak_MiB']:.1f} MiB), "
        f"{full['ms_per_step']:.0f} ms",
        "result": f"{1 / full['saved_ratio']:.0f}x less saved, {full['time_ratio']:.2f}x time",
    }


def ddp_no_sync(quick: bool) -> dict[str, Any]:
    """Two gloo processes, accumulation of 4: loopkit's no_sync against syncing every step."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(HERE / "ddp_no_sync.py"),
        "--windows",
        "4" if quick else "20",
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-2000:])
    r = json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])
    w, wo = r["with"], r["without"]
    return {
        "tip": "no gradient sync while accumulating (DDP)",
        "loopkit": "loopkit.accumulate(ddp_model, opt, every=4)",
        "measure": f"bucket all-reduces and ms per 4-micro-batch window, 2 gloo ranks, "
        f"{r['params'] / 1e6:.1f}M params",
        "baseline": f"{wo['all_reduces_per_window']} ({wo['ms_per_window']:.1f} ms)",
        "with_loopkit": f"{w['all_reduces_per_window']} ({w['ms_per_window']:.1f} ms)",
        "result": f"{wo['ms_per_window'] / w['ms_per_window']:.2f}x faster windows",
    }


def pinned_copies(quick: bool) -> dict[str, Any]:
    """Host-to-GPU batch copies: pageable and blocking against pinned and non-blocking."""
    row = {
        "tip": "pin_memory + non_blocking copies",
        "loopkit": "loopkit.to_device(batch, 'cuda')  # non_blocking=None",
    }
    if not torch.cuda.is_available():
        return row | {
            "measure": "-",
            "baseline": "-",
            "with_loopkit": "-",
            "result": "skipped: no GPU",
        }
    batch = torch.randn(64, 3, 224, 224)
    pinned = batch.pin_memory()
    compute = torch.randn(4096, 4096, device="cuda")

    def copy_and_compute(src: torch.Tensor) -> Callable[[], None]:
        def run() -> None:
            for _ in range(10):
                moved = loopkit.to_device(src, "cuda")
                compute @ compute  # overlaps with the copy only when it is non-blocking
                moved.sum()
            torch.cuda.synchronize()

        return run

    base = _median_ms(copy_and_compute(batch), 5)
    fast = _median_ms(copy_and_compute(pinned), 5)
    return row | {
        "measure": "ms for 10 copies of a 64x3x224x224 batch, overlapped with a matmul",
        "baseline": f"{base:.1f}",
        "with_loopkit": f"{fast:.1f}",
        "result": f"{base / fast:.2f}x faster",
    }


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = [
        f(args.quick)
        for f in (bf16_vs_fp32, logging_syncs, checkpoint_rows, ddp_no_sync, pinned_copies)
    ]
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(f"torch {torch.__version__}, 1 CPU thread per process\n")
        print("| tip | loopkit | measured | without | with loopkit | result |")
        print("|---|---|---|---|---|---|")
        for r in rows:
            print(
                f"| {r['tip']} | `{r['loopkit']}` | {r['measure']} | {r['baseline']} "
                f"| {r['with_loopkit']} | {r['result']} |"
            )
    return rows


if __name__ == "__main__":
    main()
