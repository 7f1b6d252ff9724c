"""The options of the commands that call a running service over HTTP: where it is and with which key."""

from __future__ import annotations

from typing import Annotated

import typer

DEFAULT_URL = "http://127.0.0.1:8000"
UrlOpt = Annotated[str, typer.Option("--url", envvar="CONVEYOR_URL", help="API base URL")]
KeyOpt = Annotated[str | None, typer.Option("--api-key", envvar="CONVEYOR_API_KEY", help="Bearer API key")]
AdminKeyOpt = Annotated[str | None, typer.Option("--api-key", envvar="CONVEYOR_API_KEY",
                                                 help="an admin API key, or the admin token")]
