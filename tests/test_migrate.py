"""The migration guides' side-by-side scripts run, and their numbers compare as the guides say.

Each script of ``examples/migrate/`` runs here in this process (as ``python script.py args``
would: ``__name__ == "__main__"``; a second each in a fresh interpreter, a tenth here), and the
docs show each one's text whole (tests/test_docs.py runs the same blocks' definitions).
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import ROOT

MIGRATE = ROOT / "examples" / "migrate"
GUIDES = {
    "accelerate.md": ("accelerate_cv.py", "loopkit_cv.py"),
    "hand-loop.md": ("hand_diffusion.py", "loopkit_diffusion.py"),
}
StateDict = dict[str, torch.Tensor]


def _run(script: str, *argv: str, replace: tuple[str, str] | None = None) -> str:
    """``python examples/migrate/<script> <argv>``, in this process; what it printed.

    ``replace``: one line of the script changed first (a port's mistake, the guide's recipe).
    """
    path = MIGRATE / script
    source = path.read_text()
    if replace is not None:
        assert source.count(replace[0]) == 1, replace[0]
        source = source.replace(*replace)
    saved_argv, saved_env, out = sys.argv, dict(os.environ), io.StringIO()
    namespace = {"__name__": "__main__", "__file__": str(path)}
    sys.argv = [str(path), *argv]
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(source, str(path), "exec"), namespace)
    finally:
        sys.argv = saved_argv
        os.environ.clear()
        os.environ.update(saved_env)
        if "accelerate" in sys.modules:  # Accelerate's state is a per-process singleton
            from accelerate.state import AcceleratorState, GradientState

            AcceleratorState._reset_state(reset_partial_state=True)
            GradientState._reset_state()
    return out.getvalue()


def _module(script: str) -> dict[str, Any]:
    """The script's definitions (its ``main()`` not run)."""
    namespace: dict[str, Any] = {"__name__": f"migrate_{Path(script).stem}"}
    exec(compile((MIGRATE / script).read_text(), script, "exec"), namespace)
    return namespace


def _load(path: Path) -> StateDict:
    return torch.load(path, weights_only=True)


def _equal(a: StateDict, b: StateDict) -> bool:
    assert a.keys() == b.keys()
    return all(torch.equal(a[k], b[k]) for k in a)


