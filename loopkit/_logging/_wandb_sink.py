"""WandbSink: metrics and hyperparameters to a Weights & Biases run (the ``wandb`` extra)."""

from __future__ import annotations

import importlib
import json
import os
from pathlib import Path
from typing import Any

from ._tracker import Tracker


class WandbSink(Tracker):
    """Log to a W&B run: ``wandb.init`` at the first write, ``run.log(values, step=)``.

    ``mode="offline"`` writes the run under ``dir`` for a later ``wandb sync``. A resumed run
    continues the same run id (``resume="allow"``). The last step written is kept in
    ``<dir>/.loopkit-wandb-<id>.json``, so a run resumed after a kill -9 does not log again
    what the killed run already logged (W&B offline cannot tell).
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

    def _sidecar(self, run_id: str) -> Path:
        return Path(self.dir if self.dir is not None else ".") / f".loopkit-wandb-{run_id}.json"

    def _start(self, run_id: str | None) -> str:
        self.run = self._wandb.init(
            project=self.project,
            dir=None if self.dir is None else os.fspath(self.dir),
            mode=self.mode,
            id=run_id,
            resume="allow" if run_id is not None else None,
            **self.init_kwargs,
        )
        return str(self.run.id)

    def _write(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)
        assert self.run_id is not None  # started
        side = self._sidecar(self.run_id)
        tmp = side.with_name(side.name + ".tmp")
        tmp.write_text(json.dumps({"last_step": step}))
        os.replace(tmp, side)

    def _write_config(self, params: dict[str, Any]) -> None:
        self.run.config.update(params)

    def _held_through(self) -> int | None:
        assert self.run_id is not None
        side = self._sidecar(self.run_id)
        return int(json.loads(side.read_text())["last_step"]) if side.exists() else None

    def _finish(self) -> None:
        self.run.finish()
