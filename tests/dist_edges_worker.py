"""accumulate at the edges under `torchrun --nproc-per-node 2`: every rank decides alike.

Launched by test_accumulate_ddp.py; results land in OUT/<scenario>.rank<r>.pt.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from helpers import counted_ddp, run_scenarios
from torch import nn

import loopkit
from loopkit import distributed

SCENARIOS: dict[str, Callable[[distributed.DistInfo], dict[str, Any]]] = {}
Batch = tuple[torch.Tensor, torch.Tensor]


def scenario(fn: Callable[[distributed.DistInfo], dict[str, Any]]) -> Any:
    SCENARIOS[fn.__name__] = fn
    return fn


def mlp(width: int = 16) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, width), nn.Tanh(), nn.Linear(width, 2))


def data(sizes: list[int], seed: int) -> list[Batch]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, 6, generator=g), torch.randn(n, 2, generator=g)) for n in sizes]


def mse(model: nn.Module, batch: Batch) -> torch.Tensor:
    return nn.functional.mse_loss(model(batch[0]), batch[1])


def flat(model: nn.Module) -> torch.Tensor:
    params = list(model.parameters())
    full = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in params]
    return torch.cat([p.detach().flatten() for p in full])


def replicas(t: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return out


def reference(windows: list[list[Batch]], lr: float = 0.05) -> torch.Tensor:
    """One process: one SGD step per window on all ranks' micro-batches as one batch."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    for window in windows:
        x = torch.cat([b[0] for b in window])
        y = torch.cat([b[1] for b in window])
        mse(model, (x, y)).backward()
        opt.step()
        opt.zero_grad()
    return flat(model)


def sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


@scenario
def skip_nonfinite_on_one_rank(info: distributed.DistInfo) -> dict[str, Any]:
    """An inf loss with finite gradients on rank 1 only: both ranks skip that update."""
    return {p: _skip_nonfinite_on_one_rank(info, p) for p in ("fp32", "fp16")}


def _skip_nonfinite_on_one_rank(info: distributed.DistInfo, precision: str) -> dict[str, Any]:
    net = distributed.wrap(mlp())
    # fp16: a small initial scale, so that no start-up back-off skips an update too.
    scaler = {"init_scale": 256.0} if precision == "fp16" else None
    s = loopkit.step(net, sgd(net), accumulate=2, skip_nonfinite=True, precision=precision)
    if scaler is not None:
        s.amp.load_state_dict({"scaler": torch.amp.GradScaler("cpu", **scaler).state_dict()})
    per_rank = [data([4] * 6, seed=20 + r) for r in range(2)]
    for i, batch in enumerate(per_rank[info.rank]):
        with s as st:
            loss = mse(net, batch)
            if i == 3 and info.rank == 1:
                loss = loss + torch.tensor(float("inf"))  # the gradient stays finite
            st.backward(loss)
    # Window 1 (micro-batches 2 and 3) is skipped everywhere; windows 0 and 2 train.
    windows = [[b for r in range(2) for b in per_rank[r][k : k + 2]] for k in (0, 4)]
    return {
        "counts": (s.updates, s.skipped),
        "same": all(torch.equal(w, replicas(flat(net))[0]) for w in replicas(flat(net))),
        # fp16's autocast forward rounds: compare it loosely, fp32 exactly.
        "diff": (flat(net) - reference(windows)).abs().max().item(),
    }


@scenario
def fsdp2_weighted(info: distributed.DistInfo) -> dict[str, Any]:
    """FSDP2 with weight= and a ragged tail: the update of one process on the global batch."""
    sizes = [[2, 7, 3, 5, 4, 1, 6], [9, 1, 6, 3, 8, 2, 2]]
    per_rank = [data(s, seed=30 + r) for r, s in enumerate(sizes)]
    net = distributed.wrap(mlp(), fsdp=True)
    s = loopkit.step(net, sgd(net), accumulate=3)
    for batch in s.iterate(per_rank[info.rank]):
        with s as st:
            st.backward(mse(net, batch), weight=batch[0].shape[0])
    windows = [[b for r in range(2) for b in per_rank[r][k : k + 3]] for k in (0, 3, 6)]
    return {"updates": s.updates, "diff": (flat(net) - reference(windows)).abs().max().item()}


