"""Re-measure the Accelerate port: run_clm_no_trainer's loop beside examples/port_accelerate_clm.py.

The Accelerate side is HF transformers' ``run_clm_no_trainer.py`` loop, written here as it
is there (``accelerator.accumulate``, ``clip_grad_norm_`` when ``sync_gradients``, the
prepared scheduler, ``gather_for_metrics(loss.repeat(batch_size))`` for perplexity,
``save_state`` every 5 updates and a resume that skips ``updates * accumulation`` batches).
The loopkit side is the example itself, run unmodified. Both train the same tiny random
GPT-2 on the same padded documents (accumulation 4, 38 batches per epoch: a ragged window).

Measured, each side against an independent reference:

1. final weights vs a float64 big batch over the same micro-batches (each window one
   token-weighted batch), relative to the distance trained;
2. perplexity of the same weights vs the float64 exact value, on 1 and 2 processes;
3. kill -9 at a micro-step inside a window (after the first checkpoint), relaunch, and
   compare the final weights bit for bit with an uninterrupted run;
4. time per micro-step, loopkit over Accelerate, interleaved in one process.

    python benchmarks/accelerate_port.py [--quick] [--json] [--trials N] [--processes 1,2]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("port_clm", ROOT / "examples/port_accelerate_clm.py")
assert _spec is not None and _spec.loader is not None
port: Any = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(port)

EVERY, BATCH, EVAL_BATCH, SAVE_EVERY, LR = 4, 4, 8, 5, 3e-3
N_TRAIN, N_VAL = 152, 37  # 38 batches per epoch: windows of 4, the last of 2


def build_model() -> nn.Module:
    """The example's model, from its seed: a tiny random GPT-2 built from a config."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=port.VOCAB, n_positions=port.LENGTH, n_embd=32, n_layer=2,
                        n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        bos_token_id=0, eos_token_id=0)  # fmt: skip
    return GPT2LMHeadModel(config)


def schedule(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda u: 1 / (1 + 0.05 * u))


def as_dict(rows: list[tuple[torch.Tensor, ...]]) -> dict[str, torch.Tensor]:
    """HF's collate: a dict batch, as run_clm_no_trainer feeds its model (+ the indices)."""
    cols = [torch.stack(c) for c in zip(*rows, strict=True)]
    return dict(zip(("input_ids", "attention_mask", "labels", "idx"), cols, strict=False))


def indexed(dataset: torch.utils.data.TensorDataset) -> torch.utils.data.TensorDataset:
    """The documents with their index as a last field (to rebuild the order trained on)."""
    return torch.utils.data.TensorDataset(*dataset.tensors, torch.arange(len(dataset)))


def params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in getattr(model, "module", model).named_parameters()}


# -- the Accelerate original (run_clm_no_trainer's loop) ------------------------------------


def accelerate_train(directory: Path, epochs: int, kill_at: int | None = None) -> dict[str, Any]:
    """Train (resuming from the newest step_* in ``directory``); the weights and batches seen."""
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    accelerator = Accelerator(gradient_accumulation_steps=EVERY, cpu=True)
    set_seed(0)
    model = build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    loader = torch.utils.data.DataLoader(
        indexed(port.documents(N_TRAIN, seed=1)), shuffle=True, batch_size=BATCH,
        collate_fn=as_dict,
    )  # fmt: skip
    scheduler = schedule(optimizer)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    completed, starting_epoch, resume_step = 0, 0, None
    saved = sorted(directory.glob("step_*"), key=lambda p: int(p.name[5:]))
    if saved:  # run_clm's resume: the step count times the accumulation, in batches
        accelerator.load_state(str(saved[-1]))
        resume_step = int(saved[-1].name[5:]) * EVERY
        starting_epoch = resume_step // len(loader)
        completed = resume_step // EVERY
        resume_step -= starting_epoch * len(loader)
    seen: list[torch.Tensor] = []
    micro = 0
    for epoch in range(starting_epoch, epochs):
        model.train()
        active = loader
        if resume_step is not None and epoch == starting_epoch:
            active = accelerator.skip_first_batches(loader, resume_step)
        for batch in active:
            seen.append(batch.pop("idx"))  # not the model's: kept for the reference
            accelerate_micro_step(accelerator, model, optimizer, scheduler, batch)
            if accelerator.sync_gradients:
                completed += 1
                if completed % SAVE_EVERY == 0:
                    accelerator.save_state(str(directory / f"step_{completed}"))
            micro += 1
            if micro == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
    return {"weights": params(model), "batches": seen}


