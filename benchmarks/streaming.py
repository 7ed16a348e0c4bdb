"""Streamed data resumed: a loader that saves its place against ``loopkit.replayed``'s re-read,
and what a shuffle buffer saved with the loader costs.

Resume cost. JSON-lines shard files the benchmark writes (each line an id, 64 floats and some
text; reading a sample decodes its line into a tensor) are streamed by
``loopkit.stream_shards`` (shuffled by shard and within each) in batches of 8. A run reads
the pass and saves a checkpoint after 10%, 50% and 90% of it, once through torchdata's
``StatefulDataLoader`` given as ``Checkpointer(loader=...)`` (its state is each worker's
place) and once through ``loopkit.replayed(DataLoader(...))`` over the same data set (its
state is the batches handed out: a resume reads them again). Then, in fresh loaders, the
time from ``Checkpointer.resume()`` called to the first batch of the resumed pass in hand
(worker start-up included, the median of the repeats, the two interleaved), the samples
the data set decoded meanwhile, and whether that batch is the one the saving run read
next. ``replayed`` prints its own line on stderr as it re-reads ("read N batches again
... in X s"); its X is shown beside the measured time.

Shuffle buffer. 1 KB samples (256 float32 tensors) from an endless
stream go through ``loopkit.shuffle_buffer`` of 100, 1,000 and 10,000 samples (and through
no buffer) into a ``StatefulDataLoader``, batches of 32. Per batch: the loader read alone,
and read by ``step.iterate`` with a ``Checkpointer(loader=)`` (which reads the loader's
state before each batch it takes ahead). The saved state's size (``torch.save`` of what a
checkpoint holds of the loader) is shown beside the buffers' samples' bytes.

    python benchmarks/streaming.py            # a few minutes
    python benchmarks/streaming.py --quick    # what the tests run (--json: the rows)
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import multiprocessing
import random
import re
import shutil
import statistics
import tempfile
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

import loopkit
from loopkit._data._consumed import state_of

BATCH = 8  # samples per batch when resuming
BUFFER_BATCH = 32  # samples per batch through the shuffle buffer
SAMPLE_FLOATS = 256  # 1 KB samples in the shuffle buffer
POSITIONS = (0.1, 0.5, 0.9)  # where the pass is saved, as shares of it
REPLAYED_LINE = re.compile(r"read (\d+) batches again .* in ([\d.]+) s")


# -- resume cost ----------------------------------------------------------------------------


def write_shards(directory: Path, shards: int, per_shard: int) -> list[str]:
    """JSON-lines shards of (id, 64 floats, some text); the same bytes every time."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    paths = []
    for s in range(shards):
        path = directory / f"shard-{s:04d}.jsonl"
        rows = []
        for i in range(per_shard):
            x = [round(rng.gauss(0, 1), 6) for _ in range(64)]
            rows.append(json.dumps({"id": s * per_shard + i, "x": x, "text": "lorem ipsum " * 20}))
        path.write_text("\n".join(rows) + "\n")
        paths.append(str(path))
    return paths


class ReadJsonl:
    """A shard's samples, each line decoded into a tensor; counts the samples decoded in
    every process (a counter in shared memory: loader workers are forked)."""

    def __init__(self) -> None:
        self.decoded = multiprocessing.get_context("fork").Value("q", 0)

    def __call__(self, path: str) -> Iterator[dict[str, Any]]:
        with open(path) as f:
            for line in f:
                row = json.loads(line)
                with self.decoded.get_lock():
                    self.decoded.value += 1
                yield {"id": row["id"], "x": torch.tensor(row["x"])}


def pipeline(kind: str, files: list[str], read: ReadJsonl, workers: int) -> Any:
    """The same stream, in a loader that saves its place or in a replayed plain one."""
    data = loopkit.stream_shards(files, read, seed=0, shuffle=True)
    context: dict[str, Any] = {"multiprocessing_context": "fork"} if workers else {}
    if kind == "stateful":
        return StatefulDataLoader(data, batch_size=BATCH, num_workers=workers, **context)
    return loopkit.replayed(DataLoader(data, batch_size=BATCH, num_workers=workers, **context))


