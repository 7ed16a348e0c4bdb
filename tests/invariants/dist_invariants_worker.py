"""The 2-rank invariants, under one ``torchrun --nproc-per-node 2`` launch.

Each group draws its examples with hypothesis on both ranks alike (``inv_budget.draw``:
derandomized in CI, seeded from ``LOOPKIT_SEED`` in deep runs), runs each example on both
ranks, checks it against its reference on each rank, and the ranks agree on the outcome
(through a process group of their own, so a rank stuck in a collective of the example
cannot confuse it). A group stops at its first failing example and reports it: the
example, each rank's message and the command that replays it alone. Results land in
``OUT/<group>.rank<r>.pt`` (a dict: ``examples``, ``failure``, ``records``).

Run: ``PYTHONPATH=tests:tests/invariants torchrun --standalone --nproc-per-node 2
tests/invariants/dist_invariants_worker.py OUT [GROUP ...]``; replay one example with
``... OUT --replay GROUP 'JSON'``.
"""

from __future__ import annotations

import datetime
import json
import sys
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import inv_budget
import inv_evaluation
import inv_exactness
import inv_loader
import inv_loop_control
import inv_micro_batch
import inv_resume_sharded
import torch
import torch.distributed as dist

from loopkit import distributed

Check = Callable[[dict[str, Any], distributed.DistInfo], Any]
# group -> (the examples' strategy, CI's budget, the check of one example on this rank)
GROUPS: dict[str, tuple[Any, int, Check]] = {
    "update": (inv_exactness.scenarios(world=2), 60, inv_exactness.check_on_ranks),
    "evaluate": (inv_evaluation.scenarios(world=2), 24, inv_evaluation.check_on_ranks),
    "loop_control": (inv_loop_control.scenarios(), 40, inv_loop_control.check_on_ranks),
    "loader": (inv_loader.scenarios(), 10, inv_loader.check_on_ranks),
    "micro_batch": (inv_micro_batch.scenarios(), 8, inv_micro_batch.check_on_ranks),
    "resume_sharded": (inv_resume_sharded.scenarios(), 6, inv_resume_sharded.check_on_ranks),
}

# Examples every run checks first (known edge shapes), before the drawn ones.
EXPLICIT: dict[str, list[Any]] = {
    "update": inv_exactness.EXPLICIT,
    "resume_sharded": inv_resume_sharded.EXPLICIT,
}
MAX_FAILURES = 5
REPLAY = (
    "PYTHONPATH=tests:tests/invariants OMP_NUM_THREADS=1 python -m torch.distributed.run "
    "--standalone --nproc-per-node 2 tests/invariants/dist_invariants_worker.py /tmp "
    "--replay {group} '{spec}'"
)


def _agree(outcome: str | None, pg: Any) -> list[str | None]:
    said: list[str | None] = [None, None]
    dist.all_gather_object(said, outcome, group=pg)
    return said


def _maybe_desynced(said: list[str | None]) -> bool:
    """Whether a failure may have left a collective half-done on one rank.

    An invariant's AssertionError is raised after the example's collectives; an exception
    raised alike on every rank (a refusal) leaves none pending either. A timeout, or an
    exception on some ranks only, may have.
    """
    errors = [s for s in said if s is not None and "AssertionError" not in s]
    timed_out = any("imed out" in s or "timeout" in s.lower() for s in errors)
    return timed_out or 0 < len(errors) < len(said)


def run_group(name: str, info: distributed.DistInfo, pg: Any, specs: list[Any]) -> dict[str, Any]:
    """Run ``specs`` of group ``name`` on both ranks; collect the failing examples.

    Stops after ``MAX_FAILURES`` failures, or at the first exception that is not an
    invariant's AssertionError (it may have left a collective half-done on one rank).
    """
    check = GROUPS[name][2]
    records: list[Any] = []
    failures: list[dict[str, Any]] = []
    desync = False
    run = 0
    for spec in specs:
        run += 1
        try:
            record, outcome = check(spec, info), None
        except Exception:
            record, outcome = None, traceback.format_exc(limit=6)[-2500:]
        said = _agree(outcome, pg)
        if any(s is not None for s in said):
            desync = _maybe_desynced(said)
            failures.append({
                "spec": spec,
                "ranks": said,
                "replay": REPLAY.format(group=name, spec=json.dumps(spec)),
                "where": inv_budget.where(),
            })  # fmt: skip
            if desync or len(failures) >= MAX_FAILURES:
                break
        else:
            records.append(record)
    return {
        "examples": run, "drawn": len(specs), "failures": failures, "desync": desync,
        "records": records,
    }  # fmt: skip


def main() -> None:
    warnings.simplefilter("ignore")  # fp16 on a CPU warns once per step built: noise here
    out = Path(sys.argv[1])
    args = sys.argv[2:]
    replay = None
    if args[:1] == ["--replay"]:
        replay, args = (args[1], json.loads(args[2])), [args[1]]
    names = [g for g in GROUPS if g in args] if args else list(GROUPS)  # in GROUPS' order
    with distributed.setup(timeout=datetime.timedelta(seconds=60)) as info:
        assert info.world_size == 2, info
        pg = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=120))
        desynced = None
        for name in names:
            if desynced is not None:
                said = f"not run: group {desynced} failed with an exception first"
                result: dict[str, Any] = {
                    "examples": 0, "drawn": 0, "records": [], "desync": True,
                    "failures": [{"spec": None, "ranks": [said, said], "replay": "", "where": ""}],
                }  # fmt: skip
            else:
                if replay is not None:
                    specs = [replay[1]]
                else:
                    specs = EXPLICIT.get(name, []) + inv_budget.draw(*GROUPS[name][:2])
                result = run_group(name, info, pg, specs)
                if result["desync"]:
                    desynced = name
            torch.save(result, out / f"{name}.rank{info.rank}.pt")
            if replay is not None:
                said = [f["ranks"][info.rank] for f in result["failures"]]
                print(f"rank {info.rank}: {said[0] if said else 'passed'}", flush=True)
        dist.barrier(group=pg)


if __name__ == "__main__":
    main()
