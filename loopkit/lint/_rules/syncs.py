"""Rules about host-device syncs: reading a tensor back every step, moving it there and back."""

from __future__ import annotations

import ast
import itertools
from collections.abc import Iterator

from .._rule import Hit, rule
from .._script import Script
from .._syntax import (
    assigned_names,
    callee,
    device_move,
    dotted,
    method,
    receiver,
    root_name,
    walk_stmts,
)

# The tensor methods that copy to the host and wait for the device.
_SYNCS = frozenset({"item", "cpu", "numpy", "tolist"})


@rule(
    "LK002",
    theme="syncs",
    flags="`.item()`/`.cpu()`/`.numpy()`/`.tolist()` every step, not under `if step % N`",
    why="each one is a host-device sync that stalls the host until the GPU has caught up, "
    "every step",
    fix="log = loopkit.detach_logging(every=N); log(loss=loss)  # one sync per N steps",
)
def sync_every_step(script: Script) -> Iterator[Hit]:
    if not script.uses_accelerator:
        return  # a CPU-only script: reading a CPU tensor waits for nothing
    shape = script.shape
    for call in script.calls:
        name = method(call)
        if name not in _SYNCS or call.args:
            continue  # numpy's arr.item(0) and friends take arguments; torch's do not
        if name == "cpu" and script.uses_rpc:
            continue  # RPC sends tensors through the host: the copy is the transport
        loops = script.loops_of(call)
        step_loop = next((loop for loop in loops if loop in shape.step_loops), None)
        if step_loop is not None:
            stop: ast.AST = step_loop
        else:
            scope = script.scope_of(call)
            if scope not in shape.called_step_funcs:
                continue
            stop = scope
        if script.guarded_by_mod(call, stop):
            continue
        if isinstance(step_loop, ast.For | ast.AsyncFor) and _straight_from_loader(call, step_loop):
            continue
        where = "a training loop" if step_loop is not None else "a per-step training function"
        yield call, f"`.{name}()` every step in {where}"


def _straight_from_loader(call: ast.Call, loop: ast.For | ast.AsyncFor) -> bool:
    """True for ``y.numpy()`` on a batch the loop gets from the loader (host memory)."""
    root = root_name(receiver(call))
    targets = {n.id for n in ast.walk(loop.target) if isinstance(n, ast.Name)}
    if root is None or root not in targets:
        return False
    return not any(
        name == root for node in walk_stmts(loop.body) for name, _ in assigned_names(node)
    )


@rule(
    "LK005",
    theme="syncs",
    flags="`.cpu()` then `.cuda()` on the same tensor",
    why="moving a tensor to the host and back costs two copies and a sync for nothing",
    fix="keep it on one device: batch = loopkit.to_device(batch, device) once per step",
)
def host_round_trip(script: Script) -> Iterator[Hit]:
    # An expression that goes to the host and back: x.cpu().cuda(), from_numpy(..).cuda().
    for call in script.calls:
        parent = script.parents.get(call)
        if isinstance(parent, ast.Attribute) and isinstance(script.parents.get(parent), ast.Call):
            continue  # not the outermost call of its chain
        moves = _moves(call)
        if any(a != b for a, b in itertools.pairwise(moves)):
            yield call, "a tensor moved between the host and the device and back"
    # In one loop body the same tensor goes x.cpu() ... x.cuda() (or the other way).
    per_loop: dict[tuple[ast.AST, str], list[tuple[int, int, str, ast.Call]]] = {}
    for call in script.calls:
        move = method(call)
        name = dotted(receiver(call))
        loops = script.loops_of(call)
        # A move under `if step % N == 0:` (a periodic snapshot) is rare enough to be fine.
        if move in {"cpu", "cuda"} and name and loops:
            if script.guarded_by_mod(call, loops[0]):
                continue
            per_loop.setdefault((loops[0], name), []).append(
                (call.lineno, call.col_offset, move or "", call)
            )
    for (_, name), moves_seen in per_loop.items():
        moves_seen.sort(key=lambda m: (m[0], m[1]))
        for (_, _, before, _), (_, _, now, call) in itertools.pairwise(moves_seen):
            if before != now:
                yield call, f"`{name}` moved with both .cpu() and .cuda()"


def _moves(node: ast.AST) -> list[str]:
    """The device moves along one expression, outermost first."""
    moves: list[str] = []
    while isinstance(node, ast.Call):
        if callee(node) in {"from_numpy", "as_tensor", "tensor"} and node.args:
            node = node.args[0]  # torch.from_numpy(x.cpu().numpy()): the copy goes on
        elif isinstance(node.func, ast.Attribute):
            move = device_move(node)
            if move is not None:
                moves.append(move)
            node = node.func.value
        else:
            break
    return moves


# -- in evaluation loops, on the loss, explicit --------------------------------------------


