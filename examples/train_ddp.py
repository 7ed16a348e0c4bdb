"""Train with DDP across processes, or single-process: the same script, the same result.

    python examples/train_ddp.py                                          # one process
    torchrun --standalone --nproc-per-node 2 examples/train_ddp.py        # two, one node
    torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d \\
        --rdzv-endpoint HOST:29400 --rdzv-id job1 examples/train_ddp.py   # on each node

The global batch is split over the processes (DistributedSampler, reshuffled every
epoch), gradients are accumulated over 4 micro-batches with one all-reduce per update,
and the loss is averaged over all ranks in one collective per log interval. With the
same --global-batch-size the final weights match the single-process run.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

import loopkit
from loopkit import distributed


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--global-batch-size", type=int, default=32)
    parser.add_argument("--accumulate", type=int, default=4)
    parser.add_argument("--precision", default="fp32", choices=["bf16", "fp16", "fp32"])
    parser.add_argument("--checkpointed", action="store_true", help="checkpoint each block")
    parser.add_argument("--out", help="save the final weights here (rank zero)")
    args = parser.parse_args(argv)

    with distributed.setup() as info:
        torch.manual_seed(0)  # the same initial weights on every rank
        data = torch.utils.data.TensorDataset(torch.randn(1024, 16), torch.randn(1024, 1))
        loader = distributed.loader(
            data, global_batch_size=args.global_batch_size, num_workers=0, seed=1
        )
        model = nn.Sequential(
            nn.Sequential(nn.Linear(16, 64), nn.GELU()),
            nn.Sequential(nn.Linear(64, 64), nn.GELU()),
            nn.Linear(64, 1),
        )
        if args.checkpointed:
            loopkit.checkpointed(model, blocks=lambda m: isinstance(m, nn.Sequential))
        model = distributed.wrap(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        step = loopkit.step(
            model,
            optimizer,
            precision=args.precision,
            accumulate=args.accumulate,
            clip_grad_norm=1.0,
            # sync_ranks=True: the logged loss is the mean over every rank's micro-batches
            # (one collective per log interval), printed once, by rank zero.
            log=loopkit.detach_logging(every=8, sink=loopkit.print_sink, sync_ranks=True),
        )
        for _ in range(args.epochs):
            for x, y in step.iterate(loader):
                with step as s:
                    s.backward(nn.functional.mse_loss(model(x), y))
        step.flush()  # the last log interval (the windows closed themselves)
        save(model, args.out, info)


@distributed.rank_zero_only
def save(model: nn.Module, path: str | None, info: distributed.DistInfo) -> None:
    print(f"done on {info.world_size} process(es)")
    if path:
        inner = getattr(model, "module", model)
        torch.save({k: v.detach().cpu() for k, v in inner.state_dict().items()}, path)


if __name__ == "__main__":
    main()
