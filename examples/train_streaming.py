"""Train on a streamed data set (HF datasets in streaming mode over JSON-lines shards), resumed
exactly after a stop or a kill at any moment.

    python examples/train_streaming.py --dir runs/stream                # one process
    torchrun --standalone --nproc-per-node 2 examples/train_streaming.py --dir runs/stream2

Without --data it writes 8 small shards beside --dir (in stream-data/) first. Each rank
reads its own shards (split_dataset_by_node), --workers loader workers read them in turn,
and --buffer N shuffles the stream through a loopkit.shuffle_buffer of N samples whose
contents are saved with the loader (HF's own shuffle buffer is not). torchdata's
StatefulDataLoader saves each worker's place; the Checkpointer saves each rank's, after the
batches the loop consumed. Kill it and run the same command again: it continues with the
next sample, and ends at the weights an uninterrupted run ends at. --trace FILE.rankN records
the ids each update trained on.

--source shards reads the shards through loopkit.stream_shards instead (shuffled by shard
and within each, every epoch in a new order): a run saved by 2 processes then resumes on
another number with --reseed, and every sample of the epoch is still read once.
"""

from __future__ import annotations

import argparse
import json
import os
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from datasets import load_dataset
from datasets.distributed import split_dataset_by_node
from torch import nn
from torchdata.stateful_dataloader import StatefulDataLoader

import loopkit
from loopkit import distributed

FEATURES = 8


def write_shards(directory: Path, shards: int = 8, per_shard: int = 64) -> list[str]:
    """Small JSON-lines shards of (id, x, y) samples; the same files every time."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    paths = []
    for s in range(shards):
        path = directory / f"shard-{s:03d}.jsonl"
        lines = []
        for i in range(per_shard):
            x = [rng.gauss(0, 1) for _ in range(FEATURES)]
            lines.append(json.dumps({"id": s * per_shard + i, "x": x, "y": [sum(x[:3])]}))
        if not path.exists():  # another rank may be writing it: the same bytes, renamed whole
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text("\n".join(lines) + "\n")
            tmp.replace(path)
        paths.append(str(path))
    return paths


def read_jsonl(path: str) -> Iterator[dict[str, Any]]:
    """A shard's samples as tensors (what stream_shards reads, shard by shard)."""
    with open(path) as f:
        for line in f:
            row = json.loads(line)
            yield {"id": row["id"], "x": torch.tensor(row["x"]), "y": torch.tensor(row["y"])}


def augment(sample: dict[str, Any]) -> dict[str, Any]:
    """Random noise on the features: the same after a resume (its RNGs are set per sample)."""
    return {**sample, "x": sample["x"] + 0.05 * torch.randn(FEATURES)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", required=True, help="checkpoint directory")
    parser.add_argument("--data", help="a directory of *.jsonl shards (default: written)")
    parser.add_argument("--workers", type=int, default=0, help="loader workers per rank")
    parser.add_argument("--buffer", type=int, default=0, help="shuffle buffer size (0: none)")
    parser.add_argument(
        "--source", default="hf", choices=["hf", "shards"],
        help="hf: HF datasets streaming, split by node; shards: loopkit.stream_shards (it "
        "splits itself again on another number of processes: see --reseed)",
    )  # fmt: skip
    parser.add_argument("--reseed", action="store_true", help="resume(reseed=True)")
    parser.add_argument("--updates", type=int, default=40, help="optimizer updates to train")
    parser.add_argument("--save-every", type=int, default=3)
    parser.add_argument("--trace", help="append each update's sample ids to TRACE.rank<N>")
    parser.add_argument("--out", help="save the final weights here")
    args = parser.parse_args(argv)

    with distributed.setup() as job:
        rank, world = job.rank, job.world_size
        data_dir = Path(args.data) if args.data else Path(args.dir).parent / "stream-data"
        files = sorted(map(str, data_dir.glob("*.jsonl"))) if args.data else write_shards(data_dir)
        stream: Any
        if args.source == "shards":  # shuffled by shard and within each, read for ever
            stream = loopkit.stream_shards(
                files, read_jsonl, seed=1, passes=None, transform=augment
            )
        else:
            stream = load_dataset("json", data_files=files, split="train", streaming=True)
            stream = split_dataset_by_node(stream.with_format("torch"), rank=rank, world_size=world)
        if args.buffer:  # read for ever, shuffled through a buffer saved with the loader
            stream = loopkit.shuffle_buffer(
                stream, args.buffer, seed=1, passes=None, transform=augment
            )
        loader = StatefulDataLoader(stream, batch_size=4, num_workers=args.workers)

        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(FEATURES, 32), nn.GELU(), nn.Dropout(0.1), nn.Linear(32, 1))
        model = distributed.wrap(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        step = loopkit.step(model, optimizer, accumulate=2)
        ckpt = loopkit.Checkpointer(
            args.dir, model=model, optimizer=optimizer, step=step, loader=loader
        )
        stop = loopkit.until(step, max_updates=args.updates, check_every=1, checkpointer=ckpt)
        resumed = ckpt.resume(reseed=args.reseed)
        if resumed is not None and rank == 0:
            print(f"resumed from {resumed.name} at update {step.updates}", flush=True)
        trace = open(f"{args.trace}.rank{rank}", "a") if args.trace else None  # noqa: SIM115
        if trace is not None:
            trace.write(f"start {step.updates}\n")
        for batch in step.iterate(loader):
            if trace is not None:  # the update this micro-step trains for, and its samples
                trace.write(f"{step.updates} {batch['id'].tolist()}\n")
                trace.flush()
            with step as s:
                s.backward(nn.functional.mse_loss(model(batch["x"]), batch["y"]))
            ckpt.maybe_save(every=args.save_every)
            if stop.check():
                break
        ckpt.save_if_needed()
        if args.out and rank == 0:
            inner = getattr(model, "module", model)
            torch.save({k: v.detach().clone() for k, v in inner.state_dict().items()}, args.out)
        if rank == 0:
            print(f"finished at update {step.updates} ({stop.reason})", flush=True)


if __name__ == "__main__":
    main()
