# expect: LK002, LK017
"""Syncs hidden in the functions and methods a training step calls, two and more levels deep."""
import torch


def log_metrics(metrics, step):
    write_row(metrics, step)


def write_row(metrics, step):
    print(step, {k: v.item() for k, v in metrics.items()})  # <- LK002


def save_snapshot(model, step):
    torch.save({k: v.cpu() for k, v in model.state_dict().items()}, f"snap_{step}.pt")


def ping(n):
    if n > 0:
        pong(n - 1)


def pong(n):
    torch.cuda.synchronize()  # <- LK017
    ping(n)


class Trainer:
    def __init__(self, model, optimizer, device):
        self.model, self.optimizer, self.device = model, optimizer, device

    def grad_norms(self):
        return [p.grad.norm().item() for p in self.model.parameters()]  # <- LK002

    def log_grads(self):
        print(max(self.grad_norms()))

    def fit(self, loader):
        for step, (x, y) in enumerate(loader):
            x, y = x.to(self.device), y.to(self.device)
            loss = torch.nn.functional.cross_entropy(self.model(x), y)
            loss.backward()
            self.optimizer.step()
            self.optimizer.zero_grad()
            self.log_grads()
            log_metrics({"loss": loss}, step)
            ping(2)
            if step % 100 == 0:
                save_snapshot(self.model, step)
