"""Loaders that cost nothing per step, and evaluations that run once."""  # clean: LK007, LK011, LK014
import argparse

import torch
from torch.utils.data import DataLoader, Dataset

parser = argparse.ArgumentParser()
parser.add_argument("--resume", default="")
args = parser.parse_args()
device = torch.device("cuda")


class Batch:
    """A batch type of its own: DataLoader's pin_memory=True cannot pin it (no pin_memory())."""

    def __init__(self, items):
        self.x = torch.stack([i[0] for i in items])
        self.y = torch.stack([i[1] for i in items])


def collate(items):
    return Batch(items)


class Pairs(Dataset):
    def __len__(self):
        return 1000

    def __getitem__(self, i):
        return torch.randn(8), torch.randn(1)


train_loader = DataLoader(
    Pairs(), batch_size=32, shuffle=True, num_workers=4, collate_fn=collate,
    generator=torch.Generator().manual_seed(0),
)  # fmt: skip
preview_loader = DataLoader(Pairs(), batch_size=8, shuffle=True)
stats_loader = DataLoader(Pairs(), batch_size=256, shuffle=True, num_workers=4, pin_memory=True)
test_loader = DataLoader(Pairs(), batch_size=100)

mean = torch.zeros(8)
for x, _ in stats_loader:  # statistics, before training: the order does not matter
    mean += x.mean(0) / len(stats_loader)

model = torch.nn.Linear(8, 1).to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
if args.resume:
    checkpoint = torch.load(args.resume)
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])

for epoch in range(10):
    for step, batch in enumerate(train_loader):
        loss = torch.nn.functional.mse_loss(model(batch.x.to(device) - mean.to(device)), batch.y.to(device))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step % 500 == 0:
            sample, _ = next(iter(preview_loader))  # one batch, every 500 steps
            print(model(sample.to(device)).detach())

model.eval()
mistakes = 0
with torch.no_grad():
    for x, y in test_loader:  # one pass over a small test set, after training
        err = torch.nn.functional.mse_loss(model(x.to(device)), y.to(device))
        print(f"test loss {err.item():.3f}")
        for p, t in zip(model(x.to(device)).cpu(), y):  # each sample on the host, to print it
            if abs(p.item() - t.item()) > 1.0:
                mistakes += 1
print(mistakes)
