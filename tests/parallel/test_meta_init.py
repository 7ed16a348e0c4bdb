"""A model built on the meta device, sharded, then materialized (``distributed.materialize``,
``distributed.wrap``): bit-identical to the CPU build with the same seed on 1 process here,
on 2 ranks (``dist_worker.py``'s ``meta_init``) and on 4 (``dist4_worker.py``'s
``meta_init4``, FSDP2 and HSDP); what it refuses, before anything changes; what a resume
into it reads."""

from __future__ import annotations

import math
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


def _refused_unchanged(model: nn.Module, through: str, match: str, message: str) -> None:
    """``wrap`` or ``materialize`` refuses ``model`` with ``message``; it stays on meta and the
    generator where it was."""
    state = torch.get_rng_state()
    call = distributed.wrap if through == "wrap" else distributed.materialize
    with pytest.raises(ValueError, match=match) as raised:
        call(model)
    assert message in str(raised.value), str(raised.value)
    assert _still_meta(model) and torch.equal(torch.get_rng_state(), state)


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
    _refused_unchanged(model, through, "init=fn", message)


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


def test_torch_before_2_7_split_equals_distribute_tensors(dist_results: dict[str, Any]) -> None:
    """2 ranks, torch < 2.7's path forced (each rank slices its part itself, as
    distribute_tensor(src_data_rank=None) does not exist there): FSDP2 and HSDP (Replicate,
    Shard), own init and init=: each local shard equals distribute_tensor's bit for bit, and
    every value the CPU build's."""
    for rank in _two_ranks(dist_results):
        cases = rank["fallback"]
        assert len(cases) == 8 and all(found == [] for found in cases.values()), cases


class _Mesh:
    """A mesh's shape and this rank's coordinate: what ``_my_slice`` reads."""

    def __init__(self, shape: tuple[int, ...], coordinate: list[int]) -> None:
        self.shape, self.coordinate = shape, coordinate

    def size(self, dim: int) -> int:
        return self.shape[dim]

    def get_coordinate(self) -> list[int]:
        return self.coordinate


def test_the_slice_of_torch_before_2_7_is_dtensors_split() -> None:
    """_my_slice (torch < 2.7) cuts what DTensor's own Shard split gives each coordinate:
    uneven and empty pieces (5 rows over 4: 2, 2, 1, 0), negative dims, 2-D meshes with
    Replicate."""
    from torch.distributed.tensor import Replicate, Shard

    from loopkit._parallel._materialize import _my_slice

    full = torch.arange(7 * 5 * 3).reshape(7, 5, 3)
    layouts = [
        ((4,), [Shard(1)]),
        ((3,), [Shard(-1)]),
        ((8,), [Shard(0)]),
        ((2, 3), [Replicate(), Shard(0)]),
        ((2, 2), [Shard(0), Shard(1)]),
    ]
    for shape, placements in layouts:
        for flat in range(math.prod(shape)):
            coordinate = [flat // math.prod(shape[i + 1 :]) % shape[i] for i in range(len(shape))]
            want = full
            for i, p in enumerate(placements):
                if isinstance(p, Shard):
                    want = p._split_tensor(want, shape[i], with_padding=False)[0][coordinate[i]]
            got = _my_slice(full, _Mesh(shape, coordinate), placements)
            assert torch.equal(got, want), (shape, placements, coordinate)


def test_torch_before_2_7_refuses_a_placement_it_cannot_split(
    process_group: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch < 2.7 (forced): a meta tensor placed _StridedShard (FSDP over tensor parallel),
    which the fallback cannot cut, is refused naming it, before anything changes."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import _StridedShard

    from loopkit._parallel import _materialize

    monkeypatch.setattr(_materialize, "_splits_locally", lambda: False)
    mesh = init_device_mesh("cpu", (1,))
    model = nn.Linear(2, 4, device="meta")
    placed = DTensor.from_local(model.weight.detach(), mesh, [_StridedShard(0, split_factor=2)])
    model.weight = nn.Parameter(placed)
    state = torch.get_rng_state()
    with pytest.raises(ValueError, match=r"weight is placed _StridedShard.*needs torch >= 2\.7"):
        distributed.materialize(model)
    assert _still_meta(model) and torch.equal(torch.get_rng_state(), state)


class _NanoBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.c_fc = nn.Linear(dim, 4 * dim)
        self.c_proj = nn.Linear(4 * dim, dim)


class _NanoGPT(nn.Module):
    """nanoGPT's init: its modules built, then ``self.apply(self._init_weights)`` and the
    residual projections scaled."""

    def __init__(self, layers: int = 2, dim: int = 8) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(11, dim), nn.Embedding(6, dim)
        self.h = nn.ModuleList(_NanoBlock(dim) for _ in range(layers))
        self.ln_f, self.lm_head = nn.LayerNorm(dim), nn.Linear(dim, 11, bias=False)
        self.apply(self._init_weights)
        _scale_projections(self, layers)

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)


def _scale_projections(model: nn.Module, layers: int) -> None:
    for name, p in model.named_parameters():
        if name.endswith("c_proj.weight"):
            nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * layers))


