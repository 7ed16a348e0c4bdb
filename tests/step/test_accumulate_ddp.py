"""accumulate under DDP and FSDP2 at the edges: every rank takes the same decision, exactly.

One torchrun launch (two gloo processes) runs every scenario of dist_edges_worker.py.
"""

from __future__ import annotations

from typing import Any

import pytest
from helpers import deep, launch_scenarios


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    """Every scenario of dist_edges_worker.py, run once by two processes."""
    return launch_scenarios("tests/dist_edges_worker.py", tmp_path_factory.mktemp("edges"))


@deep
def test_a_non_finite_loss_on_one_rank_skips_the_update_on_every_rank(results: Any) -> None:
    """skip_nonfinite (fp32 and fp16): rank 1's inf loss skips window 2 on both ranks."""
    for r in results["skip_nonfinite_on_one_rank"]:
        assert r["fp32"]["counts"] == (2, 1) and r["fp32"]["same"] and r["fp32"]["diff"] < 1e-6
        assert r["fp16"]["counts"] == (2, 1) and r["fp16"]["same"] and r["fp16"]["diff"] < 1e-2


def test_ddp_training_goes_on_after_a_flush_with_unused_parameters(results: Any) -> None:
    """DDP's reducer forgets the no_sync steps' used parameters: the next windows are exact."""
    for r in results["ddp_flush_with_unused_parameters_then_train_on"]:
        assert r["updates"] == 2 and r["same"] and r["diff"] < 1e-6


def test_ddp_flush_with_a_rank_that_made_no_backward(results: Any) -> None:
    """Both ranks join the by-hand all-reduce and normalize by the micro-steps made anywhere."""
    for r in results["ddp_flush_with_a_rank_without_backward"]:
        assert r["updates"] == 1 and r["same"] and r["diff"] < 1e-6


def test_fsdp2_iterate_after_a_refused_flush_trains_on(results: Any) -> None:
    """FSDP2: the refused window is closed by the next iterate's first micro-step, exactly."""
    for r in results["fsdp2_iterate_after_a_refused_flush"]:
        assert r["refused"] and r["updates"] == 2 and r["diff"] < 1e-5


def test_fsdp2_weights_are_summed_over_ranks(results: Any) -> None:
    """FSDP2 + weight= with unequal sizes and a ragged tail equals the global large batch."""
    for r in results["fsdp2_weighted"]:
        assert r["updates"] == 3 and r["diff"] < 1e-5


def test_fsdp2_flush_of_an_unsynced_window_changes_nothing(results: Any) -> None:
    """FSDP2 flush() after a no_sync micro-step raises, keeps the window; the next one closes it."""
    for r in results["fsdp2_flush_is_refused_and_keeps_the_window"]:
        assert "cannot reduce its gradients afterwards" in r["error"] and r["unchanged"]
        assert r["updates"] == 1 and r["diff"] < 1e-5


def test_ddp_flush_aligns_gradients_by_parameter(results: Any) -> None:
    """find_unused_parameters with rank-dependent branches: equal replicas, DDP's average."""
    for r in results["ddp_flush_with_unused_parameters"]:
        assert r["updates"] == 1 and r["same"] and r["diff"] < 1e-6
        assert not r["never_moved"]  # unused on every rank: grad stays None, no weight decay


def test_ddp_window_ending_without_backward_is_synced(results: Any) -> None:
    """A final micro-step with no backward: the local gradients are all-reduced, aligned."""
    for r in results["ddp_last_micro_step_without_backward"]:
        assert r["updates"] == 1 and r["same"] and r["diff"] < 1e-6


def test_fsdp2_fp16_skip_decision_is_agreed(results: Any) -> None:
    """fp16 under FSDP2: an inf in one rank's shard skips the update on both, scales agree."""
    for r in results["fsdp2_fp16_overflow_in_one_shard"]:
        assert r["counts"] == (2, 1) and r["kept"] and r["scales_agree"] and r["same"]


def test_sharded_inf_flags_are_agreed_before_the_skip_decision(results: Any) -> None:
    """FSDP1's per-shard inf flag: after agree_found_inf both ranks see rank 1's inf and skip."""
    rank0, rank1 = results["found_inf_agreement"]
    assert (rank0["local"], rank1["local"]) == (0.0, 1.0)
    assert rank0["agreed"] == rank1["agreed"] == 1.0
    assert rank0["stepped"] is rank1["stepped"] is False


