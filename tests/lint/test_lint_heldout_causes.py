"""The causes of the held-out corpus's wrong findings and misses, each as a legitimate loop that
stays silent beside a near twin that still fires: error paths, cadence held in a name,
tensor-only branches given floats, zero-element placeholders, flag branches of forward(),
unpinnable batches in a tuple across files, scaler steps, and device truths through names."""

from __future__ import annotations

from typing import Any

import pytest

from loopkit import lint

EVERY = list(lint.RULES)


def _found(source: str) -> list[tuple[int, str]]:
    return sorted((f.line, f.code) for f in lint.check_source(source, "t.py", select=EVERY))


def _found_in(sources: dict[str, str]) -> list[tuple[str, int, str]]:
    return sorted((f.path, f.line, f.code) for f in lint.check_sources(sources, select=EVERY))


ERROR_PATH = """\
import math
import sys
import torch

def train(model, loader, optimizer):
    for x, y in loader:
        loss = torch.nn.functional.mse_loss(model(x.cuda()), y.cuda())
        if not math.isfinite(loss.item()):
            print("loss is", loss.item())
            sys.exit(1)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
"""


@pytest.mark.parametrize("end", ["sys.exit(1)", "raise RuntimeError('diverged')", "return"])
def test_a_read_in_an_error_path_that_ends_the_run_is_not_per_step(end: str) -> None:
    """The read in a branch ending in sys.exit/raise/return runs once; the test's runs each step."""
    assert _found(ERROR_PATH.replace("sys.exit(1)", end)) == [(8, "LK002")]
    # Near twin: the branch goes on training (no exit), so its read runs on every bad step.
    assert _found(ERROR_PATH.replace("sys.exit(1)", "pass")) == [(8, "LK002"), (9, "LK002")]


CADENCE = """\
import torch

def train(model, loader, optimizer, every):
    for i, (x, y) in enumerate(loader):
        loss = model(x.cuda(), y.cuda())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        regularize = i % every == 0
        if regularize:
            print(loss.item())
"""


def test_a_cadence_held_in_a_name_gates_like_step_mod_n() -> None:
    """``reg = i % k == 0; if reg:`` is a `% N` gate; ``reg = i > k`` is not."""
    assert _found(CADENCE) == []
    assert _found(CADENCE.replace("i % every == 0", "i > every")) == [(11, "LK002")]


TENSOR_BRANCH = """\
import torch

class Meter:
    def __init__(self):
        self.total = {}

    def update(self, **kwargs):
        for k, v in kwargs.items():
            if isinstance(v, torch.Tensor):
                v = v.item()
            self.total[k] = self.total.get(k, 0.0) + v

def train(model, loader, optimizer):
    meter = Meter()
    for x, y in loader:
        loss = model(x.cuda(), y.cuda())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        value = loss.item()
        meter.update(loss=value, lr=optimizer.param_groups[0]["lr"], n=2 * len(x))
"""


def test_a_tensor_only_branch_given_floats_everywhere_is_not_followed() -> None:
    """Every call site passes host values: the isinstance(Tensor) branch's .item() never runs."""
    assert _found(TENSOR_BRANCH) == [(20, "LK002")]
    # Near twins: one call site passes the tensor itself, or a dict whose values it cannot see.
    for call in ("meter.update(loss=loss)", "meter.update(**{'loss': loss})"):
        twin = TENSOR_BRANCH.replace("        value = loss.item()\n", f"        {call}\n")
        assert (10, "LK002") in _found(twin), call


PLACEHOLDER = """\
import torch

def train(model, loader, optimizer, device):
    for x, y in loader:
        out = EMPTY.to(device)
        out = torch.cat([out, model(x.to(device))])
        loss = torch.nn.functional.mse_loss(out, y.to(device))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
"""


