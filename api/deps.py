"""What routes depend on: the app's services and a database session per request."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy.orm import Session, sessionmaker
from starlette.concurrency import run_in_threadpool

from conveyor.api.admission import AdmissionGauge
from conveyor.api.job_reads import JobReads
from conveyor.api.metrics import Metrics
from conveyor.api.served_models import ServedModels
from conveyor.core.seams.dispatch import Dispatcher, JobPublisher
from conveyor.core.seams.finish_notifications import FinishedSink, FinishedWatch
from conveyor.core.settings import Settings
from conveyor.core.store.auth_cache import AuthCache
from conveyor.core.store.finish_times import QueueRates


@dataclass(frozen=True)
class Services:
    """Everything one app instance shares between requests; built once in create_app."""

    settings: Settings
    session_factory: sessionmaker[Session]
    publisher: JobPublisher
    models: ServedModels  # each served model's settings and tokenizer, by id
    metrics: Metrics
    admission: AdmissionGauge  # max_queued without a COUNT per submit
    dispatcher: Dispatcher  # the DispatchRelay: publishes committed jobs, in groups, off the request path
    finished: FinishedSink | None = None  # told when the API itself commits a final status (cancel)
    finished_watch: FinishedWatch | None = None  # wakes long polls and event streams; None: they poll
    queue_rates: QueueRates = field(default_factory=QueueRates)  # deadline forecasts without a sum per submit
    job_reads: JobReads = field(init=False)  # reads of single jobs asked for together share one query
    auth_cache: AuthCache = field(init=False)  # API keys and tenant limits, for at most auth_cache_s

    def __post_init__(self) -> None:
        object.__setattr__(self, "job_reads", JobReads(self.session_factory))  # frozen: set once, here
        object.__setattr__(self, "auth_cache", AuthCache.for_settings(self.settings))


def services_of(request: Request) -> Services:
    services: Services = request.app.state.services
    return services


async def get_services(request: Request) -> Services:
    """Async though it awaits nothing: FastAPI runs a plain `def` dependency in its thread pool, a hand-off
    per request for one attribute read."""
    return services_of(request)


async def get_session(request: Request) -> AsyncIterator[Session]:
    """A session for the route, made on the event loop: making one does no I/O, and a `def` dependency
    would cost two thread-pool hand-offs per request (enter and exit). Closing a session whose work was
    committed does no I/O either; one still in a transaction (a read, an error) rolls back in the pool."""
    session = services_of(request).session_factory()
    try:
        yield session
    finally:
        if session.in_transaction():
            await run_in_threadpool(session.close)
        else:
            session.close()


ServicesDep = Annotated[Services, Depends(get_services)]
SessionDep = Annotated[Session, Depends(get_session)]
