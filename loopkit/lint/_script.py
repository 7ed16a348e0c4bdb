"""The model the rules ask: one file's own text (``_parsed``) and what the whole program says of
it (``_program``): which of its functions run every training step or once, and whether it runs
on an accelerator. Building one program of the files checked together is ``whole_program``."""

from __future__ import annotations

import ast

from ._branches import guarded_by_mod, in_error_exit
from ._flags import in_flag_branch
from ._parsed import Loop, SourceFile
from ._program import Func, Program, Reach
from ._shape import TrainingShape
from ._syntax import dotted

__all__ = ["Loop", "Script", "whole_program"]


class Script(SourceFile):
    """One parsed file of a program; the questions the rules ask about it."""

    def __init__(self, tree: ast.Module, path: str = "<string>") -> None:
        super().__init__(tree, path)
        # Set by whole_program(): the files of one run, or this one alone.
        self.project: Program[Script] | None = None

    def _project(self) -> Program[Script]:
        if self.project is None:
            whole_program([self])
        assert self.project is not None
        return self.project

    # ---- what the program says -------------------------------------------------------

    @property
    def reached(self) -> dict[ast.AST, Reach]:
        """Functions (of any file checked with this one) that run every training step."""
        return self._project().per_step

    def reach_of(self, node: ast.AST) -> Reach | None:
        """How ``node``'s function is reached every step, if it is (and ``node`` is not
        under ``if step % N`` in it); None otherwise."""
        scope = self.scope_of(node)
        reach = self.reached.get(scope)
        if reach is None or self.guarded_by_mod(node, scope):
            return None
        return reach

    def in_flag_branch(self, node: ast.AST, func: ast.AST) -> bool:
        """Whether ``node`` runs only when a parameter of ``func`` defaulting to False/None
        is set, and only calls off the training step set it (see _flags)."""
        return in_flag_branch(self._project(), self, node, func)

    def resolve_reference(self, ref: ast.Name | ast.Attribute) -> tuple[Script, Func] | None:
        """The function a name refers to without a call (``collate_fn=utils.collate``)."""
        return self._project().resolve_reference(self, ref)

    def runs_once(self, node: ast.AST) -> bool:
        """Whether ``node`` runs once per run, outside every training loop (see _program)."""
        return self._project().runs_once(self, node)

    def callers(self, func: Func) -> list[tuple[Script, ast.Call]]:
        """The calls, in the files checked with this one, that run ``func``."""
        return self._project().callers(self, func)

    @property
    def shape(self) -> TrainingShape:
        """The training loops and the per-step ones among them (see _shape)."""
        return self._project().shape(self)

    @property
    def uses_accelerator(self) -> bool:
        """Whether this file runs on an accelerator in its program (on a CPU, syncs cost
        nothing): its own text says so, or a file that does imports it (see _program)."""
        return self._project().on_device(self)

    @property
    def default_on_device(self) -> bool:
        """Whether this file runs where new tensors are made on an accelerator by default: a
        file of the program that sets it (``torch.set_default_device("cuda")``,
        ``set_default_tensor_type(torch.cuda.FloatTensor)``) is this one or imports it, at
        any depth. Host data given to ``torch.tensor(...)`` is then copied over."""
        program = self._project()
        setters = [s for s in program.scripts if _sets_cuda_default(s)]
        return bool(setters) and id(self) in program.imported_from(setters)

    # ---- where a node runs under a branch (see _branches) ----------------------------

    def guarded_by_mod(self, node: ast.AST, stop: ast.AST) -> bool:
        """True when ``node`` runs only under an ``if`` whose test has ``%`` (below ``stop``),
        directly or through a name bound to one."""
        return guarded_by_mod(self, node, stop)

    def in_error_exit(self, node: ast.AST, stop: ast.AST) -> bool:
        """True when ``node`` is on an error path that ends the run."""
        return in_error_exit(self, node, stop)


def whole_program(scripts: list[Script]) -> Program[Script]:
    """The program of ``scripts``, checked together: each one's ``project`` is set to it."""
    program = Program(scripts)
    for script in scripts:
        script.project = program
    return program


def _sets_cuda_default(script: SourceFile) -> bool:
    for call in script.calls:
        name = (dotted(call.func) or "").rsplit(".", 1)[-1]
        defaults = name in {"set_default_device", "set_default_tensor_type"}
        if defaults and call.args and _names_cuda(script, call.args[0], 0):
            return True
    return False


def _names_cuda(script: SourceFile, value: ast.expr, depth: int) -> bool:
    """Whether a value says CUDA: ``"cuda"``, ``torch.device("cuda:0")``,
    ``torch.cuda.FloatTensor``, or a name every binding of which does."""
    if isinstance(value, ast.Name) and depth < 3:
        bound = script.bindings.get(value.id, [])
        return bool(bound) and all(
            v is not None and _names_cuda(script, v, depth + 1) for v in bound
        )
    return "cuda" in ast.unparse(value)