@rule(
    "LK014",
    theme="syncs",
    flags="`.item()`/`.cpu()`/`float(t)` per batch in an evaluation loop (no backward, "
    "autograd off or an eval function)",
    why="each one waits for the device, once per evaluation batch (nanoGPT's estimate_loss: "
    "200 host syncs per evaluation)",
    fix="result = loopkit.evaluate(model, loader, fn)  # sums on the device, one read at the end",
)
def sync_per_eval_batch(script: Script) -> Iterator[Hit]:
    if not script.uses_accelerator:
        return
    for call in script.calls:
        name = method(call)
        is_float = (
            callee(call) == "float"
            and isinstance(call.func, ast.Name)
            and len(call.args) == 1
            and not isinstance(call.args[0], ast.Constant)
        )
        if not (is_float or (name in _SYNCS and not call.args)):
            continue
        if not _of_a_metric(script, call):
            continue  # a generated token, a picture: not what evaluate sums
        loops = script.loops_of(call)
        if not loops or any(loop in script.shape.training for loop in loops):
            continue
        loop = loops[0]
        if not script.evaluates(loop) or script.guarded_by_mod(call, loop):
            continue
        if isinstance(loop, ast.For | ast.AsyncFor) and _straight_from_loader(call, loop):
            continue
        what = "float(...)" if is_float else f".{name}()"
        yield call, f"`{what}` per batch in an evaluation loop"


@rule(
    "LK016",
    theme="syncs",
    flags="Python control flow on the loss tensor every step (`if loss < best:`, `float(loss)`)",
    why="the branch needs the value on the host, so the host waits for the device every step",
    fix="log = loopkit.detach_logging(every=N); log(loss=loss)  # decide on the flushed values",
)
def branch_on_loss(script: Script) -> Iterator[Hit]:
    if not script.uses_accelerator:
        return
    for loop in script.shape.step_loops:
        body = list(walk_stmts(getattr(loop, "body", [])))
        # The tensors back-propagated by name in this loop (`loss.backward()`).
        losses = {
            r.id
            for node in body
            if isinstance(node, ast.Call)
            and method(node) == "backward"
            and isinstance(r := receiver(node), ast.Name)
        }
        losses -= {n for node in body for n, v in assigned_names(node) if script.holds_no_graph(v)}
        for node in body:
            if script.loops_of(node)[:1] != [loop] or script.guarded_by_mod(node, loop):
                continue
            reads = any(
                isinstance(n, ast.Call) and (method(n) in _SYNCS or callee(n) == "float")
                for n in ast.walk(node.test if isinstance(node, ast.If | ast.While) else node)
            )  # an explicit read is LK002's
            if isinstance(node, ast.If | ast.While) and _names(node.test) & losses and not reads:
                yield node, f"`{ast.unparse(node.test)[:40]}`: a branch on the loss tensor"
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in {"float", "bool", "int"}
                and node.args
                and _names(node.args[0]) & losses
                and not isinstance(node.args[0], ast.Call)
            ):
                yield node, f"`{node.func.id}({ast.unparse(node.args[0])})` on the loss tensor"


@rule(
    "LK017",
    theme="syncs",
    flags="`torch.cuda.synchronize()` in a training loop",
    why="it stops the host until every queued kernel has finished, every step, so the host "
    "can no longer run ahead of the device",
    fix="remove it; to time the loop use loopkit.doctor(), which syncs on sampled steps only",
)
def synchronize_in_loop(script: Script) -> Iterator[Hit]:
    for call in script.calls_to("synchronize"):
        loops = script.loops_of(call)
        # Every step: in a step loop (once per benchmark stage or epoch is a timing point).
        if (
            loops
            and loops[0] in script.shape.step_loops
            and not script.guarded_by_mod(call, loops[0])
            and not _opted_in(script, call, loops[0])
        ):
            yield call, f"`{ast.unparse(call.func)}()` inside a training loop"


def _opted_in(script: Script, node: ast.AST, stop: ast.AST) -> bool:
    """Under `if args.synchronize_step:` (or a debug/profile/timing flag): asked for."""
    parent = script.parents.get(node)
    while parent is not None and parent is not stop:
        if isinstance(parent, ast.If):
            words = {
                (n.id if isinstance(n, ast.Name) else n.attr).lower()
                for n in ast.walk(parent.test)
                if isinstance(n, ast.Name | ast.Attribute)
            }
            if any(w in word for word in words for w in ("sync", "debug", "profil", "bench")):
                return True
        parent = script.parents.get(parent)
    return False


_METRIC_WORDS = ("loss", "acc", "correct", "err", "metric", "top", "prec", "nll", "ppl", "score")


def _of_a_metric(script: Script, call: ast.Call) -> bool:
    """Whether the value read back is a metric: a loss, an accuracy, a count of correct..."""
    parts: list[ast.AST] = [call.args[0] if callee(call) == "float" else receiver(call) or call]
    stmt: ast.AST | None = call
    while stmt is not None and not isinstance(stmt, ast.stmt):
        stmt = script.parents.get(stmt)
    if isinstance(stmt, ast.Assign):
        parts.extend(stmt.targets)
    elif isinstance(stmt, ast.AugAssign | ast.AnnAssign):
        parts.append(stmt.target)
    words = {
        (n.id if isinstance(n, ast.Name) else n.attr).lower()
        for part in parts
        for n in ast.walk(part)
        if isinstance(n, ast.Name | ast.Attribute)
    }
    return any(w in word for word in words for w in _METRIC_WORDS)


def _names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
