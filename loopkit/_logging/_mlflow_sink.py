"""MLflowSink: metrics and parameters to an MLflow run (the ``mlflow`` extra)."""

from __future__ import annotations

import importlib
import time
from typing import Any

from ._tracker import Tracker


class MLflowSink(Tracker):
    """Log to an MLflow run through ``MlflowClient`` (no global active run is touched).

    ``experiment``: its name (created if missing); ``tracking_uri``: where the runs live (a
    server, ``sqlite:///mlflow.db``, or a directory: MLflow's file store then needs
    ``MLFLOW_ALLOW_FILE_STORE=true``); ``run_name``: the name of the run it creates. A
    resumed run continues the same run id; the points it already holds (the last step and
    how many points at it) are read back from its metric history and not logged again.
    """

    def __init__(
        self,
        experiment: str = "Default",
        *,
        tracking_uri: str | None = None,
        run_name: str | None = None,
    ) -> None:
        super().__init__()
        try:
            tracking = importlib.import_module("mlflow.tracking")
            self._entities = importlib.import_module("mlflow.entities")
        except ImportError as err:
            raise ImportError(
                "MLflowSink needs mlflow: pip install 'torch-loopkit[mlflow]'"
            ) from err
        self._client_type = tracking.MlflowClient
        self.experiment, self.tracking_uri, self.run_name = experiment, tracking_uri, run_name
        self.client: Any = None

    def _start(self, run_id: str | None) -> str:
        self.client = self._client_type(tracking_uri=self.tracking_uri)
        if run_id is not None:
            self.client.update_run(run_id, status="RUNNING")
            return run_id
        found = self.client.get_experiment_by_name(self.experiment)
        experiment_id = (
            found.experiment_id if found else self.client.create_experiment(self.experiment)
        )
        return str(self.client.create_run(experiment_id, run_name=self.run_name).info.run_id)

    def _write(self, values: dict[str, float], step: int) -> None:
        now = int(time.time() * 1000)
        metric = self._entities.Metric
        self.client.log_batch(
            self.run_id, metrics=[metric(k, float(v), now, step) for k, v in values.items()]
        )

    def _write_config(self, params: dict[str, Any]) -> None:
        param = self._entities.Param
        self.client.log_batch(self.run_id, params=[param(k, str(v)) for k, v in params.items()])

    def _held_through(self) -> tuple[int, int] | None:
        """The last step in the metric histories and the most points one metric has at it."""
        keys = self.client.get_run(self.run_id).data.metrics
        histories = [[m.step for m in self.client.get_metric_history(self.run_id, k)] for k in keys]
        steps = [s for h in histories for s in h]
        if not steps:
            return None
        last = max(steps)
        return last, max(h.count(last) for h in histories)

    def _finish(self) -> None:
        self.client.set_terminated(self.run_id)
