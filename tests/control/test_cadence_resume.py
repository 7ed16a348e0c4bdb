"""cadence(checkpointer=): what it remembers goes on after a resume, or the resume is refused."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch import nn

import loopkit
from loopkit import distributed

DATA = [torch.randn(2, 3, generator=torch.Generator().manual_seed(i)) for i in range(8)]


def _run(
    directory: Path, every: int, inf_window: int, stop_after: int | None = None
) -> tuple[list[int], nn.Module]:
    """Updates at which ``updates=1`` fires; window ``inf_window`` has an inf loss (skipped).

    Validates, then saves, after every window; ``stop_after`` windows ends the run there.
    """
    torch.manual_seed(0)
    net = nn.Linear(3, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    step = loopkit.step(net, opt, accumulate=every, skip_nonfinite=True)
    ckpt = loopkit.Checkpointer(directory, model=net, optimizer=opt, step=step)
    validate = loopkit.cadence(step, updates=1, checkpointer=ckpt)
    ckpt.resume()
    fired = []
    for i in range(every * (step.updates + step.skipped), len(DATA)):
        with step as s:
            loss = net(DATA[i]).pow(2).mean()
            s.backward(loss * float("inf") if i // every == inf_window else loss)
        if validate.due():
            fired.append(step.updates)
        ckpt.maybe_save(every=1)
        if stop_after is not None and step.updates + step.skipped >= stop_after:
            break
    return fired, net


@pytest.mark.parametrize("every", [1, 2])
def test_a_skipped_first_window_after_a_resume_does_not_fire_again(
    tmp_path: Path, every: int
) -> None:
    """Resumed at update 1, the next window skipped: fires at the updates the whole run does."""
    whole, net_whole = _run(tmp_path / "whole", every, inf_window=1)
    _run(tmp_path / "resumed", every, inf_window=1, stop_after=1)
    resumed, net_resumed = _run(tmp_path / "resumed", every, inf_window=1)
    n = len(DATA) // every
    assert whole == list(range(1, n)) and resumed == list(range(2, n))
    for a, b in zip(net_whole.parameters(), net_resumed.parameters(), strict=True):
        assert torch.equal(a, b)


def _plain_loop(directory: Path, calls: int, resume: bool) -> list[int]:
    """A loop without loopkit.step: the calls at which ``updates=3`` fires, saving at each."""
    net = nn.Linear(3, 1)
    ckpt = loopkit.Checkpointer(directory, model=net)
    validate = loopkit.cadence(updates=3, checkpointer=ckpt)
    start = 0
    if resume:
        ckpt.resume()
        start = 4
    fired = []
    for call in range(start + 1, start + calls + 1):
        if validate.due():
            fired.append(call)
        if call == 4 and not resume:
            ckpt.save()
    return fired


def test_without_a_step_the_count_goes_on_after_a_resume(tmp_path: Path) -> None:
    """Saved after call 4, resumed: it fires at calls 6 and 9, as the whole run does."""
    assert _plain_loop(tmp_path, 4, resume=False) == [3]
    assert _plain_loop(tmp_path, 5, resume=True) == [6, 9]


def _saved(directory: Path) -> tuple[nn.Module, Path]:
    """A checkpoint at update 2 of a run with ``cadence(updates=2)``; its model."""
    torch.manual_seed(0)
    net = nn.Linear(3, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    step = loopkit.step(net, opt)
    ckpt = loopkit.Checkpointer(directory, model=net, optimizer=opt, step=step)
    validate = loopkit.cadence(step, updates=2, checkpointer=ckpt)
    for x in DATA[:2]:
        with step as s:
            s.backward(net(x).pow(2).mean())
        validate.due()
    path = ckpt.save()
    assert path is not None
    return net, path


@pytest.mark.parametrize(
    ("cadences", "said"),
    [
        ([], "has cadence state but the Checkpointer was built without"),  # removed
        ([{"updates": 3}], "was updates=2, this one is updates=3"),  # another schedule
        ([{"per_epoch": 1}], "was updates=2, this one is per_epoch=1"),
        ([{"updates": 2, "name": "val"}], "has no val state"),  # another name
        ([{"updates": 2}, {"updates": 1, "name": "log"}], "has no log state"),  # one added
    ],
)
def test_a_resume_with_other_cadences_is_refused_before_anything_loads(
    tmp_path: Path, cadences: list[dict[str, object]], said: str
) -> None:
    """CheckpointError from resume(); the model and every cadence's state as they were."""
    _saved(tmp_path)
    torch.manual_seed(1)
    net = nn.Linear(3, 1)
    before = [p.detach().clone() for p in net.parameters()]
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    step = loopkit.step(net, opt)
    ckpt = loopkit.Checkpointer(tmp_path, model=net, optimizer=opt, step=step)
    loader = distributed.loader(torch.utils.data.TensorDataset(torch.randn(4, 3)), batch_size=1,
                                num_workers=0)  # fmt: skip
    built = [loopkit.cadence(step, checkpointer=ckpt, loader=loader if "per_epoch" in kw else None,
                             **kw)  # type: ignore[arg-type]
             for kw in cadences]  # fmt: skip
    states = [c._state.state_dict() for c in built]
    with pytest.raises(loopkit.CheckpointError, match=re.escape(said)):
        ckpt.resume()
    assert all(torch.equal(a, b) for a, b in zip(before, net.parameters(), strict=True))
    assert step.updates == 0 and [c._state.state_dict() for c in built] == states