def close(loader: Any, it: Any) -> None:
    """Stop a pass's workers now (not when collected: the next loader forks meanwhile)."""
    if hasattr(it, "close"):
        it.close()  # replayed's generator: its DataLoader iterator is dropped with it
    iterator = getattr(loader, "_iterator", None)
    iterator = it if iterator is None else iterator
    if hasattr(iterator, "_shutdown_workers"):
        iterator._shutdown_workers()


def save_run(
    kind: str, files: list[str], workers: int, at: list[int], root: Path
) -> list[list[int]]:
    """One pass saved after each of ``at`` batches (one directory each); the ids of the batch
    read after each save."""
    loader = pipeline(kind, files, ReadJsonl(), workers)
    ckpts = [loopkit.Checkpointer(root / str(n), model=nn.Linear(1, 1), loader=loader) for n in at]
    it = iter(loader)
    taken, following = 0, []
    for n, ckpt in zip(at, ckpts, strict=True):
        while taken < n:
            next(it)
            taken += 1
        ckpt.save()
        following.append(next(it)["id"].tolist())
        taken += 1
    close(loader, it)
    return following


def timed_resume(kind: str, files: list[str], workers: int, directory: Path) -> dict[str, Any]:
    """Seconds from resume() called to the first batch in hand, the samples decoded, the ids
    of that batch and replayed's own report of its re-read."""
    read = ReadJsonl()
    loader = pipeline(kind, files, read, workers)
    ckpt = loopkit.Checkpointer(directory, model=nn.Linear(1, 1), loader=loader)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        start = time.perf_counter()
        ckpt.resume()
        it = iter(loader)
        batch = next(it)
        seconds = time.perf_counter() - start
    decoded = read.decoded.value  # workers may read ahead by a few batches meanwhile
    close(loader, it)
    found = REPLAYED_LINE.search(err.getvalue())
    return {"seconds": seconds, "decoded": decoded, "ids": batch["id"].tolist(),
            "line": found.group(0) if found else None,
            "reported_s": float(found.group(2)) if found else None}  # fmt: skip


def resume_rows(args: argparse.Namespace, work: Path) -> list[dict[str, Any]]:
    files = write_shards(work / "shards", args.shards, args.per_shard)
    batches = args.shards * args.per_shard // BATCH
    at = [int(p * batches) for p in POSITIONS]
    rows = []
    for workers in args.workers:
        following = {k: save_run(k, files, workers, at, work / f"{k}-{workers}")
                     for k in ("stateful", "replayed")}  # fmt: skip
        for i, n in enumerate(at):
            runs: dict[str, list[dict[str, Any]]] = {"stateful": [], "replayed": []}
            for r in range(args.repeats):  # interleaved: drift on the machine hits both alike
                for kind in ("stateful", "replayed") if r % 2 == 0 else ("replayed", "stateful"):
                    runs[kind].append(
                        timed_resume(kind, files, workers, work / f"{kind}-{workers}" / str(n))
                    )
            s = statistics.median(r["seconds"] for r in runs["stateful"])
            p = statistics.median(r["seconds"] for r in runs["replayed"])
            rows.append({
                "workers": workers, "batches_per_pass": batches, "position": n,
                "position_percent": round(100 * n / batches), "shard_samples": args.per_shard,
                "stateful_s": round(s, 4), "replayed_s": round(p, 4), "ratio": round(p / s, 2),
                "stateful_decoded": max(r["decoded"] for r in runs["stateful"]),
                "replayed_decoded": min(r["decoded"] for r in runs["replayed"]),
                "replayed_reported_s": statistics.median(r["reported_s"] for r in runs["replayed"]),
                "replayed_line": runs["replayed"][0]["line"],
                # Each resume's first batch is the one both saving runs read next.
                "same_next_batch": following["stateful"][i] == following["replayed"][i]
                and all(r["ids"] == following[k][i] for k in runs for r in runs[k]),
            })  # fmt: skip
    return rows