def accelerate_micro_step(
    accelerator: Any, model: Any, optimizer: Any, scheduler: Any, batch: dict[str, Any]
) -> None:
    """run_clm_no_trainer's micro-step: accumulate, backward, clip on sync, step, schedule."""
    with accelerator.accumulate(model):
        loss = model(**batch).loss
        accelerator.backward(loss)
        if accelerator.sync_gradients:
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()


def accelerate_perplexity(model: nn.Module, accelerator: Any) -> float:
    """run_clm_no_trainer's evaluation: per-batch mean losses, repeated, gathered."""
    loader = accelerator.prepare(torch.utils.data.DataLoader(
        port.documents(N_VAL, seed=2), batch_size=EVAL_BATCH, collate_fn=as_dict))  # fmt: skip
    model.eval()
    losses = []
    for batch in loader:
        with torch.no_grad():
            loss = model(**batch).loss
        losses.append(accelerator.gather_for_metrics(loss.repeat(EVAL_BATCH)))
    return math.exp(torch.mean(torch.cat(losses)).item())


# -- references ----------------------------------------------------------------------------


def nll_sum(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor):  # type: ignore[no-untyped-def]
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
    return nn.functional.cross_entropy(logits.transpose(1, 2), labels[:, 1:], ignore_index=-100,
                                       reduction="sum")  # fmt: skip


def big_batch_reference(epochs: list[list[int]]) -> dict[str, torch.Tensor]:
    """float64: each window one batch of its micro-batches (indices per epoch, in order)."""
    data = port.documents(N_TRAIN, seed=1).tensors
    model = build_model().double()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    scheduler = schedule(optimizer)
    for order in epochs:
        batches = [order[i : i + BATCH] for i in range(0, len(order), BATCH)]
        for w in range(0, len(batches), EVERY):
            rows = [i for b in batches[w : w + EVERY] for i in b]
            ids, mask, labels = (t[rows] for t in data)
            loss = nll_sum(model, ids, mask, labels) / (labels[:, 1:] != -100).sum()
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
    return params(model)


