"""The bad-input catalogue: every public entry point refuses wrong input clearly.

Each row is a wrong call, the exception type it must raise, and a piece of the message
that tells the user how to fix it. A hypothesis fuzz then throws arbitrary argument
combinations at the constructors: they either work or raise TypeError, ValueError or
RuntimeError (never an AttributeError or KeyError from deep inside).
"""

from __future__ import annotations

import contextlib
import math
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import Store, StreamWithLen, mlp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import loopkit
from loopkit import distributed

ALLOWED = (TypeError, ValueError, RuntimeError)


def _opt(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1)


def _same_ema_twice() -> None:
    model, opt = _model_opt()
    average = loopkit.ema(model)
    loopkit.step(model, opt, ema=[average, average])


def _ema_swapped_elsewhere() -> None:
    with loopkit.ema(mlp()).swapped(nn.Linear(2, 2)):
        pass


def _on_meta(build: Callable[[], nn.Module]) -> nn.Module:
    with torch.device("meta"):
        return build()


def _setup_under_srun(**changes: str) -> None:
    """distributed.setup() in a task of an srun step of 2 tasks, its variables changed."""
    import os
    from unittest import mock

    task = {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_LOCALID": "1",
            "SLURM_NTASKS": "2", "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_TASKS_PER_NODE": "2",
            "SLURM_STEP_NODELIST": "node[1-2]"}  # fmt: skip
    launch = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in launch} | task | changes
    with mock.patch.dict(os.environ, env, clear=True):
        distributed.setup()


def _model_opt() -> tuple[nn.Module, torch.optim.Optimizer]:
    m = mlp()
    return m, _opt(m)


def _probe_too_small() -> None:
    m = mlp()
    loopkit.probe_micro_batch(m, _opt(m), lambda m, b: m(b).sum(), torch.ones(4, 8), smallest=8)


class _OwnRates:
    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    def step(self) -> None:
        """Sets rates of its own."""


def _scale_own_rates() -> None:
    o = _opt(mlp())
    loopkit.scale_lr(o, _OwnRates(o), from_batch=8, to_batch=16)


def _tracker_config_changed(tmp: Path) -> None:
    sink = loopkit.CSVSink(tmp / "m.csv")
    sink.config({"lr": 0.1})
    sink.config({"lr": 0.2})


def _tracker_resumed_late(tmp: Path) -> None:
    sink = loopkit.CSVSink(tmp / "m.csv")
    sink({"loss": 1.0}, step=1)
    sink.load_state_dict({"run_id": "x", "last_step": 0})


def _user_steps_owned_optimizer() -> None:
    m, o = _model_opt()
    s = loopkit.step(m, o, accumulate=2)
    with s as st:
        st.backward(m(torch.ones(2, 8)).sum())
    o.step()


def _user_steps_owned_scheduler() -> None:
    m, o = _model_opt()
    sched = torch.optim.lr_scheduler.StepLR(o, 1)
    s = loopkit.step(m, o, scheduler=sched)
    for _ in range(2):
        with s as st:
            st.backward(m(torch.ones(2, 8)).sum())
        sched.step()


def _user_zeroes_window() -> None:
    m, o = _model_opt()
    s = loopkit.step(m, o, accumulate=2)
    for _ in range(2):
        with s as st:
            st.backward(m(torch.ones(2, 8)).sum())
        o.zero_grad()


def _acc_backward_outside() -> None:
    m, o = _model_opt()
    loopkit.accumulate(m, o, every=2).backward(m(torch.ones(1, 8)).sum())


def _step_backward_outside() -> None:
    m, o = _model_opt()
    loopkit.step(m, o, accumulate=2).backward(m(torch.ones(1, 8)).sum())


def _acc_reenter() -> None:
    m, o = _model_opt()
    acc = loopkit.accumulate(m, o, every=2)
    with acc, acc:
        pass


def _acc_flush_inside() -> None:
    m, o = _model_opt()
    acc = loopkit.accumulate(m, o, every=2)
    with acc:
        acc.flush()


def _amp_step_unscaled() -> None:
    m, o = _model_opt()
    amp = loopkit.autocast_step("fp16", device_type="cpu")
    m(torch.ones(1, 8)).sum().backward()
    amp.step(o)


def _amp_step_nothing() -> None:
    loopkit.autocast_step("bf16", device_type="cpu").step()


def _step_log_metrics_without_log() -> None:
    m, o = _model_opt()
    with loopkit.step(m, o) as s:
        s.log_metrics(x=1.0)


def _checkpointer(tmp: Path, **kw: Any) -> loopkit.Checkpointer:
    m, o = _model_opt()
    return loopkit.Checkpointer(tmp, **{"model": m, "optimizer": o, **kw})


def _accumulate_with_plateau() -> None:
    m, o = _model_opt()
    loopkit.accumulate(m, o, 2, scheduler=torch.optim.lr_scheduler.ReduceLROnPlateau(o))


def _maybe_save_zero(tmp: Path) -> None:
    m, o = _model_opt()
    loopkit.Checkpointer(tmp, model=m, step=loopkit.step(m, o)).maybe_save(every=0)


# -- helpers for the rows issue 11 added (edges found by fuzzing and by porting scripts) --


class _UncopyableMap(Store):
    def __copy__(self) -> Any:
        raise RuntimeError("holds an open file")


def _doctor_device_inside() -> None:
    doc = loopkit.doctor()
    with doc:
        doc.device = "cpu"


def _syncs_reenter() -> None:
    with loopkit.count_host_syncs() as syncs:
        syncs.__enter__()