@pytest.mark.parametrize("empty", ["torch.empty(0)", "torch.zeros((0, 3))", "torch.tensor([])"])
def test_a_zero_element_placeholder_moved_copies_nothing(empty: str) -> None:
    """``torch.empty(0).to(device)`` moves no bytes: no LK004; ``torch.empty(3)`` does."""
    assert _found(PLACEHOLDER.replace("EMPTY", empty)) == []
    full = empty.replace("0", "3").replace("[]", "[1.0]")
    assert _found(PLACEHOLDER.replace("EMPTY", full)) == [(5, "LK004")]


FLAG_BRANCH = """\
import torch
from torch import nn

class Predictor(nn.Module):
    def forward(self, x, reverse=False):
        if not reverse:
            return x.sum()
        else:
            z = torch.randn(x.size(0), 2).to(device=x.device)
            return z

class Other(nn.Module):
    def forward(self, x, reverse=False):
        return x

class Model(nn.Module):
    def __init__(self, stochastic):
        super().__init__()
        if stochastic:
            self.dp = Predictor()
        else:
            self.dp = Other()

    def forward(self, x):
        return self.dp(x)

    def infer(self, x):
        return self.dp(x, reverse=True)
"""


def test_a_forward_branch_only_inference_asks_for_is_not_per_step() -> None:
    """Predictor's reverse=True branch runs only from infer(): no LK004 in forward()."""
    assert _found(FLAG_BRANCH) == []
    # Near twin: the training forward sets the flag itself.
    twin = FLAG_BRANCH.replace("        return self.dp(x)\n", "        return self.dp(x, True)\n")
    assert _found(twin) == [(9, "LK004")]


MISC = """\
import torch

class NestedTensor(object):
    def __init__(self, tensors, mask):
        self.tensors = tensors
        self.mask = mask

def nested_tensor_from_tensor_list(tensor_list):
    return NestedTensor(torch.stack(tensor_list), None)

def collate_fn(batch):
    batch = list(zip(*batch))
    batch[0] = nested_tensor_from_tensor_list(batch[0])
    return tuple(batch)
"""
MAIN = """\
import torch
from torch.utils.data import DataLoader
import util.misc as utils

def main(model, dataset, optimizer):
    loader = DataLoader(dataset, batch_size=2, num_workers=2, collate_fn=utils.collate_fn)
    for samples, targets in loader:
        loss = model(samples.tensors.cuda(), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
"""


def test_a_collate_fn_of_another_file_returning_an_unpinnable_tuple_needs_no_pin_memory() -> None:
    """NestedTensor (no pin_memory()) as a tuple's element, built in util/misc.py: no LK007."""
    assert _found_in({"main.py": MAIN, "util/misc.py": MISC}) == []
    # Near twin: the collate_fn stacks a plain tensor there, which pin_memory=True would pin.
    twin = MISC.replace("nested_tensor_from_tensor_list(batch[0])", "torch.stack(batch[0])")
    assert _found_in({"main.py": MAIN, "util/misc.py": twin}) == [("main.py", 6, "LK007")]


SCALER = """\
import torch

def train_one_epoch(model, loader, optimizer, loss_scaler):
    for x, y in loader:
        loss = model(x.cuda(non_blocking=True), y.cuda(non_blocking=True))
        loss_value = loss.item()
        optimizer.zero_grad()
        loss_scaler(loss, optimizer, clip_grad=1.0, parameters=model.parameters())
        torch.cuda.synchronize()
        print(loss_value)
"""


def test_a_loop_stepping_through_a_loss_scaler_is_a_training_step() -> None:
    """``loss_scaler(loss, optimizer, ...)`` (timm) back-propagates and steps: LK002, LK017."""
    assert _found(SCALER) == [(6, "LK002"), (9, "LK017")]
    # Near twin: a loop that only records the loss with a step counter does not train.
    twin = SCALER.replace("loss_scaler(loss, optimizer,", "record(loss, step,")
    assert _found(twin.replace("        optimizer.zero_grad()\n", "")) == []


