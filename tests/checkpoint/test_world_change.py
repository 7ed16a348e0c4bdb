"""Resume on another number of processes: the data continues where it stopped, every sample
once; the weights end within float rounding of the uninterrupted run; what cannot carry over
is refused before anything loads.

The runs are ``tests/elastic.py``'s (global batch 8, 48 samples, ``accumulate=2``, AdamW, a
scheduler, an EMA, clipping), run on 1 process here, on 2 ranks by ``dist_worker.py`` and on
4 (HSDP) by ``dist4_worker.py``.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import elastic
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DistributedSampler

import loopkit
from loopkit import _ranks
from loopkit._checkpoint import _rng
from loopkit._data._epoch_loader import resharded
from loopkit._data._seeding import KeyedBatches, SeededRandomSampler
from loopkit._logging._log_state import own_entry, spread
from loopkit._logging._reductions import reduce_local

EVERY_SAMPLE_ONCE = [list(range(elastic.SAMPLES))] * elastic.EPOCHS


def _close(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))


def _assert_continues(resumed: elastic.Run, stopped: elastic.Run, whole: elastic.Run) -> None:
    """``resumed`` (from the save at update 4 of ``stopped``) ends as ``whole`` within float
    rounding, having used the same samples in each update, so every sample once an epoch."""
    assert resumed.resumed_from is not None and resumed.resumed_from.startswith("ckpt-0000000004")
    assert resumed.updates == whole.updates == 6
    assert resumed.seen == whole.seen[4:]
    assert elastic.coverage(stopped.seen, resumed.seen, 4) == EVERY_SAMPLE_ONCE
    assert _close(resumed.weights, whole.weights) < 1e-6
    assert _close(resumed.ema, whole.ema) < 1e-6
    assert resumed.lr == whole.lr
    assert resumed.norms == pytest.approx(whole.norms[4:], rel=1e-6)


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_a_run_saved_by_two_ranks_resumes_on_one_process(
    dist_results: dict[str, Any], tmp_path: Path, kind: str
) -> None:
    """DDP and FSDP2 (its shards read into a plain model) on 2 ranks, stopped after the save
    at update 4, resumed by 1 process with reseed=True: the same samples per update as the
    uninterrupted 2-rank run, every sample once an epoch, its weights, EMA and lr within
    float rounding."""
    found = dist_results["world_change"][0]
    shutil.copytree(Path(found["root"]) / f"{kind}_cut", tmp_path / "cut")
    resumed = elastic.run(tmp_path / "cut", reseed=True)
    _assert_continues(resumed, found[f"{kind}_cut"], found[f"{kind}_whole"])


def test_a_run_saved_by_one_process_resumes_on_two_ranks(
    dist_results: dict[str, Any], tmp_path: Path
) -> None:
    """Grown: a 1-process checkpoint resumed by 2 DDP ranks, and by 2 FSDP2 ranks (each
    cutting its shards out of the one file), ends as the uninterrupted run."""
    stopped = elastic.run(tmp_path, stop=5)  # as the one the ranks resumed: its samples
    for found in dist_results["world_change"]:
        _assert_continues(found["grown"], stopped, found["ddp_whole"])
        _assert_continues(found["grown_fsdp"], stopped, found["ddp_whole"])


def _assert_resumed_alike(a: dict[str, Any], b: dict[str, Any]) -> None:
    """Two resumes of one checkpoint hold the same state, bit for bit."""
    assert a["from"] == b["from"] and a["from"].startswith("ckpt-0000000004")
    assert a["counts"] == b["counts"] and a["lr"] == b["lr"]
    for key in ("weights", "moments", "ema"):
        assert len(a[key]) == len(b[key]) > 0
        assert all(torch.equal(x, y) for x, y in zip(a[key], b[key], strict=True)), key


def test_a_resume_on_another_shape_holds_what_the_saving_shape_resumes(
    dist_results: dict[str, Any], dist4_results: dict[str, Any], tmp_path: Path
) -> None:
    """Right after the resume, before any update: the weights, AdamW's moments and steps, the
    EMA, the counts, the scheduler and the loader's place are those of a resume by the shape
    that saved, bit for bit: one file (1 process) into FSDP2 on 2 ranks and into HSDP 2x2;
    FSDP2's directory into one plain process; HSDP 2x2's into FSDP2 on 2 ranks; on 2 ranks,
    DDP's file into FSDP2 and FSDP2's directory into DDP."""
    elastic.run(tmp_path / "one", stop=5)  # the 1-process checkpoint the ranks resumed
    one = elastic.resumed(tmp_path / "one")
    assert one["counts"][0] == 4 and one["moments"]
    four = dist4_results["hsdp_resumed"][0]
    _assert_resumed_alike(four["grown"], one)
    for found in dist_results["world_change"]:
        _assert_resumed_alike(found["grown_fsdp_resumed"], one)
        _assert_resumed_alike(found["shrunk_resumed"], four["same"])
        _assert_resumed_alike(found["ddp_cut_as_fsdp_resumed"], found["ddp_cut_resumed"])
        _assert_resumed_alike(found["fsdp_cut_as_ddp_resumed"], found["fsdp_cut_resumed"])
    found = dist_results["world_change"][0]
    shutil.copytree(Path(found["root"]) / "fsdp_cut", tmp_path / "cut")
    _assert_resumed_alike(elastic.resumed(tmp_path / "cut", reseed=True),
                          found["fsdp_cut_resumed"])  # fmt: skip


def test_an_hsdp_run_on_four_ranks_resumes_as_fsdp2_on_two(
    dist_results: dict[str, Any], dist4_results: dict[str, Any]
) -> None:
    """Shrunk: the 2x2 HSDP checkpoint resharded by DCP onto 2 FSDP2 ranks ends as the
    uninterrupted HSDP run."""
    four = dist4_results["hsdp_checkpoint"][0]
    for found in dist_results["world_change"]:
        _assert_continues(found["shrunk"], four["cut"], four["whole"])


def test_clipping_under_fsdp2_and_hsdp_equals_the_unsharded_model(
    dist_results: dict[str, Any], dist4_results: dict[str, Any], tmp_path: Path
) -> None:
    """clip_grad_norm=0.05 clips every update: the norms and the weights of FSDP2 (2 ranks)
    and HSDP (2x2) equal one unsharded process's within float rounding."""
    one = elastic.run(tmp_path)
    assert min(one.norms) > 0.05  # every update clips
    for run in (dist_results["world_change"][0]["fsdp_whole"],
                dist4_results["hsdp_checkpoint"][0]["whole"]):  # fmt: skip
        assert run.norms == pytest.approx(one.norms, rel=1e-6)
        assert _close(run.weights, one.weights) < 1e-6