def _log_changes_device() -> None:
    log = loopkit.detach_logging(every=None, sink=None)
    log(x=torch.tensor(1.0))
    log(x=torch.tensor(1.0, device="meta"))


def _checkpoint_inside_compiled() -> None:
    m = mlp()
    m.compile(backend="eager")
    loopkit.checkpointed(m, blocks=nn.Linear)


def _saved_step_checkpoint(tmp: Path, every: int = 2, precision: str = "fp32") -> Path:
    m, o = _model_opt()
    s = loopkit.step(m, o, accumulate=every, precision=precision)
    for _ in range(every):
        with s as st:
            st.backward(m(torch.ones(2, 8)).sum())
    path = loopkit.Checkpointer(tmp, model=m, optimizer=o, step=s).save()
    assert path is not None
    return path


def _adopt_after_checkpoint(tmp: Path) -> None:
    _saved_step_checkpoint(tmp, every=1)
    m, o = _model_opt()
    loopkit.Checkpointer(tmp, model=m, optimizer=o, step=loopkit.step(m, o)).adopt(updates=5)


def _ema_adopt_missing(model: nn.Module) -> None:
    saved = dict(model.state_dict())
    saved.pop(next(iter(saved)))
    loopkit.ema(model).adopt(saved, updates=3)


def _resume_with(tmp: Path, **step_kw: Any) -> None:
    path = _saved_step_checkpoint(tmp)
    m, o = _model_opt()
    step = loopkit.step(m, o, **{"accumulate": 2, **step_kw})
    loopkit.Checkpointer(tmp, model=m, optimizer=o, step=step).resume(path)


def _resume_incomplete(tmp: Path) -> None:
    state = torch.load(_saved_step_checkpoint(tmp), weights_only=True)
    del state["rng"]
    torch.save(state, tmp / "incomplete.pt")
    m, o = _model_opt()
    step = loopkit.step(m, o, accumulate=2)
    loopkit.Checkpointer(tmp, model=m, optimizer=o, step=step).resume(tmp / "incomplete.pt")


def _owned_by_another_job(tmp: Path) -> None:
    """A directory whose owner record another host's live job touched just now."""
    import json
    import os

    record = {"host": "node-b", "pid": 4242, "started": "2030-01-01 00:00:00 +0000",
              "dir_ino": os.stat(tmp).st_ino}  # fmt: skip
    (tmp / ".loopkit-owner-0000000001").write_text(json.dumps(record))
    _checkpointer(tmp).resume()


def _damaged_checkpoints(tmp: Path, skip_damaged: bool) -> None:
    """Two checkpoints, both cut short: resumed with or without skip_damaged=True."""
    ckpt = _checkpointer(tmp)
    for _ in range(2):
        path = ckpt.save()
        assert path is not None
        path.write_bytes(path.read_bytes()[:100])
    ckpt.close()
    _checkpointer(tmp).resume(skip_damaged=skip_damaged)


def _resume_mid_window(tmp: Path) -> None:
    m, o = _model_opt()
    s = loopkit.step(m, o, accumulate=2)
    with s as st:
        st.backward(m(torch.ones(2, 8)).sum())
    loopkit.Checkpointer(tmp, model=m, optimizer=o, step=s).resume()


def _loader_data(n: int) -> distributed.EpochLoader:
    return distributed.loader(torch.utils.data.TensorDataset(torch.arange(n)), 4, num_workers=0)


def _resume_other_data_length(tmp: Path) -> None:
    m, o = _model_opt()
    loopkit.Checkpointer(tmp, model=m, optimizer=o, loader=_loader_data(40)).save()
    loopkit.Checkpointer(tmp, model=m, optimizer=o, loader=_loader_data(44)).resume()


def _loader_bad_generator_state() -> None:
    loader = _loader_data(8)
    loader.load_state_dict({**loader.state_dict(), "generator": torch.zeros(3, dtype=torch.uint8)})


def _until_after_resume(tmp: Path) -> None:
    m, o = _model_opt()
    step = loopkit.step(m, o)
    ckpt = loopkit.Checkpointer(tmp, model=m, optimizer=o, step=step)
    ckpt.resume()
    loopkit.until(step, checkpointer=ckpt)


def _two_steps_on_one_model() -> None:
    m = mlp()
    body = loopkit.step(m, torch.optim.SGD(list(m.parameters())[:2], lr=0.1))
    head = loopkit.step(m, torch.optim.SGD(list(m.parameters())[2:], lr=0.1))
    with body, head:
        pass


_DATA4 = torch.utils.data.TensorDataset(torch.ones(4))


def _two_optimizers_one_parameter() -> None:
    a, b = mlp(), mlp(1)
    shared = torch.optim.SGD([*b.parameters(), *a[0].parameters()], lr=0.1)
    loopkit.steps(loopkit.step(a, _opt(a)), loopkit.step(b, shared))


def _second_weight_in_a_micro_step() -> None:
    m, o = _model_opt()
    with loopkit.step(m, o, accumulate=2) as s:
        s.backward(m(torch.ones(1, 8)).sum(), weight=1)
        s.backward(m(torch.ones(1, 8)).sum(), weight=1)


