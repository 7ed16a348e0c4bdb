"""loopkit.lint follows calls out of the training loop: into functions, methods via self,
objects of known classes and other files checked with it; reports at the sync's own line
with the chain; ends on cycles; not through `% N` branches; eval callers under no_grad."""

from __future__ import annotations

import time
from pathlib import Path

from loopkit import lint

EVERY = list(lint.RULES)


def _found(source: str, path: str = "t.py") -> list[tuple[int, str]]:
    return [(f.line, f.code) for f in lint.check_source(source, path, select=EVERY)]


def _messages(source: str, code: str) -> list[str]:
    return [f.message for f in lint.check_source(source, "t.py", select=EVERY) if f.code == code]


CHAIN = """\
import torch

def write_row(metrics):
    print({k: v.item() for k, v in metrics.items()})

def log_metrics(metrics):
    write_row(metrics)

def snapshot(model):
    return {k: v.cpu() for k, v in model.state_dict().items()}

def train(model, loader, optimizer, device):
    for step, (x, y) in enumerate(loader):
        loss = torch.nn.functional.mse_loss(model(x.to(device)), y.to(device))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        log_metrics({"loss": loss})
        if step % 100 == 0:
            snapshot(model)
"""


def test_a_sync_two_levels_down_is_reported_at_its_line_with_the_chain() -> None:
    """.item() in write_row, reached train -> log_metrics -> write_row, is LK002 at line 4;
    snapshot()'s .cpu(), called only under `step % 100`, is not reported."""
    assert _found(CHAIN) == [(4, "LK002")]
    (message,) = _messages(CHAIN, "LK002")
    assert "`.item()` every step in `write_row`, reached from t.py:18 train -> log_metrics -> " \
        "write_row" in message  # fmt: skip
    # Without the call, nothing reaches write_row: silence.
    assert _found(CHAIN.replace('        log_metrics({"loss": loss})\n', "")) == []


CYCLE = """\
import torch

def ping(n):
    if n > 0:
        pong(n - 1)

def pong(n):
    torch.cuda.synchronize()
    ping(n)

def train(model, loader, optimizer):
    for x, y in loader:
        torch.nn.functional.mse_loss(model(x.cuda()), y.cuda()).backward()
        optimizer.step()
        optimizer.zero_grad()
        ping(3)
"""


def test_a_cycle_ends_and_reports_once() -> None:
    """ping -> pong -> ping: the synchronize in pong is LK017, once, with the chain."""
    assert _found(CYCLE) == [(8, "LK017")]
    (message,) = _messages(CYCLE, "LK017")
    assert "reached from t.py:16 train -> ping -> pong" in message


METHODS = """\
import torch

class Trainer:
    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer

    def grad_norms(self):
        return [p.grad.norm().item() for p in self.model.parameters()]

    def log_grads(self):
        print(max(self.grad_norms()))

    def check(self, out):
        assert torch.isfinite(out).all()

    def fit(self, loader):
        for x, y in loader:
            out = self.model(x.cuda())
            self.check(out)
            torch.nn.functional.mse_loss(out, y.cuda()).backward()
            self.optimizer.step()
            self.optimizer.zero_grad()
            self.log_grads()
"""


def test_methods_through_self_two_levels_deep() -> None:
    """fit -> log_grads -> grad_norms (.item() per parameter): LK002 at line 8; fit -> check
    (an implicit bool() of a device tensor): LK021 at line 14."""
    assert _found(METHODS) == [(8, "LK002"), (14, "LK021")]
    assert (
        "Trainer.fit -> Trainer.log_grads -> Trainer.grad_norms" in _messages(METHODS, "LK002")[0]
    )


OBJECTS = """\
import torch

class Meter:
    def update(self, value):
        self.total = self.total + value.item()

def train(model, loader, optimizer):
    meter = Meter()
    for x, y in loader:
        loss = torch.nn.functional.mse_loss(model(x.cuda()), y.cuda())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        meter.update(loss)
"""


def test_a_method_of_an_object_of_a_known_class() -> None:
    """meter = Meter(); meter.update(loss) every step: the .item() inside is LK002; a name
    also bound to something else (a parameter) is not followed."""
    assert _found(OBJECTS) == [(5, "LK002")]
    untyped = OBJECTS.replace("(model, loader, optimizer):", "(model, loader, optimizer, meter):")
    assert _found(untyped) == []


STEP_METHODS = """\
import torch as th

class TrainLoop:
    def run_loop(self):
        while True:
            self.run_step(next(self.data))

    def run_step(self, batch):
        self.forward_backward(batch)
        self.optimize()

    def forward_backward(self, batch):
        for i in range(0, batch.shape[0], 4):
            self.model(batch[i : i + 4].cuda()).sum().backward()

    def optimize(self):
        self._log_grad_norm()
        self.opt.step()

    def _log_grad_norm(self):
        sqsum = 0.0
        for p in self.params:
            sqsum += (p.grad ** 2).sum().item()
        print(sqsum)
"""


def test_a_loop_that_steps_only_through_methods() -> None:
    """improved-diffusion's shape: run_loop's while loop calls run_step, which back-propagates
    and steps the optimizer through methods; the .item() per parameter in _log_grad_norm is
    reached every step."""
    assert _found(STEP_METHODS) == [(23, "LK002")]
    assert (
        "TrainLoop.run_step -> TrainLoop.optimize -> TrainLoop._log_grad_norm"
        in (_messages(STEP_METHODS, "LK002")[0])
    )