def test_a_ddp_gan_makes_one_all_reduce_per_model_per_window(results: Any) -> None:
    """Comm hooks: each model one bucket all-reduce per window (D's two backward passes
    included), none of D during G's step, D's gradients untouched by G's backward, and the
    weights of one process on the global batches."""
    for r in results["gan_one_all_reduce_per_model_per_window"]:
        assert r["updates"] == (3, 3)
        # (D's all-reduces, G's) after each batch: one each per window of two batches.
        assert r["per_batch"] == [(0, 0), (1, 1), (1, 1), (2, 2), (2, 2), (3, 3)]
        assert r["d_calls_in_g"] == 0 and r["d_grad_kept"]
        assert r["same"] and r["diff"] < 1e-6


def test_a_gan_in_micro_batches_matches_whole_global_batches(results: Any) -> None:
    """micro_batch= in a DDP GAN (each member splits the batch, all of D's chunks first): the
    weights of one process on whole global batches, one all-reduce per model per window."""
    for r in results["gan_in_micro_batches"]:
        assert r["updates"] == (3, 3) and r["calls"] == (3, 3)
        assert r["same"] and r["diff"] < 1e-6


def test_a_forward_outside_a_no_sync_micro_step_is_refused(results: Any) -> None:
    """DDP would all-reduce a backward whose forward ran with sync on: refused, said how."""
    for r in results["forward_outside_a_non_final_micro_step_is_refused"]:
        assert "loopkit.steps(...).iterate(loader)" in r["error"]


def test_the_by_hand_all_reduce_equals_ddps_own_for_every_comm_hook(results: Any) -> None:
    """No hook, Python hooks, built-in C++ hooks and PowerSGD: DDP's synced gradients, bitwise."""
    for r in results["by_hand_sync_equals_ddps_own_for_every_comm_hook"]:
        assert set(r) == {"none", "allreduce_hook", "fp16_compress_hook", "bf16_compress_hook",
                          "builtin:ALLREDUCE", "builtin:FP16_COMPRESS", "powerSGD"}  # fmt: skip
        assert all(d == [0.0, 0.0, 0.0] for d in r.values()), r


def test_a_synced_micro_step_that_backs_up_twice_is_reduced_exactly(results: Any) -> None:
    """One forward and two backward passes, or two forwards, on a window-ending micro-step:
    identical replicas equal to the large batch; one extra all-reduce round, once."""
    for r in results["several_backward_passes_on_a_synced_micro_step"]:
        for name, got in r.items():
            assert got["same"], name
            assert got["diff"] < (1e-3 if "fp16" in name else 1e-6), (name, got["diff"])
        # Bucket all-reduces counted after each window: DDP's own round(s) in the window
        # where the second backward is first seen, plus its by-hand round; one per window
        # after it (each later window reduced once, by hand).
        calls = {name: got["calls"] for name, got in r.items()}
        assert calls["accumulate 1, one forward two backward passes"] == [2, 3, 4]
        assert calls["accumulate 2, first seen on a window's last micro-step"] == [1, 3, 4]
        assert calls["accumulate 3, ragged, two forwards on the first window's end"] == [3, 4, 5]
        assert calls["accumulate 1, rank-dependent branches"] == [2, 3, 4]
        assert calls["accumulate 3, weighted, ragged, first seen on the last micro-step"] == [2, 3]


def test_a_group_member_skipping_a_windows_last_batch_under_ddp(results: Any) -> None:
    """until() and cadence() see every window's end on both ranks, which stay identical."""
    for r in results["group_member_skipping_the_last_batch_under_ddp"]:
        assert r["updates"] == (2, 2, 2) and r["fired"] == [1, 2]
        assert r["same"] and r["diff"] < 1e-6


def test_a_ddp_gan_whose_generator_backs_up_twice_trains_as_one_process(results: Any) -> None:
    """G(noise) inside D's step, G's adversarial and L1 losses: accumulate 1, 2 and 3 (ragged)."""
    for r in results["gan_whose_generator_backs_up_twice"]:
        assert {k: v["updates"] for k, v in r.items()} == {1: (5, 5), 2: (3, 3), 3: (2, 2)}
        assert all(v["same"] and v["diff"] < 1e-6 for v in r.values()), r


def test_gradients_cleared_as_a_by_hand_window_opens_do_not_refuse_it(results: Any) -> None:
    """A stray backward before a window later reduced by hand is dropped, not an error."""
    for r in results["gradients_cleared_as_a_window_opens_are_not_its_own"]:
        assert r["updates"] == 1 and r["same"] and r["diff"] < 1e-6


def test_windows_reduced_by_hand_still_take_rank_zeros_buffers(results: Any) -> None:
    """BatchNorm running statistics as with DDP's own reduction, on both ranks."""
    for r in results["buffers_follow_rank_zero_when_windows_are_reduced_by_hand"]:
        assert r["diff"] < 1e-6
