"""DDP for real: two gloo processes under torchrun, two torchrun agents as two nodes."""

from __future__ import annotations

import math
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers import ROOT, deep, launch_env, mlp

import loopkit
from loopkit import distributed

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def _run(cmd: list[str], timeout: int = 240) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=launch_env()
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def results(dist_results: dict[str, list[dict[str, Any]]]) -> dict[str, list[dict[str, Any]]]:
    """Every scenario of dist_worker.py, run once by two processes (shared with tests/ema)."""
    return dist_results


def test_ranks_agree_on_the_smallest_micro_batch_and_it_trains_as_whole_batches(
    results: Any,
) -> None:
    """Rank 0 fits 32, rank 1 fits 16: both probe 16 (no hang: probing makes no all-reduce);
    DDP training in chunks of 3 ends within 1e-6 of the whole batches."""
    for rank in results["micro_batch_probe"]:
        assert rank["size"] == 16
        assert rank["max_diff"] < 1e-6


def test_a_step_on_a_model_not_wrapped_for_the_group_is_reported(results: Any) -> None:
    """Every rank warns for the plain model (naming the wrap line to add), none for DDP."""
    for rank in results["unwrapped_model"]:
        assert rank["wrapped"] == []
        (message,) = rank["plain"]
        assert "not wrapped for the process group (2 processes)" in message
        assert "dist_worker.py:" in message and "loopkit.distributed.wrap(model)" in message


def test_weighted_micro_batches_match_the_global_large_batch(results: Any) -> None:
    """Unequal sizes on each rank, weight= sizes: within 1e-6 of one process on all data."""
    for r in results["weighted_equivalence"]:
        assert r["updates"] == 2 and r["max_diff"] < 1e-6


def test_two_processes_match_one_on_the_same_global_batches(results: Any) -> None:
    """accumulate(every=4) on 2 ranks ends where one process on the global batches ends."""
    for r in results["unweighted_equivalence"]:
        assert r["max_diff"] < 1e-6


def test_no_sync_makes_one_all_reduce_per_update(results: Any) -> None:
    """Counted by a comm hook: 8 micro-steps, every=4 -> 2 all-reduces; without no_sync, 8."""
    for r in results["all_reduce_counts"]:
        assert r == {"with_loopkit": 2, "without": 8, "updates": 2}


def test_logging_is_one_collective_per_flush_with_all_rank_means(results: Any) -> None:
    """sync_ranks=True: three flushes, three collectives; means (max, sum) over both ranks."""
    rank0, rank1 = results["logging_collectives"]
    for r in (rank0, rank1):
        assert r["per_flush"] == 1.0 and len(r["kinds"]) == 1
    # Rank 0 logged i, rank 1 logged i + 100, for i in 0..9 in the first interval.
    assert rank0["flushed"][0] == {"loss": pytest.approx(54.5), "peak": 109.0, "n": 20.0}
    assert len(rank0["flushed"]) == 3 and rank1["flushed"] == []  # the sink runs on rank 0
    assert rank1["last"] == rank0["last"]


def test_logging_different_first_seen_order_is_not_a_mismatch(results: Any) -> None:
    """Same metrics first seen in another order per rank: right means, one collective."""
    rank0, rank1 = results["logging_first_seen_order"]
    assert rank0["per_flush"] == rank1["per_flush"] == [1, 1]
    # Rank 0's own first-seen order: spike (logged by both ranks once) before loss.
    assert rank0["flushed"] == [[("spike", 5.5), ("loss", 1.0)], [("loss", 3.0)]]
    assert rank1["flushed"] == []


def test_logging_metrics_on_some_ranks_are_reduced_over_those_ranks(results: Any) -> None:
    """One-rank metrics, unequal counts, int64 beyond float32, NaN on one rank: all exact."""
    rank0, rank1 = results["logging_uneven_metrics"]
    first, second = rank0["flushed"]
    assert first == [
        ("loss", 6.5),  # (0+1+2+3 + 10+11+12+13) / 8
        ("w", 2.5),  # weighted by counts: (1 + 2+3+4) / 4, not the mean of rank means (2.0)
        ("tokens", float(2**52 + 3)),
        ("final", 7.0),  # 'last' over the one rank that logged it
        ("gn", 3.0),  # rank 1's only: after rank 0's own names
    ]
    assert second[:2] == [("loss", 10.5), ("lr", 0.75)]
    assert [name for name, _ in second[2:]] == ["probe", "lo"]
    assert all(math.isnan(v) for _, v in second[2:])  # a NaN on either rank surfaces
    assert rank1["flushed"] == []
    assert rank1["last"][:2] == rank0["last"][:2]
    # Different metric sets: gather, name exchange, gather; the same sets: one gather.
    for r in (rank0, rank1):
        assert len(r["per_flush"][0]) == 3 and "all_gather_object" in r["per_flush"][0]
        assert len(r["per_flush"][1]) == 1


