"""Evaluation that sums on the device and reads once; generation loops are not evaluation."""  # clean: LK014
import torch


@torch.no_grad()
def evaluate(model, loader):
    total = torch.zeros((), device="cuda")
    for x, y in loader:
        total += torch.nn.functional.cross_entropy(model(x.cuda()), y.cuda(), reduction="sum")
    return total.item() / len(loader.dataset)


@torch.no_grad()
def generate(model, idx, steps: int):
    for _ in range(steps):
        logits = model(idx)
        probs = torch.softmax(logits[:, -1], dim=-1).cpu()
        idx = torch.cat([idx, torch.multinomial(probs, 1).cuda()], dim=1)
    return idx
