"""A model with every kind of state a meta-device build must reproduce, and what it is
compared with: the same model built on the CPU with the same seed.

Shared by tests/parallel/test_meta_init.py (one process) and the scenarios of
``dist_worker.py`` (2 ranks) and ``dist4_worker.py`` (4 ranks, HSDP).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

import torch
from torch import nn


class Rotary(nn.Module):
    """A table computed in ``__init__`` (a non-persistent buffer, as rotary embeddings)."""

    def __init__(self, dim: int, length: int = 6) -> None:
        super().__init__()
        self.dim, self.length = dim, length
        self.register_buffer("table", self.compute(), persistent=False)

    def compute(self) -> torch.Tensor:
        freqs = 1.0 / 10000 ** (torch.arange(0, self.dim, 2).float() / self.dim)
        return torch.outer(torch.arange(self.length).float(), freqs).cos()

    def reset_parameters(self) -> None:
        self.table.copy_(self.compute())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.table[: x.shape[0], :1]


class Block(nn.Module):
    """Linear, BatchNorm (running stats: buffers), Linear, a rotary table."""

    def __init__(self, dim: int = 8, hidden: int = 12) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.norm = nn.BatchNorm1d(hidden)
        self.down = nn.Linear(hidden, dim)
        self.rotary = Rotary(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.rotary(self.down(torch.relu(self.norm(self.up(x)))))


class Net(nn.Module):
    """An embedding (11 rows: uneven shards on 2 and 4 ranks), 2 blocks, a LayerNorm, a head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 8)
        self.blocks = nn.Sequential(Block(), Block())
        self.ln = nn.LayerNorm(8)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln(self.blocks(self.embed(x))))


def titan_init(model: nn.Module) -> None:
    """An ``init_weights`` in torchtitan's style: depth-scaled truncated normals, zero biases,
    the norms reset, the rotary tables recomputed (assigned anew)."""
    for depth, block in enumerate(model.blocks):  # type: ignore[arg-type]
        std = 0.02 / math.sqrt(2 * (depth + 1))
        for linear in (block.up, block.down):
            nn.init.trunc_normal_(linear.weight, std=std)
            nn.init.zeros_(linear.bias)
        block.norm.reset_parameters()
        block.rotary.table = block.rotary.compute()
    nn.init.normal_(model.embed.weight)  # type: ignore[arg-type]
    model.ln.reset_parameters()  # type: ignore[operator]
    nn.init.kaiming_uniform_(model.head.weight, a=math.sqrt(5))  # type: ignore[arg-type]
    nn.init.uniform_(model.head.bias, -0.1, 0.1)  # type: ignore[arg-type]


def on_cpu(init: Callable[[nn.Module], None] | None) -> nn.Module:
    """The reference: ``Net()`` built on the CPU from seed 0 (then ``init`` from seed 1)."""
    torch.manual_seed(0)
    model = Net()
    if init is not None:
        torch.manual_seed(1)
        init(model)
    return model


def on_meta() -> nn.Module:
    """``Net()`` built on the meta device; the seed set as the CPU build had it at the draws."""
    with torch.device("meta"):
        return Net()


def seed_for(init: Callable[[nn.Module], None] | None) -> None:
    """The generator as ``on_cpu`` had it when its draws began."""
    torch.manual_seed(0 if init is None else 1)


