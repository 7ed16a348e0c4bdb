"""What Slurm's ``srun`` set: whether this process is a task of a step, its place, the first host.

Read by ``setup()`` when torchrun's variables are absent (torchrun's win: ``srun torchrun``
sets both). Pure: every function takes the environment as a mapping and starts nothing.

Which process is an srun task: Slurm sets ``SLURM_PROCID`` and ``SLURM_STEP_ID`` in every
task it starts (``slurmstepd``'s ``setup_env``), but a batch script and an interactive
``salloc`` step are tasks too, of steps with reserved numbers (batch 0xfffffffb, interactive
0xfffffffa, printed signed or not), and a plain ``salloc`` shell has neither variable while
its ``SLURM_NTASKS`` still says 4. So: a task of a real step (``SLURM_STEP_ID`` below
0xfffffff0) with more than one task (``SLURM_STEP_NUM_TASKS``, else ``SLURM_NTASKS``) is one
process of a job; every other process runs alone, whatever ``SLURM_NTASKS`` says.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping

_MAX_NORMAL_STEP = 0xFFFFFFF0  # slurm.h SLURM_MAX_NORMAL_STEP_ID: the ids above are special
_PORT_BASE, _PORT_SPAN = 15000, 17000  # 15000-31999: under Linux's ephemeral ports (32768-)
_RANGE = re.compile(r"(\d+)(?:-(\d+))?$")
_TASKS = re.compile(r"(\d+)(?:\(x(\d+)\))?$")


def hosts(nodelist: str) -> Iterator[str]:
    """The host names of a Slurm node list: ``"node[01-02,07],gpu5"`` -> node01, node02,
    node07, gpu5; several bracket groups multiply (``"r[1-2]n[1-2]"``: r1n1, r1n2, r2n1, r2n2).
    ValueError on an unbalanced bracket or a malformed range."""
    for item in _split_top(nodelist.strip()):
        if not item:
            raise ValueError(f"empty host name in node list {nodelist!r}")
        yield from _expand(item, nodelist)


def tasks_per_node(spec: str) -> list[int]:
    """Slurm's tasks per node, one entry per node: ``"2(x3),1"`` -> [2, 2, 2, 1]."""
    out: list[int] = []
    for part in spec.strip().split(","):
        m = _TASKS.match(part.strip())
        if m is None:
            raise ValueError(f"{spec!r} is not a list of tasks per node such as '2(x3),1'")
        out += [int(m[1])] * int(m[2] or 1)
    return out


def is_step_task(env: Mapping[str, str]) -> bool:
    """Whether this process is a task of a real srun step (not the batch script, not an
    interactive allocation's shell)."""
    step = env.get("SLURM_STEP_ID", env.get("SLURM_STEPID"))
    if "SLURM_PROCID" not in env or step is None:
        return False
    if not re.fullmatch(r"-?\d+", step.strip()):
        raise RuntimeError(f"SLURM_STEP_ID={step!r} is not a step number: check the launch")
    return 0 <= int(step) < _MAX_NORMAL_STEP


def srun_env(env: Mapping[str, str]) -> dict[str, str] | None:
    """torchrun's variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
    ``MASTER_ADDR``, ``MASTER_PORT``) for a task of an srun step of several tasks; None for
    every other process. RuntimeError when srun's variables are half-set or disagree."""
    if not is_step_task(env):
        return None
    world_var = "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in env else "SLURM_NTASKS"
    world = _count(env, world_var, "the step's number of tasks")
    if world <= 1:
        return None  # a one-task step (`srun --pty bash`, `srun -n1`) runs alone
    rank = _count(env, "SLURM_PROCID", "this task's rank")
    if rank >= world:
        raise RuntimeError(f"SLURM_PROCID={rank} is not below {world_var}={world}")
    local_rank = _count(env, "SLURM_LOCALID", "this task's rank on its node")
    local_world = _local_world(env)
    if local_rank >= local_world:
        raise RuntimeError(
            f"SLURM_LOCALID={local_rank} is not below the {local_world} tasks of this node "
            "(SLURM_STEP_TASKS_PER_NODE): the srun variables disagree"
        )
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(local_world),
        "MASTER_ADDR": env.get("MASTER_ADDR") or _first_host(env),
        "MASTER_PORT": env.get("MASTER_PORT") or str(_port(env)),
    }