CATALOGUE: list[tuple[str, Callable[[Path], Any], type[Exception], str]] = [
    # to_device
    (
        "to_device without device",
        lambda t: loopkit.to_device(torch.ones(1)),
        TypeError,
        "to_device(obj, device)",
    ),
    (
        "to_device bad device",
        lambda t: loopkit.to_device(torch.ones(1), "gpu0"),
        ValueError,
        "pass e.g. 'cpu'",
    ),
    (
        "to_device unsafe non_blocking",
        lambda t: loopkit.to_device(1, "cpu", non_blocking=True),
        ValueError,
        "non_blocking=None",
    ),
    (
        "to_device non_blocking type",
        lambda t: loopkit.to_device(1, "cpu", non_blocking="yes"),
        TypeError,
        "None picks",
    ),
    (
        "to_device integer uint8_to",
        lambda t: loopkit.to_device(1, "cpu", uint8_to=torch.int16),
        ValueError,
        "torch.float32",
    ),
    (
        "to_device normalize alone",
        lambda t: loopkit.to_device(1, "cpu", normalize=([0], [1])),
        ValueError,
        "also pass uint8_to",
    ),
    # autocast_step
    (
        "autocast unknown precision",
        lambda t: loopkit.autocast_step("half-ish"),
        ValueError,
        "use 'bf16', 'fp16' or 'fp32'",
    ),
    (
        "autocast device without autocast",
        lambda t: loopkit.autocast_step("bf16", device_type="meta"),
        ValueError,
        "precision='fp32'",
    ),
    (
        "autocast scaler for bf16",
        lambda t: loopkit.autocast_step("bf16", device_type="cpu", scaler={}),
        ValueError,
        "drop the scaler",
    ),
    (
        "autocast step without scaled backward",
        lambda t: _amp_step_unscaled(),
        RuntimeError,
        "amp.backward(loss)",
    ),
    ("autocast step of nothing", lambda t: _amp_step_nothing(), TypeError, "amp.step(optimizer)"),
    ("scale_lr of rates it does not know", lambda t: _scale_own_rates(), TypeError,
     "cannot scale a"),
    ("scale_lr bad batch", lambda t: loopkit.scale_lr(_opt(mlp()), from_batch=0, to_batch=8),
     ValueError, "from_batch must be an int >= 1"),
    ("probe smallest too large", lambda t: _probe_too_small(), ValueError, "smallest must be"),
    ("probe two peaks on a cpu", lambda t: loopkit.probe_micro_batch(
        mlp(), _opt(mlp()), lambda m, b: m(b).mean(), torch.ones(4, 8), search="two_peaks"),
     ValueError, "use search='halving'"),
    ("step micro_batch zero", lambda t: loopkit.step(*_model_opt(), micro_batch=0), ValueError,
     "micro_batch= must be an int >= 1"),
    ("ema decay of one", lambda t: loopkit.ema(mlp(), decay=1.0), ValueError,
     "decay must be a number in [0, 1)"),
    ("ema of another model", lambda t: loopkit.step(*_model_opt(), ema=loopkit.ema(mlp(1))),
     ValueError, "does not update: build the ema on the model"),
    ("the same ema twice", lambda t: _same_ema_twice(), ValueError, "the same ema is given twice"),
    ("ema swapped into another model", lambda t: _ema_swapped_elsewhere(), ValueError,
     "same architecture"),
    ("ema export dtype not a dtype", lambda t: loopkit.ema(mlp()).export(dtype="fp32"),
     TypeError, "dtype must be None or a torch.dtype"),
    ("ema adopt without a parameter", lambda t: _ema_adopt_missing(mlp()), ValueError,
     "pass the job's whole model state_dict of its average"),
    ("ema adopt negative updates", lambda t: (lambda m: loopkit.ema(m).adopt(m.state_dict(),
     updates=-1))(mlp()), ValueError, "the job's optimizer updates"),
    ("checkpointer epochs of no epochs", lambda t: _checkpointer(t).epochs(0), ValueError,
     "the run's number of epochs, an int >= 1"),
    ("checkpointer epochs without a loader", lambda t: _checkpointer(t).epochs(3), ValueError,
     "build it with loader=loopkit.distributed.loader"),
    ("checkpointer adopt without a step", lambda t: _checkpointer(t).adopt(updates=3),
     ValueError, "build it with step="),
    ("checkpointer adopt negative updates", lambda t: _checkpointer(t).adopt(updates=-2),
     ValueError, "the job's optimizer updates so far"),
    ("checkpointer adopt over loopkit checkpoints", _adopt_after_checkpoint, RuntimeError,
     "ckpt.resume() continues from them"),
    ("tracker config changed", lambda t: _tracker_config_changed(t), ValueError, "logged once"),
    ("tracker resumed after a write", lambda t: _tracker_resumed_late(t), RuntimeError,
     "before the first log flush"),
    ("step optimizer stepped by user", lambda t: _user_steps_owned_optimizer(), RuntimeError,
     "Remove that line"),
    ("step scheduler stepped by user", lambda t: _user_steps_owned_scheduler(), RuntimeError,
     "Remove the scheduler.step() line"),
    ("step window zeroed by user", lambda t: _user_zeroes_window(), RuntimeError,
     "optimizer.zero_grad() at"),
    (
        "autocast load fp16 state into bf16",
        lambda t: loopkit.autocast_step("bf16", device_type="cpu").load_state_dict({"scaler": {}}),
        ValueError,
        "autocast_step('fp16')",
    ),
    # detach_logging
    (
        "logging every 0",
        lambda t: loopkit.detach_logging(every=0),
        ValueError,
        "or None (flush only",
    ),
    ("logging bad sink", lambda t: loopkit.detach_logging(sink="stdout"), TypeError, "e.g. print"),
    (
        "logging bad reduction",
        lambda t: loopkit.detach_logging(reduce="median"),
        ValueError,
        "use one of",
    ),
    (
        "logging vector metric",
        lambda t: loopkit.detach_logging(sink=None)(x=torch.ones(3)),
        ValueError,
        "log(x=value.mean())",
    ),
    (
        "logging no metrics",
        lambda t: loopkit.detach_logging(sink=None)(),
        TypeError,
        "log(loss=loss",
    ),
    # accumulate
    (
        "accumulate every 0",
        lambda t: loopkit.accumulate(*_model_opt(), every=0),
        ValueError,
        "micro-batches per optimizer update",
    ),
    (
        "accumulate clip negative",
        lambda t: loopkit.accumulate(*_model_opt(), clip_grad_norm=-1),
        ValueError,
        "positive finite number or None",
    ),
    (
        "accumulate foreign optimizer",
        lambda t: loopkit.accumulate(mlp(), _opt(mlp())),
        ValueError,
        "build it from model.parameters()",
    ),
    (
        "accumulate not a model",
        lambda t: loopkit.accumulate("model", _opt(mlp())),
        TypeError,
        "nn.Module",
    ),
    (
        "accumulate bad max skips",
        lambda t: loopkit.accumulate(*_model_opt(), max_consecutive_skips=0),
        ValueError,
        "int >= 1",
    ),
    (
        "accumulate backward outside",
        lambda t: _acc_backward_outside(),
        RuntimeError,
        "inside `with acc:`",
    ),
    (
        "step backward outside",
        lambda t: _step_backward_outside(),
        RuntimeError,
        "s.backward(loss) must be called inside `with step as s:`",
    ),
    (
        "step accumulate=0 named as written",
        lambda t: loopkit.step(*_model_opt(), accumulate=0),
        ValueError,
        "accumulate= must be an int >= 1",
    ),
    ("accumulate nested", lambda t: _acc_reenter(), RuntimeError, "once per micro-batch"),
    (
        "accumulate flush inside",
        lambda t: _acc_flush_inside(),
        RuntimeError,
        "after the micro-step ends",
    ),
    # no_sync
    ("no_sync not a module", lambda t: loopkit.no_sync("model"), TypeError, "nn.Module"),
    (
        "no_sync enabled not bool",
        lambda t: loopkit.no_sync(mlp(), enabled="no"),
        TypeError,
        "True or False",
    ),
    # step
    (
        "step on another device",
        lambda t: loopkit.step(*_model_opt(), device="meta"),
        ValueError,
        "move the model first",
    ),
    ("step bad log", lambda t: loopkit.step(*_model_opt(), log="yes"), ValueError, "int >= 1"),
    (
        "step log_metrics without log",
        lambda t: _step_log_metrics_without_log(),
        RuntimeError,
        "build it with log=",
    ),
    # checkpointed
    (
        "checkpointed not callable",
        lambda t: loopkit.checkpointed(42),
        TypeError,
        "@loopkit.checkpointed on a function",
    ),
    (
        "checkpointed every 0",
        lambda t: loopkit.checkpointed(mlp(), blocks=nn.Linear, every=0),
        ValueError,
        "every k-th block",
    ),
    (
        "checkpointed no match",
        lambda t: loopkit.checkpointed(mlp(), blocks=nn.Conv1d),
        ValueError,
        "pass the class of the repeated block",
    ),
    (
        "checkpointed unknown policy",
        lambda t: loopkit.checkpointed(mlp(), policy="some"),
        ValueError,
        "'full' (recompute everything)",
    ),
    # distributed
    (
        "loader both batch sizes",
        lambda t: distributed.loader(
            torch.utils.data.TensorDataset(torch.ones(4)), 2, global_batch_size=2
        ),
        TypeError,
        "exactly one",
    ),
    (
        "loader iterable dataset",
        lambda t: distributed.loader(iter([1]), 1),
        TypeError,
        "map-style dataset",
    ),
    ("setup srun task without its local rank", lambda t: _setup_under_srun(SLURM_LOCALID=""),
     RuntimeError, "SLURM_LOCALID (this task's rank on its node) is ''"),
    ("setup srun rank beyond the step", lambda t: _setup_under_srun(SLURM_PROCID="2"),
     RuntimeError, "SLURM_PROCID=2 is not below SLURM_STEP_NUM_TASKS=2"),
    ("setup srun node list malformed", lambda t: _setup_under_srun(SLURM_STEP_NODELIST="n[1-"),
     RuntimeError, "set MASTER_ADDR to rank 0's host"),
    ("wrap not a module", lambda t: distributed.wrap("model"), TypeError, "nn.Module"),
    ("wrap compile not options", lambda t: distributed.wrap(mlp(), compile="max-autotune"),
     TypeError, "dict of torch.compile's keyword arguments"),
    ("wrap compile of a compiled model",
     lambda t: distributed.wrap(torch.compile(mlp()), compile=True), ValueError,
     "compiled already"),
    ("step compile_optimizer with LBFGS",
     lambda t: (lambda m: loopkit.step(m, torch.optim.LBFGS(m.parameters()),
                                       compile_optimizer=True))(mlp()),
     TypeError, "tensor learning rate"),
    ("wrap replicate without fsdp", lambda t: distributed.wrap(mlp(), replicate=1), ValueError,
     "give fsdp=BlockClass (or fsdp=True) too"),
    ("wrap replicate not dividing the world",
     lambda t: distributed.wrap(mlp(), fsdp=True, replicate=3), ValueError,
     "does not divide the 1 processes"),
    ("wrap FSDP2 option without fsdp",
     lambda t: distributed.wrap(mlp(), reshard_after_forward=False), ValueError,
     "reshard_after_forward= is an option of FSDP2"),
    ("wrap DDP keyword with fsdp",
     lambda t: distributed.wrap(mlp(), fsdp=True, broadcast_buffers=False), TypeError,
     "broadcast_buffers=: DDP's keyword"),
    ("wrap mp_policy not a policy", lambda t: distributed.wrap(mlp(), fsdp=True, mp_policy="bf16"),
     TypeError, "must be a torch.distributed.fsdp.MixedPrecisionPolicy"),
    ("wrap reshard_after_forward 1",
     lambda t: distributed.wrap(mlp(), fsdp=True, reshard_after_forward=1), ValueError,
     "an int >= 2"),
    ("wrap mesh not a mesh", lambda t: distributed.wrap(mlp(), fsdp=True, mesh=(2, 2)), TypeError,
     "mesh must be a torch.distributed.device_mesh.DeviceMesh"),
    ("materialize a model not on meta", lambda t: distributed.materialize(mlp()), ValueError,
     "not on the meta device"),
    ("materialize init not a function",
     lambda t: distributed.materialize(_on_meta(mlp), init="normal"), TypeError,
     "init= takes a function of the model"),
    ("materialize a module without reset_parameters",
     lambda t: distributed.materialize(_on_meta(lambda: nn.ParameterList([torch.ones(2)]))),
     ValueError, "has no reset_parameters()"),
    ("materialize a model partly on meta",
     lambda t: distributed.materialize(nn.Sequential(_on_meta(mlp), nn.Linear(1, 1))),
     ValueError, "build the whole model under torch.device('meta')"),
    ("wrap init on a model already built", lambda t: distributed.wrap(mlp(), init=print),
     ValueError, "init= initializes a model built under torch.device('meta')"),
    # doctor
    (
        "doctor unknown phase",
        lambda t: loopkit.doctor().phase("disk"),
        ValueError,
        "use one of data",
    ),
    (
        "doctor bad report_every",
        lambda t: loopkit.doctor(report_every=-1),
        ValueError,
        "int >= 1 or None",
    ),
    (
        "doctor in a step of the wrong type",
        lambda t: loopkit.step(*_model_opt(), doctor=3),
        TypeError,
        "loopkit.doctor()",
    ),
    # Checkpointer
    ("checkpointer resume skip_damaged not a bool",
     lambda t: _checkpointer(t).resume(skip_damaged="yes"), TypeError,
     "skip_damaged must be True or False"),
    ("checkpointer resume into a directory another live job owns", _owned_by_another_job,
     loopkit.CheckpointError, "give this job a directory of its own"),
    ("checkpointer resume of a damaged newest names skip_damaged",
     lambda t: _damaged_checkpoints(t, False), loopkit.CheckpointError,
     "ckpt.resume(skip_damaged=True)"),
    ("checkpointer resume skip_damaged with every checkpoint damaged",
     lambda t: _damaged_checkpoints(t, True), loopkit.CheckpointError,
     "none can be resumed"),
    (
        "checkpointer keep 0",
        lambda t: _checkpointer(t, keep=0),
        ValueError,
        "checkpoints kept on disk",
    ),
    (
        "checkpointer bad loader",
        lambda t: _checkpointer(t, loader=[1, 2]),
        TypeError,
        "loopkit.distributed.loader",
    ),
    (
        "checkpointer extra without state",
        lambda t: _checkpointer(t, extra={"x": 3}),
        TypeError,
        "wrap it in an object",
    ),
    (
        "checkpointer bad step",
        lambda t: _checkpointer(t, step="s"),
        TypeError,
        "loopkit.step or loopkit.accumulate",
    ),
    ("maybe_save every 0", _maybe_save_zero, ValueError, "updates between saves"),
    ("checkpointer async_save not a bool", lambda t: _checkpointer(t, async_save="yes"),
     TypeError, "async_save must be True or False"),
    ("checkpointer resume reseed not a bool", lambda t: _checkpointer(t).resume(reseed=1),
     TypeError, "reseed must be True or False"),
    ("export_weights ema not an index", lambda t: loopkit.export_weights(t / "c.pt", ema="x"),
     TypeError, "ema must be False, True or the index"),
    ("export_weights missing checkpoint", lambda t: loopkit.export_weights(t / "nope.pt"),
     loopkit.CheckpointError, "no such checkpoint"),
    (
        "load missing file",
        lambda t: loopkit.load_checkpoint(t / "nope.pt"),
        loopkit.CheckpointError,
        "no such checkpoint",
    ),
    # -- issue 11: unclear errors found by fuzzing, and edges found by porting scripts --
    ("LoggingSink logger not a logger", lambda t: loopkit.LoggingSink(print), TypeError,
     "logging.getLogger(__name__)"),
    ("LoggingSink level not an int", lambda t: loopkit.LoggingSink(level="INFO"), TypeError,
     "such as logging.INFO"),
    ("logging metric name not a str", lambda t: loopkit.detach_logging(sink=None).record({1: 1.0}),
     TypeError, "must be str"),
    ("logging number too large for a float",
     lambda t: loopkit.detach_logging(sink=None)(n=10**400), ValueError, "too large"),
    ("logging metric changes device", lambda t: _log_changes_device(), ValueError, "same device"),
    ("autocast backward of a non-tensor",
     lambda t: loopkit.autocast_step("bf16", device_type="cpu").backward(3.0), TypeError,
     "loss must be a tensor"),
    ("accumulate ReduceLROnPlateau scheduler",
     lambda t: _accumulate_with_plateau(), TypeError, "scheduler.step(val_loss)"),
    ("step one model two optimizers entered together", lambda t: _two_steps_on_one_model(),
     RuntimeError, "both parameter groups to one optimizer"),
    ("to_device uncopyable mapping",
     lambda t: loopkit.to_device(_UncopyableMap({"x": torch.ones(1)}), "cpu"), TypeError,
     "cannot copy a _UncopyableMap"),
    ("count_host_syncs entered twice", lambda t: _syncs_reenter(), RuntimeError,
     "already counting"),
    ("count_host_syncs exited without entering",
     lambda t: loopkit.count_host_syncs().__exit__(None, None, None), RuntimeError,
     "without being entered"),
    ("doctor device of the wrong type", lambda t: loopkit.doctor(device=2.5), TypeError,
     "device must be a str, int or torch.device"),
    ("doctor device that is not a device", lambda t: loopkit.doctor(device="nodevice"),
     ValueError, "is not a device"),
    ("doctor device changed inside a step", lambda t: _doctor_device_inside(), RuntimeError,
     "between steps"),
    ("checkpointed compiled module",
     lambda t: loopkit.checkpointed(torch.compile(mlp(), backend="eager")), ValueError,
     "Apply loopkit.checkpointed first, then compile"),
    ("checkpointed blocks inside a compiled module", lambda t: _checkpoint_inside_compiled(),
     ValueError, "Apply loopkit.checkpointed first, then compile"),
    ("checkpointed call with use_cache",
     lambda t: loopkit.checkpointed(mlp())(torch.ones(1, 8), use_cache=True), ValueError,
     "model.config.use_cache = False"),
    ("distributed loader seed None", lambda t: distributed.loader(_DATA4, 2, seed=None),
     TypeError, "seed must be an integer (int or numpy integer) in [-2**63, 2**63 - 1]"),
    ("distributed loader seed out of range", lambda t: distributed.loader(_DATA4, 2, seed=2**63),
     ValueError, "seed must be in [-2**63, 2**63 - 1]"),
    ("distributed loader iterable dataset with len",
     lambda t: distributed.loader(StreamWithLen(), 2), TypeError, "an IterableDataset has not"),
    ("distributed loader state with a bad generator", lambda t: _loader_bad_generator_state(),
     ValueError, "'generator' is not a valid state"),
    ("checkpointer resume mid-window", _resume_mid_window, RuntimeError,
     "call it before the training loop"),
    ("checkpointer resume other accumulate", lambda t: _resume_with(t, accumulate=4),
     loopkit.CheckpointError, "build the step with accumulate=2"),
    ("checkpointer resume other precision", lambda t: _resume_with(t, precision="fp16"),
     loopkit.CheckpointError, "resume with the precision it was saved with"),
    ("checkpointer resume incomplete file", _resume_incomplete, loopkit.CheckpointError,
     "incomplete checkpoint: 'rng' is missing"),
    ("checkpointer resume other data length", _resume_other_data_length, loopkit.CheckpointError,
     "the data set has 44 samples but the state was saved with 40"),
    ("steps of nothing", lambda t: loopkit.steps(), TypeError, "steps(d_step, g_step)"),
    ("steps of a non-step", lambda t: loopkit.steps(3), TypeError, "takes loopkit.step"),
    ("steps with two clocks",
     lambda t: loopkit.steps(loopkit.step(*_model_opt(), accumulate=2),
                             loopkit.step(*_model_opt())),
     ValueError, "same accumulate="),
    ("steps sharing a parameter", lambda t: _two_optimizers_one_parameter(), ValueError,
     "giving it only to that step's optimizer"),
    ("step frozen not a list", lambda t: loopkit.step(*_model_opt(), frozen=mlp()), TypeError,
     "frozen=[discriminator]"),
    ("step frozen its own parameters",
     lambda t: (lambda m: loopkit.step(m, _opt(m), frozen=[m]))(mlp()), ValueError,
     "cannot freeze what it trains"),
    ("step a second weight in one micro-step", lambda t: _second_weight_in_a_micro_step(),
     ValueError, "first backward only"),
    ("until unknown signal", lambda t: loopkit.until(signals=("SIGNOPE",)), ValueError,
     "names such as 'SIGTERM'"),
    ("until max_time unreadable", lambda t: loopkit.until(max_time="12h"), ValueError,
     '"HH:MM:SS" or "DD:HH:MM:SS"'),
    ("until of a module", lambda t: loopkit.until(mlp()), TypeError, "or None in a loop"),
    ("until after a resume", _until_after_resume, RuntimeError, "before the first resume()"),
    ("until epochs of a DataLoader", lambda t: next(loopkit.until(signals=()).epochs(
        torch.utils.data.DataLoader([1]))), TypeError, "epochs() to let until count them"),
    ("early_stop patience 0", lambda t: loopkit.early_stop(patience=0), ValueError,
     "observations without improvement"),
    ("early_stop min_updates without a step", lambda t: loopkit.early_stop(patience=1,
     min_updates=5), ValueError, "early_stop(step, ..., min_updates=N)"),
    ("early_stop observe without the metric",
     lambda t: loopkit.early_stop(patience=1).observe({"acc": 1.0}), KeyError,
     "build it with that metric= name"),
    ("cadence two schedules", lambda t: loopkit.cadence(updates=2, epochs=1), TypeError,
     "exactly one of updates=N, per_epoch=K or epochs=E"),
    ("cadence per_epoch of a DataLoader", lambda t: loopkit.cadence(
        per_epoch=2, loader=torch.utils.data.DataLoader([1])), TypeError,
     "with a plain DataLoader use updates=N"),
    ("evaluate per-batch mean", lambda t: loopkit.evaluate(
        mlp(), [(torch.ones(2, 8), torch.ones(2, 3))],
        lambda m, b: {"loss": m(b[0]).mean()}), ValueError, "reduction='none'"),
    ("preload of an iterable", lambda t: loopkit.preload(iter([1, 2]), t), TypeError,
     "map-style data set"),
    ("preload of strings", lambda t: loopkit.preload(["a", "b"], t), TypeError,
     "make transform return tensors"),
    ("evaluate loader that drops", lambda t: loopkit.evaluate(
        mlp(), torch.utils.data.DataLoader(torch.ones(5, 8), batch_size=2, drop_last=True),
        lambda m, b: {"x": m(b)[:, 0]}), ValueError, "drop_last=False"),
    ("Checkpointer loader= without a state", lambda t: loopkit.Checkpointer(
        t, model=mlp(), loader=torch.utils.data.DataLoader([1, 2])), TypeError,
     "loopkit.replayed(loader)"),
    ("replayed of a stateful loader", lambda t: loopkit.replayed(
        loopkit.replayed(torch.utils.data.DataLoader([1, 2]))), TypeError,
     "give it to the Checkpointer as it is"),
    ("shuffle_buffer of a stateless source", lambda t: loopkit.shuffle_buffer(range(4), 2),
     TypeError, "use a source that has them"),
    ("stream_shards of one path", lambda t: loopkit.stream_shards("a.jsonl", open), TypeError,
     "a list of paths"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("name", "call", "exc", "hint"), CATALOGUE, ids=[row[0] for row in CATALOGUE]
)
def test_catalogue(
    name: str, call: Callable[[Path], Any], exc: type[Exception], hint: str, tmp_path: Path
) -> None:
    """The wrong call raises the documented type with a message that says what to do."""
    with pytest.raises(exc) as info:
        call(tmp_path)
    assert type(info.value) is exc or issubclass(type(info.value), exc)
    assert hint in str(info.value), str(info.value)


def test_catalogue_covers_every_public_entry_point() -> None:
    """Each name in loopkit.__all__ that takes arguments appears in the catalogue."""
    covered = " ".join(row[0] for row in CATALOGUE)
    takes_no_input = {
        "count_host_syncs",
        "track_memory",
        "print_sink",
        "is_checkpointed",
        "TensorBoardSink",
        "Sink",
        "Stateful",
        "Precision",
        "CheckpointError",
        "LoopkitError",
        "OpenWindowWarning",
        "ResumeWarning",
        "UnwrappedModelWarning",
        "SinkFailedWarning",
        "Tracker",
        "DeviceLike",
        "Scheduler",
        "SyncKind",
        "Weight",
        "Evaluation",
        "Preloaded",
        "__version__",
    }
    words = {
        "probe_micro_batch": "probe",
        "ema": "ema",
        "scale_lr": "scale_lr",
        "CSVSink": "tracker",
        "WandbSink": "tracker",
        "MLflowSink": "tracker",
        "to_device": "to_device",
        "autocast_step": "autocast",
        "detach_logging": "logging",
        "accumulate": "accumulate",
        "no_sync": "no_sync",
        "step": "step",
        "checkpointed": "checkpointed",
        "Checkpointer": "checkpointer",
        "load_checkpoint": "load",
        "doctor": "doctor",
        "LoggingSink": "LoggingSink",
        "steps": "steps",
        "until": "until",
        "early_stop": "early_stop",
        "cadence": "cadence",
        "evaluate": "evaluate",
        "preload": "preload",
        "export_weights": "export_weights",
        "replayed": "replayed",
        "shuffle_buffer": "shuffle_buffer",
        "stream_shards": "stream_shards",
    }
    for name in loopkit.__all__:
        if name not in takes_no_input:
            assert words[name] in covered, name


ANY = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 5),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=6),
    st.sampled_from(["bf16", "fp16", "fp32", "cpu", "meta", "mean", "max"]),
    st.lists(st.integers(0, 3), max_size=3),
    st.just(torch.float32),
    st.just(torch.int8),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)
