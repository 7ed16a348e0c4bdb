"""A training run that can be killed at any moment and resumed to the same final weights.

    python examples/train_resumable.py --dir runs/demo          # run (or resume) to the end
    # kill it (Ctrl-C, SIGKILL, a lost node), run the same command again: it resumes

Checkpoints are written every --save-every optimizer updates (atomically: a crash during a
save leaves the previous ones intact) and hold the model, optimizer, scheduler, step
counters, GradScaler, RNG states and the position in the epoch. With --out, the final
weights are saved there, bit-identical to an uninterrupted run.

    python examples/train_resumable.py --dir runs/aug --augment --workers 2 --checkpointed

--augment trains on a data set that augments at random in __getitem__ (python, numpy and
torch RNGs) and has a random number of valid "tokens" per sample, weighted by that count:
resuming is exact there too, and with another --workers than the run started with.

Loop control: the run is validated --val-per-epoch times per epoch (loopkit.evaluate: every
validation sample counted once, whatever the number of processes); --patience N stops it
when the validation loss has not improved N times in a row; --max-time stops it after that
much training time (all runs of it together). --ema 0.99 keeps an fp32 moving average of the
weights (saved in the checkpoints, validated in place of the training weights). A SIGTERM
(what a preempting scheduler sends) to any process makes every process stop at the same
update, save there and exit 0:

    torchrun --nproc-per-node 2 examples/train_resumable.py --dir runs/pre --slow 0.05 &
    kill -TERM <one worker's pid>     # then run the same command again: it resumes
"""

from __future__ import annotations

import argparse
import contextlib
import random
import time
from typing import Any

import numpy as np
import torch
from torch import nn

import loopkit
from loopkit import distributed


class Payload:
    """Extra user state (here only ballast, to make saves take measurable time)."""

    def __init__(self, megabytes: int) -> None:
        self.data = torch.zeros(megabytes * 2**18)  # float32: 4 bytes each

    def state_dict(self) -> dict[str, Any]:
        return {"data": self.data}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.data = state["data"]


class Augmented(torch.utils.data.Dataset[tuple[torch.Tensor, ...]]):
    """Random augmentation drawn from python, numpy and torch, as real pipelines draw it."""

    def __init__(self, n: int) -> None:
        self.x, self.y = torch.randn(n, 16), torch.randn(n, 16)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, ...]:
        x = self.x[i].flip(0) if random.random() < 0.5 else self.x[i]
        x = x + torch.from_numpy(np.random.normal(0, 0.1, 16).astype(np.float32))
        x = x + 0.05 * torch.randn(16)
        valid = (torch.arange(16) < torch.randint(4, 17, ())).float()  # "tokens" in use
        return x, self.y[i], valid


