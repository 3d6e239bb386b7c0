"""Round metrics to an MLflow tracking server, through the `mlflow` client library (an optional extra:
`pip install 'fedlt[mlflow]'`). Named so as not to shadow the `mlflow` package.

A tracking server is a view of the run, never a condition of it: metrics leave from a thread of their own,
so a slow or unreachable server holds up no round. Rounds wait in memory, in order, until the server
answers (tried again at each new round, and every `RETRY_SECONDS`); an outage is logged once, and its end.
What is still unsent when the run closes is logged and left to metrics.json, which holds every round.

A run is found again by its key: a resumed simulator or a restarted aggregator goes on in the MLflow run it
logged to before, sends the rounds that run lacks (its `fedlt.last_step` tag says how far it got) and
never a step twice. A start without history (a new run folder or data directory) makes a new MLflow run.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("fedlt.telemetry")

INSTALL = "pip install 'fedlt[mlflow]'"
DEFAULT_EXPERIMENT = "fedlt"
RUN_KEY = "fedlt.run_key"
LAST_STEP = "fedlt.last_step"
BATCH = 999  # MLflow takes at most 1000 metrics and tags in one call; the last step's tag goes with them
RETRY_SECONDS = 60.0
CLOSE_SECONDS = 30.0


def installed() -> bool:
    return importlib.util.find_spec("mlflow") is not None


@dataclass(frozen=True)
class MlflowTarget:
    """`key`: what makes a run this run (its run folder, its data directory), kept hashed in a tag."""

    uri: str
    experiment: str
    run_name: str
    key: str

    @property
    def key_tag(self) -> str:
        return hashlib.sha256(self.key.encode()).hexdigest()[:32]


def target_from_environment(*, run_name: str, key: str) -> MlflowTarget | None:
    """The simulator's target, from MLflow's own variables: `MLFLOW_TRACKING_URI` (unset: no MLflow) and
    `MLFLOW_EXPERIMENT_NAME` (default "fedlt")."""
    uri = os.environ.get("MLFLOW_TRACKING_URI", "")
    if not uri:
        return None
    if not installed():
        log.warning(
            "MLFLOW_TRACKING_URI is set but the mlflow package is not installed (%s): not logged", INSTALL
        )
        return None
    experiment = os.environ.get("MLFLOW_EXPERIMENT_NAME") or DEFAULT_EXPERIMENT
    return MlflowTarget(uri, experiment, run_name, key)


class MlflowSink:
    """`history`: the steps the run recorded before this start, each with a maker of its scalars
    (`fedlt.telemetry.Past`), sent where the MLflow run lacks them. Its presence also says the run is
    resumed: without it a new MLflow run is made."""

    def __init__(
        self,
        target: MlflowTarget,
        *,
        history: Sequence[tuple[int, Callable[[], Mapping[str, float]]]],
        retry_seconds: float = RETRY_SECONDS,
        close_seconds: float = CLOSE_SECONDS,
    ) -> None:
        self.target = target
        self._resumed = bool(history)
        self._pending: deque[tuple[int, Callable[[], Mapping[str, float]]]] = deque(history)
        self._retry, self._close = retry_seconds, close_seconds
        self._changed = threading.Condition()
        self._news = bool(history)
        self._closing = False
        self._failing = False
        self._run_id: str | None = None
        self._last = -1  # the last step the MLflow run holds
        self._thread = threading.Thread(target=self._serve, name="mlflow", daemon=True)
        self._thread.start()

    def write(self, step: int, values: Mapping[str, float]) -> None:
        kept = dict(values)
        with self._changed:
            self._pending.append((step, lambda: kept))
            self._news = True
            self._changed.notify()

    def close(self) -> None:
        """Send what waits, for at most `close_seconds`; then say what was not sent."""
        with self._changed:
            self._closing = True
            self._changed.notify()
        self._thread.join(self._close)
        with self._changed:
            left = [step for step, _ in self._pending]
        if left:
            log.warning(
                "MLflow at %s did not take rounds %s before the run closed; metrics.json holds them",
                self.target.uri,
                ", ".join(map(str, left)),
            )

    def __str__(self) -> str:
        return f"MLflow at {self.target.uri}"

    def _serve(self) -> None:
        closing = False
        client = None
        while not closing:
            with self._changed:
                timeout = self._retry if self._pending else None
                self._changed.wait_for(lambda: self._news or self._closing, timeout=timeout)
                self._news, closing = False, self._closing
            try:
                client = client or _client(self.target.uri)
                self._send(client)
            except Exception as exc:  # whatever the server or the network did: the next try may go through
                if not self._failing:
                    log.warning(
                        "MLflow at %s: %s; rounds wait and are sent once it answers (the run goes on)",
                        self.target.uri,
                        exc,
                    )
                self._failing = True
                continue
            if self._failing:
                log.info("MLflow at %s answers again; the rounds that waited are sent", self.target.uri)
                self._failing = False
        if client is not None and self._run_id is not None and not self._pending:
            try:
                client.set_terminated(self._run_id)
            except Exception as exc:
                log.warning("MLflow at %s: the run could not be marked finished: %s", self.target.uri, exc)

    def _send(self, client: Any) -> None:
        if self._run_id is None:
            self._open(client)
        while True:
            with self._changed:
                if not self._pending:
                    return
                step, values = self._pending[0]
            if step > self._last:
                self._log(client, step, values())
                self._last = step
            with self._changed:
                self._pending.popleft()

    def _open(self, client: Any) -> None:
        """The MLflow run this run logs to: the newest one with its key if resumed, else a new one."""
        name = self.target.experiment
        experiment = client.get_experiment_by_name(name)
        experiment_id = experiment.experiment_id if experiment else client.create_experiment(name)
        found = []
        if self._resumed:
            found = client.search_runs(
                [experiment_id],
                filter_string=f"tags.`{RUN_KEY}` = '{self.target.key_tag}'",
                order_by=["attributes.start_time DESC"],
                max_results=1,
            )
        if found:
            run = found[0]
            self._last = int(run.data.tags.get(LAST_STEP, -1))
            client.update_run(run.info.run_id, status="RUNNING")
        else:
            run = client.create_run(
                experiment_id, run_name=self.target.run_name, tags={RUN_KEY: self.target.key_tag}
            )
        self._run_id = run.info.run_id

    def _log(self, client: Any, step: int, values: Mapping[str, float]) -> None:
        from mlflow.entities import Metric, RunTag

        now = int(time.time() * 1000)
        metrics = [Metric(tag, value, now, step) for tag, value in values.items()]
        chunks = [metrics[k : k + BATCH] for k in range(0, len(metrics), BATCH)] or [[]]
        for chunk in chunks[:-1]:
            client.log_batch(self._run_id, metrics=chunk)
        client.log_batch(self._run_id, metrics=chunks[-1], tags=[RunTag(LAST_STEP, str(step))])


def _client(uri: str) -> Any:
    from mlflow.tracking import MlflowClient  # about 1.5 s to import: on this thread, off the round's path

    return MlflowClient(tracking_uri=uri)
