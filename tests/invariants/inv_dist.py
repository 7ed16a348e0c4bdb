"""The 2-rank worker's results as the tests read them."""

from __future__ import annotations

from typing import Any


class DistResults:
    """What the 2-rank worker wrote for each group, or why it wrote nothing."""

    def __init__(self, found: dict[str, list[dict[str, Any]]], output: str) -> None:
        self.found, self.output = found, output

    def group(self, name: str) -> list[dict[str, Any]]:
        """Both ranks' results of group ``name``; fails with the worker's output if missing."""
        per_rank = self.found.get(name, [])
        assert len(per_rank) == 2, f"the 2-rank worker wrote no result for {name!r}:\n{self.output}"
        return per_rank

    def assert_passed(self, name: str) -> list[dict[str, Any]]:
        """Both ranks ran examples of group ``name`` and none failed; returns the results."""
        per_rank = self.group(name)
        for r in per_rank:
            assert r["examples"] > 0, f"group {name!r} ran no example"
            assert not r["failures"], describe(r)
        return per_rank


def describe(result: dict[str, Any]) -> str:
    """A worker group's failures: each example, each rank's message, how to replay it."""
    lines = [f"{len(result['failures'])} failing example(s) of {result['examples']} run"]
    for f in result["failures"]:
        lines.append(f"example: {f['spec']}  ({f['where']})")
        for rank, said in enumerate(f["ranks"]):
            if said is not None:
                lines.append(f"  rank {rank}: {said.strip().splitlines()[-1]}")
        lines.append(f"  replay: {f['replay']}")
    return "\n".join(lines)
