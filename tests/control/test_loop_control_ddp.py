"""until, early_stop and evaluate under DDP: one decision, one result, on every rank.

One torchrun launch (two gloo processes) runs every scenario of dist_loop_control_worker.py;
the SIGTERM sent from outside to one worker of a training run is in test_examples.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from dist_loop_control_worker import Centered, bn_model, eval_model, per_sample, seven_samples
from helpers import deep, launch_scenarios

import loopkit


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    """Every scenario of dist_loop_control_worker.py, run once by two processes."""
    out = tmp_path_factory.mktemp("loop_control")
    return launch_scenarios("tests/dist_loop_control_worker.py", out)


@deep
def test_evaluate_equals_one_process_bit_for_bit(results: Any) -> None:
    """7 samples, batch 2, 2 ranks (one padded duplicate): the one-process sums, exactly."""
    one = loopkit.evaluate(eval_model(), torch.utils.data.DataLoader(seven_samples(), batch_size=2),
                           per_sample)  # fmt: skip
    for r in results["evaluate_seven_samples_batch_two"]:
        for key in ("keyed", "shuffled"):
            sums, samples, means = r[key]
            assert samples == 7
            assert sums == one.sums  # float64 sums, bit for bit
            for name, mean in means.items():
                assert abs(mean - one[name]) <= 1e-12


def test_evaluate_makes_one_exchange_one_host_read_and_no_ddp_forward(results: Any) -> None:
    """One all_gather_object and nothing else; DDP's forward never ran; one read of the
    values, and the exchange's reads (its pickles) the same for 2 batches or 4 per rank.

    The one user read is the DataLoader's own (its base seed, drawn as iteration starts).
    """
    for r in results["evaluate_seven_samples_batch_two"]:
        assert r["collectives"] == {"all_gather_object": 1}
        assert r["ddp_forwards"] == 0
        assert r["expected_reads"]["evaluate's result"] == 1
        assert r["user_reads"] == {"Tensor.item": 1}
        assert r["reads_with_more_batches"] == (r["expected_reads"], {})


def test_evaluate_with_uneven_shards_and_buffers(results: Any) -> None:
    """3 batches on rank 0, 1 on rank 1: no hang, every sample counted, the same result."""
    a, b = results["evaluate_uneven_shards_with_buffers"]
    assert a["samples"] == b["samples"] == 16 and a["loss"] == b["loss"]


def test_an_error_on_one_rank_raises_on_every_rank(results: Any) -> None:
    """fn failing on rank 1: rank 1 raises its own error, rank 0 says which rank failed."""
    a, b = results["evaluate_error_on_one_rank"]
    assert b["error"] == "KeyError: 'missing label'"
    assert a["error"].startswith("RuntimeError: evaluate failed on rank 1: KeyError")


def test_early_stop_refuses_values_the_ranks_disagree_on(results: Any) -> None:
    """2.0 on rank 0, 3.0 on rank 1: ValueError on both, the record as before."""
    for r in results["early_stop_refuses_values_that_differ"]:
        assert "different values on the ranks (from 2.0 to 3.0)" in r["error"]
        assert r["observed"] == 1 and r["wait"] == 0


def test_skewed_clocks_stop_every_rank_at_the_same_update(results: Any) -> None:
    """The fast clock decides for both, at the first check past it (update 9), saved once."""
    a, b = results["until_with_clocks_skewed_per_rank"]
    assert a["reason"] == b["reason"] == "max_time"
    assert a["stopped_at"] == b["stopped_at"] == 9
    assert a["saved"] == b["saved"] == ["ckpt-0000000009.pt"]
    assert torch.equal(a["weights"], b["weights"])
    assert a["fired"] == b["fired"] == [3, 6, 9]


def test_a_signal_to_one_rank_stops_both_at_the_same_update(results: Any) -> None:
    """SIGTERM to rank 1 after update 3: both stop at update 4, one checkpoint, no hang."""
    a, b = results["until_signal_to_one_rank"]
    assert a["reason"] == b["reason"] == "SIGTERM"
    assert a["stopped_at"] == b["stopped_at"] == 4
    assert a["saved"] == ["ckpt-0000000004.pt"]
    assert torch.equal(a["weights"], b["weights"])


def test_evaluate_pools_the_metric_of_rank_zeros_model(results: Any) -> None:
    """BatchNorm statistics differ per rank (DDP broadcasting buffers or not, or no DDP):
    the pooled sums are one process's over rank 0's model, every rank keeps its own buffers."""
    data = torch.utils.data.DataLoader(seven_samples(), batch_size=2)
    a, b = results["evaluate_with_rank_zero_buffers"]
    for kind in ("ddp", "ddp_no_broadcast", "plain"):
        saved = bn_model()
        saved.load_state_dict(a[kind]["rank_zero_state"])
        one = loopkit.evaluate(saved, data, per_sample)
        assert a[kind]["sums"] == b[kind]["sums"] and a[kind]["samples"] == 7
        for name, total in one.sums.items():
            assert abs(a[kind]["sums"][name] - total) <= 1e-12 * max(1.0, abs(total)), kind
        assert a[kind]["buffers_kept"] and b[kind]["buffers_kept"] and b[kind]["training"]
        rank1 = {k: v for k, v in b[kind]["rank_zero_state"].items() if "running" in k}
        assert any(not torch.equal(v, a[kind]["rank_zero_state"][k]) for k, v in rank1.items())
        assert a[kind]["collectives"]["broadcast"] == 3  # BatchNorm's 3 buffers
        assert a[kind]["collectives"]["all_gather_object"] == 2  # buffer shapes, results


def test_evaluate_takes_rank_zeros_non_persistent_buffers_and_puts_each_ranks_back(
    results: Any,
) -> None:
    """Buffers with persistent=False differ per rank: the sums are one process's over rank 0's
    model (its non-persistent buffers too), and every rank keeps its own, bit for bit."""
    a, b = results["evaluate_with_rank_zero_non_persistent_buffers"]
    assert not torch.equal(a["buffers"]["center"], b["buffers"]["center"])  # trained apart
    assert a["buffers"]["seen"] == 3 and b["buffers"]["seen"] == 4
    saved = Centered()
    saved.load_state_dict(a["weights"])
    for name, value in a["buffers"].items():
        getattr(saved, name).copy_(value)  # not in the state_dict: set by hand
    one = loopkit.evaluate(saved, torch.utils.data.DataLoader(seven_samples(), batch_size=2),
                           per_sample)  # fmt: skip
    assert a["sums"] == b["sums"] and a["samples"] == b["samples"] == 7
    for name, total in one.sums.items():
        assert abs(a["sums"][name] - total) <= 1e-12 * max(1.0, abs(total)), name
    assert a["buffers_kept"] and b["buffers_kept"] and a["training"] and b["training"]
    assert a["collectives"] == {"all_gather_object": 2, "broadcast": 2}  # shapes, results


def test_a_stop_on_an_epochs_last_batch_resumes_exactly_on_every_rank(results: Any) -> None:
    """No step with loader=, or a step without loader=: both ranks stop at the same boundary;
    the newest checkpoint holds the epoch's code (with the loader, the stop's own, written at
    once before that code, comes first); resumed, both end at the uninterrupted weights."""
    for r in results["until_stop_on_an_epochs_last_batch"]:
        for kind in ("none", "step"):
            run = r[kind]
            first, second, whole = run["first"], run["second"], run["whole"]
            assert first["reason"] == "SIGTERM" and first["epochs"] == [0]
            assert first["stopped_at"] == (3 if kind == "none" else 2)
            assert len(first["saved"]) == (2 if kind == "none" else 1)
            assert run["saved_lr_epoch"] == 1
            assert second["epochs"] == [1] and second["reason"] == "max_epochs"
            assert torch.equal(whole["weights"], second["weights"]), kind
    a, b = results["until_stop_on_an_epochs_last_batch"]
    for kind in ("none", "step"):
        assert torch.equal(a[kind]["second"]["weights"], b[kind]["second"]["weights"])
