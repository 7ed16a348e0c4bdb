"""The benchmark scripts run from a clean install and report exact (not timed) quantities."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import ROOT, deep

pytestmark = deep  # LOOPKIT_DEEP=1 runs this file (tests/helpers.py: deep)


def test_checkpointing_benchmark_quick() -> None:
    """--quick --json runs and its exact columns order the settings as they must."""
    proc = subprocess.run(
        [sys.executable, "benchmarks/checkpointing.py", "--quick", "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    rows = {r["setting"]: r for r in json.loads(proc.stdout)}
    assert set(rows) == {"none", "full", "every=2", "save_matmuls"}
    assert rows["full"]["saved_ratio"] < rows["every=2"]["saved_ratio"] < 1
    assert rows["full"]["saved_ratio"] < rows["save_matmuls"]["saved_ratio"] < 1
    assert rows["full"]["peak_ratio"] < 1
    assert 1 < rows["full"]["flops_ratio"] <= 1.5
    assert rows["save_matmuls"]["flops_ratio"] < rows["full"]["flops_ratio"]


def _json(script: str, *args: str) -> list[dict[str, Any]]:
    proc = subprocess.run(
        [sys.executable, script, *args, "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return json.loads(proc.stdout)  # type: ignore[no-any-return]


def test_overhead_benchmark_quick_rows_and_parity(tmp_path: Path) -> None:
    """overhead.py --quick: parity held (else it exits non-zero: loopkit's runs bit-identical
    to the hand-written loop, its full stack to the same stack by hand), one row per
    contender, the full stack's per-piece microseconds."""
    rows = _json("benchmarks/overhead.py", "--quick", "--models", "tiny", "--clip")
    assert {(r["precision"], r["contender"]) for r in rows} == {
        (p, c)
        for p in ("fp32", "bf16")
        for c in (
            "hand-written",
            "loopkit pieces",
            "loopkit.step",
            "hand-written, clipped",
            "loopkit.step, clipped",
            "loopkit.step + doctor",
            "loopkit.step + until + cadence",
            "loopkit.step + iterate",
            "loopkit.step + iterate + log",
            "loopkit.step + iterate + log + CSV + progress",
            "loopkit.step + ema",
            "hand-written, full stack",
            "loopkit, full stack",
            "accelerate",
            "fabric",
        )
    }
    for r in rows:
        assert set(r) >= {"model", "precision", "contender", "us_per_step", "ratio"}
        # The goals' columns (measured, not bounded here): each on its own row.
        assert ("ratio_to_hand_clipped" in r) == (r["contender"] == "loopkit.step, clipped")
        assert ("log_us" in r) == (r["contender"] == "loopkit.step + iterate + log")
        # The goals' ratios from runs in turns of 200 micro-steps (paired()): blocks counted.
        paired = r["contender"] in ("loopkit.step", "loopkit.step, clipped", "loopkit, full stack")
        assert ("paired" in r) == paired
        if paired:
            assert r["paired"] > 0 and r["paired_blocks"] >= 3
        if "log_us" in r:
            assert r["log_us"] > 0
        # The whole stacks' logs, timed where they run, loopkit's beside the hand stack's.
        stacks = ("hand-written, full stack", "loopkit, full stack")
        assert ("stack_log_us" in r) == (r["contender"] in stacks)
        if "stack_log_us" in r:
            assert r["stack_log_us"] > 0
        if r["contender"] == "hand-written":
            assert r["ratio"] == 1.0
        if r["contender"].startswith("loopkit"):
            assert r["us_per_step"] > 0
        control = r["contender"] == "loopkit.step + until + cadence"
        assert ("ratio_to_step" in r) == control
        if control:  # the calls cost well under 1% of a micro-step (measured, not timed here)
            assert r["control_us"] > 0 and 0 < r["control_share"] < 1
        full = r["contender"] == "loopkit, full stack"  # parity with the hand stack held
        assert ("ratio_to_hand_full" in r) == full
        if full:
            assert set(r["pieces_us"]) == {
                "iterate", "log", "log's recording (timed inside)", "CSV + progress", "ema",
                "until + cadence (timed inside)"}  # fmt: skip
            assert r["pieces_us"]["log's recording (timed inside)"] > 0
    path = tmp_path / "rows.json"
    path.write_text(json.dumps(rows))
    png = tmp_path / "overhead.png"
    proc = subprocess.run(
        [sys.executable, "benchmarks/plot.py", str(path), str(png)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_speedups_benchmark_quick_counts() -> None:
    """speedups.py --quick: the exact columns (host syncs, all-reduces) are what they must be."""
    rows = {r["tip"]: r for r in _json("benchmarks/speedups.py", "--quick")}
    logging = rows["no .item() every step"]
    assert logging["baseline"].startswith("100 (") and logging["with_loopkit"].startswith("10 (")
    ddp = rows["no gradient sync while accumulating (DDP)"]
    # Two buckets per synchronized backward: 4 backward passes against 1.
    assert ddp["baseline"].startswith("8 (") and ddp["with_loopkit"].startswith("2 (")
    pinned = rows["pin_memory + non_blocking copies"]
    if not torch.cuda.is_available():
        assert pinned["result"] == "skipped: no GPU"


def test_data_seeding_benchmark_quick_rows() -> None:
    """data_seeding.py --quick: one row per worker count, with both rates and the reseed cost."""
    rows = _json("benchmarks/data_seeding.py", "--quick", "--workers", "0")
    assert [r["workers"] for r in rows] == [0]
    for r in rows:
        assert r["samples"] == 2048 and r["batch"] == 256
        assert r["plain_samples_per_s"] > 0 and r["loopkit_samples_per_s"] > 0
        assert r["seeding_us_per_batch"] > 0 and r["seeding_share_percent"] > 0


def test_preload_benchmark_quick(tmp_path: Path) -> None:
    """preload.py --quick: the three loaders, the memory rows, the cache built then opened;
    the batched cache outruns decoding per sample (the full run measures by how much); the
    raw gather of the same cache beside the loaders, with each run's ratio to it."""
    result: Any = _json("benchmarks/preload.py", "--quick", "--dir", str(tmp_path))
    rates = list(result["samples_per_s"].values())
    assert len(rates) == 3 and rates[2] > rates[0]
    assert set(result["pss_mib"]) == {"0", "2"}
    assert result["build_s"] > 0 and result["open_s"] < result["build_s"]
    floor = result["against_the_gather"]
    loaders = {"loader", "loader + collate_fn"}
    assert set(floor["samples_per_s"]) == {"gather"} | loaders
    assert set(floor["ratio"]) == set(floor["us_per_batch_above_gather"]) == loaders
    for name in loaders:
        runs = floor["ratio_runs"][name]
        assert len(runs) == len(floor["runs"]["gather"]) == 3 and all(r > 0 for r in runs)
        assert floor["ratio"][name] == pytest.approx(sorted(runs)[1])  # the median of 3


def test_first_use_benchmark_quick() -> None:
    """--quick --json: each contender's first update comes after its step was built, and
    loopkit's row is there (timings are printed, never asserted)."""
    rows = {r["contender"]: r for r in _json("benchmarks/first_use.py", "--quick")}
    assert {"plain", "loopkit"} <= set(rows)
    for r in rows.values():
        assert 0 < r["to_built_s"] <= r["to_first_update_s"]
    assert rows["plain"]["over_plain_s"] == 0


def test_accelerate_port_benchmark_quick_measures_what_the_guide_quotes() -> None:
    """accelerate_port.py --quick: the port's update equals the float64 big batch where
    Accelerate's is far off, its perplexity is exact, and a kill -9 mid-window resumes
    bit-identically (the timing is printed, never asserted)."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    measured = _json("benchmarks/accelerate_port.py", "--quick")
    rows = {r["measure"].split(",")[0]: r for r in measured}
    weights = rows["final weights vs float64 big batch"]
    assert weights["loopkit"] < 1e-4 < 1e-2 < weights["accelerate"]
    ppl = rows["perplexity vs exact"]
    assert ppl["documents"] == 37
    assert abs(ppl["loopkit"]) < 1e-6 < 1e-4 < abs(ppl["accelerate"])
    resumed = rows["kill -9 mid-window then resume"]
    assert resumed["loopkit"] == 1
    assert rows["time per micro-step (accelerate = 1)"]["loopkit"] > 0


def test_ema_cost_quick_counts_one_foreach_op_per_update() -> None:
    """ema_cost.py --quick: loopkit.ema dispatches 1 op per update on fp32 weights (2 on
    bf16, into an fp32 average) where the hand-written loop dispatches 3 per tensor."""
    rows = _json("benchmarks/ema_cost.py", "--quick")
    by = {(r["dtype"], r["contender"]): r for r in rows}
    for dtype, ops in (("float32", 1), ("bfloat16", 2)):
        mine, hand = by[(dtype, "loopkit.ema")], by[(dtype, "hand-written loop")]
        assert mine["ops_per_update"] == ops and mine["average_dtype"] == "float32"
        assert hand["ops_per_update"] == 3 * hand["tensors"]
        assert hand["average_dtype"] == by[(dtype, "AveragedModel")]["average_dtype"] == dtype
        assert by[(dtype, "loopkit.step(ema=) in training")]["update_us"] > 0


def test_save_stall_benchmark_quick_rows() -> None:
    """save_stall.py --quick: one row per mode; sync and async write the same bytes, as many
    saves; no saves writes nothing (the stalls themselves are reported, never asserted)."""
    rows = {r["mode"]: r for r in _json("benchmarks/save_stall.py", "--quick")}
    assert set(rows) == {"no saves", "sync", "async"}
    assert rows["no saves"]["saves"] == 0 and rows["no saves"]["checkpoint_mb"] == 0
    assert rows["sync"]["saves"] == rows["async"]["saves"] == 2
    assert rows["sync"]["checkpoint_mb"] == rows["async"]["checkpoint_mb"] > 0
    assert rows["sync"]["stall_vs_sync"] == 1.0


def test_compile_benchmark_quick_counts_graphs_breaks_and_recompiles() -> None:
    """compile.py --quick (dynamo's graphs, the eager backend): loopkit + compile makes no
    more graphs, breaks or recompiles than the hand loop around torch.compile (none of
    either); the hand-compiled optimizer step recompiles on its float lr,
    compile_optimizer=True does not (times are reported, never asserted)."""
    rows = {r["contender"]: r for r in _json("benchmarks/compile.py", "--quick")}
    hand, lk = rows["hand + compile"], rows["loopkit + compile"]
    assert hand["graph_breaks"] == lk["graph_breaks"] == 0
    assert lk["graphs"] <= hand["graphs"] and lk["recompiles"] <= hand["recompiles"]
    assert any("['lr']" in r for r in rows["hand + compiled optimizer"]["recompile_reasons"])
    assert not any("['lr']" in r for r in rows["loopkit + compile_optimizer"]["recompile_reasons"])
    assert rows["loopkit + compile"]["recompiles_while_timed"] == 0
    assert rows["loopkit + compile_optimizer"]["recompiles_while_timed"] == 0
    assert all(r["us_per_micro_step"] > 0 for r in rows.values())


def test_streaming_benchmark_quick_rows() -> None:
    """streaming.py --quick: each resume starts at the batch the saving run read next; replayed
    decodes the pass again up to the saved place where the stateful loader decodes at most two
    shards per worker wherever it saved; a shuffle buffer's saved state grows by at least its
    samples' bytes (decoded counts and bytes asserted, times only printed)."""
    pytest.importorskip("torchdata")
    result: Any = _json("benchmarks/streaming.py", "--quick")
    resume = result["resume"]
    assert {(r["workers"], r["position_percent"]) for r in resume} == {
        (w, p) for w in (0, 2) for p in (10, 50, 90)
    }
    for r in resume:
        assert r["same_next_batch"], r
        assert r["stateful_s"] > 0 and r["replayed_s"] > 0
        assert r["replayed_decoded"] >= 8 * r["position"]  # batches of 8, read again
        assert r["stateful_decoded"] <= 2 * r["shard_samples"] * max(r["workers"], 1)
        assert r["replayed_line"].startswith(f"read {r['position']} batches again")
        if r["position_percent"] == 90:
            assert r["replayed_decoded"] > 2 * r["stateful_decoded"]
    rows = {(r["sample"], r["workers"], r["buffer"]): r for r in result["shuffle_buffer"]}
    assert set(rows) == {("tensor", w, b) for w in (0, 2) for b in (0, 100, 1000)}
    for key, r in rows.items():
        assert r["us_per_batch"] > 0 and r["us_per_batch_iterate"] > 0
        assert r["buffered_bytes"] == 1024 * r["buffer"] * max(r["workers"], 1)
        assert r["state_growth_bytes"] >= r["buffered_bytes"], key


def test_meta_init_benchmark_quick_rows() -> None:
    """meta_init.py --quick: on 2 ranks the meta-built model's peak host memory per rank is
    below building it whole first, and its shards equal the whole-built ones."""
    rows = {r["variant"]: r for r in _json("benchmarks/meta_init.py", "--quick")}
    assert set(rows) == {"whole first", "meta"}
    assert rows["whole first"]["peak_mib_per_rank"] >= rows["whole first"]["model_mib"]
    assert rows["meta"]["ratio_to_whole_first"] < 0.85
    assert rows["meta"]["same_shards_as_whole_first"] is True


def test_host_bound_benchmark_quick_rows() -> None:
    """host_bound.py --quick: loopkit's runs bit-identical to the hand loop (else it exits
    non-zero), one row per contender against the limit (the hand loop on a CPU; a CUDA graph
    of the whole step on a GPU, whose trained loss is finite)."""
    rows = {r["contender"]: r for r in _json("benchmarks/host_bound.py", "--quick")}
    names = {"hand-written", "loopkit.step", "hand-written, clipped", "loopkit.step, clipped"}
    cuda = torch.cuda.is_available()
    assert set(rows) == names | ({"CUDA graph (the limit)"} if cuda else set())
    limit = "CUDA graph (the limit)" if cuda else "hand-written"
    assert all(r["limit"] == limit and r["us_per_step"] > 0 for r in rows.values())
    assert rows[limit]["ratio_to_limit"] == 1.0
    if cuda:
        assert torch.isfinite(torch.tensor(rows[limit]["last_loss"]))


def test_log_floor_benchmark_quick_rows() -> None:
    """log_floor.py --quick: every way of keeping the loss read the same means (else it exits
    non-zero) and each has its time per micro-step; one ``detach()`` alone costs something."""
    rows = {r["way"]: r for r in _json("benchmarks/log_floor.py", "--quick")}
    ways = {"one detach()", "one .data", "running sum", "detach + stack", ".data + stack",
            "loopkit log="}  # fmt: skip
    assert set(rows) == ways
    for r in rows.values():
        assert r["us_per_micro_step"] > 0 and len(r["rounds_us"]) == 2
