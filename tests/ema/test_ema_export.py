"""The average out as a whole model state_dict (ema.export, export_weights) and back in."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch import nn

import loopkit

DECAY = 0.9


class Net(nn.Module):
    """A frozen parameter between trained ones, a BatchNorm's buffers, a tied output layer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 6)
        self.frozen = nn.Linear(6, 6)
        self.frozen.weight.requires_grad_(False)  # its bias still trains
        self.norm = nn.BatchNorm1d(6)
        self.out = nn.Linear(6, 6, bias=False)
        self.tied = nn.Linear(6, 6, bias=False)
        self.tied.weight = self.out.weight  # one tensor, two state_dict keys

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.frozen(torch.tanh(self.embed(x))))
        return self.tied(torch.tanh(self.out(h)))


def _trained(updates: int = 5) -> tuple[Net, loopkit.ema, loopkit.step, dict[int, torch.Tensor]]:
    """A model trained by a step with an ema, and an independent average by hand (by tensor)."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    average = loopkit.ema(model, decay=DECAY)
    step = loopkit.step(model, opt, ema=average)
    by_hand = {id(p): p.detach().clone() for p in model.parameters() if p.requires_grad}
    for _ in range(updates):
        with step as s:
            s.backward(model(torch.randn(8, 4)).pow(2).mean())
        for p in model.parameters():
            if p.requires_grad:
                by_hand[id(p)].lerp_(p.detach(), 1 - DECAY)
    return model, average, step, by_hand


def test_export_maps_every_key_to_its_own_average_with_a_frozen_parameter() -> None:
    """Frozen and tied parameters misalign a naive zip; export() gives each key its tensor."""
    model, average, _, by_hand = _trained()
    names = [n for n, _ in model.named_parameters()]
    naive = dict(zip(names, average.shadow, strict=False))  # the misaligned recipe
    assert not torch.equal(naive["frozen.bias"], by_hand[id(model.frozen.bias)])
    exported = average.export()
    assert list(exported) == list(model.state_dict())  # every key, the model's order
    live = model.state_dict(keep_vars=True)
    for key, value in exported.items():
        tensor = live[key]
        if id(tensor) in by_hand:  # an averaged parameter (out.weight and tied.weight alike)
            assert torch.equal(value, by_hand[id(tensor)]), key
        else:  # a frozen parameter, or a buffer: as the model holds it after the last update
            assert torch.equal(value, tensor), key
    assert torch.equal(exported["tied.weight"], exported["out.weight"])
    assert {"norm.running_mean", "norm.running_var", "norm.num_batches_tracked"} <= set(exported)
    assert not torch.equal(exported["norm.running_mean"], torch.zeros(6))  # BatchNorm moved


def test_an_exported_average_loads_into_a_new_model_and_samples_as_swapped() -> None:
    """load_state_dict(strict) of the export gives the outputs of `with ema.swapped()`."""
    model, average, _, _ = _trained()
    fresh = Net().eval()
    fresh.load_state_dict(average.export())
    x = torch.randn(5, 4)
    with average.swapped():
        model.eval()
        expected = model(x)
    assert torch.equal(fresh(x), expected)
    exported = average.export()
    exported["embed.weight"].add_(1.0)  # new tensors: the average is untouched
    assert torch.equal(average.export()["embed.weight"], average.named_shadow()["embed.weight"])


def test_export_keeps_the_fp32_average_of_a_bf16_model_when_asked() -> None:
    """dtype=None: the parameters' own dtype; dtype=torch.float32: the average as kept."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2).to(torch.bfloat16)
    average = loopkit.ema(model, decay=DECAY)
    assert average.export()["weight"].dtype == torch.bfloat16
    assert torch.equal(average.export(torch.float32)["weight"], average.shadow[0])


def test_export_weights_of_a_checkpoint_holds_frozen_and_tied_parameters(tmp_path: Path) -> None:
    """export_weights(ema=True) is the whole state_dict too: equal to ema.export()."""
    model, average, step, _ = _trained()
    path = loopkit.Checkpointer(tmp_path, model=model, step=step).save()
    assert path is not None
    from_file = loopkit.export_weights(path, ema=True)
    live = average.export(torch.float32)
    assert list(from_file) == list(live)
    for key, value in live.items():
        assert torch.equal(from_file[key].to(value.dtype), value), key
    Net().load_state_dict(from_file)  # strict: no key missing


def test_adopt_takes_a_job_s_average_by_name() -> None:
    """A saved model state_dict (DDP's module. prefix included) becomes the average."""
    _, average, _, _ = _trained()
    job_average = {f"module.{k}": v for k, v in average.export().items()}
    torch.manual_seed(1)
    other = Net()
    adopted = loopkit.ema(other, decay=DECAY)
    adopted.adopt(job_average, updates=7)
    assert (adopted.updates, adopted.seen) == (7, 7)
    for key, value in adopted.export().items():
        assert torch.equal(value, average.export()[key] if key != "frozen.weight"
                           else other.frozen.weight), key  # fmt: skip
    before = copy.deepcopy(adopted.shadow)
    broken = dict(job_average)
    broken["module.embed.weight"] = torch.zeros(2, 2)
    try:
        adopted.adopt(broken, updates=9)
    except ValueError as err:
        assert "'embed.weight' is (2, 2)" in str(err)
    else:
        raise AssertionError("a wrong shape was adopted")
    assert adopted.updates == 7 and all(
        torch.equal(a, b) for a, b in zip(adopted.shadow, before, strict=True)
    )
