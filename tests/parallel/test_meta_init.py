"""A model built on the meta device, sharded, then materialized (``distributed.materialize``,
``distributed.wrap``): bit-identical to the CPU build with the same seed on 1 process here,
on 2 ranks (``dist_worker.py``'s ``meta_init``) and on 4 (``dist4_worker.py``'s
``meta_init4``, FSDP2 and HSDP); what it refuses, before anything changes; what a resume
into it reads."""

from __future__ import annotations

from collections import Counter
from typing import Any

import meta_models
import pytest
import torch
from meta_models import Net, differences, on_cpu, on_meta, seed_for, titan_init
from torch import nn

from loopkit import distributed


def _still_meta(model: nn.Module) -> bool:
    return all(t.is_meta for t in [*model.parameters(), *model.buffers()])


@pytest.mark.parametrize("init", [None, titan_init], ids=["own", "fn"])
def test_wrap_one_process_materializes_as_the_cpu_build(init: Any) -> None:
    """One process: wrap(meta model[, init=]) materializes it (it returned it on meta) with
    the CPU build's values, buffers included, and leaves the generator where that build did."""
    reference = on_cpu(init)
    after = torch.rand(3)
    model = on_meta()
    seed_for(init)
    assert distributed.wrap(model, init=init) is model
    assert torch.equal(torch.rand(3), after)
    assert differences(model, reference) == []
    assert not model.blocks[0].rotary.table.is_meta  # type: ignore[index,union-attr]
    model(torch.arange(4)).sum().backward()  # it trains


@pytest.mark.parametrize("init", [None, titan_init], ids=["own", "fn"])
def test_materialize_by_hand_one_process(init: Any) -> None:
    """distributed.materialize(meta model[, init]) gives the CPU build's values."""
    reference = on_cpu(init)
    model = on_meta()
    seed_for(init)
    assert distributed.materialize(model, init) is model
    assert differences(model, reference) == []


def _two_ranks(dist_results: dict[str, Any]) -> list[dict[str, Any]]:
    return dist_results["meta_init"]  # type: ignore[no-any-return]


def test_two_ranks_bit_identical_to_the_cpu_build(dist_results: dict[str, Any]) -> None:
    """2 ranks: through wrap(fsdp=Block), by hand (blocks then root; blocks only, so the root's
    own tensors stay whole) and DDP, with reset_parameters and with init=: every parameter
    and buffer equals the CPU build; the generator ends where it did; trained 2 updates, the
    meta-built model equals the CPU-built one wrapped the same way."""
    for rank in _two_ranks(dist_results):
        cases = rank["cases"]
        assert set(cases) >= {"wrap/own", "wrap/fn", "by_hand/own", "blocks_only/fn",
                              "ddp/own", "rng/own", "rng/fn", "trained"}  # fmt: skip
        assert all(found == [] for found in cases.values()), cases


def test_four_ranks_bit_identical_to_the_cpu_build(dist4_results: dict[str, Any]) -> None:
    """4 ranks, FSDP2 over 4 and HSDP on a 2x2 mesh: every parameter and buffer equals the CPU
    build, through wrap and by hand, with reset_parameters and with init=."""
    for rank in dist4_results["meta_init4"]:
        assert set(rank["fsdp"]) >= {"wrap/own", "by_hand/fn"}
        assert set(rank["hsdp"]) >= {"wrap/own", "wrap/fn", "by_hand/own", "blocks_only/fn"}
        for cases in (rank["fsdp"], rank["hsdp"]):
            assert all(found == [] for found in cases.values()), cases


def test_a_resume_into_a_meta_built_model_reads_each_stored_byte_once(
    dist_results: dict[str, Any],
) -> None:
    """2 ranks: a fresh meta-built model resumed by the Checkpointer reads every piece of the
    shard files once in the whole job (no piece twice, on one rank or two), every byte of them,
    and ends with the saved values."""
    ranks = [r["resume"] for r in _two_ranks(dist_results)]
    reads = Counter(piece for r in ranks for piece in r["reads"])
    assert reads and max(reads.values()) == 1, reads
    assert sum(length for _, _, length in reads) == ranks[0]["size"]
    for r in ranks:
        assert r["differences"] == [] and r["updates"] == 2