def whole(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer (non-persistent ones too), gathered whole, on the CPU."""
    out = {}
    for name, t in itertools.chain(model.named_parameters(), model.named_buffers()):
        gather = getattr(t, "full_tensor", None)
        out[name.replace("module.", "", 1)] = (gather() if gather else t).detach().cpu().clone()
    return out


def differences(model: nn.Module, reference: nn.Module) -> list[str]:
    """The names whose values (or dtype, or presence) differ from ``reference``'s."""
    got, want = whole(model), whole(reference)
    names = sorted(set(got) | set(want))
    return [n for n in names if n not in got or n not in want or not torch.equal(got[n], want[n])]


def _mesh(replicate: int | None) -> object:
    """HSDP's 2-D mesh (replicas x shards) with ``replicate``, else None (FSDP2's own)."""
    if replicate is None:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    world = torch.distributed.get_world_size()
    return init_device_mesh("cpu", (replicate, world // replicate),
                            mesh_dim_names=("replicate", "shard"))  # fmt: skip


def _rng_after(init: Callable[[nn.Module], None] | None, meta: nn.Module) -> bool:
    """Whether the generator stands where the CPU build left it (one draw after each)."""
    on_cpu(init)
    want = torch.rand(4)
    seed_for(init)
    from loopkit import distributed

    distributed.materialize(meta, init)
    return torch.equal(torch.rand(4), want)


def _train(model: nn.Module, rank: int) -> None:
    """Two SGD updates on this rank's batches (BatchNorm in training mode)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(10 + rank)
    for _ in range(2):
        model(torch.randint(0, 11, (4,), generator=g)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def distributed_cases(
    rank: int, replicate: int | None = None, every_way: bool = True
) -> dict[str, list[str]]:
    """Each way to shard and materialize a meta-built ``Net`` (through wrap, by hand over
    blocks and root, by hand over blocks only: the root's own tensors stay whole; DDP), each
    with the model's own init and with ``titan_init``: the names that differ from the CPU
    build (``"rng"``: the generator ends elsewhere). Then a CPU-built and a meta-built model,
    wrapped alike, trained 2 updates: the names that differ. ``every_way=False``: through wrap
    and by hand only."""
    from torch.distributed.fsdp import fully_shard

    from loopkit import distributed

    out: dict[str, list[str]] = {}
    mesh = _mesh(replicate)
    for label, init in (("own", None), ("fn", titan_init)):
        reference = on_cpu(init)
        model = on_meta()
        seed_for(init)
        distributed.wrap(model, fsdp=Block, replicate=replicate, init=init)
        out[f"wrap/{label}"] = differences(model, reference)
        for how in ("by_hand", "blocks_only")[: 2 if every_way else 1]:
            model = on_meta()
            for block in model.blocks:  # type: ignore[union-attr]
                fully_shard(block, mesh=mesh)  # type: ignore[arg-type]
            if how == "by_hand":
                fully_shard(model, mesh=mesh)  # type: ignore[arg-type]
            seed_for(init)
            distributed.materialize(model, init)
            out[f"{how}/{label}"] = differences(model, reference)
        if every_way:
            sharded = on_meta()
            fully_shard(sharded, mesh=mesh)  # type: ignore[arg-type]
            out[f"rng/{label}"] = [] if _rng_after(init, sharded) else ["rng"]
    if not every_way:
        return out
    if replicate is None:
        seed_for(None)
        ddp = distributed.wrap(on_meta())
        out["ddp/own"] = differences(ddp, on_cpu(None))
    built = distributed.wrap(on_cpu(None), fsdp=Block, replicate=replicate)
    meta = on_meta()
    seed_for(None)
    distributed.wrap(meta, fsdp=Block, replicate=replicate)
    _train(built, rank)
    _train(meta, rank)
    out["trained"] = differences(meta, built)
    return out


def fallback_cases(rank: int) -> dict[str, list[str]]:
    """torch < 2.7's path (no ``src_data_rank=None``: each rank slices its part by hand),
    forced: a meta-built ``Net`` sharded by hand over blocks and root, on FSDP2's mesh and on
    a (2, 1) HSDP mesh (Replicate, Shard), with the model's own init and with ``titan_init``,
    materialized by that path and by ``distribute_tensor``'s: the names whose local shards
    differ between the two, and (``.../cpu``) whose values differ from the CPU build."""
    from torch.distributed.fsdp import fully_shard

    from loopkit import distributed
    from loopkit._parallel import _materialize

    def sharded(mesh: object) -> nn.Module:
        model = on_meta()
        for block in model.blocks:  # type: ignore[union-attr]
            fully_shard(block, mesh=mesh)  # type: ignore[arg-type]
        fully_shard(model, mesh=mesh)  # type: ignore[arg-type]
        return model

    def local(model: nn.Module) -> dict[str, torch.Tensor]:
        both = itertools.chain(model.named_parameters(), model.named_buffers())
        return {n: getattr(t, "_local_tensor", t).detach().clone() for n, t in both}

    out: dict[str, list[str]] = {}
    native = _materialize._splits_locally
    for mesh_name, replicate in (("fsdp", None), ("hsdp", 2)):
        mesh = _mesh(replicate)
        for label, init in (("own", None), ("fn", titan_init)):
            models = []
            for forced in (False, True):
                model = sharded(mesh)
                seed_for(init)
                _materialize._splits_locally = (lambda: False) if forced else native  # type: ignore[assignment]
                try:
                    distributed.materialize(model, init)
                finally:
                    _materialize._splits_locally = native  # type: ignore[assignment]
                models.append(model)
            ours, theirs = local(models[1]), local(models[0])
            case = f"fallback/{mesh_name}/{label}"
            out[case] = [n for n in theirs if not torch.equal(ours[n], theirs[n])]
            out[f"{case}/cpu"] = differences(models[1], on_cpu(init))
    return out


def resume_reads(root: object) -> dict[str, object]:
    """A meta-built FSDP2 model trained 2 updates and saved, then resumed by a fresh meta-built
    one: the (file, offset, length) of each piece this rank read from the shard files, the
    size of those files, and the names whose resumed values differ from the saved ones."""
    from pathlib import Path

    from torch.distributed.checkpoint import filesystem

    import loopkit
    from loopkit import distributed

    def parts() -> tuple[nn.Module, loopkit.step, loopkit.Checkpointer]:
        model = on_meta()
        seed_for(None)
        distributed.wrap(model, fsdp=Block)
        step = loopkit.step(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        return model, step, loopkit.Checkpointer(Path(str(root)), model=model, step=step)

    model, step, ckpt = parts()
    g = torch.Generator().manual_seed(3)
    for _ in range(2):
        with step as s:
            s.backward(model(torch.randint(0, 11, (4,), generator=g)).pow(2).mean())
    ckpt.save()
    saved_at = ckpt.checkpoints()[-1]
    saved = whole(model)
    reads: list[tuple[str, int, int]] = []
    slice_file = filesystem.FileSystemReader._slice_file

    def counting(self: object, file: object, info: object) -> object:
        reads.append((Path(str(file.name)).name, info.offset, info.length))  # type: ignore[attr-defined]
        return slice_file(self, file, info)  # type: ignore[arg-type]

    resumed, step2, ckpt2 = parts()
    filesystem.FileSystemReader._slice_file = counting  # type: ignore[method-assign]
    try:
        ckpt2.resume()
    finally:
        filesystem.FileSystemReader._slice_file = slice_file  # type: ignore[method-assign]
    got = whole(resumed)
    return {
        "reads": reads,
        "size": sum(p.stat().st_size for p in Path(saved_at).rglob("*.distcp")),
        "differences": [n for n in saved if not torch.equal(saved[n], got[n])],
        "updates": step2.updates,
    }