def _max_diff(a: StateDict, b: StateDict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


@pytest.mark.parametrize("guide", sorted(GUIDES))
def test_the_guides_show_both_scripts_whole_side_by_side(guide: str) -> None:
    """Each guide holds the original and its port verbatim, as two columns of one table."""
    text = (ROOT / "docs" / "migrate" / guide).read_text()
    original, port = ((MIGRATE / s).read_text() for s in GUIDES[guide])
    pair = re.compile(
        r"<table>\n<tr><th>[^<]+</th><th>loopkit</th></tr>\n<tr>\n"
        r"<td[^>]*>\n\n```python\n(.*?)```\n\n</td>\n<td[^>]*>\n\n```python\n(.*?)```\n\n</td>",
        flags=re.S,
    )
    assert pair.findall(text) == [(original, port)]


@pytest.mark.parametrize(("accelerate", "loopkit"), [("no", "fp32"), ("bf16", "bf16")])
def test_accelerate_and_its_port_end_bit_identical(
    tmp_path: Path, accelerate: str, loopkit: str
) -> None:
    """accelerate_cv.py and loopkit_cv.py: the same final weights and BatchNorm buffers, bit
    for bit, and the same accuracy after every epoch (same initialization and batch order,
    each micro-batch's loss divided by the window's 2, the same clipping, the scheduler
    stepped once per update; 16 batches per epoch, so no ragged window)."""
    a, lk = tmp_path / "accelerate", tmp_path / "loopkit"
    printed_a = _run("accelerate_cv.py", "--cpu", "--mixed_precision", accelerate,
                     "--output_dir", str(a))  # fmt: skip
    printed_lk = _run("loopkit_cv.py", "--mixed_precision", loopkit, "--output_dir", str(lk))
    accuracy = re.compile(r"epoch (\d): accuracy ([\d.]+)")
    assert len(accuracy.findall(printed_a)) == 3
    assert accuracy.findall(printed_lk) == accuracy.findall(printed_a)
    assert float(accuracy.findall(printed_lk)[-1][1]) > 90  # it learned
    assert _equal(_load(lk / "model.pt"), _load(a / "model.pt"))


@pytest.mark.parametrize(
    "mistake",
    [
        ("* num_epochs\n", "* num_epochs * 2\n"),  # a leftover `* num_processes`, 2 processes
        ("accumulate=accumulate,", "accumulate=1,"),
        ("clip_grad_norm=1.0,", "clip_grad_norm=None,"),
    ],
    ids=["scheduler-total-times-processes", "no-accumulation", "no-clipping"],
)
def test_a_wrong_port_does_not_match_accelerate(tmp_path: Path, mistake: tuple[str, str]) -> None:
    """The comparison above can fail: a port with one mapping wrong ends elsewhere."""
    _run("accelerate_cv.py", "--cpu", "--output_dir", str(tmp_path / "a"))
    _run("loopkit_cv.py", "--output_dir", str(tmp_path / "lk"), replace=mistake)
    assert _max_diff(_load(tmp_path / "lk" / "model.pt"), _load(tmp_path / "a" / "model.pt")) > 1e-4


@pytest.mark.parametrize("update", [16, 20])
def test_both_resume_to_the_uninterrupted_weights(tmp_path: Path, update: int) -> None:
    """A run continued from the save at update 16 (an epoch's end) or 20 (mid-epoch) ends at
    the uninterrupted run's weights, bit for bit: Accelerate's load_state (with the loader's
    set_epoch, and updates that map to whole batches) and loopkit's relaunch alike."""
    full_a, full_lk = tmp_path / "a", tmp_path / "lk"
    _run("accelerate_cv.py", "--cpu", "--output_dir", str(full_a))
    _run("loopkit_cv.py", "--output_dir", str(full_lk))

    resumed_a = _run("accelerate_cv.py", "--cpu", "--output_dir", str(tmp_path / "a2"),
                     "--resume_from_checkpoint", str(full_a / f"step_{update}"))  # fmt: skip
    (tmp_path / "lk2").mkdir()  # a run killed after its save at `update`, relaunched:
    shutil.copy(full_lk / f"ckpt-{update:010d}.pt", tmp_path / "lk2")
    resumed_lk = _run("loopkit_cv.py", "--output_dir", str(tmp_path / "lk2"))

    assert "Resumed from checkpoint" in resumed_a and "Resumed from checkpoint" in resumed_lk
    assert re.findall(r"epoch (\d):", resumed_lk) == ["2"] == re.findall(r"epoch (\d):", resumed_a)
    assert _equal(_load(tmp_path / "a2" / "model.pt"), _load(full_a / "model.pt"))
    assert _equal(_load(tmp_path / "lk2" / "model.pt"), _load(full_lk / "model.pt"))


def test_accelerates_resume_without_set_epoch_replays_epoch_0s_order(tmp_path: Path) -> None:
    """The guide's caveat: without the loader's set_epoch (Accelerate's own examples leave it
    out) the run resumed at update 20 shuffles as in epoch 0 and ends elsewhere (about 1e-2)."""
    line = "        active_dataloader.set_epoch(epoch)\n"
    full = tmp_path / "a"
    _run("accelerate_cv.py", "--cpu", "--output_dir", str(full), replace=(line, ""))
    _run("accelerate_cv.py", "--cpu", "--output_dir", str(tmp_path / "a2"),
         "--resume_from_checkpoint", str(full / "step_20"), replace=(line, ""))  # fmt: skip
    assert _max_diff(_load(tmp_path / "a2" / "model.pt"), _load(full / "model.pt")) > 1e-3


def _losses(printed: str) -> list[float]:
    return [float(v) for v in re.findall(r"^step \d+ \| loss ([\d.]+)", printed, flags=re.M)]


def test_hand_loop_and_its_port_agree_on_whole_batches(tmp_path: Path) -> None:
    """--microbatch -1 (no chunks, so nothing to fix): the weights are the hand loop's bit for
    bit, each EMA within float rounding (the hand loop's mul_/add_ rounds unlike loopkit's
    one lerp: 1e-6), and the losses logged every 8 updates are the same."""
    hand, port = tmp_path / "hand", tmp_path / "port"
    printed_hand = _run("hand_diffusion.py", "--microbatch", "-1", "--out_dir", str(hand))
    printed_port = _run("loopkit_diffusion.py", "--microbatch", "-1", "--out_dir", str(port))
    assert len(_losses(printed_hand)) == 3
    assert _losses(printed_port) == pytest.approx(_losses(printed_hand), abs=1e-4)
    assert _equal(_load(port / "model.pt"), _load(hand / "model000024.pt"))
    for rate in (0.99, 0.9):
        ema_port, ema_hand = _load(port / f"ema_{rate}.pt"), _load(hand / f"ema_{rate}_000024.pt")
        assert 0 < _max_diff(ema_port, ema_hand) < 1e-6


def _grads(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("microbatch", [8, 12])
def test_micro_batch_is_the_batch_gradient_and_the_hand_loop_is_not(microbatch: int) -> None:
    """On one batch of 32 with the same timesteps and noise: the hand loop's gradient is
    n_chunks times the batch's for even chunks (8: 4 chunks) and weights a ragged last chunk
    more (12, 12, 8); loopkit's micro_batch= update is the batch's (float rounding: 1e-6)."""
    hand = _module("hand_diffusion.py")
    create_model, training_losses, T = hand["create_model"], hand["training_losses"], hand["T"]
    batch = hand["get_dataset"](seed=0).tensors[0][:32]
    chunks = batch.split(microbatch)

    torch.manual_seed(0)
    reference = create_model()
    torch.manual_seed(5)  # the draws of the hand loop: per chunk its timesteps, then its noise
    losses = [training_losses(reference, c, torch.randint(0, T, (len(c),))) for c in chunks]
    torch.cat(losses).mean().backward()  # the batch's mean loss, one backward
    batch_grad = _grads(reference)

    torch.manual_seed(0)
    loop = hand["TrainLoop"](model=create_model(), data=None, batch_size=32,
                             microbatch=microbatch, lr=1.0, ema_rate=[], log_interval=1,
                             save_interval=1, lr_anneal_steps=1, out_dir="unused")  # fmt: skip
    torch.manual_seed(5)
    loop.forward_backward(batch)
    hand_grad = _grads(loop.model)
    n = len(chunks)
    if all(len(c) == microbatch for c in chunks):  # n times the batch's gradient
        for h, g in zip(hand_grad, batch_grad, strict=True):
            torch.testing.assert_close(h, n * g, rtol=1e-5, atol=1e-7)
    else:  # the 8 samples of the last chunk weigh 1/8 each, the others 1/12: not n x 1/32
        off = max(((h - n * g).norm() / (n * g).norm()).item()
                  for h, g in zip(hand_grad, batch_grad, strict=True))  # fmt: skip
        assert off > 1e-2

    import loopkit

    torch.manual_seed(0)
    model = create_model()
    sgd = torch.optim.SGD(model.parameters(), lr=1.0)  # the update is minus the gradient
    step = loopkit.step(model, sgd, micro_batch=microbatch)
    torch.manual_seed(5)
    for (x,) in step.iterate([(batch,)]):
        with step as s:
            s.backward(training_losses(model, x, torch.randint(0, T, (len(x),))).mean())
    assert step.updates == 1
    torch.manual_seed(0)
    for p, p0, g in zip(model.parameters(), create_model().parameters(), batch_grad, strict=True):
        torch.testing.assert_close(p.detach(), p0.detach() - g, rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    ("microbatch", "backward", "exact"),
    [
        (8, "s.backward((losses * weights).mean() * 4)", True),
        (12, "s.backward((losses * weights).mean() * 3, weight=1)", False),
    ],
    ids=["even-4-chunks", "ragged-3-chunks"],
)
def test_the_guides_recipe_reproduces_the_hand_loops_run(
    tmp_path: Path, microbatch: int, backward: str, exact: bool
) -> None:
    """The guide's recipe for the old run: the loss times n_chunks gives the hand loop's weights
    bit for bit with even chunks (a power of two scales exactly); with a ragged chunk,
    weight=1 weighs the chunks' means equally, as the hand loop did, to float rounding (the
    factor 3 and the window's 1/3 round); without it the run is another."""
    hand, port = tmp_path / "hand", tmp_path / "port"
    _run("hand_diffusion.py", "--microbatch", str(microbatch), "--out_dir", str(hand))
    line = "s.backward((losses * weights).mean())"
    _run("loopkit_diffusion.py", "--microbatch", str(microbatch), "--out_dir", str(port),
         replace=(line, backward))  # fmt: skip
    old = _load(hand / "model000024.pt")
    if exact:
        assert _equal(_load(port / "model.pt"), old)
    else:
        assert _max_diff(_load(port / "model.pt"), old) < 1e-6
        plain = backward.replace(", weight=1", "")
        _run("loopkit_diffusion.py", "--microbatch", str(microbatch), "--out_dir",
             str(tmp_path / "shares"), replace=(line, plain))  # fmt: skip
        assert _max_diff(_load(tmp_path / "shares" / "model.pt"), old) > 1e-4
    # The port as written is not the hand loop's run (its gradients are n_chunks times
    # smaller; AdamW makes the weights differ through eps only).
    _run("loopkit_diffusion.py", "--microbatch", str(microbatch), "--out_dir",
         str(tmp_path / "as-is"))  # fmt: skip
    assert not _equal(_load(tmp_path / "as-is" / "model.pt"), old)
    if exact:  # the learning rate times n_chunks instead: AdamW's steps grow 4 times
        _run("loopkit_diffusion.py", "--microbatch", str(microbatch), "--out_dir",
             str(tmp_path / "lr"), replace=("lr=1e-3", "lr=4e-3"))  # fmt: skip
        assert _max_diff(_load(tmp_path / "lr" / "model.pt"), old) > 1e-2


def test_the_diffusion_port_resumes_bit_identically(tmp_path: Path) -> None:
    """loopkit_diffusion.py (ragged chunks of 12) relaunched after its save at update 16 ends
    with the uninterrupted run's weights and both averages, bit for bit."""
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    _run("loopkit_diffusion.py", "--microbatch", "12", "--out_dir", str(full))
    resumed.mkdir()
    shutil.copy(full / "ckpt-0000000016.pt", resumed)
    printed = _run("loopkit_diffusion.py", "--microbatch", "12", "--out_dir", str(resumed))
    # the log's records after update 16 only
    assert re.findall(r"^step (\d+) \| loss", printed, flags=re.M) == ["24"]
    for name in ("model.pt", "ema_0.99.pt", "ema_0.9.pt"):
        assert _equal(_load(resumed / name), _load(full / name)), name