class _NoReset(nn.Module):
    """Holds a parameter and has no reset_parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(3))


class _StaleTable(meta_models.Rotary):
    """A reset_parameters that writes no buffer (the table is only computed in __init__)."""

    def reset_parameters(self) -> None:
        pass


class _ResetsOthers(nn.Module):
    """A reset_parameters that writes another module's tensor as well as its own."""

    def __init__(self, other: nn.Linear) -> None:
        super().__init__()
        self.other = [other]  # not a submodule
        self.bias = nn.Parameter(torch.zeros(2))

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.bias)
        nn.init.zeros_(self.other[0].weight)


def _resets_others() -> nn.Module:
    linear = nn.Linear(2, 2)
    return nn.Sequential(linear, _ResetsOthers(linear))


def _tied() -> nn.Module:
    model = nn.Sequential(nn.Embedding(5, 4), nn.Linear(4, 5, bias=False))
    model[1].weight = model[0].weight
    return model


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: nn.Sequential(nn.Linear(2, 3), _NoReset()),
         "1 (_NoReset) holds scale but has no reset_parameters()"),
        (lambda: nn.Sequential(nn.Linear(2, 4), _StaleTable(4)),
         "1 (_StaleTable).reset_parameters() does not write table"),
        (_resets_others, "writes 0.weight, another module's tensor"),
        (_tied, "1.weight is the same tensor as 0.weight (tied)"),
    ],
    ids=["no_reset_parameters", "buffer_not_written", "writes_another_module", "tied"],
)  # fmt: skip
@pytest.mark.parametrize("through", ["wrap", "materialize"])
def test_refused_without_init_before_anything_changes(
    build: Any, message: str, through: str
) -> None:
    """A model whose own reset_parameters cannot reproduce the CPU build is refused, naming
    the module and the tensor, and says to pass init=; the model stays on meta and the
    generator where it was."""
    with torch.device("meta"):
        model = build()
    state = torch.get_rng_state()
    call = distributed.wrap if through == "wrap" else distributed.materialize
    with pytest.raises(ValueError, match="init=fn") as raised:
        call(model)
    assert message in str(raised.value), str(raised.value)
    assert _still_meta(model) and torch.equal(torch.get_rng_state(), state)


def test_init_makes_the_refused_models_work() -> None:
    """The refused model materializes with init=fn that writes every tensor, with the values
    fn gives (its draws the CPU build's)."""

    def init(model: nn.Module) -> None:
        nn.init.normal_(model[0].weight)  # type: ignore[index]
        nn.init.zeros_(model[0].bias)  # type: ignore[index]
        model[1].scale.fill_(2.0)  # type: ignore[index]

    torch.manual_seed(4)
    reference = nn.Sequential(nn.Linear(2, 3), _NoReset())
    torch.manual_seed(5)
    with torch.no_grad():
        init(reference)
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(2, 3), _NoReset())
    torch.manual_seed(5)
    distributed.materialize(model, init=init)
    assert differences(model, reference) == []


def test_init_that_leaves_a_tensor_unwritten_is_refused_and_undone() -> None:
    """init= that forgets a tensor (its memory would stay uninitialized) is refused naming it;
    the model goes back to meta and the generator to where it was."""

    def forgets_the_table(model: nn.Module) -> None:
        for module in model.modules():
            if isinstance(module, (nn.Linear, nn.Embedding, nn.LayerNorm, nn.BatchNorm1d)):
                module.reset_parameters()

    model = on_meta()
    state = torch.get_rng_state()
    with pytest.raises(ValueError, match=r"blocks\.0\.rotary\.table, blocks\.1\.rotary\.table"):
        distributed.materialize(model, init=forgets_the_table)
    assert _still_meta(model) and torch.equal(torch.get_rng_state(), state)


def test_init_that_raises_is_undone() -> None:
    """init= raising midway: the model is back on meta, the generator where it was."""

    def fails(model: nn.Module) -> None:
        nn.init.normal_(model.embed.weight)  # type: ignore[arg-type]
        raise RuntimeError("init failed")

    model = on_meta()
    state = torch.get_rng_state()
    with pytest.raises(RuntimeError, match="init failed"):
        distributed.wrap(model, init=fails)
    assert _still_meta(model) and torch.equal(torch.get_rng_state(), state)


def test_a_model_not_on_meta_is_wrapped_as_before() -> None:
    """wrap of a built model (one process) returns it untouched: no init runs."""
    model = Net()
    values = meta_models.whole(model)
    state = torch.get_rng_state()
    assert distributed.wrap(model) is model
    assert torch.equal(torch.get_rng_state(), state)
    assert all(torch.equal(values[n], t) for n, t in meta_models.whole(model).items())
