"""A hand-written loop with its own micro-batching, shaped as improved-diffusion's TrainLoop
(improved_diffusion/train_util.py): each micro-batch's mean loss is back-propagated as is.

docs/migrate/hand-loop.md shows it beside its loopkit port, loopkit_diffusion.py.
"""

import argparse
import math
import os

import torch
from torch import nn
from torch.utils.data import TensorDataset

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


def load_data(dataset, batch_size, seed):
    """Batches forever, each epoch in a new order (the last partial batch dropped)."""
    epoch = 0
    while True:
        g = torch.Generator().manual_seed(seed + epoch)
        order = torch.randperm(len(dataset), generator=g)
        for i in range(0, len(order) - batch_size + 1, batch_size):
            yield dataset[order[i : i + batch_size]]
        epoch += 1


def update_ema(target_params, source_params, rate):
    for targ, src in zip(target_params, source_params, strict=True):
        targ.detach().mul_(rate).add_(src, alpha=1 - rate)


class TrainLoop:
    def __init__(self, *, model, data, batch_size, microbatch, lr, ema_rate, log_interval,
                 save_interval, lr_anneal_steps, out_dir):  # fmt: skip
        self.model, self.data, self.batch_size = model, data, batch_size
        self.microbatch = microbatch if microbatch > 0 else batch_size
        self.lr, self.ema_rate = lr, ema_rate
        self.log_interval, self.save_interval = log_interval, save_interval
        self.lr_anneal_steps, self.out_dir = lr_anneal_steps, out_dir
        self.step, self.loss_sum = 0, 0.0
        self.opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
        self.ema_params = [[p.detach().clone() for p in model.parameters()] for _ in ema_rate]

    def run_loop(self):
        while self.step < self.lr_anneal_steps:
            (batch,) = next(self.data)
            loss, grad_norm = self.run_step(batch)
            self.step += 1
            self.loss_sum += loss.item()  # a host sync per step
            if self.step % self.log_interval == 0:
                loss = self.loss_sum / self.log_interval
                print(f"step {self.step} | loss {loss:.4f} | grad_norm {grad_norm:.4f}")
                self.loss_sum = 0.0
            if self.step % self.save_interval == 0:
                self.save()
        if self.step % self.save_interval != 0:
            self.save()

    def run_step(self, batch):
        loss = self.forward_backward(batch)
        grad_norm = self._grad_norm()
        self._anneal_lr()
        self.opt.step()
        for rate, params in zip(self.ema_rate, self.ema_params, strict=True):
            update_ema(params, self.model.parameters(), rate=rate)
        return loss, grad_norm

    def forward_backward(self, batch):
        self.opt.zero_grad()
        total = 0.0
        for i in range(0, batch.shape[0], self.microbatch):
            micro = batch[i : i + self.microbatch]
            t = torch.randint(0, T, (micro.shape[0],))
            weights = torch.ones(micro.shape[0])  # a uniform schedule sampler's
            losses = training_losses(self.model, micro, t)
            loss = (losses * weights).mean()
            loss.backward()  # not divided by the number of micro-batches
            total += loss.detach() * micro.shape[0] / batch.shape[0]
        return total

    def _grad_norm(self):
        return math.sqrt(sum((p.grad**2).sum().item() for p in self.model.parameters()))

    def _anneal_lr(self):
        frac_done = self.step / self.lr_anneal_steps
        for param_group in self.opt.param_groups:
            param_group["lr"] = self.lr * (1 - frac_done)

    def save(self):
        os.makedirs(self.out_dir, exist_ok=True)
        path = os.path.join(self.out_dir, f"model{self.step:06d}.pt")
        torch.save(self.model.state_dict(), path)
        torch.save(self.opt.state_dict(), os.path.join(self.out_dir, f"opt{self.step:06d}.pt"))
        for rate, params in zip(self.ema_rate, self.ema_params, strict=True):
            names = [name for name, _ in self.model.named_parameters()]
            torch.save(dict(zip(names, params, strict=True)),
                       os.path.join(self.out_dir, f"ema_{rate}_{self.step:06d}.pt"))  # fmt: skip


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--microbatch", type=int, default=8, help="-1: the whole batch")
    parser.add_argument("--lr_anneal_steps", type=int, default=24)
    parser.add_argument("--out_dir", default="runs/hand_diffusion")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = create_model()
    data = load_data(get_dataset(seed=0), args.batch_size, seed=0)
    TrainLoop(model=model, data=data, batch_size=args.batch_size, microbatch=args.microbatch,
              lr=1e-3, ema_rate=[0.99, 0.9], log_interval=8, save_interval=8,
              lr_anneal_steps=args.lr_anneal_steps, out_dir=args.out_dir).run_loop()  # fmt: skip


if __name__ == "__main__":
    main()