SETTINGS = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


def _only_allowed(fn: Callable[[], Any]) -> None:
    with contextlib.suppress(*ALLOWED):
        fn()


@SETTINGS
@given(updates=ANY, epochs=ANY, time=ANY, check=ANY, signals=ANY)
def test_fuzz_until(updates: Any, epochs: Any, time: Any, check: Any, signals: Any) -> None:
    """Any limits and signals: until is built (and closed) or refuses with an allowed type."""

    def build() -> None:
        loopkit.until(max_updates=updates, max_epochs=epochs, max_time=time,
                      check_every=check, signals=signals).close()  # fmt: skip

    _only_allowed(build)


@SETTINGS
@given(metric=ANY, patience=ANY, mode=ANY, delta=ANY, value=ANY)
def test_fuzz_early_stop(metric: Any, patience: Any, mode: Any, delta: Any, value: Any) -> None:
    """Any settings and any observed value: it decides or refuses with an allowed type."""

    def run() -> None:
        loopkit.early_stop(None, metric, patience=patience, mode=mode, min_delta=delta).observe(
            {metric: value} if isinstance(metric, str) else value
        )

    _only_allowed(run)


@SETTINGS
@given(every=ANY, clip=ANY, skip=ANY, max_skips=ANY)
def test_fuzz_accumulate(every: Any, clip: Any, skip: Any, max_skips: Any) -> None:
    """Any argument combination: accumulate is built or refuses with an allowed type."""
    m, o = _model_opt()
    _only_allowed(
        lambda: loopkit.accumulate(
            m,
            o,
            every=every,
            clip_grad_norm=clip,
            skip_nonfinite=skip,
            max_consecutive_skips=max_skips,
        )
    )


