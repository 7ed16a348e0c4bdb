"""The doctor names torch.compile's graph breaks and recompiles, each with the tip that fixes it."""

from __future__ import annotations

import torch
import torch._dynamo
from torch import nn

import loopkit

EAGER = {"backend": "eager"}


class Printing(nn.Module):
    """A forward with a print in it: a graph break."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        print("forward")  # the graph break under test
        return y * 2


def _steps(model: nn.Module, sizes: list[int], doc: loopkit.doctor) -> None:
    step = loopkit.step(model, torch.optim.SGD(model.parameters(), lr=0.1), doctor=doc)
    g = torch.Generator().manual_seed(0)
    for n in sizes:
        with step as s:
            s.backward(model(torch.randn(n, 4, generator=g)).pow(2).mean())


def test_a_ragged_last_batch_is_named_with_drop_last_and_mark_dynamic() -> None:
    """A compiled model seeing a smaller last batch: one recompile, its reason (a size
    mismatch) and the tip (drop_last=True, mark_dynamic) in the report."""
    torch._dynamo.reset()
    doc = loopkit.doctor()
    model = torch.compile(nn.Linear(4, 1), **EAGER)
    # The doctor counts FLOPs (step 1) and host syncs (steps 3-5) with compiled code run
    # eagerly (its ops would be unseen): the first compile is at step 2, the ragged batch's
    # at step 7.
    _steps(model, [8] * 6 + [5], doc)
    stats = doc.stats()["compile"]
    assert len(stats["recompiles"]) == 1 and "size mismatch" in stats["recompiles"][0]
    assert stats["graphs"] == 2 and not stats["graph_breaks"]
    report = doc.report()
    assert "1 recompile(s)" in report and "drop_last=True" in report and "mark_dynamic" in report


def test_a_graph_break_is_counted_with_its_reason_and_tip() -> None:
    """A print inside the compiled forward: a graph break per compilation, named, with the
    tip to move it out; an equally shaped loop has no recompile."""
    torch._dynamo.reset()
    doc = loopkit.doctor()
    _steps(torch.compile(Printing(), **EAGER), [4] * 7, doc)
    stats = doc.stats()["compile"]
    assert sum(stats["graph_breaks"].values()) == 1 and not stats["recompiles"]
    assert any("print" in reason for reason in stats["graph_breaks"])
    assert "move it out of the compiled function" in " ".join(doc.tips())


def test_a_float_lr_recompile_points_to_compile_optimizer_which_removes_it() -> None:
    """An optimizer step compiled by hand under a scheduler recompiles on the lr: the tip
    names compile_optimizer=True; with it the same loop reports no recompile, and the steps
    the doctor measures eagerly read no tensor lr on the host."""
    torch._dynamo.reset()
    model = nn.Linear(4, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)
    compiled_step = torch.compile(opt.step, **EAGER)
    doc = loopkit.doctor()
    doc.attach(model, opt)
    for _ in range(8):  # steps 1 and 3-5 are measured eagerly (FLOPs, host syncs)
        with doc:
            model(torch.ones(2, 4)).sum().backward()
            compiled_step()
            opt.zero_grad()
            sched.step()
    assert any("['lr']" in r for r in doc.stats()["compile"]["recompiles"])
    assert "compile_optimizer=True" in " ".join(doc.tips())
    torch._dynamo.reset()
    doc = loopkit.doctor()
    model = nn.Linear(4, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    step = loopkit.step(model, opt, scheduler=torch.optim.lr_scheduler.StepLR(opt, 1, 0.5),
                        compile_optimizer=EAGER, doctor=doc)  # fmt: skip
    for _ in range(5):
        with step as s:
            s.backward(model(torch.ones(2, 4)).sum())
    assert doc.stats()["compile"]["recompiles"] == []
    # The measured steps (3-5) run the optimizer eagerly with its float lrs: no lr read.
    assert doc.stats()["syncs_per_step"] == 0


def test_only_what_compiled_after_the_doctor_was_built_counts_and_reading_it_syncs_nothing() -> (
    None
):
    """Compilations before the doctor existed are not its run's; its report reads dynamo's
    records on the host: no host-device sync."""
    torch._dynamo.reset()
    earlier = torch.compile(Printing(), **EAGER)
    earlier(torch.ones(2, 4))
    doc = loopkit.doctor()
    _steps(nn.Linear(4, 1), [4, 4], doc)
    with loopkit.count_host_syncs() as syncs:
        stats = doc.stats()["compile"]
        doc.report()
    assert stats == {"graphs": 0, "compile_seconds": 0.0, "recompiles": [], "graph_breaks": {}}
    assert syncs.count == 0
    assert "torch.compile" not in doc.report()


def test_measured_steps_run_compiled_code_eagerly_and_leave_it_compiling() -> None:
    """A compiled function first called inside count_host_syncs (and a compiled model
    measured by the doctor from its first step): the counted calls run eagerly, with their
    host reads seen, and the code compiles on the next call, once; counters exited out of
    order restore the default stance."""
    from torch._dynamo.utils import clear_compilation_metrics, get_compilation_metrics

    torch._dynamo.reset()
    clear_compilation_metrics()

    def fn(x: torch.Tensor) -> torch.Tensor:
        return (x * 2).sin()

    compiled = torch.compile(fn, **EAGER)
    outer, inner = loopkit.count_host_syncs(), loopkit.count_host_syncs()
    outer.__enter__()
    inner.__enter__()
    compiled(torch.ones(3))
    outer.__exit__(None, None, None)  # out of order: inner still counts, still eager
    compiled(torch.ones(3))
    assert not get_compilation_metrics()
    inner.__exit__(None, None, None)
    compiled(torch.ones(3))
    assert len(get_compilation_metrics()) == 1  # compiled now: not skipped for good
    doc = loopkit.doctor()
    model = torch.compile(nn.Linear(4, 1), **EAGER)
    _steps(model, [4] * 6, doc)
    assert doc.stats()["compile"]["graphs"] == 1
    assert doc.stats()["flops_per_step"]  # counted on an eager step 1