# -- shuffle buffer -------------------------------------------------------------------------


class Samples:
    """An endless stream's shard: 1 KB samples, each in its own memory (tensor or array)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind

    def __call__(self, shard: int) -> Iterator[Any]:
        for i in range(4096):
            value = float(shard * 4096 + i)
            if self.kind == "tensor":
                yield torch.full((SAMPLE_FLOATS,), value)
            else:
                yield np.full(SAMPLE_FLOATS, value, dtype=np.float32)


def buffered_loader(kind: str, size: int, workers: int) -> StatefulDataLoader:
    source = loopkit.stream_shards(list(range(16)), Samples(kind), shuffle=False, passes=None)
    data = source if size == 0 else loopkit.shuffle_buffer(source, size, seed=0)
    # A batch that never comes (a worker that cannot send it) fails here, not for ever.
    more = {"multiprocessing_context": "fork", "timeout": 300} if workers else {}
    return StatefulDataLoader(data, batch_size=BUFFER_BATCH, num_workers=workers, **more)


def us_per_batch(batches: Iterator[Any], workers: int, budget: float, most: int) -> float:
    """Microseconds per batch once every worker's buffer is full (each worker's first batch
    comes after its buffer filled): the median of 5 runs of ``most // 5`` batches, each cut
    short after ``budget / 5`` seconds (one batch at least), against other work's spikes."""
    for _ in range(2 * max(workers, 1)):
        next(batches)
    runs = []
    for _ in range(5):
        n, start = 0, time.perf_counter()
        while n < most // 5 and (n == 0 or time.perf_counter() - start < budget / 5):
            next(batches)
            n += 1
        runs.append((time.perf_counter() - start) / n)
    return 1e6 * statistics.median(runs)


def buffer_row(
    kind: str, size: int, workers: int, args: argparse.Namespace, work: Path
) -> dict[str, Any]:
    loader = buffered_loader(kind, size, workers)
    it = iter(loader)
    alone = us_per_batch(it, workers, args.budget, args.most)
    blob = io.BytesIO()
    torch.save(state_of(loader, loader.state_dict), blob)  # what a checkpoint holds of it
    close(loader, it)
    loader = buffered_loader(kind, size, workers)
    model = nn.Linear(1, 1)
    step = loopkit.step(model, torch.optim.SGD(model.parameters(), lr=0.1))
    loopkit.Checkpointer(work / f"iterate-{kind}-{size}-{workers}", model=model, step=step,
                         loader=loader)  # fmt: skip
    batches = step.iterate(loader)
    tracked = us_per_batch(batches, workers, args.budget, args.most)
    close(loader, batches)
    buffered = size * max(workers, 1)
    return {"sample": kind, "workers": workers, "buffer": size, "buffered_samples": buffered,
            "us_per_batch": round(alone), "us_per_batch_iterate": round(tracked),
            "state_bytes": len(blob.getvalue()),
            "buffered_bytes": buffered * 4 * SAMPLE_FLOATS}  # fmt: skip


def buffer_rows(args: argparse.Namespace, work: Path) -> list[dict[str, Any]]:
    rows = []
    # Tensors only: a shuffle_buffer refuses samples a checkpoint cannot load (numpy arrays).
    for kind in ("tensor",):
        for workers in args.workers:
            for size in args.buffers:
                rows.append(buffer_row(kind, size, workers, args, work))
    for r in rows:
        base = next(b for b in rows if b["buffer"] == 0 and b["sample"] == r["sample"]
                    and b["workers"] == r["workers"])  # fmt: skip
        if "skipped" not in r:
            r["ratio"] = round(r["us_per_batch"] / base["us_per_batch"], 2)
            r["ratio_iterate"] = round(r["us_per_batch_iterate"] / base["us_per_batch_iterate"], 2)
            r["state_growth_bytes"] = r["state_bytes"] - base["state_bytes"]
    return rows


# -- report ---------------------------------------------------------------------------------