class Block(nn.Sequential):
    def __init__(self) -> None:
        super().__init__(nn.Linear(64, 64), nn.GELU(), nn.Dropout(0.1))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", required=True, help="checkpoint directory")
    parser.add_argument("--precision", default="fp32", choices=["bf16", "fp16", "fp32"])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--save-every", type=int, default=3)
    parser.add_argument("--payload-mb", type=int, default=0)
    parser.add_argument("--out", help="save the final weights here")
    parser.add_argument("--augment", action="store_true", help="random augmentation, weights")
    parser.add_argument("--workers", type=int, default=0, help="data loader workers")
    parser.add_argument("--checkpointed", action="store_true", help="recompute the blocks")
    parser.add_argument("--val-per-epoch", type=int, default=2, help="validations per epoch")
    parser.add_argument("--patience", type=int, help="early stopping on the validation loss")
    parser.add_argument("--max-time", help='stop after this training time ("HH:MM:SS")')
    parser.add_argument("--check-every", type=int, default=2, help="updates between checks")
    parser.add_argument("--slow", type=float, default=0.0, help="sleep per batch (a demo knob)")
    parser.add_argument("--ema", type=float, help="keep an EMA of the weights at this decay")
    parser.add_argument("--fsdp", action="store_true", help="shard the model (FSDP2) by layer")
    parser.add_argument("--replicate", type=int, help="with --fsdp: HSDP, this many replicas")
    parser.add_argument("--async-save", action="store_true", help="write saves in background")
    args = parser.parse_args(argv)

    with distributed.setup():
        torch.manual_seed(0)
        data: torch.utils.data.Dataset[Any]
        if args.augment:
            data = Augmented(512)
            model = nn.Sequential(nn.Linear(16, 64), Block(), Block(), nn.Linear(64, 16))
        else:
            data = torch.utils.data.TensorDataset(torch.randn(512, 16), torch.randn(512, 1))
            model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Dropout(0.1), nn.Linear(64, 1))
        loader = distributed.loader(data, batch_size=16, num_workers=args.workers, seed=1)
        outputs = 16 if args.augment else 1
        held_out = torch.utils.data.TensorDataset(torch.randn(100, 16), torch.randn(100, outputs))
        val_loader = distributed.loader(held_out, batch_size=32, shuffle=False, num_workers=0)
        if args.checkpointed:
            loopkit.checkpointed(model, blocks=Block)
        # --fsdp: each Linear its own shard group (every rank holds a part of every layer);
        # the Checkpointer then writes each rank's shards into a checkpoint directory.
        fsdp = nn.Linear if args.fsdp else False
        model = distributed.wrap(model, fsdp=fsdp, replicate=args.replicate)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.9)
        # An fp32 average of the weights, updated after each real update, saved with the step.
        average = loopkit.ema(model, decay=args.ema, warmup=True) if args.ema else None
        step = loopkit.step(
            model,
            optimizer,
            precision=args.precision,
            accumulate=4,
            clip_grad_norm=1.0,
            scheduler=scheduler,
            skip_nonfinite=args.precision != "fp16",
            ema=average,
        )
        ckpt = loopkit.Checkpointer(
            args.dir,
            model=model,
            optimizer=optimizer,
            scheduler=scheduler,
            step=step,
            loader=loader,
            extra={"payload": Payload(args.payload_mb)},
            keep=2,
            # A thread writes each save while training goes on (the loop waits only for the
            # copy to host memory); the process group's teardown waits for the last one.
            async_save=args.async_save,
        )
        validate = loopkit.cadence(step, per_epoch=args.val_per_epoch, loader=loader)
        early = None
        if args.patience:
            early = loopkit.early_stop(step, "loss", patience=args.patience, min_updates=10)
        stop = loopkit.until(
            step,
            max_epochs=args.epochs,
            max_time=args.max_time,
            signals=("SIGTERM",),
            early_stop=early,
            check_every=args.check_every,
            checkpointer=ckpt,  # a stop saves there; elapsed time and patience are saved
        )
        resumed = ckpt.resume()
        if resumed is not None:
            say(f"resumed from {resumed.name} at update {step.updates}")
        for _ in stop.epochs(loader):  # ends on a stop or after --epochs, then saves
            for batch in step.iterate(loader):
                with step as s:
                    if args.augment:  # a mean over the valid tokens, weighted by their count
                        x, y, valid = batch
                        err = (model(x).float() - y).pow(2) * valid
                        s.backward(err.sum() / valid.sum(), weight=valid.sum())
                    else:
                        x, y = batch
                        s.backward(nn.functional.mse_loss(model(x), y))
                if validate.due():  # the same updates on every rank, never mid-window
                    # With --ema the average is validated; the training weights come back.
                    with average.swapped() if average else contextlib.nullcontext():
                        metrics = loopkit.evaluate(model, val_loader, squared_error, step=step)
                    if distributed.is_rank_zero():
                        print(f"update {step.updates}: validation loss {metrics['loss']:.5f}")
                    if early is not None:
                        early.observe(metrics)
                saved = ckpt.maybe_save(every=args.save_every)
                if saved is not None:
                    say(f"saved {saved.name}")
                if stop.check():  # at a window boundary, agreed by every rank
                    break
                time.sleep(args.slow)
        if stop.preempted:
            say(f"preempted at update {step.updates} by {stop.reason}: saved")
            return
        if args.out:
            inner = getattr(model, "module", model)
            final = {k: full(v) for k, v in inner.state_dict().items()}
            if average is not None:
                final |= {f"ema.{k}": full(v) for k, v in average.state_dict()["shadow"].items()}
            if distributed.is_rank_zero():
                torch.save(final, args.out)
        say(f"finished at update {step.updates} ({stop.reason})")


@distributed.rank_zero_only
def say(line: str) -> None:
    """Print once per job (rank zero), not once per process."""
    print(line, flush=True)


def full(t: torch.Tensor) -> torch.Tensor:
    """A tensor whole on every rank: a sharded one gathered (a collective: every rank calls it)."""
    gather = getattr(t, "full_tensor", None)
    return (gather() if callable(gather) else t).detach().clone()


def squared_error(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, Any]:
    """Per-sample validation loss: evaluate weights by samples and drops padded duplicates."""
    x, y = batch
    return {"loss": (model(x).float() - y).pow(2).mean(dim=1)}


if __name__ == "__main__":
    main()
