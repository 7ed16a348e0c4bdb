"""Peak host memory per rank: a model built whole on each rank then sharded, against one built
on the meta device and materialized shard by shard (``distributed.wrap(meta_model, fsdp=)``).

Each variant runs in its own ``torchrun`` launch (CPU, gloo), since the measure is the
process's high-water mark: ``resource.getrusage(RUSAGE_SELF).ru_maxrss`` at the end of the
run minus the same before the model is built (after the imports and the process group), the
largest over the ranks. The model: ``--blocks`` blocks of two ``Linear(width, 4 * width)``
layers, sharded per block (FSDP2). Reported side by side in one run: the model's size, each
variant's peak per rank and its ratio to building the whole model first, and whether the
meta-built shards equal the whole-built ones (a float64 sum of each shard; ``init=``
draws other values, so it is not compared).

    python benchmarks/meta_init.py                  # 4 ranks, a 512 MiB model
    python benchmarks/meta_init.py --quick --json   # 2 ranks, 64 MiB, without init=
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

VARIANTS = ("whole first", "meta", "meta + init=")


class Block(nn.Module):
    """Two linear layers (the unit each rank materializes at a time)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def init(model: nn.Module) -> None:
    """A torchtitan-style init: truncated normal weights, zero biases."""
    for module in model.modules():
        if isinstance(module, nn.Linear):
            nn.init.trunc_normal_(module.weight, std=0.02)
            nn.init.zeros_(module.bias)


def _peak_kib() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux


def worker(variant: str, blocks: int, width: int, out: Path) -> None:
    """One rank of one variant: build, shard, materialize; write the peak and a checksum."""
    import torch.distributed.fsdp  # imported before the baseline: its own MiBs
    import torch.distributed.tensor

    from loopkit import distributed

    with distributed.setup() as info:
        # FSDP2's first use (the mesh, DTensor's dispatch) costs tens of MiB once, whatever
        # the model: paid on a tiny model before the baseline.
        with torch.device("meta"):
            tiny = nn.Sequential(Block(8))
        distributed.wrap(tiny, fsdp=Block)
        before = _peak_kib()
        torch.manual_seed(0)
        if variant == "whole first":
            model = nn.Sequential(*[Block(width) for _ in range(blocks)])
            distributed.wrap(model, fsdp=Block)
        else:
            with torch.device("meta"):
                model = nn.Sequential(*[Block(width) for _ in range(blocks)])
            distributed.wrap(model, fsdp=Block, init=init if variant == "meta + init=" else None)
        peak = _peak_kib() - before
        # The shards' values (sum of each local shard, exact in float64: a checksum).
        local = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
        sums = [float(t.double().sum()) for t in local]
        (out / f"{variant}.{info.rank}.json").write_text(json.dumps({"peak": peak, "sums": sums}))


def _launch(variant: str, world: int, blocks: int, width: int, out: Path) -> list[dict[str, Any]]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(world), __file__, "--worker", variant, "--blocks", str(blocks), "--width",
           str(width), "--out", str(out)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    if proc.returncode:
        raise SystemExit(f"{variant} failed:\n{proc.stderr[-3000:]}")
    return [json.loads((out / f"{variant}.{r}.json").read_text()) for r in range(world)]


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 ranks, 64 MiB, no init= row")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    parser.add_argument("--world", type=int, default=None)
    parser.add_argument("--blocks", type=int, default=None)
    parser.add_argument("--width", type=int, default=None)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    blocks = args.blocks or (8 if args.quick else 16)
    width = args.width or (512 if args.quick else 1024)
    if args.worker is not None:
        worker(args.worker, blocks, width, Path(args.out))
        return []
    world = args.world or (2 if args.quick else 4)
    model_mib = blocks * (8 * width * width + 5 * width) * 4 / 2**20
    with tempfile.TemporaryDirectory() as tmp:
        variants = VARIANTS[:2] if args.quick else VARIANTS
        found = {v: _launch(v, world, blocks, width, Path(tmp)) for v in variants}
    whole = max(r["peak"] for r in found["whole first"])
    rows = [
        {
            "variant": v,
            "world": world,
            "model_mib": round(model_mib, 1),
            "peak_mib_per_rank": round(max(r["peak"] for r in ranks) / 1024, 1),
            "ratio_to_whole_first": round(max(r["peak"] for r in ranks) / whole, 3),
            "same_shards_as_whole_first": None  # init= draws other values
            if v == "meta + init="
            else [r["sums"] for r in ranks] == [r["sums"] for r in found["whole first"]],
        }
        for v, ranks in found.items()
    ]
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(f"torch {torch.__version__}, {world} ranks (gloo, CPU), peak ru_maxrss per rank "
              f"above its value before the build; model {model_mib:.0f} MiB")  # fmt: skip
        print("| variant | peak MiB / rank | ratio to whole first | shards equal whole first |")
        print("|---|---|---|---|")
        for r in rows:
            print(f"| {r['variant']} | {r['peak_mib_per_rank']} | {r['ratio_to_whole_first']} "
                  f"| {r['same_shards_as_whole_first']} |")  # fmt: skip
    return rows


if __name__ == "__main__":
    main()