def report(
    resume: list[dict[str, Any]], buffers: list[dict[str, Any]], args: argparse.Namespace
) -> None:
    first = resume[0]
    print(f"torch {torch.__version__}; {args.shards} JSON-lines shards of {args.per_shard} samples "
          f"(stream_shards, shuffled), batches of {BATCH}: {first['batches_per_pass']} a pass; "
          f"median of {args.repeats} resumes\n")  # fmt: skip
    print("Resume: seconds from Checkpointer.resume() called to the resumed pass's first batch in "
          "hand (worker start-up included)\n")  # fmt: skip
    print("| workers | saved after (batches) | StatefulDataLoader (s) | loopkit.replayed (s) | "
          "ratio | samples decoded: stateful | replayed | replayed's own line (s) | same batch "
          "|\n|---|---|---|---|---|---|---|---|---|")  # fmt: skip
    for r in resume:
        print(f"| {r['workers']} | {r['position']:,} ({r['position_percent']}%) | "
              f"{r['stateful_s']:.3f} | {r['replayed_s']:.3f} | {r['ratio']:.1f}x | "
              f"{r['stateful_decoded']:,} | {r['replayed_decoded']:,} | "
              f"{r['replayed_reported_s']:.2f} | "
              f"{'yes' if r['same_next_batch'] else 'NO'} |")  # fmt: skip
    print("\nThe stateful loader's workers start where they stood: each reads its current shard "
          "again (a shuffled shard is read whole), whatever the place. replayed reads the pass "
          "again up to the saved place; it says so on stderr, e.g.\n  loopkit.replayed: "
          f"{resume[-1]['replayed_line']} ...\n(the samples decoded count the workers' "
          "read-ahead too; 'same batch': each resumed pass's first batch is the one both saving "
          "runs read next)\n")  # fmt: skip
    print(
        f"Shuffle buffer: microseconds per batch of {BUFFER_BATCH} samples of "
        f"{4 * SAMPLE_FLOATS} bytes through a StatefulDataLoader, and the loader's saved state\n"
    )
    print("| sample | workers | buffer | us/batch: loader | vs no buffer | step.iterate + "
          "Checkpointer | vs no buffer | saved state (bytes) | buffered samples' bytes |\n"
          "|---|---|---|---|---|---|---|---|---|")  # fmt: skip
    for r in buffers:
        head = f"| {r['sample']} | {r['workers']} | {r['buffer']:,} |"
        if "skipped" in r:
            print(f"{head} not run: {r['skipped']} | | | | | |")
            continue
        print(f"{head} {r['us_per_batch']:,} | {r['ratio']:.2f}x | "
              f"{r['us_per_batch_iterate']:,} | {r['ratio_iterate']:.2f}x | "
              f"{r['state_bytes']:,} | {r['buffered_bytes']:,} |")  # fmt: skip
    print("\nEach worker keeps its own buffer (workers x buffer samples held and saved). With 0 "
          "workers a batch costs the buffer's own work (a random draw per sample). With workers, "
          "torchdata's worker sends its data set's state with every batch (snapshot_every_n_steps"
          "=1, the default), the buffered samples with it, packed as one bytes object "
          "(torch.save) by the worker: StatefulDataLoader(snapshot_every_n_steps=N) sends it "
          "every N batches instead, still exact.")  # fmt: skip


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, one repeat (seconds)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    parser.add_argument("--dir", help="where to write the shards and checkpoints (kept)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message=".*set_vital.*")  # torchdata 0.11 on torch 2.13
    if args.quick:
        args.shards, args.per_shard, args.repeats = 16, 150, 1
        args.buffers, args.budget, args.most = [0, 100, 1000], 0.2, 25
    else:
        args.shards, args.per_shard, args.repeats = 48, 500, 3
        args.buffers, args.budget, args.most = [0, 100, 1000, 10000], 2.0, 400
    work = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="loopkit-streaming-"))
    try:
        result = {"resume": resume_rows(args, work), "shuffle_buffer": buffer_rows(args, work)}
    finally:
        if not args.dir:
            shutil.rmtree(work, ignore_errors=True)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        report(result["resume"], result["shuffle_buffer"], args)
    return result


if __name__ == "__main__":
    main()