def test_another_number_of_processes_is_refused_unless_reseeded(
    dist_results: dict[str, Any], tmp_path: Path
) -> None:
    """Without reseed=True: CheckpointError naming the fix (both ways), nothing loaded; with
    another global batch: CheckpointError naming global_batch_size=8, nothing loaded."""
    for found in dist_results["world_change"]:
        assert found["refused"] is not None and found["refused_unchanged"]
        assert "written by 1 process(es), resumed by 2" in found["refused"]
        assert "ckpt.resume(reseed=True)" in found["refused"]
        assert found["other_batch"] is not None and found["other_batch_unchanged"]
        assert "global_batch_size=8" in found["other_batch"]
    shutil.copytree(Path(found["root"]) / "ddp_cut", tmp_path / "cut")
    parts = elastic.build(tmp_path / "cut")
    before = [p.detach().clone() for p in parts.model.parameters()]
    rng = torch.get_rng_state()
    with pytest.raises(loopkit.CheckpointError, match=r"written by 2 process\(es\), resumed by 1"):
        parts.ckpt.resume()
    assert all(torch.equal(a, p) for a, p in zip(before, parts.model.parameters(), strict=True))
    assert torch.equal(rng, torch.get_rng_state()) and parts.loader.position == 0
    with pytest.raises(TypeError, match="reseed must be True or False"):
        parts.ckpt.resume(reseed=1)  # type: ignore[arg-type]


def test_reseeded_streams_are_deterministic_and_differ_per_rank() -> None:
    """The same checkpoint on the same number of processes gives the same streams; no two
    ranks share one; another number of processes gives others."""
    saved = [_rng.capture(), _rng.capture()]
    three = _rng.reseeded(saved, 3)
    again = _rng.reseeded(saved, 3)
    draws = []
    for state in three:
        _rng.put_back(state)
        draws.append(torch.rand(4))
    for a, b in zip(three, again, strict=True):
        assert torch.equal(a["torch"], b["torch"]) and a["python"] == b["python"]
    assert len({tuple(d.tolist()) for d in draws}) == 3
    assert not torch.equal(_rng.reseeded(saved, 2)[0]["torch"], three[0]["torch"])


