"""Micro-batching changes no update, whatever the batch holds: scenarios and their check.

A scenario draws batch sizes (ragged), a chunk size, windows, weights, optimizers, clipping,
passes, a batch layout (what a loader's ``collate_fn`` hands out: tuples, lists, dicts with
names and scalars, nested containers, lists of variable-length sequences, one dict per
sample, namedtuples, dataclasses) and a normalization layer. The reference is the same step
on whole batches (whose own updates ``test_update_exactness`` checks against float64):
``loopkit.step(micro_batch=m)`` must end within float32 rounding of it, with the same
updates and samples seen, every chunk holding consistent per-sample parts (names, ids and
sequences cut with the tensors). Layers that normalize by the batch's statistics are the
exception, refused before a cut batch's first chunk runs: BatchNorm in training mode. On 2
ranks (a DDP model) every rank checks its own run, and the replicas are identical.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from hypothesis import strategies as st
from torch import nn

import loopkit
from loopkit import distributed

Spec = dict[str, Any]
Sample = dict[str, Any]


class _Pair(NamedTuple):
    x: torch.Tensor
    y: torch.Tensor


@dataclasses.dataclass
class _Batch:
    x: torch.Tensor
    names: list[str]
    temperature: float = 1.0


def _stack(items: list[Sample], key: str) -> torch.Tensor:
    return torch.stack([it[key] for it in items])


def _ids(items: list[Sample]) -> list[int]:
    return [it["id"] for it in items]


def _names(items: list[Sample]) -> list[str]:
    return [f"s{it['id']}" for it in items]


# layout -> (collate: samples -> batch, unpack: batch -> (x, y, sequences, ids, temperature)),
# the ids read back from what the chunk carries (names, ids, per-sample dicts)
LAYOUTS: dict[str, tuple[Callable[[list[Sample]], Any], Callable[[Any], tuple[Any, ...]]]] = {
    "tuple": (
        lambda s: (_stack(s, "x"), _stack(s, "y")),
        lambda b: (b[0], b[1], None, None, 1.0),
    ),
    "dict, names, scalars": (
        lambda s: {"x": _stack(s, "x"), "y": _stack(s, "y"), "names": _names(s), "t": 0.5,
                   "scale": torch.tensor(2.0)},
        lambda b: (b["x"], b["y"], None, [int(n[1:]) for n in b["names"]], b["t"] * b["scale"]),
    ),
    "names first, nested": (
        lambda s: (_names(s), ((_stack(s, "x"), [_stack(s, "y")]), {"ids": _ids(s)})),
        lambda b: (b[1][0][0], b[1][0][1][0], None, b[1][1]["ids"], 1.0),
    ),
    "sequences": (
        lambda s: (_stack(s, "x"), [it["seq"] for it in s], _stack(s, "y")),
        lambda b: (b[0], b[2], b[1], None, 1.0),
    ),
    "a dict per sample": (
        lambda s: (_stack(s, "x"), [{"y": it["y"], "id": it["id"]} for it in s]),
        lambda b: (b[0], torch.stack([d["y"] for d in b[1]]), None, [d["id"] for d in b[1]], 1.0),
    ),
    "namedtuple": (
        lambda s: _Pair(_stack(s, "x"), _stack(s, "y")),
        lambda b: (b.x, b.y, None, None, 1.0),
    ),
    "dataclass": (
        lambda s: (_Batch(_stack(s, "x"), _names(s), 0.5), _stack(s, "y")),
        lambda b: (b[0].x, b[1], None, [int(n[1:]) for n in b[0].names], b[0].temperature),
    ),
    "token id lists": (  # a custom collate keeping each sample's ids as a Python list
        lambda s: {"x": _stack(s, "x"), "y": _stack(s, "y"),
                   "tokens": [[round(float(v) * 100) for v in it["seq"]] for it in s]},
        lambda b: (b["x"], b["y"], [torch.tensor(t, dtype=torch.float32) / 100
                                    for t in b["tokens"]], None, 1.0),
    ),
    "collated list of dicts": (  # default_collate of samples holding a list of two dicts
        lambda s: {"x": _stack(s, "x"),
                   "objs": [{"y": _stack(s, "y")}, {"id": torch.tensor(_ids(s))}]},
        lambda b: (b["x"], b["objs"][0]["y"], None, b["objs"][1]["id"].tolist(), 1.0),
    ),
}  # fmt: skip

NORMS = ["none", "groupnorm", "layernorm", "batchnorm_eval", "batchnorm_train"]


class Model(nn.Module):
    """An MLP that also pools a per-sample sequence, with a drawn normalization layer."""

    def __init__(self, norm: str) -> None:
        super().__init__()
        self.inp, self.seq, self.out = nn.Linear(4, 8), nn.Linear(1, 8), nn.Linear(8, 2)
        self.norm: nn.Module = {
            "none": nn.Identity(), "groupnorm": nn.GroupNorm(2, 8), "layernorm": nn.LayerNorm(8),
        }.get(norm) or nn.BatchNorm1d(8)  # fmt: skip

    def forward(self, x: torch.Tensor, seqs: list[torch.Tensor] | None = None) -> torch.Tensor:
        pooled = torch.zeros(len(x)) if seqs is None else torch.stack([s.mean() for s in seqs])
        h = self.inp(x) + self.seq(pooled[:, None])  # every parameter used (DDP)
        return self.out(torch.tanh(self.norm(h)))  # type: ignore[no-any-return]


def _data(spec: Spec, rank: int) -> list[Any]:
    """The drawn batches of this rank, collated in the drawn layout."""
    g = torch.Generator().manual_seed(spec["seed"] + 1000 * rank)
    collate = LAYOUTS[spec["layout"]][0]
    batches, sample = [], 0
    for n in spec["sizes"]:
        items = []
        for _ in range(n):
            length = int(torch.randint(1, 6, (), generator=g))
            items.append({"x": torch.randn(4, generator=g), "y": torch.randn(2, generator=g),
                          "seq": torch.randn(length, generator=g), "id": sample})  # fmt: skip
            sample += 1
        batches.append(collate(items))
    return batches


def train(spec: Spec, micro_batch: int | None, rank: int = 0) -> tuple[list[torch.Tensor], Any]:
    """The drawn run (DDP when a process group is up); the weights and the step."""
    torch.manual_seed(spec["seed"])
    model: nn.Module = Model(spec["norm"])
    if spec["norm"] == "batchnorm_eval":
        model.norm.eval()  # frozen statistics: each sample normalized alone
    if distributed.info().world_size > 1:
        model = distributed.wrap(model)
    opt: torch.optim.Optimizer = (
        torch.optim.AdamW(model.parameters(), lr=1e-2)
        if spec["optimizer"] == "adamw"
        else torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    )
    step = loopkit.step(model, opt, accumulate=spec["every"], clip_grad_norm=spec["clip"],
                        micro_batch=micro_batch)  # fmt: skip
    unpack = LAYOUTS[spec["layout"]][1]
    data = _data(spec, rank)
    for _ in range(spec["epochs"]):
        for batch in step.iterate(data):
            x, y, seqs, ids, temperature = unpack(batch)
            n = len(x)
            # The per-sample parts came with their own samples' rows.
            assert seqs is None or len(seqs) == n, (len(seqs), n)
            assert ids is None or (len(ids) == n and ids == sorted(ids)), (ids, n)
            with step as s:
                loss = nn.functional.mse_loss(model(x, seqs) * temperature, y)
                s.backward(loss, weight=n if spec["weight"] == "samples" else None)
    return [p.detach().clone() for p in model.parameters()], step


@st.composite
def scenarios(draw: Any) -> Spec:
    """A micro-batched run: sizes, chunk, windows, weights, optimizer, layout, normalization."""
    norm = draw(st.sampled_from(NORMS))
    smallest = 2 if norm == "batchnorm_train" else 1  # BatchNorm trains on 2 samples or more
    return {
        "sizes": draw(st.lists(st.integers(smallest, 9), min_size=1, max_size=5)),
        "micro_batch": draw(st.integers(1, 5)),
        "every": draw(st.integers(1, 3)),
        "weight": draw(st.sampled_from([None, "samples"])),
        "optimizer": draw(st.sampled_from(["sgd", "adamw"])),
        "clip": draw(st.sampled_from([None, 0.5])),
        "epochs": draw(st.integers(1, 2)),
        "layout": draw(st.sampled_from(sorted(LAYOUTS))),
        "norm": norm,
        "seed": draw(st.integers(0, 2**16)),
    }


def check(spec: Spec, rank: int = 0) -> dict[str, Any]:
    """The micro-batched run equals the whole-batch run (or, where BatchNorm in training
    mode would see a cut batch, is refused naming it before anything trains)."""
    whole, a = train(spec, None, rank)
    cut = any(n > spec["micro_batch"] for n in spec["sizes"])
    if spec["norm"] == "batchnorm_train" and cut:
        try:
            train(spec, spec["micro_batch"], rank)
        except RuntimeError as err:
            assert "BatchNorm" in str(err) and "micro_batch" in str(err), err
            return {"refused": True}
        raise AssertionError("micro_batch= with BatchNorm in training mode was not refused")
    split, b = train(spec, spec["micro_batch"], rank)
    assert (a.updates, a.seen.samples) == (b.updates, b.seen.samples), (
        (a.updates, a.seen.samples), (b.updates, b.seen.samples))  # fmt: skip
    for p, q in zip(whole, split, strict=True):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=2e-6)
    return {"refused": False, "flat": torch.cat([p.flatten() for p in split])}


def check_on_ranks(spec: Spec, info: distributed.DistInfo) -> dict[str, Any]:
    """2 ranks (DDP): each rank's check, and identical replicas (gathered)."""
    record = check(spec, info.rank)
    if not record["refused"]:
        flats = [torch.empty_like(record["flat"]) for _ in range(info.world_size)]
        torch.distributed.all_gather(flats, record["flat"])
        assert torch.equal(flats[0], flats[1]), "the DDP replicas differ"
    return {"refused": record["refused"]}
