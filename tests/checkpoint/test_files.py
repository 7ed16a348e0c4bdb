"""Checkpoint files on disk when things go wrong: a disk that refuses the writes, a writer
killed in the middle of replacing a checkpoint directory.

A full disk is a file-size cap here (``RLIMIT_FSIZE``, ``SIGXFSZ`` ignored: a write past it
fails with ``EFBIG``, as a full disk's does with ``ENOSPC``), set in a child process.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from helpers import ROOT, deep, launch_env

CAPPED = r"""
import resource, signal
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
HARD = resource.getrlimit(resource.RLIMIT_FSIZE)[1]

def cap(n):
    resource.setrlimit(resource.RLIMIT_FSIZE, (n, HARD))
"""

BUILD = r"""
import torch
from torch import nn
import loopkit

def build(d, async_save=False, shard=False):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 1))  # ~800 kB saved
    if shard:
        from torch.distributed.fsdp import fully_shard
        for m in (model[0], model[2], model):
            fully_shard(m)
    step = loopkit.step(model, torch.optim.AdamW(model.parameters()))
    with step as s:
        s.backward(model(torch.randn(4, 64)).pow(2).mean())
    return model, step, loopkit.Checkpointer(d, model=model, step=step, async_save=async_save)
"""

FULL_DISK = r"""
import hashlib, json, sys, threading
from pathlib import Path
import torch.distributed as dist

root = Path(sys.argv[1])

def names(d):  # the checkpoints and leftovers, not the job's owner record (``_owner``)
    return sorted(p.name for p in d.iterdir() if not p.name.startswith(".loopkit-owner"))

def digest(p):
    parts = sorted(p.rglob("*")) if p.is_dir() else [p]
    return hashlib.sha256(b"".join(q.name.encode() + q.read_bytes() for q in parts
                                   if q.is_file())).hexdigest()

out = {}
for kind in ("file", "sharded"):
    if kind == "sharded":  # FSDP2 over one rank: its shards are written by DCP
        dist.init_process_group("gloo", init_method=f"file://{root / 'store'}", rank=0,
                                world_size=1)
    d = root / kind
    model, step, ckpt = build(d, shard=kind == "sharded")
    first = ckpt.save()
    before = digest(first)
    with step as s:
        s.backward(model(torch.randn(4, 64)).pow(2).mean())
    cap(64 << 10)
    try:
        ckpt.save()
        out[kind] = None
    except OSError as err:
        out[kind] = [err.errno, str(err)]
    cap(HARD)
    out[kind + "_left"] = names(d)
    out[kind + "_same"] = digest(first) == before
d = root / "async"
model, step, ckpt = build(d, async_save=True)
cap(64 << 10)
ckpt.save()
for t in threading.enumerate():  # the write has failed before the loop goes on
    if t.name.startswith("loopkit save"):
        t.join()
cap(HARD)
try:
    ckpt.maybe_save(every=1)
    out["async"] = None
except RuntimeError as err:
    out["async"] = str(err)
out["async_left"] = names(d)
again = ckpt.save_if_needed()
ckpt.wait()
out["async_again"] = None if again is None else again.name
out["async_after"] = names(d)
model, step, ckpt = build(root / "unwaited", async_save=True)
ckpt.save()  # written fine, and nothing waits for it: the process ends with 0
print(json.dumps(out), flush=True)
"""

AT_EXIT = r"""
import atexit, sys
atexit.register(print, "an exit handler of the program ran")
how = sys.argv[2]
model, step, ckpt = build(sys.argv[1], async_save=True)
cap(64 << 10)
if how == "setup":  # one process: teardown waits for the save and raises its failure
    from loopkit import distributed
    with distributed.setup():
        ckpt.save()
else:
    ckpt.save()  # nothing waits for it