class _PostInit(nn.Module):
    """Hugging Face's shape: the modules built, then ``self.post_init()``."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.post_init()

    def post_init(self) -> None:
        nn.init.zeros_(self.proj.bias)


class _InlineInit(nn.Module):
    """torchvision's ResNet shape: ``__init__`` re-initializes its children in a loop."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")


class _ParentReset(nn.Module):
    """A ``reset_parameters`` on a parent that initializes its children (never run by
    materialize: the parent holds no tensor)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 3)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for m in (self.a, self.b):
            nn.init.trunc_normal_(m.weight, std=0.02)


class _LeafWithInitWeights(nn.Linear):
    """A leaf that re-initializes itself in ``__init__`` by its own ``_init_weights``."""

    def __init__(self) -> None:
        super().__init__(3, 3)
        self._init_weights()

    def _init_weights(self) -> None:
        nn.init.orthogonal_(self.weight)


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (_NanoGPT, "the model (_NanoGPT) defines _init_weights()"),
        (_PostInit, "the model (_PostInit) defines post_init()"),
        (lambda: nn.Sequential(nn.Linear(2, 8), nn.Transformer(8, 2, 1, 1, 16)),
         "1 (Transformer) defines _reset_parameters()"),
        (_InlineInit, "_InlineInit.__init__ calls kaiming_normal_() (line"),
        (_ParentReset, "the model (_ParentReset) has a reset_parameters() and children"),
        (lambda: nn.Sequential(_LeafWithInitWeights()), "0 (_LeafWithInitWeights) defines "
         "_init_weights()"),
    ],
    ids=["nanogpt", "post_init", "torch_transformer", "inline_loop", "parent_reset", "leaf"],
)  # fmt: skip
@pytest.mark.parametrize("through", ["wrap", "materialize"])
def test_a_model_that_initializes_itself_otherwise_is_refused_without_init(
    build: Any, message: str, through: str
) -> None:
    """init=None on a model whose own init is more than its modules' reset_parameters()
    (nanoGPT's apply(_init_weights), HF's post_init, nn.Transformer's, a re-init loop in
    __init__, a parent's reset_parameters): refused naming the module and method, showing
    init=, before anything changes."""
    import warnings

    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # nn.Transformer's nested-tensor note
        model = build()
    _refused_unchanged(model, through, "init=", message)


def test_nanogpt_refusal_shows_the_fix() -> None:
    """The refusal of nanoGPT's shape shows init=lambda m: m.apply(m._init_weights)."""
    with torch.device("meta"):
        model = _NanoGPT()
    with pytest.raises(ValueError, match=r"init=lambda m: m\.apply\(m\._init_weights\)"):
        distributed.materialize(model)


@pytest.mark.parametrize("through", ["wrap", "materialize"])
def test_nanogpt_with_init_is_bit_identical_to_the_cpu_build(through: str) -> None:
    """nanoGPT's shape with init= doing what its __init__ does (the modules' draws, then
    apply(_init_weights) and the scaled projections): the CPU build's values, bit for bit,
    and the generator where that build left it."""

    def init(m: nn.Module) -> None:
        for module in m.modules():
            if isinstance(module, (nn.Linear, nn.Embedding, nn.LayerNorm)):
                module.reset_parameters()
        m.apply(m._init_weights)  # type: ignore[arg-type,operator]
        _scale_projections(m, 2)

    torch.manual_seed(0)
    reference = _NanoGPT()
    after = torch.rand(3)
    with torch.device("meta"):
        model = _NanoGPT()
    torch.manual_seed(0)
    (distributed.wrap if through == "wrap" else distributed.materialize)(model, init=init)
    assert differences(model, reference) == []
    assert torch.equal(torch.rand(3), after)


def _plain() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.GELU(), meta_models.Block(8),
                         nn.AdaptiveLogSoftmaxWithLoss(8, 20, [5, 10], div_value=2.0))  # fmt: skip


@pytest.mark.parametrize("build", [_plain, Net], ids=["torch_nn", "own_leaf_modules"])
def test_models_initialized_by_their_modules_still_materialize(build: Any) -> None:
    """torch.nn models (a non-leaf torch module's reset_parameters included), user modules
    made of them and a user leaf module with its own reset_parameters (Rotary): init=None
    still gives the CPU build's values."""
    torch.manual_seed(0)
    reference = build()
    with torch.device("meta"):
        model = build()
    torch.manual_seed(0)
    distributed.materialize(model)
    assert differences(model, reference) == []
