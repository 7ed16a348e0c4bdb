"""Host reads only every 100 steps; the loader loads in workers, pinned and seeded."""  # clean: LK002, LK007, LK011
import random

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader


def seed_worker(worker_id: int) -> None:
    seed = torch.initial_seed() % 2**32
    np.random.seed(seed)
    random.seed(seed)


def train(model: nn.Module, dataset, epochs: int = 3) -> None:
    device = torch.device("cuda")
    g = torch.Generator().manual_seed(0)
    loader = DataLoader(
        dataset,
        batch_size=128,
        shuffle=True,
        num_workers=8,
        pin_memory=True,
        persistent_workers=True,
        worker_init_fn=seed_worker,
        generator=g,
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = 0
    for epoch in range(epochs):
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if step % 100 == 0:
                print(f"epoch {epoch} step {step} loss {loss.item():.4f}")
            elif step % 1000 == 999:
                torch.save({"model": model.state_dict(), "loss": loss.cpu()}, "ckpt.pt")
            step += 1
        # once per epoch, outside the step loop
        print(f"epoch {epoch} done, last loss {loss.item():.4f}")
