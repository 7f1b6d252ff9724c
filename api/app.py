"""create_app: one FastAPI instance with its own settings, store, publisher, tokenizer and metrics."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Protocol, runtime_checkable

from fastapi import FastAPI
from prometheus_client import CollectorRegistry
from sqlalchemy.orm import Session, sessionmaker

from conveyor.api import console
from conveyor.api.admission import AdmissionGauge
from conveyor.api.deps import Services
from conveyor.api.errors import ApiError, install_error_handlers
from conveyor.api.host_check import HostCheck
from conveyor.api.metrics import Metrics
from conveyor.api.middleware import (
    AllowedMethods,
    BodySizeLimit,
    MetricsAuth,
    ResponseCounter,
    UnhandledErrors,
)
from conveyor.api.openapi_doc import install_truthful_openapi
from conveyor.api.prompt_tokenizer import PromptTokenizer
from conveyor.api.routes import (
    anthropic,
    batches,
    embeddings,
    files,
    health,
    jobs,
    lora,
    message_batches,
    openai,
    queues,
    responses,
    scaling,
    traces,
    vllm,
    webhooks,
)
from conveyor.api.served_models import ServedModels, store_adapters
from conveyor.api.uploads import UploadSizeLimit
from conveyor.core.seams.dispatch import DispatchRelay, JobPublisher
from conveyor.core.seams.finish_notifications import FinishedSink, FinishedWatch
from conveyor.core.seams.token_stream import TokenStream
from conveyor.core.settings import Settings
from conveyor.core.store.auth_listener import listener_for
from conveyor.core.store.database import make_db_engine, make_session_factory

log = logging.getLogger(__name__)


class Runtime(Protocol):
    """Something started and stopped with the app (the embedded worker runtime)."""

    def start(self) -> None: ...

    def stop(self) -> None: ...


@runtime_checkable
class MetricsSource(Protocol):
    """A runtime whose own metrics join the app's /metrics (the embedded worker's engine metrics)."""

    @property
    def metrics_registry(self) -> CollectorRegistry: ...


def create_app(
    settings: Settings,
    *,
    publisher: JobPublisher,
    tokenizer: PromptTokenizer | Mapping[str, PromptTokenizer],
    session_factory: sessionmaker[Session] | None = None,
    runtime: Runtime | None = None,
    token_stream: TokenStream | None = None,
    finished_watch: FinishedWatch | None = None,
    finished_sink: FinishedSink | None = None,
) -> FastAPI:
    """`tokenizer`: each served model's, by id (one alone: the only model's). `runtime` (the embedded
    worker) is started and stopped with the app, `finished_watch` closed with it.
    `finished_watch` wakes long polls and event streams when jobs finish (without one they read the store
    more often); `finished_sink` is told of the jobs the API itself finishes (cancel). Tables come from
    migrations."""
    owns_db_engine = session_factory is None
    if session_factory is None:
        session_factory = make_session_factory(make_db_engine(settings.database_url))
    metrics = Metrics(settings, session_factory,
                      extra=runtime.metrics_registry if isinstance(runtime, MetricsSource) else None)
    dispatcher = DispatchRelay(session_factory, publisher.publish)
    tokenizers = tokenizer if isinstance(tokenizer, Mapping) else {settings.default_model_id(): tokenizer}
    models = ServedModels(settings, tokenizers, runtime=store_adapters(session_factory))
    services = Services(settings, session_factory, publisher, models, metrics,
                        AdmissionGauge(), dispatcher, finished=finished_sink, finished_watch=finished_watch)

    auth_listener = listener_for(session_factory.kw["bind"], services.auth_cache)  # None: SQLite, or off

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        if auth_listener is not None:
            auth_listener.start()
        if runtime is not None:
            runtime.start()
        try:
            yield
        finally:
            if auth_listener is not None:
                auth_listener.stop()
            dispatcher.stop()  # what was accepted is published before the embedded worker stops
            if runtime is not None:
                runtime.stop()
            if finished_watch is not None:
                await finished_watch.aclose()
            if owns_db_engine:
                bind = session_factory.kw["bind"]
                bind.dispose()

    docs = bool(settings.docs_enabled)  # off: the three routes do not exist (404); app.openapi() still works
    app = FastAPI(
        title="Conveyor", version="0.1.0", lifespan=lifespan,
        description="A job queue for asynchronous LLM inference.",
        docs_url="/docs" if docs else None, redoc_url="/redoc" if docs else None,
        openapi_url="/openapi.json" if docs else None,
    )
    app.state.services = services
    install_error_handlers(app)
    install_truthful_openapi(app)
    app.state.token_stream = token_stream  # running jobs' text for streamed completions; None: store polls
    for router in (jobs.router, queues.router, health.router, webhooks.router, openai.router,
                   anthropic.router, embeddings.router, files.router, batches.router, scaling.router,
                   vllm.router, lora.router, responses.router, message_batches.router, traces.router):
        app.include_router(router)
    if settings.console_enabled:
        for console_router in console.ROUTERS:
            app.include_router(console_router)
        app.add_exception_handler(console.SignInRequired, console.to_sign_in)
        app.add_exception_handler(ApiError, console.api_error)  # pages under /console; JSON elsewhere
    else:
        app.include_router(console.OFF_ROUTER)
    # add_middleware wraps: the last one added runs first.
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_body_bytes,
                       larger=message_batches.body_caps(settings))
    app.add_middleware(UploadSizeLimit, max_bytes=settings.files_max_bytes)
    app.add_middleware(MetricsAuth, settings=settings)
    app.add_middleware(AllowedMethods, routes=app.router.routes)
    assert settings.allowed_hosts is not None, "Settings resolves the default names"
    app.add_middleware(HostCheck, allowed_hosts=settings.allowed_hosts)  # before anything reads the body
    app.add_middleware(ResponseCounter, metrics=metrics)  # outside the others: 401s, 405s, 413s are counted
    app.add_middleware(UnhandledErrors)  # outermost of ours: an exception anywhere below becomes our 500
    if settings.auth_enabled and settings.metrics_token is None:
        log.warning("authentication is on and CONVEYOR_METRICS_TOKEN is unset: /metrics answers 401")
    return app