def test_the_same_cadences_resume_and_a_damaged_state_is_refused(tmp_path: Path) -> None:
    """The same cadence loads its state; a damaged one raises CheckpointError and loads nothing."""
    net_saved, path = _saved(tmp_path)
    state = loopkit.load_checkpoint(path)
    assert state["cadence"] == {"kind": "updates", "value": 2, "fired_at": 2, "calls": 0}
    state["cadence"]["fired_at"] = "2"
    torch.save(state, path)
    net = nn.Linear(3, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    step = loopkit.step(net, opt)
    ckpt = loopkit.Checkpointer(tmp_path, model=net, optimizer=opt, step=step)
    validate = loopkit.cadence(step, updates=2, checkpointer=ckpt)
    with pytest.raises(loopkit.CheckpointError, match=r"'cadence\.fired_at' is a str"):
        ckpt.resume()
    assert validate._state.fired_at is None and step.updates == 0
    state["cadence"]["fired_at"] = 2
    torch.save(state, path)
    ckpt.resume()
    assert validate._state.fired_at == 2 and step.updates == 2
    assert all(torch.equal(a, b)
               for a, b in zip(net.parameters(), net_saved.parameters(), strict=True))  # fmt: skip


def test_cadences_of_one_checkpointer_need_distinct_names(tmp_path: Path) -> None:
    """A second cadence named alike is refused and adds nothing; another name is saved apart."""
    net = nn.Linear(3, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    step = loopkit.step(net, opt)
    ckpt = loopkit.Checkpointer(tmp_path, model=net, optimizer=opt, step=step)
    val = loopkit.cadence(step, updates=2, checkpointer=ckpt)
    with pytest.raises(ValueError, match="already saves a cadence named 'cadence'"):
        loopkit.cadence(step, updates=1, checkpointer=ckpt)
    log = loopkit.cadence(step, updates=1, checkpointer=ckpt, name="log")
    assert ckpt.pieces["cadence"] is val._state and ckpt.pieces["log"] is log._state
    with pytest.raises(ValueError, match="name must be a non-empty str"):
        loopkit.cadence(step, updates=1, checkpointer=ckpt, name="")
    with pytest.raises(ValueError, match="already saves a piece named 'step'"):
        loopkit.cadence(step, updates=1, checkpointer=ckpt, name="step")
    for x in DATA[:2]:
        with step as s:
            s.backward(net(x).pow(2).mean())
        val.due()
        log.due()
    state = ckpt.state_dict()
    assert state["cadence"]["fired_at"] == 2 and state["log"]["value"] == 1


def test_a_cadence_and_its_checkpointer_must_follow_the_same_step(tmp_path: Path) -> None:
    """Another step, a step against none, or an add after a save: refused, nothing added."""
    net = nn.Linear(3, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    step, other = loopkit.step(net, opt), loopkit.step(net, opt)
    ckpt = loopkit.Checkpointer(tmp_path, model=net, optimizer=opt, step=step)
    with pytest.raises(ValueError, match="follow different steps"):
        loopkit.cadence(other, updates=1, checkpointer=ckpt)
    with pytest.raises(ValueError, match="given no step but its checkpointer saves one"):
        loopkit.cadence(updates=1, checkpointer=ckpt)
    plain = loopkit.Checkpointer(tmp_path / "plain", model=net)
    with pytest.raises(ValueError, match="follows a step but its checkpointer saves none"):
        loopkit.cadence(step, updates=1, checkpointer=plain)
    with pytest.raises(TypeError, match=r"must be a loopkit\.Checkpointer"):
        loopkit.cadence(step, updates=1, checkpointer=object())  # type: ignore[arg-type]
    ckpt.save()
    with pytest.raises(RuntimeError, match="before the first resume"):
        loopkit.cadence(step, updates=1, checkpointer=ckpt)
    assert "cadence" not in ckpt.pieces and "cadence" not in plain.pieces