def _count(env: Mapping[str, str], name: str, what: str) -> int:
    value = env.get(name)
    if value is None or not value.strip().isdigit():
        said = "missing" if value is None else f"{value!r}, not a non-negative integer"
        raise RuntimeError(
            f"this process is a task of an srun step (SLURM_PROCID and SLURM_STEP_ID are set) "
            f"but {name} ({what}) is {said}: launch it with srun, which sets them all, or "
            "unset SLURM_PROCID to run single-process"
        )
    return int(value)


def _local_world(env: Mapping[str, str]) -> int:
    """This node's number of tasks: the step's list, else the job's, else --ntasks-per-node."""
    for name in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        if env.get(name):
            try:
                counts = tasks_per_node(env[name])
            except ValueError as err:
                raise RuntimeError(f"{name}: {err}") from None
            if len(set(counts)) == 1:
                return counts[0]
            node = _count(env, "SLURM_NODEID", "this node's place in the step")
            if node >= len(counts):
                raise RuntimeError(f"SLURM_NODEID={node} but {name}={env[name]!r} lists "
                                   f"{len(counts)} nodes: the srun variables disagree")  # fmt: skip
            return counts[node]
    return _count(env, "SLURM_NTASKS_PER_NODE", "the tasks of each node")


def _first_host(env: Mapping[str, str]) -> str:
    """Rank 0's host: the step's first node (a step may use some of the job's nodes only)."""
    for name in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"):
        if env.get(name):
            try:
                return next(hosts(env[name]))
            except (ValueError, StopIteration) as err:
                raise RuntimeError(f"{name}={env[name]!r} is not a node list ({err}): set "
                                   "MASTER_ADDR to rank 0's host") from None  # fmt: skip
    raise RuntimeError(
        "an srun task without SLURM_STEP_NODELIST or SLURM_JOB_NODELIST: set MASTER_ADDR to "
        "rank 0's host"
    )


def _port(env: Mapping[str, str]) -> int:
    """The step's reserved port (``srun --resv-ports``), else one derived from the job and
    step ids: the same in every task, different for the steps of one job."""
    reserved = re.match(r"\d+", env.get("SLURM_STEP_RESV_PORTS", ""))
    if reserved:
        return int(reserved[0])
    job = env.get("SLURM_JOB_ID", env.get("SLURM_JOBID", ""))
    step = env.get("SLURM_STEP_ID", env.get("SLURM_STEPID", "0"))
    if not job.isdigit():
        raise RuntimeError(f"SLURM_JOB_ID={job!r} gives no port: set MASTER_PORT")
    return _PORT_BASE + (int(job) * 16 + int(step)) % _PORT_SPAN


def _split_top(text: str) -> list[str]:
    """Split at the commas outside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += (ch == "[") - (ch == "]")
        if depth not in (0, 1):
            raise ValueError(f"unbalanced brackets in node list {text!r}")
        if ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"unbalanced brackets in node list {text!r}")
    return [*parts, text[start:]]


def _expand(item: str, whole: str) -> Iterator[str]:
    """One host pattern: the first bracket group's values, each followed by the rest's."""
    open_at = item.find("[")
    if open_at < 0:
        if "]" in item:
            raise ValueError(f"unbalanced brackets in node list {whole!r}")
        yield item
        return
    close_at = item.index("]", open_at)
    head, tail = item[:open_at], item[close_at + 1 :]
    for part in item[open_at + 1 : close_at].split(","):
        m = _RANGE.match(part.strip())
        if m is None or (m[2] is not None and int(m[2]) < int(m[1])):
            raise ValueError(f"{part!r} is not a range such as 01-04 in node list {whole!r}")
        width = len(m[1])  # node[01-10]: the start's width keeps the zeros
        for n in range(int(m[1]), int(m[2] or m[1]) + 1):
            for rest in _expand(tail, whole):
                yield f"{head}{n:0{width}d}{rest}"
