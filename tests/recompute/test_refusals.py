"""What checkpointing refuses: compiled modules (checkpoint first, then compile) and KV
caches that the recompute would write twice."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from helpers import assert_bit_equal
from recompute_helpers import Block, run_model, saved_bytes, stack
from torch import nn

import loopkit


def _compiled_cases() -> dict[str, Callable[[], tuple[nn.Module, list[nn.Module]]]]:
    def wrapper() -> tuple[nn.Module, list[nn.Module]]:
        m = stack()
        return torch.compile(m, backend="eager"), list(m)

    def in_place() -> tuple[nn.Module, list[nn.Module]]:
        m = stack()
        m.compile(backend="eager")
        return m, list(m)

    def wrapper_blocks() -> tuple[nn.Module, list[nn.Module]]:
        m = stack()
        return torch.compile(m, backend="eager"), list(m)

    def compiled_block() -> tuple[nn.Module, list[nn.Module]]:
        m = stack()
        m[3].compile(backend="eager")
        return m, list(m)

    def wrapped_block() -> tuple[nn.Module, list[nn.Module]]:
        m = stack()
        m[5] = torch.compile(m[5], backend="eager")
        return m, [*list(m)[:5], m[5]._orig_mod, *list(m)[6:]]

    return {
        "wrapper": wrapper,
        "in_place": in_place,
        "wrapper_blocks": wrapper_blocks,
        "compiled_block": compiled_block,
        "wrapped_block": wrapped_block,
    }


@pytest.mark.parametrize("case", sorted(_compiled_cases()))
def test_compiled_modules_are_refused_without_change(case: str) -> None:
    """A compiled module, or blocks= inside one, is refused ("first, then compile"), unchanged."""
    model, blocks = _compiled_cases()[case]()
    classes = [type(m) for m in (model, *blocks)]
    with pytest.raises(ValueError, match=r"Apply loopkit\.checkpointed first, then compile"):
        if case in ("wrapper", "in_place"):
            loopkit.checkpointed(model)
        else:
            loopkit.checkpointed(model, blocks=Block)
    assert [type(m) for m in (model, *blocks)] == classes
    assert not any(loopkit.is_checkpointed(m) for m in (model, *blocks))
    _, grads = run_model(model)  # still the plain model
    _, plain_grads = run_model(stack())
    assert_bit_equal(plain_grads, grads)


def test_checkpointed_then_compiled_saves_memory_and_reapplies_as_no_op() -> None:
    """The right order works: bytes kept drop, gradients match; re-applying changes nothing."""
    plain = stack()
    model = loopkit.checkpointed(stack(), blocks=Block)
    compiled = torch.compile(model, backend="eager")
    assert saved_bytes(compiled) <= saved_bytes(torch.compile(plain, backend="eager")) / 4
    assert loopkit.checkpointed(compiled, blocks=Block) is compiled  # every block already is
    with pytest.raises(ValueError, match="another policy"):
        loopkit.checkpointed(compiled, blocks=Block, policy="save_matmuls")
    with pytest.raises(ValueError, match="then compile"):
        loopkit.checkpointed(compiled)  # the whole model was not checkpointed before compiling
    block = torch.compile(loopkit.checkpointed(Block()), backend="eager")
    assert loopkit.is_checkpointed(block)  # seen through the compile wrapper
    assert loopkit.checkpointed(block) is block
    plain.zero_grad()
    model.zero_grad()
    assert_bit_equal(run_model(plain)[1], run_model(compiled)[1])


# --- KV caches (transformers) ------------------------------------------------------------


class ListCache:
    """A KV cache with transformers' Cache API: update appends, get_seq_length counts."""

    def __init__(self) -> None:
        self.keys: list[torch.Tensor] = []

    def update(self, k: torch.Tensor) -> torch.Tensor:
        self.keys.append(k)
        return torch.cat(self.keys, dim=1)

    def get_seq_length(self) -> int:
        return sum(k.shape[1] for k in self.keys)


class CachedAttention(nn.Module):
    """Writes its keys to the cache it is given, then attends over all of them."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.q, self.k = nn.Linear(d, d), nn.Linear(d, d)

    def forward(
        self,
        x: torch.Tensor,
        cache: ListCache | None = None,
        past_key_values: ListCache | None = None,
        use_cache: bool = False,
    ) -> torch.Tensor:
        keys = self.k(x)
        for c in (cache, past_key_values):
            if c is not None:
                keys = c.update(keys)
        return torch.softmax(self.q(x) @ keys.transpose(1, 2), -1) @ keys


@pytest.mark.parametrize(
    ("call", "hint"),
    [
        (lambda m, x, c: m(x, past_key_values=c), "past_key_values= (ListCache)"),
        (lambda m, x, c: m(x, c), "positional argument 1 (ListCache)"),
        (lambda m, x, c: m(x, use_cache=True), "use_cache=True"),
    ],
    ids=["keyword", "positional", "use_cache"],
)
def test_kv_cache_in_a_grad_call_is_refused_before_writing(
    call: Callable[[nn.Module, torch.Tensor, ListCache], torch.Tensor], hint: str
) -> None:
    """A cache or use_cache=True in a grad-mode checkpointed call raises; nothing is written."""
    model = loopkit.checkpointed(CachedAttention())
    x, cache = torch.randn(2, 5, 16), ListCache()
    with pytest.raises(ValueError, match=r"model\.config\.use_cache = False") as info:
        call(model, x, cache)
    assert hint in str(info.value)
    assert cache.keys == []
    with torch.no_grad():  # generation: no recompute, the cache works
        model(x, past_key_values=cache)
        model(x[:, :1], past_key_values=cache)
    assert cache.get_seq_length() == 6


def _gpt2(impl: str) -> nn.Module:
    transformers = pytest.importorskip("transformers", reason="transformers is in the dev extra")
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=128, attn_implementation=impl
    )
    model: nn.Module = transformers.GPT2LMHeadModel(config)
    return model


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_gpt2_default_config_gradients_match_plain(impl: str) -> None:
    """GPT2 (use_cache=True by default): its blocks checkpointed, gradients are bit-identical."""
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    plain = _gpt2(impl)
    model = copy.deepcopy(plain)
    with pytest.warns(UserWarning, match="config.use_cache = False"):
        loopkit.checkpointed(model, blocks=GPT2Block)
    assert model.config.use_cache is False and plain.config.use_cache is True
    x = torch.randint(0, 100, (2, 94), generator=torch.Generator().manual_seed(1))
    for m in (plain, model):
        torch.manual_seed(3)  # the same dropout masks
        m(x, labels=x).loss.backward()
    assert_bit_equal([p.grad for p in plain.parameters()], [p.grad for p in model.parameters()])  # type: ignore[misc]
    with torch.no_grad():  # generation still gets its cache
        out = model(x, use_cache=True)
    assert out.past_key_values.get_seq_length() == 94
    with pytest.raises(ValueError, match="use_cache"):
        model(x, use_cache=True)  # in grad mode: refused before any block runs twice


def test_gpt2_use_cache_turned_off_with_one_warning() -> None:
    """The warning comes once: applying again finds use_cache already False."""
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    model = _gpt2("eager")
    with pytest.warns(UserWarning):
        loopkit.checkpointed(model, blocks=GPT2Block)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loopkit.checkpointed(model, blocks=GPT2Block)
