"""Small models, data and reference loops shared by the tests."""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Iterator, MutableMapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

Batch = tuple[torch.Tensor, torch.Tensor]

ROOT = Path(__file__).resolve().parent.parent
"""The repository's root (tests live in folders below tests/, helpers directly in it)."""
DEEP = os.environ.get("LOOPKIT_DEEP", "").strip() not in ("", "0", "false", "False", "no")
"""LOOPKIT_DEEP=1: the deep tier runs too (tests marked ``deep``), and the long runs
(invariants' examples, kills of a crash test) go further."""
deep = pytest.mark.deep
"""A test CI leaves to the deep run (``LOOPKIT_DEEP=1``): a slower variant of what a CI test
checks already (another model, cadence, launcher or world), or a measurement's own run."""

# Imported from here, not from conftest: tests/invariants has a conftest.py of its own, and
# whichever "conftest" module Python imports first would shadow the other.
requires_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU: none on this machine"
)


class AtenOps(TorchDispatchMode):
    """Records the name of every aten op run under it (``ops``, in order)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kw: Any = None) -> Any:
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kw or {}))


def mlp(seed: int = 0, width: int = 32) -> nn.Module:
    """A small MLP with no batch-dependent layers (so large-batch equivalence is exact)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, width), nn.GELU(), nn.Linear(width, 1))


def batches(sizes: Sequence[int], seed: int = 1) -> list[Batch]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, 8, generator=g), torch.randn(n, 1, generator=g)) for n in sizes]


def loss_fn(model: nn.Module, batch: Batch) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def twin(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model)


def large_batch_reference(
    model: nn.Module,
    make_opt: Callable[[nn.Module], torch.optim.Optimizer],
    windows: Sequence[Sequence[Batch]],
    clip: float | None = None,
) -> tuple[list[torch.Tensor], list[float]]:
    """One optimizer step per window on the concatenation of its micro-batches."""
    opt = make_opt(model)
    norms: list[float] = []
    for window in windows:
        x = torch.cat([b[0] for b in window])
        y = torch.cat([b[1] for b in window])
        loss_fn(model, (x, y)).backward()
        if clip is not None:
            norms.append(float(nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return params(model), norms


def split(items: Sequence[Batch], every: int) -> list[list[Batch]]:
    return [list(items[i : i + every]) for i in range(0, len(items), every)]


def assert_close(
    a: Sequence[torch.Tensor], b: Sequence[torch.Tensor], atol: float = 1e-6, rtol: float = 0.0
) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, rtol=rtol, atol=atol)


def assert_bit_equal(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y), (x - y).abs().max()


def launch_env() -> dict[str, str]:
    """This process's environment without launcher variables, one thread per process."""
    import os

    launcher = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in launcher}
    env["OMP_NUM_THREADS"] = "1"
    return env


def counted_ddp(model: nn.Module) -> tuple[nn.parallel.DistributedDataParallel, list[int]]:
    """Wrap in DDP with the default all-reduce as a comm hook that records each bucket."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    ddp = nn.parallel.DistributedDataParallel(model)
    calls: list[int] = []

    # No annotations: DDP compares them with dist.GradBucket, and here they would be strings.
    def hook(state, bucket):  # type: ignore[no-untyped-def]
        calls.append(bucket.index())
        return allreduce_hook(state, bucket)

    ddp.register_comm_hook(None, hook)
    return ddp, calls


def run_scenarios(scenarios: dict[str, Callable[..., dict[str, Any]]], world: int = 2) -> None:
    """Body of a torchrun worker: run each scenario, save each rank's result to argv[1]."""
    import sys
    import traceback
    from pathlib import Path

    import torch.distributed as dist

    from loopkit import distributed

    out = Path(sys.argv[1])
    names = sys.argv[2:] or list(scenarios)
    with distributed.setup() as info:
        assert info.world_size == world, info
        for name in names:
            try:
                result = scenarios[name](info)
            except Exception:
                result = {"exception": traceback.format_exc()}
            torch.save(result, out / f"{name}.rank{info.rank}.pt")
            dist.barrier()


def launch_scenarios(worker: str, out: Any, world: int = 2) -> dict[str, list[dict[str, Any]]]:
    """Run ``worker`` (a tests/ script calling run_scenarios) under torchrun with ``world`` ranks.

    Returns each scenario's per-rank results; a scenario that raised fails here.
    """
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node", str(world)]  # fmt: skip
    proc = subprocess.run(
        [*cmd, worker, str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=launch_env(),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    found: dict[str, list[dict[str, Any]]] = {}
    for path in sorted(Path(out).glob("*.rank*.pt")):
        name, _ = path.name.split(".rank")
        found.setdefault(name, []).append(torch.load(path, weights_only=False))
    for name, per_rank in found.items():
        for r in per_rank:
            assert "exception" not in r, f"{name}: {r.get('exception')}"
    return found


class Store(MutableMapping[str, Any]):
    """A custom mapping that keeps its items in an attribute, as many batch classes do."""

    def __init__(self, items: dict[str, Any]) -> None:
        self._items = dict(items)
        self.source = "disk"

    def __getitem__(self, key: str) -> Any:
        return self._items[key]

    def __setitem__(self, key: str, value: Any) -> None:
        self._items[key] = value

    def __delitem__(self, key: str) -> None:
        del self._items[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)


class ResumableLoader:
    """A sized stateful loader, as torchdata's StatefulDataLoader: ``len()`` is the whole
    pass, and a restored state goes on from the batch it was saved after."""

    def __init__(self, n: int = 6) -> None:
        g = torch.Generator().manual_seed(0)
        self.data, self.at = [torch.randn(4, 3, generator=g) for _ in range(n)], 0

    def __len__(self) -> int:
        return len(self.data)

    def __iter__(self) -> Iterator[torch.Tensor]:
        while self.at < len(self.data):
            self.at += 1
            yield self.data[self.at - 1]
        self.at = 0

    def state_dict(self) -> dict[str, int]:
        return {"at": self.at}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.at = state["at"]


class StreamWithLen(torch.utils.data.IterableDataset[int]):
    """An IterableDataset that also has a length (which DataLoader cannot shard by index)."""

    def __iter__(self) -> Iterator[int]:
        return iter(range(8))

    def __len__(self) -> int:
        return 8


def kill_tree(pid: int) -> None:
    """SIGKILL a process and all its descendants at once, as a lost node would.

    torchrun starts its workers in sessions of their own, so killing its process group
    alone would leave them training on.
    """
    import contextlib
    import signal

    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                # Fields after the command name (which may hold spaces): state, ppid, ...
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo += children.get(p, [])
    for p in tree:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)