@scenario
def fsdp2_flush_is_refused_and_keeps_the_window(info: distributed.DistInfo) -> dict[str, Any]:
    """FSDP2 flush() of a no_sync window: refused, nothing changes; the next micro-step closes."""
    per_rank = [data([4, 4], seed=40 + r) for r in range(2)]
    net = distributed.wrap(mlp(), fsdp=True)
    s = loopkit.step(net, sgd(net), accumulate=2)
    before = flat(net)
    with s as st:
        st.backward(mse(net, per_rank[info.rank][0]))
    error = ""
    try:
        s.flush()
    except RuntimeError as err:
        error = str(err)
    unchanged = torch.equal(flat(net), before) and s.updates == 0 and s.micro_step == 1
    with s as st:  # the window's second micro-step syncs and closes it
        st.backward(mse(net, per_rank[info.rank][1]))
    window = [b for r in range(2) for b in per_rank[r]]
    return {
        "error": error,
        "unchanged": unchanged,
        "updates": s.updates,
        "diff": (flat(net) - reference([window])).abs().max().item(),
    }


class TwoBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.never = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 6)
        self.head = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor, use_a: bool) -> torch.Tensor:
        return self.head(self.a(x) if use_a else self.b(x))


def _two_branch_reference(per_rank: list[list[Batch]], lr: float) -> torch.Tensor:
    """DDP's semantics by hand: each rank's mean micro-batch loss, averaged over ranks."""
    m = TwoBranch()
    opt = torch.optim.SGD(m.parameters(), lr=lr, weight_decay=0.1)
    losses = [sum(mse_branch(m, b, r == 0) for b in per_rank[r]) / len(per_rank[r]) for r in (0, 1)]
    (sum(losses) / 2).backward()
    opt.step()
    return flat(m)


def mse_branch(m: nn.Module, batch: Batch, use_a: bool) -> torch.Tensor:
    return nn.functional.mse_loss(m(batch[0], use_a), batch[1])


@scenario
def ddp_flush_with_unused_parameters(info: distributed.DistInfo) -> dict[str, Any]:
    """find_unused_parameters: ranks use different branches; flush() aligns by parameter."""
    per_rank = [data([4] * 3, seed=50 + r) for r in range(2)]
    net: Any = distributed.wrap(TwoBranch(), find_unused_parameters=True)
    # weight_decay: a parameter no rank used must keep grad None (a zero grad would decay it).
    opt = torch.optim.SGD(net.parameters(), lr=0.1, weight_decay=0.1)
    s = loopkit.step(net, opt, accumulate=4)
    never_before = net.module.never.weight.detach().clone()
    for batch in per_rank[info.rank]:
        with s as st:
            st.backward(mse_branch(net, batch, info.rank == 0))
    s.flush()  # the last micro-step ran under no_sync
    w = torch.cat([p.detach().flatten() for p in net.module.parameters()])
    return {
        "updates": s.updates,
        "same": all(torch.equal(x, replicas(w)[0]) for x in replicas(w)),
        "diff": (w - _two_branch_reference(per_rank, 0.1)).abs().max().item(),
        "never_moved": not torch.equal(net.module.never.weight, never_before),
    }


@scenario
def ddp_last_micro_step_without_backward(info: distributed.DistInfo) -> dict[str, Any]:
    """A window whose final micro-step makes no backward still all-reduces, aligned."""
    per_rank = [data([4] * 2, seed=60 + r) for r in range(2)]
    net: Any = distributed.wrap(TwoBranch(), find_unused_parameters=True)
    s = loopkit.step(net, torch.optim.SGD(net.parameters(), lr=0.1, weight_decay=0.1), accumulate=3)
    for batch in per_rank[info.rank]:
        with s as st:
            st.backward(mse_branch(net, batch, info.rank == 0))
    with s:
        pass  # the window's last micro-step: nothing to back-propagate
    w = torch.cat([p.detach().flatten() for p in net.module.parameters()])
    return {
        "updates": s.updates,
        "same": all(torch.equal(x, replicas(w)[0]) for x in replicas(w)),
        "diff": (w - _two_branch_reference(per_rank, 0.1)).abs().max().item(),
    }


