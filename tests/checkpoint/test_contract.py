"""Checkpoint pieces: the all-or-nothing check and load, and a new piece plugged in by extra=."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_bit_equal, mlp, params

import loopkit
from loopkit._checkpoint._contract import (
    ExtraStates,
    StatePiece,
    UserState,
    check_all,
    load_all,
    saved_for,
)


class _Recorded:
    """A piece that writes what is done to it in a shared log; its load may raise."""

    def __init__(self, name: str, log: list[str], fail_load: bool = False) -> None:
        self.name, self.log, self.fail_load = name, log, fail_load
        self.value = 0

    def state_dict(self) -> int:
        return self.value

    def check_state_dict(self, saved: Any) -> None:
        self.log.append(f"check {self.name}")
        if saved == "bad":
            raise loopkit.CheckpointError(f"{self.name} refuses")

    def snapshot(self) -> int:
        return self.value

    def load_state_dict(self, saved: int) -> None:
        self.log.append(f"load {self.name}")
        self.value = saved  # changed before it fails: the restore must put it back
        if self.fail_load:
            raise RuntimeError(f"{self.name} cannot load")

    def restore(self, snapshot: int) -> None:
        self.log.append(f"restore {self.name}")
        self.value = snapshot


class _PerRank(_Recorded):
    per_rank = True


def _pieces(log: list[str], failing: str = "") -> dict[str, _Recorded]:
    return {n: _Recorded(n, log, fail_load=n == failing) for n in ("model", "a", "b", "rng")}


def test_the_recorded_piece_is_a_state_piece() -> None:
    """The contract is structural: any object with the five methods is a piece."""
    assert isinstance(_Recorded("x", []), StatePiece)
    assert not isinstance(torch.optim.SGD(mlp().parameters(), lr=0.1), StatePiece)


def test_load_all_puts_last_ones_last_and_undoes_newest_first() -> None:
    """`last` pieces load after the others, in order; a failing load undoes it and all before."""
    log: list[str] = []
    pieces = _pieces(log, failing="rng")
    with pytest.raises(RuntimeError, match="rng cannot load"):
        load_all(pieces, {"model": 1, "a": 2, "b": 3, "rng": 4}, last=("rng", "model"))
    assert log == [
        "load a", "load b", "load rng",
        "restore rng", "restore b", "restore a",
    ]  # fmt: skip
    assert [p.value for p in pieces.values()] == [0, 0, 0, 0]


def test_load_all_loads_everything_when_nothing_fails() -> None:
    log: list[str] = []
    pieces = _pieces(log)
    load_all(pieces, {"model": 1, "a": 2, "b": 3, "rng": 4}, last=("model",))
    assert log == ["load a", "load b", "load rng", "load model"]
    assert [p.value for p in pieces.values()] == [1, 2, 3, 4]


@pytest.mark.parametrize(
    ("state", "message"),
    [
        ({"a": 0, "b": 0, "rng": 0}, "incomplete checkpoint: 'model' is missing"),
        ({"model": 0, "b": 0, "rng": 0}, "has no a state but the Checkpointer was built with one"),
        ({"model": 0, "a": 0, "b": 0, "rng": 0, "ema": 0}, "has ema state but the Checkpointer"),
        ({"model": 0, "a": "bad", "b": 0, "rng": 0}, "a refuses"),
    ],
    ids=["always_saved", "passed_but_not_saved", "saved_but_not_passed", "piece_refuses"],
)
def test_check_all_names_what_does_not_fit_and_loads_nothing(
    state: dict[str, Any], message: str
) -> None:
    """A missing entry is a damaged file or another setup; an unclaimed one another setup."""
    log: list[str] = []
    with pytest.raises(loopkit.CheckpointError, match=message):
        check_all(
            _pieces(log), {"format": 1, **state}, bookkeeping=("format",), always_saved=("model",)
        )
    assert not any(entry.startswith("load") for entry in log)


def test_a_per_rank_entry_gives_this_ranks_state() -> None:
    """A per-rank piece's entry is one state per rank; a list of another length is damaged."""
    piece = _PerRank("rng", [])
    assert saved_for({"rng": [7]}, "rng", piece) == 7
    with pytest.raises(loopkit.CheckpointError, match="'rng' holds 2 states for 1 ranks"):
        saved_for({"rng": [7, 8]}, "rng", piece)


def test_extra_states_wraps_plain_objects_and_keeps_whole_pieces() -> None:
    """extra= takes any Stateful (wrapped, unchecked) and uses a whole piece as it is."""
    log: list[str] = []
    sched = torch.optim.lr_scheduler.StepLR(torch.optim.SGD(mlp().parameters(), lr=0.1), 1)
    ema = _Recorded("ema", log)
    extras = ExtraStates({"sched": sched, "ema": ema})
    assert isinstance(extras.pieces["sched"], UserState) and extras.pieces["ema"] is ema
    with pytest.raises(loopkit.CheckpointError, match="ema refuses"):
        extras.check_state_dict({"sched": sched.state_dict(), "ema": "bad"})
    with pytest.raises(loopkit.CheckpointError, match=r"extra objects differ \(\['other'\]\)"):
        extras.check_state_dict({"sched": {}, "ema": 0, "other": 0})


class _Ema:
    """An exponential moving average of a model's weights: a piece of its own, via extra=."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.shadow = [p.detach().clone() for p in model.parameters()]

    def state_dict(self) -> list[torch.Tensor]:
        return self.shadow

    def check_state_dict(self, saved: Any) -> None:
        shapes = [tuple(t.shape) for t in saved]
        if shapes != [tuple(t.shape) for t in self.shadow]:
            raise loopkit.CheckpointError(f"the EMA's shapes differ: {shapes}")

    def snapshot(self) -> list[torch.Tensor]:
        return [t.clone() for t in self.shadow]

    def load_state_dict(self, saved: list[torch.Tensor]) -> None:
        self.shadow = [t.clone() for t in saved]

    def restore(self, snapshot: list[torch.Tensor]) -> None:
        self.shadow = snapshot


def test_a_new_piece_plugs_in_through_extra_and_is_checked_first(tmp_path: Path) -> None:
    """An EMA passed in extra= is saved and resumed; one that does not fit is refused untouched."""
    model = mlp()
    ema = _Ema(model)
    ema.shadow = [t + 1 for t in ema.shadow]
    loopkit.Checkpointer(tmp_path, model=model, extra={"ema": ema}).save()
    fresh = mlp(seed=1)
    fresh_ema = _Ema(fresh)
    assert loopkit.Checkpointer(tmp_path, model=fresh, extra={"ema": fresh_ema}).resume()
    assert_bit_equal(fresh_ema.shadow, ema.shadow)
    assert_bit_equal(params(fresh), params(model))
    other = mlp(seed=2)
    other_ema = _Ema(mlp(seed=2, width=16))
    before = list(other_ema.shadow)
    with pytest.raises(loopkit.CheckpointError, match="the EMA's shapes differ") as info:
        loopkit.Checkpointer(tmp_path, model=other, extra={"ema": other_ema}).resume()
    assert "ckpt-0000000001.pt" in str(info.value)
    assert other_ema.shadow == before
