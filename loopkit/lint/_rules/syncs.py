"""Rules about host-device syncs: reading a tensor back every step, moving it there and back."""

from __future__ import annotations

import ast
import itertools
from collections.abc import Iterator

from .._declaration import Hit, rule
from .._program import Reach, qualname
from .._script import Script
from .._syntax import (
    assigned_names,
    backward_tensor,
    callee,
    device_move,
    dotted,
    method,
    receiver,
    walk_scope,
    walk_stmts,
)
from ._eval_reads import eval_batch_loop, never_used, of_a_metric
from ._loss_reads import loss_as_value, test_of
from ._sync_reads import (
    feeds_an_environment,
    feeds_per_sample_loop,
    from_loader_only,
    gradient_tensors,
    host_built,
    names_in,
    reads_device,
    reads_explicitly,
    straight_from_loader,
    tensor_branch_never_taken,
    tensor_truth,
)


@rule(
    "LK002",
    theme="syncs",
    flags="`.item()`/`.cpu()`/`.numpy()`/`.tolist()` every step, not under `if step % N`, "
    "also in the functions and methods a training step calls (reported with the call chain)",
    why="each one is a host-device sync that stalls the host until the GPU has caught up, "
    "every step",
    fix="log = loopkit.detach_logging(every=N); log(loss=loss)  # one sync per N steps",
)
def sync_every_step(script: Script) -> Iterator[Hit]:
    yield from _syncs_in_called_functions(script)
    if not script.uses_accelerator:
        return  # a CPU-only script: reading a CPU tensor waits for nothing
    shape = script.shape
    for call in script.calls:
        name = method(call)
        if not reads_device(call):
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
        if script.guarded_by_mod(call, stop) or script.in_error_exit(call, stop):
            continue  # once per N steps; an error path that ends the run (read once)
        if isinstance(step_loop, ast.For | ast.AsyncFor) and straight_from_loader(call, step_loop):
            continue
        if host_built(script, call) or feeds_an_environment(script, call):
            continue
        where = "a training loop" if step_loop is not None else "a per-step training function"
        yield call, f"`.{name}()` every step in {where}"