@scenario
def ddp_flush_with_unused_parameters_then_train_on(info: distributed.DistInfo) -> dict[str, Any]:
    """After a flushed window with rank-dependent branches, later synced windows still work."""
    per_rank = [data([4] * 3, seed=80 + r) for r in range(2)]
    net: Any = distributed.wrap(TwoBranch(), find_unused_parameters=True)
    s = loopkit.step(net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9), accumulate=2)
    with s as st:  # a ragged window: rank 0 through branch a, rank 1 through b
        st.backward(mse_branch(net, per_rank[info.rank][0], info.rank == 0))
    s.flush()
    for batch in s.iterate(per_rank[info.rank][1:]):  # then both through a
        with s as st:
            st.backward(mse_branch(net, batch, True))
    ref = TwoBranch()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    (sum(mse_branch(ref, per_rank[r][0], r == 0) for r in (0, 1)) / 2).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    (sum(mse_branch(ref, b, True) for r in (0, 1) for b in per_rank[r][1:]) / 4).backward()
    opt.step()
    w = torch.cat([p.detach().flatten() for p in net.module.parameters()])
    return {
        "updates": s.updates,
        "same": all(torch.equal(x, replicas(w)[0]) for x in replicas(w)),
        "diff": (w - flat(ref)).abs().max().item(),
    }


@scenario
def ddp_flush_with_a_rank_without_backward(info: distributed.DistInfo) -> dict[str, Any]:
    """flush() of a window in which rank 1 made no backward: both ranks take part, alike."""
    per_rank = [data([4] * 2, seed=90 + r) for r in range(2)]
    net = distributed.wrap(mlp())
    s = loopkit.step(net, sgd(net), accumulate=4)
    for batch in per_rank[info.rank]:
        with s as st:
            if info.rank == 0:
                st.backward(mse(net, batch))
    s.flush()
    # DDP's semantics: rank 0's mean micro-batch loss, averaged over the ranks' micro-steps.
    w = flat(net)
    return {
        "updates": s.updates,
        "same": all(torch.equal(x, replicas(w)[0]) for x in replicas(w)),
        "diff": (w - reference([per_rank[0]])).abs().max().item(),
    }


@scenario
def fsdp2_iterate_after_a_refused_flush(info: distributed.DistInfo) -> dict[str, Any]:
    """FSDP2: after a refused flush, the next iterate() closes the left-over window and trains."""
    per_rank = [data([4] * 4, seed=95 + r) for r in range(2)]
    net = distributed.wrap(mlp(), fsdp=True)
    s = loopkit.step(net, sgd(net), accumulate=3)
    for batch in per_rank[info.rank][:2]:  # 2 of 3, no iterate: the last ran without sync
        with s as st:
            st.backward(mse(net, batch))
    refused = False
    try:
        s.flush()
    except RuntimeError:
        refused = True
    for batch in s.iterate(per_rank[info.rank][2:]):
        with s as st:
            st.backward(mse(net, batch))
    windows = [[b for r in range(2) for b in per_rank[r][k : k + n]] for k, n in ((0, 3), (3, 1))]
    return {
        "refused": refused,
        "updates": s.updates,
        "diff": (flat(net) - reference(windows)).abs().max().item(),
    }


class Poisoned(nn.Module):
    """An MLP whose loss can put an inf into one element of the first weight's gradient."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = nn.Linear(6, 16), nn.Linear(16, 2)
        self.poison = 0.0

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.fc2(torch.tanh(self.fc1(x)))
        # Row 12 of fc1.weight lives in rank 1's shard (FSDP2 shards dim 0 in two halves):
        # only that element's gradient becomes inf.
        return out, self.fc1.weight[12, 0] * self.poison


@scenario
def fsdp2_fp16_overflow_in_one_shard(info: distributed.DistInfo) -> dict[str, Any]:
    """fp16 under FSDP2: an inf only in rank 1's shard makes BOTH ranks skip, scales agree."""
    model = Poisoned()
    net = distributed.wrap(model, fsdp=True)
    s = loopkit.step(net, sgd(net), precision="fp16", accumulate=1)
    batches = data([4] * 3, seed=70)
    before, kept = flat(net), False
    for i, batch in enumerate(batches):
        model.poison = float("inf") if (i == 1 and info.rank == 1) else 0.0
        if i == 1:
            before = flat(net)
        with s as st:
            out, penalty = net(batch[0])
            st.backward(nn.functional.mse_loss(out, batch[1]) + penalty)
        if i == 1:
            kept = torch.equal(flat(net), before)
    assert s.amp.scaler is not None
    scale = torch.tensor([s.amp.scaler.get_scale()])
    return {
        "counts": (s.updates, s.skipped),
        "kept": kept,
        "scales_agree": all(torch.equal(x, scale) for x in replicas(scale)),
        "same": all(torch.equal(x, replicas(flat(net))[0]) for x in replicas(flat(net))),
    }