def distance(weights: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    """||w - w_ref|| / ||w_ref - w_0||, in float64."""
    start = params(build_model())
    num = sum(((weights[k].double() - ref[k]) ** 2).sum() for k in ref)
    den = sum(((ref[k] - start[k].double()) ** 2).sum() for k in ref)
    return float((num / den) ** 0.5)  # type: ignore[operator]


def exact_perplexity(weights: dict[str, torch.Tensor]) -> float:
    """float64, every held-out document once."""
    model = build_model().double()
    model.load_state_dict({k: v.double() for k, v in weights.items()}, strict=False)
    ids, mask, labels = port.documents(N_VAL, seed=2).tensors
    with torch.no_grad():
        nll = nll_sum(model.eval(), ids, mask, labels)
    return math.exp(float(nll / (labels[:, 1:] != -100).sum()))


def loopkit_orders(epochs: int) -> list[list[int]]:
    """The sample order the example's loader hands out (seeded: reproduced here)."""
    from loopkit import distributed

    indexed = torch.utils.data.TensorDataset(torch.arange(N_TRAIN))
    loader = distributed.loader(indexed, batch_size=BATCH, seed=0, num_workers=0)
    return [[int(i) for (b,) in loader.training_pass() for i in b] for _ in range(epochs)]


def accelerate_orders(batches: list[torch.Tensor]) -> list[list[int]]:
    """The sample order of the uninterrupted Accelerate run, per epoch."""
    flat = [int(i) for b in batches for i in b]
    return [flat[i : i + N_TRAIN] for i in range(0, len(flat), N_TRAIN)]


# -- runs in subprocesses (one run each, so kill -9 is real) -------------------------------

_KILLER = """
import os, runpy, signal, sys
import loopkit
k, seen, original = int(os.environ["BENCH_KILL_AT"]), [0], loopkit.step.__exit__
def counted(self, *exc):
    original(self, *exc)
    seen[0] += 1
    if seen[0] == k:
        os.kill(os.getpid(), signal.SIGKILL)
loopkit.step.__exit__ = counted
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def _env() -> dict[str, str]:
    launcher = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in launcher}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    return env


def run_side(side: str, directory: Path, out: Path, epochs: int, kill_at: int | None) -> int:
    """One training run of ``side`` ("loopkit": the example; "accelerate"); its exit code."""
    if side == "loopkit":
        cmd = [sys.executable, "-c", _KILLER, "examples/port_accelerate_clm.py",
               "--dir", str(directory), "--out", str(out), "--epochs", str(epochs)]  # fmt: skip
    else:
        cmd = [sys.executable, __file__, "--accelerate-run", str(directory), "--out", str(out),
               "--epochs", str(epochs)]  # fmt: skip
    env = _env() | {"BENCH_KILL_AT": str(kill_at or 0)}
    if kill_at:
        cmd += ["--kill-at", str(kill_at)] if side == "accelerate" else []
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode not in (0, -signal.SIGKILL):
        raise SystemExit(f"{side} run failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return proc.returncode


def load_weights(out: Path, side: str) -> dict[str, torch.Tensor]:
    saved = torch.load(out, weights_only=True)
    if side == "accelerate":
        return saved["weights"]  # type: ignore[no-any-return]
    names = set(params(build_model()))
    return {k: v for k, v in saved.items() if k in names}


def kill_points(epochs: int, trials: int) -> list[int]:
    """Micro-steps inside a window (not a window's last), after the first checkpoint."""
    per_epoch = N_TRAIN // BATCH
    first_save = SAVE_EVERY * EVERY
    ends = (*range(EVERY, per_epoch, EVERY), per_epoch)  # a window's last, within an epoch
    inside = [m for m in range(first_save + 1, epochs * per_epoch)
              if (m - 1) % per_epoch + 1 not in ends]  # fmt: skip
    return sorted(random.Random(0).sample(inside, trials))


def resume_trials(side: str, tmp: Path, epochs: int, trials: int, whole: Path) -> int:
    """How many kill -9 + relaunch runs end bit-identical to the uninterrupted one."""
    reference = load_weights(whole, side)
    same = 0
    for k in kill_points(epochs, trials):
        directory, out = tmp / f"{side}-k{k}", tmp / f"{side}-k{k}.pt"
        code = run_side(side, directory, out, epochs, k)
        if code != -signal.SIGKILL:
            raise SystemExit(f"{side}: the run was not killed at micro-step {k}")
        run_side(side, directory, out, epochs, None)
        got = load_weights(out, side)
        same += all(torch.equal(got[n], reference[n]) for n in reference)
    return same


# -- evaluation on 1 and 2 processes --------------------------------------------------------


def eval_worker(weights_path: str, out_dir: str) -> None:
    """Under a launcher (or alone): both perplexities of the same weights; rank 0 writes."""
    from accelerate import Accelerator

    import loopkit
    from loopkit import distributed

    accelerator = Accelerator(cpu=True)
    model = build_model()
    model.load_state_dict(torch.load(weights_path, weights_only=True), strict=False)
    gathered = accelerate_perplexity(accelerator.prepare(model), accelerator)
    val = distributed.loader(port.documents(N_VAL, seed=2), batch_size=EVAL_BATCH,
                             shuffle=False, num_workers=0)  # fmt: skip
    result = loopkit.evaluate(model, val, port.nll_and_tokens)
    if accelerator.is_main_process:
        Path(out_dir, "eval.json").write_text(json.dumps({
            "accelerate": gathered, "loopkit": math.exp(result.ratio("nll", "tokens")),
            "samples": result.samples, "processes": accelerator.num_processes,
        }))  # fmt: skip


def perplexities(weights: Path, processes: int, tmp: Path) -> dict[str, Any]:
    out = tmp / f"eval{processes}"
    out.mkdir(exist_ok=True)
    cmd = [sys.executable, __file__, "--eval-worker", str(weights), str(out)]
    if processes > 1:
        with socket.socket() as s:  # a free port: accelerate's default may be taken
            s.bind(("127.0.0.1", 0))
            port_number = str(s.getsockname()[1])
        launcher = str(Path(sys.executable).parent / "accelerate")
        cmd = [launcher, "launch", "--multi_gpu", "--num_processes", str(processes),
               "--main_process_port", port_number, *cmd[1:]]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise SystemExit(f"evaluation failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return json.loads((out / "eval.json").read_text())  # type: ignore[no-any-return]


# -- time per micro-step ---------------------------------------------------------------------


def time_ratio(rounds: int) -> float:
    """loopkit's time per micro-step over Accelerate's: interleaved epochs, medians."""
    from accelerate import Accelerator

    import loopkit

    rows = list(port.documents(N_TRAIN, seed=1))
    tuples = [tuple(torch.stack(c) for c in zip(*rows[i : i + BATCH], strict=True))
              for i in range(0, N_TRAIN, BATCH)]  # fmt: skip
    dicts = [as_dict(rows[i : i + BATCH]) for i in range(0, N_TRAIN, BATCH)]
    lk_model = build_model()
    lk_opt = torch.optim.AdamW(lk_model.parameters(), lr=LR)
    step = loopkit.step(lk_model, lk_opt, accumulate=EVERY, scheduler=schedule(lk_opt),
                        clip_grad_norm=1.0)  # fmt: skip
    accelerator = Accelerator(gradient_accumulation_steps=EVERY, cpu=True)
    acc_model = build_model()
    acc_opt = torch.optim.AdamW(acc_model.parameters(), lr=LR)
    acc_model, acc_opt, acc_sched = accelerator.prepare(acc_model, acc_opt, schedule(acc_opt))

    def loopkit_epoch() -> None:
        for ids, mask, labels in step.iterate(tuples):
            with step as s:
                loss = lk_model(input_ids=ids, attention_mask=mask, labels=labels).loss
                s.backward(loss, weight=(labels[:, 1:] != -100).sum())

    def accelerate_epoch() -> None:
        for batch in dicts:
            accelerate_micro_step(accelerator, acc_model, acc_opt, acc_sched, batch)

    times: dict[str, list[float]] = {"loopkit": [], "accelerate": []}
    pair = (("loopkit", loopkit_epoch), ("accelerate", accelerate_epoch))
    for r in range(rounds + 1):
        for name, fn in pair if r % 2 else pair[::-1]:  # alternating which goes first
            start = time.perf_counter()
            fn()
            if r:  # round 0 warms up
                times[name].append(time.perf_counter() - start)
    return statistics.median(times["loopkit"]) / statistics.median(times["accelerate"])


# -- the table ---------------------------------------------------------------------------------


def measure(quick: bool, trials: int, processes: list[int]) -> list[dict[str, Any]]:
    epochs = 1 if quick else 2
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        whole = {side: tmp / f"{side}-whole.pt" for side in ("loopkit", "accelerate")}
        for side, out in whole.items():
            run_side(side, tmp / f"{side}-whole", out, epochs, None)
        acc_batches = torch.load(whole["accelerate"], weights_only=True)["batches"]
        orders = {"loopkit": loopkit_orders(epochs), "accelerate": accelerate_orders(acc_batches)}
        rows.append({"measure": "final weights vs float64 big batch", **{
            side: distance(load_weights(whole[side], side), big_batch_reference(orders[side]))
            for side in whole}})  # fmt: skip
        exact = exact_perplexity(load_weights(whole["loopkit"], "loopkit"))
        weights = tmp / "eval-weights.pt"
        torch.save(load_weights(whole["loopkit"], "loopkit"), weights)
        for n in processes:
            got = perplexities(weights, n, tmp)
            rows.append({"measure": f"perplexity vs exact, {n} process{'es' if n > 1 else ''}",
                         "accelerate": got["accelerate"] / exact - 1,
                         "loopkit": got["loopkit"] / exact - 1, "exact": exact,
                         "documents": got["samples"]})  # fmt: skip
        resumed = {side: resume_trials(side, tmp, epochs, trials, whole[side]) for side in whole}
        rows.append({"measure": f"kill -9 mid-window then resume, bit-identical of {trials}",
                     **resumed})  # fmt: skip
    rows.append({"measure": "time per micro-step (accelerate = 1)", "accelerate": 1.0,
                 "loopkit": time_ratio(3 if quick else 15)})  # fmt: skip
    return rows


def _cell(measure: str, value: Any) -> str:
    if "time" in measure:
        return f"{value:.3f}"
    return f"{value:+.2e}" if "perplexity" in measure else f"{value:.2e}" if isinstance(
        value, float) else str(value)  # fmt: skip


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 epoch, 1 kill trial, 1 process")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    parser.add_argument("--trials", type=int, help="kill -9 trials per side (default 6; quick 1)")
    parser.add_argument("--processes", help="evaluation process counts (default 1,2; quick 1)")
    parser.add_argument("--accelerate-run", help=argparse.SUPPRESS)
    parser.add_argument("--eval-worker", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--epochs", type=int, default=2, help=argparse.SUPPRESS)
    parser.add_argument("--kill-at", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.accelerate_run:
        torch.save(accelerate_train(Path(args.accelerate_run), args.epochs, args.kill_at), args.out)
        return []
    if args.eval_worker:
        eval_worker(*args.eval_worker)
        return []
    torch.set_num_threads(1)
    trials = args.trials or (1 if args.quick else 6)
    processes = [int(p) for p in (args.processes or ("1" if args.quick else "1,2")).split(",")]
    rows = measure(args.quick, trials, processes)
    if args.json:
        print(json.dumps(rows, indent=2))
        return rows
    print(f"torch {torch.__version__}; {'1 epoch' if args.quick else '2 epochs'} of 38 batches, "
          f"accumulation {EVERY}\n")  # fmt: skip
    print("| measure | Accelerate original | loopkit port |\n|---|---|---|")
    for r in rows:
        cells = [_cell(r["measure"], r[side]) for side in ("accelerate", "loopkit")]
        print(f"| {r['measure']} | {cells[0]} | {cells[1]} |")
    return rows


if __name__ == "__main__":
    main()
