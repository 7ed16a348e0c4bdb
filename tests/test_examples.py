"""The examples train for real: the loss falls in every precision."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import ROOT, deep


@deep
@pytest.mark.parametrize("precision", ["bf16", "fp16", "fp32"])
def test_quickstart_loss_goes_down(precision: str) -> None:
    """examples/quickstart.py ends with a clearly lower loss than it started with (in CI, the
    README's example command checks the same of its fp32 run: tests/test_readme.py)."""
    proc = subprocess.run(
        [sys.executable, "examples/quickstart.py", "--precision", precision, "--steps", "200"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    m = re.search(r"loss went from ([\d.]+) to ([\d.]+)", proc.stdout)
    assert m, proc.stdout
    first, last = float(m.group(1)), float(m.group(2))
    assert last < 0.85 * first, proc.stdout


@deep
def test_gan_example_one_process_and_two_end_alike(tmp_path: Path) -> None:
    """examples/train_gan.py (fp32): under torchrun with 2 processes, the 1-process weights."""
    from helpers import launch_env

    one, two = tmp_path / "one.pt", tmp_path / "two.pt"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", "2"]  # fmt: skip
    for cmd, out in (([sys.executable], one), (torchrun, two)):
        proc = subprocess.run(
            [*cmd, "examples/train_gan.py", "--precision", "fp32", "--out", str(out)],
            cwd=ROOT, capture_output=True, text=True, timeout=300, env=launch_env(),
        )  # fmt: skip
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        assert "D 24 updates, G 24 updates" in proc.stdout
    a, b = torch.load(one, weights_only=True), torch.load(two, weights_only=True)
    assert a.keys() == b.keys() and max((a[k] - b[k]).abs().max().item() for k in a) < 1e-6


@deep
def test_preloaded_example_builds_once_then_opens_and_learns(tmp_path: Path) -> None:
    """examples/train_preloaded.py: the first run builds the cache, the second opens it;
    one epoch over the batched cache (with batch-level flips) learns the task."""
    for word in ("built", "opened"):
        proc = subprocess.run(
            [sys.executable, "examples/train_preloaded.py", "--cache", str(tmp_path),
             "--epochs", "1", "--precision", "fp32"],
            cwd=ROOT, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert proc.stdout.startswith(word), proc.stdout
        m = re.search(r"final accuracy ([\d.]+)", proc.stdout)
        assert m and float(m.group(1)) > 0.8, proc.stdout


@deep
def test_accelerate_port_resumes_finished_and_two_processes_agree(tmp_path: Path) -> None:
    """examples/port_accelerate_clm.py: perplexity falls; relaunched after it finished, it
    resumes at its end and reports the same perplexity; under torchrun with 2 processes it
    ends at the 1-process weights (token-weighted windows, every document evaluated once)."""
    from helpers import launch_env

    def run(*cmd: str, out: Path) -> str:
        proc = subprocess.run(
            [*cmd, "examples/port_accelerate_clm.py", "--dir", str(out.with_suffix("")),
             "--out", str(out)],
            cwd=ROOT, capture_output=True, text=True, timeout=300, env=launch_env(),
        )  # fmt: skip
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        return proc.stdout

    one, two = tmp_path / "one.pt", tmp_path / "two.pt"
    first = run(sys.executable, out=one)
    ppl = [float(p) for p in re.findall(r"perplexity ([\d.]+) over", first)]
    assert len(ppl) == 2 and ppl[1] < 0.8 * ppl[0], first
    final = re.findall(r"finished: 20 updates \(max_epochs\); perplexity ([\d.]+)", first)
    again = run(sys.executable, out=one)
    assert "resumed from ckpt-0000000020.pt at update 20" in again
    assert re.findall(r"finished: 20 updates \(max_epochs\); perplexity ([\d.]+)", again) == final
    run(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        out=two)  # fmt: skip
    a, b = torch.load(one, weights_only=True), torch.load(two, weights_only=True)
    # fp32, AdamW (which magnifies reduction-order rounding of small gradients): 1e-4.
    assert a.keys() == b.keys() and max((a[k] - b[k]).abs().max().item() for k in a) < 1e-4


@deep
def test_quickstart_writes_a_csv_on_the_update_axis_and_it_plots(tmp_path: Path) -> None:
    """--csv: one row per flush at updates 50, 100, ... 300; plot_metrics draws it."""
    csv_path, png = tmp_path / "q.csv", tmp_path / "q.png"
    for cmd in (
        ["examples/quickstart.py", "--steps", "100", "--csv", str(csv_path)],
        ["examples/plot_metrics.py", str(csv_path), str(png)],
    ):
        proc = subprocess.run(
            [sys.executable, *cmd], cwd=ROOT, capture_output=True, text=True, timeout=300
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
    rows = csv_path.read_text().splitlines()
    assert rows[0] == "step,epoch,samples,loss"
    assert [r.split(",")[0] for r in rows[1:]] == ["50", "100"]
    assert png.stat().st_size > 1000


@deep
def test_ema_example_validates_the_average_better_than_the_weights() -> None:
    """examples/train_ema.py: bf16 weights jittering at a high learning rate; at every
    validation but the first the fp32 average's loss is below the weights', and it averages
    once per update (the counts printed agree)."""
    proc = subprocess.run(
        [sys.executable, "examples/train_ema.py", "--epochs", "3"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    rows = re.findall(r"update +(\d+): validation loss ([\d.]+), its EMA ([\d.]+) \((\d+) av",
                      proc.stdout)  # fmt: skip
    assert len(rows) == 6, proc.stdout
    assert all(int(u) == int(n) for u, _, _, n in rows)
    assert all(float(ema) < float(raw) for _, raw, ema, _ in rows[1:]), proc.stdout