@scenario
def found_inf_agreement(info: distributed.DistInfo) -> dict[str, Any]:
    """agree_found_inf (used for FSDP1 shards): one rank's inf flag becomes every rank's."""
    from loopkit._precision import agree_found_inf

    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp = loopkit.autocast_step("fp16", device_type="cpu")
    assert amp.scaler is not None
    loss = model(torch.ones(1, 2)).sum() * (float("inf") if info.rank == 1 else 1.0)
    amp.backward(loss)
    amp.unscale_(opt)
    flags = amp.scaler._per_optimizer_states[id(opt)]["found_inf_per_device"]
    local = float(sum(flags.values()))
    agree_found_inf(amp.scaler, opt, None)
    return {"local": local, "agreed": float(sum(flags.values())), "stepped": amp.step(opt)}


def _gan_models() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    G = nn.Sequential(nn.Linear(4, 16), nn.LeakyReLU(0.2), nn.Linear(16, 2))
    D = nn.Sequential(nn.Linear(2, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
    return G, D


def _gan_loop(G: Any, D: Any, batches: list[Any], between: Callable[[str], None]) -> list[Any]:
    """The DCGAN loop with loopkit.steps (accumulate=2); `between` runs around G's step."""
    bce = nn.functional.binary_cross_entropy_with_logits
    d_step = loopkit.step(D, torch.optim.Adam(D.parameters(), lr=1e-2), accumulate=2)
    g_step = loopkit.step(G, torch.optim.Adam(G.parameters(), lr=1e-2), accumulate=2,
                          frozen=[D])  # fmt: skip
    for real, noise in loopkit.steps(d_step, g_step).iterate(batches):
        with d_step as s:
            label = torch.ones(real.shape[0], 1)
            s.backward(bce(D(real), label))
            fake = G(noise)
            label.fill_(0.0)
            s.backward(bce(D(fake.detach()), label))
        between("before G")
        with g_step as s:
            label.fill_(1.0)
            s.backward(bce(D(fake), label))
        between("after G")
    return [d_step, g_step]


def _flat_of(*models: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for m in models for p in m.parameters()])


def _against_one_process(ddp_g: Any, ddp_d: Any, per_rank: list[list[Any]]) -> dict[str, Any]:
    """Whether the ranks' GAN weights agree, and their distance from one process trained by
    ``_gan_loop`` on the global batches (each rank's batch side by side)."""
    G_ref, D_ref = _gan_models()
    glob = [tuple(torch.cat([batches[k][i] for batches in per_rank]) for i in range(2))
            for k in range(len(per_rank[0]))]  # fmt: skip
    _gan_loop(G_ref, D_ref, glob, lambda when: None)
    got = _flat_of(ddp_g.module, ddp_d.module)
    return {
        "same": all(torch.equal(x, replicas(got)[0]) for x in replicas(got)),
        "diff": (got - _flat_of(G_ref, D_ref)).abs().max().item(),
    }


@scenario
def gan_one_all_reduce_per_model_per_window(info: distributed.DistInfo) -> dict[str, Any]:
    """DDP GAN: one all-reduce round per model per window, none of D during G's step."""
    g = torch.Generator().manual_seed(100)
    per_rank = [[(torch.randn(4, 2, generator=g), torch.randn(4, 4, generator=g))
                 for _ in range(6)] for _ in range(2)]  # fmt: skip
    G, D = _gan_models()
    ddp_g, calls_g = counted_ddp(G)
    ddp_d, calls_d = counted_ddp(D)
    seen: dict[str, Any] = {"d_grad_kept": True, "d_calls_in_g": 0, "per_batch": []}

    def grads() -> list[Any]:
        return [None if p.grad is None else p.grad.clone() for p in ddp_d.parameters()]

    def between(when: str) -> None:
        if when == "before G":
            seen["d_before"], seen["d_calls"] = grads(), len(calls_d)
            return
        after = grads()
        seen["d_grad_kept"] &= all(
            (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
            for a, b in zip(seen["d_before"], after, strict=True)
        )
        seen["d_calls_in_g"] += len(calls_d) - seen["d_calls"]
        seen["per_batch"].append((len(calls_d), len(calls_g)))

    d_step, g_step = _gan_loop(ddp_g, ddp_d, per_rank[info.rank], between)
    return {
        "updates": (d_step.updates, g_step.updates),
        "per_batch": seen["per_batch"],
        "d_grad_kept": seen["d_grad_kept"],
        "d_calls_in_g": seen["d_calls_in_g"],
        **_against_one_process(ddp_g, ddp_d, per_rank),
    }


@scenario
def gan_in_micro_batches(info: distributed.DistInfo) -> dict[str, Any]:
    """DDP GAN with micro_batch= (D in 3s, G in 2s, each member splitting the batch itself):
    the weights of one process on whole global batches, one all-reduce per model per window."""
    g = torch.Generator().manual_seed(101)
    per_rank = [[(torch.randn(4, 2, generator=g), torch.randn(4, 4, generator=g))
                 for _ in range(6)] for _ in range(2)]  # fmt: skip
    G, D = _gan_models()
    ddp_g, calls_g = counted_ddp(G)
    ddp_d, calls_d = counted_ddp(D)
    bce = nn.functional.binary_cross_entropy_with_logits
    d_step = loopkit.step(ddp_d, torch.optim.Adam(ddp_d.parameters(), lr=1e-2), accumulate=2,
                          micro_batch=3)  # fmt: skip
    g_step = loopkit.step(ddp_g, torch.optim.Adam(ddp_g.parameters(), lr=1e-2), accumulate=2,
                          micro_batch=2, frozen=[ddp_d])  # fmt: skip
    for batch in loopkit.steps(d_step, g_step).iterate(per_rank[info.rank]):
        for real, noise in d_step.split(batch):
            with d_step as s:
                s.backward(bce(ddp_d(real), torch.ones(len(real), 1)))
                s.backward(bce(ddp_d(ddp_g(noise).detach()), torch.zeros(len(real), 1)))
        for _, noise in g_step.split(batch):
            with g_step as s:
                s.backward(bce(ddp_d(ddp_g(noise)), torch.ones(len(noise), 1)))
    return {
        "updates": (d_step.updates, g_step.updates),
        "calls": (len(calls_d), len(calls_g)),
        **_against_one_process(ddp_g, ddp_d, per_rank),
    }


@scenario
def forward_outside_a_non_final_micro_step_is_refused(info: distributed.DistInfo) -> dict[str, Any]:
    """Without loopkit.steps, G's forward before G's no_sync micro-step: a clear error."""
    G, _ = _gan_models()
    ddp_g = distributed.wrap(G)
    g_step = loopkit.step(ddp_g, torch.optim.SGD(ddp_g.parameters(), lr=0.1), accumulate=2)
    fake = ddp_g(torch.randn(4, 4))  # with sync on: DDP would all-reduce its backward
    try:
        with g_step as s:
            s.backward(fake.pow(2).mean())
    except RuntimeError as err:
        return {"error": str(err)}
    return {"error": ""}


# -- by-hand reduction against DDP's own, several backward passes, the group's edges -----------


def _ddp_with_hook(model: nn.Module, hook: str) -> Any:
    """DDP with one comm hook: none, a Python one, a built-in C++ one, or PowerSGD."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    net: Any = nn.parallel.DistributedDataParallel(model)
    if hook.startswith("builtin:"):
        net._register_builtin_comm_hook(getattr(dist.BuiltinCommHookType, hook[8:]))
    elif hook == "bf16_compress_hook":
        # DDP refuses this hook by its name off CUDA/NCCL; gloo reduces bfloat16 all the same.
        def bf16(state, bucket):  # type: ignore[no-untyped-def]
            return default_hooks.bf16_compress_hook(state, bucket)

        net.register_comm_hook(None, bf16)
    elif hook == "powerSGD":
        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=1,
            min_compression_rate=0.5, use_error_feedback=False, warm_start=False,
        )  # fmt: skip
        net.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    elif hook != "none":
        net.register_comm_hook(None, getattr(default_hooks, hook))
    return net


HOOKS = ("none", "allreduce_hook", "fp16_compress_hook", "bf16_compress_hook",
         "builtin:ALLREDUCE", "builtin:FP16_COMPRESS", "powerSGD")  # fmt: skip


@scenario
def by_hand_sync_equals_ddps_own_for_every_comm_hook(info: distributed.DistInfo) -> dict[str, Any]:
    """sync_grads_now after a no_sync backward gives DDP's synced gradients, bit for bit."""
    from loopkit._parallel._grad_sync import sync_grads_now

    g = torch.Generator().manual_seed(110 + info.rank)
    xs = [torch.randn(5, 6, generator=g) for _ in range(3)]
    found: dict[str, list[float]] = {}
    for hook in HOOKS:
        # PowerSGD compresses each matrix with its own random start: one matrix, so DDP's
        # bucket rebuild (after its first synced backward) cannot reorder them.
        build = (lambda: nn.Linear(6, 5, bias=False)) if hook == "powerSGD" else mlp
        torch.manual_seed(0)
        synced = _ddp_with_hook(build(), hook)
        torch.manual_seed(0)
        by_hand = _ddp_with_hook(build(), hook)
        diffs = []
        for x in xs:  # PowerSGD: the first round all-reduces, the next two compress
            synced(x).pow(2).mean().backward()
            with loopkit.no_sync(by_hand):
                by_hand(x).pow(2).mean().backward()
            sync_grads_now(by_hand)
            pairs = zip(synced.parameters(), by_hand.parameters(), strict=True)
            diffs.append(max((a.grad - b.grad).abs().max().item() for a, b in pairs))
            for p in [*synced.parameters(), *by_hand.parameters()]:
                p.grad = None
        found[hook] = diffs
    return found


def _two_losses(out: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return (out[:, 0] - y[:, 0]).pow(2).mean(), (out[:, 1] - y[:, 1]).pow(2).mean()


def _micro_step(
    st: Any, net: Any, batch: Batch, how: str, use_a: bool | None, weighted: bool = False
) -> None:
    """One micro-step's backward passes: ``one`` (the summed loss), ``retain`` (one forward,
    two backward passes) or ``forwards`` (a forward and a backward per loss); all the same
    gradient. ``weighted``: ``weight=`` the micro-batch's size, on the first."""
    x, y = batch
    weight = x.shape[0] if weighted else None

    def forward() -> torch.Tensor:
        return net(x) if use_a is None else net(x, use_a)

    if how == "one":
        st.backward(sum(_two_losses(forward(), y)), weight=weight)
    elif how == "retain":
        first, second = _two_losses(forward(), y)
        st.backward(first, weight=weight, retain_graph=True)
        st.backward(second)
    else:
        st.backward(_two_losses(forward(), y)[0], weight=weight)
        st.backward(_two_losses(forward(), y)[1])


def _windows_reference(
    build: Callable[[], nn.Module],
    per_rank: list[list[Batch]],
    every: int,
    branchy: bool,
    weighted: bool = False,
) -> torch.Tensor:
    """One process: per window, the mean over ranks of each rank's mean micro-batch loss (or,
    weighted, the mean over every sample of the window on every rank)."""
    model: Any = build()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    n = len(per_rank[0])
    for start in range(0, n, every):
        total: Any = 0.0
        windows = [batches[start : start + every] for batches in per_rank]
        samples = sum(b[0].shape[0] for window in windows for b in window)
        for r, window in enumerate(windows):
            for x, y in window:
                out = model(x, r == 0) if branchy else model(x)
                share = x.shape[0] / samples if weighted else 1 / (len(window) * len(per_rank))
                total = total + sum(_two_losses(out, y)) * share
        total.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return flat(model)


SEVERAL_BACKWARDS = {
    # name: (accumulate, micro-batches, how micro-step i back-propagates, find_unused, hook)
    "accumulate 1, one forward two backward passes": (1, 3, lambda i: "retain", False, "count"),
    "accumulate 2, first seen on a window's last micro-step": (
        2, 6, lambda i: "retain" if i == 3 else "one", False, "count"),
    "accumulate 3, ragged, two forwards on the first window's end": (
        3, 7, lambda i: "forwards" if i == 2 else "one", False, "count"),
    "accumulate 1, rank-dependent branches": (1, 3, lambda i: "retain", True, "count"),
    "accumulate 2, built-in fp16 hook": (2, 4, lambda i: "retain", False, "builtin:FP16_COMPRESS"),
    "accumulate 3, weighted, ragged, first seen on the last micro-step": (
        3, 5, lambda i: "retain" if i == 2 else "one", False, "count"),
}  # fmt: skip


def _counting_hook(calls: list[int]) -> Any:
    """DDP's default all-reduce as a Python comm hook that records each bucket it reduces."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    # No annotations: DDP compares them with dist.GradBucket, and here they would be strings.
    def hook(state, bucket):  # type: ignore[no-untyped-def]
        calls.append(bucket.index())
        return allreduce_hook(state, bucket)

    return hook


@scenario
def several_backward_passes_on_a_synced_micro_step(info: distributed.DistInfo) -> dict[str, Any]:
    """A synced micro-step that back-propagates twice: identical replicas, the large batch."""
    found = {}
    for name, (every, n, how, branchy, hook) in SEVERAL_BACKWARDS.items():
        build: Callable[[], nn.Module] = TwoBranch if branchy else mlp
        weighted = "weighted" in name
        sizes = [[2, 7, 3, 5, 4], [9, 1, 6, 3, 8]] if weighted else [[4] * n] * 2
        per_rank = [data(sizes[r][:n], seed=120 + r) for r in range(2)]
        calls: list[int] = []
        if hook == "count":
            net: Any = nn.parallel.DistributedDataParallel(build(), find_unused_parameters=branchy)
            net.register_comm_hook(None, _counting_hook(calls))
        else:
            net = _ddp_with_hook(build(), hook)
        s = loopkit.step(net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9),
                         accumulate=every)  # fmt: skip
        per_window = []
        for i, batch in enumerate(s.iterate(per_rank[info.rank])):
            with s as st:
                use_a = (info.rank == 0) if branchy else None
                _micro_step(st, net, batch, how(i), use_a, weighted)
            if s.micro_step == 0:
                per_window.append(len(calls))
        w = flat(net.module)
        found[name] = {
            "updates": s.updates,
            "calls": per_window,
            "same": all(torch.equal(x, replicas(w)[0]) for x in replicas(w)),
            "diff": (w - _windows_reference(build, per_rank, every, branchy, weighted))
            .abs()
            .max()
            .item(),
        }
    return found


def _skipping_gan(G: Any, D: Any, batches: list[Any], every: int, stop: bool) -> dict[str, Any]:
    """D on every batch, G on each window's first batch only; until/cadence/checks after both."""
    d_step = loopkit.step(D, torch.optim.SGD(D.parameters(), lr=0.1), accumulate=every)
    g_step = loopkit.step(G, torch.optim.SGD(G.parameters(), lr=0.1), accumulate=every,
                          frozen=[D])  # fmt: skip
    gan = loopkit.steps(d_step, g_step)
    until = loopkit.until(gan, max_updates=2, signals=()) if stop else None
    every_update = loopkit.cadence(gan, updates=1)
    fired = []
    for i, (real, noise) in enumerate(gan.iterate(batches)):
        with d_step as s:
            s.backward(D(real).pow(2).mean())
        if i % every == 0:
            with g_step as s:
                s.backward(-D(G(noise)).mean())
        if every_update.due():
            fired.append(gan.updates)
        if until is not None and until.check():
            break
    return {"updates": (gan.updates, d_step.updates, g_step.updates), "fired": fired}


@scenario
def group_member_skipping_the_last_batch_under_ddp(info: distributed.DistInfo) -> dict[str, Any]:
    """until/cadence see each window's end on both ranks; the by-hand close keeps replicas equal."""
    g = torch.Generator().manual_seed(130)
    per_rank = [[(torch.randn(4, 2, generator=g), torch.randn(4, 4, generator=g))
                 for _ in range(6)] for _ in range(2)]  # fmt: skip
    G, D = _gan_models()
    got = _skipping_gan(distributed.wrap(G), distributed.wrap(D), per_rank[info.rank], 2, True)
    G_ref, D_ref = _gan_models()  # one process, both ranks' batches side by side, 2 windows
    glob = [(torch.cat([per_rank[r][k][0] for r in range(2)]),
             torch.cat([per_rank[r][k][1] for r in range(2)])) for k in range(4)]  # fmt: skip
    _skipping_gan(G_ref, D_ref, glob, 2, False)
    w = _flat_of(G, D)
    return {
        **got,
        "same": all(torch.equal(x, replicas(w)[0]) for x in replicas(w)),
        "diff": (w - _flat_of(G_ref, D_ref)).abs().max().item(),
    }


def _gan_two_g_losses(G: Any, D: Any, batches: list[Any], every: int) -> tuple[int, int]:
    """The DCGAN loop whose G back-propagates twice (adversarial, then L1 on the same fake)."""
    bce = nn.functional.binary_cross_entropy_with_logits
    d_step = loopkit.step(D, torch.optim.SGD(D.parameters(), lr=0.1), accumulate=every)
    g_step = loopkit.step(G, torch.optim.SGD(G.parameters(), lr=0.1), accumulate=every,
                          frozen=[D])  # fmt: skip
    for real, noise in loopkit.steps(d_step, g_step).iterate(batches):
        n = real.shape[0]
        with d_step as s:
            s.backward(bce(D(real), torch.ones(n, 1)))
            fake = G(noise)
            s.backward(bce(D(fake.detach()), torch.zeros(n, 1)))
        with g_step as s:
            s.backward(bce(D(fake), torch.ones(n, 1)), retain_graph=True)
            s.backward(nn.functional.l1_loss(fake, real))
    return d_step.updates, g_step.updates


@scenario
def gan_whose_generator_backs_up_twice(info: distributed.DistInfo) -> dict[str, Any]:
    """G(noise) inside D's step, G with two backward passes: trains as one process does."""
    g = torch.Generator().manual_seed(140)
    per_rank = [[(torch.randn(4, 2, generator=g), torch.randn(4, 4, generator=g))
                 for _ in range(5)] for _ in range(2)]  # fmt: skip
    glob = [(torch.cat([per_rank[r][k][0] for r in range(2)]),
             torch.cat([per_rank[r][k][1] for r in range(2)])) for k in range(5)]  # fmt: skip
    found = {}
    for every in (1, 2, 3):
        G, D = _gan_models()
        counts = _gan_two_g_losses(distributed.wrap(G), distributed.wrap(D), per_rank[info.rank],
                                   every)  # fmt: skip
        G_ref, D_ref = _gan_models()
        _gan_two_g_losses(G_ref, D_ref, glob, every)
        w = _flat_of(G, D)
        found[every] = {
            "updates": counts,
            "same": all(torch.equal(x, replicas(w)[0]) for x in replicas(w)),
            "diff": (w - _flat_of(G_ref, D_ref)).abs().max().item(),
        }
    return found


@scenario
def gradients_cleared_as_a_window_opens_are_not_its_own(
    info: distributed.DistInfo,
) -> dict[str, Any]:
    """A stray backward before a window that is reduced by hand: cleared, the window trains."""
    per_rank = [data([4] * 2, seed=150 + r) for r in range(2)]
    net: Any = distributed.wrap(mlp())
    s = loopkit.step(net, sgd(net), accumulate=3)
    mse(net, per_rank[info.rank][1]).backward()  # outside any window: never joins one
    with s as st:
        st.backward(mse(net, per_rank[info.rank][0]))
    s.flush()  # ragged, its micro-step ran under no_sync: reduced by hand
    w = flat(net)
    return {
        "updates": s.updates,
        "same": all(torch.equal(x, replicas(w)[0]) for x in replicas(w)),
        "diff": (w - reference([[per_rank[r][0] for r in range(2)]])).abs().max().item(),
    }


@scenario
def buffers_follow_rank_zero_when_windows_are_reduced_by_hand(
    info: distributed.DistInfo,
) -> dict[str, Any]:
    """BatchNorm statistics: a model reduced by hand gets rank 0's at the next window's first
    forward, as DDP's own path does (two backward passes against one, same buffers)."""
    per_rank = [data([4] * 6, seed=160 + r) for r in range(2)]
    found = {}
    for how in ("one", "retain"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 2))
        net: Any = nn.parallel.DistributedDataParallel(model)
        s = loopkit.step(net, sgd(net), accumulate=2)
        for batch in s.iterate(per_rank[info.rank]):
            with s as st:
                _micro_step(st, net, batch, how, None)
        found[how] = torch.cat([b.detach().flatten().float() for b in model.buffers()])
    return {"diff": (found["one"] - found["retain"]).abs().max().item()}


if __name__ == "__main__":
    run_scenarios(SCENARIOS)