def test_logging_more_metrics_than_the_gather_holds(results: Any) -> None:
    """40 metrics (over the fixed capacity) are exchanged by name and reduced exactly."""
    rank0, rank1 = results["logging_many_metrics"]
    assert rank0["flushed"] == [{f"m{k:02d}": k + 5.5 for k in range(40)}]
    assert rank0["calls"] == rank1["calls"] == 3


def test_logging_conflicting_reductions_raise_on_every_rank(results: Any) -> None:
    """reduce= differing between ranks: the same clear error everywhere, values kept."""
    for r in results["logging_conflicting_reductions"]:
        assert r["error"] is not None and "same reduce= on every rank" in r["error"]
        assert r["kept"] == 1 and r["step"] == 1


def test_logging_resumes_each_ranks_unflushed_values(results: Any) -> None:
    """A state saved mid-interval holds every rank's values: each rank resumes its own, so
    the next flush is the uninterrupted one (rank 1 holding rank 0's value would differ)."""
    rank0, rank1 = results["logging_interval_resume"]
    assert rank0["True"]["whole"] == [{"x": 6.0}, {"x": 9.0}]  # means over both ranks
    assert rank0["True"]["resumed"] == [{"x": 9.0}] and rank1["True"]["resumed"] == []
    for rank, r in enumerate((rank0, rank1)):
        assert r["False"]["whole"] == [{"x": 10.0 * rank + 1}, {"x": 10.0 * rank + 4}]
        assert r["False"]["resumed"] == r["False"]["whole"][1:]


def test_logging_on_rank0_only_makes_no_collective(results: Any) -> None:
    """Default sync_ranks: rank-0-only logging is local, rank 1 trains on, nothing hangs."""
    rank0, rank1 = results["logging_rank0_only"]
    for r in (rank0, rank1):
        assert r["logging_calls"] == [] and r["replicas_equal"] and r["updates"] == 6

    def means(losses: list[float], k: int) -> list[Any]:
        """The mean of each run of k losses (what a local flush every k calls reports)."""
        return [
            pytest.approx(math.fsum(losses[i : i + k]) / k, rel=1e-12)
            for i in range(0, len(losses), k)
        ]

    assert [d["loss"] for d in rank0["got"]] == means(rank0["losses"], 2)
    assert rank1["got"] == []
    # sync_ranks=False: every rank's sink gets that rank's own values.
    for r in (rank0, rank1):
        assert [d["mine"] for d in r["mine"]] == means(r["losses"], 3)
    # The default with both ranks logging: own values, sink on rank 0 only.
    assert [d["both"] for d in rank0["both"]] == means(rank0["losses"], 3)
    assert rank1["both"] == [] and rank1["both_last"]["both"] == means(rank1["losses"], 3)[1]


def test_checkpointed_blocks_train_under_ddp(results: Any) -> None:
    """Checkpointed blocks (with dropout) under DDP: the same weights as plain blocks."""
    for r in results["checkpointed_blocks"]:
        assert r["checkpointed"] and r["max_diff"] == 0.0


def test_loader_gives_disjoint_shards_and_new_orders(results: Any) -> None:
    """Each epoch the ranks' indices are disjoint and cover the data; orders change."""
    rank0, rank1 = (r["epochs"] for r in results["loader_shards"])
    for e0, e1 in zip(rank0, rank1, strict=True):
        assert not set(e0) & set(e1)
        assert sorted(e0 + e1) == list(range(40))
    assert rank0[0] != rank0[1] != rank0[2] and rank1[0] != rank1[1]
    assert results["loader_shards"][0]["batch_size"] == 4  # global 8 over 2 ranks


def test_a_pass_one_rank_reads_outside_training_changes_no_rank(results: Any) -> None:
    """Rank 0 alone peeks and evaluates over the training loader each epoch: both ranks
    train 4 epochs (plain loops and iterate), each epoch every sample once, new orders."""
    rank0, rank1 = results["passes_outside_training"]
    for r in (rank0, rank1):
        assert r["epoch"] == 4 and r["updates"] == 4 * 5
    for e0, e1 in zip(rank0["trained"], rank1["trained"], strict=True):
        assert sorted(e0 + e1) == list(range(40))
    assert len({str(e) for e in rank0["trained"]}) == 4