def _syncs_in_called_functions(script: Script) -> Iterator[Hit]:
    """LK002 through calls: a read in a function or method that a training step calls (at
    any depth, not under ``if step % N`` anywhere on the way), reported at its own line with
    the chain of calls that reaches it. Its own loops count too: a read per parameter is
    one sync per parameter per step."""
    for call in script.calls:
        name = method(call)
        if not reads_device(call) or (name == "cpu" and script.uses_rpc):
            continue
        reach = script.reach_of(call)
        if reach is None or script.scope_of(call) in script.shape.called_step_funcs:
            continue  # not run per step, or a step function's own read (reported above)
        if any(loop in script.shape.step_loops for loop in script.loops_of(call)):
            continue  # its own training loop: reported above
        if script.in_error_exit(call, script.scope_of(call)):
            continue  # `raise ValueError(f"... {x.item()}")`: an error path, read once
        if tensor_branch_never_taken(script, call):
            continue  # `if isinstance(v, Tensor): v = v.item()`, only ever given floats
        if host_built(script, call) or feeds_an_environment(script, call):
            continue
        if not script.uses_accelerator:
            continue  # the program's: a helper runs on the device of the script importing it
        yield (
            call,
            f"`.{name}()` every step in `{qualname(script, script.scope_of(call))}`, "
            + (reach.describe()),
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
    flags="`.item()`/`.cpu()`/`float(t)`, or an `assert` on a tensor, per batch in an "
    "evaluation loop (no backward, "
    "autograd off or an eval function) that runs periodically: per epoch, or a script that "
    "only evaluates; not a one-off pass after training, nor a per-sample Python loop",
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
        # metric.add_batch(predictions=..., references=...) (Hugging Face evaluate) converts
        # its device tensors to host lists: a read per batch too.
        adds = name == "add_batch" and "metric" in (dotted(receiver(call)) or "").lower()
        if not (is_float or adds or reads_device(call)):
            continue
        if not adds and not of_a_metric(script, call) and not never_used(script, call):
            continue  # a generated token, a picture: not what evaluate sums
        loop = eval_batch_loop(script, call)
        if loop is None:
            continue
        loops = script.loops_of(call)
        if isinstance(loop, ast.For | ast.AsyncFor) and straight_from_loader(call, loop):
            continue
        if feeds_per_sample_loop(script, call, loops):
            continue
        what = "float(...)" if is_float else f"{dotted(call.func)}(...)" if adds else f".{name}()"
        yield call, f"`{what}` per batch in an evaluation loop"
    # assert (pred >= 0).all(): Python takes the truth of a device tensor, per batch.
    for node in script.nodes:
        test = node.test if isinstance(node, ast.Assert) else None
        if test is not None and tensor_truth(test) and eval_batch_loop(script, node) is not None:
            yield node, f"`assert {ast.unparse(test)[:40]}` per batch in an evaluation loop"


@rule(
    "LK016",
    theme="syncs",
    flags="the loss tensor used as a Python value every step: a branch on it (`if loss < best:`, "
    "`assert loss > 0`), `float(loss)` or `float(torch.exp(loss))`, formatted into a string "
    "(an f-string, a progress bar's description) or handed to a tracker (`wandb.log`, "
    "`add_scalar`)",
    why="Python needs the value on the host, so the host waits for the device every step",
    fix="log = loopkit.detach_logging(every=N); log(loss=loss)  # decide on the flushed values",
)
def branch_on_loss(script: Script) -> Iterator[Hit]:
    if not script.uses_accelerator:
        return
    for loop in script.shape.step_loops:
        body = list(walk_stmts(getattr(loop, "body", [])))
        losses = loss_names(script, body)
        for node in body:
            if script.loops_of(node)[:1] != [loop] or script.guarded_by_mod(node, loop):
                continue
            found = loss_as_value(node, losses)
            if found is not None:
                yield node, found


def loss_names(script: Script, body: list[ast.AST]) -> set[str]:
    """The tensors back-propagated by name in a loop body: ``loss`` in ``loss.backward()``,
    ``accelerator.backward(loss)`` or ``scaler.scale(loss).backward()`` (never the
    ``accelerator``: the object whose backward it is holds no loss), less names rebound to a
    value that holds no graph (``loss = loss.item()``)."""
    losses: set[str] = set()
    for node in body:
        if isinstance(node, ast.Call) and method(node) == "backward":
            tensor = backward_tensor(node)
            if isinstance(tensor, ast.List | ast.Tuple) and len(tensor.elts) == 1:
                tensor = tensor.elts[0]  # dist_autograd.backward(cid, [loss])
            if isinstance(tensor, ast.Name):
                losses.add(tensor.id)
    return losses - {
        n for node in body for n, v in assigned_names(node) if script.holds_no_graph(v)
    }


@rule(
    "LK017",
    theme="syncs",
    flags="`torch.cuda.synchronize()` every step, in a training loop or a function it calls",
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
            continue
        # In a function or method a training step calls (not under `% N` on the way, nor
        # under a timing/debug flag in it): every step too. A synchronize that times a
        # benchmark outside the loop is reached by no step.
        reach = script.reach_of(call)
        scope = script.scope_of(call)
        if reach is not None and not _opted_in(script, call, scope):
            yield (
                call,
                (
                    f"`{ast.unparse(call.func)}()` every step in `{qualname(script, scope)}`, "
                    + reach.describe()
                ),
            )


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


@rule(
    "LK021",
    theme="syncs",
    flags="an implicit `bool()` of a tensor every step: `if torch.isnan(x):`, "
    "`while t.any():`, `assert (x > 0).all()` in a training step (or a function it calls)",
    why="Python needs the tensor's truth on the host, so the host waits for the device every "
    "step, just like an explicit .item()",
    fix="check on the device and read rarely: bad = torch.isnan(x).any(); "
    "log = loopkit.detach_logging(every=N); log(nan=bad)",
)
def implicit_bool(script: Script) -> Iterator[Hit]:
    seen: set[int] = set()
    for node, losses, stop, reach in _step_nodes(script):
        if not script.uses_accelerator:
            continue  # a CPU-only script: the truth of a CPU tensor waits for nothing
        where = "" if reach is None else f" in `{qualname(script, stop)}`, {reach.describe()}"
        test = test_of(node)
        if test is None or id(node) in seen or script.guarded_by_mod(node, stop):
            continue
        seen.add(id(node))
        if names_in(test) & losses or reads_explicitly(test):
            continue  # on the loss: LK016's; an explicit .item(): LK002's
        loop = next(iter(script.loops_of(node)), None)
        if (
            isinstance(loop, ast.For | ast.AsyncFor)
            and loop in script.shape.step_loops
            and from_loader_only(test, loop)
        ):
            continue  # a batch straight from the loader is in host memory
        if tensor_truth(test, gradient_tensors(script.scope_of(node))):
            yield (
                node,
                f"`{ast.unparse(test)[:40]}`: an implicit bool() of a tensor every step{where}",
            )


def _step_nodes(script: Script) -> Iterator[tuple[ast.AST, set[str], ast.AST, Reach | None]]:
    """(node, loss names, where a `% N` guard would stop, how it is reached) for every node
    that runs per step: in a step loop, a one-step function, or a function a step calls."""
    for loop in script.shape.step_loops:
        body = list(walk_stmts(getattr(loop, "body", [])))
        losses = loss_names(script, body)
        for node in body:
            yield node, losses, loop, None
    for func in script.shape.called_step_funcs:
        body = list(walk_scope(func))
        losses = loss_names(script, body)
        for node in body:
            yield node, losses, func, None
    for func, reach in script.reached.items():
        if func in script.parents:  # one of this file's functions
            for node in walk_scope(func):
                yield node, set(), func, reach