@SETTINGS
@given(precision=ANY, accumulate=ANY, clip=ANY, log=ANY, device=ANY)
def test_fuzz_step(precision: Any, accumulate: Any, clip: Any, log: Any, device: Any) -> None:
    """Any argument combination: loopkit.step is built or refuses with an allowed type."""
    m, o = _model_opt()
    _only_allowed(
        lambda: loopkit.step(
            m,
            o,
            precision=precision,
            accumulate=accumulate,
            clip_grad_norm=clip,
            log=log,
            device=device,
        )
    )


@SETTINGS
@given(every=ANY, sink=ANY, reduce=ANY, value=ANY)
def test_fuzz_detach_logging(every: Any, sink: Any, reduce: Any, value: Any) -> None:
    """Any settings and any logged value: it works or refuses with an allowed type."""

    def run() -> None:
        log = loopkit.detach_logging(every=every, sink=sink, reduce=reduce)
        log(x=value)
        log.flush()

    _only_allowed(run)


@SETTINGS
@given(precision=ANY, device_type=ANY)
def test_fuzz_autocast_step(precision: Any, device_type: Any) -> None:
    """Any precision and device type: autocast_step is built or refuses with an allowed type."""
    _only_allowed(lambda: loopkit.autocast_step(precision, device_type=device_type))


