"""The loopkit port of hand_diffusion.py: micro_batch= runs each batch in chunks and the
update is the whole batch's (the hand loop's was n_chunks times its gradient).

docs/migrate/hand-loop.md shows the two side by side; the tests run both and compare them.
"""

import argparse
import math

import torch
from torch import nn
from torch.utils.data import TensorDataset

import loopkit
from loopkit import distributed

T = 100  # diffusion steps


def get_dataset(seed):
    """2-D points around 8 centres on a circle: the images' stand-in."""
    g = torch.Generator().manual_seed(seed)
    angle = torch.randint(0, 8, (1024,), generator=g) * (math.pi / 4)
    centres = torch.stack([angle.cos(), angle.sin()], dim=1)
    return TensorDataset(centres + 0.1 * torch.randn(1024, 2, generator=g))


def create_model():
    return nn.Sequential(
        nn.Linear(3, 64), nn.SiLU(), nn.Linear(64, 64), nn.SiLU(), nn.Linear(64, 2)
    )  # fmt: skip


def training_losses(model, x_start, t):
    """Per sample: the noise prediction's squared error ("mse" in improved-diffusion)."""
    alpha_bar = (torch.cos((t + 1) / (T + 1) * math.pi / 2) ** 2)[:, None]
    noise = torch.randn_like(x_start)
    x_t = alpha_bar.sqrt() * x_start + (1 - alpha_bar).sqrt() * noise
    return ((model(torch.cat([x_t, t[:, None] / T], dim=1)) - noise) ** 2).mean(dim=1)


def train(args):
    with distributed.setup() as info:
        torch.manual_seed(0)
        model = distributed.wrap(create_model())
        data = distributed.loader(get_dataset(seed=0), batch_size=args.batch_size, seed=0,
                                  drop_last=True, num_workers=0)  # fmt: skip
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
        anneal = torch.optim.lr_scheduler.LambdaLR(opt, lambda u: 1 - u / args.lr_anneal_steps)
        ema = [loopkit.ema(model, decay=rate) for rate in (0.99, 0.9)]
        microbatch = args.microbatch if args.microbatch > 0 else None
        step = loopkit.step(model, opt, micro_batch=microbatch, scheduler=anneal, ema=ema, log=8)
        ckpt = loopkit.Checkpointer(args.out_dir, model=model, optimizer=opt, scheduler=anneal,
                                    step=step, loader=data)  # fmt: skip
        stop = loopkit.until(step, max_updates=args.lr_anneal_steps, checkpointer=ckpt)
        ckpt.resume()  # the newest checkpoint in out_dir, if any

        for _ in stop.epochs(data):
            for (batch,) in step.iterate(data):  # a chunk of at most `microbatch` samples
                with step as s:
                    t = torch.randint(0, T, (batch.shape[0],))
                    weights = torch.ones(batch.shape[0])  # a uniform schedule sampler's
                    losses = training_losses(model, batch, t)
                    s.backward((losses * weights).mean())  # weighted by the chunk's share
                ckpt.maybe_save(every=8)
                if stop.check():
                    break

        if info.is_rank_zero:  # one state_dict each, from the checkpoint epochs() wrote
            last = ckpt.checkpoints()[-1]
            torch.save(loopkit.export_weights(last), f"{args.out_dir}/model.pt")
            for i, rate in enumerate((0.99, 0.9)):
                torch.save(loopkit.export_weights(last, ema=i), f"{args.out_dir}/ema_{rate}.pt")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--microbatch", type=int, default=8, help="-1: the whole batch")
    parser.add_argument("--lr_anneal_steps", type=int, default=24)
    parser.add_argument("--out_dir", default="runs/loopkit_diffusion", help="resumed if there")
    train(parser.parse_args())


if __name__ == "__main__":
    main()
