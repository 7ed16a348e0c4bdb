# expect: LK002
"""A walrus-driven loop over an iterator, a match statement for the optimizer choice."""
import torch


def make_optimizer(name: str, params):
    match name:
        case "sgd":
            return torch.optim.SGD(params, lr=0.1, momentum=0.9)
        case "adamw" | "adam":
            return torch.optim.AdamW(params, lr=3e-4)
        case _:
            raise ValueError(name)


def train(model, loader, name: str = "adamw"):
    optimizer = make_optimizer(name, model.parameters())
    it = iter(loader)
    while (batch := next(it, None)) is not None:
        x, y = batch
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if not torch.isfinite(loss).item():  # <- LK002
            raise FloatingPointError("loss is not finite")


DEVICE = "cuda"  # the loop runs on a GPU: each read-back waits for it