# -- the loader's place on another number of processes: a pure function of the samplers ----


def _global_batches(n: int, g: int, world: int, drop_last: bool, seed: int, epoch: int,
                    shuffle: bool) -> list[list[int]]:  # fmt: skip
    """Batch i of every rank together, as loopkit's loader deals them (sorted samples)."""
    per_rank = []
    for rank in range(world):
        base: Any
        if world > 1:
            base = DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=shuffle,
                                      seed=seed, drop_last=drop_last)  # fmt: skip
        else:
            base = SeededRandomSampler(n, seed) if shuffle else None
        batches = KeyedBatches(base, n, g // world, drop_last, seed, rank, shuffle=shuffle,
                               world_size=world)  # fmt: skip
        batches.set_epoch(epoch)
        per_rank.append([list(b) for b in batches])
    return [sorted(i for r in per_rank for i in r[k]) for k in range(len(per_rank[0]))]


def _state(n: int, g: int, world: int, drop_last: bool, position: int) -> dict[str, Any]:
    batches = KeyedBatches(None, n, g // world, drop_last, 0, 0, world_size=world)
    samples = (n // world if drop_last else -(-n // world)) if world > 1 else n
    batches.base = range(samples)  # type: ignore[assignment]  # only its length is read
    return {"world_size": world, "batch_size": g // world, "samples": samples,
            "batches": len(batches), "drop_last": drop_last, "position": position}  # fmt: skip


@settings(max_examples=150, deadline=None, derandomize=True)
@given(
    n=st.integers(1, 40),
    g=st.sampled_from([2, 4, 6, 8, 12]),
    worlds=st.tuples(st.sampled_from([1, 2, 3, 4, 6]), st.sampled_from([1, 2, 3, 4, 6])),
    drop_last=st.booleans(),
    shuffle=st.booleans(),
    seed=st.integers(0, 5),
)
def test_the_loader_resumes_on_another_world_only_where_the_rest_is_the_same_samples(
    n: int, g: int, worlds: tuple[int, int], drop_last: bool, shuffle: bool, seed: int
) -> None:
    """resharded() accepts a state saved on N processes for M (the same global batch) exactly
    when the global batches of the pass, and of the next, are the same samples on M as on N:
    then a resumed position, in batches, is the same place in the pass."""
    saved_world, world = worlds
    if g % saved_world or g % world:
        return
    here = KeyedBatches(None, n, g // world, drop_last, seed, 0, world_size=world)
    here.base = range(_state(n, g, world, drop_last, 0)["samples"])  # type: ignore[assignment]
    state = _state(n, g, saved_world, drop_last, 0)
    same = all(
        _global_batches(n, g, saved_world, drop_last, seed, epoch, shuffle)
        == _global_batches(n, g, world, drop_last, seed, epoch, shuffle)
        for epoch in (0, 1)
    )
    try:
        resharded(state, here, len(here))
        accepted = True
    except ValueError as err:
        accepted = False
        assert "drop_last=True" in str(err), err
    assert accepted == same, (n, g, worlds, drop_last)


def test_another_global_batch_or_drop_last_is_refused_naming_the_fix() -> None:
    """A global batch of 8 saved on 2 processes, resumed with 4 on 1: the message names
    global_batch_size=8; with other drop_last: names drop_last."""
    here = KeyedBatches(None, 16, 4, False, 0, 0, world_size=1)
    with pytest.raises(ValueError, match=r"global_batch_size=8"):
        resharded(_state(16, 8, 2, False, 1), here, len(here))
    here = KeyedBatches(None, 16, 8, True, 0, 0, world_size=1)
    with pytest.raises(ValueError, match="drop_last=False"):
        resharded(_state(16, 8, 2, False, 1), here, len(here))


# -- the log's unflushed values on another number of processes ------------------------------


def test_the_unflushed_values_of_other_ranks_flush_as_the_uninterrupted_run_would() -> None:
    """sync_ranks=True, 3 ranks saved 2 calls each, resumed by 1 and by 2 ranks: a mean takes
    each call's mean across the old ranks on every new rank (each call weighs alike), a sum
    and a max every value on rank 0 alone; sync_ranks=False is refused naming the fix."""
    ranks = [{"calls": 5, "since_flush": 2,
              "pending": {"loss": [float(r), 10.0 + r], "n": [1.0, 1.0], "peak": [r, 5.0]}}
             for r in range(3)]  # fmt: skip
    how = {"loss": "mean", "n": "sum", "peak": "max"}.get
    by_rank = [spread([r["pending"] for r in ranks], rank, how) for rank in range(2)]
    assert by_rank[0] == {"loss": [1.0, 11.0], "n": [1.0] * 6, "peak": [0, 5.0, 1, 5.0, 2, 5.0]}
    assert by_rank[1] == {"loss": [1.0, 11.0]}
    # The next flush over 2 ranks, each logging one more value: the 3-rank run's mean.
    new = [[20.0, 22.0], [21.0, 21.0, 21.0]]  # the uninterrupted 3 ranks' last call: mean 21
    pooled = [*by_rank[0]["loss"], *by_rank[1]["loss"], *new[0]]
    assert sum(pooled) / len(pooled) == pytest.approx((0 + 1 + 2 + 10 + 11 + 12 + 63) / 9)
    state = {"calls": 5, "ranks": ranks}
    entry = own_entry(state, True, how)  # this process: rank 0 of 1
    assert entry["pending"]["n"] == [1.0] * 6 and entry["since_flush"] == 2
    with pytest.raises(ValueError, match="sync_ranks=True"):
        own_entry(state, False)
    uneven = [{"loss": [1.0]}, {"loss": [2.0, 3.0]}]  # not once a call: all on rank 0
    assert spread(uneven, 0, how) == {"loss": [1.0, 2.0, 3.0]} and spread(uneven, 1, how) == {}


def test_one_process_unflushed_values_are_spread_over_the_new_ranks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A 1-process log state (no 'ranks' entry), sync_ranks=True, given to 2 ranks: spread as
    one old rank's, so the next cross-rank flush pools the 1-process interval once (a sum is
    not counted once per rank); sync_ranks=False is refused growing and shrinking, before
    anything loads; sync_ranks=None gives rank zero (whose sinks alone log) the state."""

    def made(sync_ranks: bool | None) -> loopkit.detach_logging:
        return loopkit.detach_logging(every=4, sink=[], reduce={"n": "sum"}, sync_ranks=sync_ranks)

    one = made(True)
    for loss in (0.5, 0.75):  # two calls of a global batch of 8 in one process
        one(n=8.0, loss=torch.tensor(loss))
    state = one.state_dict()
    assert "ranks" not in state
    logs = []
    for rank in (0, 1):
        monkeypatch.setattr(_ranks, "world", lambda r=rank: (r, 2))
        log = made(True)
        log.load_state_dict(state)
        assert log.step == 2 and log._calls_since_flush == 2
        log(n=4.0, loss=torch.tensor(1.0))  # a third call, each rank with half of the batch
        logs.append(log)
    assert logs[0]._values["n"] == [8.0, 8.0, 4.0] and logs[1]._values["n"] == [4.0]
    pooled = {k: logs[0]._values[k] + logs[1]._values[k] for k in ("n", "loss")}
    flushed = reduce_local(pooled, {"n": "sum", "loss": "mean"}.__getitem__)
    # As the uninterrupted 2-rank run's: 3 calls of 4 samples on each rank; each call's loss.
    assert flushed["n"] == 24.0 and flushed["loss"] == pytest.approx((0.5 + 0.75 + 1.0) / 3)
    for rank in (0, 1):
        monkeypatch.setattr(_ranks, "world", lambda r=rank: (r, 2))
        assert own_entry(state, None)["pending"]["n"] == [8.0, 8.0]
        log = made(False)
        with pytest.raises(loopkit.CheckpointError, match=r"values of 1 process.*has 2 ranks"):
            log.check_state_dict(state)
        assert log.step == 0 and not log._values
    two = {**state, "ranks": [own_entry(state), own_entry(state)]}
    monkeypatch.setattr(_ranks, "world", lambda: (0, 1))
    with pytest.raises(loopkit.CheckpointError, match=r"values of 2 ranks.*has 1 process"):
        made(False).check_state_dict(two)
