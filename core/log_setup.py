"""Process-wide logging for the `conveyor` commands and `python -m worker`, from the settings."""

from __future__ import annotations

import logging

from core.settings import Settings

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure_logging(settings: Settings) -> None:
    logging.basicConfig(level=settings.log_level.upper(), format=LOG_FORMAT)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # request lines carry webhook URLs and tokens