print("the program ended", flush=True)
"""


def _child(code: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", code, *args], cwd=ROOT, env=launch_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip


def test_a_full_disk_names_the_checkpoint_and_the_cause_and_leaves_nothing(tmp_path: Path) -> None:
    """A save the disk refuses, one file and sharded (FSDP2 on a one-rank group): an
    OSError with errno EFBIG naming the checkpoint's path and "File too large" (not torch's
    "unexpected pos"); no temporary left, the previous checkpoint byte for byte as it was.
    In the background (one process) the failure is raised by the next maybe_save, naming
    the path; save_if_needed() then writes that update. A background save written fine
    that nothing waits for ends the program with status 0, on disk."""
    proc = _child(CAPPED + BUILD + FULL_DISK, str(tmp_path))
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0 and "loopkit" not in stderr, stderr[-3000:]
    assert (tmp_path / "unwaited" / "ckpt-0000000001.pt").is_file()
    out: dict[str, Any] = json.loads(stdout.splitlines()[-1])
    for kind, first, second in (("file", "ckpt-0000000001.pt", "ckpt-0000000002.pt"),
                                ("sharded", "ckpt-0000000001", "ckpt-0000000002")):  # fmt: skip
        errno, said = out[kind]
        assert errno == 27 and f"the checkpoint {tmp_path / kind / second}" in said, said
        assert "File too large" in said and "unexpected pos" not in said
        assert out[kind + "_left"] == [first] and out[kind + "_same"]
    path = tmp_path / "async" / "ckpt-0000000001.pt"
    assert f"{path}" in out["async"] and "File too large" in out["async"], out["async"]
    assert out["async_left"] == []
    assert out["async_again"] == path.name and out["async_after"] == [path.name]


@deep
def test_a_failed_background_save_nothing_waits_for_ends_the_process_with_status_1(
    tmp_path: Path,
) -> None:
    """async_save=True, the disk refusing the write, the program ending without waiting:
    exit status 1, the message naming the checkpoint and "File too large", the program's
    own exit handlers run once. Inside `with distributed.setup():` its teardown raises it
    (status 1 too)."""
    runs = {how: _child(CAPPED + BUILD + AT_EXIT, str(tmp_path / how), how)
            for how in ("unwaited", "setup")}  # fmt: skip
    ended = {how: (p.wait(timeout=120), *p.communicate()) for how, p in runs.items()}
    for how in ("unwaited", "setup"):
        status, stdout, stderr = ended[how]
        path = tmp_path / how / "ckpt-0000000001.pt"
        assert status == 1 and f"{path}" in stderr and "File too large" in stderr, stderr
        assert stdout.count("an exit handler of the program ran") == 1, stdout
        assert not path.exists() and not list((tmp_path / how).glob(".ckpt-*"))
    assert "the program ended" in ended["unwaited"][1]


KILLED = r"""
import json, os, signal, sys
from pathlib import Path
from loopkit._checkpoint import _files as files

root = Path(sys.argv[1])

def checkpoint(d, tag):  # a checkpoint directory: its loop.pt and a shard
    d.mkdir()
    (d / "loop.pt").write_text(tag)
    (d / "__0_0.distcp").write_text(tag * 1000)

out = {}
for point in ("aside", "renamed", "deleting"):
    d = root / point
    d.mkdir()
    path = d / "ckpt-0000000004"
    checkpoint(path, "old")
    tmp = d / ".ckpt-0000000004.tmp-host-1-00000000"
    checkpoint(tmp, "new")
    pid = os.fork()
    if pid == 0:  # the writer, killed at ``point``
        rename, remove = os.rename, files.remove

        def killed_after(src, dst):
            rename(src, dst)
            if (point == "aside") == (".old-" in str(dst)):
                os.kill(os.getpid(), signal.SIGKILL)

        def killed_during(p):
            (p / "__0_0.distcp").unlink()
            os.kill(os.getpid(), signal.SIGKILL)

        os.rename, files.remove = killed_after, killed_during
        files.replace_dir(tmp, path)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    listed = [p.name for p in files.checkpoints(d)]
    files.restore_replaced(d)  # what a resume does first
    files.remove_stale_temporaries(d)
    out[point] = {
        "killed": os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL,
        "listed": listed, "after": sorted(p.name for p in d.iterdir()),
        "holds": [(path / n).read_text()[:3] for n in ("loop.pt", "__0_0.distcp")],
    }
print(json.dumps(out))
"""


def test_a_checkpoint_directory_replaced_by_a_writer_killed_anywhere_is_one_whole(
    tmp_path: Path,
) -> None:
    """replace_dir (a sharded checkpoint saved again at its update) SIGKILLed right after
    the old directory went aside, right after the new one took the name, and in the middle
    of deleting the old one: then, as a resume does, the name holds one whole checkpoint
    (the old one where the new never took the name, else the new one) and nothing else is
    left in the directory."""
    proc = _child(KILLED, str(tmp_path))
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr[-3000:]
    out = json.loads(stdout.splitlines()[-1])
    assert all(found["killed"] for found in out.values()), out
    assert out["aside"]["listed"] == []  # killed between the renames: restored below
    for point, holds in (("aside", "old"), ("renamed", "new"), ("deleting", "new")):
        assert out[point]["after"] == ["ckpt-0000000004"], out[point]
        assert out[point]["holds"] == [holds, holds], out[point]
