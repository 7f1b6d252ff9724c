"""Everything that runs next to one engine, built, started and stopped in one place.

The Celery worker (worker/celery_worker.py) and the embedded runtime (worker/embedded.py) both run exactly
these: the engine host, the job runner (which holds each queue to its max_running), the heartbeat, the
reconciler, the scheduler (scheduled jobs that became due), the webhook sender and the batch runner. They
differ only in where job ids come from (a broker consumer or in-process feeders), which they start after
`start()` and stop before `stop()`.

Stop order: the batch runner, the reconciler and the scheduler first (no new jobs, no re-publishing), then the
job runner (in-flight jobs finish within the grace period, the rest are requeued), then the webhook sender,
the heartbeat (the worker stays alive in the store while its jobs finish), and the engine last.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import datetime

from sqlalchemy.orm import Session, sessionmaker

from conveyor.core.background import BackgroundLoop
from conveyor.core.lanes import lane_of
from conveyor.core.protocol.model_limits import limits_beyond_model
from conveyor.core.seams.finish_notifications import FinishedSink
from conveyor.core.seams.token_stream import TokenSink
from conveyor.core.settings import Settings
from conveyor.core.store.tenants import TenantLimits
from conveyor.engine.host import EngineHost
from conveyor.worker.adapters import RuntimeAdapters, load_adapters
from conveyor.worker.batches.runner import BatchRunner, make_batch_runner
from conveyor.worker.engine_metrics import WorkerMetrics
from conveyor.worker.heartbeat import Heartbeat
from conveyor.worker.job_runner import JobRunner
from conveyor.worker.model import engine_config, resolve_model
from conveyor.worker.promoter import Promoter
from conveyor.worker.reconciler import Broker, Local, Reconciler
from conveyor.worker.webhooks.sender import WebhookSender

log = logging.getLogger(__name__)
LORA_PRUNE_S = 2.0  # how soon an adapter unloaded at run time leaves the engine (once no request holds it)


class WorkerServices:
    def __init__(self, settings: Settings, sessions: sessionmaker[Session], broker: Broker, worker_id: str,
                 *, tokens: TokenSink | None, republish_requeued: bool,
                 finished: FinishedSink | None = None, fleet_duties: bool = True) -> None:
        """`republish_requeued`: jobs requeued at shutdown are published again at once (Celery); embedded
        mode leaves them queued in the store for the next start. `finished` hears of every job this worker
        makes final (its outcomes, its reconciler's expiries), for the API's long polls. `fleet_duties`:
        run the reconciler, the webhook sender and the batch runner (one set per process is enough: the
        embedded runtime's other models run without them)."""
        self.settings = settings
        self.model_id = settings.served_model_id()
        # This worker's lanes (core/lanes.py): the queues it consumes, of its one model.
        self.lanes = {lane_of(self.model_id, name): queue
                      for name, queue in settings.consumed_queues().items()}
        self.worker_id = worker_id
        self._sessions = sessions
        self._broker = broker
        self._tokens = tokens
        self._finished = finished
        self._republish = republish_requeued
        self._fleet_duties = fleet_duties
        self._heartbeat = Heartbeat(sessions, worker_id, list(self.lanes),
                                    settings.worker_heartbeat_s, self._engine_pace)
        local = Local(worker_id, self._held_attempts, self._claims_since, self._runner_stopping)
        self._reconciler = Reconciler(sessions, broker, settings, local, finished=finished)
        self._promoter = Promoter(sessions, broker.publish, settings.schedule_poll_s)
        self._webhooks = WebhookSender(sessions, settings)
        self.metrics = WorkerMetrics()  # exists before the engine: the embedded API adds its registry early
        self._host: EngineHost | None = None
        self._runner: JobRunner | None = None
        self._lora_prune: BackgroundLoop | None = None  # drops adapters unloaded at run time
        self._batches: BatchRunner | None = None

    @property
    def host(self) -> EngineHost:
        assert self._host is not None, "WorkerServices.start() has not run"
        return self._host

    @property
    def runner(self) -> JobRunner:
        assert self._runner is not None, "WorkerServices.start() has not run"
        return self._runner

    def _engine_pace(self) -> dict[str, float] | None:
        """What the heartbeat publishes of the engine: its pace once it measured one (engine/pace.py: deadline
        forecasts read it), and its load now (KV blocks in use, running and waiting requests, preemptions
        so far: the console's workers page shows them); None before the engine is loaded."""
        if self._host is None:
            return None
        stats = self._host.stats()
        pace = stats.get("pace")
        published = dict(pace) if isinstance(pace, dict) and pace.get("step_s") else {}
        return {**published, **engine_load(stats)}

    def _held_attempts(self) -> set[tuple[str, int]]:
        return self._runner.held_attempts() if self._runner is not None else set()

    def _claims_since(self) -> datetime | None:
        return self._runner.claims_since() if self._runner is not None else None

    def _runner_stopping(self) -> bool:
        return self._runner is not None and self._runner.stopping()

    def start(self) -> None:
        """Loads the engine (once), then starts every service; job ids may flow in afterwards."""
        config = engine_config(self.settings, resolve_model(self.settings))
        log.info("loading engine for %s", config.model)
        self._host = EngineHost.from_config(config)
        load_adapters(self._host, self.settings)
        adapters = RuntimeAdapters(self._host, self._sessions, self.settings) if config.max_loras else None
        self._warn_limits_beyond_model(self._host.engine.max_model_len)
        self.metrics.attach(self._host, heartbeat_age_s=lambda: self._heartbeat.age_s())
        limits = {lane: queue.max_running for lane, queue in self.lanes.items()}
        self._runner = JobRunner(self._host, self._sessions, self.worker_id, limits=limits,
                                 cancel_poll_s=self.settings.cancel_poll_s, tokens=self._tokens,
                                 finished=self._finished,
                                 tenant_defaults=TenantLimits.defaults(self.settings), adapters=adapters,
                                 backoff=self.settings.retry_backoff())
        self._batches = make_batch_runner(self._sessions, self.settings, self._broker.publish, self.worker_id,
                                          self._host.tokenizer)
        self._heartbeat.start()
        self._runner.start()
        if adapters is not None:
            self._lora_prune = BackgroundLoop.every("lora-prune", LORA_PRUNE_S, adapters.prune)
            self._lora_prune.start()
        if self._fleet_duties:
            self._reconciler.start()
            self._promoter.start()
            self._webhooks.start()
            self._batches.start()

    def _warn_limits_beyond_model(self, max_model_len: int) -> None:
        """A warning for limits the operator set; the defaults' (sized for real models, beyond a small or
        demo model's context) only at INFO, since nobody chose them."""
        over = limits_beyond_model(self.settings.queues, max_model_len)
        if over:
            level = logging.WARNING if "queues" in self.settings.model_fields_set else logging.INFO
            log.log(level, "queue limits beyond what the model can run (max_model_len=%d; requests are "
                    "judged against it at submit and /v1/queues shows them clamped): %s", max_model_len,
                    ", ".join(over))

    def stop(self, grace_s: float | None = None, tick: Callable[[], None] | None = None) -> None:
        """Stops every service in the order of the module docstring. In-flight jobs get grace_s (default:
        worker_shutdown_grace_s) to finish; `tick` runs while waiting (the Celery consumer flushes acks)."""
        grace = self.settings.worker_shutdown_grace_s if grace_s is None else grace_s
        if self._batches is not None:
            self._batches.stop()
        self._reconciler.stop()
        self._promoter.stop()
        if self._runner is not None:
            self._runner.shutdown(grace, self._broker.publish if self._republish else None, tick)
        self._webhooks.stop()
        if self._lora_prune is not None:
            self._lora_prune.stop()
        self._heartbeat.stop()
        if self._host is not None:
            self._host.shutdown()
        log.info("worker %s stopped", self.worker_id)


def engine_load(stats: dict[str, object]) -> dict[str, float]:
    """The engine's load now, from EngineHost.stats(): the share of KV blocks in use, requests running and
    waiting (every class together), preemptions so far."""
    used, total = stats.get("kv_blocks_used"), stats.get("kv_blocks_total")
    running, waiting = stats.get("running"), stats.get("waiting")
    load: dict[str, float] = {}
    if isinstance(used, int) and isinstance(total, int) and total:
        load["kv_used"] = round(used / total, 4)
    if isinstance(running, dict) and isinstance(waiting, dict):
        load["running"] = float(sum(running.values()))
        load["waiting"] = float(sum(waiting.values()))
    preemptions = stats.get("preemptions_total")
    if isinstance(preemptions, int):
        load["preemptions"] = float(preemptions)
    return load
