"""CSVSink: one row per flush, in a CSV file (standard library only)."""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path
from typing import Any

from ._tracker import Tracker


class CSVSink(Tracker):
    """Write ``step`` and every metric (and the epoch/samples/tokens axes) as CSV rows.

    A metric that appears later adds a column: the file is rewritten once with the wider
    header (earlier rows get an empty cell). Hyperparameters go to ``<path>.config.json``.
    A resumed run appends to the same file, after the rows its checkpoint holds (the later
    ones are written again, as the uninterrupted run wrote them); a new run (no resume)
    starts it afresh. Several rows may share a step (a log that flushes more often than the
    step updates).
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        super().__init__()
        self.path = Path(path)
        self._columns: list[str] = []
        self._file: Any = None  # kept open for appending while the run lasts
        self._writer: Any = None

    def _start(self, run_id: str | None) -> str:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if run_id is not None and self.path.exists():
            with self.path.open(newline="") as f:
                self._columns = next(csv.reader(f), [])
            self._keep_held()
        else:
            self.path.write_text("")
            self._columns = []
        self._open()
        return str(self.path)

    def _keep_held(self) -> None:
        """Drop the rows past the position the checkpoint holds: the resumed run writes them
        again, as the uninterrupted run did (a killed run's rows, and a row a stopped run's
        ``close()`` flushed early from values the checkpoint still holds unflushed)."""
        with self.path.open(newline="") as f:
            rows = list(csv.DictReader(f))
        kept: list[dict[str, str]] = []
        at = 0
        for row in rows:
            step = int(row["step"]) if row.get("step") else None
            if step is None or self.last_step is None or step > self.last_step:
                break
            at = at + 1 if kept and kept[-1].get("step") == row["step"] else 1
            if step == self.last_step and self.last_count is not None and at > self.last_count:
                break
            kept.append(row)
        if len(kept) == len(rows):
            return
        tmp = self.path.with_name(self.path.name + ".tmp")
        with tmp.open("w", newline="") as f:
            writer = csv.DictWriter(f, self._columns)
            writer.writeheader()
            writer.writerows(kept)
        os.replace(tmp, self.path)

    def _open(self) -> None:
        self._file = self.path.open("a", newline="")
        self._writer = csv.DictWriter(self._file, self._columns) if self._columns else None

    def _write(self, values: dict[str, float], step: int) -> None:
        row = {"step": step, **values}
        if self._writer is None or not row.keys() <= set(self._columns):
            known = self._columns or ["step"]
            self._widen([*known, *(k for k in row if k not in known)])
        self._writer.writerow(row)
        self._file.flush()  # each row on disk as it comes (a killed run keeps its rows)

    def _widen(self, columns: list[str]) -> None:
        """Write the header (or rewrite the file under a wider one, atomically)."""
        self._file.close()
        rows: list[dict[str, str]] = []
        if self._columns:
            with self.path.open(newline="") as f:
                rows = list(csv.DictReader(f))
        tmp = self.path.with_name(self.path.name + ".tmp")
        with tmp.open("w", newline="") as f:
            writer = csv.DictWriter(f, columns)
            writer.writeheader()
            writer.writerows(rows)
        os.replace(tmp, self.path)
        self._columns = columns
        self._open()

    def _write_config(self, params: dict[str, Any]) -> None:
        target = self.path.with_name(self.path.name + ".config.json")
        saved = json.loads(target.read_text()) if target.exists() else {}
        target.write_text(json.dumps({**saved, **params}, indent=1, default=str))

    def _held_through(self) -> tuple[int, int] | None:
        """The last row's step and how many rows at its end have that step."""
        with self.path.open(newline="") as f:
            steps = [int(r["step"]) for r in csv.DictReader(f) if r.get("step")]
        if not steps:
            return None
        count = next((i for i, s in enumerate(reversed(steps)) if s != steps[-1]), len(steps))
        return steps[-1], count

    def _finish(self) -> None:
        self._file.close()

    def __repr__(self) -> str:
        return f"CSVSink({str(self.path)!r})"
