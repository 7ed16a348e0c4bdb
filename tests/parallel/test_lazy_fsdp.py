"""loopkit never imports torch.distributed.fsdp (about 1.6 s) for a model that is not FSDP."""

from __future__ import annotations

import subprocess
import sys

from helpers import ROOT, deep

# torch's optimizers import torch._dynamo, which imports FSDP, so "is it in sys.modules" says
# nothing about loopkit. The script forgets the FSDP modules, then records every import of
# one whose direct importer (the first frame outside importlib) is loopkit's own code.
_SCRIPT = r"""
import importlib.abc, sys, torch

m = torch.nn.Linear(8, 1)
opt = torch.optim.SGD(m.parameters(), lr=0.1)
for name in [k for k in sys.modules if k.startswith("torch.distributed.fsdp")]:
    del sys.modules[name]
loopkit_imports = []

class Watch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.startswith("torch.distributed.fsdp"):
            frame = sys._getframe(1)
            while frame is not None and "importlib" in frame.f_code.co_filename:
                frame = frame.f_back
            if frame is not None and "/loopkit/" in frame.f_code.co_filename:
                loopkit_imports.append((name, frame.f_code.co_filename))
                raise ImportError(name)  # never load FSDP twice in one process
        return None

sys.meta_path.insert(0, Watch())
import loopkit
step = loopkit.step(m, opt, accumulate=2)
for _ in range(2):
    with step as s:
        s.backward(m(torch.randn(4, 8)).pow(2).mean())
assert step.updates == 1
print(loopkit_imports)
"""


@deep
def test_a_step_on_a_plain_module_imports_no_fsdp_module() -> None:
    """Building loopkit.step for a plain module and running a window imports nothing under
    torch.distributed.fsdp (it did at import of loopkit's gradient-sync module)."""
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]", proc.stdout


def test_fsdp_types_are_seen_once_the_package_is_loaded() -> None:
    """The lazy lookup still recognises FSDP: with the package loaded, its classes come back."""
    import torch.distributed.fsdp as fsdp

    from loopkit._parallel._grad_sync import _fsdp_types

    assert _fsdp_types() == (fsdp.FSDPModule, fsdp.FullyShardedDataParallel)
