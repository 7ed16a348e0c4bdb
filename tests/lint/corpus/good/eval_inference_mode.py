"""Evaluation under inference_mode / no_grad, four common ways."""  # clean: LK008
import torch
from torch import nn


def evaluate(model: nn.Module, loader, device) -> float:
    model.eval()
    correct = total = 0
    with torch.inference_mode():
        for images, labels in loader:
            images, labels = images.to(device), labels.to(device)
            correct += (model(images).argmax(1) == labels).sum()
            total += labels.numel()
    model.train()
    return (correct / total).item()


@torch.no_grad()
def predict(model: nn.Module, batches):
    model.eval()
    return [model(x).softmax(-1) for x in batches]


def validate(model, loader):
    model.eval()
    return sum(model(x).sum() for x in loader)


def run(model, loader):
    with torch.no_grad():
        return validate(model, loader)


def train_or_eval(model, phases, optimizer):
    for phase, loader in phases:
        if phase == "train":
            model.train()
        else:
            model.eval()
        for x, y in loader:
            optimizer.zero_grad(set_to_none=True)
            with torch.set_grad_enabled(phase == "train"):
                loss = nn.functional.mse_loss(model(x), y)
                if phase == "train":
                    loss.backward()
                    optimizer.step()


def finetune_frozen_bn(model, loader, optimizer):
    model.eval()  # frozen batch-norm statistics, but this is training: it needs the graph
    for x, y in loader:
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
