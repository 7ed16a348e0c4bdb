"""A streamed data set resumed exactly on 2 ranks, stopped by ``until`` and killed at random.

``examples/train_streaming.py`` trains on HF ``datasets`` in streaming mode over JSON-lines
shards, split by node, read by torchdata's ``StatefulDataLoader`` (``Checkpointer(loader=)``),
with 0 and with 2 loader workers, and once through a ``loopkit.shuffle_buffer`` with random
augmentation. Each run is stopped by ``until`` part-way, then run on and SIGKILLed at random
moments (2 kills per configuration in CI, 6 with LOOPKIT_DEEP=1) and run again. Every rank's
record of the samples each update trained on, cut where the next run resumed, is the
uninterrupted run's, sample for sample; the final weights are bit-identical.
"""

from __future__ import annotations

import ast
import importlib.util
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import DEEP, ROOT, deep, kill_tree, launch_env

pytestmark = deep  # LOOPKIT_DEEP=1 runs this file (tests/helpers.py: deep)

# The runs are subprocesses: this module needs the extras installed, not imported (importing
# datasets here cost each test worker's collection about 5 s).
if importlib.util.find_spec("datasets") is None or importlib.util.find_spec("torchdata") is None:
    pytest.skip("the streaming extra is not installed", allow_module_level=True)

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
KILLS = 6 if DEEP else 2
UPDATES = 30
# CI: no workers, and 2 workers through a shuffle buffer; LOOPKIT_DEEP=1 adds 2 plain workers.
CONFIGS = [(0, 0), (2, 16), *([(2, 0)] if DEEP else [])]


def _command(tmp: Path, name: str, extra: list[str], updates: int = UPDATES) -> list[str]:
    paths = ["--dir", str(tmp / name), "--data", str(tmp / "data"), "--trace",
             str(tmp / f"{name}.trace"), "--out", str(tmp / f"{name}.pt")]  # fmt: skip
    rest = ["--updates", str(updates), "--save-every", "2", *extra]
    return [*TORCHRUN, "examples/train_streaming.py", *paths, *rest]


def _run(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, cwd=ROOT, env=launch_env(), capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def _consumed(path: Path) -> list[str]:
    """The micro-steps a run trained on, each run's record cut where the next one resumed."""
    runs: list[tuple[int, list[str]]] = []
    for line in _lines(path):
        if line.startswith("start "):
            runs.append((int(line.split()[1]), []))
        else:
            runs[-1][1].append(line)
    kept: list[str] = []
    for i, (_, lines) in enumerate(runs):
        until = runs[i + 1][0] if i + 1 < len(runs) else None
        kept += [ln for ln in lines if until is None or int(ln.split()[0]) < until]
    return kept


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shards every configuration reads (written once)."""
    tmp = tmp_path_factory.mktemp("stream")
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import train_streaming
    finally:
        sys.path.pop(0)
    train_streaming.write_shards(tmp / "data")
    return tmp


@pytest.mark.parametrize(("workers", "buffer"), CONFIGS, ids=lambda v: str(v))
def test_stream_resumed_exactly_after_stops_and_kills(
    data: Path, workers: int, buffer: int
) -> None:
    """Every sample once, in the uninterrupted order, on each rank; weights bit for bit."""
    tmp = data
    extra = ["--workers", str(workers), "--buffer", str(buffer)]
    name = f"w{workers}b{buffer}"
    _run(_command(tmp, f"{name}-ref", extra))
    _run(_command(tmp, name, extra, updates=7))  # stopped by until, then resumed below
    rng = random.Random(f"{name}")
    trace = tmp / f"{name}.trace.rank0"
    kills = 0
    while kills < KILLS:
        cmd = _command(tmp, name, extra)
        proc = subprocess.Popen(cmd, cwd=ROOT, env=launch_env(), stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)  # fmt: skip
        seen = len(_lines(trace))
        target = seen + rng.randint(2, 10)  # micro-steps into this run, then SIGKILL
        while proc.poll() is None and len(_lines(trace)) < target:
            time.sleep(0.01)
        if proc.poll() is not None:
            break  # it finished before the kill: fewer kills, the check still holds
        time.sleep(rng.random() * 0.3)  # anywhere: mid-window, mid-save, in the loader
        kill_tree(proc.pid)
        proc.wait()
        kills += 1
    _run(_command(tmp, name, extra))
    assert kills >= min(KILLS, 2), f"only {kills} kills landed before the run ended"
    for rank in range(2):
        ref = _lines(tmp / f"{name}-ref.trace.rank{rank}")[1:]
        got = _consumed(tmp / f"{name}.trace.rank{rank}")
        assert len(ref) == 2 * UPDATES  # accumulate=2: two micro-steps per update
        assert got == ref, f"rank {rank}: the resumed runs trained on other samples"
    ref_w = torch.load(tmp / f"{name}-ref.pt", weights_only=True)
    got_w = torch.load(tmp / f"{name}.pt", weights_only=True)
    assert ref_w.keys() == got_w.keys()
    for k in ref_w:
        assert torch.equal(ref_w[k], got_w[k]), k


def _segments(path: Path) -> list[list[int]]:
    """Each run's sample ids, in the order it trained on them."""
    runs: list[list[int]] = []
    for line in _lines(path):
        if line.startswith("start "):
            runs.append([])
        else:
            runs[-1] += ast.literal_eval(line.split(" ", 1)[1])
    return runs


def test_a_stream_saved_by_two_ranks_resumes_on_one_with_every_sample_once(data: Path) -> None:
    """stream_shards saved by 2 ranks (2 workers each) after 7 updates, resumed by 1 process
    with reseed=True: what was left of the epoch is read, every sample of it once, then the
    next epoch whole. A stream split by HF's split_dataset_by_node is refused instead."""
    tmp = data
    two = [*_command(tmp, "resplit", ["--source", "shards", "--workers", "2"], updates=7)]
    _run(two)
    one = [sys.executable, *two[two.index("examples/train_streaming.py") :]]
    one[one.index("--updates") + 1] = "60"
    _run([*one, "--reseed", "--workers", "1"])
    before = [i for r in range(2) for i in _segments(tmp / f"resplit.trace.rank{r}")[0]]
    after = _segments(tmp / "resplit.trace.rank0")[1]
    samples = 512  # 8 shards of 64
    left = samples - len(before)
    assert len(before) == 7 * 2 * 2 * 4  # updates x ranks x micro-steps x batch
    assert sorted(before + after[:left]) == list(range(samples))
    assert sorted(after[left : left + 64]) != sorted(before[:64])  # the next epoch began
    hf = _command(tmp, "refused", ["--workers", "0"], updates=3)
    _run(hf)
    single = [sys.executable, *hf[hf.index("examples/train_streaming.py") :], "--reseed"]
    proc = subprocess.run(single, cwd=ROOT, env=launch_env(), capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert proc.returncode != 0
    assert "cannot split its data among another number of processes" in proc.stderr
