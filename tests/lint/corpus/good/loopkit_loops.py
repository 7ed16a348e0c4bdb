"""The same loops written with loopkit: nothing left to flag."""  # clean: LK006, LK009, LK010
import torch
from torch import nn

import loopkit
from loopkit import distributed


def train_step_api(model: nn.Module, dataset, epochs: int) -> None:
    with distributed.setup():
        loader = distributed.loader(dataset, batch_size=32, seed=1)
        model = distributed.wrap(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        step = loopkit.step(model, optimizer, precision="bf16", accumulate=4, log=10)
        for _ in range(epochs):
            for x, y in step.iterate(loader):
                with step as s:
                    s.backward(nn.functional.mse_loss(model(x), y))
        step.flush()


def train_pieces(model: nn.Module, loader, device) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10)
    acc = loopkit.accumulate(model, optimizer, every=4, scheduler=scheduler)
    log = loopkit.detach_logging(every=50, sink=loopkit.print_sink)
    for batch in acc.iterate(loader):
        x, y = loopkit.to_device(batch, device)
        with acc:
            loss = nn.functional.mse_loss(model(x), y)
            acc.backward(loss)
        log(loss=loss)
    log.flush()