CLIP = """\
import torch

def clip_gradients(model, clip):
    for name, p in model.named_parameters():
        if p.grad is not None:
            param_norm = p.grad.data.norm(2)
            clip_coef = clip / (param_norm + 1e-6)
            if clip_coef < 1:
                p.grad.data.mul_(clip_coef)

def train(model, loader, optimizer):
    for x, y in loader:
        loss = model(x.cuda(), y.cuda())
        optimizer.zero_grad()
        loss.backward()
        clip_gradients(model, 3.0)
        optimizer.step()
"""


def test_the_truth_of_a_name_computed_from_a_gradient_norm_is_a_sync() -> None:
    """``if clip_coef < 1:`` with clip_coef from ``p.grad.data.norm(2)``: LK021, per step."""
    assert _found(CLIP) == [(8, "LK021")]
    # Near twin: the coefficient from a Python float (the clip value alone) is a host number.
    assert _found(CLIP.replace("(param_norm + 1e-6)", "(clip + 1e-6)")) == []


def test_recall_counts_a_cost_only_for_a_fitting_rule_at_or_just_after_its_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A host_tensor_to_device cost is found by LK004 up to 3 lines later, not by LK002."""
    import test_corpus_precision as corpus

    def finding(line: int, code: str) -> dict[str, Any]:
        return {"repo": "r", "path": "p.py", "line": line, "code": code, "right": True}

    def cost(line: int, category: str) -> dict[str, Any]:
        return {"repo": "r", "path": "p.py", "line": line, "category": category}

    data = {
        "findings": [finding(n, c) for n, c in [(13, "LK004"), (20, "LK002"), (35, "LK004")]]
        + [finding(42, "LK004")],
        "costs": [
            cost(10, "host_tensor_to_device"),  # LK004 three lines on: found
            cost(20, "host_tensor_to_device"),  # only LK002 there: not found
            cost(31, "host_tensor_to_device"),  # LK004 four lines on: not found
            cost(40, "device_tensor_rebuilt_per_step"),  # LK004 two lines on: found
            cost(20, "host_sync"),  # LK002 at its line: found
        ],
    }
    monkeypatch.setattr(corpus, "labels", lambda name: data)
    total, found = corpus.recall("dev")
    assert found[corpus.GROUPS["host_tensor_to_device"]] == 2
    assert found[corpus.GROUPS["host_sync"]] == 1 and sum(total.values()) == 5


INFER = "    def infer(self, x):\n        return rand_slice(x, 4)\n"
SLICE = """\
import torch
from torch import nn

def rand_slice(x, size):
    ids = (torch.rand([x.size(0)]).to(device=x.device) * size).long()
    return x[:, ids]

class Model(nn.Module):
    def forward(self, x):
        return rand_slice(x, 4)

    def infer(self, x):
        return x
"""


def test_a_host_tensor_in_a_function_forward_calls_is_built_every_forward() -> None:
    """``torch.rand(b).to(device)`` in a helper that forward() calls: LK004 at the helper."""
    assert _found(SLICE) == [(5, "LK004")]
    # Near twin: only infer() calls the helper; nothing per step reaches it.
    twin = SLICE.replace("        return rand_slice(x, 4)\n", "        return x\n")
    twin = twin.replace("    def infer(self, x):\n        return x\n", INFER)
    assert "rand_slice(x, 4)" in twin and _found(twin) == []


def test_a_loss_function_passed_to_an_epoch_function_is_no_scaler_step() -> None:
    """``train_epoch(loss_fn, optimizer)`` per epoch: the epoch loop is no training step."""
    epochs = """\
import torch

def main(model, loader, optimizer, loss_fn, epochs):
    model.cuda()
    for epoch in range(epochs):
        loss = train_epoch(loss_fn, optimizer, loader)
        print(loss.item())
"""
    assert _found(epochs) == []
    # Near twin: the loss is computed in the loop and handed to a scaler with the optimizer.
    twin = epochs.replace("train_epoch(loss_fn,", "loss_fn(model, loader)\n        scaler(loss,")
    assert _found(twin) == [(8, "LK002")]
