"""The kinds issue 45 named, on new code written for these tests: reads hidden in formatting
and logging, evaluation not named like evaluation, and the look-alikes that must stay quiet
(a rare empty_cache, a forward that runs once)."""

from __future__ import annotations

import textwrap

import pytest

from loopkit import lint

HEAD = """\
import math

import torch
import wandb
from torch.utils.tensorboard import SummaryWriter
from tqdm import tqdm

device = "cuda"
model = torch.nn.Linear(8, 1).to(device)
opt = torch.optim.AdamW(model.parameters())
writer = SummaryWriter()
"""


def _codes(body: str, *, head: str = HEAD) -> list[tuple[int, str]]:
    """(line within ``body``, code) of every finding, every rule on."""
    source = head + textwrap.dedent(body)
    offset = head.count("\n")
    found = lint.check_source(source, "train.py", select=list(lint.RULES))
    return sorted((f.line - offset, f.code) for f in found if f.line > offset)


STEP = """\
bar = tqdm(loader)
for step, (x, y) in enumerate(bar):
    loss = torch.nn.functional.mse_loss(model(x.to(device)), y.to(device))
    loss.backward()
    opt.step()
    opt.zero_grad()
    {line}
"""


@pytest.mark.parametrize(
    "line",
    [
        'bar.set_description(f"loss {loss:.4f}")',
        'print(f"step {step} loss {loss}")',
        'wandb.log({"loss": loss, "step": step})',
        'writer.add_scalar("train/loss", loss, step)',
        "perplexity = float(torch.exp(loss))",
        "perplexity = math.exp(loss)",
    ],
)
def test_a_loss_read_hidden_in_formatting_or_logging_is_found(line: str) -> None:
    """Each of these turns the loss tensor into a Python number every step: LK016 there."""
    assert _codes(STEP.format(line=line)) == [(7, "LK016")]


@pytest.mark.parametrize(
    "line",
    [
        'bar.set_description(f"loss {loss.item():.4f}")',  # explicit: LK002's
        "if step % 100 == 0: wandb.log({'loss': loss})",  # once per 100 steps
        'logger.log(10, "step done")',  # a logger, not a tracker
        'print(f"step {step}")',  # no tensor in it
        "value = math.exp(step / 100)",
    ],
)
def test_look_alikes_of_hidden_reads_are_not_lk016(line: str) -> None:
    """An explicit read is LK002's, a cadence is cheap, a logger or a host value reads nothing."""
    assert (7, "LK016") not in _codes(STEP.format(line=line))


def test_hidden_reads_cost_nothing_on_a_cpu_only_script() -> None:
    """The same loop in a script that never names a device: nothing to wait for."""
    head = "import torch\nimport wandb\nmodel = torch.nn.Linear(8, 1)\nopt = None\n\n\n\n\n\n\n\n"
    body = STEP.format(line='wandb.log({"loss": loss})').replace(".to(device)", "")
    assert _codes(body.replace("bar = tqdm(loader)", "bar = loader"), head=head) == []


PERIODIC_EVAL = """\
for step, (x, y) in enumerate(loader):
    loss = torch.nn.functional.mse_loss(model(x.to(device)), y.to(device))
    loss.backward()
    opt.step()
    opt.zero_grad()
    if step % 500 == 0:
        model.eval()
        with torch.no_grad():
            total = 0.0
            for xv, yv in val_loader:
                total += torch.nn.functional.mse_loss(model(xv.to(device)), yv.to(device)).item()
        model.train()
"""


def test_an_evaluation_loop_inside_the_training_loop_is_found_per_batch() -> None:
    """Every 500 steps an evaluation reads each of its batches: LK014 at the read (LK002
    leaves it: the evaluation itself runs once per 500 steps)."""
    assert _codes(PERIODIC_EVAL) == [(11, "LK014")]


def test_an_inner_loop_run_every_step_stays_lk002s() -> None:
    """The same inner loop without the cadence runs every step: LK002, not LK014 too."""
    body = PERIODIC_EVAL.replace("    if step % 500 == 0:\n", "    if True:\n")
    assert [c for _, c in _codes(body)] == ["LK002"]


METRICS = """\
def {name}(model, loader):
    model.eval()
    correct = 0
    for x, y in loader:
        pred = model(x.to(device)).argmax(1)
        correct += (pred == y.to(device)).sum().item()
    model.train()
    return correct


for epoch in range(10):
    for x, y in loader:
        loss = torch.nn.functional.mse_loss(model(x.to(device)), y.to(device))
        loss.backward()
        opt.step()
        opt.zero_grad()
    print({name}(model, val_loader))
"""


@pytest.mark.parametrize("name", ["metrics", "accuracy", "score"])
def test_an_evaluation_function_named_otherwise_is_found(name: str) -> None:
    """A function that puts the model in eval mode and loops over a loader evaluates, per
    epoch here, whatever its name: its per-batch read is LK014 (and its autograd LK008)."""
    assert _codes(METRICS.format(name=name)) == [(5, "LK008"), (6, "LK014")]


def test_an_evaluation_function_called_once_after_training_is_quiet() -> None:
    """The same function called once, after training: its reads and graphs happen once."""
    once = (
        METRICS.format(name="metrics").replace("    print(metrics(model, val_loader))\n", "")
        + "print(metrics(model, test_loader))\n"
    )
    assert _codes(once) == []


def test_empty_cache_under_a_rare_cadence_is_quiet() -> None:
    """``if step % 1000 == 0: torch.cuda.empty_cache()`` is a rare release; every step is LK003."""
    body = STEP.format(line="if step % 1000 == 0:\n        torch.cuda.empty_cache()")
    assert _codes(body) == []
    assert _codes(STEP.format(line="torch.cuda.empty_cache()")) == [(7, "LK003")]


def test_a_forward_that_runs_once_after_eval_is_not_lk008() -> None:
    """A model summary at start-up and one test pass after training record graphs once."""
    body = """\
    model.eval()
    print(model(torch.zeros(1, 8, device=device)).shape)  # a summary at start-up
    model.train()
    for x, y in loader:
        loss = torch.nn.functional.mse_loss(model(x.to(device)), y.to(device))
        loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval()
    for x, y in test_loader:
        out = model(x.to(device))
    """
    assert _codes(body) == []
    per_epoch = """\
    for epoch in range(3):
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x.to(device)), y.to(device))
            loss.backward()
            opt.step()
            opt.zero_grad()
        model.eval()
        for x, y in val_loader:
            out = model(x.to(device))
        model.train()
    """
    assert _codes(per_epoch) == [(9, "LK008")]
