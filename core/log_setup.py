"""Process-wide logging for the `conveyor` commands and `python -m conveyor.worker`, from the settings."""

from __future__ import annotations

import logging
from urllib.parse import urlsplit, urlunsplit

from conveyor.core.settings import Settings

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# Libraries that narrate their own start at INFO (alembic's plugin set-up and context lines on every start,
# Celery's "Connected to" and "ready"): Conveyor says what matters in its own lines, so these speak only
# from WARNING up, unless `conveyor --debug`.
CHATTY_AT_START = ("alembic", "celery")


def configure_logging(settings: Settings, *, debug: bool = False) -> None:
    logging.basicConfig(level=settings.log_level.upper(), format=LOG_FORMAT)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # request lines carry webhook URLs and tokens
    for name in CHATTY_AT_START:
        logging.getLogger(name).setLevel(logging.NOTSET if debug else logging.WARNING)


def masked_url(url: str) -> str:
    """The URL with its password replaced by ***: what a log line or an error message may show."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.netloc.rsplit("@", 1)[-1]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))