@SETTINGS
@given(device=ANY, non_blocking=ANY, uint8_to=ANY, channels_last=ANY)
def test_fuzz_to_device(device: Any, non_blocking: Any, uint8_to: Any, channels_last: Any) -> None:
    """Any transfer options: the batch moves or the call refuses with an allowed type."""
    batch = {"x": torch.zeros(1, 3, 2, 2, dtype=torch.uint8), "y": [torch.ones(2)]}
    _only_allowed(
        lambda: loopkit.to_device(
            batch, device, non_blocking=non_blocking, uint8_to=uint8_to, channels_last=channels_last
        )
    )


@SETTINGS
@given(every=ANY, policy=ANY, blocks=ANY)
def test_fuzz_checkpointed(every: Any, policy: Any, blocks: Any) -> None:
    """Any selection and policy: checkpointed applies or refuses with an allowed type."""
    _only_allowed(lambda: loopkit.checkpointed(mlp(), every=every, policy=policy, blocks=blocks))


@SETTINGS
@given(keep=ANY, every=ANY)
def test_fuzz_checkpointer(keep: Any, every: Any) -> None:
    """Any keep/every: the Checkpointer is built and saves, or refuses with an allowed type."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        m, o = _model_opt()
        _only_allowed(
            lambda: loopkit.Checkpointer(
                tmp, model=m, optimizer=o, keep=keep, step=loopkit.step(m, o)
            ).maybe_save(every)
        )


def test_nan_is_never_a_valid_number() -> None:
    """NaN slips past `< 1` style checks; every numeric option refuses it."""
    m, o = _model_opt()
    for kwargs in (
        {"every": math.nan},
        {"clip_grad_norm": math.nan},
        {"max_consecutive_skips": math.nan},
    ):
        with pytest.raises(ValueError):
            loopkit.accumulate(m, o, **kwargs)
    with pytest.raises(ValueError):
        loopkit.detach_logging(every=math.nan)


# -- wrong numbers (issue 11): right answers where loopkit used to compute wrong ones -------


def _fp16_updates(limit: int | None) -> tuple[int, int]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 1))
    step = loopkit.step(
        model, _opt(model), precision="fp16", device="cpu", max_consecutive_skips=limit
    )
    g = torch.Generator().manual_seed(5)
    for _ in range(16):  # activations of a few hundred: too big for the initial scale 65536
        with step as s:
            s.backward(model(torch.randn(16, 32, generator=g) * 30).float().pow(2).mean())
    return step.updates, step.skipped


def _log_sum_int64() -> float:
    log = loopkit.detach_logging(every=None, sink=None, reduce="sum")
    for n in (16_777_217, 1, 1):
        log(tokens=torch.tensor(n))
    return log.flush()["tokens"]


def _log_max_of_floats_with_nan() -> float:
    log = loopkit.detach_logging(every=None, sink=None, reduce="max")
    for v in (1.0, math.nan, 2.0):
        log(x=v)
    return log.flush()["x"]


NUMBERS: list[tuple[str, Callable[[], Any], Any]] = [
    # GradScaler's start-up back-off is calibration, not divergence (K=3 < the skips it makes).
    ("fp16 start-up back-off with max_consecutive_skips", lambda: _fp16_updates(3),
     lambda: _fp16_updates(None)),
    ("logging int64 sum is exact", _log_sum_int64, 16_777_219.0),
    ("logging max over Python floats keeps a NaN", _log_max_of_floats_with_nan, math.nan),
]  # fmt: skip


@pytest.mark.filterwarnings("ignore:fp16 autocast on a CPU")
@pytest.mark.parametrize(("name", "compute", "want"), NUMBERS, ids=[row[0] for row in NUMBERS])
def test_numbers(name: str, compute: Callable[[], Any], want: Any) -> None:
    """Each computation gives the right number (NaN where a NaN must surface)."""
    got, want = compute(), want() if callable(want) else want
    if isinstance(want, float) and math.isnan(want):
        assert math.isnan(got)
    else:
        assert got == want


@pytest.mark.parametrize("name", [n for n in loopkit.__all__ if n != "__version__"])
def test_public_classes_print_under_loopkit(name: str) -> None:
    """A traceback names loopkit's errors and warnings as users import them: loopkit.X."""
    value = getattr(loopkit, name)
    if not (isinstance(value, type) and issubclass(value, BaseException)):
        return
    assert value.__module__ == "loopkit"
    line = traceback.format_exception_only(value, value("what went wrong"))[-1]
    assert line == f"loopkit.{name}: what went wrong\n"
    assert getattr(loopkit, value.__qualname__) is value  # pickle finds it there
