"""The doctor's compute figures: one step's FLOPs counted, FLOP/s achieved, MFU against a peak."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import loopkit
from loopkit._observe._throughput import PEAKS, peak_for


def test_a_transformer_blocks_flops_are_the_closed_form() -> None:
    """GPT-2 block, forward + backward counted on one step: 6·N·tokens for its matmul weights
    (N = 12·d²) plus the attention scores' 12·B·T²·d, within 0.5%."""
    transformers = pytest.importorskip("transformers")
    d, heads, batch, length = 64, 4, 4, 32
    config = transformers.GPT2Config(n_embd=d, n_head=heads, n_positions=length,
                                     attn_implementation="eager")  # fmt: skip
    block = transformers.models.gpt2.modeling_gpt2.GPT2Block(config)
    doc = loopkit.doctor(sink=lambda _: None, sample_syncs_at=())
    step = loopkit.step(block, torch.optim.SGD(block.parameters(), lr=0.01), doctor=doc)
    for _ in range(3):
        x = torch.randn(batch, length, d, requires_grad=True)  # its gradient is computed too
        with step as s:
            s.backward(block(x)[0].pow(2).mean())
    tokens = batch * length
    closed = 6 * (12 * d * d) * tokens + 12 * batch * length * length * d
    assert doc.stats()["flops_per_step"] == pytest.approx(closed, rel=5e-3)


def test_mfu_is_achieved_over_the_given_peak_and_absent_on_a_cpu_without_one() -> None:
    """flops_per_step=1e9 over the measured wall time; MFU only with peak_flops given."""
    for peak in (None, 2e12):
        model = nn.Linear(8, 1)
        doc = loopkit.doctor(sink=lambda _: None, flops_per_step=1e9, peak_flops=peak)
        step = loopkit.step(model, torch.optim.SGD(model.parameters(), lr=0.01), doctor=doc)
        for x in torch.randn(5, 4, 8):
            with step as s:
                s.backward(model(x).sum())
        stats = doc.stats()
        wall = doc._clock.wall
        assert stats["flops_per_s"] == pytest.approx(1e9 * 5 / wall)
        report = doc.report()
        assert "FLOP/s achieved" in report
        if peak is None:
            assert stats["mfu"] is None and "MFU" not in report
            assert set(doc.metrics()) == {"flops_per_s"}
        else:
            assert stats["mfu"] == pytest.approx(stats["flops_per_s"] / 2e12)
            assert "MFU" in report and "given" in report
            assert doc.metrics()["mfu"] == stats["mfu"]


def test_the_peak_table_is_found_by_device_name_and_precision() -> None:
    """torch.cuda.get_device_name() strings pick the right row; an unknown pair gives None."""
    assert peak_for("NVIDIA A100-SXM4-80GB", "bf16") == ("A100", 312e12)
    assert peak_for("NVIDIA H100 PCIe", "bf16") == ("H100 PCIe", 756e12)
    assert peak_for("NVIDIA H100 80GB HBM3", "fp32") == ("H100", 67e12)
    assert peak_for("Tesla V100-SXM2-32GB", "bf16") is None
    assert peak_for("Some CPU", "fp32") is None
    assert all(p > 1e12 for _, peaks in PEAKS for p in peaks.values())


def test_a_bad_peak_or_flop_count_is_refused() -> None:
    """peak_flops and flops_per_step must be positive numbers."""
    with pytest.raises(ValueError, match="peak_flops must be"):
        loopkit.doctor(peak_flops=0)
    with pytest.raises(ValueError, match="flops_per_step must be"):
        loopkit.doctor(flops_per_step=-1.0)
