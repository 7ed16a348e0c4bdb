"""WandbSink: metrics and hyperparameters to a Weights & Biases run (the ``wandb`` extra)."""

from __future__ import annotations

import importlib
import math
import os
import time
from pathlib import Path
from typing import Any

from ._tracker import Tracker, held_in, read_record, write_record


class WandbSink(Tracker):
    """Log to a W&B run: ``wandb.init`` at the first write, ``run.log(values, step=)``.

    ``project``: the W&B project; other keywords go to ``wandb.init``. ``mode="offline"``
    writes the run under ``dir`` for a later ``wandb sync``. A resumed run
    continues the same run id (``resume="allow"``). The last step written, the points
    written at it and when the run last started are kept in
    ``<dir>/.loopkit-wandb-<id>.json``, so a run resumed after a kill -9 does not log again
    what the killed run already logged (W&B offline cannot tell). W&B keeps one history row
    per step: points logged at the same step are merged into it.

    W&B names a start's folder by its second and the run id (``offline-run-<time>-<id>``);
    wandb releases that do not add a suffix to a taken name (those before wandb PR 10511,
    2025) reuse the folder of a start in the same second and write over its data, so a
    resumed start waits for the next second when the run's last start was in this one.
    """

    def __init__(
        self,
        project: str | None = None,
        *,
        dir: str | os.PathLike[str] | None = None,  # wandb.init's own name
        mode: str | None = None,
        **init_kwargs: Any,
    ) -> None:
        super().__init__()
        try:
            self._wandb = importlib.import_module("wandb")
        except ImportError as err:
            raise ImportError("WandbSink needs wandb: pip install 'torch-loopkit[wandb]'") from err
        self.project, self.dir, self.mode, self.init_kwargs = project, dir, mode, init_kwargs
        self.run: Any = None
        self._record: dict[str, Any] = {}  # what the side-car file holds

    def _sidecar(self, run_id: str) -> Path:
        return Path(self.dir if self.dir is not None else ".") / f".loopkit-wandb-{run_id}.json"

    def _start(self, run_id: str | None) -> str:
        if run_id is not None:
            self._record = read_record(self._sidecar(run_id))
            started = self._record.get("started")
            now = time.time()
            if isinstance(started, (int, float)) and math.floor(now) == math.floor(started):
                # The last start of this run was in this second: the same folder name.
                time.sleep(math.floor(started) + 1 - now)
        self.run = self._wandb.init(
            project=self.project,
            dir=None if self.dir is None else os.fspath(self.dir),
            mode=self.mode,
            id=run_id,
            resume="allow" if run_id is not None else None,
            **self.init_kwargs,
        )
        # Read after init returned: no earlier than the second W&B named the folder by.
        self._record["started"] = time.time()
        run_id = str(self.run.id)
        write_record(self._sidecar(run_id), self._record)
        return run_id

    def _write(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def _wrote(self, step: int, count: int) -> None:
        assert self.run_id is not None  # started
        self._record.update(last_step=step, count=count)
        write_record(self._sidecar(self.run_id), self._record)

    def _write_config(self, params: dict[str, Any]) -> None:
        self.run.config.update(params)

    def _held_through(self) -> tuple[int, int] | int | None:
        return held_in(self._record)

    def _finish(self) -> None:
        self.run.finish()