EVAL = """\
import torch

def validate(model, loader):
    total = 0.0
    for x, y in loader:
        total += torch.nn.functional.mse_loss(model(x.cuda()), y.cuda())
    return total

def train(model, loader, val_loader, optimizer, epochs):
    for epoch in range(epochs):
        for x, y in loader:
            torch.nn.functional.mse_loss(model(x.cuda()), y.cuda()).backward()
            optimizer.step()
            optimizer.zero_grad()
        model.eval()
        print(validate(model, val_loader))
        model.train()
"""


def test_an_evaluation_called_per_epoch_with_autograd_and_under_no_grad() -> None:
    """validate() called every epoch with autograd on: LK008 at its forward (line 6); the
    same call wrapped in torch.no_grad() by the caller covers it; called once after the loop,
    it is a one-off."""
    assert _found(EVAL) == [(6, "LK008")]
    covered = EVAL.replace(
        "        print(validate(model, val_loader))\n",
        "        with torch.no_grad():\n            print(validate(model, val_loader))\n",
    )
    assert _found(covered) == []
    once = EVAL.replace("        print(validate(model, val_loader))\n", "") + (
        "    print(validate(model, val_loader))\n"
    )
    assert _found(once) == []


def test_calls_into_other_files_of_the_package(tmp_path: Path) -> None:
    """check_paths on a package: `from .utils import log_metrics` and `from pkg import
    metrics; metrics.f()`: the syncs are reported in the other files, at their lines, with
    the chain starting at train.py's call; check_source of one file alone sees nothing."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "utils.py").write_text(
        "def log_metrics(loss):\n    print(loss.item())\n"  # line 2
    )
    (pkg / "metrics.py").write_text(
        "import torch\n\n\ndef accuracy(out, y):\n"
        "    return (out.argmax(1) == y).float().mean().cpu()\n"  # line 5
    )
    (pkg / "train.py").write_text(
        "from .utils import log_metrics\n"
        "from pkg import metrics\n"
        "\n"
        "def train(model, loader, optimizer):\n"
        "    for x, y in loader:\n"
        "        out = model(x.cuda())\n"
        "        loss = out.sum()\n"
        "        loss.backward()\n"
        "        optimizer.step()\n"
        "        optimizer.zero_grad()\n"
        "        log_metrics(loss)\n"  # line 11
        "        metrics.accuracy(out, y.cuda())\n"  # line 12
    )
    found = lint.check_paths([pkg], select=EVERY)
    assert [(Path(f.path).name, f.line, f.code) for f in found] == [
        ("metrics.py", 5, "LK002"),
        ("utils.py", 2, "LK002"),
    ]
    assert f"reached from {pkg / 'train.py'}:11 train -> log_metrics" in found[1].message
    assert f"reached from {pkg / 'train.py'}:12 train -> accuracy" in found[0].message
    assert lint.check_paths([pkg / "utils.py"], select=EVERY) == []


def test_many_paths_to_the_same_function_are_followed_once() -> None:
    """40 functions, each calling the next two ways (2**40 paths): linear time, one finding,
    by the shortest chain (the depth bound stops past 6 calls)."""
    funcs = [f"def f{i}(x):\n    f{i + 1}(x)\n    f{i + 1}(x)\n" for i in range(40)]
    funcs.append("def f40(x):\n    x.item()\n")
    near = "def g(x):\n    print(x.item())\n"
    loop = (
        "def train(model, loader, optimizer):\n"
        "    for x in loader:\n"
        "        loss = model(x.cuda())\n"
        "        loss.backward()\n"
        "        optimizer.step()\n"
        "        optimizer.zero_grad()\n"
        "        f0(loss)\n"
        "        g(loss)\n"
    )
    source = "".join(funcs) + near + loop
    start = time.perf_counter()
    found = _found(source)
    assert time.perf_counter() - start < 10
    g_line = source.splitlines().index("    print(x.item())") + 1
    assert found == [(g_line, "LK002")]


def test_a_loader_built_in_a_helper_file_of_a_cuda_script(tmp_path: Path) -> None:
    """data.py never mentions CUDA, but train.py, checked with it, calls its get_loader and
    runs on CUDA: the loader without pin_memory is LK007; alone, data.py asks only workers."""
    (tmp_path / "data.py").write_text(
        "from torch.utils.data import DataLoader\n\n\n"
        "def get_loader(ds):\n"
        "    return DataLoader(ds, batch_size=64, shuffle=True, num_workers=4)\n"  # line 5
    )
    (tmp_path / "train.py").write_text(
        "from data import get_loader\n\n\n"
        "def train(model, ds, optimizer):\n"
        "    for x, y in get_loader(ds):\n"
        "        model(x.cuda()).sum().backward()\n"
        "        optimizer.step()\n"
        "        optimizer.zero_grad()\n"
    )
    found = lint.check_paths([tmp_path])
    assert [(Path(f.path).name, f.line, f.code) for f in found] == [("data.py", 5, "LK007")]
    assert "without pin_memory" in found[0].message
    assert lint.check_paths([tmp_path / "data.py"]) == []
