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
    shape = script.shape
    for call in script.calls:
        name = method(call)
        if name not in _SYNCS or call.args:
            continue  # numpy's arr.item(0) and friends take arguments; torch's do not
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
