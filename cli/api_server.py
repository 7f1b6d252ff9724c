"""`conveyor api`: the HTTP API alone, publishing to the Celery broker, in one process or `api_workers`
processes sharing the port (uvicorn's workers).

Each process builds its own app: its own database pool and its own Redis subscriptions, so a long poll or a
streamed completion in any process is woken by a worker's notification (Redis pub/sub reaches every
subscriber), and a cancel in one process wakes the waiters of all. Admission estimates are per process
(api/admission.py: a queue may overshoot max_queued by what the other processes admitted within REFRESH_S).

Worker processes are started by uvicorn, which imports `app_from_environment`: they read the settings the
way the parent did, from the environment and the config file, with the command line's host, port and config
file passed down in the environment (`pass_down`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from conveyor.core.settings import CONFIG_FILE_ENV, Settings, load_settings

FACTORY = "conveyor.cli.api_server:app_from_environment"


def build_api_app(settings: Settings) -> tuple[Any, list[Any]]:
    """The app and what to close when the process ends (the Redis connection of the finished sink)."""
    from conveyor.api.app import create_app
    from conveyor.api.finish_subscriber import RedisFinishedWatch
    from conveyor.api.token_subscriptions import RedisTokenStream
    from conveyor.core.seams.broker import BrokerPublisher
    from conveyor.core.seams.finish_notifications import RedisFinishedSink

    broker = settings.broker_url or ""
    pubsub = broker.startswith("redis")  # without it, streamed completions and long polls read the store
    tokens = RedisTokenStream(broker) if pubsub else None
    watch = RedisFinishedWatch(broker) if pubsub else None
    finished = RedisFinishedSink(broker) if pubsub else None  # the API's cancel wakes every API's waiters
    application = create_app(settings, publisher=BrokerPublisher(settings),
                             tokenizer=load_tokenizers(settings), runtime=None,
                             token_stream=tokens, finished_watch=watch, finished_sink=finished)
    return application, [finished] if finished is not None else []


def load_tokenizers(settings: Settings) -> dict[str, Any]:
    """Each served model's tokenizer (api/prompt_tokenizer.py), by id, with its chat_template setting's
    template: the API judges each request with its own model's, rendered as its workers render it."""
    from conveyor.api.prompt_tokenizer import PromptTokenizer

    return {model_id: PromptTokenizer(model_settings.model_folder(), model_settings.chat_template_text())
            for model_id, model_settings in settings.served().items()}


def pass_down(config: Path | None, host: str | None, port: int | None, workers: int | None) -> None:
    """The command line's choices, in the environment uvicorn's worker processes inherit."""
    for name, value in ((CONFIG_FILE_ENV, config), ("CONVEYOR_HOST", host), ("CONVEYOR_PORT", port),
                        ("CONVEYOR_API_WORKERS", workers)):
        if value is not None:
            os.environ[name] = str(value)


def app_from_environment() -> Any:
    """uvicorn's factory in each worker process."""
    from conveyor.core.log_setup import configure_logging

    settings = load_settings()
    configure_logging(settings, debug=False)
    application, _closing = build_api_app(settings)  # closed with the process
    return application