def test_bad_global_batch_and_double_wrap_are_refused(results: Any) -> None:
    """A global batch the world size does not divide, and wrap() on DDP, raise clearly."""
    for r in results["bad_global_batch"]:
        assert "use a multiple of 2" in r["error"]
    for r in results["already_wrapped"]:
        assert "already wrapped" in r["error"]


def test_fsdp2_no_sync(results: Any) -> None:
    """FSDP2: gradient sync off on 3 of 4 micro-steps, result equal to the large batch."""
    for r in results["fsdp2_no_sync"]:
        if r["skipped"]:
            pytest.skip(r["skipped"])
        assert r["sync_flags"] == [False, False, False, True] * 2
        assert r["max_diff"] < 1e-6


def _final_weights(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)  # type: ignore[no-any-return]


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def single_process_weights(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    out = tmp_path_factory.mktemp("single") / "w.pt"
    _run([sys.executable, "examples/train_ddp.py", "--out", str(out)])
    return _final_weights(out)


@deep
def test_example_two_processes_match_single_process(
    tmp_path: Path, single_process_weights: dict[str, torch.Tensor]
) -> None:
    """examples/train_ddp.py under torchrun with 2 processes ends at the single-process weights."""
    out = tmp_path / "w.pt"
    proc = _run(
        [
            *TORCHRUN,
            "--standalone",
            "--nproc-per-node",
            "2",
            "examples/train_ddp.py",
            "--out",
            str(out),
        ]
    )
    assert "done on 2 process(es)" in proc.stdout
    assert _max_diff(_final_weights(out), single_process_weights) < 1e-6


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@deep
def test_two_nodes_by_c10d_rendezvous_match_single_process(
    tmp_path: Path, single_process_weights: dict[str, torch.Tensor]
) -> None:
    """Two torchrun agents (--nnodes 2, c10d on loopback) form one job with the same result."""
    out = tmp_path / "w.pt"
    port = _free_port()
    agents = []
    for node in range(2):
        # Node 0 hosts the rendezvous store, as the first machine of a real job would.
        cmd = [*TORCHRUN, "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-conf", f"is_host={int(node == 0)}",
               "--rdzv-id", "loopkit-test", "examples/train_ddp.py", "--out", str(out)]  # fmt: skip
        agents.append(
            subprocess.Popen(
                cmd,
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=launch_env(),
            )
        )
        time.sleep(1)
    try:
        outputs = [a.communicate(timeout=240) for a in agents]
    finally:
        for a in agents:
            a.kill()
    for agent, (stdout, stderr) in zip(agents, outputs, strict=True):
        assert agent.returncode == 0, stdout[-2000:] + stderr[-2000:]
    assert any("done on 2 process(es)" in o for o, _ in outputs)
    assert _max_diff(_final_weights(out), single_process_weights) < 1e-6


@pytest.mark.parametrize(
    "env",
    [
        {"RANK": "0"},
        {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"},
    ],
)
def test_half_set_launcher_environment_is_refused(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str]
) -> None:
    """Some launcher variables without the others: an error naming the missing ones."""
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(RuntimeError, match="half-set") as info:
        distributed.setup()
    assert "MASTER_PORT" in str(info.value) and "torchrun" in str(info.value)
    assert not dist.is_initialized()


def test_rank_beyond_world_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """RANK >= WORLD_SIZE is a launcher mistake, reported before any connection."""
    for k, v in {
        "RANK": "2",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500",
    }.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(RuntimeError, match="not below WORLD_SIZE"):
        distributed.setup()


def test_single_process_is_a_no_op(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a launcher: rank 0 of 1, wrap() returns the model, rank_zero_only runs."""
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    with distributed.setup() as info:
        assert (info.rank, info.world_size, info.is_rank_zero) == (0, 1, True)
        assert not dist.is_initialized()
        model = mlp()
        assert distributed.wrap(model) is model
        assert distributed.rank_zero_only(lambda: 5)() == 5


def test_single_process_loader_reshuffles_each_epoch_reproducibly() -> None:
    """Without DDP the loader still gets a new, seeded order every epoch."""
    dataset = torch.utils.data.TensorDataset(torch.arange(16))

    def orders(seed: int) -> list[list[int]]:
        loader = distributed.loader(dataset, batch_size=4, num_workers=0, seed=seed)
        return [[int(i) for (b,) in loader.training_pass() for i in b] for _ in range(2)]

    first = orders(5)
    assert first[0] != first[1] and sorted(first[0]) == list(range(16))
    assert orders(5) == first and orders(6) != first


def test_loader_defaults_follow_the_guides() -> None:
    """Workers from cores per process, pin_memory only with CUDA, persistent workers."""
    dataset = torch.utils.data.TensorDataset(torch.arange(16))
    loader = distributed.loader(dataset, batch_size=4)
    workers = distributed.default_num_workers(1)
    assert loader.loader.num_workers == workers
    assert loader.loader.pin_memory is torch.cuda.is_available()
    assert loader.loader.persistent_workers is (workers > 0)
    with pytest.raises(TypeError, match="exactly one"):
        distributed.loader(dataset)
    with pytest.raises(ValueError, match="int >= 1"):
        distributed.loader(dataset, batch_size=0)
    assert loopkit.distributed.is_rank_zero()


def test_a_sharded_model_checkpoints_resumes_and_refuses_as_one_process(
    dist_results: dict[str, Any],
) -> None:
    """FSDP2 on 2 ranks: checkpoints are directories of every rank's shards; a resumed run
    ends bit-identical (weights, EMA, scheduler); another model is refused before anything
    loads; a newest checkpoint missing a rank's shards names the older one, which resumes;
    ranks given directories of their own are refused before any shard is written."""
    for r in dist_results["sharded_checkpoint"]:
        assert r["same"] and r["updates"] == (8, 8) and r["lr_epochs"][0] == r["lr_epochs"][1]
        assert r["names"] == ["ckpt-0000000003", "ckpt-0000000006", "ckpt-0000000008"]
        assert r["refused"] is not None and "(16, 8)" in r["refused"] and r["unchanged"]
        assert r["damaged"] is not None and "unreadable" in r["damaged"]
        assert r["older"] in r["damaged"] and r["older_updates"] == 6
        assert r["exported"]  # export_weights gathers the final weights and EMA in one process
        # A directory per rank (not one they share): refused naming the fix, nothing left.
        assert r["blind"] is not None and "rank(s) [1] do not see" in r["blind"]
        assert "same directory on a filesystem they share" in r["blind"] and r["left"] == []


def test_an_hsdp_model_checkpoints_and_resumes_bit_identically(dist4_results: Any) -> None:
    """HSDP on a 2x2 mesh (replicate=2): a run stopped after its save at update 4 and resumed
    by fresh objects ends bit-identical (weights, EMA, lr, norms); export_weights gathers
    the final weights of every shard in one process."""
    for r in dist4_results["hsdp_checkpoint"]:
        assert r["mesh"] == ((2, 2), ("replicate", "shard"))
        whole, resumed = r["whole"], r["resumed"]
        assert resumed.resumed_from == "ckpt-0000000004" and resumed.updates == whole.updates
        assert all(torch.equal(a, b) for a, b in zip(whole.weights, resumed.weights, strict=True))
        assert all(torch.equal(a, b) for a, b in zip(whole.ema, resumed.ema, strict=True))
        assert resumed.lr == whole.lr and resumed.norms == whole.norms[4:]
    exported = dist4_results["hsdp_checkpoint"][0]["exported"]
    whole = dist4_results["hsdp_checkpoint"][0]["whole"]
    assert all(torch.equal(a, b) for a, b in zip(whole.weights, exported, strict=True))


@pytest.mark.parametrize("kind", ["hsdp", "fsdp2"])
def test_evaluate_under_fsdp2_and_hsdp_equals_one_process_bit_for_bit(
    dist4_results: Any, dist_results: Any, kind: str
) -> None:
    """13 samples over 4 HSDP ranks (padded to 16) or 2 FSDP2 ranks (padded to 14): every
    rank gets the sums one process computes with the same weights, bit for bit."""
    from torch import nn

    ranks = (dist4_results if kind == "hsdp" else dist_results)[f"{kind}_evaluate"]
    first = ranks[0]
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    model.load_state_dict(first["weights"])
    import elastic

    samples = elastic.Indexed(13)
    data = torch.utils.data.TensorDataset(samples.x, samples.y)

    def per_sample(m: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        x, y = batch
        return {"loss": torch.stack([nn.functional.mse_loss(m(x[i : i + 1]), y[i : i + 1])
                                     for i in range(len(x))])}  # fmt: skip

    one = loopkit.evaluate(model, torch.utils.data.DataLoader(data, batch_size=5), per_sample)
    for r in ranks:
        assert r["samples"] == 13 == one.samples
        assert r["sums"] == one.sums and r.get("unchanged", True)


def test_accumulation_under_hsdp_reduces_once_per_window(dist4_results: Any) -> None:
    """accumulate=4, 8 micro-steps, 2 shard groups: 4 reduce-scatters (and 4 all-reduces
    across the replicas), one per group per window; without accumulation 16 of each."""
    for r in dist4_results["hsdp_collectives"]:
        assert r[4] == {"reduce_scatter_single": 4, "all_reduce": 4, "updates": 2}
        assert r[1] == {"reduce_scatter_single": 16, "all_reduce": 16, "updates": 8}
